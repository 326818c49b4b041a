"""Reading the files the agent's user writes in its directory, for the verbs that show them, whoever runs them.

Runs on: both sides: ``meridian-node status`` and ``meridian-node gpu-health`` read the agent's ``status.json``,
``applied.json``, ``oplog.jsonl`` and ``identity/node.pem``, as the agent's user or as root.

Root treats the agent as compromised (docs/SECURITY.md): it owns ``<state_dir>`` and may put anything at those
names, a FIFO (a plain ``open`` waits for a writer forever), a symlink to ``/dev/zero`` (read until memory runs
out) or to a file only root may read (shown to whoever asked), or a hard link to such a file. So, as
``root_side.root_dir`` reads the apply request, every read here (and any caller's: the same rules for all):

- opens each directory below ``state_dir`` relative to the one before it, with ``O_NOFOLLOW``; ``state_dir``
  itself is the config's, root's word, and is followed;
- reads the file with ``_fileutil.read_capped``: ``O_NONBLOCK | O_NOFOLLOW``, a regular file by ``fstat`` of
  what was opened, at most ``max_bytes`` (or the last ``max_bytes`` of an append-only log);
- refuses a file with more than one link, or owned by anyone but the owner of its directory (or root).

A symlink is followed only where the caller allows it (``links``: the identity's ``node.pem`` ->
``current/node.pem``, ``current`` -> ``versions/<name>``) and only down: a relative target of plain names, no
``..``, each name then opened as above. What is shown from these files must still be escaped
(``meridian_node_agent.terminal_text``): a regular file may hold escape sequences.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    CappedReadReason,
    file_kind,
    read_capped,
)
from meridian_node_agent.boundary.directories import BoundaryError

__all__ = ["STATUS_FILE", "STATUS_MAX_BYTES", "read_agent_document", "read_agent_file"]

# The agent's status document, in its state_dir (agent_side.status_file writes it; ``status``, ``gpu-health`` and a
# restarted agent's counters read it), and a cap on a read of it: far above what it holds, far below harm.
STATUS_FILE = "status.json"
STATUS_MAX_BYTES = 4 * 1024 * 1024

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 8
_PLANTED = "the agent writes no such thing there: look at what is there, and at who put it there"


def read_agent_file(
    state_dir: Path,
    relative: str,
    *,
    max_bytes: int,
    what: str,
    tail: bool = False,
    links: bool = False,
) -> bytes | None:
    """The bytes of ``<state_dir>/<relative>``; None when it, or a directory on the way, does not exist.

    ``BoundaryError``, one line naming the path, why and what to do, for a symlink, anything but a regular file,
    a file with other links or another owner, or one of more than ``max_bytes`` (with ``tail``, its last
    ``max_bytes`` are read instead). ``links`` follows relative symlinks that only go down (the identity's).
    """
    state_dir = Path(state_dir)
    try:
        directory = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BoundaryError(f"cannot open the agent's directory {state_dir}: {exc.strerror or exc}") from exc
    names = list(PurePosixPath(relative).parts)
    where, followed = state_dir, 0
    try:
        while names:
            name = names.pop(0)
            path = where / name
            try:
                if not names:
                    return _read(directory, name, path, max_bytes=max_bytes, what=what, tail=tail)
                below = os.open(name, _DIRECTORY, dir_fd=directory)
            except (FileNotFoundError, CappedFileMissingError):
                return None
            except (OSError, CappedReadError) as exc:
                if not _is_symlink(exc, directory, name):
                    raise _refused(path, exc, directory, name) from exc
                if not links or followed == _MAX_LINKS:
                    raise BoundaryError(f"refusing {path}: it is a symlink; {_PLANTED}") from exc
                # The link's own names take its place, read from the same directory, each one as carefully.
                names[:0] = _downward(os.readlink(name, dir_fd=directory), path)
                followed += 1
                continue
            os.close(directory)
            directory, where = below, path
        raise BoundaryError(f"refusing {state_dir / relative}: it names no file")
    finally:
        os.close(directory)


def read_agent_document(state_dir: Path, relative: str, *, max_bytes: int, what: str) -> dict[str, Any] | None:
    """The JSON object in ``<state_dir>/<relative>`` (``read_agent_file``'s rules); None when there is none, or
    what is there is not a JSON object (a report such as status.json: no report, as when none was written)."""
    raw = read_agent_file(state_dir, relative, max_bytes=max_bytes, what=what)
    try:
        document: Any = None if raw is None else json.loads(raw)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def _read(directory: int, name: str, path: Path, *, max_bytes: int, what: str, tail: bool) -> bytes:
    owner = os.fstat(directory).st_uid

    def check(info: os.stat_result) -> None:
        if info.st_nlink != 1:
            raise BoundaryError(
                f"refusing {path}: it has {info.st_nlink} hard links, so it is also some other file, perhaps one "
                f"the agent may not read itself; {_PLANTED}"
            )
        # Root's own file there (an agent run as root by mistake) is root's to read; the agent cannot make one.
        if info.st_uid not in (owner, 0):
            raise BoundaryError(
                f"refusing {path}: it is owned by uid {info.st_uid}, neither by uid {owner} who owns {path.parent} "
                f"nor by root; {_PLANTED}"
            )

    return read_capped(name, max_bytes, what=what, dir_fd=directory, check=check, tail=tail)


def _is_symlink(exc: OSError | CappedReadError, directory: int, name: str) -> bool:
    if isinstance(exc, CappedReadError):
        return exc.reason is CappedReadReason.SYMLINK
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return False
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=directory).st_mode)
    except OSError:
        return False


def _refused(path: Path, exc: OSError | CappedReadError, directory: int, name: str) -> BoundaryError:
    if isinstance(exc, CappedReadError):
        if exc.reason is CappedReadReason.TOO_LARGE:
            return BoundaryError(f"refusing {path}: {exc.detail}; the agent never writes one this large: look at it")
        if exc.reason is CappedReadReason.NOT_REGULAR:
            return BoundaryError(f"refusing {path}: {exc.detail}; {_PLANTED}")
        return BoundaryError(f"cannot read {path}: {exc.detail}")
    if exc.errno == errno.ENOTDIR:
        try:
            kind = file_kind(os.lstat(name, dir_fd=directory).st_mode)
        except OSError:
            kind = "not a directory"
        return BoundaryError(f"refusing {path}: it is a {kind}, not a directory; {_PLANTED}")
    return BoundaryError(f"cannot read {path}: {exc.strerror or exc}")


def _downward(target: str, link: Path) -> list[str]:
    """The names of a symlink's target, when it is relative and goes only down; ``BoundaryError`` otherwise."""
    parts = PurePosixPath(target).parts
    if not parts or target.startswith("/") or any(part in (".", "..") for part in target.split("/")):
        raise BoundaryError(
            f"refusing {link}: it is a symlink to {target!r}, and only a relative link that stays below its own "
            f"directory is followed here; {_PLANTED}"
        )
    return list(parts)

"""The root side's file rules: read the one file the agent hands over, keep everything else in root's own
directory.

Runs on: the root side only (``meridian-node apply-spooled``, started by ``meridian-node-apply.path``).

The agent is treated as compromised. It owns ``<state_dir>`` and can rename, replace or re-point anything
in it at any moment, so root reads exactly one file there, the request, and nothing else:

- every component below the agent's directory is opened relative to the one before it with
  ``O_NOFOLLOW`` (a symlinked ``spool`` or request is refused, and a rename between checks cannot move
  root elsewhere: it holds the directory it checked, not a name);
- the request must be a regular file (a FIFO or a device would block root or feed it endless bytes; it is
  opened ``O_NONBLOCK`` so the open itself cannot hang), with one link (a hard link to a file the agent
  may not read would make root read it for the agent), owned by the owner of the spool directory, and at
  most ``MAX_REQUEST_BYTES``; it is read once, into memory (``_fileutil.read_capped``, with these checks).

Root's own directory (``apply.state_dir``, the unit's ``StateDirectory=``) holds its record, journal, runs,
operation log, draining marks and Ansible's home. It must be root's (the euid's), not writable by group or
others, not a symlink, not inside the agent's directory, and so must every directory above it (a
directory another user may write lets that user swap root's directory out). Its mode is 0711: the agent
may reach ``public/`` (0750, group of the agent's directory) and ``draining/`` by name, and list nothing else.

Two root units use that directory: the apply unit, and the observe unit (``root_side.observe_unit``) that rewrites
``public/engines.json`` on a timer. ``apply_lock`` keeps them apart: an apply holds it for its whole run, and
the observe unit does nothing while it is held (the apply rewrites the file itself when it answers, and a
listing taken in the middle of a replace would show the agent a half-done state).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    CappedReadReason,
    file_kind,
    read_capped,
)
from ansible_collections.meridian.node.plugins.module_utils._lockfile import open_private_lock
from meridian_node_agent.boundary.directories import BoundaryError
from meridian_node_agent.boundary.spool import (
    MAX_REQUEST_BYTES,
    PUBLIC_DIR,
    REQUEST_FILE,
    SPOOL_DIR,
    ApplyRequest,
    parse_request,
)

__all__ = [
    "LOCK_FILE",
    "PUBLIC_MODE",
    "ROOT_DIR_MODE",
    "RootDir",
    "apply_lock",
    "prepare_root_dir",
    "read_request",
]

ROOT_DIR_MODE = 0o711
# Group-readable by the agent's group. Not setgid (RestrictSUIDSGID= forbids it): each file written there
# is given the group itself, before it is renamed into place (``RootDir.group``).
PUBLIC_MODE = 0o750
_PRIVATE_MODE = 0o700
LOCK_FILE = "apply.lock"


def read_request(agent_dir: Path) -> ApplyRequest | None:
    """The request in ``<agent_dir>/spool``, or None when there is none; anything unsafe or malformed raises."""
    raw = _read_agent_file(Path(agent_dir), SPOOL_DIR, REQUEST_FILE)
    if raw is None:
        return None
    return parse_request(raw, Path(agent_dir) / SPOOL_DIR / REQUEST_FILE)


def _read_agent_file(agent_dir: Path, subdir: str, name: str) -> bytes | None:
    path = agent_dir / subdir / name
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        base = os.open(agent_dir, flags | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BoundaryError(f"cannot open the agent's directory {agent_dir}: {_why(exc)}") from exc
    try:
        try:
            spool = os.open(subdir, flags | os.O_DIRECTORY, dir_fd=base)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BoundaryError(
                f"refusing {agent_dir / subdir}: {_why(exc, subdir, base)}; it must be a plain directory"
            ) from exc
        try:
            owner = os.fstat(spool).st_uid

            def check(info: os.stat_result) -> None:
                if info.st_nlink != 1:
                    raise BoundaryError(
                        f"refusing {path}: it has {info.st_nlink} hard links; the agent writes it by renaming a new "
                        "file into place, so another link means it names some other file"
                    )
                if info.st_uid != owner:
                    raise BoundaryError(
                        f"refusing {path}: it is owned by uid {info.st_uid}, not by uid {owner} who owns {path.parent}"
                    )

            # Relative to the spool it checked, without following a symlink or blocking on a FIFO.
            return read_capped(name, MAX_REQUEST_BYTES, what="the apply request", dir_fd=spool, check=check)
        except CappedFileMissingError:
            return None
        except CappedReadError as exc:
            if exc.reason is CappedReadReason.TOO_LARGE:
                raise BoundaryError(f"refusing {path}: more than {MAX_REQUEST_BYTES} bytes") from exc
            fix = "" if exc.reason is CappedReadReason.NOT_REGULAR else "; it must be a regular file"
            raise BoundaryError(f"refusing {path}: {exc.detail}{fix}") from exc
        finally:
            os.close(spool)
    finally:
        os.close(base)


@dataclass(frozen=True)
class RootDir:
    """Root's own directory, checked; the paths in it, and the agent's group, which may read ``public/``."""

    path: Path
    group: int = -1  # -1: leave files with root's group (the agent's directory is missing)

    @property
    def public(self) -> Path:
        return self.path / PUBLIC_DIR

    @property
    def journal(self) -> Path:
        return self.path / "journal"

    @property
    def runs(self) -> Path:
        return self.path / "runs"


def prepare_root_dir(path: Path, *, agent_dir: Path) -> RootDir:
    """Check (creating it if missing) root's directory and its ``public/``; raise ``BoundaryError`` if unsafe."""
    path = Path(path).absolute()
    real = path.resolve()
    if real != path:
        raise BoundaryError(f"refusing apply.state_dir {path}: it resolves to {real}; name the real directory")
    agent_real = str(Path(agent_dir).resolve())
    if os.path.commonpath([agent_real, str(real)]) in (agent_real, str(real)):
        raise BoundaryError(
            f"refusing apply.state_dir {path}: it overlaps the agent's directory {agent_real}, whose owner can "
            "rename anything in it"
        )
    for ancestor in reversed(path.parents):
        _check_owned(ancestor, allow_sticky=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(ROOT_DIR_MODE)
    _check_owned(path, allow_sticky=False)
    path.chmod(ROOT_DIR_MODE)
    for private in ("journal", "runs"):
        _private_dir(path / private)
    public = path / PUBLIC_DIR
    with contextlib.suppress(FileExistsError):
        public.mkdir(PUBLIC_MODE)
    _check_owned(public, allow_sticky=False)
    agent = Path(agent_dir)
    group = agent.stat().st_gid if agent.is_dir() else os.getegid()
    info = public.lstat()
    if info.st_gid != group:
        os.chown(public, -1, group, follow_symlinks=False)
    if stat.S_IMODE(info.st_mode) != PUBLIC_MODE:
        public.chmod(PUBLIC_MODE)
    return RootDir(path, group)


@contextlib.contextmanager
def apply_lock(root: RootDir, *, wait: bool) -> Iterator[bool]:
    """Hold ``<apply.state_dir>/apply.lock`` (``flock``, released when the block ends or the process dies).

    Yields True once held; with ``wait=False``, yields False at once when another root unit holds it. The
    file is root's, 0600, in root's checked directory (0711), replaced if found open to others
    (``_lockfile.open_private_lock``): the agent can neither create nor hold it, so it cannot keep root's observe
    unit from running or make an apply wait. Only root's units hold it, each within its unit's timeout, so
    ``wait=True`` waits for the other unit's run to end.
    """
    fd = open_private_lock(root.path / LOCK_FILE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _private_dir(path: Path) -> None:
    with contextlib.suppress(FileExistsError):
        path.mkdir(_PRIVATE_MODE)
    _check_owned(path, allow_sticky=False)
    if stat.S_IMODE(path.lstat().st_mode) != _PRIVATE_MODE:
        path.chmod(_PRIVATE_MODE)


def _check_owned(path: Path, *, allow_sticky: bool) -> None:
    # Called before every chmod/chown here: they follow symlinks, and this refuses anything but a directory.
    try:
        info = path.lstat()
    except OSError as exc:
        raise BoundaryError(f"cannot check {path}: {_why(exc)}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise BoundaryError(
            f"refusing {path}: it is a {file_kind(info.st_mode)}; root keeps its state in directories it owns"
        )
    euid = os.geteuid()
    if info.st_uid not in (0, euid):
        raise BoundaryError(
            f"refusing {path}: it is owned by uid {info.st_uid}, who could replace what root keeps below it; "
            f"chown root {path}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not (allow_sticky and mode & stat.S_ISVTX):
        raise BoundaryError(
            f"refusing {path}: mode {mode:04o} lets others write in it, so they could replace what root keeps "
            f"below it; chmod go-w {path}"
        )


def _why(exc: OSError, name: str | None = None, dir_fd: int | None = None) -> str:
    """Why an open failed, in words; ``name`` and ``dir_fd`` let it say what is there instead."""
    if name is not None and exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
        with contextlib.suppress(OSError):
            return f"it is a {file_kind(os.lstat(name, dir_fd=dir_fd).st_mode)}"
    if exc.errno == errno.ELOOP:
        return "it is a symlink"
    if exc.errno == errno.ENOTDIR:
        return "it is not a directory"
    return exc.strerror or str(exc)

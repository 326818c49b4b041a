"""Small files, written durably and read with a cap.

``atomic_write``: a reader sees the old content or the new content, never a torn mix. Used wherever a
half-written file would be dangerous: the applied-state record (rollback protection), the artifact store,
the agent's spool.

``create_exclusive``: a file created once and never replaced (a private key): written in full to a temporary
file, then hard-linked into place, so nobody sees a half-written file and a concurrent creator keeps its own.

``read_capped``: the one way a small file (a mark, a policy, an envelope, a file the other side of the
privilege boundary wrote) is read. It is opened without following a symlink (unless asked to), without
blocking (a FIFO cannot hang the reader), refused unless it is a regular file, and never read past the
cap; every refusal is a ``CappedReadError`` whose ``reason`` says which, and whose message names the file
and what to do. ``read_if_present`` is ``read_capped`` for a file that may not exist yet.

``read_json_record``, ``write_json_record``, ``remove_json_record``: the host's small public JSON records (the
cordon, the draining marks) that root writes and the unprivileged agent reads, each failure raised as the
caller's own error with its fix.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "CappedFileMissingError",
    "CappedReadError",
    "CappedReadReason",
    "atomic_write",
    "create_exclusive",
    "file_kind",
    "fsync_directory",
    "read_capped",
    "read_if_present",
    "read_json_record",
    "remove_json_record",
    "write_json_record",
]


def fsync_directory(path: os.PathLike[str] | str) -> None:
    """Flush a directory entry change (a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: os.PathLike[str] | str, data: bytes, mode: int = 0o600, group: int = -1) -> None:
    """Replace ``path`` with ``data`` atomically and durably; ``group`` (a gid) is set before the rename.

    The temporary file lives in the destination's directory because ``os.replace`` is only atomic within
    one filesystem. File data is fsynced before the rename and the directory after it, so after a crash
    the name points at complete old or complete new content. The temporary file is removed on any error.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        try:
            # mkstemp creates 0600; set the requested mode before any data is in the file.
            os.fchmod(fd, mode)
            if group != -1:
                os.fchown(fd, -1, group)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_directory(directory)


def create_exclusive(path: os.PathLike[str] | str, data: bytes, mode: int = 0o600) -> bool:
    """Create ``path`` (``mode``) holding ``data`` unless the name exists; True when this call created it.

    The bytes go to a temporary file in the same directory, fsynced, and are hard-linked into place:
    ``link`` refuses to replace an existing name, so of two processes creating the same file at once the
    loser keeps the winner's file, and nobody ever sees a half-written one. Unlike ``atomic_write``, an
    existing file is never replaced (a certificate may already be bound to a key). The temporary file is
    removed in every case.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, target)
        except FileExistsError:
            return False
        fsync_directory(directory)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


class CappedReadReason(str, enum.Enum):
    """Why ``read_capped`` refused a file; the value is the short code callers may report."""

    MISSING = "missing"
    UNREADABLE = "unreadable"
    SYMLINK = "symlink"
    NOT_REGULAR = "not-regular"
    TOO_LARGE = "too-large"


_FIXES = {
    CappedReadReason.MISSING: "check the path",
    CappedReadReason.UNREADABLE: "check the path and the file's permissions",
    CappedReadReason.SYMLINK: "symlinks are not followed here: put the file itself there",
    CappedReadReason.NOT_REGULAR: "put a regular file there",
    CappedReadReason.TOO_LARGE: "check that it is the right file",
}


class CappedReadError(MeridianError):
    """``read_capped`` refused a file: ``reason`` (a ``CappedReadReason``) says why, ``detail`` says it in
    words (the OS's text for an OS error), ``errno`` is the OS error number where there is one (``EISDIR``
    for a directory, as ``open()`` reports it), ``path`` and ``what`` name the file."""

    def __init__(
        self,
        reason: CappedReadReason,
        *,
        what: str,
        path: str,
        detail: str,
        error_number: int | None = None,
    ) -> None:
        super().__init__(f"cannot read {what} {path}: {detail}; {_FIXES[reason]}")
        self.reason = reason
        self.what = what
        self.path = path
        self.detail = detail
        self.errno = error_number


class CappedFileMissingError(CappedReadError):
    """The file does not exist (``reason`` is ``MISSING``): for many callers, "there is none yet"."""


def read_capped(
    path: os.PathLike[str] | str,
    max_bytes: int,
    *,
    what: str,
    nofollow: bool = True,
    dir_fd: int | None = None,
    check: Callable[[os.stat_result], None] | None = None,
    tail: bool = False,
) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them; ``CappedReadError`` otherwise.

    ``what`` names the file for people (``"draining mark"``). The file is opened ``O_NONBLOCK`` (a FIFO
    cannot hang the open) and, unless ``nofollow`` is false, ``O_NOFOLLOW``: a symlink is refused, not
    followed. Keep ``nofollow`` for anything in a directory someone else may write; pass False only for a
    path a person named (a policy, a command line's file). Anything but a regular file is refused after
    the open, by ``fstat`` of what was opened, so a swap between a check and the open cannot slip past.
    A file larger than ``max_bytes`` is refused by its size before any byte is read, and, should it grow
    while being read, after ``max_bytes + 1`` bytes at most. ``dir_fd`` opens ``path`` relative to that
    directory (``os.open``'s meaning). ``check`` is called with the regular file's status before anything
    is read; what it raises propagates (root's checks of link count and owner). With ``tail``, a larger file
    is not refused: its last ``max_bytes`` bytes are returned (an append-only log read from its end; the first
    line may be cut), and bytes appended while it is read are not.
    """
    name = os.fspath(path)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    if nofollow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise _open_refusal(exc, name, what=what, nofollow=nofollow, dir_fd=dir_fd) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CappedReadError(
                CappedReadReason.NOT_REGULAR,
                what=what,
                path=name,
                detail=f"it is a {file_kind(info.st_mode)}, not a regular file",
                error_number=errno.EISDIR if stat.S_ISDIR(info.st_mode) else None,
            )
        if check is not None:
            check(info)
        if info.st_size > max_bytes:
            if not tail:
                raise _too_large(name, max_bytes, what=what)
            os.lseek(fd, info.st_size - max_bytes, os.SEEK_SET)
        chunks: list[bytes] = []
        left = max_bytes if tail else max_bytes + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1024 * 1024))
            except OSError as exc:
                raise CappedReadError(
                    CappedReadReason.UNREADABLE,
                    what=what,
                    path=name,
                    detail=exc.strerror or str(exc),
                    error_number=exc.errno,
                ) from exc
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise _too_large(name, max_bytes, what=what)
    return data


def read_if_present(
    path: os.PathLike[str] | str, max_bytes: int, *, what: str, error: Callable[[str], Exception]
) -> bytes | None:
    """``read_capped`` of ``path`` (never through a symlink), or None while it does not exist.

    Any other refusal (a symlink, not a regular file, larger than ``max_bytes``) is raised as ``error`` called
    with ``read_capped``'s message, which names the file and the reason: the caller's own error type, so its
    callers catch one family. What an absent file means is the caller's to say.
    """
    try:
        return read_capped(path, max_bytes, what=what)
    except CappedFileMissingError:
        return None
    except CappedReadError as exc:
        raise error(str(exc)) from exc


def _too_large(name: str, max_bytes: int, *, what: str) -> CappedReadError:
    return CappedReadError(
        CappedReadReason.TOO_LARGE, what=what, path=name, detail=f"it is larger than {max_bytes} bytes"
    )


def _open_refusal(exc: OSError, name: str, *, what: str, nofollow: bool, dir_fd: int | None) -> CappedReadError:
    """The refusal for a failed open: a missing file, a symlink (``ELOOP`` under ``O_NOFOLLOW``), a socket
    (``ENXIO``), or the OS's own reason. What is there is looked at (``lstat``) only to say it in words."""
    if exc.errno == errno.ENOENT:
        return CappedFileMissingError(
            CappedReadReason.MISSING, what=what, path=name, detail=exc.strerror or str(exc), error_number=exc.errno
        )
    if exc.errno in (errno.ELOOP, errno.ENXIO):
        try:
            mode = os.lstat(name, dir_fd=dir_fd).st_mode
        except OSError:
            mode = None
        if mode is not None and stat.S_ISLNK(mode) and nofollow:
            return CappedReadError(
                CappedReadReason.SYMLINK, what=what, path=name, detail="it is a symlink", error_number=exc.errno
            )
        if mode is not None and not stat.S_ISLNK(mode) and not stat.S_ISREG(mode):
            return CappedReadError(
                CappedReadReason.NOT_REGULAR,
                what=what,
                path=name,
                detail=f"it is a {file_kind(mode)}, not a regular file",
                error_number=exc.errno,
            )
    return CappedReadError(
        CappedReadReason.UNREADABLE, what=what, path=name, detail=exc.strerror or str(exc), error_number=exc.errno
    )


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words: ``symlink``, ``FIFO``, ``socket``, ``device``, ``directory``, ..."""
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISDIR(mode):
        return "directory"
    return "regular file" if stat.S_ISREG(mode) else "special file"


def read_json_record(
    path: str, max_bytes: int, *, what: str, fix: str, error: Callable[[str], Exception]
) -> dict[str, Any] | None:
    """The JSON object in the small file ``path`` (read with ``read_capped``), or None when there is no file.

    A refused read, a file that is not JSON, or JSON that is not an object raises ``error(message)``, the
    message naming the file (``what``: "draining mark") and ending in ``fix`` ("remove it or run undrain").
    """
    data = read_if_present(path, max_bytes, what=what, error=lambda message: error(f"{message}; {fix}"))
    if data is None:
        return None
    try:
        document: Any = json.loads(data)
    except ValueError as exc:
        raise error(f"{what} {path} is not JSON ({exc}); {fix}") from exc
    if not isinstance(document, dict):
        kind = "null" if document is None else type(document).__name__
        raise error(f"{what} {path} must be an object, not a JSON {kind}; {fix}")
    return document


def write_json_record(path: str, document: dict[str, Any], *, what: str, error: Callable[[str], Exception]) -> None:
    """Write ``document`` to ``path`` as one line of sorted JSON, atomically and world-readable (0644: the agent
    runs unprivileged), making its directory (0755) where missing; a failure raises ``error`` naming the file."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        atomic_write(path, json.dumps(document, sort_keys=True).encode("utf-8") + b"\n", mode=0o644)
    except OSError as exc:
        raise error(f"cannot write {what} {path}: {exc.strerror or exc}") from exc


def remove_json_record(path: str, *, what: str, error: Callable[[str], Exception]) -> bool:
    """Remove ``path`` durably (its directory flushed); False when there was none. A failure raises ``error``."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise error(f"cannot remove {what} {path}: {exc.strerror or exc}") from exc
    fsync_directory(os.path.dirname(path))
    return True

"""Lock files that only their creator can hold, taken within a bounded wait.

``flock`` needs nothing more than an open descriptor, read-only will do: a lock file another user can open
is a lock that user can hold, for as long as they like. Root's directory is 0711, so any file in it whose
mode lets others read it can be opened by name and held by the agent's user. Hence:

- a lock file is opened ``O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK`` with mode 0600, and must
  then be a regular file the effective uid owns, with no group or other bits and one link. One that is not
  (an older release created some 0644) is never used: a fresh 0600 file is created under a temporary name
  and renamed over it, so a descriptor someone already holds on the old inode locks nothing used here;
- once the lock is taken, the file it was taken on must still be the one the name points at (another
  process may have replaced it meanwhile); otherwise it is taken again on the new file;
- a lock that is not free within ``wait_s`` raises ``LockTimeout``, naming the file and what to do:
  never a silent skip, never a wait without end.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = ["LOCK_MODE", "LOCK_WAIT_S", "LockError", "LockTimeout", "hold_fd", "hold_lock", "open_private_lock"]

LOCK_MODE = 0o600
# How long root waits for one of its locks before it reports the lock busy. Root's own holders keep them for
# a pass over the inbox or one read-modify-write of the record (milliseconds to a few seconds; an apply holds
# none of them while ansible-runner runs); far longer means a stuck or hostile holder.
LOCK_WAIT_S = 30.0
_POLL_S = 0.05
_ATTEMPTS = 5


class LockError(MeridianError, OSError):
    """A lock file cannot be made safe to use (a directory in its place, a read-only filesystem...)."""


class LockTimeout(MeridianError, RuntimeError):
    """The lock was held by someone else for longer than the wait allowed; the message says what to do."""

    def __init__(self, path: str, waited_s: float, what: str) -> None:
        self.path = path
        self.waited_s = waited_s
        super().__init__(
            f"{what} ({path}) is busy: another process held it for longer than {waited_s:g} s. Only this node's "
            f"own root units take it, each for seconds; find the holder with 'fuser -v {path}' (or "
            f"'lsof {path}'), and if it is not a meridian-node root unit that is still working, stop it. "
            "Nothing was changed; run again once it is free"
        )


def open_private_lock(path: os.PathLike[str] | str) -> int:
    """A descriptor on ``path``: a regular file, the euid's, mode 0600, one link; anything else is replaced."""
    target = os.fspath(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    for _attempt in range(_ATTEMPTS):
        try:
            fd = os.open(target, flags, LOCK_MODE)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO):
                raise LockError(exc.errno, f"cannot open the lock file {target}: {exc.strerror or exc}") from exc
            _replace(target, "it is a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc)))
            continue
        problem = _problem(os.fstat(fd))
        if problem is None:
            return fd
        os.close(fd)
        _replace(target, problem)
    raise LockError(errno.EAGAIN, f"the lock file {target} kept being replaced while it was opened; run again")


def hold_fd(
    path: os.PathLike[str] | str,
    *,
    wait_s: float,
    what: str,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The descriptor of ``path`` with ``LOCK_EX`` held (closing it releases the lock); ``LockTimeout`` after
    ``wait_s`` of finding it held."""
    target = os.fspath(path)
    deadline = monotonic() + wait_s
    while True:
        fd = open_private_lock(target)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            left_s = deadline - monotonic()
            if left_s <= 0:
                raise LockTimeout(target, wait_s, what) from None
            sleep(min(_POLL_S, left_s))
            continue
        except BaseException:
            os.close(fd)
            raise
        held = os.fstat(fd)
        try:
            named = os.lstat(target)
        except FileNotFoundError:
            named = None
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return fd
        # Replaced (or removed) between our open and our lock: a lock on that inode guards nothing.
        os.close(fd)


@contextlib.contextmanager
def hold_lock(
    path: os.PathLike[str] | str,
    *,
    wait_s: float = LOCK_WAIT_S,
    what: str = "the lock",
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[int]:
    """Hold ``path``'s lock for the block (see ``hold_fd``); yields the descriptor."""
    fd = hold_fd(path, wait_s=wait_s, what=what, monotonic=monotonic, sleep=sleep)
    try:
        yield fd
    finally:
        os.close(fd)  # closing releases the lock


def _problem(info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by uid {os.geteuid()} who locks it"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return f"its mode {mode:04o} lets other users open it, and so hold its lock (an older release made it so)"
    if info.st_nlink != 1:
        return f"it has {info.st_nlink} hard links"
    return None


def _replace(target: str, why: str) -> None:
    directory = os.path.dirname(os.path.abspath(target))
    # mkstemp opens O_CREAT | O_EXCL (and O_NOFOLLOW), mode 0600: nobody else ever had this inode open.
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".new")
    try:
        try:
            os.fchmod(fd, LOCK_MODE)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise LockError(
            exc.errno,
            f"the lock file {target} cannot be used ({why}) and cannot be replaced: {exc.strerror or exc}; "
            f"remove it (as root) and run again",
        ) from exc

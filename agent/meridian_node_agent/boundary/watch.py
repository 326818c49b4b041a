"""Waiting for the other side's files: inotify on a directory, through libc (no third-party package).

Runs on: both sides. The agent waits on root's ``public/`` for an answer (``SystemdApplier``), root's inbox
unit on the inbox for a bundle still being written; both fall back to a short sleep where inotify is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DirectoryWatch", "watch_directory"]

# Even with inotify, look again this often: an event lost to a replaced directory must not cost a timeout.
_BACKSTOP_S = 5.0
# Without inotify (not Linux), or before root's public directory exists, this is the re-check interval.
_FALLBACK_S = 0.5


# Waiting for the answer: inotify on root's public directory, through libc (no third-party package).

# Answers arrive by rename (IN_MOVED_TO); IN_CLOSE_WRITE covers a hand-written file.
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080


class DirectoryWatch:
    """Wakes ``wait`` when something is written or renamed into a directory; falls back to a short sleep.

    A directory that does not exist yet (root's ``public/`` before its first run) is watched as soon as
    it appears: each fallback sleep tries again.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fd: int | None = None
        self._start()

    def _start(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        mask = _IN_CLOSE_WRITE | _IN_MOVED_TO
        if libc.inotify_add_watch(fd, os.fsencode(self.directory), mask) < 0:
            os.close(fd)
            return
        self.fd = fd

    def wait(self, timeout_s: float, *, interrupt: int | None = None) -> None:
        """Until something arrives or ``timeout_s``; at once when ``interrupt`` (a stopping agent's pipe) is
        readable, so a stop never waits out an answer."""
        if timeout_s <= 0:
            return
        others = [] if interrupt is None else [interrupt]
        if self.fd is None:
            if others:
                select.select(others, [], [], min(timeout_s, _FALLBACK_S))
            else:
                time.sleep(min(timeout_s, _FALLBACK_S))
            self._start()
            return
        ready, _, _ = select.select([self.fd, *others], [], [], min(timeout_s, _BACKSTOP_S))
        if self.fd in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.fd, 65536):
                    pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def watch_directory(directory: Path) -> Iterator[DirectoryWatch]:
    """Watch ``directory`` for files written or renamed into it; start watching *before* looking."""
    watch = DirectoryWatch(directory)
    try:
        yield watch
    finally:
        watch.close()

"""Stopping ``meridian-node run`` on SIGTERM and SIGINT: one flag the signal sets, one pipe every wait watches.

Runs on: the agent side (``meridian-node run``, online and air-gapped).

Why a pipe and not a ``threading.Event``: a Python signal handler runs in the main thread between two bytecodes,
possibly while that same thread holds the event's lock inside ``Event.wait``; ``Event.set`` from the handler would
then wait for itself. Writing one byte to a pipe takes no lock. Every wait of the run loop (the pause between
cycles, a backoff, the long-poll's socket read, the wait for root's answer, the inbox watch) selects on the pipe's
read end too, and a byte in it stays there: each later wait returns at once.

The handlers must be the agent's for the whole run. ansible-runner's ``run`` installs its own SIGTERM and SIGINT
handlers (they only set a cancel flag nobody else reads) unless it is given a ``cancel_callback``; the in-process
``Applier`` is given ``is_stopping`` as that callback, so ansible-runner leaves these in place and kills the playbook
when the agent stops (docs/SUPERVISION.md, "Stopping").

Exit status of a stopped agent: 0 for SIGTERM (``systemctl stop`` asked for it: a clean stop), 130 for SIGINT (the
shell's convention for Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignal"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_EXIT_STATUS = {"SIGTERM": 0, "SIGINT": 130}


class StopSignal:
    """Set once by SIGTERM or SIGINT (or ``stop``); ``wait`` is a sleep that a stop ends at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def stopping(self) -> bool:
        return self.reason is not None

    def is_stopping(self) -> bool:
        """``stopping`` as a callable: ansible-runner's ``cancel_callback``."""
        return self.reason is not None

    @property
    def exit_status(self) -> int:
        """What ``meridian-node run`` exits with after this stop: 0 for SIGTERM, 130 for SIGINT."""
        return _EXIT_STATUS.get(self.reason or "", 0)

    def fileno(self) -> int:
        """The read end: readable from the stop on, for ``select`` beside a socket or an inotify descriptor."""
        return self._read

    def stop(self, reason: str) -> None:
        """Ask the agent to stop; the first reason is kept. Safe in a signal handler: no lock, one write."""
        if self.reason is None:
            self.reason = reason
        # A full pipe already wakes every wait: the byte is not needed then.
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, b"s")

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until the stop; True when stopping."""
        if self.reason is None and seconds > 0:
            # PEP 475: a signal interrupts select, runs the handler (which writes the byte), and select goes on
            # with what is left of the timeout; the byte then ends it.
            select.select([self._read], [], [], seconds)
        return self.stopping

    def install(self) -> StopSignal:
        """Take SIGTERM and SIGINT (main thread only, as for any handler); ``restore`` gives them back."""
        for number in STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def restore(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def close(self) -> None:
        self.restore()
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.stop(signal.Signals(number).name)

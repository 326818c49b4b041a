"""Ending a child process that tests and benchmarks started: asked first, killed if it does not listen."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

__all__ = ["stop_process"]


def stop_process(
    process: subprocess.Popen[Any], *, sig: signal.Signals = signal.SIGTERM, grace_s: float = 15.0
) -> None:
    """Send ``sig`` to ``process`` unless it has exited, give it ``grace_s`` to exit, then SIGKILL and reap it.

    The signal first, so that the process ends as it would under an operator (a devserver closes its store,
    the agent finishes its cycle); the kill only bounds how long a hung one keeps the caller waiting. Reaping
    (a bounded wait after the kill too) leaves no zombie behind.
    """
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=15)

"""Calls released at the same moment, each on a thread of its own: how a test races two writers, two openers or two
enrollments against one store and then looks at what each got.

``at_once(calls)`` starts one thread per call, holds them at a barrier until every one has started, lets them go
together and returns what each call returned, in the order given. An exception raised by a call is raised here (the
first one, in that order) once every call has ended, so that a test fails on the writer's own error rather than on
an empty result. ``timeout_s`` bounds the whole race: a liveness guard, never a timing assertion.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["at_once"]

T = TypeVar("T")


def at_once(calls: Sequence[Callable[[], T]], *, timeout_s: float = 120) -> list[T]:
    """What each of ``calls`` returned, all of them run at once on threads of their own (see the module doc)."""
    start = threading.Barrier(len(calls))

    def released(call: Callable[[], T]) -> T:
        start.wait(timeout=timeout_s)
        return call()

    pool = ThreadPoolExecutor(len(calls), thread_name_prefix="at-once")
    try:
        futures = [pool.submit(released, call) for call in calls]
        _done, pending = wait(futures, timeout=timeout_s)
        assert not pending, f"{len(pending)} of {len(calls)} calls run at once had not ended after {timeout_s:g} s"
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)

"""Long-polls parked on the event loop until their node's desired state changes: no request polls anything.

A waiting ``GET /v1/nodes/{node_id}/desired-state?wait=N`` parks under its node (``park``) for as long as it lasts,
and sleeps on its ``ParkedRequest`` between its looks at the cache (the state, the certificate's record). Two calls
reach it, from whichever thread learnt of the change (the ``ChangeWatcher``'s, or the loop's own for an in-process
verb), after ``NodeStateCache`` holds the change:

* ``wake(node_id)``: a new state was published, or the node's certificate records were dropped (a revocation, a
  re-enrollment). Its parked requests look again, and every look checks the request's certificate first: a revoked
  one gets, at once, the 403 a new request gets. A parked request must never outlive its certificate (one that did
  was answered with the next state published to its node, secrets included, while new requests were refused).
* ``end(node_id)``: the node's epoch moved up (a fence). Its parked requests are woken and marked ``ended``: they
  answer at once with what is current (a 304 if unchanged), so that the node heartbeats and learns its epoch,
  instead of parking again.

A parked request therefore costs a dict entry and a future, and the work a change causes is proportional to the
requests waiting on that node, never to all the requests waiting (before: every waiting request read the database's
change marker every 50 ms, ~200,000 reads/s at 10,000 nodes).

The order that makes a change impossible to miss: park first, then read the cache (the state, the certificate's
record), then sleep. A change that lands after the read wakes the request parked before it; one that landed before
the read is in what was read (a fence before the park came before the request began to wait: it answers as any
request after the fence does). The request stays parked from its first read to its answer, through every look at
the cache, so an ``end`` that comes while it is between two sleeps is kept in ``ended`` and not lost with a wake-up
nobody was sleeping on (``rearm`` clears the wake-up, never the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable

__all__ = ["DesiredStateWaiters", "ParkedRequest"]


class ParkedRequest:
    """One waiting request of ``node_id``, parked until its answer (``DesiredStateWaiters.park``/``unpark``).

    ``woken``: a new state or an end came since the last ``rearm``; ``ended``: an end came since it parked (it stays
    set). Both are set on the event loop, by ``DesiredStateWaiters``.
    """

    __slots__ = ("_loop", "_signal", "ended", "node_id")

    def __init__(self, node_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.node_id = node_id
        self.ended = False
        self._loop = loop
        self._signal: asyncio.Future[None] = loop.create_future()

    @property
    def woken(self) -> bool:
        return self._signal.done()

    def rearm(self) -> None:
        """Forget a wake-up before looking at the cache again (what woke it is in what it reads next)."""
        if self._signal.done():
            self._signal = self._loop.create_future()

    async def sleep(self, timeout_s: float, disconnected: Awaitable[object]) -> bool:
        """Until woken or ended, ``timeout_s`` has passed or ``disconnected`` completes; False if the client left."""
        gone: asyncio.Future[object] = asyncio.ensure_future(disconnected)
        try:
            await asyncio.wait((self._signal, gone), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return not gone.done()
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gone

    def _wake(self, *, end: bool) -> None:
        if end:
            self.ended = True
        if not self._signal.done():
            self._signal.set_result(None)


class DesiredStateWaiters:
    """Parked requests per node, woken by ``wake`` and ended by ``end``. ``park``/``unpark`` (and the request's
    ``sleep``) run on the event loop; ``wake`` and ``end`` on any thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._waiting: dict[str, set[ParkedRequest]] = {}

    @property
    def count(self) -> int:
        """How many requests are parked now (for tests and logs)."""
        with self._lock:
            return sum(len(parked) for parked in self._waiting.values())

    def park(self, node_id: str) -> ParkedRequest:
        loop = asyncio.get_running_loop()
        parked = ParkedRequest(node_id, loop)
        with self._lock:
            self._loop = loop
            self._waiting.setdefault(node_id, set()).add(parked)
        return parked

    def unpark(self, parked: ParkedRequest) -> None:
        with self._lock:
            requests = self._waiting.get(parked.node_id)
            if requests is not None:
                requests.discard(parked)
                if not requests:
                    del self._waiting[parked.node_id]

    def wake(self, node_id: str) -> None:
        """What ``node_id``'s parked requests answer with may have changed (a new state, dropped certificate records,
        already in the cache): they look again."""
        self._schedule(node_id, end=False)

    def end(self, node_id: str) -> None:
        """``node_id``'s epoch moved up (and the cache holds it): its parked requests stop waiting and answer as a new
        request would."""
        self._schedule(node_id, end=True)

    def _schedule(self, node_id: str, *, end: bool) -> None:
        with self._lock:
            loop = self._loop
            waiting = node_id in self._waiting
        # Nobody parked: a request that parks later reads the cache after the change was put there.
        if loop is None or not waiting:
            return
        # RuntimeError: the loop has closed (the server is stopping): nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._resolve, node_id, end)

    def _resolve(self, node_id: str, end: bool) -> None:
        with self._lock:
            requests = list(self._waiting.get(node_id, ()))
        for parked in requests:
            parked._wake(end=end)

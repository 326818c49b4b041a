"""Long-polls parked on the event loop until their node's desired state changes: no request polls anything.

A waiting ``GET /v1/nodes/{node_id}/desired-state?wait=N`` registers a future under its node and sleeps on it.
``wake(node_id)`` is called, from whichever thread learnt of the change (the ``ChangeWatcher``'s, or the loop's own
for an in-process publish), after the new state is in ``NodeStateCache``; it resolves that node's futures and no
other's. A parked request therefore costs a dict entry and a future, and the work a change causes is proportional
to the requests waiting on that node, never to all the requests waiting (before: every waiting request read the
database's change marker every 50 ms, ~200,000 reads/s at 10,000 nodes).

The order that makes a wake impossible to miss: register first, then read the cache, then sleep. A change that
lands after the read resolves the future registered before it; one that landed before the read is in what was read.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable

__all__ = ["DesiredStateWaiters"]


class DesiredStateWaiters:
    """Futures per node, resolved by ``wake``. ``register``/``discard``/``sleep`` run on the event loop; ``wake`` on
    any thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}

    @property
    def count(self) -> int:
        """How many requests are parked now (for tests and logs)."""
        with self._lock:
            return sum(len(futures) for futures in self._waiting.values())

    def register(self, node_id: str) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._loop = loop
            self._waiting.setdefault(node_id, set()).add(future)
        return future

    def discard(self, node_id: str, future: asyncio.Future[None]) -> None:
        with self._lock:
            futures = self._waiting.get(node_id)
            if futures is not None:
                futures.discard(future)
                if not futures:
                    del self._waiting[node_id]
        future.cancel()

    async def sleep(self, future: asyncio.Future[None], timeout_s: float, disconnected: Awaitable[object]) -> bool:
        """Until ``future`` is resolved, ``timeout_s`` has passed or ``disconnected`` completes; False if the client
        left."""
        gone: asyncio.Future[object] = asyncio.ensure_future(disconnected)
        try:
            await asyncio.wait((future, gone), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return not gone.done()
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gone

    def wake(self, node_id: str) -> None:
        with self._lock:
            loop = self._loop
            waiting = node_id in self._waiting
        if loop is None or not waiting:
            return
        # RuntimeError: the loop has closed (the server is stopping): nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._resolve, node_id)

    def _resolve(self, node_id: str) -> None:
        with self._lock:
            futures = self._waiting.pop(node_id, set())
        for future in futures:
            if not future.done():
                future.set_result(None)

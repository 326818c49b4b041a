"""The one thread per server that keeps its memory in step with the database.

It takes the changes other processes announce (``store/change_feed.py``: NOTIFY on PostgreSQL, the change log beside
a SQLite file) and re-reads each changed node into ``NodeStateCache``, which wakes the long-polls waiting on that
node. Waiting requests do no database work of their own; a change costs one statement per node it touched,
whatever the number of waiting requests.

The backstop: every ``backstop_s`` (2 s) the watcher asks the store for the nodes changed since the highest change
it has seen (``Database.nodes_changed_since``: one statement, an index range on ``nodes.change_seq``, usually
empty) and compares those (``NodeStateCache.refresh``). It is what bounds how stale a server's memory can be when
an announcement is lost (a writer that died between its commit and its announcement, a NOTIFY that never came).
When the feed itself says announcements may be lost (a dropped LISTEN connection, a truncated change log: ``take``
returns None), every node is compared at once (``refresh_all``), as at start.

Why not compare every node every 2 s, as this did before: with 5,000 nodes that is 55 ms of Python on an idle
server, and under a fleet's load it held the GIL against the event loop for 80-700 ms every 2 s, the largest
stalls the fleet saw (measured with bench/fleet.py; docs/SCALE.md).

``catch_up`` is the per-request half, for SQLite: a request whose ``behind()`` check (one ``stat(2)``) sees an
announcement not yet read applies it before answering, so the CLI's ``revoke``, ``fence`` and ``publish`` apply to
the very next request. On PostgreSQL the listener applies a change about a round trip after its commit; the
documented bound for replicas is the backstop's 2 s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from meridian_node_agent.devserver.serving.state_cache import NodeStateCache
from meridian_node_agent.devserver.store.change_feed import ChangeFeed
from meridian_node_agent.devserver.store.database import Database

__all__ = ["BACKSTOP_S", "ChangeWatcher"]

_log = logging.getLogger(__name__)

BACKSTOP_S = 2.0
# How long one wait for announcements lasts: also how long ``close`` may wait for the thread.
_WAIT_S = 0.25


class ChangeWatcher:
    """Applies ``feed``'s announcements to ``cache`` on a thread of its own (see the module doc).

    ``clock``: a monotonic clock in seconds (tests step the backstop with their own).
    """

    def __init__(
        self,
        store: Database,
        feed: ChangeFeed,
        cache: NodeStateCache,
        *,
        backstop_s: float = BACKSTOP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._feed = feed
        self._cache = cache
        self.backstop_s = backstop_s
        self._clock = clock
        self._apply_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0  # the highest nodes.change_seq applied
        self._next_backstop = 0.0
        self.applied = 0  # changes applied so far (tests wait on it)
        self.full_refreshes = 0

    def start(self, *, thread: bool = True) -> None:
        """Listen, read every node once, then (with ``thread``) watch on a thread. Without it a test steps the
        watcher itself (``step``)."""
        self._feed.listen()
        self.refresh_all()
        self._next_backstop = self._clock() + self.backstop_s
        if thread:
            self._thread = threading.Thread(target=self._run, name="devserver-change-watcher", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - the database is down or refused: the next step tries again
                _log.warning("could not apply the database's changes, retrying: %s", exc)
                self._stop.wait(_WAIT_S)

    def step(self, timeout_s: float) -> None:
        """Apply what is announced within ``timeout_s``, then run the backstop if it is due."""
        self._feed.wait(timeout_s)
        self.catch_up()
        if self._clock() >= self._next_backstop:
            self.backstop()

    def behind(self) -> bool:
        """Whether an announcement waits that a request should see applied first (one stat(2) on SQLite)."""
        return self._feed.behind()

    def catch_up(self) -> None:
        """Apply what has been announced and not yet applied (a request's thread calls it when ``behind``).

        Taking and applying happen under one lock: a request that finds nothing left to take knows that what was
        taken before it has been applied.
        """
        with self._apply_lock:
            changes = self._feed.take()
            if changes is None:
                self._refresh_all_locked()
                return
            for change in dict.fromkeys(changes):  # one re-read per node and kind, however often it was announced
                self._cache.apply(change)
            self.applied += len(changes)

    def backstop(self) -> None:
        """Compare the nodes changed since the highest change seen (one statement; usually none)."""
        self._next_backstop = self._clock() + self.backstop_s
        changed = self._store.nodes_changed_since(self._seq)
        if changed:
            with self._apply_lock:
                self._cache.refresh(changed)
                self._seq = max(self._seq, *(node.change_seq for node in changed))

    def refresh_all(self) -> None:
        with self._apply_lock:
            self._refresh_all_locked()

    def _refresh_all_locked(self) -> None:
        # The sequence first: a change committed after it is stamped above it, and the next backstop sees that.
        seq = self._store.last_change_seq()
        self._cache.refresh_all()
        self._seq = max(self._seq, seq)
        self.full_refreshes += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._feed.close()

"""Observations written by one thread in batches: the last body per node wins, the POST answers once it is stored.

``POST /observations`` used to be a fenced upsert in a transaction of its own, on the event loop. Here the handler,
after the epoch check against the cache, puts the observation into its node's slot and waits; one writer thread
takes every slot and writes them with one ``Database.record_observations`` call (one transaction: the nodes'
epochs read share-locked, then one ``executemany`` of the fenced upsert), then answers every waiting POST. This is
group commit: an idle server writes a lone observation at once (no added latency), a busy one writes whatever
arrived during the previous flush as the next batch, so the batch grows with the load and the transactions per
second do not.

Per node the last write wins: a second observation of a node that arrives before the first is written replaces it
in the slot, and both POSTs get the slot's outcome (the node's latest report is what the control plane keeps; the
earlier one would have been replaced a moment later anyway).

Why the POST waits for the commit instead of answering at once: a 204 then means "stored", so a server killed
mid-flush (SIGKILL, power) loses only observations it never acknowledged. Their POSTs fail as a transfer failure,
which the agent retries with backoff, on whichever replica answers; nothing acknowledged is lost, and no agent
needs to re-post on a timer to repair a loss it was never told of. The cost is the wait: at most the flush in
progress plus this one (a few ms for a batch of tens on SQLite).

The database re-checks the epoch in the upsert (``record_observations``' fence): a row whose epoch another process
moved since the handler's check (a ``fence`` that raced it, announced to this server a moment later) is not
written, and its POSTs are told so (``False``), which the handler turns into a 409 after reading the node's epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from meridian_node_agent.devserver.store.database import Database, ObservationWrite

__all__ = ["ObservationWriter"]

_log = logging.getLogger(__name__)


@dataclass
class _Slot:
    row: ObservationWrite
    waiting: list[asyncio.Future[bool]] = field(default_factory=list)


class ObservationWriter:
    """Per-node slots and the thread that flushes them (see the module doc).

    ``write`` runs on the event loop; ``flush`` on the writer thread or, when the thread is not started (tests that
    step it), on any thread. ``on_flushed`` is called after each batch that wrote something.
    """

    def __init__(self, store: Database, *, on_flushed: Callable[[], None] = lambda: None) -> None:
        self._store = store
        self._on_flushed = on_flushed
        self._ready = threading.Condition()
        self._slots: dict[str, _Slot] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.batches = 0

    async def write(self, row: ObservationWrite) -> bool:
        """Store ``row`` with the node's next batch; True once written, False if the database's fence refused it."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        with self._ready:
            slot = self._slots.get(row.node_id)
            if slot is None:
                self._slots[row.node_id] = _Slot(row, [future])
            else:
                slot.row = row
                slot.waiting.append(future)
            self._ready.notify()
        return await future

    @property
    def pending(self) -> int:
        """Nodes whose observation waits for the next batch."""
        with self._ready:
            return len(self._slots)

    def flush(self) -> int:
        """Write every slot in one batch and answer its POSTs; returns how many nodes' rows were written."""
        with self._ready:
            slots, self._slots = self._slots, {}
        if not slots:
            return 0
        try:
            refused = set(self._store.record_observations([slot.row for slot in slots.values()]))
        except BaseException as exc:
            for slot in slots.values():
                for future in slot.waiting:
                    _settle(future, exc)
            raise
        self.batches += 1
        written = len(slots) - len(refused)
        if written:
            self._on_flushed()  # before any POST is answered: a read after the 204 must see the new rows
        for node_id, slot in slots.items():
            for future in slot.waiting:
                _settle(future, node_id not in refused)
        return written

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="devserver-observation-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._slots and not self._stopping:
                    self._ready.wait()
                if self._stopping and not self._slots:
                    return
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - its POSTs were answered with the error (a 500): they retry
                _log.warning("could not write a batch of observations: %s", exc)

    def close(self) -> None:
        """Write what is waiting, then stop the thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - stopping: say what was lost, and stop all the same
            _log.warning("could not write the last batch of observations: %s", exc)


def _settle(future: asyncio.Future[bool], outcome: bool | BaseException) -> None:
    """Answer a waiting POST from the writer thread (its loop may be gone: the server is stopping)."""
    loop = future.get_loop()

    def settle() -> None:
        if future.done():  # the request was cancelled (client gone, server stopping)
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)

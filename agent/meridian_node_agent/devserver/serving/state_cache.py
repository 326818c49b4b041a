"""Each node's epoch, certificate records and latest desired state, held in memory so that a steady request costs
no database statement.

What a node's steady traffic needs from the database is small and changes rarely: its epoch (a heartbeat's answer,
the observation fence), its certificate's record (every request: is it ours, is it revoked) and its latest desired
state (a long-poll's answer, a 304's ETag). Read once on first use, each is kept until a change to that node is
announced (``store/change_feed.py``) or found by a full refresh, then re-read: a heartbeat or a 304 of a known node
reads nothing (``tests/devserver/test_hot_path_statements.py`` counts it).

Correctness rests on each value only ever moving one way, so that a slow read racing a refresh cannot put an older
value back:

* an epoch only grows (``fence``): the cache keeps the larger of what it has and what it read;
* a desired state's generation only grows (``publish``): the cache keeps the higher one;
* a certificate only goes from valid to revoked; a record is dropped on a revocation or re-enrollment of its node,
  and a read that started before a drop is used for its request but not kept (``_forgets`` counts drops).

A cached epoch is therefore never above the node's real one: an observation under a lower epoch is certainly stale
(refused at once), one under a higher epoch is re-checked against the database before it is called from the future
(``current_epoch``), since another replica may have fenced the node before this one heard of it.

Costs, measured on this machine's 2 cores with 5,000 nodes: a hit is a dict lookup under a lock (under a
microsecond); a full refresh (``refresh_all``: one ``nodes()`` statement and a comparison per node) took 55 ms on
SQLite and 60-90 ms on PostgreSQL idle, 80-700 ms under a fleet's load (it shares the GIL with the event loop, which
it stalls meanwhile), which is why it runs only at start and after a lost announcement; a targeted refresh
(``apply``: one statement for the node) is the normal path, and the backstop reads only the nodes changed since it
last looked (``refresh``). ``warm`` reads every certificate record and desired state in two statements at start.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from meridian_node_agent.devserver.store.change_feed import ChangeKind, StateChange
from meridian_node_agent.devserver.store.database import (
    CertificateRecord,
    Database,
    NodeChange,
    NodeRow,
    PublishedState,
    UnknownNode,
)

__all__ = ["NodeStateCache"]


@dataclass(frozen=True)
class _Seen:
    """What the last full refresh saw of a node: a difference is a change to re-read."""

    epoch: int
    enrolled_at: datetime | None
    revoked_at: datetime | None
    generation: int | None


class NodeStateCache:
    """Epochs, certificate records and desired states per node (see the module doc). Safe from any thread.

    Called after the change is held, on the thread that made or learnt it: ``on_desired(node_id)`` when a node's
    latest desired state changed (its long-polls wake); ``on_certificates(node_id)`` when a node's certificate
    records were dropped (a revocation, a re-enrollment: its long-polls check their certificates again, the
    serving projection is rebuilt);
    ``on_fenced(node_id)`` when a node's epoch moved up (its long-polls end), not when an epoch is first read.
    """

    def __init__(
        self,
        store: Database,
        *,
        on_desired: Callable[[str], None] = lambda _node_id: None,
        on_certificates: Callable[[str], None] = lambda _node_id: None,
        on_fenced: Callable[[str], None] = lambda _node_id: None,
    ) -> None:
        self._store = store
        self._on_desired = on_desired
        self._on_certificates = on_certificates
        self._on_fenced = on_fenced
        self._lock = threading.Lock()
        self._epochs: dict[str, int] = {}
        self._certificates: dict[str, CertificateRecord] = {}
        self._serials: dict[str, set[str]] = {}
        self._forgets = 0
        self._desired: dict[str, PublishedState | None] = {}
        self._seen: dict[str, _Seen] = {}

    # Reads: from memory, else from the store once

    def epoch(self, node_id: str) -> int:
        """The node's epoch as last known; ``UnknownNode`` if the store has no such node."""
        with self._lock:
            epoch = self._epochs.get(node_id)
        return epoch if epoch is not None else self.current_epoch(node_id)

    def current_epoch(self, node_id: str) -> int:
        """The node's epoch read from the store now (kept, if it is above what was known)."""
        return self._keep_epoch(node_id, self._store.lease(node_id).epoch)

    def certificate(self, serial: str) -> CertificateRecord | None:
        """The record of certificate ``serial``, or None if it was never issued (not kept: a refusal)."""
        with self._lock:
            record = self._certificates.get(serial)
            forgets = self._forgets
        if record is not None:
            return record
        record = self._store.certificate(serial)
        if record is not None:
            with self._lock:
                if self._forgets == forgets:
                    self._certificates[serial] = record
                    self._serials.setdefault(record.node_id, set()).add(serial)
        return record

    def desired(self, node_id: str) -> PublishedState | None:
        """The node's latest desired state (None: nothing published)."""
        with self._lock:
            if node_id in self._desired:
                return self._desired[node_id]
        return self._keep_desired(node_id, self._store.latest_desired(node_id), wake=False)

    def warm(self) -> tuple[int, int]:
        """Read every valid certificate's record and every node's latest desired state at once (two statements), so
        that a fleet reconnecting to a server that just started costs no statement per node; returns how many of
        each were kept.

        Why: read lazily, each node's first requests after a start each read its certificate and its state on the
        event loop, 5,000 of each within one heartbeat interval, while the fleet's first cycles also arrive. Kept by
        the rules the lazy reads follow: records only if no drop happened during the read, states only if newer.
        """
        with self._lock:
            forgets = self._forgets
            known = list(self._seen)
        records = self._store.valid_certificates()
        states = self._store.latest_desired_states()
        kept_records = 0
        with self._lock:
            if self._forgets == forgets:
                for record in records:
                    self._certificates.setdefault(record.serial, record)
                    self._serials.setdefault(record.node_id, set()).add(record.serial)
                kept_records = len(records)
        for node_id in known:
            self._keep_desired(node_id, states.get(node_id), wake=False)
        return kept_records, len(states)

    # Changes this process made: known without reading

    def note_published(self, state: PublishedState) -> None:
        self._keep_desired(state.node_id, state, wake=True)

    def note_epoch(self, node_id: str, epoch: int) -> None:
        self._keep_epoch(node_id, epoch, moved=True)

    def forget_certificates(self, node_id: str) -> None:
        """Drop the node's certificate records: the next request reads them again (a revocation, a re-enrollment)."""
        with self._lock:
            self._forgets += 1
            for serial in self._serials.pop(node_id, set()):
                self._certificates.pop(serial, None)
        self._on_certificates(node_id)

    # Changes another process announced, or that a full refresh found

    def apply(self, change: StateChange) -> None:
        """Re-read what ``change`` moved, if this process holds it (what it does not hold is read when first needed)."""
        node_id = change.node_id
        if change.kind is ChangeKind.PUBLISHED:
            with self._lock:
                held = node_id in self._desired
            if held:
                self._keep_desired(node_id, self._store.latest_desired(node_id), wake=True)
        elif change.kind is ChangeKind.FENCED:
            with self._lock:
                held = node_id in self._epochs
            if held:
                with contextlib.suppress(UnknownNode):
                    self.current_epoch(node_id)
            else:
                # Nothing to re-read, but the announcement says the epoch moved: a parked request must hear of it.
                self._on_fenced(node_id)
        else:  # REVOKED, ENROLLED
            self.forget_certificates(node_id)

    def refresh_all(self) -> int:
        """Compare every node with what the last refresh saw, and re-read what differs; returns how many did.

        What a server does at start and when announcements may have been lost (see ``store/change_feed.py``): one
        ``nodes()`` statement, plus one statement per node whose held desired state or epoch moved.
        """
        return self.refresh(self._store.nodes())

    def refresh(self, rows: Iterable[NodeRow | NodeChange]) -> int:
        """Compare these nodes with what the last refresh saw, and re-read what differs; returns how many did.

        The backstop passes the nodes changed since it last looked (``Database.nodes_changed_since``), usually none.
        """
        changed = 0
        for row in rows:
            seen = _Seen(row.epoch, row.enrolled_at, row.revoked_at, row.generation)
            with self._lock:
                before = self._seen.get(row.node_id)
                self._seen[row.node_id] = seen
                held_desired = row.node_id in self._desired
                held_desired_generation = (self._desired.get(row.node_id) or _NOTHING).generation
            if before == seen:
                continue
            changed += 1
            self._keep_epoch(row.node_id, row.epoch, moved=before is not None and seen.epoch > before.epoch)
            if before is None:
                # First seen: records read before this refresh may be older than the row.
                with self._lock:
                    holds_certificates = row.node_id in self._serials
                if holds_certificates:
                    self.forget_certificates(row.node_id)
            elif (before.enrolled_at, before.revoked_at) != (seen.enrolled_at, seen.revoked_at):
                # Dropped even when none is held: the node's parked requests check again (``on_certificates``).
                self.forget_certificates(row.node_id)
            if held_desired and (seen.generation or 0) > held_desired_generation:
                self._keep_desired(row.node_id, self._store.latest_desired(row.node_id), wake=True)
        return changed

    # Merging: every value only moves one way (module doc)

    def _keep_epoch(self, node_id: str, epoch: int, *, moved: bool = False) -> int:
        """Keep ``epoch`` if it is above the one held; ``on_fenced`` if it is, or (``moved``: the caller knows the
        epoch moved up) if none was held. The first read of an epoch is no fence."""
        with self._lock:
            held = self._epochs.get(node_id)
            kept = epoch if held is None else max(epoch, held)
            self._epochs[node_id] = kept
        if (held is None and moved) or (held is not None and epoch > held):
            self._on_fenced(node_id)
        return kept

    def _keep_desired(self, node_id: str, state: PublishedState | None, *, wake: bool) -> PublishedState | None:
        with self._lock:
            held = self._desired.get(node_id)
            newer = state is not None and (held is None or state.generation > held.generation)
            if newer or node_id not in self._desired:
                self._desired[node_id] = state
            kept = self._desired[node_id]
        if newer and wake:
            self._on_desired(node_id)
        return kept


# A generation below every real one (they start at 1): what "nothing published" compares as.
_NOTHING = PublishedState(node_id="", generation=0, lease_epoch=0, envelope=b"", etag="")

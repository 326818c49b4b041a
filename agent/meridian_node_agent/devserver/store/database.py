"""The devserver's database: tokens, nodes and leases, certificates, desired states, observations.

SQLAlchemy Core (no ORM) over two backends: SQLite, embedded, the default (a file in the data dir, or
``:memory:``), and PostgreSQL through psycopg 3, for a fleet that outgrows one file or wants several server
processes on one database. How each is connected: ``backends.py``; the tables: ``schema.py``; the
statements, built once: ``queries.py``; the schema's history: ``migrations/`` (Alembic, run when a
``Database`` opens; databases from before Alembic are adopted there).

Every read sees the latest commit of any process: a revocation made by the CLI applies to the server's next
request. Writes are short transactions that take their locks first:

* SQLite: ``BEGIN IMMEDIATE``, the database's one write lock, up front. Assigning the next generation or bumping
  an epoch cannot race another process doing the same.
* PostgreSQL (READ COMMITTED): a write locks the node's row before it reads what it decides on (``UPDATE ...
  RETURNING`` or ``SELECT ... FOR UPDATE``), so two publishes get two generations, and a renewal and a
  revocation of the same node do not cross; a token is locked (``FOR UPDATE``) before it is consumed. An
  observation is written only if the node's row, share-locked (``FOR SHARE``), carries the observation's epoch,
  in the upsert itself: once ``fence`` has returned, no write under the old epoch lands.

Enrollment tokens are stored as sha256 digests; the value is shown once, when it is created. A token
may be bound to one node id (``tokens.node_id``); NULL means it can enroll any node id.

Enrolling a node id that already has certificates revokes them in the same transaction: the new
certificate supersedes them, so a copy of an earlier key stops working at its next request, and a
node whose key leaked is made safe by enrolling it again. ``certificates.revoked_reason`` says why a
certificate was revoked (``revoked``: the operator's ``revoke``; ``superseded``: a later enrollment),
so the refusal can tell the two apart; it is NULL for revocations recorded before the column existed.

``nodes_changed_since(seq)`` is what a server's backstop asks (``serving/change_watcher.py``): the nodes published to,
fenced, enrolled or revoked since the change it last saw. Each of those transactions ends by bumping the one row of
``change_marker`` and stamping its node's ``change_seq`` with the new value (``_bump``); the row's lock (on SQLite
the write lock) holds every other such transaction until this one commits, so they commit in the order of their
stamps, and a reader that sees one stamp has seen every lower one. Lease renewals and observations do not bump it:
they are the fleet's steady traffic and nothing waits on them. (A database sequence would hand out its value before
the transaction commits, out of commit order, and a reader could skip a change that commits later.)

``renew_leases`` and ``record_observations`` are the batched writes a server that holds leases and
observations in memory flushes: one transaction, one ``executemany`` each. ``statement_count`` and
``commit_count`` count what this ``Database`` sent (``backends.StatementCounter``).

The devserver's command line imports this module for every verb. Without the ``devserver`` extra (SQLAlchemy,
Alembic, psycopg) it still imports, and ``Database`` says which package to install.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from meridian_node_agent.devserver.store.errors import DatabaseUnavailable, StoreConflict, UnknownNode

_missing_package: str | None = None
# What the `devserver` extra brings for the database (mako: Alembic's; typing_extensions: SQLAlchemy's).
_DATABASE_STACK = frozenset({"sqlalchemy", "alembic", "psycopg", "mako", "typing_extensions"})
try:
    from sqlalchemy import Connection, func, insert, select, text
    from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

    from meridian_node_agent.devserver.store import migrations
    from meridian_node_agent.devserver.store.backends import (
        WRITE_OPTION,
        StatementCounter,
        create_store_engine,
        locate,
    )
    from meridian_node_agent.devserver.store.queries import StoreQueries
    from meridian_node_agent.devserver.store.schema import outbox_records
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] not in _DATABASE_STACK:
        raise
    _missing_package = exc.name

__all__ = [
    "REVOKED_BY_OPERATOR",
    "SUPERSEDED_BY_ENROLLMENT",
    "CertificateRecord",
    "Database",
    "DatabaseUnavailable",
    "Enrollment",
    "LeaseRecord",
    "NodeChange",
    "NodeRow",
    "ObservationRecord",
    "ObservationWrite",
    "PublishedState",
    "StoreConflict",
    "UnknownNode",
]


@dataclass(frozen=True)
class LeaseRecord:
    node_id: str
    epoch: int
    expires_at: datetime
    renewed_at: datetime


# Why a certificate was revoked (``certificates.revoked_reason``).
REVOKED_BY_OPERATOR = "revoked"
SUPERSEDED_BY_ENROLLMENT = "superseded"


@dataclass(frozen=True)
class CertificateRecord:
    serial: str
    node_id: str
    not_after: datetime
    revoked_at: datetime | None
    # REVOKED_BY_OPERATOR or SUPERSEDED_BY_ENROLLMENT; None when revoked before reasons were kept.
    revoked_reason: str | None = None


@dataclass(frozen=True)
class Enrollment:
    """What an enrollment recorded: the node's lease, and how many earlier certificates it revoked."""

    lease: LeaseRecord
    superseded: int


@dataclass(frozen=True)
class PublishedState:
    node_id: str
    generation: int
    lease_epoch: int
    envelope: bytes
    etag: str


@dataclass(frozen=True)
class ObservationRecord:
    node_id: str
    lease_epoch: int
    remote_host: str
    body: str


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    epoch: int
    lease_expires_at: datetime | None
    enrolled_at: datetime | None
    revoked_at: datetime | None
    certificates: int
    generation: int | None
    last_observed_at: datetime | None


@dataclass(frozen=True)
class NodeChange:
    """What a server's cache compares of a node that changed (``Database.nodes_changed_since``)."""

    node_id: str
    epoch: int
    enrolled_at: datetime | None
    revoked_at: datetime | None
    generation: int | None
    change_seq: int


class ObservationWrite(NamedTuple):
    """One row of ``record_observations``: a node's observation (``body``, its JSON) as the server received it.

    The first four fields are the plain tuple ``record_observations`` also takes. ``observed_at`` defaults to
    the body's own ``observed_at`` (else ``received_at``); ``remote_host`` to the address already stored for
    the node (else its node id).
    """

    node_id: str
    lease_epoch: int
    body: bytes
    received_at: datetime
    observed_at: datetime | None = None
    remote_host: str | None = None


def token_digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


# Node ids per `IN (...)` list: well under SQLite's 32,766 and PostgreSQL's 65,535 bound parameters.
_IN_CHUNK = 5000
# pg_advisory_xact_lock's key while migrating: any constant the devserver alone uses ("mndv" in ASCII).
_MIGRATION_LOCK_KEY = 0x6D6E6476


class Database:
    """The database at ``path``: a SQLite file path, ``:memory:``, or a URL (``sqlite:///PATH``,
    ``postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE``). Opening migrates it to the newest schema.

    ``path`` afterwards is what to show: the file, ``:memory:``, or the URL without its password. Methods are
    safe to call from several threads.
    """

    def __init__(self, path: str) -> None:
        if _missing_package is not None:
            raise DatabaseUnavailable(_not_installed(_missing_package, "of the devserver"))
        location = locate(path)
        self.path = location.shown
        self.backend = location.backend
        self._postgresql = location.backend == "postgresql"
        self._memory = location.memory
        try:
            self._engine = create_store_engine(location)
        except ModuleNotFoundError as exc:  # the driver (psycopg) is imported here, not above
            raise DatabaseUnavailable(_not_installed(exc, self.path)) from exc
        self._counter = StatementCounter(self._engine)
        self._writer = self._engine.execution_options(**{WRITE_OPTION: True})
        # PostgreSQL reads in autocommit: no BEGIN/ROLLBACK round trips around a SELECT.
        self._reader = (
            self._engine.execution_options(isolation_level="AUTOCOMMIT") if self._postgresql else self._engine
        )
        # :memory: is one connection for every thread: one caller at a time.
        self._lock = threading.RLock() if self._memory else None
        self._q = StoreQueries.for_backend(postgresql_backend=self._postgresql)
        try:
            self._migrate()
        except ModuleNotFoundError as exc:  # Alembic is imported only when there is migrating to do
            self._engine.dispose()
            raise DatabaseUnavailable(_not_installed(exc, self.path)) from exc
        except OperationalError as exc:
            self._engine.dispose()
            raise DatabaseUnavailable(self._unavailable(exc)) from exc
        except BaseException:
            self._engine.dispose()
            raise

    def _unavailable(self, exc: OperationalError) -> str:
        reason = str(exc.orig).strip() or type(exc.orig).__name__
        if self._postgresql:
            return (
                f"cannot open the database {self.path}: {reason}; check that the PostgreSQL server runs and that "
                "the URL's user, password, host, port and database are right (the database must exist)"
            )
        return (
            f"cannot open the SQLite database {self.path}: {reason}; check that its directory exists and that this "
            "user may write there"
        )

    def close(self) -> None:
        self._engine.dispose()

    @property
    def statement_count(self) -> int:
        """Statements this ``Database`` has sent (an ``executemany`` counts once; BEGIN and COMMIT do not)."""
        return self._counter.statements

    @property
    def commit_count(self) -> int:
        """Transactions this ``Database`` has committed."""
        return self._counter.commits

    # Plumbing

    def _migrate(self) -> None:
        """Bring the database to the newest schema (``migrations``), unless it is there already."""
        if self._at_head():
            return
        with self._serialized(), self._writer.begin() as conn:
            if self._postgresql:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
            migrations.upgrade(conn)

    def _at_head(self) -> bool:
        try:
            with self._read() as conn:
                version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except DBAPIError:
            # No alembic_version (a new database, or one from before Alembic), or no database to reach:
            # _migrate says which.
            return False
        return version == migrations.HEAD

    @contextmanager
    def _serialized(self) -> Iterator[None]:
        if self._lock is None:
            yield
            return
        with self._lock:
            yield

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._serialized(), self._writer.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._serialized(), self._reader.connect() as conn:
            yield conn

    def _bump(self, conn: Connection, node_id: str) -> None:
        """Move the change marker and stamp ``node_id`` with its new value: the last statements of a transaction
        that publishes, fences, enrolls or revokes. The marker row's lock (SQLite: the write lock) holds every other
        such transaction until this one commits, so they commit in the order of their values: a reader that sees a
        value has seen every lower one (``nodes_changed_since``)."""
        conn.execute(self._q.marker_bump)
        seq = int(conn.execute(self._q.marker_row_value).scalar_one())
        conn.execute(self._q.node_change_seq, {"b_node_id": node_id, "b_seq": seq})

    def nodes_changed_since(self, seq: int) -> list[NodeChange]:
        """The nodes published to, fenced, enrolled or revoked in transactions after the one that stamped ``seq``:
        one statement, an index range (``_bump``)."""
        with self._read() as conn:
            rows = conn.execute(self._q.nodes_changed_since, {"b_seq": seq}).all()
        return [
            NodeChange(
                node_id=r.node_id,
                epoch=int(r.epoch),
                enrolled_at=r.enrolled_at,
                revoked_at=r.revoked_at,
                generation=None if r.generation is None else int(r.generation),
                change_seq=int(r.change_seq),
            )
            for r in rows
        ]

    def last_change_seq(self) -> int:
        """The highest ``change_seq`` of any node (0: none changed since the column was added)."""
        with self._read() as conn:
            return int(conn.execute(self._q.last_change_seq).scalar_one())

    # Tokens

    def put_token(self, name: str, value: str, now: datetime, node_id: str | None = None) -> None:
        """Create token ``name``, replacing an unused token of that name; a used name is a conflict.

        With ``node_id`` the token can enroll only that node id; without, any.
        """
        q = self._q
        with self._write() as conn:
            used_by = conn.execute(q.token_used_by, {"b_name": name}).scalar_one_or_none()
            if used_by is not None:
                raise StoreConflict(
                    "token-used", f"token {name!r} was already used (by node {used_by!r}); choose another name"
                )
            conn.execute(q.token_delete, {"b_name": name})
            try:
                conn.execute(
                    q.token_insert,
                    {"name": name, "value_sha256": token_digest(value), "created_at": now, "node_id": node_id},
                )
            except IntegrityError as exc:
                raise StoreConflict("token-exists", "another token already has this value; choose another") from exc

    # Enrollment, leases, certificates

    def enroll(
        self, *, token: str, node_id: str, serial: str, not_after: datetime, lease_for: timedelta, now: datetime
    ) -> Enrollment:
        """Consume ``token``, record the node and its new certificate, and revoke its earlier ones: all or nothing.

        A token bound to another node id is refused before anything else is said about it, and stays
        unused: the node it was made for must still be able to enroll with it. A refused enrollment
        revokes nothing.
        """
        q = self._q
        with self._write() as conn:
            row = conn.execute(q.token_by_digest, {"b_digest": token_digest(token)}).first()
            if row is None:
                raise StoreConflict("token-unknown", "this enrollment token is not known to the control plane")
            if row.node_id is not None and row.node_id != node_id:
                raise StoreConflict(
                    "token-wrong-node",
                    f"this enrollment token is bound to another node id, not {node_id!r}; enroll with the token "
                    "made for this node, or ask the operator for one",
                    server_note=f"token {row.name!r} is bound to node {row.node_id!r} but was presented for node "
                    f"{node_id!r}",
                )
            if row.used_at is not None:
                raise StoreConflict(
                    "token-used",
                    f"enrollment token {row.name!r} was already used at {format_rfc3339(row.used_at)}; tokens are "
                    "one-time",
                )
            conn.execute(q.token_consume, {"b_name": row.name, "b_used_at": now, "b_used_by": node_id})
            conn.execute(q.node_insert_if_missing, {"b_node_id": node_id})
            # Locks the node's row: a renewal or revocation of it waits, then sees the certificates below.
            lease = conn.execute(
                q.node_enroll, {"b_node_id": node_id, "b_now": now, "b_expires_at": now + lease_for}
            ).one()
            # The new certificate supersedes every earlier one (enrolled or renewed): a copy of an old key
            # must not keep speaking for the node once it has enrolled again.
            superseded = conn.execute(
                q.certificates_revoke, {"b_node_id": node_id, "b_now": now, "b_reason": SUPERSEDED_BY_ENROLLMENT}
            ).rowcount
            conn.execute(
                q.certificate_insert, {"serial": serial, "node_id": node_id, "issued_at": now, "not_after": not_after}
            )
            self._bump(conn, node_id)
            return Enrollment(lease=_lease(node_id, lease), superseded=int(superseded))

    def add_renewed_certificate(
        self, *, node_id: str, presented_serial: str, serial: str, not_after: datetime, now: datetime
    ) -> LeaseRecord:
        """Record a certificate issued by renewal, unless the one presented for it was revoked meanwhile.

        The presented certificate is left as it is: it stays valid until it expires, so a renewal whose
        answer is lost in transit does not lock the node out.
        """
        q = self._q
        with self._write() as conn:
            # The node's row first (as revoke and enroll lock it), then what it decides on.
            lease = conn.execute(q.node_lock_lease, {"b_node_id": node_id}).first()
            presented = conn.execute(q.certificate_owner, {"b_serial": presented_serial}).first()
            if lease is None or presented is None or presented.node_id != node_id:
                raise StoreConflict(
                    "certificate-unknown", f"certificate serial {presented_serial} was never issued to node {node_id!r}"
                )
            if presented.revoked_at is not None:
                raise StoreConflict(
                    "certificate-revoked",
                    f"the certificate of node {node_id!r} was revoked at {format_rfc3339(presented.revoked_at)} (a "
                    "renewal and a revocation or re-enrollment crossed); enroll again with a new token",
                )
            conn.execute(
                q.certificate_insert, {"serial": serial, "node_id": node_id, "issued_at": now, "not_after": not_after}
            )
            return _lease(node_id, lease)

    def certificate(self, serial: str) -> CertificateRecord | None:
        with self._read() as conn:
            row = conn.execute(self._q.certificate, {"b_serial": serial}).first()
        return None if row is None else _certificate_record(row)

    def valid_certificates(self) -> list[CertificateRecord]:
        """Every certificate not revoked (expired ones included: the caller checks the date), in one statement."""
        with self._read() as conn:
            rows = conn.execute(self._q.valid_certificates).all()
        return [_certificate_record(row) for row in rows]

    def renew_lease(self, node_id: str, lease_for: timedelta, now: datetime) -> LeaseRecord:
        """Extend the lease; the epoch is untouched (only ``fence`` moves it, and only up)."""
        with self._write() as conn:
            lease = conn.execute(
                self._q.node_renew_lease, {"b_node_id": node_id, "b_expires_at": now + lease_for, "b_renewed_at": now}
            ).first()
            if lease is None:
                raise UnknownNode(node_id)
            return _lease(node_id, lease)

    def renew_leases(self, renewals: Mapping[str, tuple[datetime, datetime]]) -> None:
        """Record many lease renewals at once: node id -> (renewed_at, lease_expires_at). Unknown ids are ignored.

        One transaction, one ``executemany`` (an UPDATE per node, in node id order, so two flushes lock rows in
        the same order). The epoch is untouched.
        """
        if not renewals:
            return
        rows = [
            {"b_node_id": node_id, "b_renewed_at": renewed_at, "b_expires_at": expires_at}
            for node_id, (renewed_at, expires_at) in sorted(renewals.items())
        ]
        with self._write() as conn:
            conn.execute(self._q.node_renew_leases, rows)

    def lease(self, node_id: str) -> LeaseRecord:
        with self._read() as conn:
            lease = conn.execute(self._q.node_lease, {"b_node_id": node_id}).first()
        if lease is None:
            raise UnknownNode(node_id)
        return _lease(node_id, lease)

    def fence(self, node_id: str) -> int:
        """Bump the node's epoch by one and return it."""
        with self._write() as conn:
            epoch = conn.execute(self._q.node_fence, {"b_node_id": node_id}).scalar_one_or_none()
            if epoch is None:
                raise UnknownNode(node_id)
            self._bump(conn, node_id)
            return int(epoch)

    def revoke(self, node_id: str, now: datetime) -> int:
        """Revoke every certificate issued to the node; returns how many were still valid."""
        q = self._q
        with self._write() as conn:
            if conn.execute(q.node_revoke, {"b_node_id": node_id, "b_now": now}).first() is None:
                raise UnknownNode(node_id)
            revoked = conn.execute(
                q.certificates_revoke, {"b_node_id": node_id, "b_now": now, "b_reason": REVOKED_BY_OPERATOR}
            ).rowcount
            self._bump(conn, node_id)
            return int(revoked)

    # Desired state

    def publish(self, node_id: str, build: Callable[[int, int], tuple[bytes, str]], now: datetime) -> PublishedState:
        """Store the node's next desired state. ``build(generation, epoch)`` returns (envelope, etag).

        ``build`` runs inside the write transaction, so the generation it is given is the one stored.
        """
        q = self._q
        with self._write() as conn:
            conn.execute(q.node_insert_if_missing, {"b_node_id": node_id})
            epoch = int(conn.execute(q.node_epoch_locked, {"b_node_id": node_id}).scalar_one())
            generation = int(conn.execute(q.last_generation, {"b_node_id": node_id}).scalar_one()) + 1
            envelope, etag = build(generation, epoch)
            conn.execute(
                q.desired_insert,
                {
                    "node_id": node_id,
                    "generation": generation,
                    "lease_epoch": epoch,
                    "envelope": envelope,
                    "etag": etag,
                    "published_at": now,
                },
            )
            self._bump(conn, node_id)
            return PublishedState(node_id, generation, epoch, envelope, etag)

    def latest_desired(self, node_id: str) -> PublishedState | None:
        with self._read() as conn:
            row = conn.execute(self._q.latest_desired, {"b_node_id": node_id}).first()
        if row is None:
            return None
        return PublishedState(node_id, int(row.generation), int(row.lease_epoch), bytes(row.envelope), row.etag)

    def latest_desired_states(self) -> dict[str, PublishedState]:
        """Every node's latest desired state (nodes with none are absent), in one statement."""
        with self._read() as conn:
            rows = conn.execute(self._q.latest_desired_all).all()
        return {
            row.node_id: PublishedState(
                row.node_id, int(row.generation), int(row.lease_epoch), bytes(row.envelope), row.etag
            )
            for row in rows
        }

    # Observations

    def record_observation(
        self, node_id: str, lease_epoch: int, observed_at: datetime, remote_host: str, body: str, now: datetime
    ) -> None:
        """Keep the node's latest observation; one carrying an epoch other than the current one is refused."""
        with self._write() as conn:
            written = conn.execute(
                self._q.observation_upsert,
                {
                    "b_node_id": node_id,
                    "b_epoch": lease_epoch,
                    "b_observed_at": observed_at,
                    "b_received_at": now,
                    "b_remote_host": remote_host,
                    "b_body": body,
                },
            ).rowcount
            if written:
                return
            epoch = conn.execute(self._q.node_epoch, {"b_node_id": node_id}).scalar_one_or_none()
            if epoch is None:
                raise UnknownNode(node_id)
            if lease_epoch < epoch:
                raise StoreConflict(
                    "stale-epoch",
                    f"the observation carries lease epoch {lease_epoch}, but node {node_id!r} is at epoch {epoch}: "
                    "it comes from a writer that has been fenced; heartbeat to learn the current epoch",
                )
            raise StoreConflict(
                "future-epoch",
                f"the observation carries lease epoch {lease_epoch}, but node {node_id!r} is only at epoch "
                f"{epoch}: this control plane never issued it",
            )

    def record_observations(self, batch: Sequence[tuple[str, int, bytes, datetime] | ObservationWrite]) -> list[str]:
        """Write many observations at once; returns the node ids of the rows not written, in batch order, once each.

        A row is written only if its epoch is its node's current one: an older epoch (a fenced writer), a newer
        one (never issued) or an unknown node id is refused, and the other rows are written all the same. Per
        node the last written row of the batch wins (a node may be refused for one row and written for a later
        one). One transaction: the nodes' epochs read share-locked (one ``SELECT`` per 5,000 ids), then one
        ``executemany`` of the fenced upsert, in node id order.
        """
        rows = [ObservationWrite(*row) for row in batch]
        if not rows:
            return []
        with self._write() as conn:
            epochs: dict[str, int] = {}
            ids = sorted({row.node_id for row in rows})
            for start in range(0, len(ids), _IN_CHUNK):
                locked = conn.execute(self._q.node_epochs_locked, {"b_node_ids": ids[start : start + _IN_CHUNK]})
                epochs.update((node_id, int(epoch)) for node_id, epoch in locked)
            latest: dict[str, ObservationWrite] = {}
            refused: dict[str, None] = {}
            for row in rows:
                if epochs.get(row.node_id) == row.lease_epoch:
                    latest[row.node_id] = row
                else:
                    refused.setdefault(row.node_id)
            if latest:
                conn.execute(self._q.observation_upsert, [_observation_params(latest[key]) for key in sorted(latest)])
        return list(refused)

    def serving_observations(self) -> list[ObservationRecord]:
        """The latest observation of every node that is not revoked, in node order."""
        with self._read() as conn:
            rows = conn.execute(self._q.serving_observations).all()
        # Sorted here: PostgreSQL's collation may order '-' and '.' unlike SQLite's bytes.
        return sorted(
            (ObservationRecord(r.node_id, int(r.lease_epoch), r.remote_host, r.body) for r in rows),
            key=lambda record: record.node_id,
        )

    # Air-gapped nodes' outbox records (``outbox_import``): rare, so built per call rather than in ``StoreQueries``.

    def outbox_record_digest(self, node_id: str, sequence: int) -> str | None:
        """The sha256 of the record imported as ``(node_id, sequence)``, or None when there is none."""
        table = outbox_records
        query = select(table.c.sha256).where(table.c.node_id == node_id, table.c.sequence == sequence)
        with self._read() as conn:
            return conn.execute(query).scalar_one_or_none()

    def newest_imported_observation(self, node_id: str) -> int | None:
        """The highest sequence of an observation imported (not superseded) for the node, or None."""
        table = outbox_records
        query = select(func.max(table.c.sequence)).where(
            table.c.node_id == node_id, table.c.kind == "observation", table.c.result == "imported"
        )
        with self._read() as conn:
            newest = conn.execute(query).scalar_one_or_none()
        return None if newest is None else int(newest)

    def add_outbox_record(
        self, node_id: str, sequence: int, *, kind: str, sha256: str, result: str, imported_at: datetime, body: str
    ) -> None:
        """Record one imported outbox file; ``StoreConflict`` when another import took its sequence meanwhile."""
        row = {
            "node_id": node_id,
            "sequence": sequence,
            "kind": kind,
            "sha256": sha256,
            "result": result,
            "imported_at": format_rfc3339(imported_at),
            "body": body,
        }
        try:
            with self._write() as conn:
                conn.execute(insert(outbox_records), row)
        except IntegrityError as exc:
            raise StoreConflict(
                "sequence-reused",
                f"node {node_id!r} record {sequence} was imported by another run at the same time; import again",
            ) from exc

    def nodes(self) -> list[NodeRow]:
        with self._read() as conn:
            rows = conn.execute(self._q.nodes_listing).all()
        return sorted(
            (
                NodeRow(
                    node_id=r.node_id,
                    epoch=int(r.epoch),
                    lease_expires_at=r.lease_expires_at,
                    enrolled_at=r.enrolled_at,
                    revoked_at=r.revoked_at,
                    certificates=int(r.certs),
                    generation=None if r.generation is None else int(r.generation),
                    last_observed_at=r.observed_at,
                )
                for r in rows
            ),
            key=lambda row: row.node_id,
        )


def _not_installed(missing: ModuleNotFoundError | str, database: str) -> str:
    name = missing if isinstance(missing, str) else missing.name
    return (
        f"the database {database} needs the Python package {name!r}, which is not installed; install "
        "meridian-node[devserver] (pip install 'meridian-node[devserver]')"
    )


_EPOCH_ZERO = datetime.fromisoformat("1970-01-01T00:00:00+00:00")


def _certificate_record(row: Any) -> CertificateRecord:
    """A row of ``StoreQueries.certificate`` or ``valid_certificates`` (the same columns)."""
    return CertificateRecord(
        serial=row.serial,
        node_id=row.node_id,
        not_after=row.not_after,
        revoked_at=row.revoked_at,
        revoked_reason=row.revoked_reason,
    )


def _lease(node_id: str, row: Sequence[Any]) -> LeaseRecord:
    """A lease from a row of (epoch, lease_expires_at, renewed_at). A node known only from a publish has no lease
    yet: reported as one that lapsed long ago."""
    epoch, expires, renewed = row[0], row[1], row[2]
    return LeaseRecord(
        node_id=node_id, epoch=int(epoch), expires_at=expires or _EPOCH_ZERO, renewed_at=renewed or _EPOCH_ZERO
    )


def _observation_params(row: ObservationWrite) -> dict[str, Any]:
    body = row.body.decode("utf-8")
    return {
        "b_node_id": row.node_id,
        "b_epoch": row.lease_epoch,
        "b_observed_at": row.observed_at or _observed_at_in(body) or row.received_at,
        "b_received_at": row.received_at,
        "b_remote_host": row.remote_host,
        "b_body": body,
    }


def _observed_at_in(body: str) -> datetime | None:
    """The ``observed_at`` an observation's JSON carries, or None if it has none that reads as a time."""
    try:
        value = json.loads(body).get("observed_at")
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except (ValueError, AttributeError):
        return None

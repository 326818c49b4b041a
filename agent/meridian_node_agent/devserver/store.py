"""The devserver's embedded SQLite database: tokens, nodes and leases, certificates, desired states, observations.

One connection per ``Database``, shared by every thread under a lock. That is what makes ``:memory:`` work
(each SQLite connection to ``:memory:`` is a separate database) and it is plenty for a dev/CI server.
A file database runs in WAL mode with a busy timeout, so the CLI (``publish``, ``fence``, ``revoke``) can
write while ``serve`` reads, and the connection is in autocommit mode, so every read sees the latest
commit of any process: a revocation made by the CLI applies to the server's next request.

Every multi-statement change runs in ``BEGIN IMMEDIATE``: the write lock is taken up front, so assigning
the next generation or bumping an epoch cannot race another process doing the same.

Enrollment tokens are stored as sha256 digests; the value is shown once, when it is created. A token
may be bound to one node id (``tokens.node_id``); NULL means it can enroll any node id. Databases made
before that column existed get it when they are opened (``_migrate``).

Enrolling a node id that already has certificates revokes them in the same transaction: the new
certificate supersedes them, so a copy of an earlier key stops working at its next request, and a
node whose key leaked is made safe by enrolling it again. ``certificates.revoked_reason`` says why a
certificate was revoked (``revoked``: the operator's ``revoke``; ``superseded``: a later enrollment),
so the refusal can tell the two apart; it is NULL for revocations recorded before the column existed.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339

__all__ = [
    "REVOKED_BY_OPERATOR",
    "SUPERSEDED_BY_ENROLLMENT",
    "CertificateRecord",
    "Database",
    "Enrollment",
    "LeaseRecord",
    "NodeRow",
    "ObservationRecord",
    "PublishedState",
    "StoreConflict",
    "UnknownNode",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    name TEXT PRIMARY KEY,
    value_sha256 TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    used_at TEXT,
    used_by TEXT,
    node_id TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL CHECK (epoch >= 1),
    lease_expires_at TEXT,
    renewed_at TEXT,
    enrolled_at TEXT,
    revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS certificates (
    serial TEXT PRIMARY KEY,
    node_id TEXT NOT NULL REFERENCES nodes(node_id),
    issued_at TEXT NOT NULL,
    not_after TEXT NOT NULL,
    revoked_at TEXT,
    revoked_reason TEXT
);
CREATE TABLE IF NOT EXISTS desired_states (
    node_id TEXT NOT NULL REFERENCES nodes(node_id),
    generation INTEGER NOT NULL CHECK (generation >= 1),
    lease_epoch INTEGER NOT NULL,
    envelope BLOB NOT NULL,
    etag TEXT NOT NULL,
    published_at TEXT NOT NULL,
    PRIMARY KEY (node_id, generation)
);
CREATE TABLE IF NOT EXISTS observations (
    node_id TEXT PRIMARY KEY REFERENCES nodes(node_id),
    lease_epoch INTEGER NOT NULL,
    observed_at TEXT NOT NULL,
    received_at TEXT NOT NULL,
    remote_host TEXT NOT NULL,
    body TEXT NOT NULL
);
"""


class UnknownNode(MeridianError, LookupError):
    """No node by that id: never enrolled and nothing published for it."""


class StoreConflict(MeridianError):
    """A write refused because of what is stored: a used token, a stale epoch. ``reason`` is a short code.

    ``detail`` goes back to the caller; ``server_note``, when set, is for the server's log only and may
    name what an unauthenticated caller must not learn (such as the node a token is bound to).
    """

    def __init__(self, reason: str, detail: str, *, server_note: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.server_note = server_note


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


def token_digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


class Database:
    """The database. ``path`` is a file path or ``:memory:``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._local_changes = 0
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 10000")
            self._conn.execute("PRAGMA foreign_keys = ON")
            if path != ":memory:":
                self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring a database made by an older devserver up to ``_SCHEMA``: columns added since then.

        Checked inside the write lock, so two processes opening the same old file add the column once.
        """
        with self._write() as conn:
            columns = {row[1] for row in conn.execute("PRAGMA table_info(tokens)")}
            if "node_id" not in columns:
                # Tokens made before binding existed stay unbound (NULL): they keep working as they did.
                conn.execute("ALTER TABLE tokens ADD COLUMN node_id TEXT")
            columns = {row[1] for row in conn.execute("PRAGMA table_info(certificates)")}
            if "revoked_reason" not in columns:
                # Revocations recorded before reasons were kept stay revoked, with no reason (NULL).
                conn.execute("ALTER TABLE certificates ADD COLUMN revoked_reason TEXT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            self._local_changes += 1

    def _read(self, sql: str, params: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            cursor = self._conn.execute(sql, params)
            cursor.row_factory = sqlite3.Row
            return list(cursor.fetchall())

    def change_marker(self) -> tuple[int, int]:
        """Changes when anything commits: another process (``data_version``) or this one (a counter).

        ``PRAGMA data_version`` only compares a counter in the database header, so a long-poll can ask
        every few tens of milliseconds and re-query only when it moved.
        """
        with self._lock:
            row = self._conn.execute("PRAGMA data_version").fetchone()
            return int(row[0]), self._local_changes

    # Tokens

    def put_token(self, name: str, value: str, now: datetime, node_id: str | None = None) -> None:
        """Create token ``name``, replacing an unused token of that name; a used name is a conflict.

        With ``node_id`` the token can enroll only that node id; without, any.
        """
        with self._write() as conn:
            row = conn.execute("SELECT used_by FROM tokens WHERE name = ?", (name,)).fetchone()
            if row is not None and row[0] is not None:
                raise StoreConflict(
                    "token-used", f"token {name!r} was already used (by node {row[0]!r}); choose another name"
                )
            conn.execute("DELETE FROM tokens WHERE name = ?", (name,))
            try:
                conn.execute(
                    "INSERT INTO tokens (name, value_sha256, created_at, node_id) VALUES (?, ?, ?, ?)",
                    (name, token_digest(value), format_rfc3339(now), node_id),
                )
            except sqlite3.IntegrityError as exc:
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
        stamp = format_rfc3339(now)
        with self._write() as conn:
            row = conn.execute(
                "SELECT name, used_at, node_id FROM tokens WHERE value_sha256 = ?", (token_digest(token),)
            ).fetchone()
            if row is None:
                raise StoreConflict("token-unknown", "this enrollment token is not known to the control plane")
            if row[2] is not None and row[2] != node_id:
                raise StoreConflict(
                    "token-wrong-node",
                    f"this enrollment token is bound to another node id, not {node_id!r}; enroll with the token "
                    "made for this node, or ask the operator for one",
                    server_note=f"token {row[0]!r} is bound to node {row[2]!r} but was presented for node {node_id!r}",
                )
            if row[1] is not None:
                raise StoreConflict(
                    "token-used", f"enrollment token {row[0]!r} was already used at {row[1]}; tokens are one-time"
                )
            conn.execute("UPDATE tokens SET used_at = ?, used_by = ? WHERE name = ?", (stamp, node_id, row[0]))
            conn.execute(
                "INSERT INTO nodes (node_id, epoch) VALUES (?, 1) ON CONFLICT (node_id) DO NOTHING", (node_id,)
            )
            expires = format_rfc3339(now + lease_for)
            conn.execute(
                "UPDATE nodes SET enrolled_at = ?, revoked_at = NULL, lease_expires_at = ?, renewed_at = ? "
                "WHERE node_id = ?",
                (stamp, expires, stamp, node_id),
            )
            # The new certificate supersedes every earlier one (enrolled or renewed): a copy of an old key
            # must not keep speaking for the node once it has enrolled again.
            superseded = conn.execute(
                "UPDATE certificates SET revoked_at = ?, revoked_reason = ? WHERE node_id = ? AND revoked_at IS NULL",
                (stamp, SUPERSEDED_BY_ENROLLMENT, node_id),
            )
            conn.execute(
                "INSERT INTO certificates (serial, node_id, issued_at, not_after) VALUES (?, ?, ?, ?)",
                (serial, node_id, stamp, format_rfc3339(not_after)),
            )
            return Enrollment(lease=self._lease(conn, node_id), superseded=int(superseded.rowcount))

    def add_renewed_certificate(
        self, *, node_id: str, presented_serial: str, serial: str, not_after: datetime, now: datetime
    ) -> LeaseRecord:
        """Record a certificate issued by renewal, unless the one presented for it was revoked meanwhile.

        The presented certificate is left as it is: it stays valid until it expires, so a renewal whose
        answer is lost in transit does not lock the node out.
        """
        with self._write() as conn:
            row = conn.execute(
                "SELECT node_id, revoked_at FROM certificates WHERE serial = ?", (presented_serial,)
            ).fetchone()
            if row is None or row[0] != node_id:
                raise StoreConflict(
                    "certificate-unknown", f"certificate serial {presented_serial} was never issued to node {node_id!r}"
                )
            if row[1] is not None:
                raise StoreConflict(
                    "certificate-revoked",
                    f"the certificate of node {node_id!r} was revoked at {row[1]} (a renewal and a revocation or "
                    "re-enrollment crossed); enroll again with a new token",
                )
            conn.execute(
                "INSERT INTO certificates (serial, node_id, issued_at, not_after) VALUES (?, ?, ?, ?)",
                (serial, node_id, format_rfc3339(now), format_rfc3339(not_after)),
            )
            return self._lease(conn, node_id)

    def certificate(self, serial: str) -> CertificateRecord | None:
        rows = self._read(
            "SELECT serial, node_id, not_after, revoked_at, revoked_reason FROM certificates WHERE serial = ?",
            (serial,),
        )
        if not rows:
            return None
        row = rows[0]
        return CertificateRecord(
            serial=row["serial"],
            node_id=row["node_id"],
            not_after=_parse(row["not_after"]),
            revoked_at=_parse_optional(row["revoked_at"]),
            revoked_reason=row["revoked_reason"],
        )

    def renew_lease(self, node_id: str, lease_for: timedelta, now: datetime) -> LeaseRecord:
        """Extend the lease; the epoch is untouched (only ``fence`` moves it, and only up)."""
        stamp = format_rfc3339(now)
        with self._write() as conn:
            updated = conn.execute(
                "UPDATE nodes SET lease_expires_at = ?, renewed_at = ? WHERE node_id = ?",
                (format_rfc3339(now + lease_for), stamp, node_id),
            )
            if updated.rowcount == 0:
                raise UnknownNode(node_id)
            return self._lease(conn, node_id)

    def lease(self, node_id: str) -> LeaseRecord:
        with self._lock:
            return self._lease(self._conn, node_id)

    def _lease(self, conn: sqlite3.Connection, node_id: str) -> LeaseRecord:
        row = conn.execute(
            "SELECT epoch, lease_expires_at, renewed_at FROM nodes WHERE node_id = ?", (node_id,)
        ).fetchone()
        if row is None:
            raise UnknownNode(node_id)
        renewed = _parse_optional(row[2])
        expires = _parse_optional(row[1])
        # A node known only from a publish has no lease yet: report one that lapsed long ago.
        return LeaseRecord(
            node_id=node_id, epoch=int(row[0]), expires_at=expires or _EPOCH_ZERO, renewed_at=renewed or _EPOCH_ZERO
        )

    def fence(self, node_id: str) -> int:
        """Bump the node's epoch by one and return it."""
        with self._write() as conn:
            updated = conn.execute("UPDATE nodes SET epoch = epoch + 1 WHERE node_id = ?", (node_id,))
            if updated.rowcount == 0:
                raise UnknownNode(node_id)
            return int(conn.execute("SELECT epoch FROM nodes WHERE node_id = ?", (node_id,)).fetchone()[0])

    def revoke(self, node_id: str, now: datetime) -> int:
        """Revoke every certificate issued to the node; returns how many were still valid."""
        stamp = format_rfc3339(now)
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone() is None:
                raise UnknownNode(node_id)
            conn.execute("UPDATE nodes SET revoked_at = ? WHERE node_id = ?", (stamp, node_id))
            revoked = conn.execute(
                "UPDATE certificates SET revoked_at = ?, revoked_reason = ? WHERE node_id = ? AND revoked_at IS NULL",
                (stamp, REVOKED_BY_OPERATOR, node_id),
            )
            return int(revoked.rowcount)

    # Desired state

    def publish(self, node_id: str, build: Callable[[int, int], tuple[bytes, str]], now: datetime) -> PublishedState:
        """Database the node's next desired state. ``build(generation, epoch)`` returns (envelope, etag).

        ``build`` runs inside the write transaction, so the generation it is given is the one stored.
        """
        with self._write() as conn:
            conn.execute(
                "INSERT INTO nodes (node_id, epoch) VALUES (?, 1) ON CONFLICT (node_id) DO NOTHING", (node_id,)
            )
            epoch = int(conn.execute("SELECT epoch FROM nodes WHERE node_id = ?", (node_id,)).fetchone()[0])
            last = conn.execute(
                "SELECT COALESCE(MAX(generation), 0) FROM desired_states WHERE node_id = ?", (node_id,)
            ).fetchone()
            generation = int(last[0]) + 1
            envelope, etag = build(generation, epoch)
            conn.execute(
                "INSERT INTO desired_states (node_id, generation, lease_epoch, envelope, etag, published_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (node_id, generation, epoch, envelope, etag, format_rfc3339(now)),
            )
            return PublishedState(node_id, generation, epoch, envelope, etag)

    def latest_desired(self, node_id: str) -> PublishedState | None:
        rows = self._read(
            "SELECT generation, lease_epoch, envelope, etag FROM desired_states WHERE node_id = ? "
            "ORDER BY generation DESC LIMIT 1",
            (node_id,),
        )
        if not rows:
            return None
        row = rows[0]
        return PublishedState(
            node_id, int(row["generation"]), int(row["lease_epoch"]), bytes(row["envelope"]), row["etag"]
        )

    # Observations

    def record_observation(
        self, node_id: str, lease_epoch: int, observed_at: datetime, remote_host: str, body: str, now: datetime
    ) -> None:
        """Keep the node's latest observation; one carrying an epoch other than the current one is refused."""
        with self._write() as conn:
            row = conn.execute("SELECT epoch FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            if row is None:
                raise UnknownNode(node_id)
            epoch = int(row[0])
            if lease_epoch < epoch:
                raise StoreConflict(
                    "stale-epoch",
                    f"the observation carries lease epoch {lease_epoch}, but node {node_id!r} is at epoch {epoch}: "
                    "it comes from a writer that has been fenced; heartbeat to learn the current epoch",
                )
            if lease_epoch > epoch:
                raise StoreConflict(
                    "future-epoch",
                    f"the observation carries lease epoch {lease_epoch}, but node {node_id!r} is only at epoch "
                    f"{epoch}: this control plane never issued it",
                )
            conn.execute(
                "INSERT INTO observations (node_id, lease_epoch, observed_at, received_at, remote_host, body) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET lease_epoch = excluded.lease_epoch, "
                "observed_at = excluded.observed_at, received_at = excluded.received_at, "
                "remote_host = excluded.remote_host, body = excluded.body",
                (node_id, lease_epoch, format_rfc3339(observed_at), format_rfc3339(now), remote_host, body),
            )

    def serving_observations(self) -> list[ObservationRecord]:
        """The latest observation of every node that is not revoked, in node order."""
        rows = self._read(
            "SELECT o.node_id, o.lease_epoch, o.remote_host, o.body FROM observations o "
            "JOIN nodes n ON n.node_id = o.node_id WHERE n.revoked_at IS NULL ORDER BY o.node_id"
        )
        return [ObservationRecord(r["node_id"], int(r["lease_epoch"]), r["remote_host"], r["body"]) for r in rows]

    def nodes(self) -> list[NodeRow]:
        rows = self._read(
            "SELECT n.node_id, n.epoch, n.lease_expires_at, n.enrolled_at, n.revoked_at, "
            "(SELECT COUNT(*) FROM certificates c WHERE c.node_id = n.node_id AND c.revoked_at IS NULL) AS certs, "
            "(SELECT MAX(generation) FROM desired_states d WHERE d.node_id = n.node_id) AS generation, "
            "(SELECT observed_at FROM observations o WHERE o.node_id = n.node_id) AS observed_at "
            "FROM nodes n ORDER BY n.node_id"
        )
        return [
            NodeRow(
                node_id=r["node_id"],
                epoch=int(r["epoch"]),
                lease_expires_at=_parse_optional(r["lease_expires_at"]),
                enrolled_at=_parse_optional(r["enrolled_at"]),
                revoked_at=_parse_optional(r["revoked_at"]),
                certificates=int(r["certs"]),
                generation=None if r["generation"] is None else int(r["generation"]),
                last_observed_at=_parse_optional(r["observed_at"]),
            )
            for r in rows
        ]


_EPOCH_ZERO = datetime.fromisoformat("1970-01-01T00:00:00+00:00")


def _parse(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _parse_optional(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)

"""How a change to what a server holds in memory reaches every process that serves the same database.

A ``serve`` process answers heartbeats, 304s and the epoch check from memory (``serving/state_cache.py``): each node's
epoch, its certificate records and its latest desired state. Other processes change them: the CLI's ``publish``,
``fence`` and ``revoke``, and on PostgreSQL the other replicas' enrollments. Every ``ControlPlane`` verb that changes
one of them announces it, after its transaction has committed, as a ``StateChange`` (what changed, for which node) on
the database's feed, and each server's ``ChangeWatcher`` re-reads just that node:

* **PostgreSQL**: ``NOTIFY`` on the channel ``meridian_devserver_changes`` with the payload ``"<kind> <node id>"``.
  Each server ``LISTEN``s on one connection of its own (not one of the store's pool), so a change reaches every
  replica about a round trip after it committed. The notification is sent on its own connection after the
  store's transaction, not inside it (the store owns its transactions); PostgreSQL delivers notifications in
  commit order, and none before its commit, so a listener never acts on a change it cannot see yet.
* **A SQLite file**: one line ``"<kind> <node id>\\n"`` appended (``O_APPEND``) to ``<database>-changes`` beside the
  database, as SQLite keeps its ``-wal`` there: every process that opens that database finds it. A server reads
  the lines it has not read yet. Whether there are any is one ``stat(2)`` of the file (its size against what was
  read; about a microsecond, no database statement), cheap enough for every request to ask: that is what makes a
  ``revoke`` or ``publish`` by the CLI apply to the very next request, as it did when every request read the
  database. A line written is never rewritten; past ``CHANGE_LOG_MAX_BYTES`` the writer that crosses it truncates
  the file, and a reader that finds the file shorter than what it read re-reads every node instead.
* **``:memory:``**: no other process reaches the database; the in-process listeners (``ControlPlane``'s
  ``listeners``) are all there is.

What an announcement cannot cover: a writer that dies between its commit and its announcement, a NOTIFY lost with
a dropped connection, a writer that does not go through ``ControlPlane``. ``ChangeWatcher``'s backstop re-reads
every node whenever the store's change marker moved, at most every ``BACKSTOP_S`` (2 s): the bound on how stale a
server's memory can be. ``take`` returns None whenever it knows it may have missed something (a reconnect, a
truncated log), and the watcher then re-reads every node at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = [
    "CHANGE_LOG_MAX_BYTES",
    "NOTIFY_CHANNEL",
    "ChangeFeed",
    "ChangeKind",
    "InProcessFeed",
    "PostgresChangeChannel",
    "SqliteChangeLog",
    "StateChange",
    "change_log_path",
    "decode_change",
    "libpq_conninfo",
]

_log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "meridian_devserver_changes"
# About 20,000 announcements (a line is ~40 bytes): a reader truncated away re-reads every node once.
CHANGE_LOG_MAX_BYTES = 1024 * 1024
# How often a SQLite watcher looks at the change log: one stat(2), so a publish reaches a waiting long-poll
# within about this long (what the per-request PRAGMA data_version poll gave before).
SQLITE_POLL_S = 0.05
_CONNECT_TIMEOUT_S = 10


class ChangeKind(StrEnum):
    """What changed about a node, as far as a server's memory is concerned."""

    PUBLISHED = "published"  # a new desired state
    FENCED = "fenced"  # the lease epoch moved up
    REVOKED = "revoked"  # its certificates were revoked by the operator
    ENROLLED = "enrolled"  # a new certificate; the earlier ones are superseded (revoked)


@dataclass(frozen=True)
class StateChange:
    kind: ChangeKind
    node_id: str

    def encode(self) -> str:
        return f"{self.kind.value} {self.node_id}"


def decode_change(text: str) -> StateChange | None:
    """The change ``text`` announces, or None if it is not one (then the reader re-reads every node)."""
    kind, sep, node_id = text.strip().partition(" ")
    if not sep or not node_id or " " in node_id:
        return None
    try:
        return StateChange(ChangeKind(kind), node_id)
    except ValueError:
        return None


def libpq_conninfo(database_url: str) -> str:
    """The devserver's database URL (``postgresql+psycopg://...``, as SQLAlchemy takes it) as libpq takes it."""
    from sqlalchemy import make_url  # the devserver extra brings it; only PostgreSQL comes here

    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def change_log_path(database_file: str) -> Path:
    """Where the announcements for the SQLite database ``database_file`` go."""
    return Path(f"{database_file}-changes")


class ChangeFeed(ABC):
    """One database's announcements: ``announce`` from any process that changed it; ``listen``, ``wait``, ``behind``
    and ``take`` in a server (``wait`` from its one watcher thread; ``take`` from it or from a request's thread, one
    at a time: the watcher serialises them)."""

    @abstractmethod
    def announce(self, change: StateChange) -> None:
        """Tell every server of ``change`` (already committed). Never raises: the change is saved whatever happens
        to its announcement, and the watchers' backstop finds it."""

    def listen(self) -> None:  # noqa: B027 - most feeds have nothing to set up
        """Start receiving: what is announced from now on, ``take`` returns."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until ``take`` may have something, or ``timeout_s`` passed."""

    def behind(self) -> bool:
        """Cheaply, from any thread: whether ``take`` has something a request should see applied before it answers.
        False where that cannot be known without a round trip (PostgreSQL)."""
        return False

    @abstractmethod
    def take(self) -> list[StateChange] | None:
        """The changes announced since the last call, without waiting; None: some may have been missed (re-read
        every node)."""

    def close(self) -> None:  # noqa: B027 - most feeds hold nothing
        pass


class InProcessFeed(ChangeFeed):
    """``:memory:``: no other process can reach the database, so there is nobody to tell."""

    def announce(self, change: StateChange) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def take(self) -> list[StateChange] | None:
        return []


class SqliteChangeLog(ChangeFeed):
    """A SQLite database's announcements: lines appended to the file beside it (see the module doc)."""

    def __init__(self, path: Path, *, poll_s: float = SQLITE_POLL_S, max_bytes: int = CHANGE_LOG_MAX_BYTES) -> None:
        self.path = path
        self._poll_s = poll_s
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._offset = 0
        self._inode: int | None = None

    def announce(self, change: StateChange) -> None:
        line = (change.encode() + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
                if os.fstat(fd).st_size > self._max_bytes:
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            _log.warning(
                "could not announce %s to %s (%s); running servers see it within their backstop (2 s)",
                change.encode(),
                self.path,
                exc,
            )

    def listen(self) -> None:
        with self._lock:
            self._inode, self._offset = self._where()

    def _where(self) -> tuple[int | None, int]:
        try:
            status = self.path.stat()
        except FileNotFoundError:
            return None, 0
        return status.st_ino, status.st_size

    def behind(self) -> bool:
        inode, size = self._where()
        return size != self._offset or (inode != self._inode and size > 0)

    def take(self) -> list[StateChange] | None:
        with self._lock:
            inode, size = self._where()
            if self._inode is None and self._offset == 0:
                self._inode = inode  # made since we looked (or still absent): read it from its start
            elif inode != self._inode or size < self._offset:
                # Truncated, replaced or removed: lines may be gone. What is there now was committed before it was
                # written, so re-reading every node covers it; read on from its end.
                self._inode, self._offset = inode, size
                return None
            if size == self._offset:
                return []
            try:
                with self.path.open("rb") as log:
                    log.seek(self._offset)
                    data = log.read(size - self._offset)
            except FileNotFoundError:
                self._inode, self._offset = None, 0
                return None
            # A line is read once it is whole: a writer may be half-way through one.
            whole = data.rfind(b"\n") + 1
            self._offset += whole
            changes = [decode_change(line) for line in data[:whole].decode("utf-8", "replace").splitlines()]
        if any(change is None for change in changes):
            return None
        return [change for change in changes if change is not None]

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.behind():
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return
            time.sleep(min(self._poll_s, left_s))


class PostgresChangeChannel(ChangeFeed):
    """A PostgreSQL database's announcements: NOTIFY on ``NOTIFY_CHANNEL`` (see the module doc).

    ``conninfo``: a libpq URI (``postgresql://USER:PASSWORD@HOST:PORT/DATABASE``). Two connections of its own,
    opened when first needed: one that announces (a CLI verb opens only this one), one that listens.
    """

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._send_lock = threading.Lock()
        self._sender: Any = None
        self._listener: Any = None

    def _connect(self) -> Any:
        import psycopg  # the devserver extra brings it; only PostgreSQL needs it

        return psycopg.connect(
            self._conninfo,
            autocommit=True,
            connect_timeout=_CONNECT_TIMEOUT_S,
            application_name="meridian-node-devserver changes",
        )

    def announce(self, change: StateChange) -> None:
        import psycopg

        with self._send_lock:
            for attempt in (1, 2):
                try:
                    if self._sender is None:
                        self._sender = self._connect()
                    self._sender.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, change.encode()))
                    return
                except psycopg.Error as exc:
                    self._close_sender()
                    if attempt == 2:
                        _log.warning(
                            "could not NOTIFY %s (%s); the replicas see it within their backstop (2 s)",
                            change.encode(),
                            exc,
                        )

    def _close_sender(self) -> None:
        _close_quietly(self._sender)
        self._sender = None

    def listen(self) -> None:
        self._listener = self._connect()
        self._listener.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def wait(self, timeout_s: float) -> None:
        if self._listener is None:
            time.sleep(timeout_s)  # take reconnects
            return
        try:
            select.select([self._listener.fileno()], [], [], timeout_s)
        except (OSError, ValueError):  # closed under us: take finds out and reconnects
            time.sleep(timeout_s)

    def take(self) -> list[StateChange] | None:
        import psycopg

        if self._listener is None:
            try:
                self.listen()
            except psycopg.Error as exc:
                _log.warning("cannot LISTEN for changes (%s); retrying, and re-reading every node meanwhile", exc)
                return None
            # Whatever was announced while nobody listened is lost: re-read every node.
            return None
        try:
            notices = list(self._listener.notifies(timeout=0))
        except psycopg.Error as exc:
            _log.warning("the LISTEN connection failed (%s); reconnecting", exc)
            self._close_listener()
            return None
        changes = [decode_change(notice.payload) for notice in notices]
        if any(change is None for change in changes):
            return None
        return [change for change in changes if change is not None]

    def _close_listener(self) -> None:
        _close_quietly(self._listener)
        self._listener = None

    def close(self) -> None:
        with self._send_lock:
            self._close_sender()
        self._close_listener()


def _close_quietly(connection: Any) -> None:
    """Close a psycopg ``connection`` if there is one: it is being dropped because it failed, or at shutdown, so
    whatever its close raises (a broken socket) changes nothing; the next use connects afresh."""
    if connection is not None:
        with contextlib.suppress(Exception):
            connection.close()

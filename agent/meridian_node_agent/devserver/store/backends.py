"""Where the devserver's database is (a path, ``:memory:`` or a URL), made into a SQLAlchemy engine per backend.

SQLite (the default, embedded: nothing to start):

* a file runs in WAL mode with ``synchronous=NORMAL`` (a commit waits for the WAL, not for a checkpoint; a power
  cut may lose the last commits but never corrupts the file) and a 10 s busy timeout, so the CLI's verbs write
  while ``serve`` runs. Foreign keys are enforced.
* the driver's own transaction handling is off (``isolation_level = None``, SQLAlchemy's documented pysqlite
  recipe): a write transaction starts with ``BEGIN IMMEDIATE`` (connections of ``WRITE_OPTION``), so the write
  lock is taken up front and assigning a generation or bumping an epoch cannot race another process; a read runs
  without ``BEGIN``, each statement seeing the latest commit of any process.
* ``:memory:`` is one connection for every thread (``StaticPool``): each SQLite connection to ``:memory:`` is a
  database of its own. ``database.Database`` serialises its calls on it with a lock.

PostgreSQL through psycopg 3 (``postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE``; ``postgresql://`` means
the same here): a pool of connections, the session time zone UTC, reads in autocommit (one round trip, no
``BEGIN``/``ROLLBACK`` around a ``SELECT``), writes in READ COMMITTED transactions whose row locks the store takes.
No ``pool_pre_ping``: it would add a round trip to every call; a connection that a server restart broke fails
one call, and the pool then replaces it.

``StatementCounter`` counts what the store sends: each statement SQLAlchemy runs through a cursor (an
``executemany`` counts once) and each commit. Transaction control (``BEGIN``, ``COMMIT``) is not a statement
here: psycopg sends its own, and SQLite's ``BEGIN IMMEDIATE`` goes straight to the driver for the same count on
both backends.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from meridian_node_agent.devserver.store.errors import DatabaseUnavailable

__all__ = [
    "WRITE_OPTION",
    "DatabaseLocation",
    "StatementCounter",
    "create_store_engine",
    "locate",
]

# The execution option that makes a SQLite transaction start with BEGIN IMMEDIATE.
WRITE_OPTION = "meridian_write"
SQLITE_BUSY_TIMEOUT_MS = 10_000
POSTGRESQL_CONNECT_TIMEOUT_S = 10
_EXAMPLES = "a SQLite file path, ':memory:', sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"


@dataclass(frozen=True)
class DatabaseLocation:
    """Where the database is: ``url`` as SQLAlchemy takes it, ``shown`` as the CLI prints it (no password)."""

    url: URL

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.url.get_backend_name()

    @property
    def memory(self) -> bool:
        return self.backend == "sqlite" and self.url.database in (None, "", ":memory:")

    @property
    def shown(self) -> str:
        if self.backend == "sqlite":
            return ":memory:" if self.memory else str(self.url.database)
        return self.url.render_as_string(hide_password=True)


def locate(location: str) -> DatabaseLocation:
    """``location`` as a ``DatabaseLocation``: a URL when it has ``://``, else a SQLite file path or ``:memory:``."""
    if "://" not in location:
        if not location:
            raise DatabaseUnavailable(f"the database location is empty; give {_EXAMPLES}")
        return DatabaseLocation(URL.create("sqlite+pysqlite", database=location))
    try:
        url = make_url(location)
    except ArgumentError as exc:
        raise DatabaseUnavailable(f"{_redacted(location)} is not a database URL ({exc}); give {_EXAMPLES}") from exc
    backend, driver = url.get_backend_name(), url.get_driver_name()
    if backend == "sqlite" and driver in ("pysqlite", "sqlite"):
        return DatabaseLocation(url.set(drivername="sqlite+pysqlite"))
    if backend == "postgresql" and driver in ("psycopg", "postgresql"):
        # SQLAlchemy's default PostgreSQL driver is psycopg2; the devserver ships psycopg 3.
        return DatabaseLocation(url.set(drivername="postgresql+psycopg"))
    raise DatabaseUnavailable(
        f"the database URL {url.render_as_string(hide_password=True)!r} names {url.drivername!r}; the devserver "
        f"speaks SQLite and PostgreSQL through psycopg 3: give {_EXAMPLES}"
    )


def create_store_engine(location: DatabaseLocation) -> Engine:
    """The engine for ``location``, its connections set up as the module doc says."""
    if location.backend == "postgresql":
        return create_engine(
            location.url,
            connect_args={
                "connect_timeout": POSTGRESQL_CONNECT_TIMEOUT_S,
                "options": "-c timezone=UTC",
                "application_name": "meridian-node-devserver",
            },
        )
    if location.memory:
        engine = create_engine(
            "sqlite+pysqlite:///:memory:", poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
    else:
        engine = create_engine(location.url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _sqlite_connect_setup(memory=location.memory))
    event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_connect_setup(*, memory: bool) -> Any:
    def setup(dbapi_connection: Any, _record: Any) -> None:
        driver = cast(sqlite3.Connection, dbapi_connection)
        # Transactions begin where _sqlite_begin says, not wherever the driver guesses.
        driver.isolation_level = None
        pragmas = [f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}", "PRAGMA foreign_keys = ON"]
        if not memory:
            pragmas += ["PRAGMA journal_mode = WAL", "PRAGMA synchronous = NORMAL"]
        for pragma in pragmas:
            driver.execute(pragma).close()

    return setup


def _sqlite_begin(conn: Connection) -> None:
    if conn.get_execution_options().get(WRITE_OPTION):
        driver = cast(sqlite3.Connection, conn.connection.driver_connection)
        driver.execute("BEGIN IMMEDIATE").close()


class StatementCounter:
    """Statements and commits an engine has sent since it was made (see the module doc for what counts)."""

    def __init__(self, engine: Engine) -> None:
        self._lock = threading.Lock()
        self._statements = 0
        self._commits = 0
        event.listen(engine, "before_cursor_execute", self._on_statement)
        event.listen(engine, "commit", self._on_commit)

    @property
    def statements(self) -> int:
        return self._statements

    @property
    def commits(self) -> int:
        return self._commits

    def _on_statement(self, *_args: Any) -> None:
        with self._lock:
            self._statements += 1

    def _on_commit(self, _conn: Connection) -> None:
        with self._lock:
            self._commits += 1


def _redacted(location: str) -> str:
    """``location`` without what follows ``:`` in its user part: a password must not reach a log or a terminal."""
    scheme, sep, rest = location.partition("://")
    user, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in user:
        return repr(location)
    return repr(f"{scheme}://{user.partition(':')[0]}:***@{host}")

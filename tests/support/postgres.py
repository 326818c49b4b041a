"""A real PostgreSQL for the devserver's store tests: Debian's server binaries (``initdb``, ``pg_ctl``), a cluster in
a temporary directory, started by the tests and stopped after them.

The binaries are where ``pg_config --bindir`` says, or the newest ``/usr/lib/postgresql/N/bin`` (Debian's
``postgresql`` package keeps them off PATH). ``initdb`` refuses to run as root, so under root the cluster belongs
to ``nobody`` (``runuser -u nobody``) and lives in a directory given to it; as anyone else it is theirs. It listens
on 127.0.0.1 on a free port (and a unix socket inside its own directory, never /var/run/postgresql), trusts
local connections (a throwaway cluster no one else can reach), and skips fsync: a crash loses a test database,
nothing else.

Pieces:

* ``PostgresServer`` / ``running_postgres``: one server; ``new_database`` makes an empty database and
  ``drop_database`` removes it (forcing its connections closed), so each test gets a database of its own.
* ``postgres_server``: the session's server as a pytest fixture. Without PostgreSQL its tests skip, except with
  ``MERIDIAN_REQUIRE_DOCKER=1`` (CI, where ``.ci/run`` installs it), where they fail. ``postgres_database``: an
  empty database of the test's own on it, its URL.
* ``store_backend``: an empty database for the devserver's store on each backend in turn (a SQLite file, then a
  database of its own on the session's PostgreSQL), so one test runs on both; ``StoreBackend.open`` opens one more
  ``store.Database`` on it (another server process, or the CLI), and every one opened is closed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from meridian_node_agent.devserver.store.database import Database

__all__ = [
    "PostgresServer",
    "PostgresUnavailableError",
    "StoreBackend",
    "find_bindir",
    "postgres_database",
    "postgres_server",
    "running_postgres",
    "store_backend",
]

SUPERUSER = "postgres"
# Who owns and runs the cluster when the tests run as root (initdb refuses root).
UNPRIVILEGED_USER = "nobody"
_START_TIMEOUT_S = 30
_START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it


class PostgresUnavailableError(RuntimeError):
    """PostgreSQL's server binaries are missing or the server did not come up; the message says how to fix it."""


def find_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if result.returncode == 0 and result.stdout.strip():
            candidates.append(Path(result.stdout.strip()))

    def version(path: Path) -> int:
        name = path.parent.name
        return int(name) if name.isdigit() else 0

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for candidate in candidates:
        if all(os.access(candidate / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return candidate
    return None


@dataclass
class PostgresServer:
    """A running cluster: ``port`` on 127.0.0.1, the superuser ``postgres`` with no password."""

    root: Path
    bindir: Path
    port: int
    as_user: list[str]  # the command prefix that runs a tool as the cluster's owner (empty: as ourselves)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database`` (the devserver's ``--database-url``)."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True, connect_timeout=10
        )

    def new_database(self, prefix: str = "meridian") -> str:
        """A new empty database; returns its name."""
        name = f"{prefix}_{secrets.token_hex(4)}"
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # the name is ours: a prefix and hex digits
        return name

    def drop_database(self, name: str) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextlib.contextmanager
    def database(self, prefix: str = "meridian") -> Iterator[str]:
        """A new empty database (``new_database``), dropped afterwards; yields its URL."""
        name = self.new_database(prefix)
        try:
            yield self.url(name)
        finally:
            self.drop_database(name)

    def stop(self) -> None:
        subprocess.run(
            [*self.as_user, str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"],
            capture_output=True,
            check=False,
        )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ, "LC_ALL": "C"})
    if result.returncode != 0:
        raise PostgresUnavailableError(f"{what} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server in a temporary directory on 127.0.0.1:<free port>; stopped and deleted afterwards."""
    bindir = find_bindir()
    if bindir is None:
        raise PostgresUnavailableError(
            "PostgreSQL's server binaries (initdb, pg_ctl, postgres) are not in pg_config --bindir nor in "
            "/usr/lib/postgresql/*/bin: install Debian's postgresql package (apt-get install postgresql; .ci/run does)"
        )
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="meridian-pg-"))
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise PostgresUnavailableError(
                "initdb refuses root, and runuser (util-linux) is missing to run it as nobody: install util-linux"
            )
        as_user = [runuser, "-u", UNPRIVILEGED_USER, "--"]
        shutil.chown(root, UNPRIVILEGED_USER)
    server: PostgresServer | None = None
    try:
        initdb = [str(bindir / "initdb"), "-D", str(root / "data"), "-U", SUPERUSER, "--auth=trust"]
        _run([*as_user, *initdb, "--encoding=UTF8", "--locale=C", "--no-sync"], "initdb")
        for attempt in range(1, _START_ATTEMPTS + 1):
            candidate = PostgresServer(root=root, bindir=bindir, port=_free_port(), as_user=as_user)
            options = (
                f"-c listen_addresses=127.0.0.1 -p {candidate.port} -k {root} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            )
            start = [str(bindir / "pg_ctl"), "-D", str(candidate.data_dir), "-l", str(root / "server.log")]
            try:
                _run([*as_user, *start, "-w", "-t", str(_START_TIMEOUT_S), "-o", options, "start"], "pg_ctl start")
            except PostgresUnavailableError as exc:
                candidate.stop()
                in_use = re.search(r"could not (bind|create listen)", candidate.log)
                if attempt == _START_ATTEMPTS or not in_use:
                    raise PostgresUnavailableError(f"{exc}; the server's log:\n{candidate.log[-2000:]}") from exc
                continue
            server = candidate
            break
        assert server is not None
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _required() -> bool:
    return os.environ.get("MERIDIAN_REQUIRE_DOCKER") == "1"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL; stopped when the session ends."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(running_postgres())
        except PostgresUnavailableError as exc:
            if _required():
                pytest.fail(f"{exc}; MERIDIAN_REQUIRE_DOCKER=1 forbids skipping", pytrace=False)
            pytest.skip(str(exc))
        yield server


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> Iterator[str]:
    """An empty database of the test's own on the session's PostgreSQL: its URL (the devserver's
    ``--database-url``); dropped afterwards."""
    with postgres_server.database("test") as url:
        yield url


@dataclass
class StoreBackend:
    """An empty database for the store: ``location`` as ``store.Database`` takes it (a path or a URL)."""

    name: str  # sqlite or postgresql
    location: str
    opened: list[Database] = field(default_factory=list)

    def open(self) -> Database:
        """One more ``Database`` on this database (migrating it, the first time)."""
        database = Database(self.location)
        self.opened.append(database)
        return database

    def close_all(self) -> None:
        for database in self.opened:
            database.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBackend]:
    """An empty database on each backend in turn (see the module doc)."""
    if request.param == "sqlite":
        backend = StoreBackend("sqlite", str(tmp_path / "store.sqlite3"))
        yield backend
        backend.close_all()
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with server.database("store") as url:
        backend = StoreBackend("postgresql", url)
        try:
            yield backend
        finally:
            backend.close_all()

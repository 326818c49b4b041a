"""bench/fleet.py's control plane: a real ``meridian-node-devserver serve`` process pinned to its cores, what
it costs (from /proc), what its database holds and commits, and the operator's side (tokens, publishes) in
this process on the same data dir.

The server binds 127.0.0.1, port 0 (the kernel's pick, read from its banner), and is stopped by SIGTERM when
the ``serving`` block ends. Its affinity is set right after it is started, before its interpreter has made a
thread, so every thread it makes later inherits it. Server CPU is utime + stime of /proc/<pid>/stat (all its
threads), RSS is VmRSS, descriptors are the entries of /proc/<pid>/fd.

``--database-url``: passed to ``serve --database-url`` and to ``open_control_plane(database=...)`` where the
devserver has that option (SQLAlchemy URLs: ``sqlite:///PATH``, ``postgresql+psycopg://...``), refused with that
reason by one that has not.
For PostgreSQL, transactions are ``pg_stat_database.xact_commit`` deltas and growth is ``pg_database_size``
(psycopg); SQLite has no commit counter a reader can see, so its transactions are not measured (None), and
its growth is the database file plus its WAL.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.tests.devserver.devserver_process import devserver_command
from ansible_collections.meridian.node.tests.support.processes import stop_process
from meridian_node_agent.devserver.control.plane import ControlPlane, DataDir, open_control_plane

__all__ = ["ProcSample", "Replicas", "ServerProcess", "open_control", "serving", "serving_replicas"]

_STARTUP_S = 60.0
_NO_DATABASE_URL = "this devserver has no --database-url: only its embedded SQLite can be measured"
_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ServerError(Exception):
    """The devserver could not be started or cannot do what the bench asks of it."""


@dataclass(frozen=True)
class ProcSample:
    at: float  # time.perf_counter()
    cpu_s: float
    rss_bytes: int
    descriptors: int


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    data_dir: Path
    host: str
    port: int
    ca_pem: str
    database_url: str | None

    @property
    def pid(self) -> int:
        return self.process.pid

    def sample(self) -> ProcSample:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat(5))
        rss = int(Path(f"/proc/{self.pid}/statm").read_text().split()[1]) * _PAGE
        return ProcSample(time.perf_counter(), cpu_s, rss, len(os.listdir(f"/proc/{self.pid}/fd")))

    def database_bytes(self) -> int | None:
        if self.database_url is not None:
            if not self.database_url.startswith("postgresql"):
                return None
            return int(_postgres_value(self.database_url, "SELECT pg_database_size(current_database())"))
        path = DataDir(self.data_dir).database
        return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())

    def transactions(self) -> int | None:
        """Commits so far, where the backend counts them (PostgreSQL); None for SQLite."""
        if self.database_url is None or not self.database_url.startswith("postgresql"):
            return None
        return int(
            _postgres_value(
                self.database_url, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            )
        )


@contextlib.contextmanager
def serving(
    data_dir: Path, *, cpus: set[int] | None = None, database_url: str | None = None
) -> Iterator[ServerProcess]:
    """The devserver on ``data_dir``, answering on 127.0.0.1, pinned to ``cpus`` (None: not pinned)."""
    extra = []
    if database_url is not None:
        if not _takes_database_url():
            raise ServerError(_NO_DATABASE_URL)
        extra = ["--database-url", database_url]
    data_dir.mkdir(parents=True, exist_ok=True)
    banner = data_dir.parent / f"{data_dir.name}.serve.out"
    log = data_dir.parent / f"{data_dir.name}.serve.err"
    with banner.open("wb") as stdout, log.open("ab") as stderr:
        process = subprocess.Popen(
            [*devserver_command(), "serve", "--data-dir", str(data_dir), "--host", "127.0.0.1", "--port", "0", *extra],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        if cpus:
            os.sched_setaffinity(process.pid, cpus)
        port, ca_path = _banner(process, banner, log)
        server = ServerProcess(process, data_dir, "127.0.0.1", port, Path(ca_path).read_text(), database_url)
        _wait_until_answering(server, log)
        yield server
    finally:
        stop_process(process)


@dataclass(frozen=True)
class Replicas:
    """One or more ``serve`` processes on one database and data dir, as one server to the bench: node ``i`` talks
    to member ``i`` modulo their number; CPU, RSS and descriptors are the members' sums."""

    members: list[ServerProcess]

    def address(self, index: int) -> tuple[str, int]:
        member = self.members[index % len(self.members)]
        return member.host, member.port

    @property
    def pid(self) -> int:
        return self.members[0].pid

    @property
    def ca_pem(self) -> str:
        return self.members[0].ca_pem

    @property
    def database_url(self) -> str | None:
        return self.members[0].database_url

    def sample(self) -> ProcSample:
        samples = [member.sample() for member in self.members]
        return ProcSample(
            at=samples[-1].at,
            cpu_s=sum(sample.cpu_s for sample in samples),
            rss_bytes=sum(sample.rss_bytes for sample in samples),
            descriptors=sum(sample.descriptors for sample in samples),
        )

    def database_bytes(self) -> int | None:
        return self.members[0].database_bytes()

    def transactions(self) -> int | None:
        return self.members[0].transactions()


@contextlib.contextmanager
def serving_replicas(
    data_dir: Path, count: int, *, cpus: set[int] | None = None, database_url: str | None = None
) -> Iterator[Replicas]:
    """``count`` servers on ``data_dir`` and ``database_url`` (more than one needs PostgreSQL: docs/SCALE.md)."""
    if count > 1 and (database_url is None or not database_url.startswith("postgresql")):
        raise ServerError(f"{count} replicas need a PostgreSQL --database-url: a SQLite file has one server")
    with contextlib.ExitStack() as stack:
        yield Replicas(
            [stack.enter_context(serving(data_dir, cpus=cpus, database_url=database_url)) for _ in range(count)]
        )


def open_control(data_dir: Path, database_url: str | None = None) -> ControlPlane:
    """The operator's side of the same control plane, in this process: tokens and publishes."""
    if database_url is not None and not _takes_database_url():
        raise ServerError(_NO_DATABASE_URL)
    return open_control_plane(data_dir, database=database_url)


@functools.cache
def _takes_database_url() -> bool:
    result = subprocess.run([*devserver_command(), "serve", "--help"], capture_output=True, text=True, check=False)
    return "--database-url" in result.stdout


def _banner(process: subprocess.Popen[bytes], banner: Path, log: Path) -> tuple[int, str]:
    deadline = time.monotonic() + _STARTUP_S
    while time.monotonic() < deadline:
        lines = banner.read_text().splitlines()
        values = dict(line.partition(": ")[::2] for line in lines if ": " in line)
        for line in lines:
            if line.startswith("listening on "):
                return int(line.rpartition(":")[2]), values["ca bundle"]
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise ServerError(f"the devserver did not start (exit {process.poll()}):\n{log.read_text()[-4000:]}")


def _wait_until_answering(server: ServerProcess, log: Path) -> None:
    context = ssl.create_default_context(cadata=server.ca_pem)
    deadline = time.monotonic() + _STARTUP_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        with contextlib.suppress(OSError):
            url = f"https://{server.host}:{server.port}/v1/healthz"
            with urllib.request.urlopen(url, context=context, timeout=2) as answer:
                if answer.status == 200:
                    return
        time.sleep(0.05)
    raise ServerError(
        f"the devserver never answered /v1/healthz (exit {server.process.poll()}):\n{log.read_text()[-4000:]}"
    )


def _postgres_value(url: str, query: str) -> Any:
    # psycopg comes with the devserver's PostgreSQL support; imported by name so that this module loads without it.
    psycopg: Any = importlib.import_module("psycopg")
    plain = "postgresql://" + url.partition("://")[2]  # a SQLAlchemy URL names its driver: postgresql+psycopg://
    with psycopg.connect(plain, autocommit=True) as connection:
        return connection.execute(query).fetchone()[0]

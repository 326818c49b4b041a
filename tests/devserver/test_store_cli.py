"""The devserver's verbs on PostgreSQL: ``serve`` and the operator's verbs in other processes, one database.

The URL reaches every process the way an operator would give it to all of them: ``MERIDIAN_DEVSERVER_DATABASE_URL``
(``--database-url`` says the same per command). What crosses processes here is what the SQLite file carried
before: tokens made by ``token``, a publish reaching a waiting long-poll, a fence applying to the next request.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.devserver.devserver_process import (
    DevServer,
    cli,
    enroll_node,
    running,
)
from ansible_collections.meridian.node.tests.support.postgres import PostgresServer
from meridian_node_agent.agent_side.control_client import DesiredStateFetch, FetchStatus
from meridian_node_agent.devserver.cli.common import DATABASE_URL_ENV


@pytest.fixture
def pg_server(tmp_path: Path, postgres_database: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[DevServer]:
    monkeypatch.setenv(DATABASE_URL_ENV, postgres_database)
    with running(tmp_path / "data") as started:
        yield started


def _publish(server: DevServer, tmp_path: Path, node_id: str) -> int:
    path = tmp_path / "desired.yaml"
    path.write_text(yaml.safe_dump({"engines": [], "artifacts": []}))
    output = server.cli("publish", node_id, str(path)).stdout
    return int(output.split("generation ")[1].split()[0])


def test_serve_on_postgresql_wakes_a_long_poll_when_the_cli_publishes(pg_server: DevServer, tmp_path: Path) -> None:
    with enroll_node(pg_server, tmp_path / "node", "gpu-pg-1") as client:
        _publish(pg_server, tmp_path, "gpu-pg-1")
        current = client.fetch_desired_state("gpu-pg-1")
        results: list[DesiredStateFetch | BaseException] = []

        def poll() -> None:
            try:
                results.append(client.fetch_desired_state("gpu-pg-1", etag=current.etag, wait_s=30))
            except BaseException as exc:
                results.append(exc)

        waiter = threading.Thread(target=poll)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not results  # parked: its ETag is the current one
        published = _publish(pg_server, tmp_path, "gpu-pg-1")
        waiter.join(timeout=40)

        assert len(results) == 1
        result = results[0]
        assert isinstance(result, DesiredStateFetch), result
        assert result.status is FetchStatus.NEW and result.generation == published == 2

        assert client.heartbeat("gpu-pg-1").epoch == 1
        assert pg_server.cli("fence", "gpu-pg-1").stdout.strip() == "node gpu-pg-1: lease epoch 2"
        assert client.heartbeat("gpu-pg-1").epoch == 2

    listing = pg_server.cli("nodes").stdout
    assert "gpu-pg-1" in listing.splitlines()[1]


def test_info_names_the_postgresql_database_without_its_password(
    tmp_path: Path, postgres_server: PostgresServer, postgres_database: str
) -> None:
    with_password = postgres_database.replace("postgres@", "postgres:not-checked-by-trust@")
    shown = cli(tmp_path / "data", "info", "--database-url", with_password).stdout

    assert f"database: {postgres_database.replace('postgres@', 'postgres:***@')}" in shown.splitlines()
    assert "not-checked-by-trust" not in shown


def test_database_and_database_url_together_are_a_usage_error(tmp_path: Path) -> None:
    result = cli(
        tmp_path / "data", "serve", "--database", ":memory:", "--database-url", "sqlite:///x.sqlite3", check=False
    )
    assert result.returncode == 2
    assert "--database and --database-url both name the database; give one of them" in result.stderr


def test_an_unreachable_database_url_is_a_usage_error_naming_the_fix(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = f"postgresql+psycopg://postgres:hunter2@127.0.0.1:{postgres_server.port}/never_created"
    result = cli(tmp_path / "data", "token", "t1", "--database-url", url, check=False)

    assert result.returncode == 2, result.stderr
    assert "cannot open the database postgresql+psycopg://postgres:***@127.0.0.1" in result.stderr
    assert "the database must exist" in result.stderr and "hunter2" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("missing", ["sqlalchemy", "alembic", "psycopg"])
def test_a_verb_without_the_database_packages_names_the_extra(tmp_path: Path, missing: str) -> None:
    """As on a host with the agent alone: the package is made unimportable in the verb's own process."""
    database = ["--database-url", "postgresql+psycopg://u@127.0.0.1:1/d"] if missing == "psycopg" else []
    script = (
        "import sys\n"
        f"sys.modules[{missing!r}] = None\n"
        "from meridian_node_agent.devserver.cli import main\n"
        f"sys.exit(main(['token', 't1', '--data-dir', {str(tmp_path / 'data')!r}, *{database!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)

    assert result.returncode == 2, result.stderr
    assert f"needs the Python package {missing!r}, which is not installed" in result.stderr
    assert "install meridian-node[devserver]" in result.stderr and "Traceback" not in result.stderr

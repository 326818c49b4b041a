"""The devserver's app served from the test's own process, so that a test can count the statements it sends and
step its background work.

``serving_in_process`` runs what ``meridian-node-devserver serve`` runs (``HotPath`` behind uvicorn's mutual TLS,
``server.uvicorn_config``) on a thread of the test process, on 127.0.0.1 at a free port. By default its periodic
work is off: the lease flush and the watcher's backstop are due only after an hour, so every database statement
during a test comes from what the test did (a request, ``hot.leases.flush()``, ``hot.watcher.backstop()``) or from
an announcement the watcher applied. ``feed`` replaces the database's change feed (``InProcessFeed()``: a server
that never hears other processes, as if every announcement were lost); ``lane=False`` serves FastAPI's app alone,
without ``SteadyCallLane`` in front, so that its heartbeat and desired-state routes answer.

``InProcessServer.cli`` runs a CLI verb beside the server, in a process of its own on the same database.

Also here, what the hot-path, fencing and replica tests share: an observation to post (``observation``, its
``applied_generation`` marking which one it was), how a CLI verb names a test's database (``database_url_args``),
``wait_for``, a liveness guard, and ``LongPoll``, a desired-state long-poll parked on a thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvicorn

from ansible_collections.meridian.node.plugins.module_utils.contracts import Observation, format_rfc3339
from ansible_collections.meridian.node.tests.devserver.devserver_process import cli
from meridian_node_agent.agent_side.control_client import ControlClient, ControlPlaneRejected, DesiredStateFetch
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.control.plane import ControlPlane, open_control_plane
from meridian_node_agent.devserver.serving.app import create_app
from meridian_node_agent.devserver.serving.hot_path import HotPath
from meridian_node_agent.devserver.serving.server import bind, prepare_tls, uvicorn_config
from meridian_node_agent.devserver.store.change_feed import ChangeFeed

__all__ = [
    "InProcessServer",
    "LongPoll",
    "database_url_args",
    "generation_of",
    "observation",
    "serving_in_process",
    "wait_for",
]

_HOUR_S = 3600.0


@dataclass
class InProcessServer:
    control: ControlPlane
    hot: HotPath
    base_url: str
    ca_bundle: Path
    database: str  # as ``serving_in_process`` was given it: a SQLite file path, or a URL

    @property
    def statements(self) -> int:
        """Statements this server's store has sent so far."""
        return self.control.store.statement_count

    def cli(self, *args: str) -> None:
        """A CLI verb in a process of its own, on this server's data dir and database: what an operator runs beside
        the server, heard by it only through the change feed."""
        cli(self.control.paths.root, *args, *database_url_args(self.database))

    def cli_publish(self, node_id: str, directory: Path) -> None:
        """``publish`` of a state with no engines and no artifacts to ``node_id`` by the CLI (see ``cli``), its
        document written in ``directory``."""
        document = directory / "desired.yaml"
        document.write_text("engines: []\nartifacts: []\n")
        self.cli("publish", node_id, str(document))

    def enroll(self, directory: Path, node_id: str, *, token_name: str | None = None) -> ControlClient:
        """Enroll ``node_id`` over HTTP with a token made for it (named ``token_name``, by default after the node: a
        second enrollment of one node names another); a client speaking as it, its identity in ``directory``."""
        token = self.control.create_token(token_name or f"t-{node_id}", node_id=node_id)
        identity = NodeIdentity(directory / node_id)
        with ControlClient(self.base_url, self.ca_bundle) as anonymous:
            identity.store(anonymous.enroll(node_id, token, identity.csr_pem(node_id)))
        return ControlClient(self.base_url, identity.ca_path, identity.cert_path, identity.key_path, timeout_s=30)


@contextmanager
def serving_in_process(
    data_dir: Path,
    database: str,
    *,
    feed: ChangeFeed | None = None,
    lease_flush_s: float = _HOUR_S,
    backstop_s: float = _HOUR_S,
    lane: bool = True,
) -> Iterator[InProcessServer]:
    control = open_control_plane(data_dir, database=database)
    if feed is not None:
        control.feed.close()
        control.feed = feed
    hot = HotPath(control, lease_flush_s=lease_flush_s, backstop_s=backstop_s)
    sock = bind("127.0.0.1", 0)
    tls = prepare_tls(control, "127.0.0.1")
    config = uvicorn_config(control, hot, tls)
    if not lane:
        config.app = create_app(control, hot)
    server = uvicorn.Server(config)
    hot.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="in-process-devserver", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the in-process devserver did not start"
            time.sleep(0.01)
        port = sock.getsockname()[1]
        yield InProcessServer(control, hot, f"https://127.0.0.1:{port}", tls.ca, database)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        hot.close()
        control.close()


class LongPoll:
    """``client.fetch_desired_state(node_id, etag, wait_s)`` on a thread of its own, started at once: its ``outcome``
    is the answer, or the refusal the call raised."""

    def __init__(self, client: ControlClient, node_id: str, etag: str | None, wait_s: float) -> None:
        self._answers: list[DesiredStateFetch | ControlPlaneRejected] = []
        self._thread = threading.Thread(
            target=self._poll, args=(client, node_id, etag, wait_s), name="long-poll", daemon=True
        )
        self._thread.start()

    def _poll(self, client: ControlClient, node_id: str, etag: str | None, wait_s: float) -> None:
        try:
            self._answers.append(client.fetch_desired_state(node_id, etag=etag, wait_s=wait_s))
        except ControlPlaneRejected as exc:
            self._answers.append(exc)

    @property
    def answered(self) -> bool:
        return not self._thread.is_alive()

    def answered_within(self, seconds: float) -> bool:
        """Whether it is answered within ``seconds``: a request whose ETag is current must still be parked after
        them (on a server in another process, the time it has to park)."""
        self._thread.join(timeout=seconds)
        return self.answered

    def outcome(self, what: str, timeout_s: float = 30) -> DesiredStateFetch | ControlPlaneRejected:
        """The answer, once it came within ``timeout_s`` (a liveness guard, see ``wait_for``)."""
        wait_for(lambda: self.answered, what, timeout_s)
        assert self._answers, "the long-poll ended without an answer or a refusal (see the thread's traceback)"
        return self._answers[0]


def observation(
    node_id: str, epoch: int, generation: int = 0, *, engines: list[dict[str, Any]] | None = None
) -> Observation:
    """An observation of ``node_id`` under ``epoch``; ``generation`` (its applied generation) tells posts apart;
    ``engines`` as the node reports them (none by default)."""
    return Observation.model_validate(
        {
            "apiVersion": "meridian.node/v1",
            "kind": "Observation",
            "node_id": node_id,
            "lease_epoch": epoch,
            "observed_at": format_rfc3339(datetime.now(UTC)),
            "mode": "managed-host",
            "applied_generation": generation,
            "gpu": {"nvml_available": False, "reason": "no NVIDIA driver on this test host"},
            "engines": engines or [],
        }
    )


def generation_of(body: str) -> int:
    """Which ``observation`` a stored body is."""
    return Observation.model_validate_json(body).applied_generation


def database_url_args(location: str) -> list[str]:
    """How a CLI verb names the database at ``location`` (a SQLite file path, or a URL)."""
    return ["--database-url", location if "://" in location else f"sqlite:///{location}"]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Until ``condition()`` holds: a liveness guard, for what happens in another thread or process. No assertion
    depends on how long it took."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s:g} s: {what}")
        time.sleep(0.01)

"""The devserver's app served from the test's own process, so that a test can count the statements it sends and
step its background work.

``serving_in_process`` runs what ``meridian-node-devserver serve`` runs (``HotPath`` behind uvicorn's mutual TLS,
``server.uvicorn_config``) on a thread of the test process, on 127.0.0.1 at a free port. By default its periodic
work is off: the lease flush and the watcher's backstop are due only after an hour, so every database statement
during a test comes from what the test did (a request, ``hot.leases.flush()``, ``hot.watcher.backstop()``) or from
an announcement the watcher applied. ``feed`` replaces the database's change feed (``InProcessFeed()``: a server
that never hears other processes, as if every announcement were lost).

Also here, what the hot-path, fencing and replica tests share: an observation to post (``observation``, its
``applied_generation`` marking which one it was), how a CLI verb names a test's database (``database_url_args``),
and ``wait_for``, a liveness guard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import uvicorn

from ansible_collections.meridian.node.plugins.module_utils.contracts import Observation, format_rfc3339
from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.change_feed import ChangeFeed
from meridian_node_agent.devserver.control import ControlPlane, open_control_plane
from meridian_node_agent.devserver.hot_path import HotPath
from meridian_node_agent.devserver.server import bind, prepare_tls, uvicorn_config

__all__ = [
    "InProcessServer",
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

    @property
    def statements(self) -> int:
        """Statements this server's store has sent so far."""
        return self.control.store.statement_count

    def enroll(self, directory: Path, node_id: str) -> ControlClient:
        """Enroll ``node_id`` over HTTP with a token made for it; a client speaking as it."""
        token = self.control.create_token(f"t-{node_id}", node_id=node_id)
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
) -> Iterator[InProcessServer]:
    control = open_control_plane(data_dir, database=database)
    if feed is not None:
        control.feed.close()
        control.feed = feed
    hot = HotPath(control, lease_flush_s=lease_flush_s, backstop_s=backstop_s)
    sock = bind("127.0.0.1", 0)
    tls = prepare_tls(control, "127.0.0.1")
    server = uvicorn.Server(uvicorn_config(control, hot, tls))
    hot.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="in-process-devserver", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the in-process devserver did not start"
            time.sleep(0.01)
        port = sock.getsockname()[1]
        yield InProcessServer(control, hot, f"https://127.0.0.1:{port}", tls.ca)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        hot.close()
        control.close()


def observation(node_id: str, epoch: int, generation: int = 0) -> Observation:
    """An observation of ``node_id`` under ``epoch``; ``generation`` (its applied generation) tells posts apart."""
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
            "engines": [],
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

"""The heartbeat and the desired-state fetch answered in front of FastAPI give the answers FastAPI's routes give.

``serve`` runs ``SteadyCallLane`` around the FastAPI app (``steady_calls.py``). Each request below is sent as an ASGI
call twice, once to the lane and once to the FastAPI app alone, against one started ``HotPath`` on a real database
with an enrolled node and its real certificate in the scope's TLS extension: the status, the headers and the body
must be the same, for answers and refusals alike. A request the lane does not take (another method on the same
path) must reach FastAPI untouched. Over real mutual TLS the lane serves ``tests/devserver/test_devserver_protocol.py``
and the schemathesis run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping
from datetime import UTC, datetime
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.in_process_server import InProcessServer, serving_in_process
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.serving.app import create_app
from meridian_node_agent.devserver.serving.steady_calls import SteadyCallLane

NODE = "lane-node"
QUIET = "lane-quiet"  # enrolled, nothing published to it


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessServer, str, str]]:
    directory = tmp_path_factory.mktemp("lane")
    with serving_in_process(directory / "data", str(directory / "data" / "devserver.db")) as server:
        server.enroll(directory, NODE).close()
        server.enroll(directory, QUIET).close()
        state = server.control.publish(NODE, {"engines": [], "artifacts": []})
        yield server, NodeIdentity(directory / NODE).cert_path.read_text(), state.etag


def served_directory(server: InProcessServer) -> Any:
    """Where the fixture enrolled its nodes: beside the server's data dir."""
    return server.control.paths.root.parent


def _scope(method: str, path: str, certificate_pem: str | None, *, query: bytes = b"", headers: Any = ()) -> Any:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "https",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query,
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8443),
        "extensions": {"tls": {"client_cert_chain": [certificate_pem] if certificate_pem else []}},
    }


def _answer(app: Any, scope: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    sent: list[MutableMapping[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(3600)  # the client stays: a long-poll ends by its wait, not by a disconnect
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(message for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return start["status"], list(start["headers"]), body


CASES: dict[str, tuple[str, str, bytes, tuple[tuple[bytes, bytes], ...], bool]] = {
    # name: (method, path, query, headers, with the node's certificate)
    "heartbeat": ("POST", f"/v1/nodes/{NODE}/heartbeat", b"", (), True),
    "heartbeat for another node": ("POST", f"/v1/nodes/{QUIET}/heartbeat", b"", (), True),
    "heartbeat of an unknown node": ("POST", "/v1/nodes/nobody/heartbeat", b"", (), True),
    "heartbeat without a certificate": ("POST", f"/v1/nodes/{NODE}/heartbeat", b"", (), False),
    "state": ("GET", f"/v1/nodes/{NODE}/desired-state", b"", (), True),
    "state, wait=0": ("GET", f"/v1/nodes/{NODE}/desired-state", b"wait=0", (), True),
    "state, wait not a number": ("GET", f"/v1/nodes/{NODE}/desired-state", b"wait=soon", (), True),
    "state, wait negative": ("GET", f"/v1/nodes/{NODE}/desired-state", b"wait=-1", (), True),
    "state, wait too long": ("GET", f"/v1/nodes/{NODE}/desired-state", b"wait=100000", (), True),
    "state, wait blank": ("GET", f"/v1/nodes/{NODE}/desired-state", b"wait=", (), True),
    "state, wait twice": ("GET", f"/v1/nodes/{NODE}/desired-state", b"wait=soon&wait=0", (), True),
    "state, any etag": ("GET", f"/v1/nodes/{NODE}/desired-state", b"", ((b"if-none-match", b"*"),), True),
    "state, other etag": ("GET", f"/v1/nodes/{NODE}/desired-state", b"", ((b"if-none-match", b'"other"'),), True),
    "state of another node": ("GET", f"/v1/nodes/{QUIET}/desired-state", b"", (), True),
    "heartbeat by GET (not taken)": ("GET", f"/v1/nodes/{NODE}/heartbeat", b"", (), True),
    "state by POST (not taken)": ("POST", f"/v1/nodes/{NODE}/desired-state", b"", (), True),
    "a path below (not taken)": ("GET", f"/v1/nodes/{NODE}/desired-state/x", b"", (), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_lane_answers_as_the_fastapi_route_does(
    served: tuple[InProcessServer, str, str], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, certificate_pem, _etag = served
    now = datetime.now(UTC)
    monkeypatch.setattr(server.control, "clock", lambda: now)  # one moment for both: a lease's bytes carry it
    method, path, query, headers, with_certificate = CASES[case]
    scope = _scope(method, path, certificate_pem if with_certificate else None, query=query, headers=headers)
    fastapi_app = create_app(server.control, server.hot)

    through_lane = _answer(SteadyCallLane(fastapi_app, server.hot), dict(scope))
    through_fastapi = _answer(fastapi_app, dict(scope))

    assert through_lane == through_fastapi


def test_a_known_etag_is_a_304_a_stale_one_a_200_and_nothing_a_204_through_the_lane(
    served: tuple[InProcessServer, str, str],
) -> None:
    server, certificate_pem, etag = served
    lane = SteadyCallLane(create_app(server.control, server.hot), server.hot)
    path = f"/v1/nodes/{NODE}/desired-state"

    quiet_pem = NodeIdentity(served_directory(server) / QUIET).cert_path.read_text()
    nothing = _answer(lane, _scope("GET", f"/v1/nodes/{QUIET}/desired-state", quiet_pem))
    unchanged = _answer(lane, _scope("GET", path, certificate_pem, headers=((b"if-none-match", etag.encode()),)))
    weak = _answer(lane, _scope("GET", path, certificate_pem, headers=((b"if-none-match", f"W/{etag}".encode()),)))
    fresh = _answer(lane, _scope("GET", path, certificate_pem))

    assert (nothing[0], nothing[2]) == (204, b"")
    assert (unchanged[0], unchanged[2]) == (304, b"")
    assert (b"etag", etag.encode()) in unchanged[1]
    assert weak[0] == 304
    assert fresh[0] == 200 and fresh[2] == server.control.store.latest_desired(NODE).envelope  # type: ignore[union-attr]


def test_the_lane_leaves_other_paths_to_fastapi(served: tuple[InProcessServer, str, str]) -> None:
    server, _certificate_pem, _etag = served
    lane = SteadyCallLane(create_app(server.control, server.hot), server.hot)

    health = _answer(lane, _scope("GET", "/v1/healthz", None))

    assert (health[0], health[2]) == (200, b'{"status":"ok"}')

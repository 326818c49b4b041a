"""The control client with several base URLs (replicas of one control plane): a call that cannot reach its replica
fails, and the next call goes to the next URL; a refusal or a stop does not move it. ``meridian-node enroll`` tries
the URLs in turn, and the agent's own backoff-and-retry reaches a live replica.

Everything is real: the module's devserver (a ``meridian-node-devserver serve`` process) is the live replica; a dead
one is a port on 127.0.0.1 that refuses connections (bound, so nothing else takes it, but not listening); a failing
one is the transport tests' scripted TLS server answering 503 with the devserver's own server certificate.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.agent.agent_side.test_control_transport import ScriptedServer, answer
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.node_env import make_node, publish
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from meridian_node_agent import cli
from meridian_node_agent.agent_side.control_client import (
    ControlCallStopped,
    ControlClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
)
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.serving.tls import server_ssl_context


def _refusing_port() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A replica that is down: connecting is refused."""
    with _refusing_port() as sock:
        yield f"https://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def identity(server: DevServer, tmp_path: Path, node_id: str) -> NodeIdentity:
    """The test's node, enrolled with the module's devserver."""
    node = make_node(server, tmp_path / "node", node_id, mode="observe-only")
    return NodeIdentity(node.config.identity_dir)


def _client(identity: NodeIdentity, primary: str, *replicas: str, interrupt: int | None = None) -> ControlClient:
    return ControlClient(
        primary,
        identity.ca_path,
        identity.cert_path,
        identity.key_path,
        timeout_s=10,
        interrupt=interrupt,
        replica_urls=replicas,
    )


def test_a_call_that_cannot_reach_its_replica_fails_and_the_next_call_goes_to_the_next(
    server: DevServer, identity: NodeIdentity, node_id: str, dead_url: str
) -> None:
    with _client(identity, dead_url, server.base_url) as client:
        assert client.base_urls == (dead_url, server.base_url)
        with pytest.raises(ControlPlaneUnavailable) as failed:
            client.heartbeat(node_id)
        moved_to = client.base_url
        lease = client.heartbeat(node_id)
        client.heartbeat(node_id)  # a replica that answers keeps the client
        stayed_on = client.base_url

    assert dead_url in str(failed.value)
    assert (failed.value.url, failed.value.next_url) == (dead_url, server.base_url)
    assert moved_to == stayed_on == server.base_url
    assert lease.node_id == node_id


def test_the_client_goes_round_the_urls_and_a_single_url_never_moves(identity: NodeIdentity, node_id: str) -> None:
    with _refusing_port() as first, _refusing_port() as second:
        urls = [f"https://127.0.0.1:{sock.getsockname()[1]}" for sock in (first, second)]
        failures: list[ControlPlaneUnavailable] = []
        with _client(identity, *urls) as client:
            for _ in range(3):
                with pytest.raises(ControlPlaneUnavailable) as failed:
                    client.heartbeat(node_id)
                failures.append(failed.value)
        with _client(identity, urls[0]) as alone, pytest.raises(ControlPlaneUnavailable) as single:
            alone.heartbeat(node_id)
        stays = alone.base_url

    assert [(f.url, f.next_url) for f in failures] == [(urls[0], urls[1]), (urls[1], urls[0]), (urls[0], urls[1])]
    assert (single.value.url, single.value.next_url, stays) == (None, None, urls[0])


def test_a_5xx_moves_the_client_to_the_next_replica(server: DevServer, identity: NodeIdentity, node_id: str) -> None:
    tls = server.data_dir / "tls"
    context = server_ssl_context(tls / "server.pem", tls / "server.key.pem", server.ca_bundle)
    body = b'{"reason": "unavailable", "detail": "replica is shutting down"}'
    failing = ScriptedServer(context, [[answer(body, status=b"503 Service Unavailable")]])
    try:
        with _client(identity, failing.url, server.base_url) as client:
            with pytest.raises(ControlPlaneUnavailable, match="unexpected HTTP 503") as failed:
                client.heartbeat(node_id)
            lease = client.heartbeat(node_id)
    finally:
        failing.close()

    assert (failed.value.url, failed.value.next_url) == (failing.url, server.base_url)
    assert lease.node_id == node_id
    assert failing.connections == 1


def test_a_refusal_does_not_move_the_client(
    server: DevServer, identity: NodeIdentity, node_id: str, dead_url: str
) -> None:
    with _client(identity, server.base_url, dead_url) as client:
        # The node's certificate speaks for node_id only: every replica refuses another node's heartbeat alike.
        with pytest.raises(ControlPlaneRejected) as refused:
            client.heartbeat(f"{node_id}-other")
        after_refusal = client.base_url
        lease = client.heartbeat(node_id)

    assert 400 <= refused.value.status < 500
    assert after_refusal == server.base_url
    assert lease.node_id == node_id


def test_a_stop_does_not_move_the_client(
    server: DevServer, identity: NodeIdentity, node_id: str, dead_url: str
) -> None:
    readable, writable = os.pipe()
    try:
        os.write(writable, b"x")
        with _client(identity, dead_url, server.base_url, interrupt=readable) as client:
            with pytest.raises(ControlCallStopped):
                client.heartbeat(node_id)
            still = client.base_url
    finally:
        os.close(readable)
        os.close(writable)

    assert still == dead_url


@pytest.mark.parametrize(
    ("primary", "replicas", "expected"),
    [
        ("https://a.example", ["http://b.example"], "must start with https://"),
        ("https://a.example", ["https://b.example", "https://b.example/"], "given twice"),
        ("https://a.example/", ["https://a.example"], "given twice"),
        ("https://a.example", "https://b.example", "a list of URLs, not one URL"),
    ],
)
def test_bad_replica_urls_are_refused(tmp_path: Path, primary: str, replicas: list[str], expected: str) -> None:
    with pytest.raises((ValueError, TypeError), match=expected):
        ControlClient(primary, tmp_path / "ca.pem", replica_urls=replicas)


def test_enroll_tries_the_urls_in_turn(
    server: DevServer, tmp_path: Path, node_id: str, dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    document = {
        "node_id": node_id,
        "state_dir": "state",
        "control_plane": {"url": dead_url, "replica_urls": [server.base_url]},
    }
    config.write_text(yaml.safe_dump(document))
    token = server.new_token_for(f"t-{node_id}", node_id)

    status = cli.main(["--config", str(config), "enroll", "--token", token, "--ca-bundle", str(server.ca_bundle)])
    out, err = capsys.readouterr()

    assert status == 0, err
    assert f"enrolled node {node_id}" in out
    [warning] = err.splitlines()
    assert warning.startswith(f"warning: POST {dead_url}/v1/enroll: ")
    assert warning.endswith(f"; trying the next control plane URL, {server.base_url}")
    assert NodeIdentity(tmp_path / "state" / "identity").enrolled


def test_enroll_with_every_url_down_fails_naming_the_last(
    server: DevServer, tmp_path: Path, dead_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with _refusing_port() as other:
        other_url = f"https://127.0.0.1:{other.getsockname()[1]}"
        config = tmp_path / "config.yaml"
        document = {"node_id": "nowhere-node", "control_plane": {"url": dead_url, "replica_urls": [other_url]}}
        config.write_text(yaml.safe_dump(document))
        status = cli.main(["--config", str(config), "enroll", "--token", "t", "--ca-bundle", str(server.ca_bundle)])
    _out, err = capsys.readouterr()

    assert status == 1
    first, last = err.splitlines()
    assert first.startswith(f"warning: POST {dead_url}/v1/enroll: ")
    assert first.endswith(f"; trying the next control plane URL, {other_url}")
    assert last.startswith(f"error: enrollment of node nowhere-node failed: POST {other_url}/v1/enroll: ")


def test_the_agent_backs_off_and_its_retry_reaches_a_live_replica(
    server: DevServer, tmp_path: Path, node_id: str, dead_url: str
) -> None:
    node = make_node(server, tmp_path / "node", node_id, mode="observe-only")
    node.configure(
        control_plane={
            "url": dead_url,
            "replica_urls": [server.base_url],
            "long_poll_seconds": 0,
            "heartbeat_seconds": 1,
        }
    )
    generation = publish(server, node_id)
    log, events = recording_logger(node_id)
    sleeps: list[float] = []
    agent = node.agent(log=log, sleep=sleeps.append)
    try:
        status = agent.run(max_cycles=2)
    finally:
        agent.close()

    assert status == 0
    [unavailable] = events.named("control-plane-unavailable")
    assert (unavailable["url"], unavailable["next_url"]) == (dead_url, server.base_url)
    assert dead_url in unavailable["error"]
    assert len(sleeps) == 1  # one backoff, then the retry went to the live replica
    assert (agent.counters.unavailable, agent.lease is not None) == (1, True)
    assert isinstance(agent.client, ControlClient) and agent.client.base_url == server.base_url
    assert events.named("desired-state-verified-not-applied")[0]["generation"] == generation

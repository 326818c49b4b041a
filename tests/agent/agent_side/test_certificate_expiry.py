"""An expired client certificate, against the real devserver over real mutual TLS: a refusal, not an outage.

The devserver issues four-second certificates (``--certificate-seconds 4``) and each test waits, in real
time, until its node's certificate has run out: the control plane's TLS layer and application then refuse
it for real. What the node must make of that: ``certificate-expired`` with the hint to enroll again, no
more connections with a certificate it knows is refused, backoff, and recovery on its own once the
operator has enrolled it again.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from ansible_collections.meridian.node.tests.support.devserver_fixtures import DevServerOptions
from ansible_collections.meridian.node.tests.support.node_env import make_node
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from meridian_node_agent.agent_side.control_client import (
    CertificateExpired,
    ControlClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
)
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.agent_side.status_file import read_status
from meridian_node_agent.devserver.serving.tls import server_ssl_context

LIFETIME_SECONDS = 4


DEVSERVER_OPTIONS = DevServerOptions(extra=["--certificate-seconds", str(LIFETIME_SECONDS)])


def _wait_until_expired(identity: NodeIdentity) -> datetime:
    not_after = identity.certificate().not_after
    while datetime.now(UTC) <= not_after + timedelta(milliseconds=200):
        time.sleep(0.1)
    return not_after


def _client(server: DevServer, identity: NodeIdentity, clock: Callable[[], datetime] | None = None) -> ControlClient:
    return ControlClient(
        server.base_url, identity.ca_path, identity.cert_path, identity.key_path, timeout_s=10, clock=clock
    )


def test_expired_certificate_is_a_refusal_with_a_hint_and_the_agent_backs_off_without_connecting(
    server: DevServer, tmp_path: Path, node_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(server, tmp_path / "node", node_id, mode="observe-only")
    identity = NodeIdentity(node.config.identity_dir)
    log, events = recording_logger(node_id)
    sleeps: list[float] = []
    agent = node.agent(log=log, sleep=sleeps.append)
    try:
        not_after = _wait_until_expired(identity)
        connections: list[object] = []
        real_connect = socket.create_connection

        def counting(*args: Any, **kwargs: Any) -> socket.socket:
            connections.append(args[0])
            return real_connect(*args, **kwargs)

        monkeypatch.setattr(socket, "create_connection", counting)

        assert agent.run(max_cycles=3) == 1

        assert (agent.counters.refused, agent.counters.unavailable) == (3, 0)
        refusals = events.named("control-plane-refused")
        assert len(refusals) == 3
        for refusal in refusals:
            assert (refusal["status"], refusal["reason"]) == (403, "certificate-expired")
            assert "enroll again" in refusal["hint"]
            assert str(identity.cert_path) in refusal["detail"]
            assert "enroll the node again" in refusal["detail"]
        assert not events.named("control-plane-unavailable")
        # Nothing was sent with a certificate the node knows is refused: no handshake, renewal included.
        assert connections == []
        renewal = events.named("certificate-renewal-failed")
        assert renewal and "certificate-expired" in renewal[0]["error"]
        # Backing off, growing: attempt n waits in [base/2, base], base = 1 s * 2^(n-1) (config backoff).
        assert len(sleeps) == 2
        assert 0.5 <= sleeps[0] <= 1.0 and 1.0 <= sleeps[1] <= 2.0
        status = read_status(node.state_dir)
        assert status is not None and status["counters"]["refused"] == 3
        assert agent.renewal.info is not None and agent.renewal.info.not_after == not_after

        # The operator enrolls the node again (another process writes new files); the running agent
        # picks up the new certificate by itself.
        monkeypatch.undo()
        enroll_node(server, identity.directory, node_id, server.new_token(f"again-{node_id}")).close()
        assert agent.run(max_cycles=1) == 0
        assert agent.lease is not None and agent.lease.node_id == node_id
    finally:
        if isinstance(agent.client, ControlClient):
            agent.client.close()


def test_control_plane_answering_403_certificate_expired_on_a_kept_alive_connection_is_reported_as_such(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    # This node's clock is an hour behind the control plane's, so the client cannot tell by itself; the
    # connection was opened while the certificate was valid, so the TLS layer does not get to refuse it.
    identity = NodeIdentity(tmp_path / node_id)
    enroll_node(server, identity.directory, node_id).close()
    with _client(server, identity, clock=lambda: datetime.now(UTC) - timedelta(hours=1)) as client:
        deadline = time.monotonic() + 4 * LIFETIME_SECONDS
        with pytest.raises(ControlPlaneRejected) as refused:
            while time.monotonic() < deadline:  # requests keep the connection from going idle
                client.heartbeat(node_id)
                time.sleep(0.2)
    assert isinstance(refused.value, CertificateExpired)
    assert (refused.value.status, refused.value.reason) == (403, "certificate-expired")
    assert "expired at" in refused.value.detail and "enroll it again" in refused.value.detail


def test_certificate_expiring_between_the_check_and_the_handshake_is_reported_as_expired(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    identity = NodeIdentity(tmp_path / node_id)
    enroll_node(server, identity.directory, node_id).close()
    not_after = _wait_until_expired(identity)
    reads = itertools.count()

    def clock() -> datetime:
        # The check before connecting still saw a valid certificate; by the time the handshake failed,
        # it had run out.
        return not_after - timedelta(seconds=1) if next(reads) == 0 else datetime.now(UTC)

    with _client(server, identity, clock=clock) as client, pytest.raises(CertificateExpired) as refused:
        client.heartbeat(node_id)
    assert refused.value.reason == "certificate-expired" and refused.value.not_after == not_after
    assert "the control plane refused it" in refused.value.detail
    assert isinstance(refused.value.__cause__, Exception)
    assert not isinstance(refused.value, ControlPlaneUnavailable)


def test_tls_alert_certificate_expired_from_a_server_whose_clock_runs_ahead_is_reported_as_expired(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    # A TLS 1.2 front end (here: the stdlib's TLS server with the devserver's own certificate and CA) does
    # send the alert that uvicorn drops. The node's clock is an hour behind, so only the alert can tell.
    identity = NodeIdentity(tmp_path / node_id)
    enroll_node(server, identity.directory, node_id).close()
    _wait_until_expired(identity)
    tls = server.data_dir / "tls"
    context = server_ssl_context(tls / "server.pem", tls / "server.key.pem", server.ca_bundle)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    refusals: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def handshake_once() -> None:
            connection, _ = listener.accept()
            with connection:
                try:
                    context.wrap_socket(connection, server_side=True).close()
                except ssl.SSLError as exc:
                    refusals.append(str(exc))

        front = threading.Thread(target=handshake_once, daemon=True)
        front.start()

        def behind() -> datetime:
            return datetime.now(UTC) - timedelta(hours=1)

        with (
            ControlClient(
                f"https://127.0.0.1:{port}",
                identity.ca_path,
                identity.cert_path,
                identity.key_path,
                timeout_s=10,
                clock=behind,
            ) as client,
            pytest.raises(CertificateExpired) as refused,
        ):
            client.heartbeat(node_id)
        front.join(timeout=10)
    assert refusals and "certificate has expired" in refusals[0]
    assert "as expired at the TLS handshake" in refused.value.detail
    assert "one of the two clocks is wrong" in refused.value.detail
    assert isinstance(refused.value.__cause__, ssl.SSLError)

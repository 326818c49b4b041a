"""In-process checks of the devserver's parts and the agent's identity and client, where a process is overkill."""

from __future__ import annotations

import re
import socket
import sqlite3
import ssl
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.routing import APIRoute

from ansible_collections.meridian.node.plugins.module_utils.contracts import EnrollmentRequest, EnrollmentResponse
from meridian_node_agent.agent_side import control_client as client_module
from meridian_node_agent.agent_side import identity as identity_module
from meridian_node_agent.agent_side.control_client import ControlClient, ControlPlaneUnavailable
from meridian_node_agent.agent_side.identity import IdentityError, NodeIdentity
from meridian_node_agent.devserver.control.ca import CertificateAuthority, CsrError, PeerCertificateError
from meridian_node_agent.devserver.control.plane import ControlPlane, ProtocolError, open_control_plane
from meridian_node_agent.devserver.serving.app import create_app
from meridian_node_agent.devserver.serving.tls import peer_certificate_der, server_ssl_context, tls_extension
from meridian_node_agent.devserver.store.database import Database, StoreConflict

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def control(tmp_path: Path) -> Iterator[ControlPlane]:
    opened = open_control_plane(tmp_path / "data", database=":memory:")
    yield opened
    opened.close()


def _enroll(control: ControlPlane, tmp_path: Path, node_id: str) -> tuple[NodeIdentity, EnrollmentResponse]:
    identity = NodeIdentity(tmp_path / node_id)
    token = control.create_token(f"t-{node_id}")
    response = control.enroll(EnrollmentRequest(node_id=node_id, token=token, csr_pem=identity.csr_pem(node_id)))
    identity.store(response)
    return identity, response


def _der(identity: NodeIdentity) -> bytes:
    return x509.load_pem_x509_certificate(identity.cert_path.read_bytes()).public_bytes(serialization.Encoding.DER)


def test_private_keys_are_0600_and_reused_when_the_data_dir_is_reopened(tmp_path: Path) -> None:
    first = open_control_plane(tmp_path / "data", database=":memory:")
    second = open_control_plane(tmp_path / "data", database=":memory:")
    for path in (first.ca.key_path, first.paths.control_key):
        assert (path.stat().st_mode & 0o777) == 0o600
    assert (first.paths.root.stat().st_mode & 0o777) == 0o700
    assert second.control_keyid == first.control_keyid
    assert second.ca.bundle_pem == first.ca.bundle_pem


def test_enrollment_tokens_are_stored_as_digests_never_as_values(tmp_path: Path) -> None:
    database = tmp_path / "db.sqlite3"
    store = Database(str(database))
    store.put_token("rack-1", "super-secret-token-value", NOW)
    store.close()
    dump = "\n".join(sqlite3.connect(database).iterdump())
    assert "rack-1" in dump
    assert "super-secret-token-value" not in dump


def test_memory_database_is_one_database_for_every_thread() -> None:
    store = Database(":memory:")
    seen: list[int] = []

    def publish() -> None:
        seen.append(
            store.publish("gpu-a", lambda generation, epoch: (b"{}", f'"{generation}-{epoch}"'), NOW).generation
        )

    worker = threading.Thread(target=publish)
    worker.start()
    worker.join()
    latest = store.latest_desired("gpu-a")
    assert seen == [1]
    assert latest is not None and latest.etag == '"1-1"'


def test_failed_signing_consumes_no_generation() -> None:
    store = Database(":memory:")

    def explode(generation: int, epoch: int) -> tuple[bytes, str]:
        raise ValueError("signing failed")

    with pytest.raises(ValueError, match="signing failed"):
        store.publish("gpu-a", explode, NOW)
    assert store.publish("gpu-a", lambda g, e: (b"{}", f'"{g}"'), NOW).generation == 1


def test_reused_token_name_after_use_is_a_conflict() -> None:
    store = Database(":memory:")
    store.put_token("t", "value-number-one", NOW)
    store.enroll(token="value-number-one", node_id="gpu-a", serial="1", not_after=NOW, lease_for=timedelta(1), now=NOW)
    with pytest.raises(StoreConflict) as conflict:
        store.put_token("t", "value-number-two", NOW)
    assert conflict.value.reason == "token-used"


def test_generated_tokens_never_look_like_a_command_line_option(control: ControlPlane) -> None:
    # token_urlsafe's alphabet includes '-': one token in 64 would start with it, and
    # 'meridian-node enroll --token -abc...' then fails as a missing argument.
    tokens = [control.create_token(f"dash-{i}") for i in range(300)]
    assert all(token.startswith("mnt_") and len(token) > 30 for token in tokens)
    assert len(set(tokens)) == len(tokens)


def test_token_value_starting_with_a_dash_is_refused(control: ControlPlane) -> None:
    with pytest.raises(ValueError, match="must not start with '-'"):
        control.create_token("dash", "-looks-like-an-option")


def test_certificate_of_another_ca_is_refused_by_the_application_too(control: ControlPlane, tmp_path: Path) -> None:
    # The TLS layer refuses it first; the application must not rely on that alone.
    stranger = CertificateAuthority(tmp_path / "stranger-ca")
    identity = NodeIdentity(tmp_path / "forged")
    issued = stranger.issue_node_certificate("gpu-a", identity.csr_pem("gpu-a"), days=1)
    der = x509.load_pem_x509_certificate(issued.pem.encode()).public_bytes(serialization.Encoding.DER)
    with pytest.raises(ProtocolError) as refused:
        control.authenticate(der, "gpu-a")
    assert (refused.value.status, refused.value.reason) == (403, "certificate-untrusted")


def test_expired_certificate_is_refused(control: ControlPlane, tmp_path: Path) -> None:
    identity, _ = _enroll(control, tmp_path, "gpu-a")
    with pytest.raises(PeerCertificateError, match=r"expired at .*enroll it again"):
        control.ca.check_peer(_der(identity), datetime.now(UTC) + timedelta(days=400))
    with pytest.raises(PeerCertificateError, match="not yet now"):
        control.ca.check_peer(_der(identity), datetime.now(UTC) - timedelta(days=1))


def test_expired_certificate_reaching_the_application_is_403_certificate_expired(
    control: ControlPlane, tmp_path: Path
) -> None:
    # The TLS layer refuses it first on a new connection; a kept-alive connection opened while it was
    # still valid reaches the application, which must say "expired", not "untrusted".
    identity, _ = _enroll(control, tmp_path, "gpu-a")
    later = datetime.now(UTC) + timedelta(days=400)
    a_year_on = ControlPlane(
        store=control.store,
        ca=control.ca,
        control_key=control.control_key,
        paths=control.paths,
        settings=control.settings,
        clock=lambda: later,
    )
    with pytest.raises(ProtocolError) as refused:
        a_year_on.authenticate(_der(identity), "gpu-a")
    assert (refused.value.status, refused.value.reason) == (403, "certificate-expired")
    assert "enroll it again" in refused.value.detail


def test_certificate_issued_by_the_ca_but_never_recorded_is_refused(control: ControlPlane, tmp_path: Path) -> None:
    identity = NodeIdentity(tmp_path / "side-door")
    issued = control.ca.issue_node_certificate("gpu-a", identity.csr_pem("gpu-a"), days=1)
    der = x509.load_pem_x509_certificate(issued.pem.encode()).public_bytes(serialization.Encoding.DER)
    with pytest.raises(ProtocolError) as refused:
        control.authenticate(der, "gpu-a")
    assert refused.value.reason == "certificate-unknown"


def test_enrolled_certificate_authenticates_only_its_own_node(control: ControlPlane, tmp_path: Path) -> None:
    identity, response = _enroll(control, tmp_path, "gpu-a")
    assert control.authenticate(_der(identity), "gpu-a") == "gpu-a"
    assert control.authenticate(_der(identity), None) == "gpu-a"
    with pytest.raises(ProtocolError) as refused:
        control.authenticate(_der(identity), "gpu-b")
    assert refused.value.reason == "wrong-node"
    assert response.lease.epoch == 1


def test_csr_with_an_unaccepted_key_type_is_refused(control: ControlPlane) -> None:
    key = ec.generate_private_key(ec.SECP521R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-a")]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    with pytest.raises(CsrError, match="secp521r1"):
        control.ca.issue_node_certificate("gpu-a", csr, days=1)


def test_identity_never_replaces_an_existing_key(tmp_path: Path) -> None:
    identity = NodeIdentity(tmp_path)
    assert identity.ensure_key() is True
    before = identity.key_path.read_bytes()
    assert identity.ensure_key() is False
    assert identity.key_path.read_bytes() == before
    assert (identity.key_path.stat().st_mode & 0o777) == 0o600


def test_identity_refuses_a_certificate_for_another_key(control: ControlPlane, tmp_path: Path) -> None:
    _, response = _enroll(control, tmp_path, "gpu-a")
    other = NodeIdentity(tmp_path / "other")
    other.ensure_key()
    with pytest.raises(IdentityError, match="different public key"):
        other.store(response)
    assert not other.cert_path.exists()


def test_identity_refuses_a_certificate_naming_another_node(control: ControlPlane, tmp_path: Path) -> None:
    identity, response = _enroll(control, tmp_path, "gpu-a")
    swapped = response.model_copy(update={"node_id": "gpu-b"})
    with pytest.raises(IdentityError, match="gpu-b"):
        identity.store(swapped)


def test_identity_reports_certificate_expiry(control: ControlPlane, tmp_path: Path) -> None:
    identity, _ = _enroll(control, tmp_path, "gpu-a")
    info = identity.certificate()
    assert info.node_ids == ("gpu-a",)
    assert "day(s) left" in identity.describe_expiry(info.not_after - timedelta(days=2))
    assert "expired" in identity.describe_expiry(info.not_after + timedelta(seconds=1))


def test_unreachable_control_plane_is_unavailable_not_rejected(control: ControlPlane) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with (
        ControlClient(f"https://127.0.0.1:{port}", control.ca.cert_path, timeout_s=2) as client,
        pytest.raises(ControlPlaneUnavailable),
    ):
        client.heartbeat("gpu-a")


def test_plain_http_control_plane_url_is_refused(control: ControlPlane) -> None:
    with pytest.raises(ValueError, match="https"):
        ControlClient("http://127.0.0.1:1", control.ca.cert_path)


def test_tls_extension_carries_the_client_certificate_of_a_real_handshake(
    control: ControlPlane, tmp_path: Path
) -> None:
    identity, _ = _enroll(control, tmp_path, "gpu-a")
    cert, key = control.ca.write_server_certificate(tmp_path / "tls", ["127.0.0.1"])
    server_context = server_ssl_context(cert, key, control.ca.cert_path)
    client_context = ssl.create_default_context(cafile=str(control.ca.cert_path))
    client_context.load_cert_chain(identity.cert_path, identity.key_path)

    left, right = socket.socketpair()
    extensions: list[dict[str, object]] = []

    def serve() -> None:
        with server_context.wrap_socket(left, server_side=True) as tls:
            extensions.append(tls_extension(tls))

    worker = threading.Thread(target=serve)
    worker.start()
    with client_context.wrap_socket(right, server_hostname="127.0.0.1"):
        worker.join(timeout=10)

    assert len(extensions) == 1
    scope = {"type": "http", "extensions": {"tls": extensions[0]}}
    assert peer_certificate_der(scope) == _der(identity)
    assert extensions[0]["client_cert_name"] == "CN=gpu-a"
    assert peer_certificate_der({"type": "http"}) is None


def test_protocol_doc_covers_every_endpoint_and_links_real_schemas(control: ControlPlane) -> None:
    doc_path = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
    doc = doc_path.read_text()
    routes = [route for route in create_app(control).routes if isinstance(route, APIRoute)]
    assert routes
    for route in routes:
        for method in sorted(route.methods or ()):
            assert f"`{method} {route.path}`" in doc, f"{method} {route.path} is not documented in {doc_path}"
    for schema in re.findall(r"\(\.\./(contracts/v1/[a-z-]+\.schema\.json)\)", doc):
        assert (doc_path.parents[1] / schema).is_file(), schema


def test_public_api_of_the_protocol_client_is_pinned() -> None:
    assert set(client_module.__all__) == {
        "CERTIFICATE_EXPIRED",
        "DEFAULT_MAX_RESPONSE_BYTES",
        "CertificateExpired",
        "ControlCallStopped",
        "ControlClient",
        "ControlPlaneError",
        "ControlPlaneRejected",
        "ControlPlaneUnavailable",
        "DesiredStateFetch",
        "FetchStatus",
    }
    assert set(identity_module.__all__) == {
        "CertificateInfo",
        "CertificateIssuer",
        "CertificateRenewal",
        "IdentityError",
        "NodeIdentity",
        "PendingKey",
        "certificate_info",
    }
    assert issubclass(client_module.ControlPlaneRejected, client_module.ControlPlaneError)
    assert issubclass(client_module.CertificateExpired, client_module.ControlPlaneRejected)
    assert issubclass(client_module.ControlPlaneUnavailable, client_module.ControlPlaneError)

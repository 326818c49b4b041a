"""``POST /v1/nodes/{node_id}/certificate`` against the real devserver process over real mutual TLS.

A renewal is authenticated by the node's current certificate exactly like every node endpoint, must
carry a CSR for a new key that names the node, and leaves the old certificate valid until it expires.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ansible_collections.meridian.node.tests.devserver.devserver_process import (
    DevServer,
    enroll_node,
    node_client,
    rejection,
    renew_identity,
)
from ansible_collections.meridian.node.tests.support.devserver_fixtures import DevServerOptions
from meridian_node_agent.agent_side.control_client import ControlClient, FetchStatus
from meridian_node_agent.agent_side.identity import NodeIdentity

DEVSERVER_OPTIONS = DevServerOptions(extra=["--certificate-seconds", "3600"])


def _csr(key: ec.EllipticCurvePrivateKey, common_name: str, dns_names: list[str]) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    if dns_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(name) for name in dns_names]), critical=False
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode("ascii")


def _renew(client: ControlClient, identity: NodeIdentity, node_id: str) -> ControlClient:
    """Renew through ``client`` and switch ``identity`` to the new pair; a client on the new pair."""
    renew_identity(client, identity, node_id)
    return node_client(client.base_url, identity)


def test_renewal_issues_a_certificate_for_the_new_key_that_works(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    identity = NodeIdentity(tmp_path / node_id)
    with enroll_node(server, identity.directory, node_id) as old_client:
        old = identity.certificate()
        old_key = identity.key_path.read_bytes()
        with _renew(old_client, identity, node_id) as new_client:
            new = identity.certificate()
            assert new.node_ids == (node_id,)
            assert new.serial != old.serial
            assert identity.key_path.read_bytes() != old_key
            certificate = x509.load_pem_x509_certificate(identity.cert_path.read_bytes())
            certificate.verify_directly_issued_by(x509.load_pem_x509_certificate(server.ca_bundle.read_bytes()))
            # --certificate-seconds 3600: an hour, backdated at most a tenth of that for clock skew.
            assert timedelta(seconds=3600) < new.not_after - new.not_before <= timedelta(seconds=3960)
            assert new_client.heartbeat(node_id).node_id == node_id
            assert new_client.fetch_desired_state(node_id).status == FetchStatus.NONE_PUBLISHED


def test_old_certificate_still_works_after_renewal_so_a_lost_answer_cannot_lock_the_node_out(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    old_dir = tmp_path / "old"
    with enroll_node(server, old_dir, node_id) as old_client:
        kept = tmp_path / "kept"
        kept.mkdir()
        for name in ("ca.pem", "node.pem", "node.key.pem"):
            (kept / name).write_bytes((old_dir / name).read_bytes())
        # The answer is "lost": the node never installs it.
        old_client.renew_certificate(node_id, NodeIdentity(tmp_path / "lost").new_key(node_id).csr_pem)
    with ControlClient(server.base_url, kept / "ca.pem", kept / "node.pem", kept / "node.key.pem") as retry:
        assert retry.heartbeat(node_id).node_id == node_id
        renewed = retry.renew_certificate(node_id, NodeIdentity(tmp_path / "again").new_key(node_id).csr_pem)
        assert renewed.node_id == node_id


def test_certificate_of_another_node_on_the_renewal_path_is_403(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    other = f"{node_id}-b"
    enroll_node(server, tmp_path / other, other).close()
    with enroll_node(server, tmp_path / node_id, node_id) as client:
        csr = NodeIdentity(tmp_path / "new").new_key(other).csr_pem
        refused = rejection(lambda: client.renew_certificate(other, csr))
    assert (refused.status, refused.reason) == (403, "wrong-node")
    assert node_id in refused.detail and other in refused.detail


def test_renewal_without_a_client_certificate_is_403(server: DevServer, tmp_path: Path, node_id: str) -> None:
    enroll_node(server, tmp_path / node_id, node_id).close()
    csr = NodeIdentity(tmp_path / "new").new_key(node_id).csr_pem
    with ControlClient(server.base_url, server.ca_bundle) as anonymous:
        refused = rejection(lambda: anonymous.renew_certificate(node_id, csr))
    assert (refused.status, refused.reason) == (403, "client-certificate-required")


def test_revoked_certificate_cannot_renew_itself_back_to_life(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with enroll_node(server, tmp_path / node_id, node_id) as client:
        server.cli("revoke", node_id)
        csr = NodeIdentity(tmp_path / "new").new_key(node_id).csr_pem
        refused = rejection(lambda: client.renew_certificate(node_id, csr))
    assert (refused.status, refused.reason) == (403, "certificate-revoked")


def test_revoking_a_node_also_revokes_its_renewed_certificates(server: DevServer, tmp_path: Path, node_id: str) -> None:
    identity = NodeIdentity(tmp_path / node_id)
    with enroll_node(server, identity.directory, node_id) as old_client, _renew(old_client, identity, node_id) as new:
        assert "revoked 2 certificate" in server.cli("revoke", node_id).stdout
        refused = rejection(lambda: new.heartbeat(node_id))
    assert (refused.status, refused.reason) == (403, "certificate-revoked")


def test_malformed_csr_is_refused_with_the_reason(server: DevServer, tmp_path: Path, node_id: str) -> None:
    garbage = "-----BEGIN CERTIFICATE REQUEST-----\nbm90IGEgQ1NS\n-----END CERTIFICATE REQUEST-----\n"
    with enroll_node(server, tmp_path / node_id, node_id) as client:
        refused = rejection(lambda: client.renew_certificate(node_id, garbage))
        assert (refused.status, refused.reason) == (422, "bad-csr")
        assert "not a PEM certificate signing request" in refused.detail
        # And the node's certificate is untouched by the refusal.
        assert client.heartbeat(node_id).node_id == node_id


def test_body_that_is_not_a_renewal_request_is_refused_naming_the_field(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    directory = tmp_path / node_id
    enroll_node(server, directory, node_id).close()
    answer = requests.post(
        f"{server.base_url}/v1/nodes/{node_id}/certificate",
        json={"node_id": node_id, "csr_pem": "hello"},
        cert=(str(directory / "node.pem"), str(directory / "node.key.pem")),
        verify=str(server.ca_bundle),
        timeout=10,
    )
    assert answer.status_code == 422
    assert answer.json()["reason"] == "invalid-request" and "csr_pem" in answer.json()["detail"]


@pytest.mark.parametrize(
    ("common_name", "dns_names"),
    [("{other}", ["{other}"]), ("{node}", ["{node}", "{other}"]), ("{node}", [])],
    ids=["names-another-node", "adds-another-node", "no-san"],
)
def test_csr_that_does_not_name_exactly_this_node_is_refused(
    server: DevServer, tmp_path: Path, node_id: str, common_name: str, dns_names: list[str]
) -> None:
    names = {"node": node_id, "other": "someone-else"}
    csr = _csr(
        ec.generate_private_key(ec.SECP256R1()), common_name.format(**names), [n.format(**names) for n in dns_names]
    )
    with enroll_node(server, tmp_path / node_id, node_id) as client:
        refused = rejection(lambda: client.renew_certificate(node_id, csr))
    assert (refused.status, refused.reason) == (422, "bad-csr")
    assert f"must name node {node_id!r}" in refused.detail


def test_csr_that_keeps_the_current_key_is_refused(server: DevServer, tmp_path: Path, node_id: str) -> None:
    identity = NodeIdentity(tmp_path / node_id)
    with enroll_node(server, identity.directory, node_id) as client:
        refused = rejection(lambda: client.renew_certificate(node_id, identity.csr_pem(node_id)))
    assert (refused.status, refused.reason) == (422, "bad-csr")
    assert "generate a new key" in refused.detail


def test_csr_with_a_refused_key_type_is_refused(server: DevServer, tmp_path: Path, node_id: str) -> None:
    csr = _csr(ec.generate_private_key(ec.SECP256K1()), node_id, [node_id])
    with enroll_node(server, tmp_path / node_id, node_id) as client:
        refused = rejection(lambda: client.renew_certificate(node_id, csr))
    assert (refused.status, refused.reason) == (422, "bad-csr")
    assert "secp256k1" in refused.detail

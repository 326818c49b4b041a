"""Enrolling a node again revokes its earlier certificates, against the real devserver over real mutual TLS.

A re-enrollment is how an operator recovers a node whose key leaked, was revoked, or was rebuilt: the
new certificate must be the only one left speaking for the node, so a copy of the old key (taken off a
disk image, a backup, a decommissioned host) stops working at its very next request.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

from ansible_collections.meridian.node.tests.devserver.devserver_process import (
    DevServer,
    enroll_node,
    node_client,
    rejection,
    renewed_node,
)
from meridian_node_agent.agent_side.control_client import ControlClient, FetchStatus
from meridian_node_agent.agent_side.identity import NodeIdentity


def test_copied_key_stops_working_once_the_node_enrolls_again(server: DevServer, tmp_path: Path, node_id: str) -> None:
    original = tmp_path / "original"
    enroll_node(server, original, node_id).close()
    stolen = tmp_path / "stolen"
    shutil.copytree(original, stolen)
    with node_client(server.base_url, NodeIdentity(stolen)) as thief:
        assert thief.heartbeat(node_id).node_id == node_id  # the copy works while it is the node's certificate

        # The operator rebuilds the node: a new key, a new token, a new certificate.
        with enroll_node(server, tmp_path / "rebuilt", node_id, server.new_token(f"again-{node_id}")) as rebuilt:
            refused = rejection(lambda: thief.heartbeat(node_id))
            assert (refused.status, refused.reason) == (403, "certificate-revoked")
            assert "enrolled again" in refused.detail and node_id in refused.detail
            # Every endpoint, not only the heartbeat.
            assert rejection(lambda: thief.fetch_desired_state(node_id)).reason == "certificate-revoked"
            assert rejection(lambda: thief.serving()).reason == "certificate-revoked"

            assert rebuilt.heartbeat(node_id).node_id == node_id
            assert rebuilt.fetch_desired_state(node_id).status == FetchStatus.NONE_PUBLISHED
    # The original files are the same certificate as the copy: refused as well.
    with node_client(server.base_url, NodeIdentity(original)) as old:
        assert rejection(lambda: old.heartbeat(node_id)).reason == "certificate-revoked"


def test_enrolling_again_also_revokes_the_certificates_renewal_issued(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    identity = renewed_node(server, tmp_path / "node", node_id)
    with node_client(server.base_url, NodeIdentity(identity.directory)) as renewed:
        assert renewed.heartbeat(node_id).node_id == node_id
        enroll_node(server, tmp_path / "elsewhere", node_id, server.new_token(f"again-{node_id}")).close()
        assert rejection(lambda: renewed.heartbeat(node_id)).reason == "certificate-revoked"
        # Nor can a superseded certificate renew itself back to life.
        csr = NodeIdentity(tmp_path / "new").new_key(node_id).csr_pem
        assert rejection(lambda: renewed.renew_certificate(node_id, csr)).reason == "certificate-revoked"
    rows = [line for line in server.cli("nodes").stdout.splitlines() if line.split()[:1] == [node_id]]
    assert len(rows) == 1


def test_a_refused_enrollment_revokes_nothing(server: DevServer, tmp_path: Path, node_id: str) -> None:
    used = server.new_token(f"t-{node_id}")
    with enroll_node(server, tmp_path / "node", node_id, used) as client:
        intruder = NodeIdentity(tmp_path / "intruder")
        other = server.new_token_for(f"bound-{node_id}", f"{node_id}-other")
        with ControlClient(server.base_url, server.ca_bundle) as anonymous:
            for token, reason in (
                (used, "token-used"),
                (other, "token-wrong-node"),
                ("mnt_never-issued", "token-unknown"),
            ):
                refused = rejection(partial(anonymous.enroll, node_id, token, intruder.csr_pem(node_id)))
                assert refused.reason == reason
        assert client.heartbeat(node_id).node_id == node_id


def test_the_server_logs_which_node_enrolled_again_and_how_many_certificates_went(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    enroll_node(server, tmp_path / "first", node_id).close()
    assert f"node {node_id!r} enrolled again" not in server.stderr()
    enroll_node(server, tmp_path / "second", node_id, server.new_token(f"again-{node_id}")).close()
    assert (
        f"node {node_id!r} enrolled again from 127.0.0.1: its 1 earlier certificate(s) are revoked" in server.stderr()
    )

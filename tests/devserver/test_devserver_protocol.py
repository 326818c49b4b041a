"""Protocol v1 end to end: the real devserver process on 127.0.0.1, real TLS, the agent's real client.

One server per module; each test uses its own node ids so the tests stay independent. Operator verbs
(``token``, ``publish``, ``fence``, ``revoke``) run as separate processes against the same data dir,
exactly as an operator would run them next to ``serve``.
"""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from cryptography import x509

from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from ansible_collections.meridian.node.tests.devserver.in_process_server import LongPoll, observation
from ansible_collections.meridian.node.tests.support.devserver_fixtures import DevServerOptions
from ansible_collections.meridian.node.tests.support.http_fixture import write_self_signed
from meridian_node_agent.agent_side.control_client import (
    ControlClient,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    DesiredStateFetch,
    FetchStatus,
)
from meridian_node_agent.agent_side.identity import NodeIdentity

_names = itertools.count(1)


DEVSERVER_OPTIONS = DevServerOptions(tokens=["banner:auto", "fixed:fixed-token-value"])


def _enroll(server: DevServer, tmp_path: Path, node_id: str) -> ControlClient:
    return enroll_node(server, tmp_path / node_id, node_id)


def _publish(server: DevServer, tmp_path: Path, node_id: str, document: dict[str, Any] | None = None) -> int:
    path = tmp_path / f"desired-{node_id}-{next(_names)}.yaml"
    path.write_text(yaml.safe_dump(document if document is not None else {"engines": [], "artifacts": []}))
    output = server.cli("publish", node_id, str(path)).stdout
    return int(output.split("generation ")[1].split()[0])


def _engine(name: str, port: int, *, ready: bool, draining: bool) -> dict[str, Any]:
    return {
        "name": name,
        "managed": True,
        "driver": "vllm",
        "image": "registry.local/vllm@sha256:" + "a" * 64,
        "state": "running",
        "ready": ready,
        "draining": draining,
        "port": port,
        "served_model_name": f"model-{name}",
    }


# Enrollment


def test_enrollment_with_token_issues_certificate_naming_the_node(server: DevServer, tmp_path: Path) -> None:
    identity = NodeIdentity(tmp_path / "id")
    with ControlClient(server.base_url, server.ca_bundle) as anonymous:
        response = anonymous.enroll("gpu-enroll-1", server.tokens["banner"], identity.csr_pem("gpu-enroll-1"))
    info = identity.store(response)

    assert response.node_id == "gpu-enroll-1"
    assert info.node_ids == ("gpu-enroll-1",)
    certificate = x509.load_pem_x509_certificate(response.certificate_pem.encode())
    certificate.verify_directly_issued_by(x509.load_pem_x509_certificate(server.ca_bundle.read_bytes()))
    assert response.ca_bundle_pem == server.ca_bundle.read_text()
    assert response.lease.node_id == "gpu-enroll-1"
    assert response.lease.epoch == 1
    assert response.lease.expires_at > response.lease.renewed_at
    assert (identity.key_path.stat().st_mode & 0o777) == 0o600


def test_reused_enrollment_token_is_refused(server: DevServer, tmp_path: Path, node_id: str) -> None:
    token = server.new_token(f"once-{node_id}")
    enroll_node(server, tmp_path / "first", node_id, token).close()

    with pytest.raises(ControlPlaneRejected) as refused:
        enroll_node(server, tmp_path / "second", f"{node_id}-thief", token)
    assert refused.value.status == 403
    assert refused.value.reason == "token-used"
    assert "one-time" in refused.value.detail


def test_unknown_enrollment_token_is_refused(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with pytest.raises(ControlPlaneRejected) as refused:
        enroll_node(server, tmp_path, node_id, "a-token-nobody-created")
    assert (refused.value.status, refused.value.reason) == (403, "token-unknown")


def test_enrollment_with_a_garbage_csr_is_refused_and_keeps_the_token(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    token = server.new_token(f"csr-{node_id}")
    bogus = "-----BEGIN CERTIFICATE REQUEST-----\nbm90IGEgY3Ny\n-----END CERTIFICATE REQUEST-----\n"
    with ControlClient(server.base_url, server.ca_bundle) as anonymous, pytest.raises(ControlPlaneRejected) as bad:
        anonymous.enroll(node_id, token, bogus)
    assert (bad.value.status, bad.value.reason) == (422, "bad-csr")

    enroll_node(server, tmp_path, node_id, token).close()


# Mutual TLS


def test_call_without_client_certificate_after_enrollment_is_refused(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _enroll(server, tmp_path, node_id).close()
    with ControlClient(server.base_url, server.ca_bundle) as anonymous:
        for call in (lambda: anonymous.heartbeat(node_id), lambda: anonymous.fetch_desired_state(node_id)):
            with pytest.raises(ControlPlaneRejected) as refused:
                call()
            assert (refused.value.status, refused.value.reason) == (403, "client-certificate-required")
        with pytest.raises(ControlPlaneRejected):
            anonymous.serving()


def test_certificate_for_node_a_on_node_b_path_is_403(server: DevServer, tmp_path: Path, node_id: str) -> None:
    node_b = f"{node_id}-b"
    client_a = _enroll(server, tmp_path, node_id)
    _enroll(server, tmp_path, node_b).close()
    lease_b = server.cli("nodes").stdout
    assert node_b in lease_b

    with client_a:
        for call in (
            lambda: client_a.heartbeat(node_b),
            lambda: client_a.fetch_desired_state(node_b),
            lambda: client_a.post_observation(observation(node_b, 1)),
        ):
            with pytest.raises(ControlPlaneRejected) as refused:
                call()
            assert (refused.value.status, refused.value.reason) == (403, "wrong-node")
            assert node_id in refused.value.detail and node_b in refused.value.detail
        assert client_a.heartbeat(node_id).node_id == node_id


def test_client_certificate_from_a_foreign_ca_fails_the_handshake(server: DevServer, tmp_path: Path) -> None:
    now = datetime.now(UTC)
    cert_path, key_path = tmp_path / "forged.pem", tmp_path / "forged.key.pem"
    write_self_signed(
        cert_path,
        key_path,
        "gpu-forged",
        not_before=now.replace(year=now.year - 1),
        not_after=now.replace(year=now.year + 1),
    )
    with (
        ControlClient(server.base_url, server.ca_bundle, cert_path, key_path) as forger,
        pytest.raises(ControlPlaneUnavailable),
    ):
        forger.heartbeat("gpu-forged")


def test_revoked_certificate_is_refused_on_the_next_request(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        client.heartbeat(node_id)
        assert "revoked 1 certificate" in server.cli("revoke", node_id).stdout

        with pytest.raises(ControlPlaneRejected) as refused:
            client.heartbeat(node_id)
        assert (refused.value.status, refused.value.reason) == (403, "certificate-revoked")
        with pytest.raises(ControlPlaneRejected):
            client.fetch_desired_state(node_id)

    # Recovery is a fresh enrollment with a new token; the old certificate stays revoked.
    token = server.new_token(f"again-{node_id}")
    with enroll_node(server, tmp_path / "re-enrolled", node_id, token) as fresh:
        assert fresh.heartbeat(node_id).node_id == node_id


# Leases


def test_heartbeat_keeps_the_epoch_and_fence_bumps_it(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        first = client.heartbeat(node_id)
        second = client.heartbeat(node_id)
        assert first.epoch == second.epoch == 1
        assert second.expires_at >= first.expires_at

        assert f"lease epoch {first.epoch + 1}" in server.cli("fence", node_id).stdout
        fenced = client.heartbeat(node_id)
        assert fenced.epoch == first.epoch + 1
        assert client.heartbeat(node_id).epoch == fenced.epoch


def test_fence_of_an_unknown_node_is_refused(server: DevServer) -> None:
    result = server.cli("fence", "gpu-nobody", check=False)
    assert result.returncode == 1
    assert "gpu-nobody" in result.stderr


# Desired state


def _policy_trusting(server: DevServer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "policy.yaml"
    path.write_text(
        yaml.safe_dump({"trust": {"control": {"threshold": 1, "public_keys": [str(server.control_public_key)]}}})
    )
    return path


def test_published_state_is_a_signed_envelope_the_trust_core_accepts(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        assert client.fetch_desired_state(node_id).status is FetchStatus.NONE_PUBLISHED
        server.cli("fence", node_id)
        engine = {
            "name": "chat",
            "driver": "vllm",
            "image": "registry.local/vllm@sha256:" + "b" * 64,
            "model": {"name": "tiny"},
            "port": 18080,
        }
        generation = _publish(server, tmp_path, node_id, {"engines": [engine]})
        fetched = client.fetch_desired_state(node_id)

    assert fetched.status is FetchStatus.NEW and fetched.envelope is not None
    assert fetched.generation == generation
    policy = load_policy(_policy_trusting(server, tmp_path / "policy"))
    verified = trust.verify_desired_state(
        fetched.envelope, policy, node_id=node_id, now=datetime.now(UTC), applied=trust.AppliedState()
    )
    assert verified.state.generation == generation
    assert verified.state.lease_epoch == 2
    assert [e.name for e in verified.state.engines] == ["chat"]

    # Another node must not accept it, whoever signed it.
    with pytest.raises(trust.Rejection) as rejected:
        trust.verify_desired_state(
            fetched.envelope, policy, node_id="gpu-other", now=datetime.now(UTC), applied=trust.AppliedState()
        )
    assert rejected.value.code is trust.RejectionCode.WRONG_NODE


def test_if_none_match_with_the_current_etag_is_304(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        _publish(server, tmp_path, node_id)
        first = client.fetch_desired_state(node_id)
        again = client.fetch_desired_state(node_id, etag=first.etag)
        short_wait = client.fetch_desired_state(node_id, etag=first.etag, wait_s=0.2)
        stale = client.fetch_desired_state(node_id, etag='"not-the-current-etag"')

    assert first.status is FetchStatus.NEW and first.etag
    assert again == DesiredStateFetch(FetchStatus.NOT_MODIFIED, etag=first.etag, generation=first.generation)
    assert short_wait.status is FetchStatus.NOT_MODIFIED
    assert stale.status is FetchStatus.NEW and stale.envelope == first.envelope


def test_publish_generations_strictly_increase(server: DevServer, tmp_path: Path, node_id: str) -> None:
    generations = [_publish(server, tmp_path, node_id) for _ in range(3)]
    assert generations == [1, 2, 3]


def test_long_poll_returns_the_state_published_by_another_process(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        _publish(server, tmp_path, node_id)
        current = client.fetch_desired_state(node_id)
        poll = LongPoll(client, node_id, current.etag, wait_s=30)
        # The poller must still be parked when the publish happens (its ETag is current, so the server
        # holds the request); its answer must then be the new generation, not a 304.
        assert not poll.answered_within(1.0)
        published = _publish(server, tmp_path, node_id)
        result = poll.outcome("the publish by another process answered the long-poll", 40)

    assert isinstance(result, DesiredStateFetch), result
    assert result.status is FetchStatus.NEW
    assert result.generation == published == (current.generation or 0) + 1
    assert result.envelope is not None and json.loads(result.envelope)["payloadType"].endswith("desired-state.v1+json")


def test_publish_out_writes_the_envelope_the_node_fetches_byte_for_byte(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        path = tmp_path / "desired.yaml"
        path.write_text(yaml.safe_dump({"engines": [], "artifacts": []}))
        out = tmp_path / "state.json"
        server.cli("publish", node_id, str(path), "--out", str(out))
        fetched = client.fetch_desired_state(node_id)

    assert fetched.envelope is not None and out.read_bytes() == fetched.envelope
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no .part left


def test_publish_out_to_an_unwritable_place_says_the_state_was_published(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    path = tmp_path / "desired.yaml"
    path.write_text(yaml.safe_dump({"engines": [], "artifacts": []}))
    result = server.cli("publish", node_id, str(path), "--out", str(tmp_path / "missing" / "state.json"), check=False)

    assert result.returncode == 1
    assert "the state was published" in result.stderr and "missing/state.json" in result.stderr
    assert _publish(server, tmp_path, node_id) == 2


def test_publish_refuses_a_document_that_sets_server_assigned_fields(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    path = tmp_path / "desired.yaml"
    path.write_text(yaml.safe_dump({"generation": 99, "engines": []}))
    result = server.cli("publish", node_id, str(path), check=False)
    assert result.returncode == 1
    assert "generation" in result.stderr


def test_publish_refuses_an_invalid_state_and_assigns_no_generation(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    bad = {"engines": [{"name": "x", "driver": "not-a-driver", "image": "a@sha256:" + "c" * 64, "port": 1}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = server.cli("publish", node_id, str(path), check=False)
    assert result.returncode == 1
    assert "driver" in result.stderr
    assert _publish(server, tmp_path, node_id) == 1


# Observations and the serving projection


def test_observation_with_a_stale_epoch_is_409(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        epoch = client.heartbeat(node_id).epoch
        client.post_observation(observation(node_id, epoch))
        server.cli("fence", node_id)

        with pytest.raises(ControlPlaneRejected) as refused:
            client.post_observation(observation(node_id, epoch))
        assert (refused.value.status, refused.value.reason) == (409, "stale-epoch")
        assert f"epoch {epoch}" in refused.value.detail and f"epoch {epoch + 1}" in refused.value.detail

        with pytest.raises(ControlPlaneRejected) as future:
            client.post_observation(observation(node_id, epoch + 5))
        assert (future.value.status, future.value.reason) == (409, "future-epoch")

        client.post_observation(observation(node_id, client.heartbeat(node_id).epoch))


def test_serving_projection_lists_only_ready_engines_that_are_not_draining(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        engines = [
            _engine("serving", 19001, ready=True, draining=False),
            _engine("draining", 19002, ready=True, draining=True),
            _engine("starting", 19003, ready=False, draining=False),
        ]
        client.post_observation(observation(node_id, client.heartbeat(node_id).epoch, engines=engines))
        ours = [e for e in client.serving().endpoints if e.node_id == node_id]
        assert [(e.engine, e.address, e.served_model_name, e.driver) for e in ours] == [
            ("serving", "127.0.0.1:19001", "model-serving", "vllm")
        ]

        # The next observation replaces the last one: the engine is now draining, so it leaves the projection.
        engines[0]["draining"] = True
        client.post_observation(observation(node_id, client.heartbeat(node_id).epoch, engines=engines))
        assert [e for e in client.serving().endpoints if e.node_id == node_id] == []


def test_revoked_node_leaves_the_serving_projection(server: DevServer, tmp_path: Path, node_id: str) -> None:
    watcher = _enroll(server, tmp_path, f"{node_id}-watcher")
    with _enroll(server, tmp_path, node_id) as client, watcher:
        epoch = client.heartbeat(node_id).epoch
        client.post_observation(observation(node_id, epoch, engines=[_engine("e", 19010, ready=True, draining=False)]))
        assert any(e.node_id == node_id for e in watcher.serving().endpoints)
        server.cli("revoke", node_id)
        assert not any(e.node_id == node_id for e in watcher.serving().endpoints)


def _post_raw_observation(server: DevServer, tmp_path: Path, node_id: str, body: bytes) -> requests.Response:
    """POST ``body`` as is (not through the client, which would refuse to send it) to ``node_id``'s observations
    URL over mutual TLS, with the identity ``_enroll`` gave the node under ``tmp_path``."""
    identity = NodeIdentity(tmp_path / node_id)
    return requests.post(
        f"{server.base_url}/v1/nodes/{node_id}/observations",
        data=body,
        headers={"Content-Type": "application/json"},
        verify=str(identity.ca_path),
        cert=(str(identity.cert_path), str(identity.key_path)),
        timeout=10,
    )


def test_observation_about_another_node_is_refused(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with _enroll(server, tmp_path, node_id) as client:
        epoch = client.heartbeat(node_id).epoch
        foreign = observation("gpu-someone-else", epoch)
        body = foreign.model_dump_json().encode()
        answer = _post_raw_observation(server, tmp_path, node_id, body)
    assert answer.status_code == 403
    assert answer.json()["reason"] == "wrong-node"


def test_malformed_observation_is_422_with_the_field_named(server: DevServer, tmp_path: Path, node_id: str) -> None:
    _enroll(server, tmp_path, node_id).close()
    body = json.dumps({"apiVersion": "meridian.node/v1", "kind": "Observation", "node_id": node_id}).encode()
    answer = _post_raw_observation(server, tmp_path, node_id, body)
    assert answer.status_code == 422
    assert answer.json()["reason"] == "invalid-request"
    assert "lease_epoch" in answer.json()["detail"]


def test_an_observation_naming_a_key_twice_is_422_not_read_last_wins(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    # Two readers of these bytes (the devserver, an audit tool) must not disagree about the node it is for.
    _enroll(server, tmp_path, node_id).close()
    body = f'{{"apiVersion": "meridian.node/v1", "kind": "Observation", "node_id": "other", "node_id": "{node_id}"}}'
    answer = _post_raw_observation(server, tmp_path, node_id, body.encode())
    assert answer.status_code == 422
    assert answer.json()["reason"] == "invalid-request"
    assert "node_id" in answer.json()["detail"] and "twice" in answer.json()["detail"]


def test_oversized_response_is_a_transfer_failure(server: DevServer, tmp_path: Path, node_id: str) -> None:
    _enroll(server, tmp_path, node_id).close()
    _publish(server, tmp_path, node_id)
    identity = NodeIdentity(tmp_path / node_id)
    with (
        ControlClient(
            server.base_url, identity.ca_path, identity.cert_path, identity.key_path, max_response_bytes=64
        ) as small,
        pytest.raises(ControlPlaneUnavailable, match="64-byte limit"),
    ):
        small.fetch_desired_state(node_id)


def test_nodes_table_shows_epoch_generation_and_revocation(server: DevServer, tmp_path: Path, node_id: str) -> None:
    _enroll(server, tmp_path, node_id).close()
    _publish(server, tmp_path, node_id)
    server.cli("fence", node_id)
    server.cli("revoke", node_id)
    table = server.cli("nodes").stdout.splitlines()
    header = table[0].split()
    assert header[:2] == ["NODE", "EPOCH"]
    row = next(line.split() for line in table if line.startswith(node_id + " "))
    # NODE EPOCH LEASE(2 words) ENROLLED(2 words) CERTS REVOKED GENERATION LAST-OBSERVATION
    assert row[1] == "2"
    assert row[-4:] == ["0", "yes", "1", "-"]


def test_oversized_request_body_is_413_before_anything_is_parsed(server: DevServer) -> None:
    answer = requests.post(
        f"{server.base_url}/v1/enroll",
        data=b"{" + b" " * (2 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
        verify=str(server.ca_bundle),
        timeout=30,
    )
    assert answer.status_code == 413
    assert answer.json()["reason"] == "too-large"

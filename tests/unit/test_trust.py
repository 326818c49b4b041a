"""The verifier against real signed documents: each test is an attack or a fault, and what stops it."""

import base64
import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils import dsse
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.policy import Policy, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust import (
    MAX_CLOCK_SKEW,
    AppliedState,
    Rejection,
    RejectionCode,
    VerifiedState,
    verify_artifact_manifest,
    verify_bundle,
    verify_desired_state,
    verify_envelope,
)
from ansible_collections.meridian.node.tests.helpers.trust_fixtures import (
    NODE_ID,
    NOW,
    SigningKey,
    artifact_manifest,
    bundle,
    desired_state,
    encode,
    envelope,
    make_key,
    signed,
    write_policy,
)

CONTROL = make_key()
CONTROL_2 = make_key()
ARTIFACT = make_key()
AUTHORITY = make_key()
STRANGER = make_key()

DESIRED_TYPE = dsse.PAYLOAD_TYPES["desired-state"]
FRESH_HOST = AppliedState()


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    return load_policy(
        write_policy(tmp_path, control=[CONTROL, CONTROL_2], artifact=[ARTIFACT], air_gap_authority=[AUTHORITY])
    )


@pytest.fixture
def two_of_two(tmp_path: Path) -> Policy:
    return load_policy(write_policy(tmp_path, control=[CONTROL, CONTROL_2], control_threshold=2))


def verify(data: bytes, policy: Policy, applied: AppliedState = FRESH_HOST, now: datetime = NOW) -> VerifiedState:
    return verify_desired_state(data, policy, node_id=NODE_ID, now=now, applied=applied)


def rejected(code: RejectionCode, call: Callable[[], object]) -> Rejection:
    with pytest.raises(Rejection) as info:
        call()
    assert info.value.code is code, info.value.message
    return info.value


def applied_after(data: bytes, policy: Policy) -> AppliedState:
    """The state a host records after applying ``data``."""
    result = verify(data, policy)
    return AppliedState(result.state.generation, result.state.lease_epoch, result.payload_sha256)


def reenvelope(data: bytes, **changes: object) -> bytes:
    document = json.loads(data)
    document.update(changes)
    return json.dumps(document).encode()


# --- accepted -------------------------------------------------------------------------------------------


def test_valid_state_signed_by_a_control_key_is_accepted(policy: Policy) -> None:
    payload = desired_state(generation=7, lease_epoch=3)
    result = verify(signed("desired-state", payload, [CONTROL]), policy, AppliedState(6, 3, "0" * 64))
    assert result.state.generation == 7
    assert result.state.node_id == NODE_ID
    assert result.signers == (CONTROL.keyid,)
    assert result.payload_sha256 == hashlib.sha256(encode(payload)).hexdigest()
    assert result.already_applied is False


def test_redelivered_state_is_already_applied_not_rejected(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=4), [CONTROL])
    result = verify(data, policy, applied_after(data, policy))
    assert result.already_applied is True


def test_two_distinct_control_keys_meet_a_threshold_of_two(two_of_two: Policy) -> None:
    result = verify(signed("desired-state", desired_state(), [CONTROL, CONTROL_2]), two_of_two)
    assert set(result.signers) == {CONTROL.keyid, CONTROL_2.keyid}


def test_signature_by_an_unknown_key_is_ignored_beside_a_trusted_one(policy: Policy) -> None:
    result = verify(signed("desired-state", desired_state(), [STRANGER, CONTROL]), policy)
    assert result.signers == (CONTROL.keyid,)


def test_issued_slightly_ahead_of_our_clock_is_tolerated(policy: Policy) -> None:
    issued = NOW + MAX_CLOCK_SKEW - timedelta(seconds=1)
    data = signed("desired-state", desired_state(issued_at=format_rfc3339(issued)), [CONTROL])
    assert verify(data, policy).state.issued_at == issued


def test_new_leader_with_a_higher_epoch_is_accepted(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=2, lease_epoch=9), [CONTROL])
    assert verify(data, policy, AppliedState(1, 4, "0" * 64)).state.lease_epoch == 9


# --- malformed ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\x00\xff garbage", id="binary-garbage"),
        pytest.param(b"[1, 2]", id="json-not-an-object"),
        pytest.param(b'{"payloadType": "x", "payload": ""}', id="no-signatures-field"),
    ],
)
def test_garbage_instead_of_an_envelope_is_malformed(policy: Policy, data: bytes) -> None:
    rejected(RejectionCode.MALFORMED, lambda: verify(data, policy))


def test_truncated_envelope_is_malformed(policy: Policy) -> None:
    data = signed("desired-state", desired_state(), [CONTROL])
    rejected(RejectionCode.MALFORMED, lambda: verify(data[: len(data) // 2], policy))


def test_envelope_with_extra_fields_is_malformed(policy: Policy) -> None:
    data = reenvelope(signed("desired-state", desired_state(), [CONTROL]), note="trust me")
    error = rejected(RejectionCode.MALFORMED, lambda: verify(data, policy))
    assert "note" in error.message


def test_payload_that_is_not_base64_is_malformed(policy: Policy) -> None:
    data = reenvelope(signed("desired-state", desired_state(), [CONTROL]), payload="not*base64!")
    error = rejected(RejectionCode.MALFORMED, lambda: verify(data, policy))
    assert "base64" in error.message


# --- wrong payload type ---------------------------------------------------------------------------------


def test_signed_manifest_offered_as_desired_state_is_wrong_payload_type(policy: Policy) -> None:
    data = signed("artifact-manifest", artifact_manifest(), [CONTROL])
    error = rejected(RejectionCode.WRONG_PAYLOAD_TYPE, lambda: verify(data, policy))
    assert dsse.PAYLOAD_TYPES["artifact-manifest"] in error.message
    assert DESIRED_TYPE in error.message


# --- signatures and thresholds --------------------------------------------------------------------------


def test_state_signed_only_by_an_unknown_key_is_refused(policy: Policy) -> None:
    data = signed("desired-state", desired_state(), [STRANGER])
    error = rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(data, policy))
    assert "1 by keys the policy does not trust" in error.message


def test_same_key_signing_twice_does_not_meet_a_threshold_of_two(two_of_two: Policy) -> None:
    data = signed("desired-state", desired_state(), [CONTROL, CONTROL])
    error = rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(data, two_of_two))
    assert "2 distinct control key(s) must sign this document, 1 did" in error.message


def test_tampered_payload_breaks_the_signature(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=1), [CONTROL])
    forged = encode(desired_state(generation=1000))
    tampered = reenvelope(data, payload=base64.b64encode(forged).decode())
    error = rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(tampered, policy))
    assert "1 not valid" in error.message


def test_signature_moved_to_another_payload_type_does_not_verify(policy: Policy) -> None:
    # A control key signed these bytes as an artifact manifest; relabelling them as desired state must not
    # carry the signature over, because PAE binds the type into what was signed.
    body = encode(desired_state())
    moved = dsse.sign(dsse.PAYLOAD_TYPES["artifact-manifest"], body, [CONTROL.private])
    moved["payloadType"] = DESIRED_TYPE
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(json.dumps(moved).encode(), policy))


def test_invalid_signature_by_a_trusted_key_does_not_count(two_of_two: Policy) -> None:
    document = envelope("desired-state", desired_state(), [CONTROL, CONTROL_2])
    forged_sig = base64.b64encode(b"\x00" * 64).decode()
    document["signatures"][1]["sig"] = forged_sig
    data = json.dumps(document).encode()
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(data, two_of_two))


def test_signature_that_is_not_base64_counts_as_invalid(policy: Policy) -> None:
    document = envelope("desired-state", desired_state(), [CONTROL])
    document["signatures"][0]["sig"] = "@@@"
    data = json.dumps(document).encode()
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(data, policy))


def test_unsigned_payload_is_never_parsed(policy: Policy) -> None:
    # Garbage signed by a stranger must fail on the signature, not reach the schema parser.
    data = signed("desired-state", b'{"unexpected": "payload"}', [STRANGER])
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(data, policy))


def test_artifact_key_cannot_sign_desired_state(policy: Policy) -> None:
    data = signed("desired-state", desired_state(), [ARTIFACT])
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify(data, policy))


# --- schema ---------------------------------------------------------------------------------------------


def test_unknown_field_in_a_signed_payload_is_a_schema_error(policy: Policy) -> None:
    data = signed("desired-state", desired_state(privileged=True), [CONTROL])
    error = rejected(RejectionCode.SCHEMA, lambda: verify(data, policy))
    assert "privileged: unknown field" in error.message


def test_bad_value_in_a_signed_payload_names_the_field(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=0), [CONTROL])
    error = rejected(RejectionCode.SCHEMA, lambda: verify(data, policy))
    assert "generation: must be >= 1 (got 0)" in error.message


def test_signed_body_that_is_not_json_is_a_schema_error(policy: Policy) -> None:
    data = signed("desired-state", b"\x00 not json", [CONTROL])
    rejected(RejectionCode.SCHEMA, lambda: verify(data, policy))


# --- node, time, replay, epoch ---------------------------------------------------------------------------


def test_state_for_another_node_is_refused(policy: Policy) -> None:
    data = signed("desired-state", desired_state(node_id="gpu-node-2"), [CONTROL])
    error = rejected(RejectionCode.WRONG_NODE, lambda: verify(data, policy))
    assert "'gpu-node-2'" in error.message and NODE_ID in error.message


def test_expired_state_is_refused_freeze_attack(policy: Policy) -> None:
    payload = desired_state(
        issued_at=format_rfc3339(NOW - timedelta(hours=2)), expires_at=format_rfc3339(NOW - timedelta(hours=1))
    )
    error = rejected(RejectionCode.EXPIRED, lambda: verify(signed("desired-state", payload, [CONTROL]), policy))
    assert "expired at 2025-06-01T11:00:00Z" in error.message


def test_state_expiring_exactly_now_is_expired(policy: Policy) -> None:
    data = signed("desired-state", desired_state(expires_at=format_rfc3339(NOW)), [CONTROL])
    rejected(RejectionCode.EXPIRED, lambda: verify(data, policy))


def test_state_issued_ten_minutes_in_the_future_is_not_yet_valid(policy: Policy) -> None:
    payload = desired_state(
        issued_at=format_rfc3339(NOW + timedelta(minutes=10)), expires_at=format_rfc3339(NOW + timedelta(hours=2))
    )
    error = rejected(RejectionCode.NOT_YET_VALID, lambda: verify(signed("desired-state", payload, [CONTROL]), policy))
    assert "check this host's clock" in error.message


def test_older_generation_is_a_replay(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=3), [CONTROL])
    error = rejected(RejectionCode.REPLAYED, lambda: verify(data, policy, AppliedState(5, 1, "0" * 64)))
    assert error.message == ("generation 3 is lower than the applied generation 5: a replayed or rolled-back state")


def test_same_generation_with_different_content_is_a_replay(policy: Policy) -> None:
    applied = applied_after(signed("desired-state", desired_state(generation=5), [CONTROL]), policy)
    other = signed("desired-state", desired_state(generation=5, lease_epoch=2), [CONTROL])
    error = rejected(RejectionCode.REPLAYED, lambda: verify(other, policy, applied))
    assert "already applied with different content" in error.message


def test_lower_epoch_is_a_deposed_leader(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=9, lease_epoch=2), [CONTROL])
    error = rejected(RejectionCode.STALE_EPOCH, lambda: verify(data, policy, AppliedState(8, 3, "0" * 64)))
    assert "lease epoch 2 is lower than the highest epoch seen (3)" in error.message


def test_already_applied_state_from_a_deposed_leader_is_still_stale(policy: Policy) -> None:
    data = signed("desired-state", desired_state(generation=4, lease_epoch=1), [CONTROL])
    applied = applied_after(data, policy)
    raised = AppliedState(applied.generation, 2, applied.payload_sha256)
    rejected(RejectionCode.STALE_EPOCH, lambda: verify(data, policy, raised))


def test_naive_clock_is_a_caller_bug(policy: Policy) -> None:
    data = signed("desired-state", desired_state(), [CONTROL])
    with pytest.raises(RuntimeError, match="aware datetime"):
        verify(data, policy, now=NOW.replace(tzinfo=None))


def test_threshold_below_one_is_a_caller_bug() -> None:
    data = signed("desired-state", desired_state(), [CONTROL])
    with pytest.raises(RuntimeError, match="threshold must be >= 1"):
        verify_envelope(data, payload_type=DESIRED_TYPE, keys={}, threshold=0)


# --- artifact manifests ---------------------------------------------------------------------------------


def test_manifest_signed_by_an_artifact_key_is_accepted(policy: Policy) -> None:
    result = verify_artifact_manifest(signed("artifact-manifest", artifact_manifest(), [ARTIFACT]), policy)
    assert result.manifest.name == "tiny-model"
    assert result.signers == (ARTIFACT.keyid,)


def test_manifest_signed_by_a_control_key_is_refused(policy: Policy) -> None:
    data = signed("artifact-manifest", artifact_manifest(), [CONTROL])
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify_artifact_manifest(data, policy))


def test_manifest_escaping_the_store_is_a_schema_error(policy: Policy) -> None:
    payload = artifact_manifest(files=[{"path": "../../etc/passwd", "size": 1, "sha256": "ab" * 32}])
    error = rejected(
        RejectionCode.SCHEMA,
        lambda: verify_artifact_manifest(signed("artifact-manifest", payload, [ARTIFACT]), policy),
    )
    assert "files[0].path" in error.message


def test_manifest_is_refused_when_policy_trusts_no_artifact_key(tmp_path: Path) -> None:
    control_only = load_policy(write_policy(tmp_path, control=[CONTROL]))
    data = signed("artifact-manifest", artifact_manifest(), [ARTIFACT])
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify_artifact_manifest(data, control_only))


# --- air-gap bundles ------------------------------------------------------------------------------------


def make_bundle(
    state_keys: list[SigningKey],
    bundle_keys: list[SigningKey],
    state: dict[str, object] | None = None,
    **fields: object,
) -> bytes:
    inner = envelope("desired-state", state or desired_state(generation=2), state_keys)
    return signed("bundle", bundle(inner, **fields), bundle_keys)


def verify_b(data: bytes, policy: Policy, applied: AppliedState = FRESH_HOST) -> object:
    return verify_bundle(data, policy, node_id=NODE_ID, now=NOW, applied=applied)


def test_bundle_signed_by_the_authority_with_a_control_signed_state_is_accepted(policy: Policy) -> None:
    result = verify_bundle(
        make_bundle([CONTROL], [AUTHORITY]), policy, node_id=NODE_ID, now=NOW, applied=AppliedState()
    )
    assert result.signers == (AUTHORITY.keyid,)
    assert result.desired.state.generation == 2
    assert result.desired.signers == (CONTROL.keyid,)


def test_bundle_not_signed_by_the_authority_is_refused(policy: Policy) -> None:
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify_b(make_bundle([CONTROL], [CONTROL]), policy))


def test_stolen_authority_key_cannot_invent_a_desired_state(policy: Policy) -> None:
    rejected(RejectionCode.THRESHOLD_NOT_MET, lambda: verify_b(make_bundle([AUTHORITY], [AUTHORITY]), policy))


def test_bundle_for_another_node_is_refused(policy: Policy) -> None:
    data = make_bundle([CONTROL], [AUTHORITY], node_id="gpu-node-2")
    rejected(RejectionCode.WRONG_NODE, lambda: verify_b(data, policy))


def test_bundle_carrying_a_state_for_another_node_is_refused(policy: Policy) -> None:
    data = make_bundle([CONTROL], [AUTHORITY], state=desired_state(node_id="gpu-node-2"))
    rejected(RejectionCode.WRONG_NODE, lambda: verify_b(data, policy))


def test_bundle_replaying_an_old_state_is_refused(policy: Policy) -> None:
    data = make_bundle([CONTROL], [AUTHORITY], state=desired_state(generation=2))
    rejected(RejectionCode.REPLAYED, lambda: verify_b(data, policy, AppliedState(3, 1, "0" * 64)))


def test_bundle_created_in_the_future_is_not_yet_valid(policy: Policy) -> None:
    data = make_bundle([CONTROL], [AUTHORITY], created_at=format_rfc3339(NOW + timedelta(hours=1)))
    rejected(RejectionCode.NOT_YET_VALID, lambda: verify_b(data, policy))


# --- every code, from a real envelope -------------------------------------------------------------------


SCENARIOS: dict[RejectionCode, Callable[[Policy], object]] = {
    RejectionCode.MALFORMED: lambda p: verify(b"{not json", p),
    RejectionCode.WRONG_PAYLOAD_TYPE: lambda p: verify(signed("bundle", desired_state(), [CONTROL]), p),
    RejectionCode.THRESHOLD_NOT_MET: lambda p: verify(signed("desired-state", desired_state(), [STRANGER]), p),
    RejectionCode.SCHEMA: lambda p: verify(signed("desired-state", desired_state(extra=1), [CONTROL]), p),
    RejectionCode.WRONG_NODE: lambda p: verify(signed("desired-state", desired_state(node_id="x"), [CONTROL]), p),
    RejectionCode.EXPIRED: lambda p: verify(
        signed("desired-state", desired_state(), [CONTROL]), p, now=NOW + timedelta(days=1)
    ),
    RejectionCode.NOT_YET_VALID: lambda p: verify(
        signed("desired-state", desired_state(), [CONTROL]), p, now=NOW - timedelta(hours=1)
    ),
    RejectionCode.REPLAYED: lambda p: verify(
        signed("desired-state", desired_state(generation=1), [CONTROL]), p, AppliedState(2, 0, "0" * 64)
    ),
    RejectionCode.STALE_EPOCH: lambda p: verify(
        signed("desired-state", desired_state(generation=3, lease_epoch=1), [CONTROL]), p, AppliedState(2, 5, "0" * 64)
    ),
}


def test_rejection_codes_are_exactly_the_documented_ones() -> None:
    assert [code.value for code in RejectionCode] == [
        "malformed",
        "wrong-payload-type",
        "threshold-not-met",
        "schema",
        "wrong-node",
        "expired",
        "not-yet-valid",
        "replayed",
        "stale-epoch",
    ]
    # A new code without a scenario below fails here.
    assert set(SCENARIOS) == set(RejectionCode)


@pytest.mark.parametrize("code", list(RejectionCode), ids=lambda code: code.value)
def test_every_rejection_code_comes_from_a_real_signed_envelope(policy: Policy, code: RejectionCode) -> None:
    error = rejected(code, lambda: SCENARIOS[code](policy))
    assert error.message
    assert str(error) == f"{code.value}: {error.message}"

"""The verifier against real signed documents: each test is an attack or a fault, and what stops it."""

import base64
import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import cast

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import (
    MAX_CLOCK_SKEW,
    AcceptedState,
    AppliedState,
    Rejection,
    RejectionCode,
    VerifiedState,
    verify_artifact_manifest,
    verify_bundle,
    verify_desired_state,
    verify_envelope,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
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


def test_signature_that_is_not_base64_is_malformed(policy: Policy) -> None:
    document = envelope("desired-state", desired_state(), [CONTROL])
    document["signatures"][0]["sig"] = "@@@"
    data = json.dumps(document).encode()
    error = rejected(RejectionCode.MALFORMED, lambda: verify(data, policy))
    assert "signatures[0].sig: must be canonical base64" in error.message


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


def accepted_after(data: bytes, policy: Policy, applied: AppliedState = FRESH_HOST) -> AppliedState:
    """The record once ``data`` was accepted (its apply started) and never recorded applied."""
    result = verify(data, policy, applied)
    decision = AcceptedState(result.state.generation, result.state.lease_epoch, result.payload_sha256)
    return AppliedState(applied.generation, max(applied.epoch, decision.epoch), applied.payload_sha256, decision)


def test_generation_below_an_accepted_but_failed_one_is_replayed(policy: Policy) -> None:
    # N-1 applied; N accepted, its apply killed before it recorded success; N-1 delivered again.
    older = signed("desired-state", desired_state(generation=4), [CONTROL])
    applied = applied_after(older, policy)
    record = accepted_after(signed("desired-state", desired_state(generation=5), [CONTROL]), policy, applied)
    error = rejected(RejectionCode.REPLAYED, lambda: verify(older, policy, record))
    assert "generation 4 is lower than generation 5, which this host accepted" in error.message
    assert "publish a new generation with the old content" in error.message


def test_the_exact_bytes_of_an_accepted_but_failed_generation_apply_again_not_as_already_applied(
    policy: Policy,
) -> None:
    applied = applied_after(signed("desired-state", desired_state(generation=4), [CONTROL]), policy)
    data = signed("desired-state", desired_state(generation=5), [CONTROL])
    result = verify(data, policy, accepted_after(data, policy, applied))
    assert result.state.generation == 5
    assert not result.already_applied  # its apply never recorded success: the retry runs it


def test_an_accepted_generation_with_other_bytes_is_replayed(policy: Policy) -> None:
    applied = applied_after(signed("desired-state", desired_state(generation=4), [CONTROL]), policy)
    record = accepted_after(signed("desired-state", desired_state(generation=5), [CONTROL]), policy, applied)
    other = signed("desired-state", desired_state(generation=5, lease_epoch=2), [CONTROL])
    error = rejected(RejectionCode.REPLAYED, lambda: verify(other, policy, record))
    assert "generation 5 was already accepted with different content" in error.message


def test_a_generation_above_the_accepted_one_is_accepted(policy: Policy) -> None:
    record = accepted_after(signed("desired-state", desired_state(generation=5), [CONTROL]), policy)
    result = verify(signed("desired-state", desired_state(generation=6), [CONTROL]), policy, record)
    assert (result.state.generation, result.already_applied) == (6, False)


def test_a_bundle_below_an_accepted_but_failed_generation_is_replayed(policy: Policy) -> None:
    record = AppliedState(2, 1, "0" * 64, AcceptedState(3, 1, "1" * 64))
    data = make_bundle([CONTROL], [AUTHORITY], state=desired_state(generation=2))
    error = rejected(RejectionCode.REPLAYED, lambda: verify_b(data, policy, record))
    assert "which this host accepted" in error.message


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


# --- one meaning per signed body -------------------------------------------------------------------------
# A signed state is read by the host and by reviewers, audit tools and the control plane. Each attack below
# is a document two honest readers could read differently; each is refused, signed by a trusted key.


UNIX_NOW = int(NOW.timestamp())

# Values lax pydantic read as something else (generation 30, 1, 3, 3; a Unix time; a time without seconds
# or with a digit Python drops): each reader of the signed bytes could see another state.
COERCIBLE = [
    ("generation", "3_0"),
    ("generation", True),
    ("generation", 3.0),
    ("generation", " 3 "),
    ("generation", "3"),
    ("lease_epoch", "1"),
    ("issued_at", UNIX_NOW - 60),
    ("issued_at", str(UNIX_NOW - 60)),
    ("issued_at", "2025-06-01 11:59:00Z"),
    ("expires_at", "2025-06-01T13:00Z"),
    ("expires_at", "2025-06-01T13:00:00.0000001Z"),
]


@pytest.mark.parametrize(("field", "value"), COERCIBLE, ids=[f"{field}={value!r}" for field, value in COERCIBLE])
def test_state_signed_with_a_coercible_value_is_a_schema_error(policy: Policy, field: str, value: object) -> None:
    data = signed("desired-state", desired_state(**{field: value}), [CONTROL])
    error = rejected(RejectionCode.SCHEMA, lambda: verify(data, policy))
    assert error.message.startswith(f"signed desired state does not match the schema: {field}: "), error.message
    assert repr(value) in error.message


def test_engine_port_signed_as_a_string_is_a_schema_error(policy: Policy) -> None:
    engine = {"name": "chat", "driver": "vllm", "image": "r/i", "model": {"name": "m"}, "port": "8000"}
    data = signed("desired-state", desired_state(engines=[engine]), [CONTROL])
    error = rejected(RejectionCode.SCHEMA, lambda: verify(data, policy))
    assert "engines[0].port: input should be a valid integer (got '8000')" in error.message


def _with_duplicate(payload: dict[str, object], key: str, value: object, *, first: bool = False) -> bytes:
    """The JSON of ``payload`` with ``key`` given a second time (before the others when ``first``)."""
    extra = f"{json.dumps(key)}: {json.dumps(value)}"
    text = json.dumps(payload)
    return ("{" + extra + ", " + text[1:] if first else text[:-1] + ", " + extra + "}").encode()


def test_state_naming_its_generation_twice_is_a_schema_error(policy: Policy) -> None:
    # A first-wins reader (a reviewer's tool) sees generation 2; a last-wins one (pydantic) 1000.
    body = _with_duplicate(desired_state(generation=2), "generation", 1000)
    error = rejected(RejectionCode.SCHEMA, lambda: verify(signed("desired-state", body, [CONTROL]), policy))
    assert "key 'generation' appears twice in one object (first 2, then 1000)" in error.message


def test_engine_naming_its_image_twice_is_a_schema_error(policy: Policy) -> None:
    engine = (
        '{"name": "chat", "driver": "vllm", "image": "r/good", "model": {"name": "m"}, "port": 8000, "image": "r/evil"}'
    )
    body = json.dumps(desired_state(engines=["ENGINE"])).replace('"ENGINE"', engine).encode()
    error = rejected(RejectionCode.SCHEMA, lambda: verify(signed("desired-state", body, [CONTROL]), policy))
    assert "key 'image' appears twice in one object (first 'r/good', then 'r/evil')" in error.message


def test_manifest_naming_a_file_digest_twice_is_a_schema_error(policy: Policy) -> None:
    text = json.dumps(artifact_manifest())
    body = text.replace('"sha256": ', '"sha256": "' + "cd" * 32 + '", "sha256": ').encode()
    data = signed("artifact-manifest", body, [ARTIFACT])
    error = rejected(RejectionCode.SCHEMA, lambda: verify_artifact_manifest(data, policy))
    assert "key 'sha256' appears twice" in error.message


def test_bundle_carrying_two_desired_states_is_a_schema_error(policy: Policy) -> None:
    old = envelope("desired-state", desired_state(generation=2), [CONTROL])
    new = envelope("desired-state", desired_state(generation=3), [CONTROL])
    body = _with_duplicate(bundle(new), "desired_state", old)
    data = signed("bundle", body, [AUTHORITY])
    error = rejected(RejectionCode.SCHEMA, lambda: verify_b(data, policy))
    assert "key 'desired_state' appears twice" in error.message


@pytest.mark.parametrize(
    "smuggle",
    [
        # A forged payload first: readers that keep the first key see it, the verifier the signed last one.
        pytest.param(
            lambda document: _with_duplicate(
                document, "payload", base64.b64encode(encode(desired_state(generation=99))).decode(), first=True
            ),
            id="second-payload",
        ),
        pytest.param(
            lambda document: _with_duplicate(
                document, "payloadType", dsse.PAYLOAD_TYPES["artifact-manifest"], first=True
            ),
            id="second-payload-type",
        ),
        pytest.param(
            lambda document: _with_duplicate(document, "signatures", [], first=True),
            id="second-signature-list",
        ),
        pytest.param(
            lambda document: (
                json.dumps(document).replace('"keyid": ', f'"keyid": "{STRANGER.keyid}", "keyid": ', 1).encode()
            ),
            id="second-keyid",
        ),
    ],
)
def test_envelope_naming_a_key_twice_is_malformed(
    policy: Policy, smuggle: Callable[[dict[str, object]], bytes]
) -> None:
    data = smuggle(envelope("desired-state", desired_state(), [CONTROL]))
    json.loads(data)  # valid JSON to the stdlib, which would quietly keep the last
    error = rejected(RejectionCode.MALFORMED, lambda: verify(data, policy))
    assert "appears twice in one object" in error.message


def _other_encoding(canonical: str) -> str:
    """The same bytes base64-encoded with the unused trailing bits set: what a lenient decoder still reads."""
    assert canonical.endswith("=")
    padding = len(canonical) - len(canonical.rstrip("="))
    last = canonical[-padding - 1]
    other = canonical[: -padding - 1] + chr(ord(last) + 1) + "=" * padding
    assert base64.b64decode(other, validate=True) == base64.b64decode(canonical)
    return other


def padded_body() -> bytes:
    """A desired state whose base64 needs '==' (trailing JSON whitespace sets the length), so it has unused bits."""
    body = encode(desired_state())
    return body + b" " * ((1 - len(body)) % 3)


def test_same_body_in_a_second_base64_encoding_is_malformed(policy: Policy) -> None:
    document = envelope("desired-state", padded_body(), [CONTROL])
    document["payload"] = _other_encoding(document["payload"])
    error = rejected(RejectionCode.MALFORMED, lambda: verify(json.dumps(document).encode(), policy))
    assert "payload: must be canonical base64" in error.message


@pytest.mark.parametrize(
    "recode",
    [
        pytest.param(lambda text: text.rstrip("="), id="no-padding"),
        pytest.param(lambda text: text[:76] + "\n" + text[76:], id="mime-line-break"),
        pytest.param(lambda text: text.replace("+", "-").replace("/", "_") + "-", id="url-safe-alphabet"),
    ],
)
def test_payload_in_a_non_standard_base64_form_is_malformed(policy: Policy, recode: Callable[[str], str]) -> None:
    document = envelope("desired-state", padded_body(), [CONTROL])
    document["payload"] = recode(document["payload"])
    error = rejected(RejectionCode.MALFORMED, lambda: verify(json.dumps(document).encode(), policy))
    assert "payload: must be canonical base64" in error.message


def test_signature_in_a_second_base64_encoding_is_malformed(policy: Policy) -> None:
    # Ed25519 signatures are 64 bytes: base64 with '==' and four unused bits, sixteen spellings of each.
    document = envelope("desired-state", desired_state(), [CONTROL])
    document["signatures"][0]["sig"] = _other_encoding(document["signatures"][0]["sig"])
    error = rejected(RejectionCode.MALFORMED, lambda: verify(json.dumps(document).encode(), policy))
    assert "signatures[0].sig: must be canonical base64" in error.message


# --- verification cost is bounded -------------------------------------------------------------------------


class CountingKey:
    """A trusted public key that counts the signatures the verifier asks it to check."""

    def __init__(self, key: SigningKey) -> None:
        self.public = key.private.public_key()
        self.calls = 0

    def verify(self, signature: bytes, data: bytes) -> None:
        self.calls += 1
        self.public.verify(signature, data)


def counting(*keys: SigningKey) -> tuple[dict[str, Ed25519PublicKey], list[CountingKey]]:
    counters = [CountingKey(key) for key in keys]
    return {key.keyid: cast("Ed25519PublicKey", counter) for key, counter in zip(keys, counters, strict=True)}, counters


def with_signatures(document: dict[str, object], signatures: list[dict[str, str]]) -> bytes:
    return json.dumps({**document, "signatures": signatures}).encode()


def bogus_signature(key: SigningKey, index: int = 0) -> dict[str, str]:
    """A signature naming ``key`` that is not valid for anything."""
    return {"keyid": key.keyid, "sig": base64.b64encode(hashlib.sha512(b"%d" % index).digest()).decode()}


def test_flood_of_invalid_signatures_naming_a_trusted_key_is_refused_unverified() -> None:
    document = envelope("desired-state", desired_state(), [CONTROL])
    flood = [bogus_signature(CONTROL, index) for index in range(2000)] + document["signatures"]
    keys, (counter,) = counting(CONTROL)
    error = rejected(
        RejectionCode.MALFORMED,
        lambda: verify_envelope(with_signatures(document, flood), payload_type=DESIRED_TYPE, keys=keys, threshold=1),
    )
    assert error.message.startswith(
        "the envelope carries 2001 signatures, more than the 4 allowed for trusted documents"
    )
    assert counter.calls == 0


def test_more_than_four_signatures_per_trusted_key_are_refused_unverified(policy: Policy) -> None:
    # Two control keys: at most eight signatures, whoever made them.
    document = envelope("desired-state", desired_state(), [CONTROL])
    nine = document["signatures"] + [bogus_signature(STRANGER, index) for index in range(8)]
    data = with_signatures(document, nine)
    error = rejected(RejectionCode.MALFORMED, lambda: verify(data, policy))
    assert "carries 9 signatures, more than the 8 allowed for control documents" in error.message
    keys, counters = counting(CONTROL, CONTROL_2)
    rejected(
        RejectionCode.MALFORMED,
        lambda: verify_envelope(data, payload_type=DESIRED_TYPE, keys=keys, threshold=1, role="control"),
    )
    assert [counter.calls for counter in counters] == [0, 0]
    eight = with_signatures(document, nine[:8])
    assert verify(eight, policy).signers == (CONTROL.keyid,)


def test_signature_limit_is_four_per_key_within_a_fixed_ceiling() -> None:
    assert [trust.signature_limit(keys, 1) for keys in (0, 1, 2, 16, 17, 1000)] == [4, 4, 8, 64, 64, 64]
    assert trust.signature_limit(1000, 100) == 100  # never below what the threshold needs
    assert trust.SIGNATURES_PER_KEY == 4 and contracts.MAX_SIGNATURES == 64


def test_many_trusted_keys_do_not_lift_the_ceiling() -> None:
    many = [make_key() for _ in range(20)]
    document = envelope("desired-state", desired_state(), many[:1])
    signatures = document["signatures"] + [bogus_signature(key, index) for index, key in enumerate(many * 4)][:64]
    keys, counters = counting(*many)
    rejected(
        RejectionCode.MALFORMED,
        lambda: verify_envelope(
            with_signatures(document, signatures), payload_type=DESIRED_TYPE, keys=keys, threshold=1
        ),
    )
    assert sum(counter.calls for counter in counters) == 0


def test_trusted_key_named_again_and_again_is_verified_once() -> None:
    # Invalid signatures first: only the first naming the key is checked, so the valid one after them is
    # never reached. An honest signer signs once per key.
    document = envelope("desired-state", desired_state(), [CONTROL])
    repeated = [bogus_signature(CONTROL, index) for index in range(3)] + document["signatures"]
    keys, (counter,) = counting(CONTROL)
    error = rejected(
        RejectionCode.THRESHOLD_NOT_MET,
        lambda: verify_envelope(
            with_signatures(document, repeated), payload_type=DESIRED_TYPE, keys=keys, threshold=1, role="control"
        ),
    )
    assert "1 not valid for the key they name, 3 naming a key already tried" in error.message
    assert counter.calls == 1


def test_valid_signature_followed_by_repeats_is_accepted_after_one_verification() -> None:
    document = envelope("desired-state", desired_state(), [CONTROL])
    repeated = document["signatures"] + [bogus_signature(CONTROL, index) for index in range(3)]
    keys, (counter,) = counting(CONTROL)
    result = verify_envelope(with_signatures(document, repeated), payload_type=DESIRED_TYPE, keys=keys, threshold=1)
    assert result.signers == (CONTROL.keyid,)
    assert counter.calls == 1


# --- a policy may cap a state's lifetime ------------------------------------------------------------------


@pytest.fixture
def week_at_most(tmp_path: Path) -> Policy:
    return load_policy(
        write_policy(tmp_path, control=[CONTROL], air_gap_authority=[AUTHORITY], control_max_lifetime="7d")
    )


def lasting(lifetime: timedelta) -> dict[str, object]:
    issued = NOW - timedelta(minutes=1)
    return desired_state(issued_at=format_rfc3339(issued), expires_at=format_rfc3339(issued + lifetime))


FOREVER = desired_state(expires_at="9999-12-31T23:59:59Z")


def test_state_valid_until_the_end_of_time_is_refused_where_the_policy_caps_lifetime(week_at_most: Policy) -> None:
    # A stolen or leaked state that never expires defeats the freeze-attack defence.
    error = rejected(RejectionCode.SCHEMA, lambda: verify(signed("desired-state", FOREVER, [CONTROL]), week_at_most))
    assert "is valid for 2912656d 12h 59s (issued_at 2025-06-01T11:59:00Z" in error.message
    assert f"longer than trust.control.max_lifetime 7d in policy {week_at_most.source}" in error.message


def test_state_valid_for_a_second_more_than_the_cap_is_refused(week_at_most: Policy) -> None:
    data = signed("desired-state", lasting(timedelta(days=7, seconds=1)), [CONTROL])
    error = rejected(RejectionCode.SCHEMA, lambda: verify(data, week_at_most))
    assert "valid for 7d 1s" in error.message


def test_state_valid_for_exactly_the_cap_is_accepted(week_at_most: Policy) -> None:
    data = signed("desired-state", lasting(timedelta(days=7)), [CONTROL])
    assert verify(data, week_at_most).state.generation == 1


def test_without_a_cap_any_lifetime_is_accepted(policy: Policy) -> None:
    assert policy.max_lifetime("control") is None
    assert verify(signed("desired-state", FOREVER, [CONTROL]), policy).state.expires_at.year == 9999


def test_bundle_cannot_carry_a_state_living_longer_than_the_cap(week_at_most: Policy) -> None:
    data = make_bundle([CONTROL], [AUTHORITY], state=lasting(timedelta(days=30)))
    error = rejected(RejectionCode.SCHEMA, lambda: verify_b(data, week_at_most))
    assert "valid for 30d" in error.message


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


def test_missing_libraries_names_each_library_that_did_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trust.missing_libraries() == []
    monkeypatch.setattr(contracts, "PYDANTIC_IMPORT_ERROR", "Traceback: No module named 'pydantic'")
    monkeypatch.setattr(dsse, "CRYPTOGRAPHY_IMPORT_ERROR", "Traceback: No module named 'cryptography'")
    assert trust.missing_libraries() == [
        ("pydantic", "Traceback: No module named 'pydantic'"),
        ("cryptography", "Traceback: No module named 'cryptography'"),
    ]

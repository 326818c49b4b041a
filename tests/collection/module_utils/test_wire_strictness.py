"""One meaning per signed document: the readers we wrote, held against the stdlib and pydantic.

``contracts.read_json`` (duplicate keys), ``contracts.parse_rfc3339`` (timestamps) and the canonical
base64 check are hand-written; each is compared here, over tables and generated inputs, with what the
stdlib and pydantic do, so that every difference is one we chose and name.
"""

from __future__ import annotations

import base64
import json
import random
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import AwareDatetime, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import FieldError, parse_engine_spec
from ansible_collections.meridian.node.tests.support.trust_fixtures import vllm_engine
from meridian_node_agent.dev import schemas

FIXTURES = schemas.CONTRACTS_DIR / "fixtures"
ANY_JSON = TypeAdapter(Any)  # pydantic's own JSON reader, what model_validate_json uses
LAX_TIME = TypeAdapter(AwareDatetime)  # pydantic's timestamp parsing without our type


def _same(left: Any, right: Any) -> bool:
    """Equal, and of the same types all the way down (1 and 1.0 and True are not the same value here)."""
    if type(left) is not type(right):
        return False
    if isinstance(left, dict):
        return list(left) == list(right) and all(_same(left[key], right[key]) for key in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right, strict=True))
    return bool(left == right)


# --- read_json against json.loads and pydantic -----------------------------------------------------------

AGREED = [
    b"{}",
    b"[]",
    b"0",
    b"-0",
    b"1.5",
    b"1e2",
    b"-1e-400",
    b"1.7976931348623157e308",
    b"123456789012345678901234567890",
    b'"x"',
    b'"\\u00e9\\n\\t\\"\\\\\\/"',
    '"é€😀"'.encode(),
    b'"\\ud83d\\ude00"',
    b'"\\u0000"',
    b' \t\r\n{"a" : [true, false, null, {"b": {}}]} \n',
    b'{"a": {"b": [1, 2, {"c": null}]}, "d": "e"}',
    b'{"": 1, "A": 2, "a": 3}',
]

REFUSED_BY_BOTH = [
    b"",
    b"{",
    b"[1,]",
    b'{"a": 1,}',
    b"01",
    b"{'a': 1}",
    b"1 2",
    b"nul",
    b'"\\x41"',
    b'"a\x01b"',
    b"\xff",
    b'"\xc3"',
    b"\xef\xbb\xbf{}",
    b'"\\ud800"',
    b'"\\ude00\\ud83d"',
    b"[" * 5000 + b"]" * 5000,
]

# What json.loads and pydantic's reader both accept and read_json refuses, and why.
ONLY_READ_JSON_REFUSES = {
    b'{"a": 1, "a": 2}': "key 'a' appears twice",
    b'{"a": {"b": [{"c": 1, "d": 2, "c": 1}]}}': "key 'c' appears twice",
    b'[{"x": {}}, {"x": {"y": 1, "y": 1}}]': "key 'y' appears twice",
    b"NaN": "NaN is not JSON",
    b'{"a": Infinity}': "Infinity is not JSON",
    b"[-Infinity]": "-Infinity is not JSON",
    b"1e400": "beyond what a 64-bit float holds",
    b"[-1E400]": "beyond what a 64-bit float holds",
}


@pytest.mark.parametrize("data", AGREED, ids=repr)
def test_read_json_reads_what_stdlib_and_pydantic_read(data: bytes) -> None:
    ours = contracts.read_json(data)
    assert _same(ours, json.loads(data))
    assert _same(ours, ANY_JSON.validate_json(data))


@pytest.mark.parametrize("data", REFUSED_BY_BOTH, ids=lambda data: repr(data[:20]))
def test_read_json_refuses_what_pydantic_refuses(data: bytes) -> None:
    with pytest.raises(contracts.JsonError):
        contracts.read_json(data)
    with pytest.raises(PydanticValidationError):
        ANY_JSON.validate_json(data)


@pytest.mark.parametrize(("data", "reason"), list(ONLY_READ_JSON_REFUSES.items()), ids=repr)
def test_read_json_refuses_what_other_readers_silently_resolve(data: bytes, reason: str) -> None:
    json.loads(data)
    ANY_JSON.validate_json(data)
    with pytest.raises(contracts.JsonError, match=re.escape(reason)):
        contracts.read_json(data)


def test_nesting_beyond_pydantic_s_limit_is_refused_by_every_model() -> None:
    # pydantic's reader stops at a depth no document has; read_json goes deeper. No model has a field
    # that takes arbitrary nesting, so the model refuses what pydantic's reader would have.
    data = b'{"generation": ' + b"[" * 300 + b"]" * 300 + b"}"
    with pytest.raises(PydanticValidationError):
        ANY_JSON.validate_json(data)
    assert contracts.read_json(data)
    with pytest.raises(contracts.ValidationError):
        contracts.parse_document(contracts.DesiredState, data)


@pytest.mark.parametrize("depth", range(6))
def test_duplicate_key_is_found_at_any_depth(depth: int) -> None:
    data = ('{"a": [' * depth + '{"k": 1, "k": 1}' + "]}" * depth).encode()
    distinct = data.replace(b'"k": 1, "k"', b'"k": 1, "j"')
    assert _same(contracts.read_json(distinct), json.loads(distinct))
    with pytest.raises(contracts.JsonError, match="key 'k' appears twice in one object"):
        contracts.read_json(data)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 5 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 + 1, rng.randint(-(10**20), 10**20)])
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e-300, 1.5e300, rng.uniform(-1e6, 1e6)])
    if kind == "str":
        alphabet = 'aZ09 "\\/\b\f\n\r\t\x00\x1féß€😀\u2028'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = {_random_value(rng, 5) if rng.random() < 0.5 else f"k{index}" for index in range(rng.randint(0, 4))}
    return {str(key): _random_value(rng, depth + 1) for key in keys}


def test_read_json_agrees_with_stdlib_and_pydantic_on_generated_documents() -> None:
    rng = random.Random(20250601)
    for _ in range(2000):
        value = _random_value(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]))
        data = text.encode("utf-8")
        ours = contracts.read_json(data)
        assert _same(ours, json.loads(data)), text
        assert _same(ours, ANY_JSON.validate_json(data)), text


# --- parse_rfc3339 against datetime.fromisoformat and pydantic --------------------------------------------

TIMES_AGREED = {
    "2025-06-01T12:00:00Z": datetime(2025, 6, 1, 12, tzinfo=UTC),
    "2025-06-01T12:00:00+00:00": datetime(2025, 6, 1, 12, tzinfo=UTC),
    "2025-06-01T12:00:00-00:00": datetime(2025, 6, 1, 12, tzinfo=UTC),
    "2025-06-01T12:00:00.5Z": datetime(2025, 6, 1, 12, 0, 0, 500000, tzinfo=UTC),
    "2025-06-01T12:00:00.000001Z": datetime(2025, 6, 1, 12, 0, 0, 1, tzinfo=UTC),
    "2025-06-01T14:30:00+02:30": datetime(2025, 6, 1, 12, tzinfo=UTC),
    "2024-02-29T23:59:59.999999Z": datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=UTC),
    "0001-01-01T00:00:00Z": datetime(1, 1, 1, tzinfo=UTC),
    "9999-12-31T23:59:59Z": datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC),
}

# Spellings pydantic's own parser takes (each a reading another tool may not share) that we refuse.
TIMES_ONLY_WE_REFUSE = [
    "2025-06-01 12:00:00Z",
    "2025-06-01t12:00:00z",
    "2025-06-01T12:00Z",
    "2025-06-01T12:00:00.1234567Z",
    "2025-06-01T12:00:00.123456789Z",
    "1748779200",
    "1748779200.5",
    "2025-06-01T12:00:00+0000",
]

TIMES_REFUSED_BY_BOTH = [
    "",
    "2025-06-01",
    "2025-06-01T12:00:00",
    "2025-13-01T12:00:00Z",
    "2025-02-29T12:00:00Z",
    "2025-06-01T24:00:00Z",
    "2025-06-01T23:59:60Z",
    "2025-06-01T12:00:00+24:00",
    "2025-06-01T12:00:00+00",
    "\uff12\uff10\uff12\uff15-06-01T12:00:00Z",  # full-width digits
    " 2025-06-01T12:00:00Z",
    "2025-06-01T12:00:00Z\n",
]


@pytest.mark.parametrize(("text", "expected"), list(TIMES_AGREED.items()))
def test_rfc3339_reads_what_stdlib_and_pydantic_read(text: str, expected: datetime) -> None:
    ours = contracts.parse_rfc3339(text)
    assert ours == expected == datetime.fromisoformat(text.replace("Z", "+00:00")) == LAX_TIME.validate_python(text)
    assert ours.utcoffset() == datetime.fromisoformat(text.replace("Z", "+00:00")).utcoffset()


@pytest.mark.parametrize("text", TIMES_ONLY_WE_REFUSE)
def test_rfc3339_refuses_spellings_pydantic_would_coerce(text: str) -> None:
    LAX_TIME.validate_json(json.dumps(text))
    with pytest.raises(ValueError, match="must be an RFC 3339 timestamp in UTC"):
        contracts.parse_rfc3339(text)


@pytest.mark.parametrize("text", TIMES_REFUSED_BY_BOTH, ids=repr)
def test_rfc3339_refuses_what_pydantic_refuses(text: str) -> None:
    with pytest.raises(PydanticValidationError):
        LAX_TIME.validate_json(json.dumps(text))
    with pytest.raises(ValueError, match="must be an RFC 3339 timestamp in UTC"):
        contracts.parse_rfc3339(text)


def test_rfc3339_round_trips_what_we_emit() -> None:
    rng = random.Random(3339)
    pattern = re.compile(contracts.RFC3339_UTC_PATTERN)
    for _ in range(2000):
        moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**17))
        moment = moment.replace(microsecond=0) if rng.random() < 0.5 else moment
        text = contracts.format_rfc3339(moment)
        assert contracts.parse_rfc3339(text) == moment == LAX_TIME.validate_python(text)
        assert pattern.fullmatch(text), text


def test_a_time_is_never_a_number_in_python_either() -> None:
    # Python callers (the devserver, observe) may pass datetimes; numbers stay refused in both modes.
    lease = {"node_id": "n", "epoch": 1, "renewed_at": datetime(2025, 6, 1, tzinfo=UTC)}
    assert contracts.Lease.model_validate({**lease, "expires_at": datetime(2025, 6, 2, tzinfo=UTC)})
    assert contracts.Lease.model_validate({**lease, "expires_at": "2025-06-02T00:00:00Z"})
    with pytest.raises(contracts.ValidationError, match="a time is a string, never a number"):
        contracts.Lease.model_validate({**lease, "expires_at": 1748822400})
    with pytest.raises(contracts.ValidationError, match="epoch"):
        contracts.Lease.model_validate({**lease, "epoch": True, "expires_at": "2025-06-02T00:00:00Z"})


# --- canonical base64 -------------------------------------------------------------------------------------


def _validator_accepts(text: str) -> bool:
    try:
        contracts.Signature.model_validate({"keyid": "a" * 64, "sig": text or "-"})
    except contracts.ValidationError:
        return False
    return True


def _round_trips(text: str) -> bool:
    try:
        return base64.b64encode(base64.b64decode(text, validate=True)).decode("ascii") == text
    except ValueError:
        return False


def test_canonical_base64_is_exactly_what_b64encode_writes() -> None:
    pattern = re.compile(contracts.CANONICAL_BASE64)
    for size in range(3):
        for number in range(256**size):
            raw = number.to_bytes(size, "big")
            text = base64.b64encode(raw).decode()
            assert pattern.fullmatch(text), text
    rng = random.Random(4648)
    alphabet = "AQgwBE+/=\n -_aZ09"
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert bool(pattern.fullmatch(text)) == _round_trips(text) == _validator_accepts(text), repr(text)


def _lenient(text: str) -> bytes | None:
    try:
        return base64.b64decode(text)  # validate=False: what many readers do
    except ValueError:
        return None


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(lambda text: text[:-3] + chr(ord(text[-3]) + 1) + "==", id="trailing-bits"),
        pytest.param(lambda text: text.rstrip("="), id="no-padding"),
        pytest.param(lambda text: text[:4] + "\n" + text[4:], id="line-break"),
        pytest.param(lambda text: text + "\n", id="trailing-newline"),
        pytest.param(lambda text: text[:4] + " " + text[4:], id="space"),
    ],
)
def test_a_second_encoding_of_the_same_bytes_is_refused(variant: Any) -> None:
    raw = b"\x00\x01\x02\x03"
    canonical = base64.b64encode(raw).decode()
    other = variant(canonical)
    assert other != canonical
    # A lenient reader either refuses it or reads the very same bytes: one body, two encodings.
    assert _lenient(other) in (raw, None)
    assert not _validator_accepts(other)
    assert not re.fullmatch(contracts.CANONICAL_BASE64, other)


def test_trailing_bits_give_the_stdlib_a_second_encoding_of_one_body() -> None:
    canonical = base64.b64encode(b"\x03").decode()  # "Aw=="
    for last in "xyz0":
        other = canonical[0] + last + "=="
        assert base64.b64decode(other, validate=True) == b"\x03"
        assert not _validator_accepts(other)


# --- the schemas say the same -------------------------------------------------------------------------------

# The strictness fixtures, and whether a JSON Schema validator given our schema refuses each too: None
# when it does, else why it cannot (what a schema cannot express; the models and read_json still refuse).
_DATA_MODEL = "JSON Schema's data model: a number with a zero fraction is an integer"
_PARSED = "a schema sees the parsed value, after one of the two keys won"
STRICTNESS_FIXTURES: dict[str, str | None] = {
    "desired-state/generation-string.json": None,
    "desired-state/generation-underscored.json": None,
    "desired-state/generation-padded.json": None,
    "desired-state/generation-bool.json": None,
    "desired-state/generation-float.json": _DATA_MODEL,
    "desired-state/vram-in-exponent-form.json": _DATA_MODEL,
    "desired-state/engine-port-string.json": None,
    "desired-state/pin-as-integer.json": None,
    "desired-state/epoch-nan.json": None,
    "desired-state/issued-at-unix-number.json": None,
    "desired-state/issued-at-unix-string.json": None,
    "desired-state/issued-at-space.json": None,
    "desired-state/issued-at-lower-case.json": None,
    "desired-state/issued-at-no-seconds.json": None,
    "desired-state/issued-at-nanoseconds.json": None,
    "desired-state/expires-at-impossible-date.json": "'format' is an annotation, and a pattern knows no calendar",
    "desired-state/duplicate-key.json": _PARSED,
    "desired-state/duplicate-key-nested.json": _PARSED,
    "artifact-manifest/size-as-string.json": None,
    "artifact-manifest/size-as-float.json": _DATA_MODEL,
    "artifact-manifest/duplicate-key-sha256.json": _PARSED,
    "bundle/created-at-unix-number.json": None,
    "bundle/duplicate-key-node-id.json": _PARSED,
    "envelope/payload-trailing-bits.json": None,
    "envelope/payload-unpadded.json": None,
    "envelope/payload-line-break.json": None,
    "envelope/payload-url-safe-alphabet.json": None,
    "envelope/sig-trailing-bits.json": None,
    "envelope/too-many-signatures.json": None,
    "envelope/duplicate-key-payload.json": _PARSED,
    "envelope/duplicate-key-sig.json": _PARSED,
    "lease/epoch-as-string.json": None,
    "lease/expires-at-unix-number.json": None,
    "observation/applied-generation-as-string.json": None,
    "observation/observed-at-space.json": None,
    "outbox-record/sequence-as-string.json": None,
    "outbox-record/sequence-as-float.json": _DATA_MODEL,
    "outbox-record/sequence-negative.json": None,
    "outbox-record/created-at-offset.json": None,
    "outbox-record/created-at-naive.json": None,
    "outbox-record/duplicate-key-sequence.json": _PARSED,
}


@pytest.mark.parametrize(("fixture", "blind_spot"), list(STRICTNESS_FIXTURES.items()))
def test_json_schema_refuses_each_strictness_fixture_it_can_express(fixture: str, blind_spot: str | None) -> None:
    kind, name = fixture.split("/")
    path = FIXTURES / kind / "invalid" / name
    validator = jsonschema.Draft202012Validator(json.loads(schemas.render(kind)))
    assert validator.is_valid(json.loads(path.read_bytes())) == (blind_spot is not None)
    with pytest.raises((contracts.JsonError, contracts.ValidationError)):
        contracts.parse_document(schemas.SCHEMAS[kind], path.read_bytes())


def _walk(node: Any, where: str, found: dict[str, list[str]]) -> None:
    if isinstance(node, dict):
        for key in ("type", "format"):
            if isinstance(node.get(key), str):
                found.setdefault(f"{key}={node[key]}", []).append(where)
        for key, value in node.items():
            _walk(value, f"{where}/{key}", found)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _walk(value, f"{where}/{index}", found)


def _schema_nodes(stem: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    _walk(json.loads(Path(schemas.schema_path(stem)).read_text(encoding="utf-8")), stem, found)
    return found


def test_only_float_fields_are_numbers_in_the_schemas() -> None:
    numbers = {where for stem in schemas.SCHEMAS for where in _schema_nodes(stem).get("type=number", [])}
    # HealthReason.value: a reading such as a PCIe replay rate per minute (observations and GPU facts only).
    fields = {where.split("/properties/")[-1].split("/")[0] for where in numbers}
    assert fields == {"power_draw_w", "power_limit_w", "value"}
    for stem in ("desired-state", "artifact-manifest", "bundle", "envelope"):
        assert "type=number" not in _schema_nodes(stem)


def _timestamps(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if node.get("format") == "date-time" else []
        return found + [stamp for value in node.values() for stamp in _timestamps(value)]
    if isinstance(node, list):
        return [stamp for value in node for stamp in _timestamps(value)]
    return []


def test_every_timestamp_in_the_schemas_carries_the_rfc3339_pattern() -> None:
    for stem in schemas.SCHEMAS:
        found = _timestamps(json.loads(schemas.schema_path(stem).read_text(encoding="utf-8")))
        assert all(node.get("pattern") == contracts.RFC3339_UTC_PATTERN for node in found), stem
    assert _timestamps(json.loads(schemas.schema_path("desired-state").read_text(encoding="utf-8")))


def test_envelope_schema_caps_signatures_at_the_verifier_s_ceiling() -> None:
    envelope = json.loads(schemas.schema_path("envelope").read_text(encoding="utf-8"))
    assert envelope["properties"]["signatures"]["maxItems"] == contracts.MAX_SIGNATURES
    assert envelope["properties"]["payload"]["pattern"] == contracts.CANONICAL_BASE64


# --- the engine modules' pydantic-free check agrees ---------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", "8000"),
        ("port", True),
        ("port", 8000.0),
        ("port", " 8000 "),
        ("min_vram_mib", "1_000"),
        ("min_vram_mib", 1.0),
        ("name", 7),
        ("served_model_name", 3),
        ("args", ("--a",)),
    ],
    ids=repr,
)
def test_engine_spec_coercions_are_refused_by_contract_and_engine_modules_alike(field: str, value: Any) -> None:
    document = vllm_engine(**{field: value})
    with pytest.raises(contracts.ValidationError) as theirs:
        contracts.EngineSpec.model_validate(document)
    assert contracts.describe_validation_error(theirs.value).startswith(field)
    with pytest.raises(FieldError) as ours:
        parse_engine_spec(document)
    assert ours.value.where == field

"""Signed bytes: the one JSON reader for them (``read_json``, ``parse_document``) and the DSSE ``Envelope``
that carries a signed body as canonical base64."""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Annotated, Any, TypeVar

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import (
    AfterValidator,
    BaseModel,
    Field,
    KeyId,
    StrictModel,
    WithJsonSchema,
    require_pydantic,
)

__all__ = [
    "CANONICAL_BASE64",
    "MAX_SIGNATURES",
    "Base64",
    "Envelope",
    "JsonError",
    "Signature",
    "parse_document",
    "read_json",
]


class JsonError(MeridianError, ValueError):
    """Bytes that are not one JSON document with one meaning: not UTF-8, not RFC 8259 JSON (``NaN``,
    ``Infinity``, a number no 64-bit float holds, a lone UTF-16 surrogate), or an object naming a key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise JsonError(
                f"key {key!r} appears twice in one object (first {short_repr(document[key])}, then "
                f"{short_repr(value)}): readers disagree on which one counts, so a signed document names "
                "each key once - fix the program that wrote it"
            )
        document[key] = value
    return document


def _no_constant(name: str) -> Any:
    raise JsonError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonError(f"number {short_repr(text, 40)} is beyond what a 64-bit float holds")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def read_json(data: bytes) -> Any:
    """The one JSON reader for signed bytes (envelopes and the bodies they carry): stdlib ``json`` with
    duplicate keys refused at every depth, plus what RFC 8259 leaves out refused; ``JsonError`` says what.

    Values are exactly ``json.loads``'s where it accepts; what it accepts and this refuses is listed in
    ``JsonError``. ``tests/collection/module_utils/test_wire_strictness.py`` holds it to that, and to pydantic's parser.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"not UTF-8 text: {exc}") from None
    try:
        document = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float
        )
    except JsonError:
        raise
    except RecursionError:
        raise JsonError("not JSON: nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer beyond int()'s digit limit
        raise JsonError(f"not JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):
        # A \ud800 escape without its pair decodes to a string no UTF-8 reader can hold: pydantic refuses
        # it, others replace it with U+FFFD. Pairs are fine (they are one character).
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise JsonError(f"not JSON text: an escaped UTF-16 surrogate without its pair ({exc.reason})") from None
    return document


_Model = TypeVar("_Model", bound=BaseModel)


def parse_document(model: type[_Model], data: bytes) -> _Model:
    """``model`` from JSON bytes read by ``read_json``: ``JsonError`` or pydantic's ``ValidationError``.

    What the verifier uses for every envelope and signed body, so the tree checked for duplicate keys
    is the tree validated (no second parser to disagree with the first).
    """
    require_pydantic()
    return model.model_validate(read_json(data))


# Base64 as ``base64.b64encode`` writes it (RFC 4648 section 4): the standard alphabet, '=' padding, no
# whitespace, and the unused low bits of the last character zero. Exactly one string encodes a byte
# string, so one body has one envelope payload.
# The validator checks by definition (decode, encode again, compare); the schema says it as a pattern.
CANONICAL_BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?$"


def _canonical_base64(value: str) -> str:
    try:
        canonical = base64.b64encode(base64.b64decode(value, validate=True)).decode("ascii") == value
    except ValueError:  # binascii.Error, or a character outside ASCII
        canonical = False
    if not canonical:
        raise ValueError(
            "must be canonical base64, as base64.b64encode writes it: the standard alphabet, '=' padding, "
            f"no whitespace or line breaks, the unused trailing bits zero (got {short_repr(value)})"
        )
    return value


_BASE64_SCHEMA = {"type": "string", "contentEncoding": "base64", "pattern": CANONICAL_BASE64}
Base64 = Annotated[str, AfterValidator(_canonical_base64), WithJsonSchema(_BASE64_SCHEMA)]

# The most signatures an envelope may carry, whatever the policy; the verifier's own limit is smaller
# (four per trusted key of the role), and both are checked before any signature is verified.
MAX_SIGNATURES = 64


class Signature(StrictModel):
    keyid: KeyId
    sig: Annotated[
        str,
        Field(min_length=1, description="base64 Ed25519 signature over PAE(type, body)"),
        AfterValidator(_canonical_base64),
        WithJsonSchema({**_BASE64_SCHEMA, "minLength": 1}),
    ]


class Envelope(StrictModel):
    """A DSSE envelope (https://github.com/secure-systems-lab/dsse). The payload is base64 of the body."""

    payloadType: Annotated[str, Field(min_length=1)]
    payload: Annotated[Base64, Field(description="canonical base64 of the body")]
    signatures: Annotated[list[Signature], Field(min_length=1, max_length=MAX_SIGNATURES)]

"""One meaning for ``1.0``: the published schemas, the models and the running server all refuse it where an
integer belongs, and take the same document with ``1``.

JSON Schema's ``"type": "integer"`` admits ``1.0`` (a number with a zero fraction is an integer since draft
6); the schemas add ``"format": "integer-literal"``, which a validator asserting formats refuses ``1.0``
with (``schemas.format_checker()`` for python-jsonschema). Each fixture below is a valid fixture with one
integer written as a float (or, for the runbook's constant, as ``true``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests

from ansible_collections.meridian.node.plugins.module_utils.contracts import JsonError, ValidationError, parse_document
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.dev import schemas

FIXTURES = schemas.CONTRACTS_DIR / "fixtures"

# fixture -> where in it the integer is written as a float.
WHOLE_FLOATS: dict[str, tuple[str | int, ...]] = {
    "desired-state/generation-float.json": ("generation",),
    "desired-state/vram-in-exponent-form.json": ("engines", 0, "min_vram_mib"),
    "desired-state/runbook-format-float.json": ("runbook", "format"),
    "artifact-manifest/size-as-float.json": ("files", 0, "size"),
    "bundle/generation-as-float.json": ("generation",),
    "enrollment-response/lease-epoch-as-float.json": ("lease", "epoch"),
    "gpu-facts/memory-as-float.json": ("gpus", 0, "memory", "total_mib"),
    "lease/epoch-as-float.json": ("epoch",),
    "observation/lease-epoch-as-float.json": ("lease_epoch",),
    "observation/applied-generation-in-exponent-form.json": ("applied_generation",),
    "outbox-record/sequence-as-float.json": ("sequence",),
}


def _validator(kind: str, *, formats: bool) -> jsonschema.Draft202012Validator:
    schema = json.loads(schemas.schema_path(kind).read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema, format_checker=schemas.format_checker() if formats else None)


def _model_accepts(kind: str, data: bytes) -> bool:
    try:
        parse_document(schemas.SCHEMAS[kind], data)
    except (JsonError, ValidationError):
        return False
    return True


def _at(document: Any, path: tuple[str | int, ...]) -> Any:
    for step in path[:-1]:
        document = document[step]
    return document


def test_the_format_checker_tells_1_from_1_0() -> None:
    schema = {"type": "integer", "format": "integer-literal"}
    plain = jsonschema.Draft202012Validator(schema)
    asserting = jsonschema.Draft202012Validator(schema, format_checker=schemas.format_checker())
    for text, is_literal in (("1", True), ("1.0", False), ("1e0", False), ("-0", True), ("-0.0", False)):
        value = json.loads(text)
        assert plain.is_valid(value), f"JSON Schema's data model admits {text}"
        assert asserting.is_valid(value) == is_literal, text


@pytest.mark.parametrize("fixture", sorted(WHOLE_FLOATS))
def test_schema_and_model_refuse_the_float_and_take_the_integer(fixture: str) -> None:
    kind, name = fixture.split("/")
    data = (FIXTURES / kind / "invalid" / name).read_bytes()
    document = json.loads(data)
    path = WHOLE_FLOATS[fixture]
    assert isinstance(_at(document, path)[path[-1]], float)
    assert not _validator(kind, formats=True).is_valid(document)
    assert _validator(kind, formats=False).is_valid(document), "plain validators cannot see it: why the format"
    assert not _model_accepts(kind, data)
    _at(document, path)[path[-1]] = int(_at(document, path)[path[-1]])
    assert _validator(kind, formats=True).is_valid(document), "the float is the fixture's only fault"
    assert _model_accepts(kind, json.dumps(document).encode())


def test_every_kind_with_an_integer_has_a_whole_float_fixture() -> None:
    with_integers = {stem for stem in schemas.SCHEMAS if '"format": "integer-literal"' in schemas.render(stem)}
    assert with_integers == {fixture.split("/")[0] for fixture in WHOLE_FLOATS}


def test_a_constant_integer_refuses_true_in_schema_and_model() -> None:
    path = FIXTURES / "desired-state" / "invalid" / "runbook-format-true.json"
    assert not _validator("desired-state", formats=False).is_valid(json.loads(path.read_bytes()))
    assert not _model_accepts("desired-state", path.read_bytes())


@pytest.mark.parametrize(("kind", "path"), [(p.parent.parent.name, p) for p in sorted(FIXTURES.glob("*/valid/*.json"))])
def test_every_valid_fixture_passes_the_asserting_validator(kind: str, path: Path) -> None:
    assert _validator(kind, formats=True).is_valid(json.loads(path.read_bytes()))


def test_the_server_refuses_the_float_and_takes_the_integer(server: DevServer, tmp_path: Path, node_id: str) -> None:
    with enroll_node(server, tmp_path / node_id, node_id):
        pass
    identity = NodeIdentity(tmp_path / node_id)
    with requests.Session() as session:
        session.trust_env = False
        session.cert = (str(identity.cert_path), str(identity.key_path))
        session.verify = str(identity.ca_path)
        epoch = session.post(f"{server.base_url}/v1/nodes/{node_id}/heartbeat", timeout=10).json()["epoch"]
        url = f"{server.base_url}/v1/nodes/{node_id}/observations"
        source = json.loads((FIXTURES / "observation" / "valid" / "managed-host.json").read_bytes())
        body = json.dumps({**source, "node_id": node_id, "lease_epoch": epoch})
        for spelled in (f"{epoch}.0", f"{epoch}e0"):
            refused = session.post(
                url, data=body.replace(f'"lease_epoch": {epoch}', f'"lease_epoch": {spelled}'), timeout=10
            )
            assert refused.status_code == 422, refused.text
            assert refused.json()["reason"] == "invalid-request"
            assert f"lease_epoch: input should be a valid integer (got {float(epoch)})" in refused.json()["detail"]
        assert session.post(url, data=body, timeout=10).status_code == 204

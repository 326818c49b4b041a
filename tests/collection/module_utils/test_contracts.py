"""contracts/v1: checked-in schemas match the models, and every golden fixture behaves as labelled."""

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    JsonError,
    ValidationError,
    describe_validation_error,
    parse_document,
)
from meridian_node_agent.dev import schemas

FIXTURES = schemas.CONTRACTS_DIR / "fixtures"
# Every versioned kind: the collection's (contracts.SCHEMAS) and the agent's (the air-gap outbox record).
SCHEMAS = schemas.SCHEMAS


def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _fixtures(validity: str) -> list[tuple[str, Path]]:
    return sorted((kind, path) for kind in SCHEMAS for path in (FIXTURES / kind / validity).glob("*.json"))


def _id(param: Any) -> str:
    return param.stem if isinstance(param, Path) else str(param)


def test_checked_in_schemas_match_the_models() -> None:
    assert schemas.stale_schemas() == [], "run `make schemas` and commit contracts/v1"


def test_drift_is_detected(tmp_path: Path) -> None:
    for stem in SCHEMAS:
        schemas.schema_path(stem, tmp_path).write_text(schemas.render(stem), encoding="utf-8")
    edited = schemas.schema_path("desired-state", tmp_path)
    edited.write_text(edited.read_text(encoding="utf-8").replace('"generation"', '"gen"'), encoding="utf-8")
    (tmp_path / "lease.schema.json").unlink()
    assert schemas.stale_schemas(tmp_path) == [edited, tmp_path / "lease.schema.json"]


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_every_kind_has_valid_and_invalid_fixtures(kind: str) -> None:
    assert list((FIXTURES / kind / "valid").glob("*.json"))
    invalid = {path.name for path in (FIXTURES / kind / "invalid").glob("*.json")}
    expected = yaml.safe_load((FIXTURES / kind / "invalid" / "EXPECTED.yaml").read_text(encoding="utf-8"))
    assert invalid and invalid == set(expected)


@pytest.mark.parametrize(("kind", "path"), _fixtures("valid"), ids=_id)
def test_valid_fixture_is_accepted_by_model_and_schema(kind: str, path: Path) -> None:
    document = _load(path)
    model = parse_document(SCHEMAS[kind], path.read_bytes())
    # pydantic's own JSON reader, the agent's and devserver's for protocol bodies, reads the same.
    assert SCHEMAS[kind].model_validate_json(path.read_bytes()) == model
    jsonschema.validate(document, json.loads(schemas.render(kind)))
    # What we emit parses back to the same document: the JSON form is stable.
    assert SCHEMAS[kind].model_validate_json(model.model_dump_json()) == model
    assert parse_document(SCHEMAS[kind], model.model_dump_json().encode()) == model


def _refusal(kind: str, data: bytes) -> str:
    """How ``parse_document`` (the verifier's reader) words its refusal of ``data`` as ``kind``."""
    with pytest.raises((JsonError, ValidationError)) as caught:
        parse_document(SCHEMAS[kind], data)
    error = caught.value
    return describe_validation_error(error) if isinstance(error, ValidationError) else str(error)


@pytest.mark.parametrize(("kind", "path"), _fixtures("invalid"), ids=_id)
def test_invalid_fixture_is_rejected_naming_the_problem(kind: str, path: Path) -> None:
    expected = yaml.safe_load((path.parent / "EXPECTED.yaml").read_text(encoding="utf-8"))[path.name]
    assert expected in _refusal(kind, path.read_bytes())
    if path.name.startswith("duplicate-key"):
        # pydantic's JSON reader keeps the last of the two: the reason read_json exists.
        SCHEMAS[kind].model_validate_json(path.read_bytes())
    else:
        with pytest.raises(ValidationError):
            SCHEMAS[kind].model_validate_json(path.read_bytes())


def test_unknown_fields_are_rejected_at_every_depth() -> None:
    document = _load(FIXTURES / "desired-state" / "valid" / "full.json")
    document["artifacts"][0]["manifest"]["signatures"][0]["note"] = "unsigned"
    with pytest.raises(ValidationError, match="note"):
        SCHEMAS["desired-state"].model_validate(document)

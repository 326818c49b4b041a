"""Generate the JSON Schemas under contracts/v1 from the contract models, or check them for drift.

The kinds are ``contracts.SCHEMAS`` (the collection's, importable on managed hosts) plus the agent-side
wire documents whose models live in the agent: the air-gap ``OutboxRecord`` (``boundary.outbox``).

    python -m meridian_node_agent.dev.schemas --write   # regenerate (``make schemas``)
    python -m meridian_node_agent.dev.schemas --check   # exit 1 and name the files that differ
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
from pydantic import BaseModel

from ansible_collections.meridian.node.plugins.module_utils import contracts
from meridian_node_agent.boundary.outbox import OutboxRecord
from meridian_node_agent.devserver.serving.json_schema import (
    INTEGER_COMMENT,
    INTEGER_FORMAT,
    ContractJsonSchema,
    is_integer_literal,
)

CONTRACTS_DIR = Path(__file__).resolve().parents[3] / "contracts" / "v1"
SCHEMA_BASE_URI = "https://meridian.node/contracts/v1/"

# Every versioned kind, schema stem -> model: what is generated, checked for drift and fixture-tested.
SCHEMAS: dict[str, type[BaseModel]] = {**contracts.SCHEMAS, "outbox-record": OutboxRecord}


def render(stem: str) -> str:
    """The schema text for one kind, exactly as it is checked in."""
    body = SCHEMAS[stem].model_json_schema(mode="validation", schema_generator=ContractJsonSchema)
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"{SCHEMA_BASE_URI}{stem}.schema.json",
        **body,
    }
    if f'"format": "{INTEGER_FORMAT}"' in json.dumps(body):
        # Said where a reader meets the format, since most validators only annotate it.
        schema["$comment"] = INTEGER_COMMENT
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def format_checker() -> jsonschema.FormatChecker:
    """python-jsonschema's format checker for the one format the schemas define (``integer-literal``).

    ``Draft202012Validator(schema, format_checker=format_checker())`` then refuses ``1.0`` where the schema
    says integer, as the models do (see ``devserver/json_schema.py``). Other formats stay annotations, as
    the schemas' patterns already say what ``date-time`` means here.
    """
    checker = jsonschema.FormatChecker(formats=())
    checker.checks(INTEGER_FORMAT)(is_integer_literal)
    return checker


def schema_path(stem: str, directory: Path = CONTRACTS_DIR) -> Path:
    return directory / f"{stem}.schema.json"


def stale_schemas(directory: Path = CONTRACTS_DIR) -> list[Path]:
    """Checked-in schema files that differ from (or are missing for) the models."""
    stale = []
    for stem in SCHEMAS:
        path = schema_path(stem, directory)
        if not path.is_file() or path.read_text(encoding="utf-8") != render(stem):
            stale.append(path)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="write contracts/v1/*.schema.json")
    action.add_argument("--check", action="store_true", help="fail if a checked-in schema is stale")
    args = parser.parse_args(argv)
    if args.write:
        CONTRACTS_DIR.mkdir(parents=True, exist_ok=True)
        for stem in SCHEMAS:
            schema_path(stem).write_text(render(stem), encoding="utf-8")
        return 0
    stale = stale_schemas()
    for path in stale:
        print(f"stale schema: {path} (run `make schemas` and commit the result)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

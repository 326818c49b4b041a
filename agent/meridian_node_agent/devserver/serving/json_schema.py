"""The JSON Schema of a contract model, saying what the models say about integers: ``1.0`` is not ``1``.

The models are strict: a JSON number written with a fraction or an exponent (``1.0``, ``1e0``) is not an
integer, whatever its value. JSON Schema cannot say that with ``"type": "integer"``: since draft 6 its data
model is mathematical numbers, and ``1.0`` *is* an integer there (2020-12 core, section 4.2.1). A schema
that admits what the server refuses is two meanings for one document, and a signed document must have one:
``9007199254740993.0`` is that integer to a schema and ``9007199254740992`` to every reader that goes
through a 64-bit float. So the strict reading wins, and every integer in a published schema carries
``"format": "integer-literal"``: JSON Schema's extension point for what its vocabulary cannot express. A
validator asserting formats refuses ``1.0`` there (``meridian_node_agent.dev.schemas.format_checker`` is one
for python-jsonschema); one that only annotates still reads the ``$comment`` at the top of the schema.

Shared by ``dev/schemas.py`` (contracts/v1) and ``openapi.py`` (``/openapi.json``), so the two documents
can never disagree about a number.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

__all__ = ["INTEGER_COMMENT", "INTEGER_FORMAT", "ContractJsonSchema", "is_integer_literal"]

INTEGER_FORMAT = "integer-literal"
INTEGER_COMMENT = (
    f"format {INTEGER_FORMAT!r}: the number is written as a JSON integer, with no fraction and no exponent "
    "(1, never 1.0 or 1e0); producers and the meridian.node readers refuse anything else, "
    "see docs/PROTOCOL.md (Numbers)"
)


def is_integer_literal(instance: object) -> bool:
    """Whether a parsed JSON value (stdlib ``json``) meets the format; values of other types are not its to judge.

    ``json.loads`` keeps the spelling's kind: ``1`` parses to ``int``, ``1.0`` and ``1e0`` to ``float``.
    """
    return not isinstance(instance, float)


class ContractJsonSchema(GenerateJsonSchema):
    """pydantic's JSON Schema generator, marking every integer (and every integer constant) as a literal."""

    def int_schema(self, schema: core_schema.IntSchema) -> JsonSchemaValue:
        return {**super().int_schema(schema), "format": INTEGER_FORMAT}

    def literal_schema(self, schema: core_schema.LiteralSchema) -> JsonSchemaValue:
        generated: dict[str, Any] = super().literal_schema(schema)
        if generated.get("type") == "integer":
            generated["format"] = INTEGER_FORMAT
        return generated

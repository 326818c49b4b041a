"""The OpenAPI 3.1 document the devserver serves at ``/openapi.json``, built from the contract models.

The handlers read their bodies themselves (``contracts.parse_document``: one JSON reader for every contract,
duplicate keys refused) rather than through FastAPI's parameter binding, so FastAPI cannot see what they take
and answer. This module says it instead, as data: one ``RouteDoc`` per route, whose bodies are contract
models and whose refusals are the ``ProtocolError`` codes that route can raise. The components are the
models' JSON Schemas from the generator contracts/v1 is written with (``json_schema.ContractJsonSchema``), so
the two documents agree on every field. ``tests/devserver/test_openapi_document.py`` holds the app's routes
and this table to each other, and ``test_openapi_schemathesis.py`` the server to the document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, TypeAdapter
from pydantic.json_schema import models_json_schema

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    CertificateRenewalRequest,
    EnrollmentRequest,
    EnrollmentResponse,
    Envelope,
    Lease,
    NodeId,
    Observation,
    ServingProjection,
    StrictModel,
)
from meridian_node_agent.devserver.serving.json_schema import INTEGER_COMMENT, ContractJsonSchema

__all__ = [
    "GENERATION_HEADER",
    "OPENAPI_PATH",
    "HealthAnswer",
    "ProtocolErrorBody",
    "RouteDoc",
    "openapi_document",
    "operations",
]

OPENAPI_PATH = "/openapi.json"
GENERATION_HEADER = "X-Meridian-Generation"
_SCHEMAS = "#/components/schemas/"
_SECURITY = "nodeCertificate"


class ProtocolErrorBody(StrictModel):
    """Every refusal: a stable code for programs and a sentence with the values for people."""

    reason: str = Field(description="a stable code such as stale-epoch (docs/PROTOCOL.md, Errors)")
    detail: str = Field(description="what was wrong, with the values, and what to do")


class HealthAnswer(StrictModel):
    status: Literal["ok"]


# Refusals, by status: the reasons a route's checks raise (ControlPlane and the app's readers).
_CERTIFICATE = (
    "client-certificate-required",
    "certificate-untrusted",
    "certificate-expired",
    "certificate-unknown",
    "certificate-revoked",
)
_NODE_CERTIFICATE = (*_CERTIFICATE, "wrong-node")
_TOO_LARGE = {413: ("too-large",)}
# Any path: a node id with a '/' in it, once percent-decoded, names no route.
_NOT_FOUND = ("not-found",)


@dataclass(frozen=True)
class RouteDoc:
    """One route: what it takes, what it answers, and how it refuses."""

    method: Literal["get", "post"]
    path: str
    summary: str
    ok_status: int
    ok_body: type[BaseModel] | None
    refusals: dict[int, tuple[str, ...]]
    request_body: type[BaseModel] | None = None
    # A success body no model describes (this document itself).
    ok_schema: dict[str, Any] | None = None
    authenticated: bool = True
    node_in_path: bool = False
    parameters: tuple[dict[str, Any], ...] = ()
    ok_headers: dict[str, Any] = field(default_factory=dict)
    # Answers that are neither the success nor a refusal (the desired state's 204 and 304).
    other_answers: dict[int, dict[str, Any]] = field(default_factory=dict)


def _state_headers() -> dict[str, Any]:
    return {
        "ETag": {
            "description": "strong: the quoted lowercase hex SHA-256 of the envelope bytes",
            "required": True,
            "schema": {"type": "string", "pattern": '^"[0-9a-f]{64}"$'},
        },
        GENERATION_HEADER: {
            "description": "the state's generation, for logs (a node takes it from the verified payload)",
            "required": True,
            "schema": {"type": "string", "pattern": "^[1-9][0-9]*$"},
        },
        "Cache-Control": {"required": True, "schema": {"const": "no-cache"}},
    }


def _state_parameters(max_wait_s: float) -> tuple[dict[str, Any], ...]:
    return (
        {
            "name": "wait",
            "in": "query",
            "required": False,
            "description": "long-poll: hold the request up to this many seconds for a state the client lacks",
            "schema": {"type": "number", "minimum": 0, "maximum": max_wait_s},
        },
        {
            "name": "If-None-Match",
            "in": "header",
            "required": False,
            "description": "the ETags the client has (comma-separated; W/ is read as strong; * for any)",
            "schema": {"type": "string"},
        },
    )


def operations(max_wait_s: float) -> tuple[RouteDoc, ...]:
    """Every route the app serves (``app.create_app``), in the order docs/PROTOCOL.md lists them."""
    return (
        RouteDoc("get", "/v1/healthz", "Liveness", 200, HealthAnswer, {}, authenticated=False),
        RouteDoc(
            "post",
            "/v1/enroll",
            "Enroll a node with a one-time token and a CSR",
            200,
            EnrollmentResponse,
            {
                403: ("token-unknown", "token-used", "token-wrong-node"),
                **_TOO_LARGE,
                422: ("invalid-request", "bad-csr"),
            },
            request_body=EnrollmentRequest,
            authenticated=False,
        ),
        RouteDoc(
            "post",
            "/v1/nodes/{node_id}/heartbeat",
            "Renew the node's lease",
            200,
            Lease,
            {403: _NODE_CERTIFICATE, 404: ("unknown-node", *_NOT_FOUND)},
            node_in_path=True,
        ),
        RouteDoc(
            "get",
            "/v1/nodes/{node_id}/desired-state",
            "The node's latest signed desired state (conditional, long-poll)",
            200,
            Envelope,
            {403: _NODE_CERTIFICATE, 404: _NOT_FOUND, 422: ("invalid-request",)},
            node_in_path=True,
            parameters=_state_parameters(max_wait_s),
            ok_headers=_state_headers(),
            other_answers={
                204: {"description": "nothing has been published for this node yet"},
                304: {"description": "the latest state still has an ETag the client sent", "headers": _state_headers()},
            },
        ),
        RouteDoc(
            "post",
            "/v1/nodes/{node_id}/observations",
            "Report what the node observes (fenced by lease epoch)",
            204,
            None,
            {
                403: _NODE_CERTIFICATE,
                404: ("unknown-node", *_NOT_FOUND),
                409: ("stale-epoch", "future-epoch"),
                **_TOO_LARGE,
                422: ("invalid-request",),
            },
            request_body=Observation,
            node_in_path=True,
        ),
        RouteDoc(
            "post",
            "/v1/nodes/{node_id}/certificate",
            "Renew the node's client certificate for a new key",
            200,
            EnrollmentResponse,
            {403: _NODE_CERTIFICATE, 404: _NOT_FOUND, **_TOO_LARGE, 422: ("invalid-request", "bad-csr")},
            request_body=CertificateRenewalRequest,
            node_in_path=True,
        ),
        RouteDoc(
            "get",
            "/v1/serving",
            "The gateway's serving projection: ready engines, not draining",
            200,
            ServingProjection,
            {403: _CERTIFICATE},
        ),
        RouteDoc("get", OPENAPI_PATH, "This document", 200, None, {403: _CERTIFICATE}, ok_schema={"type": "object"}),
    )


def openapi_document(max_wait_s: float) -> dict[str, Any]:
    """The whole document, for a server whose long-poll waits at most ``max_wait_s`` seconds."""
    table = operations(max_wait_s)
    models: list[type[BaseModel]] = [ProtocolErrorBody]
    for operation in table:
        for model in (operation.ok_body, operation.request_body):
            if model is not None and model not in models:
                models.append(model)
    by_model, definitions = models_json_schema(
        [(model, "validation") for model in models],
        ref_template=_SCHEMAS + "{model}",
        schema_generator=ContractJsonSchema,
    )
    refs = {model: by_model[(model, "validation")] for model in models}
    paths: dict[str, dict[str, Any]] = {}
    for operation in table:
        paths.setdefault(operation.path, {})[operation.method] = _operation(operation, refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "meridian-node devserver: control-plane protocol v1",
            "version": "v1",
            "description": (
                "The reference control plane (docs/PROTOCOL.md). Bodies are the contracts/v1 documents; "
                f"unknown fields are refused everywhere. Numbers: {INTEGER_COMMENT}."
            ),
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "security": [{_SECURITY: []}],
        "paths": paths,
        "components": {
            "schemas": definitions["$defs"],
            "securitySchemes": {
                _SECURITY: {
                    "type": "mutualTLS",
                    "description": (
                        "the node's client certificate from enrollment: issued by the devserver's CA, unexpired, "
                        "unrevoked, and naming the node in the path (DNS subjectAltName)"
                    ),
                }
            },
        },
    }


def _operation(operation: RouteDoc, refs: Mapping[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    """One operation object; ``refs`` says where in the components each model's schema is."""
    ok: dict[str, Any] = {"description": operation.summary}
    ok_schema = refs[operation.ok_body] if operation.ok_body is not None else operation.ok_schema
    if ok_schema is not None:
        ok["content"] = {"application/json": {"schema": ok_schema}}
    if operation.ok_headers:
        ok["headers"] = operation.ok_headers
    responses: dict[str, Any] = {str(operation.ok_status): ok}
    responses.update({str(status): answer for status, answer in operation.other_answers.items()})
    for status, reasons in operation.refusals.items():
        responses[str(status)] = {
            "description": "refused: reason " + ", ".join(reasons),
            "content": {"application/json": {"schema": _error_schema(refs[ProtocolErrorBody], reasons)}},
        }
    document: dict[str, Any] = {
        "operationId": _operation_id(operation),
        "summary": operation.summary,
        "responses": responses,
    }
    if not operation.authenticated:
        document["security"] = []
    parameters = list(operation.parameters)
    if operation.node_in_path:
        parameters.insert(0, _node_id_parameter())
    if parameters:
        document["parameters"] = parameters
    if operation.request_body is not None:
        document["requestBody"] = {
            "required": True,
            "description": "at most 1 MiB",
            "content": {"application/json": {"schema": refs[operation.request_body]}},
        }
    return document


def _error_schema(error_body: dict[str, Any], reasons: tuple[str, ...]) -> dict[str, Any]:
    return {
        "allOf": [
            error_body,
            {"properties": {"reason": {"enum": list(reasons)}}},
        ]
    }


def _node_id_parameter() -> dict[str, Any]:
    return {
        "name": "node_id",
        "in": "path",
        "required": True,
        "description": "the node's id, as in its certificate",
        "schema": TypeAdapter(NodeId).json_schema(),
    }


def _operation_id(operation: RouteDoc) -> str:
    words = [part for part in operation.path.replace(".json", "").split("/") if part and not part.startswith("{")]
    return operation.method + "".join(word.replace("-", " ").title().replace(" ", "") for word in words)

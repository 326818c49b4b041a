"""Protocol v1 over HTTP: the FastAPI application (see docs/PROTOCOL.md for the wire contract).

Handlers are thin: read and validate the body with the contract models, authenticate the client
certificate from the ASGI TLS extension, call ``HotPath`` (``ControlPlane`` answered from memory), shape the
response. Every error body is ``{"reason": "<code>", "detail": "<sentence>"}``.

A steady call reads no database (``hot_path.py``). What still does (an enrollment, a renewal, a cache's first read
of a node) is a statement or a short transaction of about a millisecond, run on the event loop: a thread pool hop
would cost more than it saves. What waits (a long-poll, an observation waiting for its batch) waits on a future.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    CertificateRenewalRequest,
    EnrollmentRequest,
    JsonError,
    Observation,
    ValidationError,
    describe_validation_error,
    parse_document,
)
from meridian_node_agent.devserver.control import ControlPlane, ProtocolError
from meridian_node_agent.devserver.hot_path import HotPath
from meridian_node_agent.devserver.openapi import (
    GENERATION_HEADER,
    OPENAPI_PATH,
    HealthAnswer,
    ProtocolErrorBody,
    openapi_document,
)
from meridian_node_agent.devserver.tls import peer_certificate_der

__all__ = ["MAX_REQUEST_BYTES", "create_app"]

# Requests are small JSON documents; an observation of a busy 8-GPU host is a few tens of KiB.
MAX_REQUEST_BYTES = 1024 * 1024

Model = TypeVar("Model", bound=BaseModel)


def create_app(control: ControlPlane, hot: HotPath | None = None) -> FastAPI:
    """The application over ``hot`` (``server.serve`` starts it; without one, a ``HotPath`` that was never started,
    which answers from the database on every cache miss: enough to list the routes)."""
    hot = hot if hot is not None else HotPath(control)
    # FastAPI's own document would show bodies as untyped (the handlers read them): ours is served instead.
    app = FastAPI(title="meridian-node devserver", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    document = openapi_document(control.settings.max_wait_s)

    @app.exception_handler(ProtocolError)
    async def protocol_error(_request: Request, exc: ProtocolError) -> Response:
        return _json(ProtocolErrorBody(reason=exc.reason, detail=exc.detail), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        reason = "not-found" if exc.status_code == 404 else "http-error"
        detail = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        # A 405 names the methods the path takes in Allow (RFC 9110, 15.5.6): keep Starlette's headers.
        return _json(ProtocolErrorBody(reason=reason, detail=detail), exc.status_code, exc.headers)

    @app.get("/v1/healthz")
    async def healthz() -> Response:
        return _json(HealthAnswer(status="ok"))

    @app.get(OPENAPI_PATH)
    async def openapi(request: Request) -> JSONResponse:
        # Behind the node certificate like /v1/serving: the unauthenticated surface stays what enrollment
        # needs, and the same schemas are public in contracts/v1 for a node that has none yet.
        await _authenticate(hot, request, None)
        return JSONResponse(document)

    @app.post("/v1/enroll")
    async def enroll(request: Request) -> Response:
        body = await _read_model(request, EnrollmentRequest)
        response = hot.enroll(body, request.client.host if request.client else None)
        return _json(response)

    @app.post("/v1/nodes/{node_id}/heartbeat")
    async def heartbeat(node_id: str, request: Request) -> Response:
        await _authenticate(hot, request, node_id)
        return _json(hot.heartbeat(node_id))

    @app.get("/v1/nodes/{node_id}/desired-state")
    async def desired_state(node_id: str, request: Request) -> Response:
        await _authenticate(hot, request, node_id)
        wait_s = _wait_seconds(request, control.settings.max_wait_s)
        known = _etags(request.headers.get("if-none-match"))
        current = await hot.desired_state(node_id, known, wait_s, lambda: _disconnected(request))
        if current is None:
            return Response(status_code=204)
        headers = {"ETag": current.etag, GENERATION_HEADER: str(current.generation), "Cache-Control": "no-cache"}
        if current.etag in known or ("*" in known):
            return Response(status_code=304, headers=headers)
        return Response(content=current.envelope, media_type="application/json", headers=headers)

    @app.post("/v1/nodes/{node_id}/observations")
    async def observations(node_id: str, request: Request) -> Response:
        await _authenticate(hot, request, node_id)
        observation = await _read_model(request, Observation)
        remote = request.client.host if request.client else "unknown"
        await hot.observe(node_id, observation, remote)
        return Response(status_code=204)

    @app.post("/v1/nodes/{node_id}/certificate")
    async def renew_certificate(node_id: str, request: Request) -> Response:
        await _authenticate(hot, request, node_id)
        body = await _read_model(request, CertificateRenewalRequest)
        return _json(hot.renew_certificate(peer_certificate_der(request.scope), node_id, body))

    @app.get("/v1/serving")
    async def serving(request: Request) -> Response:
        await _authenticate(hot, request, None)
        return _json(await hot.serving())

    return app


async def _authenticate(hot: HotPath, request: Request, node_id: str | None) -> str:
    """The node the request speaks for (403 otherwise), after catching up with other processes' changes."""
    await hot.fresh()
    return hot.authenticate(peer_certificate_der(request.scope), node_id)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone. A GET's body was never read, so the first message is its (empty) body;
    what follows is the disconnect, or nothing until the response is sent."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _wait_seconds(request: Request, limit_s: float) -> float:
    """The long-poll's ``wait`` query parameter, in seconds (0 without it)."""
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= limit_s:
        raise ProtocolError(
            422, "invalid-request", f"wait must be a number of seconds from 0 to {limit_s:g}, got {raw!r}"
        )
    return value


def _etags(header: str | None) -> set[str]:
    if not header:
        return set()
    tags = set()
    for part in header.split(","):
        tag = part.strip()
        # Weak and strong comparison agree here: a state's bytes never change under one ETag.
        tags.add(tag[2:] if tag.startswith("W/") else tag)
    return tags


async def _read_model(request: Request, model: type[Model]) -> Model:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise ProtocolError(413, "too-large", f"the request body is {declared} bytes; the limit is {MAX_REQUEST_BYTES}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            raise ProtocolError(413, "too-large", f"the request body exceeds {MAX_REQUEST_BYTES} bytes")
        chunks.append(chunk)
    try:
        return parse_document(model, b"".join(chunks))
    except JsonError as exc:
        raise ProtocolError(422, "invalid-request", f"not a valid {model.__name__}: {exc}") from exc
    except ValidationError as exc:
        raise ProtocolError(
            422, "invalid-request", f"not a valid {model.__name__}: {describe_validation_error(exc)}"
        ) from exc


def _json(model: BaseModel, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(content=model.model_dump_json(), status_code=status, headers=headers, media_type="application/json")

"""Protocol v1 over HTTP: the FastAPI application (see docs/PROTOCOL.md for the wire contract).

Handlers are thin: read and validate the body with the contract models, authenticate the client
certificate from the ASGI TLS extension, call ``HotPath`` (``ControlPlane`` answered from memory), shape the
response. Every error body is ``{"reason": "<code>", "detail": "<sentence>"}``.

``serve`` answers the heartbeat and the desired-state fetch in front of this app (``steady_calls.py``: a parked
long-poll through FastAPI's stack held about 140 objects for the garbage collector to walk, per node); their routes
here call the same functions. A steady call reads no database (``hot_path.py``). What still does (an enrollment, a
renewal, a cache's first read of a node) is a statement or a short transaction of about a millisecond, run on the
event loop: a thread pool hop would cost more than it saves. What waits (a long-poll, an observation waiting for its
batch) waits on a future.
"""

from __future__ import annotations

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
from meridian_node_agent.devserver.control.plane import ControlPlane, ProtocolError
from meridian_node_agent.devserver.serving.hot_path import HotPath
from meridian_node_agent.devserver.serving.openapi import (
    OPENAPI_PATH,
    HealthAnswer,
    ProtocolErrorBody,
    openapi_document,
)
from meridian_node_agent.devserver.serving.steady_calls import (
    authenticate,
    desired_state_response,
    heartbeat_response,
    json_response,
    protocol_error_response,
)
from meridian_node_agent.devserver.serving.tls import peer_certificate_der

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
        return protocol_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        reason = "not-found" if exc.status_code == 404 else "http-error"
        detail = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        # A 405 names the methods the path takes in Allow (RFC 9110, 15.5.6): keep Starlette's headers.
        return json_response(ProtocolErrorBody(reason=reason, detail=detail), exc.status_code, exc.headers)

    @app.get("/v1/healthz")
    async def healthz() -> Response:
        return json_response(HealthAnswer(status="ok"))

    @app.get(OPENAPI_PATH)
    async def openapi(request: Request) -> JSONResponse:
        # Behind the node certificate like /v1/serving: the unauthenticated surface stays what enrollment
        # needs, and the same schemas are public in contracts/v1 for a node that has none yet.
        await authenticate(hot, request.scope, None)
        return JSONResponse(document)

    @app.post("/v1/enroll")
    async def enroll(request: Request) -> Response:
        body = await _read_model(request, EnrollmentRequest)
        response = hot.enroll(body, request.client.host if request.client else None)
        return json_response(response)

    # What ``serve`` answers in front of FastAPI (``steady_calls.SteadyCallLane``), through the same functions: these
    # routes serve the same answers where the app runs without the lane, and list the endpoints with the others.
    @app.post("/v1/nodes/{node_id}/heartbeat")
    async def heartbeat(node_id: str, request: Request) -> Response:
        return await heartbeat_response(hot, request.scope, node_id)

    @app.get("/v1/nodes/{node_id}/desired-state")
    async def desired_state(node_id: str, request: Request) -> Response:
        return await desired_state_response(hot, request.scope, request.receive, node_id)

    @app.post("/v1/nodes/{node_id}/observations")
    async def observations(node_id: str, request: Request) -> Response:
        await authenticate(hot, request.scope, node_id)
        observation = await _read_model(request, Observation)
        remote = request.client.host if request.client else "unknown"
        await hot.observe(node_id, observation, remote)
        return Response(status_code=204)

    @app.post("/v1/nodes/{node_id}/certificate")
    async def renew_certificate(node_id: str, request: Request) -> Response:
        await authenticate(hot, request.scope, node_id)
        body = await _read_model(request, CertificateRenewalRequest)
        return json_response(hot.renew_certificate(peer_certificate_der(request.scope), node_id, body))

    @app.get("/v1/serving")
    async def serving(request: Request) -> Response:
        await authenticate(hot, request.scope, None)
        return json_response(await hot.serving())

    return app


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

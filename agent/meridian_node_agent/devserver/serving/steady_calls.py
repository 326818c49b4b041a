"""The fleet's two most frequent calls, answered in front of FastAPI: a heartbeat and a desired-state fetch.

Every connected node is almost always in a long-poll (it ends at the node's next heartbeat), so what one parked
request holds is what the server holds per node. Through FastAPI and Starlette a parked long-poll is a stack of
about 22 suspended coroutines (uvicorn's cycle, the proxy-headers middleware, Starlette's error, exception and
exit-stack middlewares, the router, the endpoint, the dependency solver) with their closures and cells: about 140
objects the cyclic garbage collector tracks, per node. Measured with bench/fleet.py at 2,000 and 5,000 nodes: the
long-polls outlive every young collection, so their objects are promoted to the oldest generation at about 50,000 a
second, which triggered a full collection every 5 s, each walking every live object (950,000 at 5,000 nodes) for
300-540 ms while the event loop stood still: the fleet's worst latencies (docs/SCALE.md, "What one core holds").

``SteadyCallLane`` is the ASGI app uvicorn runs: it answers ``POST /v1/nodes/{id}/heartbeat`` and ``GET
/v1/nodes/{id}/desired-state`` itself, through the same functions the FastAPI routes call (``heartbeat_response``,
``desired_state_response``), and hands every other request to FastAPI unchanged. The answers are Starlette
``Response`` objects either way, so their bytes do not depend on which path served them
(``tests/devserver/test_steady_calls.py`` compares them); a refusal is the same ``{"reason", "detail"}`` body.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel
from starlette.responses import Response

from meridian_node_agent.devserver.control.plane import ProtocolError
from meridian_node_agent.devserver.serving.hot_path import HotPath
from meridian_node_agent.devserver.serving.openapi import GENERATION_HEADER, ProtocolErrorBody
from meridian_node_agent.devserver.serving.tls import peer_certificate_der

__all__ = [
    "SteadyCallLane",
    "authenticate",
    "desired_state_response",
    "heartbeat_response",
    "json_response",
    "protocol_error_response",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# What Starlette's router matches for ``/v1/nodes/{node_id}/...``: one path segment, already percent-decoded.
_STEADY_PATH = re.compile(r"/v1/nodes/([^/]+)/(heartbeat|desired-state)")
_STEADY_METHOD = {"heartbeat": "POST", "desired-state": "GET"}


class SteadyCallLane:
    """Heartbeats and desired-state fetches answered here, everything else by ``app`` (see the module doc)."""

    def __init__(self, app: AsgiApp, hot: HotPath) -> None:
        self.app = app
        self.hot = hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            match = _STEADY_PATH.fullmatch(scope["path"])
            if match is not None and scope["method"] == _STEADY_METHOD[match[2]]:
                node_id = match[1]
                try:
                    if match[2] == "heartbeat":
                        response = await heartbeat_response(self.hot, scope, node_id)
                    else:
                        response = await desired_state_response(self.hot, scope, receive, node_id)
                except ProtocolError as exc:
                    response = protocol_error_response(exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def authenticate(hot: HotPath, scope: Scope, node_id: str | None) -> str:
    """The node a request speaks for (403 otherwise), after catching up with other processes' changes."""
    await hot.fresh()
    return hot.authenticate(peer_certificate_der(scope), node_id)


async def heartbeat_response(hot: HotPath, scope: Scope, node_id: str) -> Response:
    await authenticate(hot, scope, node_id)
    return json_response(hot.heartbeat(node_id))


async def desired_state_response(hot: HotPath, scope: Scope, receive: Receive, node_id: str) -> Response:
    """The node's state (200), unchanged (304) or none (204), after a long-poll of the ``wait`` asked for.

    Authenticated before it parks and again after its last wait (``HotPath.desired_state``): a revocation while it
    waited is answered with the refusal a new request gets, never with a state.
    """
    certificate_der = peer_certificate_der(scope)
    await hot.fresh()
    hot.authenticate(certificate_der, node_id)
    wait_s = _wait_seconds(scope, hot.control.settings.max_wait_s)
    known = _etags(_header(scope, b"if-none-match"))
    current = await hot.desired_state(node_id, certificate_der, known, wait_s, lambda: _disconnected(receive))
    if current is None:
        return Response(status_code=204)
    headers = {"ETag": current.etag, GENERATION_HEADER: str(current.generation), "Cache-Control": "no-cache"}
    if current.etag in known or ("*" in known):
        return Response(status_code=304, headers=headers)
    return Response(content=current.envelope, media_type="application/json", headers=headers)


def json_response(model: BaseModel, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """A pydantic model as the JSON answer."""
    return Response(content=model.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


def protocol_error_response(exc: ProtocolError) -> Response:
    return json_response(ProtocolErrorBody(reason=exc.reason, detail=exc.detail), exc.status)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone. A GET's body was never read, so the first message is its (empty) body;
    what follows is the disconnect, or nothing until the response is sent."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), as Starlette's ``Headers.get`` reads it."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _wait_seconds(scope: Scope, limit_s: float) -> float:
    """The long-poll's ``wait`` query parameter, in seconds (0 without it); the last one counts, as in Starlette."""
    query = scope.get("query_string", b"").decode("latin-1")
    values = [value for key, value in parse_qsl(query, keep_blank_values=True) if key == "wait"]
    if not values:
        return 0.0
    raw = values[-1]
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

"""Mutual TLS under uvicorn: the server's SSL context and the client certificate in the ASGI scope.

uvicorn (0.55, h11 and httptools alike) builds the HTTP scope without the ASGI TLS extension, so an
application cannot see the client certificate (asked for in encode/uvicorn#745, still absent). The
handshake has finished by the time the event loop calls the protocol's ``connection_made``, and the transport
exposes the ``ssl.SSLObject`` there (``get_extra_info("ssl_object")``, asyncio's and uvloop's alike).
``MutualTlsHttpToolsProtocol`` reads the peer certificate at that point, once per connection, and wraps the
application for that connection so that every request scope carries ``scope["extensions"]["tls"]`` as the ASGI TLS
extension specifies (https://asgi.readthedocs.io/en/latest/specs/tls.html). The application depends
only on that standard extension, not on uvicorn internals, and works unchanged under a server that
provides it.

The context asks for a client certificate but does not require one (``CERT_OPTIONAL``): enrollment is
the one call made without a certificate. A certificate that *is* presented must chain to the CA or the
handshake fails. Renegotiation is disabled so the certificate read at connection time is the one
for the whole connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from cryptography import x509
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MutualTlsHttpToolsProtocol", "peer_certificate_der", "server_ssl_context", "tls_extension"]

Scope = MutableMapping[str, Any]
AsgiApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

# ASGI wants the TLS version as the protocol's 16-bit code.
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


def server_ssl_context(cert_path: Path, key_path: Path, ca_path: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    context.load_verify_locations(cafile=ca_path)
    context.verify_mode = ssl.CERT_OPTIONAL
    context.options |= ssl.OP_NO_RENEGOTIATION
    return context


def tls_extension(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> dict[str, Any]:
    """The ASGI TLS extension for one connection. Python's ``ssl`` hands out only the leaf certificate."""
    der = ssl_object.getpeercert(binary_form=True)
    chain: list[str] = []
    name: str | None = None
    if der:
        chain.append(ssl.DER_cert_to_PEM_cert(der))
        name = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    version = ssl_object.version()
    return {
        "server_cert": None,
        "client_cert_chain": chain,
        "client_cert_name": name,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(version or ""),
        "cipher_suite": None,
    }


def peer_certificate_der(scope: Scope) -> bytes | None:
    """The client's leaf certificate (DER) from the scope's TLS extension, or None when none was sent."""
    tls = (scope.get("extensions") or {}).get("tls")
    if not tls or not tls.get("client_cert_chain"):
        return None
    return ssl.PEM_cert_to_DER_cert(tls["client_cert_chain"][0])


class _WithTls:
    """An ASGI app wrapper that adds one connection's TLS extension to each scope."""

    def __init__(self, app: AsgiApp, tls: dict[str, Any]) -> None:
        self.app = app
        self.tls = tls

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope.get("type") in ("http", "websocket"):
            scope = dict(scope)
            scope["extensions"] = {**(scope.get("extensions") or {}), "tls": self.tls}
        await self.app(scope, receive, send)


class MutualTlsHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C), plus the client certificate in every request's scope (see the
    module doc). Not h11: with 5,000 nodes on one core the pure-Python parser's share of each request mattered
    (docs/SCALE.md, "What one core holds")."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.app = _WithTls(self.app, tls_extension(ssl_object))

"""Running the app under uvicorn with mutual TLS on a socket we bind ourselves.

Binding the socket here, before uvicorn starts, lets ``--port 0`` work: the kernel picks a free port and
we can print it before serving, so tests and scripts never race for a port.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from meridian_node_agent.devserver.app import create_app
from meridian_node_agent.devserver.control import ControlPlane
from meridian_node_agent.devserver.tls import MutualTlsH11Protocol, server_ssl_context

__all__ = ["ServerTls", "bind", "prepare_tls", "serve"]


@dataclass(frozen=True)
class ServerTls:
    cert: Path
    key: Path
    ca: Path


def prepare_tls(control: ControlPlane, host: str) -> ServerTls:
    """A fresh server certificate for ``host``, 127.0.0.1 and localhost, signed by the devserver's CA."""
    hosts = ["127.0.0.1", "localhost"] if _unspecified(host) else [host, "127.0.0.1", "localhost"]
    cert, key = control.ca.write_server_certificate(control.paths.tls_dir, hosts)
    return ServerTls(cert=cert, key=key, ca=control.ca.cert_path)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(control: ControlPlane, sock: socket.socket, tls: ServerTls, *, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM. Long-polls still waiting at shutdown are cut off after two seconds."""
    context = server_ssl_context(tls.cert, tls.key, tls.ca)
    config = uvicorn.Config(
        create_app(control),
        http=MutualTlsH11Protocol,
        ws="none",
        lifespan="off",
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        ssl_context_factory=lambda _config, _default: context,
        timeout_graceful_shutdown=2,
        server_header=False,
    )
    uvicorn.Server(config).run(sockets=[sock])

"""Running the app under uvicorn with mutual TLS on a socket we bind ourselves.

Binding the socket here, before uvicorn starts, lets ``--port 0`` work: the kernel picks a free port and
we can print it before serving, so tests and scripts never race for a port.

Replicas share one data dir (``docs/PROTOCOL.md``, "Several servers on one PostgreSQL"): each writes a fresh TLS
key and certificate into ``tls/`` at start, under an exclusive lock on ``tls/.lock`` held until its SSL context has
loaded them, so two servers starting together never load one's key with the other's certificate.
"""

from __future__ import annotations

import fcntl
import gc
import ipaddress
import signal
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from meridian_node_agent.devserver.control.plane import ControlPlane
from meridian_node_agent.devserver.serving.app import create_app
from meridian_node_agent.devserver.serving.hot_path import HotPath
from meridian_node_agent.devserver.serving.steady_calls import SteadyCallLane
from meridian_node_agent.devserver.serving.tls import MutualTlsHttpToolsProtocol, server_ssl_context

__all__ = ["ServerTls", "bind", "prepare_tls", "serve", "uvicorn_config"]


@dataclass(frozen=True)
class ServerTls:
    cert: Path
    key: Path
    ca: Path
    context: ssl.SSLContext


def prepare_tls(control: ControlPlane, host: str, names: Sequence[str] = ()) -> ServerTls:
    """A fresh server certificate for ``host``, ``names`` (what clients dial: a load balancer's or a DNS name shared
    by replicas), 127.0.0.1 and localhost, signed by the devserver's CA, loaded into the server's SSL context."""
    hosts = [*([] if _unspecified(host) else [host]), *names, "127.0.0.1", "localhost"]
    tls_dir = control.paths.tls_dir
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (tls_dir / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cert, key = control.ca.write_server_certificate(tls_dir, hosts)
        context = server_ssl_context(cert, key, control.ca.cert_path)
    return ServerTls(cert=cert, key=key, ca=control.ca.cert_path, context=context)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP said outright: asyncio sets TCP_NODELAY on an accepted connection only when its socket says it is
    # TCP, and a socket made with protocol 0 does not. Without it every answer with a body (uvicorn writes its head
    # and its body apart) waited on the client's delayed ACK: 45 ms per heartbeat, measured here, against 0.5 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(
    control: ControlPlane, hot: HotPath, tls: ServerTls, *, log_level: str = "warning"
) -> uvicorn.Config:
    """How uvicorn runs the app: mutual TLS through our httptools protocol on uvloop, no lifespan, our own TLS
    context. uvloop (libuv, its TLS in Cython) rather than asyncio's loop: with 5,000 connected nodes on one core it
    took the server from 1,950 to 850 MiB (asyncio's TLS transport keeps a 256 KiB read buffer per connection) and
    a tenth of its CPU (docs/SCALE.md, "What one core holds")."""
    return uvicorn.Config(
        SteadyCallLane(create_app(control, hot), hot),
        loop="uvloop",
        http=MutualTlsHttpToolsProtocol,
        ws="none",
        lifespan="off",
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        ssl_context_factory=lambda _config, _default: tls.context,
        timeout_graceful_shutdown=2,
        server_header=False,
        # Nodes connect directly (or through a TCP balancer): no proxy's X-Forwarded-For is to be believed, and a
        # node on 127.0.0.1 could otherwise set the address its observations are recorded under.
        proxy_headers=False,
        # A fleet keeps its connections: a node's next call comes one heartbeat (15 s) after its last answer, and a
        # new TLS handshake costs the server more than the call itself.
        timeout_keep_alive=75,
    )


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(control: ControlPlane, sock: socket.socket, tls: ServerTls, *, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM. Long-polls still waiting at shutdown are cut off after two seconds; the leases and
    observations held in memory are written before this returns."""
    hot = HotPath(control)
    config = uvicorn_config(control, hot, tls, log_level=log_level)
    hot.start()
    # What exists now (the imported libraries, the app, every node's warmed records and states) lives as long as the
    # process: the cyclic collector need not walk it again. A full collection is the server's longest pause: with
    # 5,000 connected nodes it walks about 950,000 objects (most of them the coroutine stacks of parked long-polls)
    # in 300-540 ms, measured by bench/fleet.py; this takes 115,000 of them out of every one (docs/SCALE.md).
    gc.freeze()
    # uvicorn (0.29 and later) raises the signal that stopped it again once it has shut down, with the handlers it
    # found restored: under the default ones that killed the process there, before this function's cleanup (the
    # leases and observations in memory were never written, the operator socket never removed). Handlers of our
    # own are what it restores, so the signal ends up here and serve returns; the CLI then exits 0, as a server
    # that shut down cleanly does. One that comes before uvicorn has put its own in place stops it all the same.
    server = uvicorn.Server(config)

    def stop(_number: int, _frame: object) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        hot.close()

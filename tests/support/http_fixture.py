"""A real HTTP server on 127.0.0.1 for artifact tests, with Range support and ways to misbehave.

``ArtifactServer`` serves ``files`` (URL path -> bytes) from a ``ThreadingHTTPServer`` in a thread. Its
``mode`` picks the behaviour for every request; the ``*_left`` counters make a misbehaviour happen only
for the first N requests. Every request is recorded (path, Range header, status) so a test can assert
what the client really asked for.

Modes:
- ``normal``: 200, or 206 with ``Content-Range`` for ``Range: bytes=N-``.
- ``no-range``: ignores Range, always 200 with the whole file.
- ``too-long``: the file plus ``extra`` bytes, announced in Content-Length.
- ``too-short``: the file minus its last ``short_by`` bytes, announced in Content-Length.
- ``fail``: HTTP 500 while ``failures_left`` > 0, then normal.
- ``drop``: announces the full length, sends half of the body, closes the connection (``drops_left``
  times, then normal).
- ``slow``: sends ``slow_chunk`` bytes, then sleeps ``slow_delay`` seconds, until done.
- ``wrong-range``: answers a Range request with a 206 that starts at byte 0.

``redirects`` (URL path -> (status, Location)) answers a path with a redirect before any file or mode is
looked at; a Location may be relative or point at another server. ``tls=(cert, key)`` makes the server
speak HTTPS (``tls_material`` issues a CA and a 127.0.0.1 certificate for it). ``write_self_signed`` writes
a certificate that only vouches for itself: a client certificate no CA of ours issued, or a node identity whose
certificate is also its own CA bundle.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meridian_node_agent.devserver.control.ca import CertificateAuthority

__all__ = [
    "ArtifactServer",
    "RequestRecord",
    "TlsMaterial",
    "running_artifact_server",
    "small_tmpfs",
    "tls_material",
    "write_self_signed",
]


@dataclass(frozen=True)
class RequestRecord:
    path: str
    range: str | None
    status: int


@dataclass(frozen=True)
class TlsMaterial:
    ca: Path  # the CA bundle a client verifies the server with
    cert: Path
    key: Path


def tls_material(directory: Path) -> TlsMaterial:
    """A fresh CA and a server certificate for 127.0.0.1 signed by it, under ``directory``."""
    authority = CertificateAuthority(directory / "ca")
    cert, key = authority.write_server_certificate(directory / "server", ["127.0.0.1"])
    return TlsMaterial(authority.cert_path, cert, key)


def write_self_signed(cert: Path, key: Path, name: str, *, not_before: datetime, not_after: datetime) -> None:
    """A P-256 key and a certificate for ``name`` (its CN and its one DNS name) that signs itself, written as PEM
    to ``cert`` and ``key`` (PKCS#8, unencrypted)."""
    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


class ArtifactServer:
    def __init__(self, files: dict[str, bytes] | None = None, tls: TlsMaterial | None = None) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.redirects: dict[str, tuple[int, str]] = {}
        self.disk_files: dict[str, Path] = {}  # large files served from disk, always well behaved
        self.mode = "normal"
        self.failures_left = 0
        self.drops_left = 0
        self.extra = 4096
        self.short_by = 4096
        self.slow_chunk = 64 * 1024
        self.slow_delay = 0.02
        self.requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.cert, tls.key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, name="artifact-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{self.scheme}://{host!s}:{port}"

    def start(self) -> ArtifactServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def record(self, path: str, range_header: str | None, status: int) -> None:
        with self._lock:
            self.requests.append(RequestRecord(path, range_header, status))

    def ranges(self, path: str | None = None) -> list[str | None]:
        return [r.range for r in self.requests if path is None or r.path == path]


def _handler_for(server: ArtifactServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path).lstrip("/")
            range_header = self.headers.get("Range")
            if path in server.redirects:
                status, location = server.redirects[path]
                server.record(path, range_header, status)
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            if path in server.disk_files:
                return self._send_disk(path, range_header, server.disk_files[path])
            data = server.files.get(path)
            if data is None:
                return self._simple(path, range_header, 404)
            mode = server.mode
            if mode == "fail":
                with server._lock:
                    failing = server.failures_left > 0
                    server.failures_left -= 1 if failing else 0
                if failing:
                    return self._simple(path, range_header, 500)
            start = 0
            if range_header and mode not in ("no-range", "too-long", "too-short"):
                start = int(range_header.removeprefix("bytes=").split("-")[0])
                if start >= len(data):
                    return self._simple(path, range_header, 416)
            body = data[start:]
            if mode == "too-long":
                body = data + b"X" * server.extra
            elif mode == "too-short":
                body = data[: len(data) - server.short_by]
            status = 206 if start or (range_header and mode == "wrong-range") else 200
            if mode == "wrong-range" and range_header:
                body = data
            server.record(path, range_header, status)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            if status == 206:
                first = 0 if mode == "wrong-range" else start
                self.send_header("Content-Range", f"bytes {first}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            drop = False
            if mode == "drop":
                with server._lock:
                    drop = server.drops_left > 0
                    server.drops_left -= 1 if drop else 0
            try:
                if drop:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif mode == "slow":
                    for offset in range(0, len(body), server.slow_chunk):
                        self.wfile.write(body[offset : offset + server.slow_chunk])
                        self.wfile.flush()
                        time.sleep(server.slow_delay)
                else:
                    self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _send_disk(self, path: str, range_header: str | None, file: Path) -> None:
            """Large files straight from disk with sendfile(2); honours Range, never misbehaves."""
            size = file.stat().st_size
            start = int(range_header.removeprefix("bytes=").split("-")[0]) if range_header else 0
            status = 206 if start else 200
            server.record(path, range_header, status)
            self.send_response(status)
            self.send_header("Content-Length", str(size - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            self.wfile.flush()
            with file.open("rb") as handle, contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.connection.sendfile(handle, start, size - start)

        def _simple(self, path: str, range_header: str | None, status: int) -> None:
            server.record(path, range_header, status)
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


@contextlib.contextmanager
def running_artifact_server(
    files: dict[str, bytes] | None = None, tls: TlsMaterial | None = None
) -> Iterator[ArtifactServer]:
    """An ``ArtifactServer`` serving ``files`` (over HTTPS with ``tls``), started for the block and stopped
    when it ends, pass or fail: what a test's server fixture yields."""
    server = ArtifactServer(files, tls=tls).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``directory`` (created) for the block; skips where mounting is not allowed."""
    directory.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=False)
    if mounted.returncode != 0:
        pytest.skip("this machine does not allow mounting a tmpfs here")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)

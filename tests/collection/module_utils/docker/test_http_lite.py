"""The lean HTTP/1.1 exchange, against a real TCP server on 127.0.0.1 that answers with exact bytes."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker._http import Answer, HttpLiteError, exchange
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import http_get


class RawServer:
    """Accepts connections one at a time; answers each with the next queued bytes, then closes."""

    def __init__(self, address: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.listener = socket.create_server((address, 0), family=family)
        self.port: int = self.listener.getsockname()[1]
        self.answers: list[bytes] = []
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _address = self.listener.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(65536)
                    if not data:
                        break
                    request += data
                head, _sep, rest = request.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append(request)
                conn.sendall(self.answers.pop(0) if self.answers else b"")

    def ask(self, answer: bytes, method: str = "GET", body: bytes | None = None, **kwargs: object) -> Answer:
        self.answers.append(answer)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            return exchange(sock, method, "/health", host="engine", body=body, max_body=64, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server() -> Iterator[RawServer]:
    raw = RawServer()
    yield raw
    raw.close()


def test_sized_body_and_headers_are_read(server: RawServer) -> None:
    answer = server.ask(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello")

    assert (answer.status, answer.reason, answer.body) == (200, "OK", b"hello")
    assert answer.headers["x-a"] == "1, 2"
    assert server.requests[0].startswith(b"GET /health HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n")


def test_chunked_body_with_extensions_and_trailers_is_joined(server: RawServer) -> None:
    answer = server.ask(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer: x\r\n\r\n"
    )
    assert answer.body == b"wikipedia"


def test_body_without_length_is_read_to_the_end_of_the_connection(server: RawServer) -> None:
    assert server.ask(b"HTTP/1.0 503 Service Unavailable\r\n\r\nLoading model").body == b"Loading model"


def test_interim_answers_are_skipped(server: RawServer) -> None:
    answer = server.ask(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
    assert (answer.status, answer.body) == (204, b"")


def test_request_body_is_sent_with_its_length(server: RawServer) -> None:
    server.ask(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}", method="POST", body=b'{"a":1}')
    assert b"Content-Length: 7\r\n" in server.requests[0]


def test_oversized_body_is_refused_or_cut_when_asked(server: RawServer) -> None:
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    with pytest.raises(HttpLiteError, match="larger than 64 bytes"):
        server.ask(big)
    assert server.ask(big, truncate=True).body == b"x" * 64
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"64\r\n" + b"y" * 100 + b"\r\n0\r\n\r\n"
    with pytest.raises(HttpLiteError, match="larger than 64 bytes"):
        server.ask(chunked)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"", "closed before the status line"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "ended after 5 of 10 body bytes"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\n folded: value\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello!", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "ended inside a chunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", "longer than its size"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n", "more than 100 headers"),
    ],
)
def test_broken_answers_are_errors_naming_what_was_wrong(server: RawServer, answer: bytes, reason: str) -> None:
    with pytest.raises(HttpLiteError, match=reason):
        server.ask(answer)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_probe_of_an_engine_bound_to_ipv6_sends_a_bracketed_host() -> None:
    raw = RawServer("::1")
    try:
        raw.answers.append(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        answer = http_get("::1", raw.port, "/health", timeout_s=5)
    finally:
        raw.close()

    assert (answer.status, answer.body) == (200, "ok")
    assert f"Host: [::1]:{raw.port}\r\n".encode() in raw.requests[0]

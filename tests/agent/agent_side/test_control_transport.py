"""The control client's HTTP transport (``agent_side.control_link``, h11) against a scripted mutual-TLS server.

The server is real: TLS on 127.0.0.1 with a certificate from the devserver's CA, asking for the node's
client certificate. Each connection it accepts follows a script (answer these exact bytes, close without
answering, hang up after answering), so the faults a peer can produce are produced on purpose: a server
ending a kept-alive connection, an answer over the size cap, chunked and garbled answers.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import EnrollmentRequest
from meridian_node_agent.agent_side import control_link as control_http
from meridian_node_agent.agent_side.control_client import (
    DEFAULT_MAX_RESPONSE_BYTES,
    ControlClient,
    ControlPlaneUnavailable,
    FetchStatus,
)
from meridian_node_agent.agent_side.control_link import MAX_HEAD_BYTES
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.control.plane import open_control_plane
from meridian_node_agent.devserver.serving.tls import server_ssl_context

NODE_ID = "gpu-transport-1"


@dataclass(frozen=True)
class Close:
    """Read the request, then close the connection without a byte of answer."""


@dataclass(frozen=True)
class HangUp:
    """After the previous answer, close the connection without waiting for another request."""


@dataclass(frozen=True)
class Delayed:
    """Read the request, wait ``seconds``, then answer."""

    seconds: float
    answer: bytes


Step = bytes | Close | HangUp | Delayed


@dataclass
class ScriptedServer:
    """Mutual TLS on 127.0.0.1; connection number i (from 0) follows ``scripts[i]``."""

    context: ssl.SSLContext
    scripts: list[list[Step]]
    requests: list[tuple[int, bytes]] = field(default_factory=list)
    connections: int = 0
    listener: socket.socket = field(init=False)
    threads: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        acceptor = threading.Thread(target=self._accept, daemon=True)
        acceptor.start()
        self.threads.append(acceptor)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                raw, _address = self.listener.accept()
            except OSError:
                return
            index = self.connections
            self.connections += 1
            script = self.scripts[index] if index < len(self.scripts) else []
            worker = threading.Thread(target=self._serve, args=(raw, index, list(script)), daemon=True)
            worker.start()
            self.threads.append(worker)

    def _serve(self, raw: socket.socket, index: int, script: list[Step]) -> None:
        try:
            with self.context.wrap_socket(raw, server_side=True) as tls:
                tls.settimeout(30)
                pending = b""
                for step in script:
                    if isinstance(step, HangUp):
                        return
                    request, pending = _read_request(tls, pending)
                    if request is None:
                        return
                    self.requests.append((index, request))
                    if isinstance(step, Close):
                        return
                    if isinstance(step, Delayed):
                        time.sleep(step.seconds)
                        step = step.answer
                    tls.sendall(step)
                # Script done: hold the connection open until the client closes it.
                while tls.recv(65536):
                    pass
        except (OSError, ssl.SSLError):
            return
        finally:
            raw.close()

    def close(self) -> None:
        # Closing alone does not wake a thread blocked in accept() on Linux; shutting it down does.
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for thread in self.threads:
            thread.join(timeout=10)


def _read_request(tls: ssl.SSLSocket, pending: bytes) -> tuple[bytes | None, bytes]:
    """One request from our own client (head and Content-Length body); None at end of connection."""
    while b"\r\n\r\n" not in pending:
        data = tls.recv(65536)
        if not data:
            return None, b""
        pending += data
    head, _sep, rest = pending.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _colon, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        rest += tls.recv(65536)
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


@dataclass(frozen=True)
class Node:
    identity: NodeIdentity
    lease_json: bytes
    server_context: ssl.SSLContext


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    control = open_control_plane(tmp_path / "data", database=":memory:")
    try:
        identity = NodeIdentity(tmp_path / "node")
        token = control.create_token("transport")
        response = control.enroll(EnrollmentRequest(node_id=NODE_ID, token=token, csr_pem=identity.csr_pem(NODE_ID)))
        identity.store(response)
        cert, key = control.ca.write_server_certificate(tmp_path / "tls", ["127.0.0.1"])
        yield Node(
            identity, response.lease.model_dump_json().encode(), server_ssl_context(cert, key, control.ca.cert_path)
        )
    finally:
        control.close()


@pytest.fixture
def serve(node: Node) -> Iterator[list[ScriptedServer]]:
    """Start scripted servers by appending to this list: ``server = scripted(serve, node, [...])``."""
    servers: list[ScriptedServer] = []
    yield servers
    for server in servers:
        server.close()


def scripted(servers: list[ScriptedServer], node: Node, *scripts: list[Step]) -> ScriptedServer:
    server = ScriptedServer(node.server_context, list(scripts))
    servers.append(server)
    return server


def client_for(
    server: ScriptedServer, node: Node, *, timeout_s: float = 10, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
) -> ControlClient:
    identity = node.identity
    return ControlClient(
        server.url,
        identity.ca_path,
        identity.cert_path,
        identity.key_path,
        timeout_s=timeout_s,
        max_response_bytes=max_response_bytes,
    )


def answer(body: bytes, *head: bytes, status: bytes = b"200 OK") -> bytes:
    lines = [b"HTTP/1.1 " + status, b"Content-Type: application/json", b"Content-Length: %d" % len(body), *head]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(*parts: bytes) -> bytes:
    chunks = b"".join(b"%x;note=x\r\n%s\r\n" % (len(part), part) for part in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\nX-Trailer: t\r\n\r\n"


NOT_MODIFIED = b'HTTP/1.1 304 Not Modified\r\nETag: "g7"\r\nX-Meridian-Generation: 7\r\n\r\n'


def test_calls_share_one_kept_alive_connection(node: Node, serve: list[ScriptedServer]) -> None:
    server = scripted(serve, node, [answer(node.lease_json), NOT_MODIFIED, answer(node.lease_json)])
    with client_for(server, node) as client:
        client.heartbeat(NODE_ID)
        fetched = client.fetch_desired_state(NODE_ID, etag='"g7"')
        client.heartbeat(NODE_ID)

    assert (fetched.status, fetched.etag, fetched.generation) == (FetchStatus.NOT_MODIFIED, '"g7"', 7)
    assert server.connections == 1
    assert [index for index, _request in server.requests] == [0, 0, 0]
    assert b'If-None-Match: "g7"\r\n' in server.requests[1][1]


@pytest.mark.parametrize(
    ("ending", "requests"),
    [
        # Idle, the connection ended before the next request: the client sees it and connects again.
        pytest.param(HangUp(), [0, 1], id="idle-hang-up-costs-one-reconnect"),
        # The idle-timeout race: the connection looked alive when the request left, and the server closed it
        # without a byte of answer. The request never reached the application, so it is sent once more.
        pytest.param(Close(), [0, 0, 1], id="closed-as-the-request-arrives-is-sent-again-once"),
    ],
)
def test_server_ending_the_kept_alive_connection_costs_one_reconnect(
    node: Node, serve: list[ScriptedServer], ending: Step, requests: list[int]
) -> None:
    server = scripted(serve, node, [answer(node.lease_json), ending], [answer(node.lease_json)])
    with client_for(server, node) as client:
        client.heartbeat(NODE_ID)
        lease = client.heartbeat(NODE_ID)

    assert lease.node_id == NODE_ID
    assert server.connections == 2
    assert [index for index, _request in server.requests] == requests


def test_a_renewal_cut_off_by_the_idle_race_is_not_sent_again(node: Node, serve: list[ScriptedServer]) -> None:
    # Each renewal issues a certificate: a second request after a lost answer would issue another one.
    server = scripted(serve, node, [answer(node.lease_json), Close()], [answer(node.lease_json)])
    csr = "-----BEGIN CERTIFICATE REQUEST-----\nnot read by the scripted server\n"
    with client_for(server, node) as client:
        client.heartbeat(NODE_ID)
        with pytest.raises(ControlPlaneUnavailable, match="closed before any answer"):
            client.renew_certificate(NODE_ID, csr)

    assert server.connections == 1
    assert [index for index, _request in server.requests] == [0, 0]


def test_second_close_before_an_answer_is_unavailable_not_retried_again(
    node: Node, serve: list[ScriptedServer]
) -> None:
    server = scripted(serve, node, [answer(node.lease_json), Close()], [Close()], [answer(node.lease_json)])
    with client_for(server, node) as client:
        client.heartbeat(NODE_ID)
        with pytest.raises(ControlPlaneUnavailable, match="closed before any answer"):
            client.heartbeat(NODE_ID)

    assert server.connections == 2


def test_close_before_an_answer_on_a_new_connection_is_unavailable_and_not_retried(
    node: Node, serve: list[ScriptedServer]
) -> None:
    server = scripted(serve, node, [Close()], [answer(node.lease_json)])
    with client_for(server, node) as client, pytest.raises(ControlPlaneUnavailable) as failed:
        client.heartbeat(NODE_ID)

    assert f"POST {server.url}/v1/nodes/{NODE_ID}/heartbeat" in str(failed.value)
    assert "closed before any answer" in str(failed.value)
    assert server.connections == 1


def test_announced_body_over_the_cap_is_refused_naming_the_cap_before_any_of_it_arrives(
    node: Node, serve: list[ScriptedServer]
) -> None:
    # The head announces 10 MB and no body follows: a client that read on would wait out its timeout.
    head_only = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
    server = scripted(serve, node, [head_only], [answer(node.lease_json)])
    with client_for(server, node, max_response_bytes=4096, timeout_s=30) as client:
        with pytest.raises(ControlPlaneUnavailable) as refused:
            client.heartbeat(NODE_ID)
        assert "4096-byte limit" in str(refused.value)
        assert "announced 10000000 bytes" in str(refused.value)

        lease = client.heartbeat(NODE_ID)  # on a new connection: the refused one still had a body coming

    assert lease.node_id == NODE_ID
    assert server.connections == 2


def test_chunked_body_over_the_cap_is_refused_naming_the_cap(node: Node, serve: list[ScriptedServer]) -> None:
    server = scripted(serve, node, [chunked(b"x" * 3000, b"y" * 3000)])
    with (
        client_for(server, node, max_response_bytes=4096) as client,
        pytest.raises(ControlPlaneUnavailable, match="4096-byte limit"),
    ):
        client.heartbeat(NODE_ID)


def test_chunked_answer_with_extensions_and_trailers_is_read_whole(node: Node, serve: list[ScriptedServer]) -> None:
    body = node.lease_json
    server = scripted(serve, node, [chunked(body[:10], body[10:25], body[25:]), answer(body)])
    with client_for(server, node) as client:
        first = client.heartbeat(NODE_ID)
        second = client.heartbeat(NODE_ID)

    assert first == second
    assert server.connections == 1  # a complete chunked answer leaves the connection reusable


def test_interim_answers_are_skipped(node: Node, serve: list[ScriptedServer]) -> None:
    server = scripted(serve, node, [b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + answer(node.lease_json)])
    with client_for(server, node) as client:
        assert client.heartbeat(NODE_ID).node_id == NODE_ID


def test_answer_saying_close_is_not_reused(node: Node, serve: list[ScriptedServer]) -> None:
    server = scripted(
        serve, node, [answer(node.lease_json, b"Connection: close"), answer(node.lease_json)], [answer(node.lease_json)]
    )
    with client_for(server, node) as client:
        client.heartbeat(NODE_ID)
        client.heartbeat(NODE_ID)

    assert [index for index, _request in server.requests] == [0, 1]


def test_bytes_after_the_answer_that_no_request_asked_for_are_not_taken_as_the_next_answer(
    node: Node, serve: list[ScriptedServer]
) -> None:
    stray = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
    server = scripted(serve, node, [answer(node.lease_json) + stray], [answer(node.lease_json)])
    with client_for(server, node) as client:
        client.heartbeat(NODE_ID)
        lease = client.heartbeat(NODE_ID)

    assert lease.node_id == NODE_ID
    assert [index for index, _request in server.requests] == [0, 1]


@pytest.mark.parametrize(
    ("garbled", "named"),
    [
        (b"HTTP/1.1 2OO OK\r\nContent-Length: 0\r\n\r\n", "illegal status line"),
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "illegal status line"),
        (b"HTTP/1.1 200 OK\r\nBad Header: x\r\nContent-Length: 0\r\n\r\n", "illegal header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello!", "conflicting Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "illegal chunk header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "Transfer-Encoding: chunked"),
    ],
)
def test_malformed_answer_is_unavailable_naming_what_was_wrong(
    node: Node, serve: list[ScriptedServer], garbled: bytes, named: str
) -> None:
    server = scripted(serve, node, [garbled], [answer(node.lease_json)])
    with client_for(server, node) as client:
        with pytest.raises(ControlPlaneUnavailable) as failed:
            client.heartbeat(NODE_ID)
        assert "not valid HTTP/1.1" in str(failed.value)
        assert named in str(failed.value)

        assert client.heartbeat(NODE_ID).node_id == NODE_ID  # the garbled connection was dropped

    assert server.connections == 2


def test_answer_cut_short_is_unavailable_naming_how_much_came(node: Node, serve: list[ScriptedServer]) -> None:
    server = scripted(serve, node, [b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"node_id"', HangUp()])
    with client_for(server, node) as client, pytest.raises(ControlPlaneUnavailable) as failed:
        client.heartbeat(NODE_ID)

    assert "received 10 bytes, expected 100" in str(failed.value)


def test_long_poll_may_take_its_wait_beyond_the_read_timeout_and_a_plain_call_may_not(
    node: Node, serve: list[ScriptedServer]
) -> None:
    server = scripted(serve, node, [Delayed(1.5, NOT_MODIFIED), Delayed(1.5, answer(node.lease_json))])
    with client_for(server, node, timeout_s=0.5) as client:
        fetched = client.fetch_desired_state(NODE_ID, etag='"g7"', wait_s=5)
        assert fetched.status is FetchStatus.NOT_MODIFIED
        with pytest.raises(ControlPlaneUnavailable, match="no answer in time"):
            client.heartbeat(NODE_ID)


def test_answer_head_over_the_head_limit_is_unavailable_naming_the_limit(
    node: Node, serve: list[ScriptedServer]
) -> None:
    # h11 checks its bound whenever it needs more bytes for the head, so the head is refused once the bytes
    # buffered without its end pass the limit: within one read (16 KiB) of it.
    huge = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"p" * (4 * MAX_HEAD_BYTES) + b"\r\nContent-Length: 0\r\n\r\n"
    server = scripted(serve, node, [huge])
    with client_for(server, node) as client, pytest.raises(ControlPlaneUnavailable) as failed:
        client.heartbeat(NODE_ID)

    assert f"longer than {MAX_HEAD_BYTES} bytes" in str(failed.value)


def test_public_api_of_the_transport_is_pinned() -> None:
    assert set(control_http.__all__) == {
        "MAX_HEAD_BYTES",
        "AnswerTooLarge",
        "ClosedBeforeAnswer",
        "HttpExchangeError",
        "Interrupted",
        "Link",
        "MalformedAnswer",
        "Reply",
    }

"""HTTP/1.1 on the control-plane link, read by ``h11``: one kept-alive socket, bounded answers.

Runs on: the agent side (``agent_side.control_client``'s transport).

What the control plane sends comes from a remote peer, so it is parsed by a maintained implementation
(``h11``, the sans-IO HTTP/1.1 state machine under uvicorn and httpcore), never by hand. This module does
only the I/O around it: it writes the request ``h11`` serialised, feeds what the socket returns into it,
and gathers the events into one ``Reply``. What it adds to ``h11`` are the agent's limits:

- the body is capped: a ``Content-Length`` over the cap is refused as soon as the head is read, before
  any of the body, and a chunked or close-delimited body as soon as it passes the cap;
- the head (status line and headers) is capped, ``MAX_HEAD_BYTES`` unless the caller says otherwise
  (``h11``'s bound: checked whenever it needs more bytes, so a head is refused within one read of it);
- an answer the peer ends early, or bytes that are not HTTP/1.1, raise ``MalformedAnswer`` naming what
  ``h11`` found wrong; a peer that closes before sending any byte of an answer raises ``ClosedBeforeAnswer``
  (on a kept-alive connection that is the server having ended it while the request was on its way, and
  the caller may send the request once more on a new connection).

After a complete exchange ``Link.reusable`` says whether the socket may carry the next request: both
sides finished their message, neither asked to close, and nothing arrived that no request asked for.

Socket errors (``OSError``, ``ssl.SSLError``, ``TimeoutError``) pass through unchanged: the caller
knows what they mean for its peer (an expired client certificate, for one).

A link given an ``interrupt`` descriptor (the agent's stop pipe, ``agent_side.stop``) waits for each read on
that descriptor too, and raises ``Interrupted`` as soon as it is readable: a stopping agent does not sit out a
30-second long-poll, and starts no exchange at all once it is stopping.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import h11

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "MAX_HEAD_BYTES",
    "AnswerTooLarge",
    "ClosedBeforeAnswer",
    "HttpExchangeError",
    "Interrupted",
    "Link",
    "MalformedAnswer",
    "Reply",
]

# The status line and headers together. The control plane's heads are a few hundred bytes; this is
# ``h11``'s own default, far above them and far below what a hostile peer would need to hurt.
MAX_HEAD_BYTES = 16 * 1024
# One TLS record carries at most 16 KiB, so no read returns more: a larger buffer would only be allocated
# and shrunk again on every read.
_RECV_BYTES = 16384


class HttpExchangeError(MeridianError):
    """The exchange did not produce a complete, well-formed answer within the limits."""


class ClosedBeforeAnswer(HttpExchangeError):
    """The peer closed the connection before sending any byte of an answer."""


class MalformedAnswer(HttpExchangeError):
    """What the peer sent is not a complete HTTP/1.1 answer (``h11`` says why)."""


class Interrupted(HttpExchangeError):
    """The ``interrupt`` descriptor became readable (the agent is stopping): the exchange was given up."""


class AnswerTooLarge(HttpExchangeError):
    """The answer's body is larger than the cap; the rest of it was not read."""

    def __init__(self, limit: int, size: int | None) -> None:
        told = f" (it announced {size} bytes)" if size is not None else ""
        super().__init__(f"the answer's body is larger than the {limit}-byte limit{told}")
        self.limit = limit
        self.size = size


@dataclass(frozen=True)
class Reply:
    status: int
    reason: str
    headers: Mapping[str, str]  # names lowercased; repeated headers joined with ", "
    body: bytes


class Link:
    """One HTTP/1.1 connection over ``sock`` (connected, TLS already wrapped): requests one at a time."""

    def __init__(
        self, sock: socket.socket, *, max_head_bytes: int = MAX_HEAD_BYTES, interrupt: int | None = None
    ) -> None:
        self.sock = sock
        self.max_head_bytes = max_head_bytes
        self.interrupt = interrupt
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head_bytes)
        # Completed exchanges: a connection that has carried one is "kept alive", and a close before the
        # next answer is the server ending an idle connection, not a refusal of the request.
        self.exchanges = 0
        # Whether any byte of the current answer arrived (a request that may have been acted upon).
        self.answer_started = False

    @property
    def reusable(self) -> bool:
        return self._h11.our_state is h11.IDLE and self._h11.their_state is h11.IDLE

    def close(self) -> None:
        self.sock.close()

    def exchange(
        self,
        method: str,
        target: str,
        *,
        host: str,
        headers: Mapping[str, str],
        body: bytes | None,
        max_body: int,
    ) -> Reply:
        """Send one request and read its whole answer (1xx interim answers skipped)."""
        if not self.reusable:
            raise RuntimeError("this connection cannot carry another request: open a new one")
        connection = self._h11
        fields = [("Host", host), *headers.items()]
        if body is not None:
            fields.append(("Content-Length", str(len(body))))
        try:
            data = connection.send(h11.Request(method=method, target=target, headers=fields))
            if body:
                data += connection.send(h11.Data(data=body))
            data += connection.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise ValueError(f"cannot send {method} {target}: {exc}") from exc
        self.answer_started = False
        if self.interrupt is not None and _readable(self.interrupt, 0):
            raise Interrupted(f"{method} {target} not sent: the agent is stopping")
        self.sock.sendall(data)
        try:
            reply = self._read(max_body, bodiless=method == "HEAD")
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:  # h11's "Receive buffer too long": the head never ended
                raise MalformedAnswer(
                    f"the answer's status line and headers are longer than {self.max_head_bytes} bytes"
                ) from exc
            raise MalformedAnswer(f"the answer is not valid HTTP/1.1: {exc}") from exc
        self.exchanges += 1
        # Bytes after the answer were sent for no request: the connection is out of step, do not reuse it.
        if connection.our_state is h11.DONE and connection.their_state is h11.DONE and not connection.trailing_data[0]:
            connection.start_next_cycle()
        return reply

    def _read(self, max_body: int, *, bodiless: bool) -> Reply:
        connection = self._h11
        head: h11.Response | None = None
        parts: list[bytes] = []
        size = 0
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                if self.interrupt is not None:
                    self._await_data()
                data = self.sock.recv(_RECV_BYTES)
                if not data and not self.answer_started:
                    raise ClosedBeforeAnswer("the connection closed before any answer")
                self.answer_started = True
                connection.receive_data(data)
            elif isinstance(event, h11.Response):
                head = event
                announced = None if bodiless else _announced_length(event)
                if announced is not None and announced > max_body:
                    raise AnswerTooLarge(max_body, announced)
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > max_body:
                    raise AnswerTooLarge(max_body, None)
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None  # h11 sends no EndOfMessage before the Response
                return Reply(head.status_code, head.reason.decode("latin-1"), _fields(head.headers), b"".join(parts))
            elif not isinstance(event, h11.InformationalResponse):  # a 1xx: the final answer follows
                raise MalformedAnswer(f"the answer ended unexpectedly ({type(event).__name__})")

    def _await_data(self) -> None:
        """Wait for the socket as ``recv`` would (its timeout), or for ``interrupt``, which wins."""
        assert self.interrupt is not None
        # Bytes TLS has already decrypted are not on the descriptor any more: select would not see them.
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return
        readable, _, _ = select.select([self.sock.fileno(), self.interrupt], [], [], self.sock.gettimeout())
        if self.interrupt in readable:
            raise Interrupted("the answer was not waited for: the agent is stopping")
        if not readable:
            raise TimeoutError("timed out")  # what recv would have raised after the same wait


def _readable(fd: int, timeout_s: float) -> bool:
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return bool(readable)


def _announced_length(response: h11.Response) -> int | None:
    """The body length the head announces; None when the body is chunked, close-delimited or absent."""
    if response.status_code in (204, 304):
        return None
    length = None
    for name, value in response.headers:
        if name == b"transfer-encoding":
            return None  # chunked framing takes precedence over a Content-Length (RFC 9112, 6.3)
        if name == b"content-length":
            length = int(value)  # h11 has checked it: digits, one value
    return length


def _fields(headers: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1")
        value = raw_value.decode("latin-1")
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    return fields

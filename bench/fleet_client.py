"""bench/fleet.py's transport: one kept-alive HTTP/1.1 connection over asyncio TLS, its answers read by h11.

Why this and not a thread per node or ``httpx.AsyncClient`` per node: 10,000 nodes each hold one connection
open for a whole step, on one core of a 2-core machine; only an event loop holds that many, and an
``asyncio.Protocol`` that feeds ``h11`` straight from ``data_received`` and resolves one future per answer is
the least Python an exchange can cost there (no stream reader, no task per read, one timer per request).
``h11`` is what the agent's own client reads the control plane with (``agent_side.control_link``), so the
answers are held to the same strictness. What it costs is in bench/fleet.py's docstring.

Two failures, as the agent's client has them: ``TransferFailed`` (connection refused, reset, closed before
the answer, garbled) and its ``TimedOut`` (no complete answer within the call's time). A status the caller
did not expect is not a failure here: the caller decides.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass

import h11

__all__ = ["Answer", "ClosedBeforeAnswer", "Link", "TimedOut", "TransferFailed"]

# The agent's cap on an answer (control_client.DEFAULT_MAX_RESPONSE_BYTES is 4 MiB); a desired state is a few KiB.
MAX_ANSWER_BYTES = 4 * 1024 * 1024


class TransferFailed(Exception):
    """The exchange did not complete: the agent would back off and retry."""


class ClosedBeforeAnswer(TransferFailed):
    """The server closed the connection before a byte of the answer arrived."""


class TimedOut(TransferFailed):
    """No complete answer within the call's time (the agent's ``timeout_seconds``, plus a long-poll's wait)."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[bytes, bytes]  # names lowercased
    body: bytes
    sent_at: float  # time.perf_counter() as the request was written
    done_at: float  # time.perf_counter() as the answer's last byte was parsed


class _Protocol(asyncio.Protocol):
    """Feeds ``h11`` as bytes arrive and completes the pending exchange's future at the answer's end."""

    def __init__(self) -> None:
        self.h11 = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=64 * 1024)
        self.transport: asyncio.Transport | None = None
        self.pending: asyncio.Future[Answer] | None = None
        self.sent_at = 0.0
        self.started = False
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self.h11.receive_data(data)
            self._pump()
        except h11.ProtocolError as exc:
            self._fail(TransferFailed(f"the answer is not HTTP/1.1: {exc}"))

    def eof_received(self) -> bool | None:
        try:
            self.h11.receive_data(b"")
            self._pump()
        except h11.ProtocolError as exc:
            self._fail(TransferFailed(f"the connection ended inside an answer: {exc}"))
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.pending is not None and not self.pending.done():
            error = ClosedBeforeAnswer if not self.started else TransferFailed
            self.pending.set_exception(error(f"the server closed the connection ({exc or 'end of stream'})"))

    def _pump(self) -> None:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = dict(event.headers)
            elif isinstance(event, h11.Data):
                self.size += len(event.data)
                if self.size > MAX_ANSWER_BYTES:
                    self._fail(TransferFailed(f"the answer exceeds {MAX_ANSWER_BYTES} bytes"))
                    return
                self.body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                answer = Answer(self.status, self.headers, b"".join(self.body), self.sent_at, time.perf_counter())
                if self.pending is not None and not self.pending.done():
                    self.pending.set_result(answer)
                return
            elif isinstance(event, h11.ConnectionClosed):
                self._fail(TransferFailed("the server closed the connection inside an answer"))
                return
            # h11.InformationalResponse (a 100 Continue) needs nothing

    def _fail(self, error: TransferFailed) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


class Link:
    """One node's kept-alive connection to ``host:port`` with ``context`` (its own certificate, or none).

    ``exchange`` opens the connection when there is none (``connects`` counts them) and, like the agent's
    client, sends a request once more on a new connection when the server closed a reused one before a byte
    of the answer came back (its keep-alive timeout racing the request).
    """

    def __init__(self, host: str, port: int, context: ssl.SSLContext) -> None:
        self.host, self.port, self.context = host, port, context
        self.authority = f"{host}:{port}".encode()
        self._protocol: _Protocol | None = None
        self._exchanges = 0  # on the current connection
        self.connects = 0

    @property
    def connected(self) -> bool:
        return self._protocol is not None and not self._protocol.closed

    async def connect(self, timeout_s: float) -> None:
        """Open the connection (TCP and the TLS handshake) unless one is open."""
        if self.connected:
            return
        self.close()
        loop = asyncio.get_running_loop()
        try:
            _transport, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, self.host, self.port, ssl=self.context, server_hostname=self.host),
                timeout_s,
            )
        except TimeoutError as exc:
            raise TimedOut(f"no connection to {self.host}:{self.port} within {timeout_s:g} s") from exc
        except (OSError, ssl.SSLError) as exc:
            raise TransferFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._protocol = protocol
        self._exchanges = 0
        self.connects += 1

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.abort()
        self._protocol = None

    async def exchange(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes | None, timeout_s: float
    ) -> Answer:
        reused = self.connected and self._exchanges > 0
        try:
            return await self._exchange(method, target, headers, body, timeout_s)
        except ClosedBeforeAnswer:
            if not reused:
                raise
            return await self._exchange(method, target, headers, body, timeout_s)

    async def _exchange(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes | None, timeout_s: float
    ) -> Answer:
        await self.connect(timeout_s)
        protocol = self._protocol
        assert protocol is not None and protocol.transport is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        protocol.pending, protocol.started, protocol.body, protocol.size = future, False, [], 0
        fields = [(b"host", self.authority), *headers]
        if body is not None:
            fields.append((b"content-length", str(len(body)).encode()))
        try:
            data = protocol.h11.send(h11.Request(method=method, target=target, headers=fields)) or b""
            if body is not None:
                data += protocol.h11.send(h11.Data(data=body)) or b""
            data += protocol.h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:
            self.close()
            raise TransferFailed(f"cannot send on this connection: {exc}") from exc
        protocol.sent_at = time.perf_counter()
        protocol.transport.write(data)
        self._exchanges += 1
        timer = loop.call_later(timeout_s, _expire, future, protocol, timeout_s)
        try:
            answer = await future
        except TransferFailed:
            self.close()
            raise
        finally:
            timer.cancel()
        if protocol.h11.our_state is h11.DONE and protocol.h11.their_state is h11.DONE:
            protocol.h11.start_next_cycle()
        else:  # the server said close, or sent what no request asked for
            self.close()
        return answer


def _expire(future: asyncio.Future[Answer], protocol: _Protocol, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(TimedOut(f"no complete answer within {timeout_s:g} s"))
        if protocol.transport is not None:
            protocol.transport.abort()

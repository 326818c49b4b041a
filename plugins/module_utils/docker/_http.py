"""One HTTP/1.1 request per connection, read lean: the local calls the agent makes every cycle.

The agent asks the Docker Engine for its containers and each engine for its readiness every cycle. With
``http.client`` most of the CPU of such a call goes to parsing the answer's headers through the ``email``
package; here the status line and headers are split directly. The exchange is deliberately narrow:

- one request on a socket the caller connected (Unix, TCP or TLS): ``Connection: close``, or with
  ``keep_alive`` an HTTP/1.1 persistent connection, where ``Answer.reusable`` says whether the socket may
  carry the next request (a length-delimited answer the server did not mark ``Connection: close``);
- the answer's body is read by ``Content-Length``, by chunks (``Transfer-Encoding: chunked``, extensions
  and trailers skipped), or to the end of the connection; none for HEAD, 1xx, 204 and 304;
- interim 1xx answers (``103 Early Hints``) are skipped;
- limits on the status line, each header line, the number of headers and the body; an answer that breaks
  them, or ends early, raises ``HttpLiteError`` naming what was wrong;
- ``exchange_streamed``: the same request, its body then read as it arrives (``StreamedAnswer.read`` with a
  timeout per read), for the one long answer the Docker Engine streams: an image pull's progress. A read
  that times out loses nothing (the bytes are taken from the socket by ``recv`` and decoded here, not through
  a buffered file that a timeout leaves in an unknown state), so the caller can look at the clock and read on.

Its reading is checked against ``h11``, a maintained implementation, byte for byte on the same answers
(tests/collection/module_utils/docker/test_http_lite_differential.py): the two agree, or this
refuses. It stays for these local calls because it costs about half the CPU of ``http.client`` or ``h11``
per Docker API call (bench/control_http.py);
the control plane's answers, which come from a remote peer, are read by ``h11`` (the agent's
``agent_side.control_link``).
"""

from __future__ import annotations

import io
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = ["Answer", "ChunkedDecoder", "HttpLiteError", "StreamedAnswer", "exchange", "exchange_streamed"]

_MAX_LINE = 65536
_MAX_HEADERS = 100
# RFC 9110/9112 grammar, in ASCII only: str.isdigit() also takes "²", which int() then refuses.
_STATUS_CODE = re.compile(r"[1-9][0-9][0-9]")
_DIGITS = re.compile(r"[0-9]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # in a field value: every control but HTAB


class HttpLiteError(MeridianError):
    """The answer was not well-formed HTTP/1.x, broke a limit, or ended early."""


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    headers: Mapping[str, str]  # names lowercased; repeated headers joined with ", "
    body: bytes
    reusable: bool = False


def exchange(
    sock: socket.socket,
    method: str,
    target: str,
    *,
    host: str,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    max_body: int,
    truncate: bool = False,
    keep_alive: bool = False,
) -> Answer:
    """Send one request on ``sock`` and read the whole answer; the caller closes ``sock`` (or, when the
    answer is ``reusable``, may send the next request on it).

    A body longer than ``max_body`` raises, or with ``truncate`` is cut at ``max_body`` bytes.
    """
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if not keep_alive:
        lines.append("Connection: close")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
    with sock.makefile("rb") as stream:
        while True:
            version, status, reason = _status_line(stream)
            fields = _header_fields(stream)
            if not 100 <= status < 200:
                break
        tokens = {token.strip() for token in fields.get("connection", "").lower().split(",")}
        persistent = keep_alive and version == "HTTP/1.1" and "close" not in tokens
        if method == "HEAD" or status in (204, 304):
            return Answer(status, reason, fields, b"", reusable=persistent)
        coding = fields.get("transfer-encoding")
        if coding is not None:
            # Any other coding (gzip, ...) would hand back an encoded body as if it were the body.
            if coding.strip().lower() != "chunked":
                raise HttpLiteError(f"unsupported Transfer-Encoding: {coding[:80]!r} (only chunked is read)")
            data = _chunked(stream, max_body, truncate)
            persistent = persistent and len(data) < max_body  # a cut answer leaves chunks unread
        elif "content-length" in fields:
            size = _content_length(fields["content-length"])
            data = _sized(stream, size, max_body, truncate)
            persistent = persistent and len(data) == size
        else:
            # Delimited by the end of the connection: nothing can follow on this socket.
            return Answer(status, reason, fields, _to_end(stream, max_body, truncate))
    return Answer(status, reason, fields, data, reusable=persistent)


def _line(stream: BinaryIO, what: str) -> bytes:
    line = stream.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise HttpLiteError(f"the {what} is longer than {_MAX_LINE} bytes")
    if not line:
        raise HttpLiteError(f"the connection closed before the {what}")
    return line


def _status_line(stream: BinaryIO) -> tuple[str, int, str]:
    line = _line(stream, "status line").decode("latin-1").rstrip("\r\n")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _STATUS_CODE.fullmatch(parts[1]):
        raise HttpLiteError(f"not an HTTP/1.x status line: {line[:80]!r}")
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else ""


def _header_fields(stream: BinaryIO) -> dict[str, str]:
    fields: dict[str, str] = {}
    for _index in range(_MAX_HEADERS + 1):  # lines, not names: repeated names would grow one value forever
        line = _line(stream, "headers").decode("latin-1")
        if line in ("\r\n", "\n"):
            return fields
        name, colon, value = line.partition(":")
        value = value.strip(" \t\r\n")  # str.strip() would also drop controls and NBSP unseen
        if not colon or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            raise HttpLiteError(f"malformed header line: {line.rstrip()[:80]!r}")
        key = name.lower()
        fields[key] = f"{fields[key]}, {value}" if key in fields else value
    raise HttpLiteError(f"more than {_MAX_HEADERS} headers")


def _content_length(text: str) -> int:
    values = {part.strip() for part in text.split(",")}
    if len(values) != 1 or not _DIGITS.fullmatch(next(iter(values))):
        raise HttpLiteError(f"bad Content-Length: {text!r}")
    return int(values.pop())


def _limit(size: int, max_body: int, truncate: bool) -> int:
    if size > max_body and not truncate:
        raise HttpLiteError(f"the answer's body is larger than {max_body} bytes")
    return min(size, max_body)


def _sized(stream: BinaryIO, size: int, max_body: int, truncate: bool) -> bytes:
    wanted = _limit(size, max_body, truncate)
    data = stream.read(wanted)
    if len(data) < wanted:
        raise HttpLiteError(f"the answer ended after {len(data)} of {size} body bytes")
    return data


def _to_end(stream: BinaryIO, max_body: int, truncate: bool) -> bytes:
    data = stream.read(max_body + 1)
    if len(data) > max_body:
        _limit(len(data), max_body, truncate)
        return data[:max_body]
    return data


def _chunked(stream: BinaryIO, max_body: int, truncate: bool) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_text = _line(stream, "chunk size").split(b";", 1)[0].rstrip()
        # int(text, 16) alone also takes "0x2", "+2", "1_0" and "-5" (a negative read reads to the end).
        if not _HEX.fullmatch(size_text):
            raise HttpLiteError(f"bad chunk size: {size_text[:20]!r}")
        size = int(size_text, 16)
        if size == 0:
            while _line(stream, "trailer") not in (b"\r\n", b"\n"):
                pass
            return b"".join(parts)
        if total + size > max_body:
            _limit(total + size, max_body, truncate)
            parts.append(stream.read(max_body - total))
            return b"".join(parts)
        chunk = stream.read(size)
        if len(chunk) < size:
            raise HttpLiteError("the answer ended inside a chunk")
        if _line(stream, "chunk end") not in (b"\r\n", b"\n"):
            raise HttpLiteError("a chunk is longer than its size says")
        parts.append(chunk)
        total += size


class ChunkedDecoder:
    """``Transfer-Encoding: chunked`` decoded incrementally: ``feed`` takes the bytes that arrived and returns
    the body bytes they complete; ``done`` once the last chunk and its trailers are read. Extensions and
    trailers are skipped, as ``exchange`` does; malformed framing raises ``HttpLiteError``."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._left = 0  # body bytes still to come in the current chunk
        self._state = "size"  # size, data, crlf, trailer, done

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out = bytearray()
        while self._pending and self._state != "done":
            if self._state == "data":
                take = min(self._left, len(self._pending))
                out += self._pending[:take]
                del self._pending[:take]
                self._left -= take
                if self._left == 0:
                    self._state = "crlf"
                continue
            line = self._line()
            if line is None:
                break
            if self._state == "size":
                size_text = line.split(b";", 1)[0].rstrip()
                if not _HEX.fullmatch(size_text):
                    raise HttpLiteError(f"bad chunk size: {size_text[:20]!r}")
                self._left = int(size_text, 16)
                self._state = "data" if self._left else "trailer"
            elif self._state == "crlf":
                if line not in (b"\r\n", b"\n"):
                    raise HttpLiteError("a chunk is longer than its size says")
                self._state = "size"
            elif line in (b"\r\n", b"\n"):  # the trailers' end
                self._state = "done"
        return bytes(out)

    def _line(self) -> bytes | None:
        end = self._pending.find(b"\n")
        if end < 0:
            if len(self._pending) > _MAX_LINE:
                raise HttpLiteError(f"a chunk size or trailer line is longer than {_MAX_LINE} bytes")
            return None
        line = bytes(self._pending[: end + 1])
        del self._pending[: end + 1]
        return line


class StreamedAnswer:
    """An answer whose status and headers are read and whose body is read as it arrives (``read``)."""

    def __init__(self, sock: socket.socket, status: int, reason: str, headers: Mapping[str, str], early: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self._sock = sock
        self._chunked: ChunkedDecoder | None = None
        self._left: int | None = None  # Content-Length bytes still to come; None: to the end of the connection
        self._ended = False
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.strip().lower() != "chunked":
                raise HttpLiteError(f"unsupported Transfer-Encoding: {coding[:80]!r} (only chunked is read)")
            self._chunked = ChunkedDecoder()
        elif "content-length" in headers:
            self._left = _content_length(headers["content-length"])
        self._early = early  # body bytes that arrived with the headers

    def read(self, timeout_s: float) -> bytes | None:
        """The body bytes that arrive within ``timeout_s`` (at least one, or more as they come); ``b""`` once
        the body has ended; None when nothing arrived in time (nothing is lost: read again)."""
        while not self._ended:
            if self._early:
                data, self._early = self._early, b""
            else:
                self._sock.settimeout(max(timeout_s, 0.001))
                try:
                    data = self._sock.recv(65536)
                except (socket.timeout, BlockingIOError):
                    return None
                if not data:
                    if self._chunked is not None or (self._left or 0) > 0:
                        raise HttpLiteError("the answer ended before its body did")
                    self._ended = True
                    return b""
            body = self._body(data)
            if body:
                return body
        return b""

    def _body(self, data: bytes) -> bytes:
        if self._chunked is not None:
            body = self._chunked.feed(data)
            self._ended = self._chunked.done
            return body
        if self._left is not None:
            body = data[: self._left]
            self._left -= len(body)
            self._ended = self._left == 0
            return body
        return data


def exchange_streamed(
    sock: socket.socket,
    method: str,
    target: str,
    *,
    host: str,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
) -> StreamedAnswer:
    """Send one request on ``sock`` (``Connection: close``) and read the answer's status line and headers (within
    the socket's own timeout); the body is then read with ``StreamedAnswer.read``. The caller closes ``sock``:
    closing it early is how a streamed operation is abandoned."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
    received = bytearray()
    while True:
        end = received.find(b"\r\n\r\n")
        if end >= 0:
            head, rest = bytes(received[: end + 4]), bytes(received[end + 4 :])
            stream = io.BytesIO(head)
            _version, status, reason = _status_line(stream)
            fields = _header_fields(stream)
            if not 100 <= status < 200:
                return StreamedAnswer(sock, status, reason, fields, rest)
            received = bytearray(rest)  # an interim answer: the real one follows
            continue
        if len(received) > _MAX_LINE * 4:
            raise HttpLiteError(f"the answer's status line and headers are longer than {_MAX_LINE * 4} bytes")
        data = sock.recv(65536)
        if not data:
            raise HttpLiteError("the connection closed before the headers ended")
        received += data

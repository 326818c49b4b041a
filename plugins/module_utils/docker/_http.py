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
  them, or ends early, raises ``HttpLiteError`` naming what was wrong.

Its reading is checked against ``h11``, a maintained implementation, byte for byte on the same answers
(tests/collection/module_utils/docker/test_http_lite_differential.py): the two agree, or this
refuses. It stays for these local calls because it costs about half the CPU of ``http.client`` or ``h11``
per Docker API call (bench/control_http.py);
the control plane's answers, which come from a remote peer, are read by ``h11`` (the agent's
``agent_side.control_link``).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = ["Answer", "HttpLiteError", "exchange"]

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

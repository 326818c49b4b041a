"""http_lite's reading of answers, checked against h11 (a maintained HTTP/1.1 implementation).

Each case's exact bytes go through both, each over a real socket pair: ``docker._http.exchange`` as the
Docker and engine probes call it (``keep_alive`` on, so its reuse verdict is compared too), and h11 as the
control link drives it (``agent_side.control_link.Link``). The rule: they agree (status, headers, body, whether the
connection may carry another request), or http_lite refuses. http_lite accepting what h11 refuses, or
reading it differently, is a bug in http_lite.

h11 is given http_lite's own head limit here (100 lines of up to 64 KiB), so a difference is a difference in
reading, not in limits. Each case also pins what each side does, so a change in either is seen.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker._http import HttpLiteError, exchange
from meridian_node_agent.agent_side.control_link import HttpExchangeError, Link

MAX_BODY = 1 << 20
# http_lite's ceiling: 100 header lines of up to 64 KiB, plus the status line.
LITE_HEAD_CEILING = 101 * 65536 + 4


@dataclass(frozen=True)
class Parsed:
    status: int
    headers: dict[str, str]
    body: bytes
    reusable: bool


@dataclass(frozen=True)
class Refused:
    reason: str


Outcome = Parsed | Refused


def _feed(raw: bytes) -> tuple[socket.socket, threading.Thread]:
    """A connected socket whose peer reads the request and answers with ``raw``, then closes."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)

    def answer() -> None:
        with theirs:
            theirs.recv(65536)  # the request (small: one read)
            try:
                theirs.sendall(raw)
                theirs.shutdown(socket.SHUT_WR)
                theirs.settimeout(10)
                while theirs.recv(65536):  # until the reader is done
                    pass
            except OSError:
                pass  # the reader refused early and closed: the rest was not wanted

    writer = threading.Thread(target=answer, daemon=True)
    writer.start()
    return ours, writer


def through_http_lite(raw: bytes, method: str = "GET") -> Outcome:
    sock, writer = _feed(raw)
    try:
        answer = exchange(sock, method, "/", host="peer", max_body=MAX_BODY, keep_alive=True)
    except HttpLiteError as exc:
        return Refused(str(exc))
    finally:
        sock.close()
        writer.join(timeout=10)
    return Parsed(answer.status, dict(answer.headers), answer.body, answer.reusable)


def through_h11(raw: bytes, method: str = "GET") -> Outcome:
    sock, writer = _feed(raw)
    link = Link(sock, max_head_bytes=LITE_HEAD_CEILING)
    try:
        reply = link.exchange(method, "/", host="peer", headers={}, body=None, max_body=MAX_BODY)
    except HttpExchangeError as exc:
        return Refused(str(exc))
    finally:
        link.close()
        writer.join(timeout=10)
    return Parsed(reply.status, dict(reply.headers), reply.body, link.reusable)


@dataclass(frozen=True)
class Case:
    raw: bytes
    h11: str  # "parsed" or "refused": what the reference does
    lite: str  # what http_lite does: "parsed" only where it agrees
    method: str = "GET"


OK = b"HTTP/1.1 200 OK\r\n"
CASES: dict[str, Case] = {
    # Both read these, and must read them alike.
    "content-length, repeated header": Case(
        OK + b"Content-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello", "parsed", "parsed"
    ),
    "chunked with extensions and trailers": Case(
        OK + b"Transfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\nA\r\npedia-0123\r\n0\r\nTrailer: x\r\n\r\n",
        "parsed",
        "parsed",
    ),
    "chunked, coding named in capitals": Case(
        OK + b"Transfer-Encoding: Chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", "parsed", "parsed"
    ),
    "chunked wins over Content-Length": Case(
        OK + b"Content-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", "parsed", "parsed"
    ),
    "keep-alive answer, reusable": Case(OK + b"Content-Length: 2\r\n\r\nok", "parsed", "parsed"),
    "Connection: close, not reusable": Case(
        OK + b"Content-Length: 2\r\nConnection: keep-alive, close\r\n\r\nok", "parsed", "parsed"
    ),
    "HTTP/1.0 with a length, not reusable": Case(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "parsed", "parsed"),
    "HTTP/1.0 to the end of the connection": Case(
        b"HTTP/1.0 503 Service Unavailable\r\n\r\nLoading model", "parsed", "parsed"
    ),
    "204 without a body": Case(b"HTTP/1.1 204 No Content\r\n\r\n", "parsed", "parsed"),
    "304 announcing a length, no body": Case(
        b'HTTP/1.1 304 Not Modified\r\nETag: "g1"\r\nContent-Length: 100\r\n\r\n', "parsed", "parsed"
    ),
    "HEAD answer announcing a length, no body": Case(
        OK + b"Content-Length: 10\r\n\r\n", "parsed", "parsed", method="HEAD"
    ),
    "interim 103 then 200": Case(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK + b"Content-Length: 0\r\n\r\n", "parsed", "parsed"
    ),
    "status line without a reason": Case(b"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", "parsed", "parsed"),
    "same Content-Length twice in one field": Case(OK + b"Content-Length: 5, 5\r\n\r\nhello", "parsed", "parsed"),
    "bare LF line ends": Case(b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", "parsed", "parsed"),
    "whitespace around a value, empty value, tab inside": Case(
        OK + b"X-A:   a\tb  \r\nX-B:\r\nContent-Length: 0\r\n\r\n", "parsed", "parsed"
    ),
    # Both refuse these.
    "nothing at all": Case(b"", "refused", "refused"),
    "not HTTP": Case(b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "refused", "refused"),
    "malformed status code": Case(b"HTTP/1.1 2OO OK\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "four-digit status code": Case(b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "status code below 100": Case(b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "status code in non-ASCII digits": Case(
        b"HTTP/1.1 \xb2\xb2\xb2 OK\r\nContent-Length: 0\r\n\r\n", "refused", "refused"
    ),
    "HTTP/2 status line": Case(b"HTTP/2 200 OK\r\n\r\n", "refused", "refused"),
    "two spaces in the status line": Case(b"HTTP/1.1  200 OK\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "header line without a colon": Case(OK + b"no colon here\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "space before the colon": Case(OK + b"Content-Length : 2\r\n\r\nok", "refused", "refused"),
    "space inside a header name": Case(OK + b"Bad Header: x\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "separator in a header name": Case(OK + b"X(a): 1\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "NUL in a header value": Case(OK + b"X: a\x00b\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "bare CR in a header value": Case(OK + b"X: a\rb\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "folded line before any header": Case(OK + b" folded: value\r\nContent-Length: 0\r\n\r\n", "refused", "refused"),
    "conflicting Content-Length in one field": Case(OK + b"Content-Length: 5, 6\r\n\r\nhello!", "refused", "refused"),
    "conflicting Content-Length fields": Case(
        OK + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", "refused", "refused"
    ),
    "Content-Length not a number": Case(OK + b"Content-Length: abc\r\n\r\n", "refused", "refused"),
    "Content-Length in non-ASCII digits": Case(OK + b"Content-Length: \xc2\xb2\r\n\r\nab", "refused", "refused"),
    "Content-Length in a superscript digit": Case(OK + b"Content-Length: \xb2\r\n\r\nab", "refused", "refused"),
    "negative Content-Length": Case(OK + b"Content-Length: -1\r\n\r\n", "refused", "refused"),
    "body shorter than its length": Case(OK + b"Content-Length: 10\r\n\r\nshort", "refused", "refused"),
    "transfer coding other than chunked": Case(
        OK + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "refused", "refused"
    ),
    "transfer coding merely containing 'chunked'": Case(
        OK + b"Transfer-Encoding: xchunked\r\nContent-Length: 2\r\n\r\nab", "refused", "refused"
    ),
    "chunk size not hex": Case(OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "refused", "refused"),
    "chunk size with 0x": Case(OK + b"Transfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n0\r\n\r\n", "refused", "refused"),
    "chunk size with a sign": Case(
        OK + b"Transfer-Encoding: chunked\r\n\r\n+2\r\nab\r\n0\r\n\r\n", "refused", "refused"
    ),
    "chunk size with an underscore": Case(
        OK + b"Transfer-Encoding: chunked\r\n\r\n1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", "refused", "refused"
    ),
    "chunk size after a space": Case(
        OK + b"Transfer-Encoding: chunked\r\n\r\n 2\r\nab\r\n0\r\n\r\n", "refused", "refused"
    ),
    "transfer coding identity": Case(
        OK + b"Transfer-Encoding: identity\r\nContent-Length: 2\r\n\r\nab", "refused", "refused"
    ),
    "negative chunk size": Case(OK + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nab\r\n0\r\n\r\n", "refused", "refused"),
    "chunk longer than its size": Case(
        OK + b"Transfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", "refused", "refused"
    ),
    "answer ends inside a chunk": Case(OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nab", "refused", "refused"),
    "answer ends before the last chunk": Case(
        OK + b"Transfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", "refused", "refused"
    ),
    # h11 reads these; http_lite refuses them, which the rule allows.
    "folded header line (obs-fold)": Case(OK + b"X: a\r\n b\r\nContent-Length: 0\r\n\r\n", "parsed", "refused"),
    "header line over 64 KiB": Case(OK + b"X: " + b"a" * 70000 + b"\r\nContent-Length: 0\r\n\r\n", "parsed", "refused"),
    "more than 100 header lines": Case(OK + b"X: y\r\n" * 101 + b"Content-Length: 0\r\n\r\n", "parsed", "refused"),
}


def _comparable(outcome: Outcome) -> Outcome:
    """h11 rewrites the framing fields' values (``5, 5`` to ``5``, ``Chunked`` to ``chunked``): what they
    mean is compared through the body and the reuse verdict; every other field as received."""
    if isinstance(outcome, Refused):
        return outcome
    kept = {name: value for name, value in outcome.headers.items() if name not in _FRAMING}
    return Parsed(outcome.status, kept, outcome.body, outcome.reusable)


_FRAMING = ("content-length", "transfer-encoding")


@pytest.mark.parametrize("name", list(CASES))
def test_http_lite_reads_an_answer_as_h11_does_or_refuses_it(name: str) -> None:
    case = CASES[name]
    reference = through_h11(case.raw, case.method)
    lite = through_http_lite(case.raw, case.method)

    if isinstance(lite, Parsed):
        assert _comparable(lite) == _comparable(reference), f"http_lite read {name!r} as {lite}, h11 as {reference}"
    assert type(reference).__name__.lower() == case.h11, f"h11: {reference}"
    assert type(lite).__name__.lower() == case.lite, f"http_lite: {lite}"


def test_the_agreeing_cases_cover_what_the_links_meet() -> None:
    parsed = [CASES[name] for name in CASES if CASES[name].lite == "parsed"]
    heads = b"".join(case.raw.lower() for case in parsed)
    assert b"transfer-encoding: chunked" in heads
    assert b"content-length" in heads
    assert b"304 not modified" in heads and b"204 no content" in heads
    assert any(
        through_h11(case.raw, case.method) == Parsed(200, {"content-length": "2"}, b"ok", True) for case in parsed
    )

"""The agent's side of protocol v1 (docs/PROTOCOL.md): one kept-alive mutual-TLS connection, bounded reads.

Runs on: the agent side: the unprivileged ``meridian-node run`` is the only caller of the control plane.

Two error families, so the caller can tell "try again later" from "the control plane said no":

- ``ControlPlaneUnavailable``: the transfer failed. Connection refused or reset, TLS handshake failure,
  timeout, a 5xx, a response over the size cap or one that is not what the protocol promises. The agent
  backs off and retries; engines keep serving.
- ``ControlCallStopped``: the agent is stopping (``interrupt``, its stop pipe, is readable): the call was not
  made, or its answer not waited for. Neither the control plane's fault nor a reason to back off.
- ``ControlPlaneRejected``: the control plane answered with a 4xx and a reason (``status``, ``reason``,
  ``detail`` from its ``{"reason", "detail"}`` body). Retrying the same request will not help.
  ``CertificateExpired`` is one: reason ``certificate-expired``, raised when the node's own client
  certificate has run out (below).

An expired client certificate is a refusal, not an outage. The server's TLS layer refuses it, and what
reaches the client is then a failed handshake or a connection closed before any answer (asyncio servers
drop the connection without sending the TLS alert), which on its own reads like "control plane down".
The client knows its certificate's end (``notAfter``, read when the TLS context is built), so it says
what is wrong instead: before each call, a certificate that has ended by this host's clock raises
``CertificateExpired`` without connecting (the agent keeps backing off and does not knock on the server
with a certificate it knows is refused); a transfer failure while it has ended, a TLS alert
``certificate_expired`` from the server (whose clock may run ahead) and a 403 ``certificate-expired``
answer raise it too. The cure is the operator's: enroll the node again. The client rebuilds its TLS
context when the files change, so a running agent picks up the new certificate by itself.

The desired-state envelope is returned as the exact bytes received: verifying it is the trust core's
job, and it must see what the server sent, not a re-serialisation.

The transport is one kept-alive TLS socket, over an SSL context built once from the node's files. What
the control plane sends is read by ``h11`` (``agent_side.control_link``), a maintained HTTP/1.1 implementation, not
by hand: the answers come from a remote peer. Chosen on bench/control_http.py's figures (a real
devserver over mutual TLS, one kept-alive connection per implementation, exchanges interleaved; CPU of
the client; 2-core CI machine, 2026-12-01). Against ``docker._http``, the hand-written exchange used before,
a heartbeat cost 1.64x with ``h11`` and 1.48x with ``http.client``, a 304 fetch 1.86x and 1.76x: ``h11``
about 0.2 ms more per exchange, and 6-10 % more than ``http.client``. But of the 34 malformed answers
that ``h11`` and ``docker._http`` both refuse
(tests/collection/module_utils/docker/test_http_lite_differential.py) ``http.client``
took 21 as answers (conflicting ``Content-Length``, a ``gzip`` transfer coding read as the body, ``0x``
chunk sizes, NUL in a header, lines without a colon); ``h11`` none. A few hundredths of a millisecond buy
a reader that refuses what it cannot read, so ``h11``; an unchanged agent cycle stays far under its
10 ms guard (bench/agent.py). ``h11`` is sans-IO, which also lets the client keep its limits
exactly: a ``Content-Length`` over the cap is refused before any of the body is read, and bytes after an
answer that no request asked for keep the connection from being reused.

Before each call the connection is checked: one the server closed while idle is reopened, never used.
When the server closes a kept-alive connection as a request reaches it (its idle timeout racing the
request) and not a byte of answer came back, the request is sent once more on a new connection; a second
failure is reported. The context is rebuilt when the CA bundle, certificate or key change on disk (a
re-enrolled node), so a running agent never keeps using files that were replaced.

Replicas. A control plane may run as several servers on one database and one data dir (``meridian-node-devserver
serve`` replicas: one CA, every node served by each). The client is given their base URLs, the primary first, and
calls one of them at a time, ``base_url``. When a call fails with ``ControlPlaneUnavailable``, the client closes its
connection and the *next* call goes to the next URL, round and round: the agent already backs off and retries after
such a failure, so the retry lands on another replica without a load balancer and without a second retry loop
here. The failed call itself is not sent again elsewhere: the caller decides whether to retry (enrollment's token
and a renewal's certificate are not to be spent twice), and the backoff keeps a fleet whose replica died from
stampeding the others. A refusal (``ControlPlaneRejected``, ``CertificateExpired`` among them) does not move it:
every replica shares the database and the CA, so the next would refuse the same. Nor does a stop
(``ControlCallStopped``). Every ``ControlPlaneUnavailable`` moves it, even the few that are not the replica's
doing (the node's own TLS files unreadable): those fail alike on every replica, so moving costs nothing, and one
rule is easier to reason about than a list. The client stays on a replica that answers; it does not drift back to
the primary. The exception it raises carries ``url`` (the one that failed) and ``next_url`` (where the next call
goes) when it moved, so the agent's log can say both.
"""

from __future__ import annotations

import functools
import json
import select
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from cryptography import x509
from pydantic import BaseModel

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    CertificateRenewalRequest,
    EnrollmentRequest,
    EnrollmentResponse,
    JsonError,
    Lease,
    Observation,
    ServingProjection,
    ValidationError,
    describe_validation_error,
    format_rfc3339,
    parse_document,
)
from meridian_node_agent.agent_side.control_link import (
    AnswerTooLarge,
    ClosedBeforeAnswer,
    HttpExchangeError,
    Interrupted,
    Link,
    Reply,
)

__all__ = [
    "CERTIFICATE_EXPIRED",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "CertificateExpired",
    "ControlCallStopped",
    "ControlClient",
    "ControlPlaneError",
    "ControlPlaneRejected",
    "ControlPlaneUnavailable",
    "DesiredStateFetch",
    "FetchStatus",
]

DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
# The refusal reason of an expired client certificate (docs/PROTOCOL.md, "Errors").
CERTIFICATE_EXPIRED = "certificate-expired"
# What OpenSSL calls the TLS alert a server sends for an expired client certificate.
_EXPIRED_ALERT = "ALERT_CERTIFICATE_EXPIRED"

Model = TypeVar("Model", bound=BaseModel)
_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")


class ControlPlaneError(MeridianError):
    """Base of both families."""


class ControlPlaneUnavailable(ControlPlaneError):
    """The request did not complete: back off and retry.

    ``url`` and ``next_url`` are set when the client has several replicas and moved on: the base URL that failed
    and the one the next call goes to.
    """

    url: str | None = None
    next_url: str | None = None


class ControlCallStopped(ControlPlaneError):
    """The agent is stopping: the call was not made, or its answer was not waited for."""


# What an operator does about each refusal the control plane answers a node with: retrying will not help until they act.
_REFUSAL_HINTS = {
    "certificate-revoked": "this node's certificate was revoked: enroll again with a new token",
    "certificate-expired": "the node's certificate expired before it was renewed: enroll again with a new token",
    "wrong-node": "the certificate names another node than config node_id: fix node_id or re-enroll",
    "certificate-untrusted": "the certificate is not the control plane's (another CA): re-enroll",
    "certificate-unknown": "the control plane never issued this certificate: re-enroll",
    "unknown-node": "the control plane does not know this node: check node_id and control_plane.url",
}


class ControlPlaneRejected(ControlPlaneError):
    """The control plane refused the request (4xx) and said why; ``hint`` says what an operator does about it."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail

    @property
    def hint(self) -> str:
        return _REFUSAL_HINTS.get(self.reason, "see docs/PROTOCOL.md for the reason")


class CertificateExpired(ControlPlaneRejected):
    """The node's client certificate has expired: no call can succeed until the node is enrolled again.

    ``status`` is 403 and ``reason`` ``certificate-expired``, what the control plane answers such a
    certificate when it gets to answer at all; ``not_after`` is the certificate's end. Raised by the
    client itself when the TLS layer refused the certificate or when it knows the certificate has ended
    (see the module docstring): the detail says which.
    """

    def __init__(self, detail: str, not_after: datetime | None) -> None:
        super().__init__(403, CERTIFICATE_EXPIRED, detail)
        self.not_after = not_after


class FetchStatus(StrEnum):
    NEW = "new"
    NOT_MODIFIED = "not-modified"
    NONE_PUBLISHED = "none-published"


@dataclass(frozen=True)
class DesiredStateFetch:
    """A conditional fetch's outcome. ``envelope`` is set only for ``NEW``."""

    status: FetchStatus
    envelope: bytes | None = None
    etag: str | None = None
    generation: int | None = None


@dataclass(frozen=True)
class _ControlAnswer:
    status: int
    headers: Mapping[str, str]  # names lowercased
    body: bytes


@dataclass(frozen=True)
class _Replica:
    """One base URL of the control plane, taken apart for the connection and the request line."""

    base_url: str  # without a trailing slash
    host: str
    port: int
    host_header: str
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> _Replica:
        if not base_url.startswith("https://"):
            raise ValueError(f"control plane URL {base_url!r} must start with https:// (mutual TLS is required)")
        url = urlsplit(base_url.rstrip("/"))
        if not url.hostname:
            raise ValueError(f"control plane URL {base_url!r} names no host")
        return cls(
            base_url=base_url.rstrip("/"),
            host=url.hostname,
            port=url.port or 443,
            host_header=url.netloc.rpartition("@")[2],
            prefix=url.path.rstrip("/"),
        )


def _moves_on_when_unavailable(
    call: Callable[Concatenate[ControlClient, _Args], _Result],
) -> Callable[Concatenate[ControlClient, _Args], _Result]:
    """A protocol call after which, if it failed with ``ControlPlaneUnavailable``, the next call goes to the next
    replica (module docstring, "Replicas"). Around each whole call, so that an answer that is not what the protocol
    promises (a malformed lease, another node's) moves it as an unreachable replica does."""

    @functools.wraps(call)
    def moving(client: ControlClient, /, *args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
        try:
            return call(client, *args, **kwargs)
        except ControlPlaneUnavailable as exc:
            client._move_on(exc)
            raise

    return moving


class ControlClient:
    """A client for one control plane, reached at ``base_url`` or, after a failure there, at one of
    ``replica_urls`` (module docstring, "Replicas").

    ``cert``/``key`` are the node's client certificate and key; without them only ``enroll`` works.
    ``timeout_s`` bounds connecting and each read; a long-poll adds its ``wait_s`` to the read bound.
    ``clock`` is what "now" is when the certificate's end is compared with it (this host's UTC clock).
    ``interrupt`` is a descriptor that turns readable when the agent stops (``agent_side.stop.StopSignal``): from
    then on each call raises ``ControlCallStopped`` instead of connecting, sending or waiting.
    """

    def __init__(
        self,
        base_url: str,
        ca_bundle: Path | str,
        cert: Path | str | None = None,
        key: Path | str | None = None,
        timeout_s: float = 10.0,
        *,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        clock: Callable[[], datetime] | None = None,
        interrupt: int | None = None,
        replica_urls: Sequence[str] = (),
    ) -> None:
        if isinstance(replica_urls, str):
            raise TypeError("replica_urls is a list of URLs, not one URL")
        replicas = [_Replica.parse(url) for url in (base_url, *replica_urls)]
        seen: set[str] = set()
        for replica in replicas:
            if replica.base_url in seen:
                raise ValueError(f"control plane URL {replica.base_url!r} is given twice: list each replica once")
            seen.add(replica.base_url)
        if (cert is None) != (key is None):
            raise ValueError("give both the client certificate and its key, or neither (enrollment only)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self._replicas = tuple(replicas)
        self._current = 0  # index into _replicas: where the next call goes
        # Only these files are trusted: nothing from the environment (REQUESTS_CA_BUNDLE and the like).
        self._files = tuple(Path(f) for f in (ca_bundle, cert, key) if f is not None)
        self._has_cert = cert is not None
        self._clock = clock or (lambda: datetime.now(UTC))
        self._context: ssl.SSLContext | None = None
        self._signature: tuple[tuple[int, int, int], ...] | None = None
        # The client certificate's serial and end, read with the files the context was built from.
        self._certificate: tuple[int, datetime] | None = None
        self._link: Link | None = None
        self._interrupt = interrupt

    @property
    def base_url(self) -> str:
        """The base URL the next call goes to (without a trailing slash)."""
        return self._replicas[self._current].base_url

    @property
    def base_urls(self) -> tuple[str, ...]:
        """Every base URL this client may call, the primary first: the order it moves through them."""
        return tuple(replica.base_url for replica in self._replicas)

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Protocol calls

    @_moves_on_when_unavailable
    def enroll(self, node_id: str, token: str, csr_pem: str) -> EnrollmentResponse:
        request = EnrollmentRequest(node_id=node_id, token=token, csr_pem=csr_pem)
        # Not sent twice: the token is single-use, so a repeat after a lost answer could only be refused.
        answer = self._call("POST", "/v1/enroll", body=request, repeatable=False)
        return self._parse(answer, EnrollmentResponse, "enrollment response")

    @_moves_on_when_unavailable
    def renew_certificate(self, node_id: str, csr_pem: str) -> EnrollmentResponse:
        """A new certificate for the CSR's key, authenticated with the current one (which stays valid)."""
        request = CertificateRenewalRequest(node_id=node_id, csr_pem=csr_pem)
        # Not sent twice: each renewal issues a certificate, and the one a lost answer carried is never used.
        answer = self._call("POST", f"/v1/nodes/{_segment(node_id)}/certificate", body=request, repeatable=False)
        response = self._parse(answer, EnrollmentResponse, "certificate renewal response")
        if response.node_id != node_id:
            raise ControlPlaneUnavailable(f"the control plane renewed the certificate of node {response.node_id!r}")
        return response

    def reload_identity(self) -> None:
        """Drop the TLS context and the kept-alive connection: the next call loads the files as they are now.

        A renewal calls this after switching the key and certificate. The file check before each call
        would notice the switch as well (new inodes); this makes the switch explicit at the point it happens.
        """
        self.close()
        self._context = None
        self._signature = None

    @_moves_on_when_unavailable
    def heartbeat(self, node_id: str) -> Lease:
        answer = self._call("POST", f"/v1/nodes/{_segment(node_id)}/heartbeat")
        lease = self._parse(answer, Lease, "lease")
        if lease.node_id != node_id:
            raise ControlPlaneUnavailable(f"the control plane answered with the lease of node {lease.node_id!r}")
        return lease

    @_moves_on_when_unavailable
    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait_s: float = 0) -> DesiredStateFetch:
        """The node's desired state unless it is still ``etag``; with ``wait_s`` > 0, a long-poll of that length."""
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0 seconds, got {wait_s}")
        headers = {"If-None-Match": etag} if etag else {}
        params = {"wait": f"{wait_s:g}"} if wait_s else {}  # the protocol's query parameter
        answer = self._call(
            "GET",
            f"/v1/nodes/{_segment(node_id)}/desired-state",
            headers=headers,
            params=params,
            read_timeout_s=self.timeout_s + wait_s,
            expect=(200, 204, 304),
        )
        if answer.status == 204:
            return DesiredStateFetch(FetchStatus.NONE_PUBLISHED)
        new_etag = answer.headers.get("etag")
        generation = _int_or_none(answer.headers.get("x-meridian-generation"))
        if answer.status == 304:
            return DesiredStateFetch(FetchStatus.NOT_MODIFIED, etag=new_etag or etag, generation=generation)
        if not answer.body:
            raise ControlPlaneUnavailable("the control plane sent an empty desired state")
        return DesiredStateFetch(FetchStatus.NEW, envelope=answer.body, etag=new_etag, generation=generation)

    @_moves_on_when_unavailable
    def post_observation(self, observation: Observation) -> None:
        self._call(
            "POST", f"/v1/nodes/{_segment(observation.node_id)}/observations", body=observation, expect=(204, 200)
        )

    @_moves_on_when_unavailable
    def serving(self) -> ServingProjection:
        return self._parse(self._call("GET", "/v1/serving"), ServingProjection, "serving projection")

    # Transport

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        read_timeout_s: float | None = None,
        expect: tuple[int, ...] = (200,),
        repeatable: bool = True,
    ) -> _ControlAnswer:
        url = self.base_url + path
        target = self._replicas[self._current].prefix + path + (f"?{urlencode(params)}" if params else "")
        send_headers = {"Accept": "application/json", "User-Agent": "meridian-node-agent", **(headers or {})}
        data: bytes | None = None
        if body is not None:
            data = body.model_dump_json().encode("utf-8")
            send_headers["Content-Type"] = "application/json"
        try:
            received = self._exchange(method, target, send_headers, data, read_timeout_s or self.timeout_s, repeatable)
        except ControlPlaneError:
            self.close()
            raise
        except Interrupted as exc:
            self.close()
            raise ControlCallStopped(f"{method} {url}: {exc}") from exc
        except ssl.SSLError as exc:
            self.close()
            self._raise_if_expired(exc)
            raise ControlPlaneUnavailable(
                f"TLS with {self.base_url} failed ({_first_line(exc)}); check the CA bundle and the client "
                "certificate (a revoked or foreign certificate is refused at the handshake or with a 403)"
            ) from exc
        except TimeoutError as exc:
            self.close()
            raise ControlPlaneUnavailable(f"{method} {url}: no answer in time ({_first_line(exc)})") from exc
        except AnswerTooLarge as exc:
            # The rest of the body is still on its way: the socket cannot carry another request.
            self.close()
            raise ControlPlaneUnavailable(
                f"{method} {url}: response exceeds the {self.max_response_bytes}-byte limit"
                + (f" (it announced {exc.size} bytes)" if exc.size is not None else "")
                + "; nothing more of it was read"
            ) from exc
        except HttpExchangeError as exc:
            # An answer cut short or garbled leaves the socket in an unknown place: drop it.
            self.close()
            self._raise_if_expired(exc)
            raise ControlPlaneUnavailable(f"{method} {url}: {_first_line(exc)}") from exc
        except OSError as exc:
            self.close()
            self._raise_if_expired(exc)
            raise ControlPlaneUnavailable(f"{method} {url}: {_first_line(exc)}") from exc
        answer = _ControlAnswer(received.status, received.headers, received.body)
        if answer.status in expect:
            return answer
        if 400 <= answer.status < 500:
            reason, detail = _error_body(answer)
            if reason == CERTIFICATE_EXPIRED:
                self.close()
                raise CertificateExpired(detail, self._certificate[1] if self._certificate else None)
            raise ControlPlaneRejected(answer.status, reason, detail)
        raise ControlPlaneUnavailable(f"{method} {url}: unexpected HTTP {answer.status} ({_snippet(answer.body)})")

    def _exchange(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes | None,
        read_timeout_s: float,
        repeatable: bool = True,
    ) -> Reply:
        """One request and its answer on the kept-alive connection, sent once more on a new connection if
        the server closed the old one before answering (its idle timeout raced the request) and the request
        is ``repeatable``."""
        host = self._replicas[self._current].host_header
        link = self._open(read_timeout_s)
        try:
            reply = link.exchange(
                method, target, host=host, headers=headers, body=body, max_body=self.max_response_bytes
            )
        except (ClosedBeforeAnswer, ConnectionResetError, BrokenPipeError):
            if not repeatable or not link.exchanges or link.answer_started:
                raise
            # Not a byte of answer on a connection that had carried requests: the server ended it as idle
            # (uvicorn after 5 s) as this request left, before reading it. A heartbeat, a fetch or an
            # observation sent twice does no harm, so it goes once more on a fresh connection; a failure
            # there is the control plane's answer.
            self.close()
            link = self._open(read_timeout_s)
            reply = link.exchange(
                method, target, host=host, headers=headers, body=body, max_body=self.max_response_bytes
            )
        if not link.reusable:
            # A server that said "close", an answer delimited by closing, or bytes no request asked for.
            self.close()
        return reply

    def _open(self, read_timeout_s: float) -> Link:
        """The kept-alive connection, (re)opened when needed, with ``read_timeout_s`` for this call's reads.

        Refuses (``CertificateExpired``) before touching the network when the client certificate has ended.
        """
        if self._interrupt is not None and select.select([self._interrupt], [], [], 0)[0]:
            raise ControlCallStopped("the agent is stopping: no new call to the control plane")
        context = self._ssl_context()
        if self._certificate is not None and self._clock() > self._certificate[1]:
            raise self._expired("the control plane refuses it, so nothing was sent")
        if self._link is not None and _closed_by_peer(self._link.sock):
            # The server ends idle keep-alive connections (uvicorn after 5 s): open a fresh one rather
            # than send into a socket that is already gone.
            self.close()
        if self._link is None:
            replica = self._replicas[self._current]
            raw = socket.create_connection((replica.host, replica.port), timeout=self.timeout_s)
            try:
                self._link = Link(context.wrap_socket(raw, server_hostname=replica.host), interrupt=self._interrupt)
            except BaseException:
                raw.close()
                raise
        self._link.sock.settimeout(read_timeout_s)
        return self._link

    def _move_on(self, failure: ControlPlaneUnavailable) -> None:
        """After ``failure``: drop the connection and, with several replicas, send the next call to the next one."""
        self.close()
        if len(self._replicas) == 1:
            return
        failure.url = self.base_url
        self._current = (self._current + 1) % len(self._replicas)
        failure.next_url = self.base_url

    def _ssl_context(self) -> ssl.SSLContext:
        """The TLS context for the files as they are on disk now; rebuilt (new connection) when any changed."""
        try:
            signature = tuple(_file_signature(path) for path in self._files)
        except OSError as exc:
            raise ControlPlaneUnavailable(
                f"cannot read the TLS files for {self.base_url} ({exc}); check the CA bundle path, and re-enroll "
                "if the node's certificate or key is gone"
            ) from exc
        if self._context is not None and signature == self._signature:
            return self._context
        try:
            context = ssl.create_default_context(cafile=str(self._files[0]))
            certificate = None
            if self._has_cert:
                context.load_cert_chain(str(self._files[1]), str(self._files[2]))
                leaf = x509.load_pem_x509_certificate(self._files[1].read_bytes())
                certificate = (leaf.serial_number, leaf.not_valid_after_utc)
        except (OSError, ValueError) as exc:
            raise ControlPlaneUnavailable(
                f"cannot load the TLS files {', '.join(map(str, self._files))} ({_first_line(exc)}); the CA "
                "bundle must be PEM certificates and the key must match the certificate (re-enroll if not)"
            ) from exc
        self.close()
        self._context, self._signature, self._certificate = context, signature, certificate
        return context

    def _raise_if_expired(self, failure: BaseException) -> None:
        """After a transfer failure: ``CertificateExpired`` when the client certificate explains it."""
        if self._certificate is None:
            return
        if self._clock() > self._certificate[1]:
            raise self._expired(f"the control plane refused it ({_first_line(failure)})") from failure
        if isinstance(failure, ssl.SSLError) and _EXPIRED_ALERT in f"{failure.reason} {failure}".upper():
            raise CertificateExpired(
                f"the control plane refused the client certificate {self._files[1]} (serial "
                f"{self._certificate[0]:x}) as expired at the TLS handshake, but by this host's clock "
                f"({format_rfc3339(self._clock())}) it is valid until {format_rfc3339(self._certificate[1])}: "
                "one of the two clocks is wrong; fix it, or enroll the node again with a new token",
                self._certificate[1],
            ) from failure

    def _expired(self, what: str) -> CertificateExpired:
        assert self._certificate is not None
        serial, not_after = self._certificate
        self.close()
        return CertificateExpired(
            f"the node's client certificate {self._files[1]} (serial {serial:x}) expired at "
            f"{format_rfc3339(not_after)} (this host's clock says {format_rfc3339(self._clock())}); {what}. "
            "It can no longer be renewed either: enroll the node again with a new token "
            "('meridian-node enroll --token ...'); a running agent picks up the new certificate by itself",
            not_after,
        )

    def _parse(self, answer: _ControlAnswer, model: type[Model], what: str) -> Model:
        try:
            # One reading of what the peer sent: a key named twice is refused, not resolved last-wins.
            return parse_document(model, answer.body)
        except JsonError as exc:
            raise ControlPlaneUnavailable(f"the control plane sent a malformed {what}: {exc}") from exc
        except ValidationError as exc:
            raise ControlPlaneUnavailable(
                f"the control plane sent a malformed {what}: {describe_validation_error(exc)}"
            ) from exc


def _file_signature(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return (info.st_ino, info.st_size, info.st_mtime_ns)


def _closed_by_peer(sock: Any) -> bool:
    """True when an idle connection is readable: the server closed it (or sent what no request asked for)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _segment(node_id: str) -> str:
    return quote(node_id, safe="")


def _error_body(answer: _ControlAnswer) -> tuple[str, str]:
    try:
        document: Any = json.loads(answer.body)
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("reason"), str):
        return document["reason"], str(document.get("detail", ""))
    return f"http-{answer.status}", _snippet(answer.body)


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body[:limit].decode("utf-8", errors="replace").strip()
    return text or "empty body"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None

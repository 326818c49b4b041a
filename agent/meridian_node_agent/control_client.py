"""The agent's side of protocol v1 (docs/PROTOCOL.md): one ``requests`` session, mutual TLS, bounded reads.

Two error families, so the caller can tell "try again later" from "the control plane said no":

- ``ControlPlaneUnavailable``: the transfer failed. Connection refused or reset, TLS handshake failure,
  timeout, a 5xx, a response over the size cap or one that is not what the protocol promises. The agent
  backs off and retries; engines keep serving.
- ``ControlPlaneRejected``: the control plane answered with a 4xx and a reason (``status``, ``reason``,
  ``detail`` from its ``{"reason", "detail"}`` body). Retrying the same request will not help.

The desired-state envelope is returned as the exact bytes received: verifying it is the trust core's
job, and it must see what the server sent, not a re-serialisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import requests
from pydantic import BaseModel

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    EnrollmentRequest,
    EnrollmentResponse,
    Lease,
    Observation,
    ServingProjection,
    ValidationError,
    describe_validation_error,
)

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "ControlClient",
    "ControlPlaneError",
    "ControlPlaneRejected",
    "ControlPlaneUnavailable",
    "DesiredStateFetch",
    "FetchStatus",
]

DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024

Model = TypeVar("Model", bound=BaseModel)


class ControlPlaneError(Exception):
    """Base of both families."""


class ControlPlaneUnavailable(ControlPlaneError):
    """The request did not complete: back off and retry."""


class ControlPlaneRejected(ControlPlaneError):
    """The control plane refused the request (4xx) and said why."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail


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
class _Answer:
    status: int
    headers: requests.structures.CaseInsensitiveDict[str]
    body: bytes


class ControlClient:
    """A client for one control plane.

    ``cert``/``key`` are the node's client certificate and key; without them only ``enroll`` works.
    ``timeout`` bounds connecting and each read; a long-poll adds its ``wait`` to the read bound.
    """

    def __init__(
        self,
        base_url: str,
        ca_bundle: Path | str,
        cert: Path | str | None = None,
        key: Path | str | None = None,
        timeout: float = 10.0,
        *,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if not base_url.startswith("https://"):
            raise ValueError(f"control plane URL {base_url!r} must start with https:// (mutual TLS is required)")
        if (cert is None) != (key is None):
            raise ValueError("give both the client certificate and its key, or neither (enrollment only)")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._verify = str(ca_bundle)
        self._cert = (str(cert), str(key)) if cert is not None and key is not None else None
        self._session = requests.Session()
        # The CA bundle is the trust anchor for the control plane and must not be swapped by the
        # environment: requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override a *session's* verify
        # setting, so the environment is ignored and verify/cert are passed on every request.
        self._session.trust_env = False
        self._session.headers["Accept"] = "application/json"

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Protocol calls

    def enroll(self, node_id: str, token: str, csr_pem: str) -> EnrollmentResponse:
        request = EnrollmentRequest(node_id=node_id, token=token, csr_pem=csr_pem)
        answer = self._call("POST", "/v1/enroll", body=request)
        return self._parse(answer, EnrollmentResponse, "enrollment response")

    def heartbeat(self, node_id: str) -> Lease:
        answer = self._call("POST", f"/v1/nodes/{_segment(node_id)}/heartbeat")
        lease = self._parse(answer, Lease, "lease")
        if lease.node_id != node_id:
            raise ControlPlaneUnavailable(f"the control plane answered with the lease of node {lease.node_id!r}")
        return lease

    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait: float = 0) -> DesiredStateFetch:
        """The node's desired state unless it is still ``etag``; with ``wait`` > 0, a long-poll of that length."""
        if wait < 0:
            raise ValueError(f"wait must be >= 0 seconds, got {wait}")
        headers = {"If-None-Match": etag} if etag else {}
        params = {"wait": f"{wait:g}"} if wait else {}
        answer = self._call(
            "GET",
            f"/v1/nodes/{_segment(node_id)}/desired-state",
            headers=headers,
            params=params,
            read_timeout=self.timeout + wait,
            expect=(200, 204, 304),
        )
        if answer.status == 204:
            return DesiredStateFetch(FetchStatus.NONE_PUBLISHED)
        new_etag = answer.headers.get("ETag")
        generation = _int_or_none(answer.headers.get("X-Meridian-Generation"))
        if answer.status == 304:
            return DesiredStateFetch(FetchStatus.NOT_MODIFIED, etag=new_etag or etag, generation=generation)
        if not answer.body:
            raise ControlPlaneUnavailable("the control plane sent an empty desired state")
        return DesiredStateFetch(FetchStatus.NEW, envelope=answer.body, etag=new_etag, generation=generation)

    def post_observation(self, observation: Observation) -> None:
        self._call(
            "POST", f"/v1/nodes/{_segment(observation.node_id)}/observations", body=observation, expect=(204, 200)
        )

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
        read_timeout: float | None = None,
        expect: tuple[int, ...] = (200,),
    ) -> _Answer:
        url = self.base_url + path
        send_headers = dict(headers or {})
        data: bytes | None = None
        if body is not None:
            data = body.model_dump_json().encode("utf-8")
            send_headers["Content-Type"] = "application/json"
        try:
            response = self._session.request(
                method,
                url,
                data=data,
                headers=send_headers,
                params=params,
                timeout=(self.timeout, read_timeout or self.timeout),
                stream=True,
                allow_redirects=False,
                verify=self._verify,
                cert=self._cert,
            )
            try:
                content = self._read_capped(response, url)
            finally:
                response.close()
        except requests.exceptions.SSLError as exc:
            raise ControlPlaneUnavailable(
                f"TLS with {self.base_url} failed ({_first_line(exc)}); check the CA bundle and the client "
                "certificate (a revoked or foreign certificate is refused at the handshake or with a 403)"
            ) from exc
        except requests.exceptions.Timeout as exc:
            raise ControlPlaneUnavailable(f"{method} {url}: no answer in time ({_first_line(exc)})") from exc
        except requests.exceptions.RequestException as exc:
            raise ControlPlaneUnavailable(f"{method} {url}: {_first_line(exc)}") from exc
        answer = _Answer(response.status_code, response.headers, content)
        if answer.status in expect:
            return answer
        if 400 <= answer.status < 500:
            reason, detail = _error_body(answer)
            raise ControlPlaneRejected(answer.status, reason, detail)
        raise ControlPlaneUnavailable(f"{method} {url}: unexpected HTTP {answer.status} ({_snippet(answer.body)})")

    def _read_capped(self, response: requests.Response, url: str) -> bytes:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_response_bytes:
            raise ControlPlaneUnavailable(
                f"{url}: response of {declared} bytes exceeds the {self.max_response_bytes}-byte limit"
            )
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_content(_CHUNK):
            size += len(chunk)
            if size > self.max_response_bytes:
                raise ControlPlaneUnavailable(f"{url}: response exceeds the {self.max_response_bytes}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, answer: _Answer, model: type[Model], what: str) -> Model:
        try:
            return model.model_validate_json(answer.body)
        except ValidationError as exc:
            raise ControlPlaneUnavailable(
                f"the control plane sent a malformed {what}: {describe_validation_error(exc)}"
            ) from exc


def _segment(node_id: str) -> str:
    return quote(node_id, safe="")


def _error_body(answer: _Answer) -> tuple[str, str]:
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

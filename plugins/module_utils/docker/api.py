"""The Docker Engine HTTP API, spoken with the standard library: the transport under ``docker.engine``.

Why not the Docker SDK: an Ansible module pays its imports on every task, and ``docker`` (with
``requests`` and ``urllib3`` under it) costs about 180 ms to import, more than the whole no-op converge of
an engine. The calls meridian.node makes are few and plain JSON over HTTP/1.1, so they are made here
directly, and a host needs no Python package to run the engine modules.

Where the engine is, as the ``docker`` CLI reads it: ``DOCKER_HOST`` (``unix:///path`` or
``tcp://host:port``), default ``unix:///var/run/docker.sock``; over TCP, ``DOCKER_TLS_VERIFY`` set to a
non-empty value other than ``0`` means TLS with the engine verified against ``$DOCKER_CERT_PATH/ca.pem``
and ``cert.pem``/``key.pem`` as the client certificate (``DOCKER_CERT_PATH`` defaults to ``~/.docker``).
``ssh://`` is not supported: say so rather than guess.

The API version is the engine's own (``/_ping`` reports it), capped at the newest this file was written
against, so responses have the shape the code expects on old and new engines alike.

Every failure is a ``DockerApiError``: ``status`` is the HTTP status when the engine answered (404: no such
object), None when it could not be reached; the message is the engine's own explanation.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker._http import (
    HttpLiteError,
    StreamedAnswer,
    exchange,
    exchange_streamed,
)

if TYPE_CHECKING:
    import ssl

__all__ = ["DEFAULT_HOST", "MAX_API_VERSION", "DockerApi", "DockerApiError", "PullStream", "demultiplex"]

DEFAULT_HOST = "unix:///var/run/docker.sock"
# Newest API version whose responses this module was checked against (Docker Engine 27); older engines
# are spoken to in their own version. 1.41 (Engine 20.10) is the oldest tested.
MAX_API_VERSION = (1, 47)
_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# A pull refused at once answers with a short JSON error: more than this is not an error document.
_MAX_ERROR_BYTES = 64 * 1024
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class DockerApiError(MeridianError):
    """A Docker Engine API call failed; ``status`` is None when the engine could not be reached."""

    def __init__(self, reason: str, *, action: str = "", status: int | None = None) -> None:
        super().__init__(f"Error {action}: {reason}" if action else reason)
        self.reason = reason
        self.status = status

    @property
    def not_found(self) -> bool:
        return self.status == 404


class PullStream:
    """An image pull under way: the engine's progress messages (JSON lines) as they arrive. ``close`` abandons
    the pull: the engine cancels a pull whose client went away, so closing is how a stalled pull is stopped."""

    def __init__(self, sock: socket.socket, answer: StreamedAnswer, action: str, host: str) -> None:
        self._sock = sock
        self._answer = answer
        self._action = action
        self._host = host

    def read(self, timeout_s: float) -> bytes | None:
        """Progress bytes that arrived within ``timeout_s``; ``b""`` when the pull's answer ended; None when
        nothing arrived in time (read again)."""
        try:
            return self._answer.read(timeout_s)
        except (OSError, HttpLiteError) as exc:
            raise DockerApiError(_transport_text(exc, self._host), action=self._action) from exc

    def close(self) -> None:
        self._sock.close()


@dataclass(frozen=True)
class _DockerAnswer:
    status: int
    headers: dict[str, str]  # names lowercased
    body: bytes


class DockerApi:
    """One Docker Engine endpoint; every method is one API call returning the engine's JSON."""

    def __init__(self, host: str = DEFAULT_HOST, *, timeout_s: float = 60, tls: ssl.SSLContext | None = None) -> None:
        scheme, rest = host.split("://", 1) if "://" in host else (host, "")
        if scheme == "unix" and rest.startswith("/"):
            self._target = rest
        elif scheme == "tcp" and rest:
            parsed = urllib.parse.urlsplit(f"//{rest}")
            if not parsed.hostname or parsed.port is None:
                raise DockerApiError(f"DOCKER_HOST {host!r}: a tcp:// address needs a host and a port")
            self._target = f"{parsed.hostname}:{parsed.port}"
        else:
            raise DockerApiError(
                f"DOCKER_HOST {host!r} is not supported: use unix:///path/to/docker.sock or tcp://host:port "
                "(with DOCKER_TLS_VERIFY=1 for TLS); ssh:// is not supported"
            )
        self.host = host
        self.timeout_s = timeout_s
        self._scheme = scheme
        self._tls = tls
        self._prefix = ""

    @classmethod
    def from_env(cls, timeout_s: float = 60, environ: Mapping[str, str] | None = None) -> DockerApi:
        """The engine the ``docker`` CLI would talk to, with the API version negotiated by one ping."""
        env = os.environ if environ is None else environ
        host = env.get("DOCKER_HOST") or DEFAULT_HOST
        tls = None
        if host.startswith("tcp://") and env.get("DOCKER_TLS_VERIFY", "") not in ("", "0"):
            cert_path = env.get("DOCKER_CERT_PATH") or os.path.expanduser("~/.docker")
            import ssl  # here: only TLS over TCP needs it, and a module would pay its import on every task

            try:
                tls = _tls_context(cert_path)
            except (OSError, ssl.SSLError) as exc:
                raise DockerApiError(
                    f"DOCKER_TLS_VERIFY is set but the TLS files in {cert_path} (ca.pem, cert.pem, key.pem) "
                    f"cannot be used: {exc}"
                ) from exc
        api = cls(host, timeout_s=timeout_s, tls=tls)
        api.negotiate()
        return api

    def negotiate(self) -> str:
        """Ping the engine and use its API version (capped at ``MAX_API_VERSION``); returns the version."""
        answer = self._request("GET", "/_ping", "pinging the Docker Engine", versioned=False)
        version = _parse_version(answer.headers.get("api-version", ""))
        if version is None:
            raise DockerApiError(f"the Docker Engine at {self.host} did not report an API version in its ping")
        chosen = min(version, MAX_API_VERSION)
        self._prefix = f"/v{chosen[0]}.{chosen[1]}"
        return f"{chosen[0]}.{chosen[1]}"

    # --- reading --------------------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return _object(self._json("GET", "/info", "reading docker info"))

    def containers(self, filters: Mapping[str, str | Sequence[str]]) -> list[dict[str, Any]]:
        """Every container, running or not, that matches all ``filters`` (the engine's filter names)."""
        query = {"all": "1", "filters": _filters(filters)}
        return _objects(self._json("GET", "/containers/json", "listing containers", query=query))

    def images(self, filters: Mapping[str, str | Sequence[str]]) -> list[dict[str, Any]]:
        query = {"all": "1", "filters": _filters(filters)}
        return _objects(self._json("GET", "/images/json", "listing images", query=query))

    def inspect_image(self, reference: str) -> dict[str, Any]:
        return _object(self._json("GET", f"/images/{_quote(reference)}/json", f"inspecting image {reference!r}"))

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        path = f"/containers/{_quote(container_id)}/json"
        return _object(self._json("GET", path, f"inspecting container {container_id[:12]}"))

    def logs(self, container_id: str, tail: int) -> bytes:
        """stdout and stderr interleaved as written, the last ``tail`` lines of each."""
        tty = bool((self.inspect_container(container_id).get("Config") or {}).get("Tty"))
        query = {"stdout": "1", "stderr": "1", "tail": str(tail), "timestamps": "0"}
        body = self._request(
            "GET", f"/containers/{_quote(container_id)}/logs", f"reading logs of {container_id[:12]}", query=query
        ).body
        return body if tty else demultiplex(body)

    def distribution(self, reference: str, registry_auth: str | None = None) -> dict[str, Any]:
        """What the registry says of ``reference`` (``GET /distribution/NAME/json``: the manifest's descriptor
        and platforms), asked by the engine with its own network and the given ``X-Registry-Auth``."""
        headers = {"X-Registry-Auth": registry_auth} if registry_auth else {}
        path = f"/distribution/{_quote(reference)}/json"
        return _object(self._json("GET", path, f"asking the registry about {reference!r}", headers=headers))

    # --- changing -------------------------------------------------------------------------------------------

    def open_pull(
        self, repository: str, digest: str, registry_auth: str | None = None, *, wait_s: float | None = None
    ) -> PullStream:
        """Start pulling ``repository@digest``: only ever a digest, never a tag (``ValueError`` otherwise).

        ``registry_auth`` is the ``X-Registry-Auth`` header's value (base64url JSON credentials), sent to the
        engine only. The engine answers at once and then streams progress; an error before the stream (such
        as a malformed name) raises ``DockerApiError`` here. The engine sends its first byte only once the
        registry gave it the manifest: ``wait_s`` bounds that wait (the client timeout by default).
        """
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"open_pull pulls by digest only (sha256:<64 hex>), got {digest!r}")
        action = f"pulling image {repository}@{digest}"
        url = f"{self._prefix}/images/create?" + urllib.parse.urlencode({"fromImage": repository, "tag": digest})
        headers = {"X-Registry-Auth": registry_auth} if registry_auth else {}
        try:
            sock = self._connect(self.timeout_s if wait_s is None else wait_s)
        except OSError as exc:
            raise DockerApiError(_transport_text(exc, self.host), action=action) from exc
        try:
            answer = exchange_streamed(sock, "POST", url, host="docker", headers=headers)
            if answer.status >= 400:
                data = bytearray()
                while len(data) < _MAX_ERROR_BYTES:
                    part = answer.read(self.timeout_s)
                    if not part:
                        break
                    data += part
                raise DockerApiError(_engine_message(answer.status, bytes(data)), action=action, status=answer.status)
        except (OSError, HttpLiteError) as exc:
            sock.close()
            raise DockerApiError(_transport_text(exc, self.host), action=action) from exc
        except DockerApiError:
            sock.close()
            raise
        return PullStream(sock, answer, action, self.host)

    def create_container(self, name: str, config: Mapping[str, Any]) -> dict[str, Any]:
        return _object(
            self._json("POST", "/containers/create", f"creating container {name!r}", query={"name": name}, body=config)
        )

    def start(self, container_id: str) -> None:
        self._request("POST", f"/containers/{_quote(container_id)}/start", f"starting {container_id[:12]}")

    def stop(self, container_id: str, timeout_s: int) -> None:
        # The engine answers only after the grace period and the kill: wait that long plus our own timeout.
        self._request(
            "POST",
            f"/containers/{_quote(container_id)}/stop",
            f"stopping {container_id[:12]}",
            query={"t": str(timeout_s)},
            timeout_s=self.timeout_s + timeout_s,
        )

    def remove(self, container_id: str, *, force: bool = False) -> None:
        query = {"force": "1" if force else "0", "v": "0"}
        self._request("DELETE", f"/containers/{_quote(container_id)}", f"removing {container_id[:12]}", query=query)

    def remove_image(self, image_id: str) -> None:
        """Remove one image by its id, never forced: Docker itself refuses (409) while a container uses it or
        while it is tagged in more than one repository, a second guard behind ``engines.image_prune``."""
        query = {"force": "0", "noprune": "0"}
        self._request("DELETE", f"/images/{_quote(image_id)}", f"removing image {image_id[:19]}", query=query)

    def rename(self, container_id: str, name: str) -> None:
        self._request(
            "POST", f"/containers/{_quote(container_id)}/rename", f"renaming {container_id[:12]}", query={"name": name}
        )

    def load(self, chunks: Iterable[bytes], size: int, what: str) -> list[str]:
        """``POST /images/load`` of a tar of ``size`` bytes sent as ``chunks`` come (never held whole in memory);
        returns the engine's ``Loaded image`` lines. The engine answers 200 and reports a failed load inside
        the body, so its ``error`` lines raise here."""
        action = f"loading {what} into the Docker Engine"
        url = f"{self._prefix}/images/load?quiet=1"
        headers = {"Content-Type": "application/x-tar", "Content-Length": str(size)}
        try:
            sock = self._connect(self.timeout_s)
            try:
                answer = exchange(
                    cast(socket.socket, _BodyAfterHeaders(sock, chunks)),
                    "POST",
                    url,
                    host="docker",
                    headers=headers,
                    max_body=_MAX_RESPONSE_BYTES,
                )
            finally:
                sock.close()
        except (OSError, HttpLiteError) as exc:
            raise DockerApiError(_transport_text(exc, self.host), action=action) from exc
        if answer.status >= 400:
            raise DockerApiError(_engine_message(answer.status, answer.body), action=action, status=answer.status)
        loaded = []
        for line in answer.body.decode("utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line) if line.strip() else {}
            except ValueError:
                event = {"stream": line}
            if not isinstance(event, dict):
                continue
            if event.get("error") or event.get("errorDetail"):
                detail = event.get("error") or (event.get("errorDetail") or {}).get("message")
                raise DockerApiError(str(detail), action=action)
            text = str(event.get("stream") or "").strip()
            if text:
                loaded.append(text)
        return loaded

    def save(self, reference: str, out: BinaryIO, max_bytes: int) -> int:
        """``GET /images/NAME/get`` (what ``docker save`` writes) streamed into ``out``; returns its size. An
        export larger than ``max_bytes`` raises rather than fill the disk."""
        import http.client  # here: it pulls in the email package, which no other call needs

        action = f"exporting image {reference!r}"
        target = f"{self._prefix}/images/{_quote(reference)}/get"
        total = 0
        try:
            sock = self._connect(self.timeout_s)
            try:
                sock.sendall(f"GET {target} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n".encode("latin-1"))
                # http.client reads the long streamed body piece by piece; exchange() would hold it whole.
                response = http.client.HTTPResponse(sock, method="GET")
                response.begin()
                if response.status >= 400:
                    body = response.read(_MAX_RESPONSE_BYTES)
                    raise DockerApiError(_engine_message(response.status, body), action=action, status=response.status)
                while True:
                    chunk = response.read(1024 * 1024)
                    if not chunk:
                        return total
                    total += len(chunk)
                    if total > max_bytes:
                        raise DockerApiError(f"the export is larger than {max_bytes} bytes", action=action)
                    out.write(chunk)
            finally:
                sock.close()
        except (OSError, http.client.HTTPException) as exc:
            raise DockerApiError(_transport_text(exc, self.host), action=action) from exc

    # --- transport ------------------------------------------------------------------------------------------

    def _json(self, method: str, path: str, action: str, **kwargs: Any) -> Any:
        body = self._request(method, path, action, **kwargs).body
        try:
            return json.loads(body) if body else None
        except ValueError as exc:
            raise DockerApiError(f"the engine's answer is not JSON ({exc})", action=action) from exc

    def _connect(self, timeout_s: float) -> socket.socket:
        if self._scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout_s)
                sock.connect(self._target)
            except OSError:
                sock.close()
                raise
            return sock
        address, _colon, port = self._target.rpartition(":")
        sock = socket.create_connection((address, int(port)), timeout=timeout_s)
        if self._tls is None:
            return sock
        try:
            return self._tls.wrap_socket(sock, server_hostname=address)
        except OSError:
            sock.close()
            raise

    def _request(
        self,
        method: str,
        path: str,
        action: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        timeout_s: float | None = None,
        versioned: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> _DockerAnswer:
        url = (self._prefix if versioned else "") + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        payload = None if body is None else json.dumps(body).encode("utf-8")
        headers = {**({"Content-Type": "application/json"} if payload is not None else {}), **(headers or {})}
        try:
            sock = self._connect(self.timeout_s if timeout_s is None else timeout_s)
            try:
                answer = exchange(
                    sock, method, url, host="docker", headers=headers, body=payload, max_body=_MAX_RESPONSE_BYTES
                )
            finally:
                sock.close()
        except (OSError, HttpLiteError) as exc:
            raise DockerApiError(_transport_text(exc, self.host), action=action) from exc
        status, data = answer.status, answer.body
        if status >= 400:
            raise DockerApiError(_engine_message(status, data), action=action, status=status)
        return _DockerAnswer(status, dict(answer.headers), data)


class _BodyAfterHeaders:
    """The socket ``exchange`` writes its request to, sending ``chunks`` as the body right after the headers:
    an image archive streams to the engine without being held in memory."""

    def __init__(self, sock: socket.socket, chunks: Iterable[bytes]) -> None:
        self._sock = sock
        self._chunks = chunks

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        for chunk in self._chunks:
            self._sock.sendall(chunk)

    def makefile(self, mode: str) -> Any:
        if mode != "rb":
            raise ValueError(f"only the answer is read from this socket (mode 'rb'), not {mode!r}")
        return self._sock.makefile("rb")


def demultiplex(stream: bytes) -> bytes:
    """The payload of Docker's multiplexed log stream (8-byte frame headers: stream, 0, 0, 0, size)."""
    out = bytearray()
    offset = 0
    while offset + 8 <= len(stream):
        (size,) = struct.unpack(">I", stream[offset + 4 : offset + 8])
        out += stream[offset + 8 : offset + 8 + size]
        offset += 8 + size
    return bytes(out)


def _tls_context(cert_path: str) -> ssl.SSLContext:
    import ssl

    context = ssl.create_default_context(cafile=os.path.join(cert_path, "ca.pem"))
    context.load_cert_chain(os.path.join(cert_path, "cert.pem"), os.path.join(cert_path, "key.pem"))
    return context


def _filters(filters: Mapping[str, str | Sequence[str]]) -> str:
    return json.dumps({key: [values] if isinstance(values, str) else list(values) for key, values in filters.items()})


def _parse_version(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.strip().partition(".")
    if not dot or not major.isdigit() or not minor.isdigit():
        return None
    return int(major), int(minor)


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="/:")


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DockerApiError(f"the Docker Engine answered {type(value).__name__} where an object was expected")
    return value


def _objects(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise DockerApiError("the Docker Engine answered something other than a list of objects")
    return value


def _engine_message(status: int, data: bytes) -> str:
    from http import HTTPStatus  # here: only an error's message needs it

    text = data.decode("utf-8", errors="replace").strip()
    try:
        message = json.loads(text).get("message")
    except (ValueError, AttributeError):
        message = None
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"{status}{' ' + phrase if phrase else ''}: {message or text or 'no explanation'}"


def _transport_text(exc: BaseException, host: str) -> str:
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        reason = f"no socket at {host} ({exc.strerror})"
    elif isinstance(exc, PermissionError):
        reason = f"permission denied on {host}; is this user in the 'docker' group?"
    elif isinstance(exc, TimeoutError):
        reason = f"no answer from {host} in time"
    return reason

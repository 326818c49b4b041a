"""The standard-library Docker Engine API client: addressing, version negotiation, errors, log frames.

Most of it runs against a real HTTP server on a Unix socket that answers as a Docker Engine would
(so the odd answers an engine can give are reproducible), and the rest against the real dockerd.
"""

from __future__ import annotations

import json
import socketserver
import struct
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.api import (
    MAX_API_VERSION,
    DockerApi,
    DockerApiError,
    demultiplex,
)


class _Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, api_version: str | None) -> None:
        super().__init__(path, _Handler)
        self.api_version = api_version
        self.paths: list[str] = []
        self.bodies: list[Any] = []


class _Handler(BaseHTTPRequestHandler):
    server: _Engine

    def address_string(self) -> str:  # a Unix socket has no host to log
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        if self.server.api_version is not None:
            self.send_header("Api-Version", self.server.api_version)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        path = self.path.split("?", 1)[0]
        if path == "/_ping":
            self._answer(200, b"OK", "text/plain")
        elif path.endswith("/info"):
            self._answer(200, b"not json", "text/plain")
        elif path.endswith("/containers/json"):
            self._answer(200, b"[]")
        elif path.endswith("/containers/abc/json"):
            self._answer(200, json.dumps({"Config": {"Tty": False}}).encode())
        elif path.endswith("/containers/abc/logs"):
            frames = b"".join(
                struct.pack(">BxxxI", stream, len(text)) + text for stream, text in ((1, b"out 1\n"), (2, b"err 2\n"))
            )
            self._answer(200, frames, "application/vnd.docker.raw-stream")
        elif "/images/" in path and not path.endswith("/images/json"):
            reference = urllib.parse.unquote(path.split("/images/", 1)[1].removesuffix("/json"))
            self._answer(404, json.dumps({"message": f"No such image: {reference}"}).encode())
        else:
            self._answer(500, json.dumps({"message": "engine trouble"}).encode())

    def do_POST(self) -> None:
        self.server.paths.append(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        self.server.bodies.append(json.loads(self.rfile.read(length)) if length else None)
        self._answer(201, json.dumps({"Id": "abc", "Warnings": []}).encode())


@pytest.fixture
def engine_socket(tmp_path: Path) -> Iterator[tuple[str, _Engine]]:
    path = str(tmp_path / "docker.sock")
    server = _Engine(path, api_version="1.43")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}", server
    finally:
        server.shutdown()
        server.server_close()


def test_version_is_the_engines_own_below_the_cap(engine_socket: tuple[str, _Engine]) -> None:
    host, server = engine_socket
    api = DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})
    api.containers({"label": ["a=b"], "name": "^/x$"})

    path, _, query = server.paths[-1].partition("?")
    assert path == "/v1.43/containers/json"
    assert json.loads(urllib.parse.parse_qs(query)["filters"][0]) == {"label": ["a=b"], "name": ["^/x$"]}


def test_version_of_a_newer_engine_is_capped_at_what_this_code_knows(engine_socket: tuple[str, _Engine]) -> None:
    host, server = engine_socket
    server.api_version = "1.99"

    assert DockerApi(host, timeout_s=5).negotiate() == "{}.{}".format(*MAX_API_VERSION)


def test_engine_that_reports_no_api_version_is_refused(engine_socket: tuple[str, _Engine]) -> None:
    host, server = engine_socket
    server.api_version = None

    with pytest.raises(DockerApiError, match="did not report an API version"):
        DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})


def test_missing_object_is_not_found_with_the_engines_message(engine_socket: tuple[str, _Engine]) -> None:
    host, _ = engine_socket
    api = DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})

    with pytest.raises(DockerApiError) as caught:
        api.inspect_image("repo/x@sha256:" + "a" * 64)

    assert caught.value.not_found
    assert "404 Not Found: No such image: repo/x@sha256:" in str(caught.value)
    assert str(caught.value).startswith("Error inspecting image 'repo/x@sha256:")


def test_engine_error_keeps_the_engines_explanation(engine_socket: tuple[str, _Engine]) -> None:
    host, _ = engine_socket
    api = DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})

    with pytest.raises(DockerApiError) as caught:
        api.images({})

    assert caught.value.status == 500 and not caught.value.not_found
    assert caught.value.reason == "500 Internal Server Error: engine trouble"


def test_answer_that_is_not_json_is_an_error_not_a_crash(engine_socket: tuple[str, _Engine]) -> None:
    host, _ = engine_socket
    api = DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})

    with pytest.raises(DockerApiError, match="Error reading docker info: the engine's answer is not JSON"):
        api.info()


def test_logs_of_a_container_without_tty_are_demultiplexed(engine_socket: tuple[str, _Engine]) -> None:
    host, _ = engine_socket
    api = DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})

    assert api.logs("abc", tail=10) == b"out 1\nerr 2\n"


def test_create_sends_the_settings_as_json_with_the_name_in_the_query(engine_socket: tuple[str, _Engine]) -> None:
    host, server = engine_socket
    api = DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})

    assert api.create_container("mn-x", {"Image": "sha256:1"})["Id"] == "abc"
    assert server.paths[-1] == "/v1.43/containers/create?name=mn-x"
    assert server.bodies[-1] == {"Image": "sha256:1"}


def test_demultiplex_ignores_a_truncated_last_frame() -> None:
    whole = struct.pack(">BxxxI", 1, 3) + b"abc"
    assert demultiplex(whole + struct.pack(">BxxxI", 2, 10)[:5]) == b"abc"


def test_no_socket_names_the_socket(tmp_path: Path) -> None:
    with pytest.raises(DockerApiError, match=r"Error pinging the Docker Engine: no socket at unix://.*/none\.sock"):
        DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("ssh://me@gpu-01", "ssh:// is not supported"),
        ("tcp://gpu-01", "a tcp:// address needs a host and a port"),
        ("unix://relative.sock", "is not supported"),
        ("npipe:////./pipe/docker_engine", "is not supported"),
    ],
)
def test_docker_host_that_cannot_be_used_is_refused_by_name(host: str, reason: str) -> None:
    with pytest.raises(DockerApiError, match=reason) as caught:
        DockerApi.from_env(timeout_s=5, environ={"DOCKER_HOST": host})
    assert host in str(caught.value)


def test_tls_without_its_files_names_the_directory(tmp_path: Path) -> None:
    environ = {"DOCKER_HOST": "tcp://127.0.0.1:2376", "DOCKER_TLS_VERIFY": "1", "DOCKER_CERT_PATH": str(tmp_path)}
    with pytest.raises(DockerApiError, match=f"TLS files in {tmp_path}"):
        DockerApi.from_env(timeout_s=5, environ=environ)


@pytest.mark.docker
def test_real_engine_answers_in_a_version_it_speaks(docker_client: Any) -> None:
    api = DockerApi.from_env(timeout_s=30)
    served = docker_client.version()
    major, minor = (int(part) for part in served["ApiVersion"].split("."))

    assert api.negotiate() == "{}.{}".format(*min((major, minor), MAX_API_VERSION))
    assert api.info()["ID"] == docker_client.info()["ID"]
    with pytest.raises(DockerApiError) as caught:
        api.inspect_image("meridian-node/no-such-image:never")
    assert caught.value.not_found and "no-such-image" in caught.value.reason

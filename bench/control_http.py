"""HTTP/1.1 on the agent's two links: which implementation reads the answers, and what it costs.

    .venv/bin/python bench/control_http.py [--rounds 12] [--calls 100]

1. The control-plane link: a real ``meridian-node-devserver`` on 127.0.0.1 (mutual TLS, the node enrolled,
   one desired state published), one kept-alive connection per implementation, all built from the same
   SSL context as ``ControlClient`` builds it. Two exchanges, the two an unchanged agent cycle makes: a
   heartbeat (``POST .../heartbeat``, a 200 with a lease) and a conditional fetch answered 304
   (``GET .../desired-state`` with ``If-None-Match``). Implementations: ``docker._http`` (the collection's
   hand-written exchange, what the client used before), ``h11`` (``agent_side.control_link.Link``, what it uses now)
   and the standard library's ``http.client``. CPU of this process (``time.process_time``; the server is
   another process) per exchange, over --rounds rounds of --calls exchanges of each kind and each
   implementation, interleaved (the order rotates every round), as ratios to ``docker._http``.
2. Strictness: the malformed answers of
   tests/collection/module_utils/docker/test_http_lite_differential.py (those http_lite and h11 both
   refuse) fed to each implementation over a socket pair; how many each accepts as an answer.
3. The Docker Engine socket, as ``docker.api`` speaks it (a new connection per request, ``Connection:
   close``): ``GET /containers/json`` filtered to one container this bench creates (never started, removed
   at the end; from the stand-in base image, built first if this machine has none) and
   ``GET /containers/{id}/json``, with ``docker._http`` and ``http.client`` (and ``h11`` beside them), the same
   interleaving, ratios to ``docker._http``. Wall time per request is printed too: most of it is the engine's
   own time to answer, the same for all three.

Every answer is checked (status, and the ETag of the 304) so a broken implementation cannot look fast.
"""

import argparse
import http.client
import json
import os
import socket
import ssl
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Protocol

import docker
import yaml
from timing import run_bench

from ansible_collections.meridian.node.plugins.module_utils.docker._http import exchange
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DEFAULT_HOST
from ansible_collections.meridian.node.tests.collection.module_utils.docker.test_http_lite_differential import (
    CASES,
    Parsed,
    through_h11,
    through_http_lite,
)
from ansible_collections.meridian.node.tests.devserver.devserver_process import enroll_node, running
from ansible_collections.meridian.node.tests.support.standin_image import ensure_base_image
from meridian_node_agent.agent_side.control_client import ControlClient, FetchStatus, _closed_by_peer
from meridian_node_agent.agent_side.control_link import Link
from meridian_node_agent.agent_side.identity import NodeIdentity

NODE_ID = "bench-http-node"
MAX_BODY = 4 * 1024 * 1024
LABEL = "meridian.node.bench"

Headers = Mapping[str, str]


def fail(message: str) -> NoReturn:
    raise SystemExit(f"bench: {message}")


class Http(Protocol):
    """One implementation on one connection: send a request, get (status, lowercased headers, body)."""

    name: str

    @property
    def connections(self) -> int: ...

    def request(self, method: str, target: str, headers: Headers, body: bytes | None) -> tuple[int, Headers, bytes]: ...

    def close(self) -> None: ...


Connect = Callable[[], socket.socket]


class LiteHttp:
    name = "http_lite"

    def __init__(self, connect: Connect, host: str, keep_alive: bool) -> None:
        self.connect, self.host, self.keep_alive = connect, host, keep_alive
        self.sock: socket.socket | None = None
        self.connections = 0

    def request(self, method: str, target: str, headers: Headers, body: bytes | None) -> tuple[int, Headers, bytes]:
        if self.sock is not None and _closed_by_peer(self.sock):
            self.close()
        if self.sock is None:
            self.sock = self.connect()
            self.connections += 1
        answer = exchange(
            self.sock, method, target, host=self.host, headers=headers, body=body, max_body=MAX_BODY,
            keep_alive=self.keep_alive,
        )  # fmt: skip
        if not answer.reusable:
            self.close()
        return answer.status, answer.headers, answer.body

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class H11Http:
    name = "h11"

    def __init__(self, connect: Connect, host: str, keep_alive: bool) -> None:
        self.connect, self.host = connect, host
        self.extra = {} if keep_alive else {"Connection": "close"}
        self.link: Link | None = None
        self.connections = 0

    def request(self, method: str, target: str, headers: Headers, body: bytes | None) -> tuple[int, Headers, bytes]:
        if self.link is not None and _closed_by_peer(self.link.sock):
            self.close()
        if self.link is None:
            self.link = Link(self.connect())
            self.connections += 1
        reply = self.link.exchange(
            method, target, host=self.host, headers={**headers, **self.extra}, body=body, max_body=MAX_BODY
        )
        if not self.link.reusable:
            self.close()
        return reply.status, reply.headers, reply.body

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


class _Connection(http.client.HTTPConnection):
    """``http.client`` on a socket made by ``connect`` (TLS or a Unix socket)."""

    def __init__(self, make: Connect, host: str) -> None:
        super().__init__(host)
        self.make = make
        self.opened = 0

    def connect(self) -> None:
        self.sock = self.make()
        self.opened += 1


class StdlibHttp:
    name = "http.client"

    def __init__(self, connect: Connect, host: str, keep_alive: bool) -> None:
        self.conn = _Connection(connect, host)
        self.extra = {} if keep_alive else {"Connection": "close"}

    @property
    def connections(self) -> int:
        return self.conn.opened

    def request(self, method: str, target: str, headers: Headers, body: bytes | None) -> tuple[int, Headers, bytes]:
        if self.conn.sock is not None and _closed_by_peer(self.conn.sock):
            self.conn.close()
        self.conn.request(method, target, body=body, headers={**headers, **self.extra})
        response = self.conn.getresponse()
        if response.length is not None and response.length > MAX_BODY:
            self.conn.close()
            fail(f"{self.name}: answer over the cap")
        data = response.read(MAX_BODY + 1)
        if len(data) > MAX_BODY:
            fail(f"{self.name}: answer over the cap")
        fields = {name.lower(): value for name, value in response.getheaders()}
        if response.will_close:
            self.conn.close()
        return response.status, fields, data

    def close(self) -> None:
        self.conn.close()


IMPLEMENTATIONS: list[Callable[[Connect, str, bool], Http]] = [LiteHttp, H11Http, StdlibHttp]


@dataclass
class Call:
    """One kind of exchange and the check of its answer."""

    name: str
    method: str
    target: str
    headers: Headers
    check: Callable[[int, Headers, bytes], str | None]  # what is wrong, or None
    cpu: dict[str, float] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)


def interleaved(implementations: list[Http], calls: list[Call], rounds: int, per_round: int) -> None:
    """Each round: ``per_round`` times, each call once on each implementation, the implementations' order
    rotating every round. Exchange by exchange, so no connection idles long enough for the server to end it
    and no implementation gets the machine's quiet or busy moments to itself."""
    for call in calls:
        call.cpu = {impl.name: 0.0 for impl in implementations}
        call.wall = {impl.name: 0.0 for impl in implementations}
        for impl in implementations:  # warm: connections open, code paths taken once
            _run(impl, call)
    for index in range(rounds):
        shift = index % len(implementations)
        order = implementations[shift:] + implementations[:shift]
        for _ in range(per_round):
            for call in calls:
                for impl in order:
                    cpu, wall = _run(impl, call)
                    call.cpu[impl.name] += cpu
                    call.wall[impl.name] += wall


def _run(impl: Http, call: Call) -> tuple[float, float]:
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    status, headers, body = impl.request(call.method, call.target, call.headers, None)
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
    wrong = call.check(status, headers, body)
    if wrong:
        fail(f"{impl.name}, {call.name}: {wrong}")
    return cpu, wall


def report(title: str, calls: list[Call], names: list[str], count: int, connections: dict[str, int]) -> None:
    print(title)
    peer = names[0]
    for call in calls:
        print(f"  {call.name}:")
        for name in names:
            cpu_us = 1e6 * call.cpu[name] / count
            wall_us = 1e6 * call.wall[name] / count
            ratio = call.cpu[name] / call.cpu[peer]
            print(
                f"    {name:12} CPU {cpu_us:7.1f} us/exchange   ratio to {peer} {ratio:4.2f}   (wall {wall_us:7.1f} us)"
            )
    print("  connections opened: " + ", ".join(f"{name} {connections[name]}" for name in names))


def control_plane(root: Path, rounds: int, per_round: int) -> None:
    (root / "control-plane").mkdir()
    with running(root / "control-plane" / "data") as server:
        enroll_node(server, root / "identity", NODE_ID).close()
        desired = root / "desired.yaml"
        desired.write_text(yaml.safe_dump({"engines": [], "artifacts": []}))
        server.cli("publish", NODE_ID, str(desired))
        identity = NodeIdentity(root / "identity")
        client = ControlClient(server.base_url, identity.ca_path, identity.cert_path, identity.key_path)
        with client:
            first = client.fetch_desired_state(NODE_ID)
            if first.status is not FetchStatus.NEW or not first.etag:
                fail(f"the published desired state was not fetched: {first}")
            etag = first.etag
            host, port = server.base_url.removeprefix("https://").rsplit(":", 1)
            # As ControlClient builds it: the node's CA, certificate and key, and nothing else.
            context = ssl.create_default_context(cafile=str(identity.ca_path))
            context.load_cert_chain(str(identity.cert_path), str(identity.key_path))

            def connect() -> socket.socket:
                raw = socket.create_connection((host, int(port)), timeout=10)
                return context.wrap_socket(raw, server_hostname=host)

            base = {"Accept": "application/json", "User-Agent": "meridian-node-agent"}
            calls = [
                Call(
                    "heartbeat (POST, 200 with a lease)",
                    "POST",
                    f"/v1/nodes/{NODE_ID}/heartbeat",
                    base,
                    lambda status, _h, body: None if status == 200 and NODE_ID.encode() in body else f"HTTP {status}",
                ),
                Call(
                    "conditional fetch answered 304",
                    "GET",
                    f"/v1/nodes/{NODE_ID}/desired-state",
                    {**base, "If-None-Match": etag},
                    lambda status, headers, _b: (
                        None if status == 304 and headers.get("etag") == etag else f"HTTP {status}, {headers}"
                    ),
                ),
            ]
            implementations = [make(connect, f"{host}:{port}", True) for make in IMPLEMENTATIONS]
            interleaved(implementations, calls, rounds, per_round)
            report(
                f"control plane, one kept-alive mutual-TLS connection each, {rounds} rounds x {per_round} "
                "exchanges per kind, interleaved; CPU of this process:",
                calls,
                [impl.name for impl in implementations],
                rounds * per_round,
                {impl.name: impl.connections for impl in implementations},
            )
            for impl in implementations:
                impl.close()


def strictness() -> None:
    """Which implementation refuses what is not HTTP/1.1: the malformed answers of the differential test."""
    malformed = {name: case for name, case in CASES.items() if case.h11 == case.lite == "refused"}
    accepted: dict[str, list[str]] = {"http_lite": [], "h11": [], "http.client": []}
    for name, case in malformed.items():
        if isinstance(through_http_lite(case.raw, case.method), Parsed):
            accepted["http_lite"].append(name)
        if isinstance(through_h11(case.raw, case.method), Parsed):
            accepted["h11"].append(name)
        if _stdlib_reads(case.raw, case.method):
            accepted["http.client"].append(name)
    print(
        f"malformed answers (the {len(malformed)} that http_lite and h11 both refuse in "
        "tests/collection/module_utils/docker/test_http_lite_differential.py), fed to each implementation "
        "over a socket pair:"
    )
    for name, names in accepted.items():
        print(f"  {name:12} accepted {len(names):2} of {len(malformed)}" + (f": {'; '.join(names)}" if names else ""))


def _stdlib_reads(raw: bytes, method: str) -> bool:
    """Whether http.client returns an answer (instead of raising) for ``raw``."""
    ours, theirs = socket.socketpair()
    theirs.sendall(raw)
    theirs.shutdown(socket.SHUT_WR)
    conn = http.client.HTTPConnection("peer")
    conn.sock = ours
    try:
        conn.request(method, "/")
        conn.getresponse().read()  # without a size: its strictest reading (a short body raises)
    except (http.client.HTTPException, OSError, ValueError):
        return False
    finally:
        conn.close()
        theirs.close()
    return True


def docker_socket(rounds: int, per_round: int) -> None:
    host = os.environ.get("DOCKER_HOST", DEFAULT_HOST)
    if not host.startswith("unix://"):
        print(f"docker socket: skipped, DOCKER_HOST is {host!r}, not a Unix socket")
        return
    path = host.removeprefix("unix://")
    sdk = docker.DockerClient(base_url=host)
    image = ensure_base_image(sdk)
    mark = f"control-http-{uuid.uuid4().hex[:8]}"
    container = sdk.containers.create(image.id, command=["true"], name=f"meridian-bench-{mark}", labels={LABEL: mark})
    try:
        version = sdk.version()["ApiVersion"]

        def connect() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(60)
            sock.connect(path)
            return sock

        quoted = urllib.parse.quote(json.dumps({"label": [f"{LABEL}={mark}"]}), safe="")
        calls = [
            Call(
                "GET /containers/json (one container, by label)",
                "GET",
                f"/v{version}/containers/json?all=1&filters={quoted}",
                {},
                lambda status, _h, body: None if status == 200 and container.id.encode() in body else f"HTTP {status}",
            ),
            Call(
                "GET /containers/{id}/json (inspect)",
                "GET",
                f"/v{version}/containers/{container.id}/json",
                {},
                lambda status, _h, body: None if status == 200 and mark.encode() in body else f"HTTP {status}",
            ),
        ]
        implementations = [make(connect, "docker", False) for make in IMPLEMENTATIONS]
        interleaved(implementations, calls, rounds, per_round)
        report(
            f"docker socket {path}, a new connection per request (as docker_api), {rounds} rounds x "
            f"{per_round} requests per kind, interleaved; CPU of this process:",
            calls,
            [impl.name for impl in implementations],
            rounds * per_round,
            {impl.name: impl.connections for impl in implementations},
        )
    finally:
        container.remove(force=True)
        sdk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=100, help="exchanges of each kind per round")
    parser.add_argument("--skip-docker", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meridian-bench-http-") as temporary:
        control_plane(Path(temporary), args.rounds, args.calls)
    strictness()
    if not args.skip_docker:
        docker_socket(args.rounds, args.calls)


if __name__ == "__main__":
    run_bench(main)

"""The real ``meridian-node-devserver serve`` as a subprocess on 127.0.0.1, and helpers to talk to it.

The server binds port 0 and prints the port it got, so no test races another for a port. ``running``
returns once the server answers ``/v1/healthz`` over TLS with its own CA, and stops it on exit.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
import requests

from ansible_collections.meridian.node.tests.support.processes import stop_process
from meridian_node_agent.agent_side.control_client import ControlClient, ControlPlaneRejected
from meridian_node_agent.agent_side.identity import NodeIdentity

__all__ = [
    "DevServer",
    "cli",
    "devserver_command",
    "enroll_node",
    "node_client",
    "rejection",
    "renew_identity",
    "renewed_node",
    "running",
]

_STARTUP_SECONDS = 30.0


def devserver_command() -> list[str]:
    """The installed console script when there is one (what operators run), else the module."""
    script = Path(sys.executable).parent / "meridian-node-devserver"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "meridian_node_agent.devserver.cli"]


@dataclass
class DevServer:
    data_dir: Path
    base_url: str
    ca_bundle: Path
    control_public_key: Path
    tokens: dict[str, str] = field(default_factory=dict)
    stderr_path: Path | None = None
    # The serve process itself (a test that kills a server mid-flush signals it).
    process: subprocess.Popen[str] | None = None

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return cli(self.data_dir, *args, check=check)

    def new_token(self, name: str) -> str:
        return self.cli("token", name).stdout.strip()

    def new_token_for(self, name: str, node_id: str) -> str:
        """A token that can enroll only ``node_id``."""
        return self.cli("token", name, "--node-id", node_id).stdout.strip()

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path and self.stderr_path.exists() else ""


def cli(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a devserver verb in its own process against ``data_dir``."""
    verb, *rest = args
    result = subprocess.run(
        [*devserver_command(), verb, "--data-dir", str(data_dir), *rest],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"meridian-node-devserver {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


@contextmanager
def running(
    data_dir: Path, tokens: Sequence[str] = (), extra: Sequence[str] = (), *, name: str | None = None
) -> Iterator[DevServer]:
    """``serve`` on ``data_dir``; ``name`` tells apart the stderr logs of several servers on one data dir."""
    stderr_path = data_dir.parent / f"{name or data_dir.name}.stderr.log"
    token_args = [arg for spec in tokens for arg in ("--token", spec)]
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [*devserver_command(), "serve", "--data-dir", str(data_dir), "--port", "0", *token_args, *extra],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert process.stdout is not None
        # A thread reads stdout line by line (select() on a buffered text pipe misses lines already
        # buffered) and keeps draining it afterwards, so the server can never block on a full pipe.
        lines: queue.Queue[str | None] = queue.Queue()
        pump = threading.Thread(target=_pump, args=(process.stdout, lines), name="devserver-stdout", daemon=True)
        pump.start()
        try:
            server = _read_banner(process, lines, data_dir, stderr_path)
            server.process = process
            _wait_until_answering(server, process)
            yield server
        finally:
            stop_process(process)
            pump.join(timeout=15)
            process.stdout.close()


def _pump(stdout: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stdout:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _read_banner(
    process: subprocess.Popen[str], lines: queue.Queue[str | None], data_dir: Path, stderr_path: Path
) -> DevServer:
    seen: list[str] = []
    deadline = time.monotonic() + _STARTUP_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith("listening on "):
            return _parse_banner(seen, data_dir, stderr_path)
    raise AssertionError(
        f"devserver did not start (exit {process.poll()}); stdout:\n"
        + "\n".join(seen)
        + "\nstderr:\n"
        + (stderr_path.read_text() if stderr_path.exists() else "")
    )


def _parse_banner(lines: list[str], data_dir: Path, stderr_path: Path) -> DevServer:
    values: dict[str, str] = {}
    tokens: dict[str, str] = {}
    for line in lines:
        token = re.match(r"^token (\S+): (\S+)$", line)
        if token:
            tokens[token.group(1)] = token.group(2)
        elif line.startswith("listening on "):
            values["url"] = line.removeprefix("listening on ").strip()
        elif ": " in line:
            key, _, value = line.partition(": ")
            values[key] = value
    return DevServer(
        data_dir=data_dir,
        base_url=values["url"],
        ca_bundle=Path(values["ca bundle"]),
        control_public_key=Path(values["control public key"].split(" (keyid ")[0]),
        tokens=tokens,
        stderr_path=stderr_path,
    )


def _wait_until_answering(server: DevServer, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _STARTUP_SECONDS
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"devserver exited with {process.returncode}:\n{server.stderr()}")
        try:
            answer = requests.get(f"{server.base_url}/v1/healthz", verify=str(server.ca_bundle), timeout=2)
            if answer.status_code == 200:
                return
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"devserver never answered /v1/healthz ({last}):\n{server.stderr()}")


def enroll_node(server: DevServer, directory: Path, node_id: str, token: str | None = None) -> ControlClient:
    """Enroll ``node_id`` with a fresh token; return a client holding its certificate."""
    identity = NodeIdentity(directory)
    with ControlClient(server.base_url, server.ca_bundle) as anonymous:
        response = anonymous.enroll(node_id, token or server.new_token(f"t-{node_id}"), identity.csr_pem(node_id))
    identity.store(response)
    return node_client(server.base_url, identity)


def node_client(base_url: str, identity: NodeIdentity) -> ControlClient:
    """A client of the control plane at ``base_url`` speaking as the node ``identity`` holds the certificate of
    (whatever that certificate is by now: a copy, a revoked one, a renewed one)."""
    return ControlClient(base_url, identity.ca_path, identity.cert_path, identity.key_path, timeout_s=10)


def renew_identity(client: ControlClient, identity: NodeIdentity, node_id: str) -> None:
    """Renew ``node_id``'s certificate through ``client`` (a new key, a CSR for it) and switch ``identity`` to the
    new pair, as the agent's renewal does."""
    pending = identity.new_key(node_id)
    identity.install_renewal(client.renew_certificate(node_id, pending.csr_pem), pending)


def renewed_node(server: DevServer, directory: Path, node_id: str) -> NodeIdentity:
    """Enroll ``node_id`` with its identity in ``directory`` and renew its certificate once: that identity, now
    on the renewed pair."""
    identity = NodeIdentity(directory)
    with enroll_node(server, identity.directory, node_id) as client:
        renew_identity(client, identity, node_id)
    return identity


def rejection(call: Callable[[], object]) -> ControlPlaneRejected:
    """Run ``call``, a request the control plane must refuse; its refusal (``status``, ``reason``, ``detail``)."""
    with pytest.raises(ControlPlaneRejected) as refused:
        call()
    return refused.value

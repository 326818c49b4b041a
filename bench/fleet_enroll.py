"""bench/fleet.py's nodes: one key and one certificate each, enrolled through the devserver's real endpoint.

Tokens are made in this process through ``ControlPlane.create_token`` on the server's own data dir (one short
transaction each: 0.25 ms on this machine's SQLite, where 10,000 ``token`` CLI runs would take an hour of
interpreter starts). Each node then does what ``meridian-node enroll`` does: a fresh P-256 key and its CSR
(``NodeIdentity.new_key``, the agent's key type, so the TLS handshakes cost what the agent's cost), ``POST
/v1/enroll`` with its bound token, and the certificate kept with its key. ``ENROLL_CONNECTIONS`` kept-alive
connections enroll side by side. Each node's certificate and key go to one PEM file (certificate first), which
both ``ssl.SSLContext.load_cert_chain`` and the agent's ``ControlClient`` read.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.meridian.node.bench.fleet_client import Link
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    EnrollmentRequest,
    EnrollmentResponse,
    parse_document,
)
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.devserver.control.plane import ControlPlane

__all__ = ["ENROLL_CONNECTIONS", "Enrolled", "client_context", "enroll", "fleet_node_ids", "make_tokens"]

ENROLL_CONNECTIONS = 8
_ENROLL_TIMEOUT_S = 60.0


class EnrollmentFailed(Exception):
    """The devserver refused or failed an enrollment: nothing can be measured without every node."""


@dataclass(frozen=True)
class Enrolled:
    node_id: str
    credentials: Path  # the node's certificate, then its private key (PEM)


def fleet_node_ids(count: int) -> list[str]:
    return [f"fleet-{index:05d}" for index in range(count)]


def make_tokens(control: ControlPlane, node_ids: list[str]) -> dict[str, str]:
    """A one-time token bound to each node id."""
    return {node_id: control.create_token(f"fleet-{node_id}", None, node_id) for node_id in node_ids}


def client_context(ca_pem: str, credentials: Path | None = None) -> ssl.SSLContext:
    """What the agent's client builds: the control plane's CA only, and the node's certificate if it has one."""
    context = ssl.create_default_context(cadata=ca_pem)
    if credentials is not None:
        context.load_cert_chain(credentials)
    return context


async def enroll(host: str, port: int, ca_pem: str, tokens: dict[str, str], directory: Path) -> list[Enrolled]:
    """Enroll every node of ``tokens``; their credentials go to ``directory``. In the order of ``tokens``."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    anonymous = client_context(ca_pem)
    queue = list(tokens)
    queue.reverse()
    done: dict[str, Enrolled] = {}

    async def worker() -> None:
        link = Link(host, port, anonymous)
        try:
            while queue:
                node_id = queue.pop()
                done[node_id] = await _enroll_one(link, node_id, tokens[node_id], directory)
        finally:
            link.close()

    await asyncio.gather(*(worker() for _ in range(ENROLL_CONNECTIONS)))
    return [done[node_id] for node_id in tokens]


async def _enroll_one(link: Link, node_id: str, token: str, directory: Path) -> Enrolled:
    pending = NodeIdentity(directory / node_id).new_key(node_id)  # in memory: NodeIdentity writes nothing here
    request = EnrollmentRequest(node_id=node_id, token=token, csr_pem=pending.csr_pem)
    answer = await link.exchange(
        b"POST",
        b"/v1/enroll",
        [(b"accept", b"application/json"), (b"content-type", b"application/json")],
        request.model_dump_json().encode(),
        _ENROLL_TIMEOUT_S,
    )
    if answer.status != 200:
        raise EnrollmentFailed(f"enrolling {node_id}: HTTP {answer.status} {answer.body[:300]!r}")
    response = parse_document(EnrollmentResponse, answer.body)
    path = directory / f"{node_id}.pem"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(response.certificate_pem.encode() + pending.key_pem)
    return Enrolled(node_id, path)

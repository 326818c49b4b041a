"""The agent renews its client certificate in its normal cycle, against the real devserver over real TLS.

The devserver issues one-hour certificates (``--certificate-seconds 3600``); the agent's clock is moved
past the renewal point (two thirds of the lifetime) instead of waiting for it, so nothing here depends
on how fast the machine is. The identity switch is also crashed at every step it has, and each time
the files left behind must be a key and certificate that belong together.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sqlite3
import ssl
import stat
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ansible_collections.meridian.node.plugins.module_utils.contracts import EnrollmentResponse, format_rfc3339
from ansible_collections.meridian.node.tests.devserver.devserver_process import (
    DevServer,
    enroll_node,
    node_client,
    renew_identity,
    renewed_node,
)
from ansible_collections.meridian.node.tests.support.devserver_fixtures import DevServerOptions
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node, publish
from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.identity import NodeIdentity, PendingKey
from meridian_node_agent.agent_side.status_file import read_status

LIFETIME = timedelta(hours=1)


DEVSERVER_OPTIONS = DevServerOptions(extra=["--certificate-seconds", str(int(LIFETIME.total_seconds()))])


@pytest.fixture
def node(server: DevServer, tmp_path: Path, node_id: str) -> Node:
    """The test's node, enrolled with the module's devserver as ``node_id``; observe-only, so that a cycle renews
    without applying anything."""
    return make_node(server, tmp_path / "node", node_id, mode="observe-only")


class _Clock:
    """The agent's wall clock, moved by the test."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, delta: timedelta) -> None:
        self.now += delta


def _agent_past_renewal_point(node: Node) -> tuple[Agent, _Clock]:
    clock = _Clock()
    agent = node.agent(clock=clock)
    info = NodeIdentity(node.config.identity_dir).certificate()
    # The agent's own renewal point: the configured fraction, jittered once at its start.
    clock.now = info.renew_after(agent.renewal.remaining_fraction) + timedelta(seconds=1)
    return agent, clock


def _close(agent: Agent) -> None:
    if isinstance(agent.client, ControlClient):
        agent.client.close()


def _pair_matches(directory: Path) -> bytes:
    """The certificate (DER) that ``node.pem``/``node.key.pem`` name, after checking they belong together."""
    identity = NodeIdentity(directory)
    certificate = x509.load_pem_x509_certificate(identity.cert_path.read_bytes())
    key = serialization.load_pem_private_key(identity.key_path.read_bytes(), password=None)
    assert certificate.public_key() == key.public_key()
    # What the control client does with them: TLS must accept the pair as well.
    ssl.create_default_context(cafile=str(identity.ca_path)).load_cert_chain(identity.cert_path, identity.key_path)
    return certificate.public_bytes(serialization.Encoding.DER)


def _revoke_serial(server: DevServer, serial: int) -> None:
    """Revoke one certificate in the devserver's database (the CLI revokes a node's certificates all at once)."""
    with sqlite3.connect(server.data_dir / "devserver.sqlite3", timeout=10) as db:
        db.execute(
            "UPDATE certificates SET revoked_at = ? WHERE serial = ?",
            (format_rfc3339(datetime.now(UTC)), format(serial, "x")),
        )


class _ForeignCsrIssuer:
    """A renewal path where the CSR arrives naming another node: the real devserver must refuse it."""

    def __init__(self, real: ControlClient) -> None:
        self.real = real
        self.calls = 0

    def renew_certificate(self, node_id: str, csr_pem: str) -> EnrollmentResponse:
        self.calls += 1
        foreign = NodeIdentity(Path("/nonexistent")).new_key("someone-else").csr_pem
        return self.real.renew_certificate(node_id, foreign)

    def reload_identity(self) -> None:
        self.real.reload_identity()


def test_agent_renews_in_a_normal_cycle_and_then_works_only_with_the_new_pair(
    node: Node, server: DevServer, node_id: str
) -> None:
    identity = NodeIdentity(node.config.identity_dir)
    old = identity.certificate()
    old_key = identity.key_path.read_bytes()
    agent, clock = _agent_past_renewal_point(node)
    try:
        first = agent.cycle()

        assert first.outcome == CycleStatus.NONE_PUBLISHED
        new = identity.certificate()
        assert new.serial != old.serial and new.not_after >= old.not_after
        assert identity.key_path.read_bytes() != old_key
        _pair_matches(identity.directory)
        assert stat.S_IMODE(identity.key_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(identity.current_link.resolve().stat().st_mode) == 0o700
        assert stat.S_IMODE(identity.versions_dir.stat().st_mode) == 0o700

        # With the old certificate refused by the server, the agent still works: it uses the new one.
        _revoke_serial(server, old.serial)
        generation = publish(server, node_id)
        assert agent.renewal.renew_at is not None
        clock.now = agent.renewal.renew_at - timedelta(seconds=1)
        second = agent.cycle()
        assert (second.outcome, second.generation) == (CycleStatus.OBSERVED_ONLY, generation)
        assert identity.certificate().serial == new.serial  # not due again: no second renewal
        agent.write_status()
        status = read_status(node.state_dir)
        assert status is not None
        assert status["certificate"]["serial"] == f"{new.serial:x}"
        assert status["certificate"]["last_renewed_at"] is not None
        assert status["certificate"]["failures"] == 0
    finally:
        _close(agent)


def test_refused_renewal_keeps_the_old_pair_and_is_retried_after_a_backoff_not_every_cycle(node: Node) -> None:
    identity = NodeIdentity(node.config.identity_dir)
    old = identity.certificate()
    old_files = {p.name: p.read_bytes() for p in (identity.key_path, identity.cert_path, identity.ca_path)}
    agent, clock = _agent_past_renewal_point(node)
    real = agent.issuer
    assert isinstance(real, ControlClient)
    refusing = _ForeignCsrIssuer(real)
    agent.issuer = refusing
    try:
        assert agent.cycle().outcome == CycleStatus.NONE_PUBLISHED  # the cycle itself is not failed
        assert refusing.calls == 1
        assert {name: (identity.directory / name).read_bytes() for name in old_files} == old_files
        assert identity.certificate().serial == old.serial
        assert agent.renewal.failures == 1
        assert agent.renewal.last_error is not None and "bad-csr" in agent.renewal.last_error
        retry_at = agent.renewal.next_attempt_at
        assert retry_at is not None and retry_at > clock.now

        # Later cycles before the retry time do not try again.
        for _ in range(3):
            assert agent.cycle().outcome == CycleStatus.NONE_PUBLISHED
        assert refusing.calls == 1

        clock.now = retry_at
        agent.cycle()
        assert refusing.calls == 2 and agent.renewal.failures == 2
        assert agent.renewal.next_attempt_at is not None and agent.renewal.next_attempt_at > retry_at

        agent.write_status()
        status = read_status(node.state_dir)
        assert status is not None and status["certificate"]["failures"] == 2
        assert "bad-csr" in status["certificate"]["last_error"]

        # The control plane accepts the next attempt: the node moves to a new pair.
        agent.issuer = real
        clock.now = agent.renewal.next_attempt_at
        assert agent.cycle().outcome == CycleStatus.NONE_PUBLISHED
        assert identity.certificate().serial != old.serial
        assert agent.renewal.failures == 0 and agent.renewal.last_error is None
    finally:
        _close(agent)


def test_unchanged_cycles_do_not_read_the_certificate_again(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[Path] = []
    original = NodeIdentity.certificate

    def counting(self: NodeIdentity) -> Any:
        reads.append(self.cert_path)
        return original(self)

    monkeypatch.setattr(NodeIdentity, "certificate", counting)
    agent = node.agent()
    try:
        for _ in range(4):
            assert agent.cycle().outcome == CycleStatus.NONE_PUBLISHED
    finally:
        _close(agent)
    assert len(reads) == 1


class _Crash(BaseException):
    """The process dies here: nothing after this call happens."""


def _crash_at(monkeypatch: pytest.MonkeyPatch, step: int) -> list[str]:
    """Make the ``step``-th rename, replace or symlink (counting from 0) crash the process."""
    seen: list[str] = []
    for name in ("rename", "replace", "symlink"):
        real: Callable[..., Any] = getattr(os, name)

        def wrapper(*args: Any, _real: Callable[..., Any] = real, _name: str = name, **kwargs: Any) -> Any:
            if len(seen) == step:
                seen.append(f"{_name} (crashed)")
                raise _Crash(_name)
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, wrapper)
    return seen


def _crash_every_step(
    monkeypatch: pytest.MonkeyPatch, template: Path, work: Path, install: Callable[[NodeIdentity], object]
) -> tuple[set[bytes], int]:
    """Run ``install`` on a copy of ``template`` once per step, crashing at that step; check the pair each time.

    Returns the distinct certificates the crashes left behind and how many steps there were.
    """
    left_behind: set[bytes] = set()
    for step in itertools.count():
        copy = work / f"step-{step}"
        shutil.copytree(template, copy, symlinks=True)
        seen = _crash_at(monkeypatch, step)
        try:
            install(NodeIdentity(copy))
        except _Crash:
            crashed = True
        else:
            crashed = False
        finally:
            monkeypatch.undo()
        left_behind.add(_pair_matches(copy))
        if not crashed:
            assert seen and "(crashed)" not in seen[-1]
            # A crashed switch is finished by the next renewal: it starts from whatever pair was left.
            return left_behind, step
        # The next attempt on the crashed copy succeeds and leaves a matching pair.
        install(NodeIdentity(copy))
        _pair_matches(copy)
    raise AssertionError("unreachable")


def test_crash_at_any_step_of_the_key_switch_leaves_a_matching_pair(
    server: DevServer, tmp_path: Path, node_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    enrolled = tmp_path / "enrolled"
    with enroll_node(server, enrolled, node_id) as client:
        old = _pair_matches(enrolled)
        first_key = NodeIdentity(enrolled).new_key(node_id)
        first = client.renew_certificate(node_id, first_key.csr_pem)
        second_key = NodeIdentity(enrolled).new_key(node_id)
        second = client.renew_certificate(node_id, second_key.csr_pem)

    def renew_with(response: EnrollmentResponse, pending: PendingKey) -> Callable[[NodeIdentity], object]:
        return lambda identity: identity.install_renewal(response, pending)

    # The first renewal also moves the enrolled flat files into the versioned layout.
    left, steps = _crash_every_step(monkeypatch, enrolled, tmp_path / "first", renew_with(first, first_key))
    new = x509.load_pem_x509_certificate(first.certificate_pem.encode()).public_bytes(serialization.Encoding.DER)
    assert steps >= 5
    assert left == {old, new}

    # A later renewal, from the versioned layout, is one switch of the 'current' link.
    renewed = tmp_path / "renewed"
    shutil.copytree(enrolled, renewed, symlinks=True)
    NodeIdentity(renewed).install_renewal(first, first_key)
    left, steps = _crash_every_step(monkeypatch, renewed, tmp_path / "second", renew_with(second, second_key))
    newer = x509.load_pem_x509_certificate(second.certificate_pem.encode()).public_bytes(serialization.Encoding.DER)
    assert steps >= 2
    assert left == {new, newer}
    # Old versions do not pile up: the current pair and the one it replaced.
    assert len(list(NodeIdentity(tmp_path / "second" / f"step-{steps}").versions_dir.iterdir())) == 2


def test_renewal_response_for_another_key_is_not_installed(server: DevServer, tmp_path: Path, node_id: str) -> None:
    identity = NodeIdentity(tmp_path / "node")
    with enroll_node(server, identity.directory, node_id) as client:
        before = _pair_matches(identity.directory)
        asked = identity.new_key(node_id)
        response = client.renew_certificate(node_id, asked.csr_pem)
    with pytest.raises(ValueError, match="another key"):
        identity.install_renewal(response, identity.new_key(node_id))
    assert _pair_matches(identity.directory) == before


def test_status_shows_the_certificate_expiry_and_the_last_renewal(node: Node) -> None:
    agent, _clock = _agent_past_renewal_point(node)
    try:
        agent.cycle()
        agent.write_status()
    finally:
        _close(agent)
    info = NodeIdentity(node.config.identity_dir).certificate()
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    shown = subprocess.run(
        [*command, "--config", str(node.config_path), "status"], capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr
    table = {name.strip(): value.strip() for name, value in (line.split("  ", 1) for line in shown.stdout.splitlines())}
    assert table["certificate"].startswith(f"serial {info.serial:x}, valid until {format_rfc3339(info.not_after)}")
    due = format_rfc3339(info.renew_after(agent.renewal.remaining_fraction))
    assert table["cert renewal"].startswith(f"due from {due}; last renewed at ")


def test_refused_renewal_does_not_stop_the_agent_loop(node: Node) -> None:
    agent, _clock = _agent_past_renewal_point(node)
    real = agent.issuer
    assert isinstance(real, ControlClient)
    agent.issuer = _ForeignCsrIssuer(real)
    before = _pair_matches(node.config.identity_dir)
    try:
        assert agent.run(once=True) == 0
    finally:
        _close(agent)
    assert agent.renewal.failures == 1 and agent.counters.refused == 0
    assert _pair_matches(node.config.identity_dir) == before


def test_re_enrolling_a_renewed_node_and_renewing_again_keeps_a_matching_pair(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    identity = renewed_node(server, tmp_path / "node", node_id)
    renewed = _pair_matches(identity.directory)

    # An operator re-enrolls (after a revocation, say): the current key stays, node.pem is written anew.
    server.cli("revoke", node_id)
    with enroll_node(server, identity.directory, node_id, server.new_token(f"again-{node_id}")) as client:
        re_enrolled = _pair_matches(identity.directory)
        assert re_enrolled != renewed
        renew_identity(client, identity, node_id)
    with node_client(server.base_url, identity) as fresh:
        assert fresh.heartbeat(node_id).node_id == node_id
    assert _pair_matches(identity.directory) not in (renewed, re_enrolled)

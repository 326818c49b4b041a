"""The privilege boundary under a real systemd, attacked by the ``meridian`` user.

One bookworm host booting systemd as PID 1 (tests/support/systemd_host.py) with the project's wheel and
``systemd/`` units installed as docs/SECURITY.md says. It shares this machine's network (``--network host``)
and Docker socket: the devserver runs in this test process on 127.0.0.1, the agent inside reaches it there,
and the root apply unit inside starts the stand-in engine on this machine's Docker Engine, which publishes
it on the same 127.0.0.1. (A dockerd of its own inside the host would need ``--privileged``, which these
machines refuse.)

The whole loop runs first: publish → agent (``meridian``) verifies and spools → ``meridian-node-apply.path``
fires → the root unit re-verifies and applies → the engine serves. Then each attack runs as ``meridian``
against the live units. Each must fail: nothing runs as root that root did not choose, no older generation
or lower epoch is applied, the engine keeps serving the same container, and the refusal is logged with
the reason.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.systemd_host import SystemdHost
from ansible_collections.meridian.node.tests.support.systemd_site import (
    AGENT_DIR,
    AGENT_UNIT,
    APPLY_PATH_UNIT,
    APPLY_UNIT,
    ROOT_DIR,
    SiteParts,
    SplitSite,
    as_meridian,
    install_managed_site,
    refused_as_meridian,
    root_generation,
    split_config,
    wait_until,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import current_state

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SPOOL = f"{AGENT_DIR}/spool"
REQUEST = f"{SPOOL}/apply-request.json"
ANSWER = f"{ROOT_DIR}/public/apply-result.json"
# systemd-analyze security of the apply unit was 7.1 (MEDIUM) before the boundary was rebuilt.
APPLY_UNIT_MAX_EXPOSURE = 4.5


@dataclass
class Site(SplitSite):
    server: DevServer
    first_envelope: bytes  # generation 1 (no engines), as the agent spooled it
    generation: int  # the one with the engine

    def as_meridian(self, script: str, *, check: bool = True) -> Any:
        return as_meridian(self.host, script, check=check)

    def answer(self) -> dict[str, Any] | None:
        result = self.host.exec(["cat", ANSWER], check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def container(self) -> tuple[str, str]:
        """(id, state) of the engine container on the outer Docker Engine."""
        container = self.docker.containers.get(self.engine)
        return str(container.id), str(container.status)

    def sign(self, generation: int, lease_epoch: int) -> bytes:
        """The site's state as ``generation`` under ``lease_epoch``, signed with the devserver's real control key
        (what a leader could have signed)."""
        body = current_state(generation, lease_epoch=lease_epoch, node_id=self.node_id, engines=[self.stand_in.spec()])
        key = dsse.load_private_key_pem((self.server.data_dir / "control" / "control.key.pem").read_bytes())
        envelope = dsse.sign(dsse.PAYLOAD_TYPES["desired-state"], json.dumps(body).encode(), [key])
        return json.dumps(envelope).encode()

    def spool_as_meridian(self, generation: int, envelope: bytes, *, stamp: str | None = None) -> str:
        """Write a request as the agent's user would (temporary file, rename): the path unit fires."""
        ident = f"gen-{generation}-{stamp or datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}"
        request = json.dumps({"format": 1, "request": ident, "envelope": base64.b64encode(envelope).decode()})
        as_meridian(self.host, f"cat > {SPOOL}/.req && mv -f {SPOOL}/.req {REQUEST}", input=request.encode())
        return ident

    def await_answer(self, ident: str, timeout: float = 120) -> dict[str, Any]:
        def answered() -> dict[str, Any] | None:
            answer = self.answer()
            return answer if answer is not None and answer["request"] == ident else None

        return wait_until(f"the answer to {ident}", answered, self.host, [APPLY_UNIT], timeout=timeout)


def _wait(what: str, check: Callable[[], object], host: SystemdHost, timeout: float = 180) -> None:
    wait_until(what, check, host, (AGENT_UNIT, APPLY_UNIT), timeout=timeout)


@pytest.fixture(scope="module")
def site(site_parts: SiteParts) -> Iterator[Site]:
    host = site_parts.host
    node_id = site_parts.node_id("boundary")
    stop_units = (AGENT_UNIT, APPLY_PATH_UNIT)
    with site_parts.devserver("boundary") as server, site_parts.engine("boundary", stop_units=stop_units) as engine:
        install_managed_site(host, server, split_config(node_id, "managed-host", control_plane=server.base_url))
        publish(server, node_id)  # generation 1: nothing to run
        host.exec(["systemctl", "enable", "--now", APPLY_PATH_UNIT, AGENT_UNIT])
        with host.logs_on_failure(AGENT_UNIT, APPLY_UNIT):
            _wait("generation 1 applied", lambda: root_generation(host) == 1, host)
        first = host.read_file(f"{SPOOL}/desired-state.json")
        generation = publish(server, node_id, document={"engines": [engine.spec()]})
        site = Site(
            host, node_id, engine, site_parts.docker, server=server, first_envelope=first, generation=generation
        )
        with host.logs_on_failure(AGENT_UNIT, APPLY_UNIT):
            _wait(f"generation {generation} applied", lambda: site.root_generation() == generation, host)
            # The playbook records before root answers: wait for the answer too, or a test reads the last one.
            _wait(f"the answer to generation {generation}", lambda: _answered(site, generation), host)
            _wait(f"engine {engine.name} serving", site.serving, host)
        yield site


def _answered(site: Site, generation: int) -> bool:
    answer = site.answer()
    return answer is not None and answer["generation"] == generation


def _settled(site: Site) -> bool:
    """The agent recorded the applied generation itself (status.json may be older) and has no apply pending."""
    record = site.host.exec(["cat", f"{AGENT_DIR}/applied.json"], check=False)
    if record.returncode != 0 or json.loads(record.stdout)["generation"] != site.generation:
        return False
    oplog = site.oplog()
    return bool(oplog) and oplog[-1]["result"] != "started"


def test_the_whole_loop_runs_under_systemd_with_root_keeping_its_own_record(site: Site) -> None:
    host = site.host
    assert site.root_record()["generation"] == site.generation
    answer = site.answer()
    assert answer is not None and answer["status"] == "successful" and answer["generation"] == site.generation
    # The apply unit re-verified and ran it: one line per answered request in its journal.
    assert f"generation {site.generation} successful" in host.journal(APPLY_UNIT)
    # The agent's own copy and its status say the same, learnt from the answer.
    _wait(
        "the agent's status showing the generation",
        lambda: json.loads(host.read_file(f"{AGENT_DIR}/status.json"))["applied_generation"] == site.generation,
        host,
    )
    # Root wrote nothing in the agent's directory; the agent can list nothing of root's.
    assert host.exec(["find", AGENT_DIR, "-user", "root"]).stdout == ""
    assert site.as_meridian(f"ls {ROOT_DIR}", check=False).returncode != 0
    assert site.container()[1] == "running"

    scores = {unit: host.unit_security_score(unit) for unit in (AGENT_UNIT, APPLY_UNIT)}
    print(f"systemd-analyze security: {AGENT_UNIT} {scores[AGENT_UNIT]}, {APPLY_UNIT} {scores[APPLY_UNIT]}")
    assert scores[APPLY_UNIT] <= APPLY_UNIT_MAX_EXPOSURE


@pytest.fixture
def agent_stopped(site: Site) -> Iterator[Site]:
    """The attacker holds the agent's account: the agent process is theirs to stop, and the files its."""
    site.host.exec(["systemctl", "stop", AGENT_UNIT])
    before = site.container()
    yield site
    # Whatever the attack, the approved engine kept serving, in the same container.
    assert site.container() == before
    assert site.serving()
    assert site.root_record()["generation"] >= site.generation
    # Each test stops and starts the agent: reset its start counter too, or systemd's StartLimitBurst refuses
    # the start once several tests ran within its interval.
    site.host.exec(["systemctl", "reset-failed", APPLY_UNIT, APPLY_PATH_UNIT, AGENT_UNIT], check=False)
    site.host.exec(["systemctl", "start", APPLY_PATH_UNIT, AGENT_UNIT])


def test_rewriting_the_agents_record_does_not_replay_an_older_generation(agent_stopped: Site) -> None:
    site = agent_stopped
    zeros = '{"format": 1, "generation": 0, "epoch": 0, "payload_sha256": null}'
    site.as_meridian(f"printf '%s' '{zeros}' > {AGENT_DIR}/applied.json; : > {AGENT_DIR}/oplog.jsonl")
    ident = site.spool_as_meridian(1, site.first_envelope)

    answer = site.await_answer(ident)

    assert answer["status"] == "failed" and "(replayed)" in answer["failures"][0]
    assert f"request {ident}: generation 1 failed" in site.host.journal(APPLY_UNIT)
    assert site.root_record()["generation"] == site.generation


def test_a_validly_signed_state_under_a_lower_epoch_is_refused_as_a_fenced_leaders(agent_stopped: Site) -> None:
    site = agent_stopped
    record = site.root_record()
    assert record["epoch"] >= 1
    generation = record["generation"] + 1
    ident = site.spool_as_meridian(generation, site.sign(generation=generation, lease_epoch=record["epoch"] - 1))

    answer = site.await_answer(ident)

    assert answer["status"] == "failed" and "(stale-epoch)" in answer["failures"][0]
    assert site.root_record() == record


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (f"ln -sf /etc/shadow {SPOOL}/.x && mv -fT {SPOOL}/.x {REQUEST}", "it is a symlink"),
        (f"rm -f {SPOOL}/.x && mkfifo {SPOOL}/.x && mv -fT {SPOOL}/.x {REQUEST}", "it is a FIFO"),
        (f"echo '{{}}' > {SPOOL}/.x && ln -f {SPOOL}/.x {REQUEST}", "it has 2 hard links"),
        (f"mv {SPOOL} {AGENT_DIR}/spool.old && ln -s {ROOT_DIR}/public {SPOOL}", "it is a symlink"),
    ],
    ids=["symlink-to-shadow", "fifo", "hard-link", "spool-symlinked-into-roots-directory"],
)
def test_a_request_that_is_not_a_plain_file_of_the_agents_is_refused(
    agent_stopped: Site, plant: str, reason: str
) -> None:
    site = agent_stopped
    shadow = site.host.exec(["sha256sum", "/etc/shadow"]).stdout
    answer_before = site.answer()
    site.host.exec(["systemctl", "reset-failed", APPLY_UNIT], check=False)
    try:
        site.as_meridian(plant)
        # The path unit fires on the rename, possibly half-way through a two-step plant, and a start while that
        # run is active only joins it. So start it twice: the second run begins after the plant is whole.
        for _run in range(2):
            site.host.exec(["systemctl", "start", APPLY_UNIT], check=False, timeout=60)
        journal = site.host.journal(APPLY_UNIT)
        assert f"refusing {REQUEST if 'spool.old' not in plant else SPOOL}: {reason}" in journal, journal[-3000:]
        assert site.answer() == answer_before  # no request was read, so nothing was answered
        assert site.host.exec(["sha256sum", "/etc/shadow"]).stdout == shadow
    finally:
        site.as_meridian(
            f"if [ -L {SPOOL} ]; then rm {SPOOL} && mv {AGENT_DIR}/spool.old {SPOOL}; fi; rm -f {REQUEST} {SPOOL}/.x"
        )


def test_swapping_everything_in_the_agents_directory_while_root_applies_changes_nothing_root_chose(
    agent_stopped: Site,
) -> None:
    site = agent_stopped
    host = site.host
    host.exec(["touch", "/run/boundary-marker"])
    record = site.root_record()
    envelope = host.read_file(f"{SPOOL}/desired-state.json")
    ident = site.spool_as_meridian(record["generation"], envelope)  # the same state again: drift repair
    # While root runs it, the agent's user renames and re-points everything it owns, as fast as it can.
    chaos = f"""
        end=$(( $(date +%s) + 12 ))
        while [ $(date +%s) -lt $end ]; do
            mv -f {SPOOL} {AGENT_DIR}/spool.x 2>/dev/null || true
            ln -sfn /etc {SPOOL} 2>/dev/null || true
            rm -f {SPOOL} 2>/dev/null || true
            mv -f {AGENT_DIR}/spool.x {SPOOL} 2>/dev/null || true
            for name in runs journal tmp .ansible engines.json draining public; do
                ln -sfn /etc {AGENT_DIR}/$name 2>/dev/null || true
            done
            ln -sf /etc/shadow {SPOOL}/.r 2>/dev/null && mv -fT {SPOOL}/.r {SPOOL}/desired-state.json \
                2>/dev/null || true
            printf '{{"format":1,"generation":0,"epoch":0,"payload_sha256":null}}' > {AGENT_DIR}/applied.json || true
        done
        for name in runs journal tmp .ansible engines.json draining public; do rm -f {AGENT_DIR}/$name; done
        rm -f {SPOOL}/.r; [ -d {SPOOL} ] || mv -f {AGENT_DIR}/spool.x {SPOOL} 2>/dev/null || true
    """
    site.as_meridian(chaos)

    answer = site.await_answer(ident)
    assert answer["status"] == "successful", answer  # root read the request once, then used only its own files
    assert site.root_record() == record
    journal = sorted(host.exec(["ls", f"{ROOT_DIR}/journal"]).stdout.split())
    assert ident in journal
    # Nothing outside root's own directories was written by root meanwhile.
    changed = host.exec(
        ["find", "/etc", "/opt", "/usr", "-newer", "/run/boundary-marker", "-not", "-type", "d"]
    ).stdout.split()
    assert changed == []
    assert host.exec(["find", AGENT_DIR, "-user", "root"]).stdout == ""


def test_the_agents_user_cannot_touch_roots_record_journal_or_the_artifact_store(site: Site) -> None:
    scripts = [
        f"touch {ROOT_DIR}/applied.json",
        f"touch {ROOT_DIR}/public/apply-result.json",
        f"mkdir {ROOT_DIR}/journal/x",
        f"ls {ROOT_DIR}/journal",
        f"mv {ROOT_DIR}/draining {ROOT_DIR}/d",
        "touch /var/lib/meridian-node-artifacts/blob",
        f"ln -sfn /etc {ROOT_DIR}/public/engines.json",
    ]
    refused_as_meridian(site.host, scripts, reasons=["Permission denied", "No such file"])
    assert site.host.exec(["stat", "-c", "%U %a", ROOT_DIR]).stdout.split() == ["root", "711"]
    assert site.host.exec(["stat", "-c", "%U %a", "/var/lib/meridian-node-artifacts"]).stdout.split()[0] == "root"


def test_an_engine_stopped_behind_the_agents_back_is_repaired_through_the_root_unit(site: Site) -> None:
    # Under the split the agent has no Docker: it sees the engine lose readiness through its own probes, and
    # asks root to reconcile the same generation again.
    host = site.host
    # After the attacks above the agent re-applied the state it had been made to forget: let it settle first,
    # so that what brings the engine back below can only be supervision.
    _wait("the agent's own record back at the applied generation, nothing in flight", lambda: _settled(site), host)
    _wait("the engine serving", site.serving, host)
    before = site.container()
    site.docker.containers.get(site.engine).stop(timeout=5)

    _wait("the engine serving again", site.serving, host, timeout=120)

    assert site.container() == (before[0], "running")  # the same container, started again
    assert site.root_record()["generation"] == site.generation
    drift = [e for e in site.oplog() if e.get("reason", "").startswith("drift:")]
    assert drift and drift[-1]["generation"] == site.generation
    assert f"{site.engine}: lost readiness" in drift[-1]["reason"]

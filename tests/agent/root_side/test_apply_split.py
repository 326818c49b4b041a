"""The privilege split: the agent spools an apply request, the root unit answers it.

systemd is not PID 1 here, so ``_PathUnit`` plays ``meridian-node-apply.path`` + ``.service``: each time
the request file changes it runs the real ``meridian-node apply-spooled`` verb in a subprocess, one at a
time, as a oneshot would. Everything else is real: signed envelopes, ansible-runner, the playbook.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import STATE_FILE
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.tests.devserver.devserver_process import running
from ansible_collections.meridian.node.tests.support.node_env import make_node, publish
from ansible_collections.meridian.node.tests.support.path_unit import PathUnit, apply_spooled, write_split_config
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    encode,
    local_artifact,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.agent_side.cycle import SPOOL_FILE, Agent, CycleStatus
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.systemd_applier import SystemdApplier, write_request
from meridian_node_agent.apply.applier import Applier, ApplyResult, run_ident
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.boundary.spool import PUBLIC_DIR, REQUEST_FILE, SPOOL_DIR, ApplyAnswer, read_answer_file
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.cli.agent import build_applier
from meridian_node_agent.config import AgentConfig, load_config
from meridian_node_agent.root_side.apply_unit import write_answer
from meridian_node_agent.root_side.root_dir import RootDir, prepare_root_dir

CONTROL = make_key()


def _spool(config: AgentConfig, ident: str, payload: dict[str, Any]) -> None:
    """Spool ``payload``, signed by CONTROL, under the request ``ident`` in the agent's spool, as the agent would."""
    write_request(Path(config.state_dir) / SPOOL_DIR, ident, signed("desired-state", payload, [CONTROL]))


def _successful_answer(
    config: AgentConfig, ident: str, generation: int, payload_sha256: str, started_at: datetime
) -> ApplyAnswer:
    """Root's answer that request ``ident`` ran ``generation`` successfully, from ``started_at`` for a second."""
    return ApplyAnswer(
        request=ident,
        payload_sha256=payload_sha256,
        generation=generation,
        status="successful",
        rc=0,
        changed=1,
        failed=0,
        failures=[],
        journal=str(Path(config.state_dir) / "journal" / ident),
        started_at=format_rfc3339(started_at),
        finished_at=format_rfc3339(started_at + timedelta(seconds=1)),
        wall_seconds=1.0,
    )


def _sha(payload: dict[str, Any]) -> str:
    return hashlib.sha256(encode(payload)).hexdigest()


def _node(root: Path, *, via: str = "systemd", timeout: float = 300.0) -> tuple[Path, AgentConfig]:
    """A root-owned config (as the apply unit reads it) and the policy it names, under ``root``."""
    store = {"path": str(root / "store"), "max_bytes": "1G"}
    policy = write_policy(root / "etc", control=[CONTROL], extra={"store": store})
    apply = {"via": via, "timeout_seconds": timeout, "state_dir": str(root / "apply")}
    path = write_split_config(
        root / "config.yaml", node_id=NODE_ID, policy=policy, state_dir=root / "state", apply=apply
    )
    return path, load_config(path)


def _oplog(state_dir: Path) -> list[tuple[str, int, int, str, str]]:
    return [(e.op, e.generation, e.epoch, e.payload_sha256, e.result) for e in OpLog(state_dir / "oplog.jsonl").read()]


def _answer(config: AgentConfig) -> ApplyAnswer | None:
    return read_answer_file(Path(config.apply.state_dir) / PUBLIC_DIR)


def _root(config: AgentConfig) -> RootDir:
    return prepare_root_dir(Path(config.apply.state_dir), agent_dir=Path(config.state_dir))


def _journal_names(result: ApplyResult) -> list[str]:
    return sorted(path.name for path in result.journal.iterdir())


@pytest.fixture
def split(tmp_path: Path) -> Iterator[tuple[Path, AgentConfig, PathUnit]]:
    config_path, config = _node(tmp_path / "split")
    with PathUnit(config_path, Path(config.state_dir)) as unit:
        yield config_path, config, unit


def test_state_applied_through_the_split_leaves_the_same_records_as_in_process(tmp_path: Path) -> None:
    config_path, config = _node(tmp_path / "split")
    payload = current_state(1)
    envelope = signed("desired-state", payload, [CONTROL])
    local_config = _node(tmp_path / "local", via="in-process")[1]
    local_applier = build_applier(local_config)
    split_applier = build_applier(config)
    assert isinstance(local_applier, Applier) and isinstance(split_applier, SystemdApplier)

    local = local_applier.apply(envelope, generation=1, epoch=1, payload_sha256=_sha(payload))
    with PathUnit(config_path, Path(config.state_dir)) as unit:
        remote = split_applier.apply(envelope, generation=1, epoch=1, payload_sha256=_sha(payload))

    assert remote.status == local.status == "successful", (remote.failures, [r.stderr for r in unit.runs])
    assert (remote.changed, remote.failed) == (local.changed, local.failed) == (1, 0)
    local_dir, split_dir, root_dir = Path(local_config.state_dir), Path(config.state_dir), Path(config.apply.state_dir)
    # Root's record is the one the playbook wrote; the agent's own copy is not written by the applier.
    assert (root_dir / STATE_FILE).read_bytes() == (local_dir / STATE_FILE).read_bytes()
    assert not (split_dir / STATE_FILE).exists()
    # Each side keeps its own oplog of the same operation, under the agent's ident.
    assert (
        _oplog(split_dir)
        == _oplog(root_dir)
        == _oplog(local_dir)
        == [
            ("apply", 1, 1, _sha(payload), "started"),
            ("apply", 1, 1, _sha(payload), "successful"),
        ]
    )
    assert [e.run_ident for e in OpLog(split_dir / "oplog.jsonl").read()] == [remote.ident] * 2
    assert [e.run_ident for e in OpLog(root_dir / "oplog.jsonl").read()] == [remote.ident] * 2
    # The journal is ansible-runner's artifacts under the agent's ident, in root's directory.
    assert remote.journal == root_dir / "journal" / remote.ident
    assert _journal_names(remote) == _journal_names(local)
    assert (remote.journal / "status").read_text() == "successful"
    assert list((root_dir / "runs").iterdir()) == []
    assert not (split_dir / "journal").exists() and not (split_dir / "runs").exists()
    answer = _answer(config)
    assert answer is not None and answer.request == remote.ident
    assert [run.returncode for run in unit.runs] == [0]


def test_agent_loop_applies_a_published_state_through_the_split(tmp_path: Path) -> None:
    # The whole cycle against the real devserver, with the agent wired by build_agent from its config.
    with running(tmp_path / "data") as server:
        node = make_node(server, tmp_path / "node", "split-node-1")
        node.configure(apply={"via": "systemd", "timeout_seconds": 300, "state_dir": str(tmp_path / "node-apply")})
        generation = publish(server, node.node_id)
        agent = node.agent()
        assert isinstance(agent.applier, SystemdApplier)
        with PathUnit(node.config_path, node.state_dir) as unit:
            first = agent.cycle()
            again = agent.cycle()

    assert first.outcome == CycleStatus.APPLIED, (first, [r.stdout + r.stderr for r in unit.runs])
    assert again.outcome == CycleStatus.UNCHANGED
    assert first.run is not None
    assert sorted(p.name for p in (Path(node.config.apply.state_dir) / "journal").iterdir()) == [first.run.ident]
    # Root's record decides; the agent recorded its own copy from the answer.
    assert json.loads((Path(node.config.apply.state_dir) / STATE_FILE).read_text())["generation"] == generation
    assert json.loads(node.applied_file().read_text())["generation"] == generation
    assert [(e.run_ident, e.result) for e in OpLog(node.state_dir / "oplog.jsonl").read()] == [
        (first.run.ident, "started"),
        (first.run.ident, "successful"),
    ]
    assert len(unit.runs) == 1  # the unchanged cycle spooled nothing, so root ran nothing


def test_a_request_swapped_after_the_agent_wrote_it_is_not_reported_as_the_agents_apply(tmp_path: Path) -> None:
    # Something with write access to the spool replaces the envelope with another validly signed state
    # of the same generation. Root verifies and runs what it read; the agent must not record its own
    # state as applied.
    config_path, config = _node(tmp_path / "node")
    ours, theirs = current_state(8), {**current_state(8), "engines": [], "artifacts": [], "lease_epoch": 2}

    def swap(spool: Path) -> None:
        request = json.loads((spool / REQUEST_FILE).read_text())
        write_request(spool, request["request"], signed("desired-state", theirs, [CONTROL]))

    with PathUnit(config_path, Path(config.state_dir), before=swap):
        result = build_applier(config).apply(
            signed("desired-state", ours, [CONTROL]), generation=8, epoch=1, payload_sha256=_sha(ours)
        )

    assert result.status == "failed"
    assert f"not the {_sha(ours)} the agent spooled" in result.failures[0]
    assert [(e.run_ident, e.result) for e in OpLog(Path(config.state_dir) / "oplog.jsonl").read()] == [
        (result.ident, "started"),
        (result.ident, "failed"),
    ]


def test_root_side_refuses_a_tampered_spooled_envelope_and_applies_nothing(tmp_path: Path) -> None:
    config_path, config = _node(tmp_path / "node")
    document = json.loads(signed("desired-state", current_state(2), [CONTROL]))
    body = bytearray(base64.b64decode(document["payload"]))
    body[body.index(b'"generation": 2') + len('"generation": ')] = ord("7")  # one byte: generation 2 -> 7
    document["payload"] = base64.b64encode(bytes(body)).decode()
    state_dir = Path(config.state_dir)
    write_request(state_dir / SPOOL_DIR, "gen-7-20261129T120000.000000Z", json.dumps(document).encode())

    run = apply_spooled(config_path)

    assert run.returncode == 1, run.stdout + run.stderr
    answer = _answer(config)
    assert answer is not None and answer.status == "failed"
    assert "threshold-not-met" in answer.failures[0] and "nothing was applied" in answer.failures[0]
    assert "threshold-not-met" in run.stdout
    root_dir = Path(config.apply.state_dir)
    assert not (root_dir / STATE_FILE).exists()
    assert list((root_dir / "journal").iterdir()) == [] and list((root_dir / "runs").iterdir()) == []


def test_root_side_refuses_a_request_whose_ident_claims_another_generation(tmp_path: Path) -> None:
    # A validly signed generation 3, spooled under an ident for generation 9: the journal and the agent's
    # oplog would disagree about what ran, so root does not run it.
    config_path, config = _node(tmp_path / "node")
    _spool(config, "gen-9-20261129T120000.000000Z", current_state(3))

    run = apply_spooled(config_path)

    assert run.returncode == 1
    answer = _answer(config)
    assert answer is not None and "another generation" in answer.failures[0]
    assert not (Path(config.apply.state_dir) / STATE_FILE).exists()


def test_root_side_runs_the_artifact_step_for_a_state_with_an_artifact_from_its_own_verification(
    tmp_path: Path,
) -> None:
    # The request carries only the envelope: whether the state lists artifacts (and so whether the playbook's
    # artifact step runs) is root's own reading of it, not the agent's.
    config_path, config = _node(tmp_path / "node")
    artifact_key = make_key()
    models = tmp_path / "models"
    store = {"path": str(tmp_path / "node" / "store"), "max_bytes": "1G", "local_sources": [str(models)]}
    write_policy(tmp_path / "node" / "etc", control=[CONTROL], artifact=[artifact_key], extra={"store": store})
    weights = b"root-side weights\n" * 32
    artifact = local_artifact(models / "tiny-model", weights, artifact_key)
    payload = {**current_state(4), "artifacts": [artifact]}
    _spool(config, "gen-4-20261129T120000.000000Z", payload)

    run = apply_spooled(config_path)

    assert run.returncode == 0, run.stdout + run.stderr
    answer = _answer(config)
    assert answer is not None and answer.status == "successful", answer
    assert (tmp_path / "node" / "store" / "artifacts" / "tiny-model" / "1.0.0" / "weights.bin").read_bytes() == weights
    assert json.loads((Path(config.apply.state_dir) / STATE_FILE).read_text())["generation"] == 4


def test_a_request_whose_trigger_systemd_lost_is_spooled_again_and_root_applies_it_once(tmp_path: Path) -> None:
    # PathChanged= drops a change made while the apply service is still active (a request written just after
    # root's last read of the spool): here the first trigger is lost outright. Without the agent writing the
    # request again, root never runs it and the agent waits its whole apply.timeout_seconds.
    config_path, config = _node(tmp_path / "split", timeout=120.0)
    payload = current_state(1)
    envelope = signed("desired-state", payload, [CONTROL])
    applier = SystemdApplier(
        state_dir=Path(config.state_dir), apply_state_dir=Path(config.apply.state_dir), timeout_s=120.0, respool_s=0.5
    )

    with PathUnit(config_path, Path(config.state_dir), lose=1) as unit:
        result = applier.apply(envelope, generation=1, epoch=1, payload_sha256=_sha(payload))

    assert result.status == "successful", (result.failures, [run.stderr for run in unit.runs])
    # Written again while root ran it, the request was still applied once: root answers each request once.
    assert _oplog(Path(config.apply.state_dir)) == [
        ("apply", 1, 1, _sha(payload), "started"),
        ("apply", 1, 1, _sha(payload), "successful"),
    ]
    assert unit.runs and all(run.returncode == 0 for run in unit.runs)


def test_an_answer_to_another_request_is_not_taken_as_ours_and_a_silent_root_side_times_out(tmp_path: Path) -> None:
    config = _node(tmp_path / "node", timeout=1.5)[1]
    state_dir = Path(config.state_dir)
    payload = current_state(4)
    stale = _successful_answer(
        config, "gen-4-20200101T000000.000000Z", 4, _sha(payload), datetime(2020, 1, 1, tzinfo=UTC)
    )
    write_answer(_root(config), stale)
    applier = build_applier(config)  # no root side is listening
    envelope = signed("desired-state", payload, [CONTROL])

    result = applier.apply(envelope, generation=4, epoch=1, payload_sha256=_sha(payload))

    assert result.status == "timeout" and not result.ok
    assert result.ident != stale.request
    assert f"did not answer request {result.ident} within 1.5 s" in result.failures[0]
    assert "apply.timeout_seconds" in result.failures[0] and "meridian-node-apply" in result.failures[0]
    pending = OpLog(state_dir / "oplog.jsonl").pending()
    assert pending is not None and pending.run_ident == result.ident  # unfinished: start-up applies it again
    assert not (state_dir / STATE_FILE).exists()


def test_an_apply_the_root_side_never_answered_is_applied_again_at_start_up(
    split: tuple[Path, AgentConfig, PathUnit],
) -> None:
    _config_path, config, unit = split
    state_dir = Path(config.state_dir)
    payload = current_state(5)
    envelope = signed("desired-state", payload, [CONTROL])
    # What a timed-out apply leaves: the spooled envelope and a 'started' line without a result.
    (state_dir / SPOOL_FILE).write_bytes(envelope)
    OpLog(state_dir / "oplog.jsonl").append(
        op="apply", generation=5, epoch=1, payload_sha256=_sha(payload), run_ident="gen-5-lost", result="started"
    )
    observer = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False})
    agent = Agent(config, load_policy(config.policy), client=None, applier=build_applier(config), observer=observer)  # type: ignore[arg-type]

    result = agent.recover()

    assert result is not None and result.ok, (result, [r.stderr for r in unit.runs])
    assert _oplog_with_idents(state_dir) == [
        ("gen-5-lost", "started"),
        ("gen-5-lost", "interrupted"),
        (result.ident, "started"),
        (result.ident, "successful"),
    ]
    assert OpLog(state_dir / "oplog.jsonl").pending() is None
    assert json.loads((Path(config.apply.state_dir) / STATE_FILE).read_text())["generation"] == 5
    assert json.loads((state_dir / STATE_FILE).read_text())["generation"] == 5


# Root's apply unit whose playbook never ends (a drain that waits, a wedged Docker call): the real verb, with
# ansible-runner's run replaced by a hang that says it started. argv: config path, marker file.
_HANGING_ROOT = """
import sys, time
import ansible_runner
def hang(**options):
    open(sys.argv[2], "w").write("running")
    time.sleep(3600)
ansible_runner.run = hang
from meridian_node_agent.cli import main
sys.exit(main(["--config", sys.argv[1], "apply-spooled"]))
"""


def test_an_apply_killed_mid_run_leaves_its_generation_accepted_the_older_one_refused_and_itself_applicable(
    tmp_path: Path,
) -> None:
    config_path, config = _node(tmp_path / "node")
    state_dir, root_dir = Path(config.state_dir), Path(config.apply.state_dir)
    first, second = current_state(1), current_state(2)
    old, new = signed("desired-state", first, [CONTROL]), signed("desired-state", second, [CONTROL])

    def spool(generation: int, envelope: bytes) -> None:
        write_request(state_dir / SPOOL_DIR, run_ident(generation, datetime.now(UTC)), envelope)

    spool(1, old)
    assert apply_spooled(config_path).returncode == 0
    assert json.loads((root_dir / STATE_FILE).read_text())["generation"] == 1

    spool(2, new)
    marker = tmp_path / "applying"
    unit = subprocess.Popen(
        [sys.executable, "-c", _HANGING_ROOT, str(config_path), str(marker)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert unit.poll() is None, "the root unit ended before it applied generation 2"
            if time.monotonic() > deadline:  # a liveness bound, not a timing assertion
                pytest.fail("the root unit never started applying generation 2")
            time.sleep(0.05)
    finally:
        os.killpg(unit.pid, signal.SIGKILL)  # what systemd does at the unit's timeout, or an OOM kill
        unit.wait()
    assert json.loads((root_dir / STATE_FILE).read_text())["generation"] == 1  # 2 never recorded applied

    # The agent spools generation 1 again, the bytes root applied last: it is below the one root accepted.
    spool(1, old)
    refused = apply_spooled(config_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    answer = _answer(config)
    assert answer is not None and answer.status == "failed"
    assert "replayed" in answer.failures[0] and "generation 2, which this host accepted" in answer.failures[0]
    record = json.loads((root_dir / STATE_FILE).read_text())
    assert (record["generation"], record["accepted"]["generation"]) == (1, 2)

    # Generation 2's own bytes may run again: the retry.
    spool(2, new)
    again = apply_spooled(config_path)
    assert again.returncode == 0, again.stdout + again.stderr
    record = json.loads((root_dir / STATE_FILE).read_text())
    assert (record["generation"], record["payload_sha256"], record["accepted"]) == (2, _sha(second), None)


def _oplog_with_idents(state_dir: Path) -> list[tuple[str, str]]:
    return [(e.run_ident, e.result) for e in OpLog(state_dir / "oplog.jsonl").read()]


def test_a_late_answer_to_a_timed_out_request_finishes_its_oplog_entry(tmp_path: Path) -> None:
    config = _node(tmp_path / "node")[1]
    state_dir = Path(config.state_dir)
    ident = "gen-6-20261129T120000.000000Z"
    OpLog(state_dir / "oplog.jsonl").append(
        op="apply", generation=6, epoch=1, payload_sha256="b" * 64, run_ident=ident, result="started"
    )
    applier = build_applier(config)
    assert applier.record_late_answer() is None  # nothing answered yet: still unfinished
    late = _successful_answer(config, ident, 6, "b" * 64, datetime(2026, 11, 29, 12, tzinfo=UTC))
    write_answer(_root(config), late)

    recorded = applier.record_late_answer()

    assert recorded is not None and (recorded.run_ident, recorded.result) == (ident, "successful")
    assert OpLog(state_dir / "oplog.jsonl").pending() is None


def test_root_side_refuses_when_its_own_config_says_observe_only(tmp_path: Path) -> None:
    # A compromised agent can write a request; whether root acts on it is the root-owned config's call.
    config_path, config = _node(tmp_path / "node")
    document = yaml.safe_load(config_path.read_text())
    document["mode"] = "observe-only"
    config_path.write_text(yaml.safe_dump(document))
    _spool(config, "gen-1-20261129T120000.000000Z", current_state(1))

    run = apply_spooled(config_path)

    assert run.returncode == 1
    answer = _answer(config)
    assert answer is not None and "observe-only" in answer.failures[0]
    root_dir = Path(config.apply.state_dir)
    assert not (root_dir / STATE_FILE).exists() and list((root_dir / "journal").iterdir()) == []


def test_root_side_does_nothing_at_all_when_its_config_says_the_agent_applies_in_process(tmp_path: Path) -> None:
    config_path, config = _node(tmp_path / "node", via="in-process")
    _spool(config, "gen-1-20261129T120000.000000Z", current_state(1))

    run = apply_spooled(config_path)

    assert run.returncode == 1
    assert "apply.via: in-process; the apply unit only serves apply.via: systemd" in run.stderr
    assert not Path(config.apply.state_dir).exists()  # no answer, no record, no directory of root's


def test_check_config_explains_a_bad_apply_setting_and_describes_a_good_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path, config = _node(tmp_path / "node")
    assert cli_main(["--config", str(config_path), "check-config"]) == 0
    described = capsys.readouterr().out
    assert f"apply: via systemd (the agent writes {Path(config.state_dir) / SPOOL_DIR / REQUEST_FILE}" in described
    document = yaml.safe_load(config_path.read_text())
    document["apply"] = {"via": "sudo", "timeout_seconds": 0}
    config_path.write_text(yaml.safe_dump(document))

    status = cli_main(["--config", str(config_path), "check-config"])

    error = capsys.readouterr().err
    assert status == 1
    assert "apply.via: input should be 'in-process' or 'systemd' (got 'sudo')" in error
    assert "apply.timeout_seconds: must be > 0" in error

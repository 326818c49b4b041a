"""``run`` in mode air-gapped: check-config's path checks, the refusals before anything starts, and the pass
that turns bundles into journal summaries and observations in the outbox (real applies of reconcile.yml)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.airgap_env import AirGapNode, make_airgap_node, state_bundle
from meridian_node_agent.agent_side.airgap_agent import OBSERVATION_REFRESH_S, AirGapAgent, node_signing_key
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.boundary.outbox import Outbox, verify_outbox_record
from meridian_node_agent.cli import main as cli_main

CRASHED = "gen-1-20261201T120000.000000Z"


def _agent(node: AirGapNode, monotonic: Callable[[], float] = time.monotonic) -> AirGapAgent:
    config = node.config
    outbox = Outbox(node.outbox, node.state_dir, node.node_id, node_signing_key(config))
    return AirGapAgent(config, node.policy, Observer(store_path=None), outbox, monotonic=monotonic)


def test_check_config_accepts_an_air_gapped_node_and_names_its_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(tmp_path)

    assert cli_main(["--config", str(node.config_path), "check-config"]) == 0

    out = capsys.readouterr().out
    assert f"bundles from {node.inbox}" in out and f"records to {node.outbox}" in out
    assert f"scratch {tmp_path / 'scratch'}" in out


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("inbox missing", "air_gap.inbox {inbox} does not exist"),
        ("inbox writable by everyone", "air_gap.inbox {inbox} is writable by everyone"),
        ("inbox a symlink", "air_gap.inbox {inbox} is a symbolic link"),
        ("scratch writable by group", "policy air_gap.scratch_dir {scratch} is writable by group or others"),
    ],
)
def test_check_config_and_run_refuse_unsafe_air_gap_paths(
    tmp_path: Path, fault: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(tmp_path)
    scratch = tmp_path / "scratch"
    if fault == "inbox missing":
        node.inbox.rmdir()
    elif fault == "inbox writable by everyone":
        node.inbox.chmod(0o777)
    elif fault == "inbox a symlink":
        node.inbox.rename(tmp_path / "real-inbox")
        node.inbox.symlink_to(tmp_path / "real-inbox")
    else:
        scratch.mkdir(mode=0o700)
        scratch.chmod(0o770)
    message = expected.format(inbox=node.inbox, scratch=scratch)

    assert cli_main(["--config", str(node.config_path), "check-config"]) == 1
    assert message in capsys.readouterr().err
    assert cli_main(["--config", str(node.config_path), "run", "--once"]) == 2
    assert message in capsys.readouterr().err
    assert not node.state_dir.exists()  # refused before anything was created


def test_a_pass_writes_the_journal_and_an_observation_and_an_idle_pass_writes_nothing(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    agent = _agent(node)
    shutil.copyfile(state_bundle(node, "g1.tar", generation=1), node.inbox / "g1.tar")

    first = agent.run_pass()
    idle = agent.run_pass()

    assert [p.name for p in first.written] == [
        f"{node.node_id}-000000000001-journal.json",
        f"{node.node_id}-000000000002-observation.json",
    ]
    assert first.ok and idle.ok and idle.written == [] and idle.bundles == []
    key = node_signing_key(node.config).public_key()
    journal, observation = (verify_outbox_record(p.name, p.read_bytes(), {node.node_id: key}) for p in first.written)
    assert journal.journal is not None and (journal.journal.generation, journal.journal.status) == (1, "successful")
    assert observation.observation is not None and observation.observation.applied_generation == 1
    assert observation.observation.last_run is not None
    assert observation.observation.last_run.ident == journal.journal.ident
    assert sorted(os.listdir(node.outbox)) == [p.name for p in first.written]


def test_a_bundle_whose_apply_was_interrupted_is_taken_again_at_start(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    shutil.copyfile(state_bundle(node, "g1.tar", generation=1), node.inbox / "g1.tar")
    oplog = OpLog(node.state_dir / "oplog.jsonl")
    node.state_dir.mkdir()
    # What a crash in the middle of the run leaves: a started operation, the bundle still in the inbox.
    oplog.append(op="apply", generation=1, epoch=1, payload_sha256="ab" * 32, run_ident=CRASHED, result="started")

    assert _agent(node).run(once=True) == 0

    assert oplog.pending() is None
    closed = [entry for entry in oplog.read() if entry.run_ident == CRASHED]
    assert [entry.result for entry in closed] == ["started", "interrupted"]
    assert node.filed("processed")["g1.tar"]["result"] == "applied"
    last = oplog.last()
    assert last is not None and last.result == "successful"


def test_an_unchanged_observation_is_written_again_only_after_the_refresh_interval(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    clock = [1000.0]
    agent = _agent(node, monotonic=lambda: clock[0])

    assert len(agent.run_pass().written) == 1
    clock[0] += OBSERVATION_REFRESH_S - 1
    assert agent.run_pass().written == []
    clock[0] += 1
    [again] = agent.run_pass().written

    assert again.name == f"{node.node_id}-000000000002-observation.json"

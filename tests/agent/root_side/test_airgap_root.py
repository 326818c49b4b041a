"""Root's inbox verb (``meridian-node airgap-inbox --once``) and the agent's side of it, under the split, as
root on this machine: the inbox checks, the agent's own files refused, root's record deciding, and the
outcomes file that crosses back parsed strictly by the agent. (The units themselves, under a real systemd:
tests/system/systemd_host/test_airgap_under_split.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.support.airgap_env import (
    AGENT_UID,
    AirGapNode,
    InPlaceWriter,
    grow_while_read,
    make_airgap_node,
    state_bundle,
)
from meridian_node_agent.agent_side.airgap_agent import AirGapAgent, node_signing_key
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.boundary.directories import BoundaryError, check_root_inbox
from meridian_node_agent.boundary.outbox import Outbox, verify_outbox_record
from meridian_node_agent.boundary.outcomes import OUTCOMES_FILE, read_outcomes
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.root_side.inbox_unit import take_bundles
from meridian_node_agent.root_side.root_dir import prepare_root_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's verb checks ownership: run as root (CI does)")


def _drop(node: AirGapNode, bundle: Path, name: str) -> Path:
    temporary = node.inbox / f".{name}.part"
    shutil.copyfile(bundle, temporary)
    return temporary.rename(node.inbox / name)


def _root(node: AirGapNode) -> int:
    return cli_main(["--config", str(node.config_path), "airgap-inbox", "--once"])


def _agent(node: AirGapNode) -> AirGapAgent:
    config = node.config
    outbox = Outbox(node.outbox, node.state_dir, node.node_id, node_signing_key(config))
    return AirGapAgent(config, node.policy, Observer(store_path=None), outbox)


def _public(node: AirGapNode) -> Path:
    return node.root / "apply" / "public"


def test_root_takes_the_bundle_with_its_own_record_and_the_agent_journals_the_outcome(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(tmp_path, split=True)
    assert cli_main(["--config", str(node.config_path), "check-config"]) == 0
    assert "taken by root's meridian-node-airgap" in capsys.readouterr().out
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")

    assert _root(node) == 0

    assert "bundle g1.tar: applied" in capsys.readouterr().out
    assert StateStore(tmp_path / "apply").load().generation == 1  # root's record, not the agent's
    assert StateStore(node.state_dir).load().generation == 0
    assert node.filed("processed")["g1.tar"]["result"] == "applied"
    document = read_outcomes(_public(node), node_id=node.node_id)
    assert document is not None and [(o.sequence, o.result) for o in document.outcomes] == [(1, "applied")]
    assert document.applied.generation == 1
    stat = (_public(node) / OUTCOMES_FILE).stat()
    assert (stat.st_gid, stat.st_mode & 0o777) == (AGENT_UID, 0o640)  # readable by the agent's group only

    agent = _agent(node)
    first, again = agent.run_pass(), agent.run_pass()

    assert [p.name.rsplit("-", 1)[1] for p in first.written] == ["journal.json", "observation.json"]
    key = node_signing_key(node.config).public_key()
    journal = verify_outbox_record(first.written[0].name, first.written[0].read_bytes(), {node.node_id: key})
    assert journal.journal is not None and journal.journal.ident == document.outcomes[0].run.ident  # type: ignore[union-attr]
    assert journal.journal.bundle_id is not None and journal.lease_epoch == document.applied.epoch
    assert again.written == [] and again.bundles == []  # each outcome journaled once
    status = json.loads((node.state_dir / "status.json").read_text())
    assert status["air_gap"]["last_bundle"]["result"] == "applied"
    assert status["air_gap"]["applied_generation"] == 1
    assert status["air_gap"]["outbox_sequence"] == 2

    # The same bundle again: root's record says applied; nothing runs, and the agent journals no run.
    _drop(node, node.bundles / "g1.tar", "g1-again.tar")
    assert _root(node) == 0
    assert node.filed("processed")["g1-again.tar"]["reason"] == "already-applied"
    assert _agent(node).run_pass().written[0].name.endswith("-observation.json")


@pytest.mark.parametrize("attack", ["owned-by-the-agent", "hard-link"])
def test_an_inbox_entry_the_agent_could_change_is_refused_however_well_signed(tmp_path: Path, attack: str) -> None:
    node = make_airgap_node(tmp_path, split=True)
    entry = _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    if attack == "owned-by-the-agent":
        os.chown(entry, AGENT_UID, AGENT_UID)
    else:
        os.link(entry, node.state_dir / "my-link.tar")  # what the agent would keep to rewrite the bytes

    assert _root(node) == 1

    reason = node.filed("rejected")["g1.tar"]
    assert reason["reason"] == "untrusted-entry"
    assert ("the agent's user" if attack == "owned-by-the-agent" else "2 hard links") in reason["message"]
    assert StateStore(tmp_path / "apply").load().generation == 0
    document = read_outcomes(_public(node), node_id=node.node_id)
    assert document is not None and document.outcomes[-1].reason == "untrusted-entry"


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("inside the agent's directory", "overlaps the agent's directory"),
        ("writable by the agent's group", "the agent's group"),
        ("writable by everyone", "lets every user write in it"),
        ("a symlink", "resolves to"),
        ("an ancestor writable by a group", "lets group"),
    ],
)
def test_root_refuses_an_inbox_the_agent_could_write_or_swap(tmp_path: Path, fault: str, expected: str) -> None:
    node = make_airgap_node(tmp_path, split=True)
    inbox = node.inbox
    if fault == "inside the agent's directory":
        inbox = node.state_dir / "inbox"
        inbox.mkdir(mode=0o700)
    elif fault == "writable by the agent's group":
        os.chown(inbox, 0, AGENT_UID)
        inbox.chmod(0o770)
    elif fault == "writable by everyone":
        inbox.chmod(0o777)
    elif fault == "a symlink":
        inbox.rename(tmp_path / "real-inbox")
        inbox.symlink_to(tmp_path / "real-inbox")
    else:
        parent = tmp_path / "shared"
        parent.mkdir(mode=0o775)
        parent.chmod(0o775)
        inbox = parent / "inbox"
        inbox.mkdir(mode=0o700)

    with pytest.raises(BoundaryError, match=expected):
        check_root_inbox(inbox, agent_dir=node.state_dir, agent_gid=AGENT_UID)


def test_check_config_under_the_split_checks_roots_inbox(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = make_airgap_node(tmp_path, split=True)
    os.chown(node.inbox, AGENT_UID, AGENT_UID)  # the agent's own inbox is what the split must not have

    assert cli_main(["--config", str(node.config_path), "check-config"]) == 1
    err = capsys.readouterr().err
    assert "air_gap.inbox (read by root's meridian-node-airgap.service)" in err and f"uid {AGENT_UID}" in err
    assert _root(node) == 1
    assert "no bundle was taken" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage",
    [
        ("unknown field", lambda d: {**d, "extra": 1}),
        ("another node", lambda d: {**d, "node_id": "someone-else"}),
        ("a sequence going back", lambda d: {**d, "outcomes": d["outcomes"] * 2}),
        ("a string for a number", lambda d: {**d, "applied": {"generation": "9", "epoch": 0}}),
    ],
    ids=lambda damage: damage[0],
)
def test_a_malformed_outcomes_file_is_refused_whole_and_nothing_is_journaled(tmp_path: Path, damage: tuple) -> None:  # type: ignore[type-arg]
    node = make_airgap_node(tmp_path, split=True)
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    assert _root(node) == 0
    path = _public(node) / OUTCOMES_FILE
    path.write_text(json.dumps(damage[1](json.loads(path.read_text()))))

    result = _agent(node).run_pass()

    assert not result.ok and result.bundles == []
    assert [p.name.rsplit("-", 1)[1] for p in result.written] == ["observation.json"]  # no journal record
    status = json.loads((node.state_dir / "status.json").read_text())
    assert status["applied_generation"] == 0  # nothing of the refused file was believed


def test_status_shows_the_inbox_the_last_bundle_and_the_outbox_sequence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(tmp_path, split=True)
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    _drop(
        node, state_bundle(make_airgap_node(tmp_path / "other", node_id="other-node"), "x.tar", generation=1), "x.tar"
    )
    assert _root(node) == 1  # x.tar is for another node
    _agent(node).run_pass()
    capsys.readouterr()

    assert cli_main(["--config", str(node.config_path), "status"]) == 0
    table = capsys.readouterr().out
    assert cli_main(["--config", str(node.config_path), "status", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)

    row = next(line for line in table.splitlines() if line.startswith("air gap"))
    assert f"inbox {node.inbox} taken by root" in row
    assert "last bundle x.tar rejected (wrong-node:" in row  # in name order: g1.tar, then x.tar
    assert "applied generation 1" in row and "at record 2" in row
    air_gap = document["agent"]["air_gap"]
    assert air_gap["last_bundle"]["name"] == "x.tar" and air_gap["last_bundle"]["reason"] == "wrong-node"
    assert (air_gap["applied_generation"], air_gap["outbox_sequence"]) == (1, 2)


def test_status_in_process_shows_what_the_agent_took_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = make_airgap_node(tmp_path)
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    _agent(node).run_pass()
    capsys.readouterr()

    assert cli_main(["--config", str(node.config_path), "status"]) == 0

    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("air gap"))
    assert "taken by the agent; last bundle g1.tar applied; applied generation 1" in row


def test_a_bundle_still_being_written_under_its_final_name_is_waited_for_within_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PathExistsGlob= would start the unit again at once after a run that left the file, to re-read it in a
    # tight loop while the copy goes on: instead the run waits on the inbox between passes and takes it then.
    node = make_airgap_node(tmp_path, split=True)
    data = state_bundle(node, "g1.tar", generation=1).read_bytes()
    writer = InPlaceWriter(node.inbox / "g1.tar", data, steps=8)
    writer.step()
    grow_while_read(monkeypatch, writer)
    waits: list[float] = []
    config = node.config
    root = prepare_root_dir(Path(config.apply.state_dir), agent_dir=node.state_dir)

    taken = take_bundles(config, root, node.policy, untrusted_uid=AGENT_UID, wait=waits.append)

    results = [(o.result.value, o.reason) for o in taken]
    assert len(results) >= 2 and results[-1] == ("applied", None), results
    assert set(results[:-1]) == {("left-in-inbox", "changed-while-read")}, results
    assert config.air_gap is not None
    assert waits == [config.air_gap.poll_seconds] * (len(results) - 1)  # one wait per pass that left it
    assert StateStore(tmp_path / "apply").load().generation == 1
    document = read_outcomes(_public(node), node_id=node.node_id)
    assert document is not None and [o.result for o in document.outcomes] == ["applied"]  # only what was filed

"""Attacks on the privilege boundary by whoever holds the agent's directory, against the real root verb.

Each test plays the compromised agent: it owns ``state_dir`` and writes there whatever it likes, then the
real ``meridian-node apply-spooled`` runs (in a subprocess, as the unit would). What must hold: root reads
only the request and only if it is a plain file the agent owns; root's own record decides replay and
fencing whatever the agent's files say; nothing is applied that root did not choose, and the refusal
names the reason. The same attacks run as the ``meridian`` user against live units in
``tests/system/systemd_host/``; these run everywhere, quickly.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import STATE_FILE, StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.tests.support.path_unit import apply_spooled, write_split_config
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    encode,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.agent_side.cycle import SPOOL_FILE, Agent
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.systemd_applier import write_request
from meridian_node_agent.apply.oplog import ABANDONED, OpLog
from meridian_node_agent.boundary.directories import BoundaryError
from meridian_node_agent.boundary.spool import (
    MAX_REQUEST_BYTES,
    PUBLIC_DIR,
    REQUEST_FILE,
    SPOOL_DIR,
    ApplyAnswer,
    SpoolError,
    read_answer_file,
)
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.config import ConfigError, load_config
from meridian_node_agent.root_side.root_dir import prepare_root_dir, read_request

CONTROL = make_key()
IDENT = "gen-{}-20261201T120000.000000Z"


class Node:
    """A split node under ``root``: the root-owned config and policy, the agent's dir, root's dir."""

    def __init__(self, root: Path) -> None:
        policy = write_policy(root / "etc", control=[CONTROL], extra={"store": {"path": str(root / "store")}})
        apply = {"via": "systemd", "timeout_seconds": 60, "state_dir": str(root / "apply")}
        self.config_path = write_split_config(
            root / "config.yaml", node_id=NODE_ID, policy=policy, state_dir=root / "agent", apply=apply
        )
        self.config = load_config(self.config_path)
        self.agent_dir = Path(self.config.state_dir)
        self.root_dir = Path(self.config.apply.state_dir)
        self.spool = self.agent_dir / SPOOL_DIR
        self.agent_dir.mkdir(mode=0o750)

    def spool_state(self, payload: dict[str, Any]) -> None:
        write_request(self.spool, IDENT.format(payload["generation"]), signed("desired-state", payload, [CONTROL]))

    def run_root(self) -> tuple[int, str, ApplyAnswer | None]:
        run = apply_spooled(self.config_path)
        return run.returncode, run.stdout + run.stderr, read_answer_file(self.root_dir / PUBLIC_DIR)

    def root_record(self) -> tuple[int, int, str | None]:
        applied = StateStore(self.root_dir).load()
        return applied.generation, applied.epoch, applied.payload_sha256

    def journal(self) -> list[str]:
        journal = self.root_dir / "journal"
        return sorted(p.name for p in journal.iterdir()) if journal.exists() else []


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def _sha(payload: dict[str, Any]) -> str:
    return hashlib.sha256(encode(payload)).hexdigest()


# Replay and fencing: root's own record decides.


def test_deleting_the_agents_applied_record_does_not_let_root_replay_an_older_generation(node: Node) -> None:
    newer, older = current_state(5), current_state(3)
    node.spool_state(newer)
    assert node.run_root()[0] == 0
    assert node.root_record() == (5, 1, _sha(newer))
    # The agent forgets (or rewrites) what it applied, and asks root for generation 3, validly signed.
    (node.agent_dir / STATE_FILE).unlink(missing_ok=True)
    (node.agent_dir / STATE_FILE).write_text(
        json.dumps({"format": 1, "generation": 0, "epoch": 0, "payload_sha256": None})
    )
    node.spool_state(older)

    status, output, answer = node.run_root()

    assert status == 1 and answer is not None and answer.request == IDENT.format(3)
    assert "(replayed)" in answer.failures[0] and "nothing was applied" in answer.failures[0]
    assert "replayed" in output
    assert node.root_record() == (5, 1, _sha(newer))
    assert node.journal() == [IDENT.format(5)]


def test_a_state_from_a_fenced_leader_is_refused_by_root_whatever_the_agent_recorded(node: Node) -> None:
    node.spool_state(current_state(5, lease_epoch=4))
    assert node.run_root()[0] == 0
    (node.agent_dir / STATE_FILE).write_text(
        json.dumps({"format": 1, "generation": 0, "epoch": 0, "payload_sha256": None})
    )
    node.spool_state(current_state(6, lease_epoch=3))  # newer generation, signed under a deposed leader's epoch

    status, _output, answer = node.run_root()

    assert status == 1 and answer is not None and "(stale-epoch)" in answer.failures[0]
    assert node.root_record()[:2] == (5, 4)


def test_the_applied_generation_with_other_bytes_is_refused_by_root(node: Node) -> None:
    node.spool_state(current_state(5))
    assert node.run_root()[0] == 0
    other = current_state(5, lease_epoch=2, engines=[], artifacts=[])
    write_request(node.spool, "gen-5-20261201T130000.000000Z", signed("desired-state", other, [CONTROL]))

    status, _output, answer = node.run_root()

    assert status == 1 and answer is not None and "(replayed)" in answer.failures[0]


def test_the_applied_generation_with_the_same_bytes_is_applied_again_to_repair_drift(node: Node) -> None:
    payload = current_state(5)
    envelope = signed("desired-state", payload, [CONTROL])
    write_request(node.spool, IDENT.format(5), envelope)
    assert node.run_root()[0] == 0
    write_request(node.spool, "gen-5-20261201T130000.000000Z", envelope)

    status, output, answer = node.run_root()

    assert status == 0, output
    assert answer is not None and answer.status == "successful" and answer.payload_sha256 == _sha(payload)
    assert node.journal() == [IDENT.format(5), "gen-5-20261201T130000.000000Z"]


def test_a_request_naming_an_interrupted_runs_ident_is_not_run_twice_under_it(node: Node) -> None:
    node.spool_state(current_state(2))
    assert node.run_root()[0] == 0
    (node.root_dir / PUBLIC_DIR / "apply-result.json").unlink()  # root lost its answer; the journal remains

    status, _output, answer = node.run_root()

    assert status == 1 and answer is not None and "interrupted" in answer.failures[0]
    assert node.journal() == [IDENT.format(2)]


# The one file root reads: only a plain file the agent owns, read once, bounded.


def _refused(node: Node, reason: str) -> None:
    status, output, answer = node.run_root()
    assert status == 1, output
    assert reason in output and "nothing was applied" in output
    assert answer is None  # no request was read, so there is nothing to answer
    assert node.root_record() == (0, 0, None) and node.journal() == []


def test_a_spool_that_is_a_symlink_to_another_directory_is_refused(node: Node, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    write_request(elsewhere, IDENT.format(1), signed("desired-state", current_state(1), [CONTROL]))
    node.spool.symlink_to(elsewhere)

    _refused(node, f"refusing {node.spool}: it is a symlink")


def test_a_request_that_is_a_symlink_to_a_file_only_root_may_read_is_refused(node: Node, tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    node.spool.mkdir()
    (node.spool / REQUEST_FILE).symlink_to(secret)

    _refused(node, f"refusing {node.spool / REQUEST_FILE}: it is a symlink")


def test_a_request_that_is_a_hard_link_to_another_file_is_refused(node: Node, tmp_path: Path) -> None:
    node.spool.mkdir()
    other = node.spool / "planted"
    other.write_text("{}")
    os.link(other, node.spool / REQUEST_FILE)

    _refused(node, "it has 2 hard links")


def test_a_request_that_is_a_fifo_is_refused_without_blocking_root(node: Node) -> None:
    node.spool.mkdir()
    os.mkfifo(node.spool / REQUEST_FILE)

    _refused(node, "it is a FIFO, not a regular file")  # apply_spooled has a timeout: a hang would fail


def test_a_request_owned_by_someone_else_than_the_spools_owner_is_refused(node: Node) -> None:
    node.spool_state(current_state(1))
    os.chown(node.spool, 4242, -1)  # the spool is the agent's (uid 4242); the file is not

    _refused(node, f"owned by uid {os.geteuid()}, not by uid 4242")


def test_an_oversized_request_is_refused_before_it_is_read(node: Node) -> None:
    node.spool.mkdir()
    with (node.spool / REQUEST_FILE).open("wb") as handle:
        handle.truncate(MAX_REQUEST_BYTES + 1)

    _refused(node, f"more than {MAX_REQUEST_BYTES}")


def test_a_request_swapped_back_and_forth_while_root_reads_is_read_once_whole(node: Node) -> None:
    # The agent flips the request between a signed state and garbage as fast as it can. Whatever root
    # read, it is one read of one file: a whole request, or a refusal naming the file; never a mix.
    write_request(node.spool, IDENT.format(1), signed("desired-state", current_state(1), [CONTROL]))
    good = (node.spool / REQUEST_FILE).read_bytes()
    bad = good.replace(b'"request"', b'"requesT"')
    stop = threading.Event()

    def flip() -> None:
        temp = node.spool / ".flip"
        while not stop.is_set():
            for data in (bad, good):
                temp.write_bytes(data)
                temp.replace(node.spool / REQUEST_FILE)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    seen = {"whole": 0, "refused": 0}
    try:
        for _ in range(300):
            try:
                request = read_request(node.agent_dir)
            except SpoolError as exc:
                assert "requesT" in str(exc) or "Extra inputs" in str(exc) or "request" in str(exc)
                seen["refused"] += 1
            else:
                assert request is not None and request.request == IDENT.format(1)
                assert request.envelope_bytes() == signed_envelope_of(good)
                seen["whole"] += 1
    finally:
        stop.set()
        flipper.join(timeout=10)
    assert seen["whole"] + seen["refused"] == 300


def signed_envelope_of(raw_request: bytes) -> bytes:
    import base64

    return base64.b64decode(json.loads(raw_request)["envelope"])


# Root's own directory: root's, private, and apart from the agent's.


def test_a_root_directory_another_user_owns_is_refused_and_nothing_is_applied(node: Node) -> None:
    node.spool_state(current_state(1))
    node.root_dir.mkdir(mode=0o711)
    os.chown(node.root_dir, 4242, -1)

    status, output, _answer = node.run_root()

    assert status == 1 and f"refusing {node.root_dir}: it is owned by uid 4242" in output
    assert node.journal() == []


def test_a_root_directory_others_may_write_is_refused(node: Node) -> None:
    node.root_dir.mkdir()
    node.root_dir.chmod(0o777)

    with pytest.raises(BoundaryError, match="mode 0777 lets others write in it"):
        prepare_root_dir(node.root_dir, agent_dir=node.agent_dir)


def test_a_root_directory_that_is_a_symlink_is_refused(node: Node, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    node.root_dir.symlink_to(tmp_path / "real")

    with pytest.raises(BoundaryError, match="it resolves to"):
        prepare_root_dir(node.root_dir, agent_dir=node.agent_dir)


def test_a_root_directory_under_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could rename root's directory away and put theirs there

    with pytest.raises(BoundaryError, match=f"refusing {shared}: mode 0777"):
        prepare_root_dir(shared / "apply", agent_dir=tmp_path / "agent")


def test_a_config_putting_roots_directory_inside_the_agents_is_refused(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "etc", control=[CONTROL])
    apply = {"via": "systemd", "state_dir": str(tmp_path / "agent" / "apply")}
    path = write_split_config(
        tmp_path / "config.yaml", node_id=NODE_ID, policy=policy, state_dir=tmp_path / "agent", apply=apply
    )

    with pytest.raises(ConfigError, match="must be separate directories, neither inside the other"):
        load_config(path)


def test_roots_directory_is_private_except_the_answer_and_what_the_agent_observes(node: Node) -> None:
    node.spool_state(current_state(1))
    assert node.run_root()[0] == 0

    modes = {
        path.relative_to(node.root_dir).as_posix(): path.stat().st_mode & 0o777
        for path in [node.root_dir, *node.root_dir.iterdir()]
        if not path.name.startswith(".")
    }
    assert modes["."] == 0o711
    assert modes["journal"] == modes["runs"] == 0o700
    assert modes["public"] == 0o750
    group = node.agent_dir.stat().st_gid
    public = node.root_dir / PUBLIC_DIR
    assert [p.stat().st_gid for p in [public, *public.iterdir()]] == [group] * 3
    assert sorted(p.name for p in (node.root_dir / PUBLIC_DIR).iterdir()) == ["apply-result.json", "engines.json"]
    # Nothing was written into the agent's directory but what the agent wrote itself.
    assert sorted(p.name for p in node.agent_dir.rglob("*")) == [REQUEST_FILE, SPOOL_DIR]


# The agent side does not fall over on what it cannot do.


def _agent(node: Node) -> Agent:
    from meridian_node_agent.cli.agent import build_applier

    observer = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False})
    policy = load_policy(node.config.policy)
    return Agent(node.config, policy, client=None, applier=build_applier(node.config), observer=observer)  # type: ignore[arg-type]


def test_an_apply_that_cannot_even_be_requested_is_a_failed_apply_not_a_crash(node: Node) -> None:
    node.spool.write_text("a file where the spool directory should be")
    agent = _agent(node)
    from ansible_collections.meridian.node.plugins.module_utils.trust.verify import verify_desired_state

    envelope = signed("desired-state", current_state(1), [CONTROL])
    verified = verify_desired_state(
        envelope, agent.policy, node_id=NODE_ID, now=datetime.now(UTC), applied=agent.store.load()
    )

    result = agent._apply(envelope, verified)

    assert result.status == "failed" and "the apply could not be run" in result.failures[0]
    assert agent.counters.apply_failures == 1 and agent.counters.applies == 0


def test_an_interrupted_apply_that_cannot_be_resumed_is_abandoned_once_with_its_reason(node: Node) -> None:
    oplog = OpLog(node.agent_dir / "oplog.jsonl")
    oplog.append(op="apply", generation=7, epoch=1, payload_sha256="c" * 64, run_ident="gen-7-x", result="started")
    (node.agent_dir / SPOOL_FILE).parent.mkdir(parents=True, exist_ok=True)
    (node.agent_dir / SPOOL_FILE).write_bytes(b"not an envelope")

    first = _agent(node).recover()
    second = _agent(node).recover()

    assert first is None and second is None
    entries = oplog.read()
    assert [(e.run_ident, e.result) for e in entries] == [("gen-7-x", "started"), ("gen-7-x", ABANDONED)]
    assert entries[1].reason is not None and "malformed" in entries[1].reason.lower()


# What an operator runs: the record that decides, and a damaged one said plainly.


def test_verify_reads_the_record_root_decides_by_and_says_a_damaged_one_is_damaged(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node.spool_state(current_state(5))
    assert node.run_root()[0] == 0
    older = tmp_path / "older.json"
    older.write_bytes(signed("desired-state", current_state(4), [CONTROL]))
    argv = [
        "--config",
        str(node.config_path),
        "verify",
        "--policy",
        node.config.policy,
        "--kind",
        "desired-state",
        "--node-id",
        NODE_ID,
        str(older),
    ]

    assert cli_main(argv) == 1
    assert json.loads(capsys.readouterr().out)["reason"] == "replayed"  # root's record, not the agent's (empty)

    (node.root_dir / STATE_FILE).write_text("{ damaged")
    assert cli_main(argv) == 2
    line = json.loads(capsys.readouterr().out)
    assert (line["accepted"], line["reason"]) == (False, "record-error")
    assert "is corrupt" in line["message"] and str(node.root_dir / STATE_FILE) in line["message"]


def test_the_agent_waits_for_roots_first_answer_before_roots_directory_exists(node: Node) -> None:
    from meridian_node_agent.cli.agent import build_applier

    payload = current_state(1)
    applier = build_applier(node.config)
    results: list[Any] = []
    envelope = signed("desired-state", payload, [CONTROL])
    waiter = threading.Thread(
        target=lambda: results.append(applier.apply(envelope, generation=1, epoch=1, payload_sha256=_sha(payload)))
    )
    waiter.start()
    deadline = time.monotonic() + 30  # a liveness bound, not a timing assertion
    while not (node.spool / REQUEST_FILE).exists():
        if time.monotonic() > deadline:
            raise AssertionError("the agent never spooled its request")
        time.sleep(0.05)
    assert not node.root_dir.exists()
    assert node.run_root()[0] == 0
    waiter.join(timeout=60)

    assert results and results[0].status == "successful"

"""The inbox loop against what arrives in an inbox: each test a fault or an attack, and what the loop does.

Real bundles (make-bundle's code), a real inbox directory, and real ansible-runner runs of the collection's
``reconcile.yml`` where a bundle is applied: the record that decides replay is the one that playbook
writes, as online.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._lockfile import LockTimeout, hold_lock
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import unpack_bundle
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.support.airgap_env import (
    AirGapNode,
    InPlaceWriter,
    grow_while_read,
    make_airgap_node,
    state_bundle,
)
from meridian_node_agent.apply import inbox as airgap_inbox
from meridian_node_agent.apply.inbox import LOCK_FILE, BundleResult, InboxProcessor


def _processor(node: AirGapNode) -> InboxProcessor:
    return InboxProcessor(inbox=node.inbox, policy=node.policy, node_id=node.node_id, record_dir=node.state_dir)


def _drop(node: AirGapNode, bundle: Path, name: str) -> Path:
    """Copy ``bundle`` in the documented way: under a temporary name, then renamed into place."""
    temporary = node.inbox / f".{name}.part"
    shutil.copyfile(bundle, temporary)
    return temporary.rename(node.inbox / name)


def _journal_runs(node: AirGapNode) -> list[str]:
    journal = node.state_dir / "journal"
    return sorted(p.name for p in journal.iterdir()) if journal.is_dir() else []


def test_a_bundle_still_being_copied_is_not_taken_until_renamed(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    bundle = state_bundle(node, "g1.tar", generation=1)
    data = bundle.read_bytes()
    (node.inbox / ".g1.tar.part").write_bytes(data[: len(data) // 2])
    (node.inbox / "g1.tar.partial").write_bytes(data[: len(data) // 3])
    processor = _processor(node)

    assert processor.process_once() == []
    assert sorted(os.listdir(node.inbox)) == [".g1.tar.part", "g1.tar.partial"]
    assert StateStore(node.state_dir).load().generation == 0

    (node.inbox / ".g1.tar.part").write_bytes(data)  # the copy finishes, then the writer renames it
    (node.inbox / ".g1.tar.part").rename(node.inbox / "g1.tar")
    [outcome] = processor.process_once()

    assert outcome.result == BundleResult.APPLIED, outcome
    assert StateStore(node.state_dir).load().generation == 1
    assert node.filed("processed")["g1.tar"]["result"] == "applied"
    assert (node.inbox / "processed" / "g1.tar").read_bytes() == data
    assert sorted(os.listdir(node.inbox)) == ["g1.tar.partial", "processed"]
    assert os.listdir(tmp_path / "scratch") == []  # the unpacked tree is gone after the apply


def test_an_inbox_symlink_is_refused_and_never_followed(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    bundle = state_bundle(node, "g1.tar", generation=1)
    before = bundle.read_bytes()
    (node.inbox / "linked.tar").symlink_to(bundle)

    [outcome] = _processor(node).process_once()

    assert (outcome.result, outcome.reason) == (BundleResult.REJECTED, "not-a-file")
    reason = node.filed("rejected")["linked.tar"]
    assert reason["reason"] == "not-a-file" and "symbolic link" in reason["message"]
    assert (node.inbox / "rejected" / "linked.tar").is_symlink()  # moved as a link, its target untouched
    assert bundle.read_bytes() == before
    assert StateStore(node.state_dir).load().generation == 0
    assert _journal_runs(node) == []


def test_an_inbox_directory_is_refused(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    (node.inbox / "unpacked.tar").mkdir()
    (node.inbox / "unpacked.tar" / "bundle.json").write_text("{}")

    [outcome] = _processor(node).process_once()

    assert (outcome.result, outcome.reason) == (BundleResult.REJECTED, "not-a-file")
    assert "is a directory" in node.filed("rejected")["unpacked.tar"]["message"]
    assert (node.inbox / "rejected" / "unpacked.tar" / "bundle.json").is_file()
    assert _journal_runs(node) == []


def test_a_file_not_named_tar_is_refused_with_the_naming_rule(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    shutil.copyfile(state_bundle(node, "g1.tar", generation=1), node.inbox / "g1.bundle")

    [outcome] = _processor(node).process_once()

    assert (outcome.result, outcome.reason) == (BundleResult.REJECTED, "not-a-bundle-name")
    assert ".NAME.tar.part" in node.filed("rejected")["g1.bundle"]["message"]
    assert StateStore(node.state_dir).load().generation == 0


def test_refused_bundles_are_moved_to_rejected_with_their_reason(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    other = make_airgap_node(tmp_path / "other", node_id="another-node")
    _drop(node, state_bundle(other, "theirs.tar", generation=1), "theirs.tar")
    data = state_bundle(node, "cut.tar", generation=1).read_bytes()
    (node.inbox / "cut.tar").write_bytes(data[:700])  # the header and the start of bundle.json

    outcomes = {o.name: o for o in _processor(node).process_once()}

    assert {name: (o.result, o.reason) for name, o in outcomes.items()} == {
        "cut.tar": (BundleResult.REJECTED, "truncated"),
        "theirs.tar": (BundleResult.REJECTED, "wrong-node"),
    }
    rejected = node.filed("rejected")
    assert "another-node" in rejected["theirs.tar"]["message"]
    assert rejected["cut.tar"]["result"] == "rejected"
    assert sorted(os.listdir(node.inbox)) == ["rejected"]
    assert StateStore(node.state_dir).load().generation == 0
    assert _journal_runs(node) == []
    assert os.listdir(tmp_path / "scratch") == []


def test_a_replayed_bundle_is_a_no_op_and_an_older_generation_is_refused(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    g1 = state_bundle(node, "g1.tar", generation=1)
    g2 = state_bundle(node, "g2.tar", generation=2)
    processor = _processor(node)
    _drop(node, g2, "g2.tar")
    [applied] = processor.process_once()
    assert applied.result == BundleResult.APPLIED, applied
    runs = _journal_runs(node)

    _drop(node, g2, "g2.tar")  # the same bundle copied in again, under the same name
    _drop(node, g1, "g1.tar")  # an older one
    outcomes = {o.name: o for o in processor.process_once()}

    assert outcomes["g2.tar"].result == BundleResult.ALREADY_APPLIED
    assert (outcomes["g1.tar"].result, outcomes["g1.tar"].reason) == (BundleResult.REJECTED, "replayed")
    assert _journal_runs(node) == runs  # no playbook ran for either
    assert StateStore(node.state_dir).load().generation == 2
    processed = node.filed("processed")
    assert processed["g2.tar"]["result"] == "applied"
    [again] = [name for name in processed if name != "g2.tar"]
    assert again.startswith("g2.tar-") and processed[again]["result"] == "already-applied"  # nothing overwritten
    assert "generation 1" in node.filed("rejected")["g1.tar"]["message"]


def test_a_second_process_does_not_take_the_inbox_while_one_holds_it(tmp_path: Path) -> None:
    node = make_airgap_node(tmp_path)
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    node.state_dir.mkdir()
    with hold_lock(node.state_dir / LOCK_FILE, wait_s=0):  # another run's pass in progress
        # Busy is said as such (never an empty pass, which reads as "no bundle"), within the bounded wait.
        with pytest.raises(LockTimeout, match=r"air-gap inbox lock .*airgap-inbox.lock\) is busy"):
            _processor(node).process_once(lock_wait_s=0.2)
        assert os.listdir(node.inbox) == ["g1.tar"]

    [outcome] = _processor(node).process_once()
    assert outcome.result == BundleResult.APPLIED


def test_a_bundle_written_in_place_and_still_growing_is_left_not_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer that ignores the temporary-name rule: the reader sees the file cut short while the copy goes on.
    node = make_airgap_node(tmp_path)
    data = state_bundle(node, "g1.tar", generation=1).read_bytes()
    target = node.inbox / "g1.tar"
    target.write_bytes(data[:700])
    real = unpack_bundle

    def read_while_the_copy_goes_on(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        finally:
            with target.open("ab") as writer:
                writer.write(data[700:])

    monkeypatch.setattr(airgap_inbox, "unpack_bundle", read_while_the_copy_goes_on)
    [left] = _processor(node).process_once()
    monkeypatch.setattr(airgap_inbox, "unpack_bundle", real)
    [taken] = _processor(node).process_once()

    assert (left.result, left.reason) == (BundleResult.LEFT, "changed-while-read")
    assert "truncated" in (left.message or "")
    assert taken.result == BundleResult.APPLIED
    assert node.filed("rejected") == {}


def test_a_bundle_growing_while_it_is_read_is_never_taken_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer ignores the rename rule and copies under NAME.tar. Each time the reader reads from the file,
    # the copy goes one chunk further (grow_while_read): every pass but the last sees a file still moving.
    node = make_airgap_node(tmp_path)
    data = state_bundle(node, "g1.tar", generation=1).read_bytes()
    writer = InPlaceWriter(node.inbox / "g1.tar", data, steps=5)
    writer.step()
    grow_while_read(monkeypatch, writer)
    processor = _processor(node)

    passes = []
    while True:
        complete_before = writer.done
        [outcome] = processor.process_once()
        passes.append((complete_before, outcome.result, outcome.reason))
        if outcome.result != BundleResult.LEFT:
            break
        assert StateStore(node.state_dir).load().generation == 0  # nothing of a moving file was applied
        assert os.listdir(tmp_path / "scratch") == []  # nor kept
        assert len(passes) < 20, passes

    assert all(result == BundleResult.LEFT for _, result, _ in passes[:-1]), passes
    assert {reason for _, _, reason in passes[:-1]} == {"changed-while-read"}
    assert len(passes) >= 2  # the first pass saw the copy in progress
    assert passes[-1] == (True, BundleResult.APPLIED, None)  # taken only once complete before the read began
    assert node.filed("rejected") == {}
    assert (node.inbox / "processed" / "g1.tar").read_bytes() == data

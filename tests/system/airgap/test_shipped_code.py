"""Code a bundle ships runs only because control pinned it (issue 22): what whoever holds only the air-gap
authority key can make of a bundle, tried on every path that takes bundles.

The authority's attacks are bundles it re-signs itself (``resigned``): shipped code under a control-signed
state that pins none, one byte of a pinned playbook changed, a collection swapped, code left out. Each is
refused with its reason before anything is staged or run: the playbook that would write a proof file as
the applier never runs, and the applier's record stays where it was. The same bundle with its pin applies
through a real ansible-runner run (and, with a Docker stand-in engine, in ``test_airgap_e2e``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import (
    BundleProblem,
    BundleRefused,
    check_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.runbook import listed_runbook
from ansible_collections.meridian.node.plugins.module_utils.contracts import read_json
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState
from ansible_collections.meridian.node.tests.collection.playbooks.test_airgap_apply_playbook import _play
from ansible_collections.meridian.node.tests.support.airgap_env import (
    AirGapNode,
    galaxy_collection,
    make_airgap_node,
    state_bundle,
)
from ansible_collections.meridian.node.tests.support.bundle_fixtures import (
    CONTROL,
    Member,
    Site,
    listed,
    make_site,
    rebuilt_bundle,
    regular,
    resigned,
    snapshot,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import NODE_ID, NOW, envelope
from meridian_node_agent.apply.inbox import BundleResult, InboxProcessor
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.cli.bundle import shipped_code_pin

PLAYBOOK = "playbooks/reconcile.yml"
# What the shipped playbook does when it runs: a file no refused bundle may leave behind.
PROOF_PLAY = (
    "- name: Shipped code ran as the applier\n"
    "  hosts: all\n"
    "  gather_facts: false\n"
    "  tasks:\n"
    "    - name: Leave the proof\n"
    "      ansible.builtin.copy:\n"
    '        content: "shipped code ran\\n"\n'
    '        dest: "{{ meridian_state_dir }}/proof"\n'
    "        mode: '0600'\n"
)


@pytest.fixture(scope="module")
def tarballs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("collections")
    return {
        "site": galaxy_collection(root, "meridian_site", "extras"),
        "shadow": galaxy_collection(root, "meridian", "node"),
    }


def _code(node: AirGapNode, collection: Path) -> tuple[Path, Path]:
    playbooks = node.root / "site-playbooks"
    playbooks.mkdir(exist_ok=True)
    (playbooks / "reconcile.yml").write_text(PROOF_PLAY)
    return playbooks, collection


def _pinned_bundle(node: AirGapNode, name: str, collection: Path, generation: int = 1) -> Path:
    """A bundle whose control-signed state pins the proof playbook and ``collection`` (the honest case)."""
    playbooks, collection = _code(node, collection)
    pin = shipped_code_pin(playbooks, collection)
    return state_bundle(
        node, name, generation=generation, desired={"runbook": pin}, playbooks=playbooks, collection=collection
    )


def _state_of(payload: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(base64.b64decode(payload["desired_state"]["payload"]))
    return state


def _without_pin(payload: dict[str, Any], body: list[Member]) -> None:
    """The authority swaps in a state control signed for the same generation without a pin (one published
    online, or delivered in a bundle without code): control's signature is genuine, the code is not chosen."""
    state = _state_of(payload)
    del state["runbook"]
    payload["desired_state"] = envelope("desired-state", state, [CONTROL])


def _one_byte_changed(payload: dict[str, Any], body: list[Member]) -> None:
    changed = PROOF_PLAY.replace("Leave the proof", "Leave the proof!").encode()
    payload["files"] = [listed(PLAYBOOK, changed) if e["path"] == PLAYBOOK else e for e in payload["files"]]
    body[:] = [regular(PLAYBOOK, changed) if info.name == PLAYBOOK else (info, data) for info, data in body]


def _processor(node: AirGapNode) -> InboxProcessor:
    return InboxProcessor(inbox=node.inbox, policy=node.policy, node_id=node.node_id, record_dir=node.state_dir)


def _drop(node: AirGapNode, bundle: Path, name: str) -> None:
    shutil.copyfile(bundle, node.inbox / f".{name}.part")
    (node.inbox / f".{name}.part").rename(node.inbox / name)


def _attack(node: AirGapNode, collection: Path, edit: Callable[[dict[str, Any], list[Member]], None]) -> Path:
    return resigned(_pinned_bundle(node, "honest.tar", collection), node.bundles / "attack.tar", edit)


# --- the inbox (root's inbox unit and the in-process air-gapped agent share InboxProcessor) -------------------


@pytest.mark.parametrize(
    ("edit", "reason"),
    [(_without_pin, "code-not-pinned"), (_one_byte_changed, "code-mismatch")],
    ids=["state-without-pin", "playbook-one-byte-changed"],
)
def test_the_inbox_never_runs_code_the_authority_chose(
    tmp_path: Path,
    tarballs: dict[str, Path],
    edit: Callable[[dict[str, Any], list[Member]], None],
    reason: str,
) -> None:
    node = make_airgap_node(tmp_path)
    _drop(node, _attack(node, tarballs["site"], edit), "attack.tar")

    [outcome] = _processor(node).process_once()

    assert (outcome.result, outcome.reason) == (BundleResult.REJECTED, reason), outcome.message
    assert not (node.state_dir / "proof").exists()
    assert StateStore(node.state_dir).load() == AppliedState()
    assert node.filed("rejected")["attack.tar"]["reason"] == reason


def test_the_same_bundle_with_its_pin_runs_its_playbook(tmp_path: Path, tarballs: dict[str, Path]) -> None:
    node = make_airgap_node(tmp_path)
    _drop(node, _pinned_bundle(node, "pinned.tar", tarballs["site"]), "pinned.tar")

    [outcome] = _processor(node).process_once()

    assert outcome.result == BundleResult.APPLIED, outcome.message
    assert (node.state_dir / "proof").read_text() == "shipped code ran\n"


def test_a_pinned_collection_that_is_meridian_node_itself_is_refused(tmp_path: Path, tarballs: dict[str, Path]) -> None:
    """Even pinned, a shipped meridian.node would stand in for the host's verifier and record keeping."""
    node = make_airgap_node(tmp_path)
    _drop(node, _pinned_bundle(node, "shadow.tar", tarballs["shadow"]), "shadow.tar")

    [outcome] = _processor(node).process_once()

    assert (outcome.result, outcome.reason) == (BundleResult.REJECTED, "shipped-code-refused")
    assert "meridian.node collection itself" in (outcome.message or "")
    assert not (node.state_dir / "proof").exists()
    assert StateStore(node.state_dir).load() == AppliedState()


@pytest.mark.skipif(sys.platform != "linux", reason="root's inbox unit is Linux-only")
def test_roots_inbox_unit_refuses_unpinned_code(
    tmp_path: Path, tarballs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("root's verb checks ownership: run as root (CI does)")
    node = make_airgap_node(tmp_path, split=True)
    _drop(node, _attack(node, tarballs["site"], _without_pin), "attack.tar")

    status = cli_main(["--config", str(node.config_path), "airgap-inbox", "--once"])

    assert status == 1
    assert "bundle attack.tar: rejected (code-not-pinned" in capsys.readouterr().out
    assert not (tmp_path / "apply" / "proof").exists()
    assert StateStore(tmp_path / "apply").load() == AppliedState()


def test_airgap_apply_playbook_refuses_unpinned_code(tmp_path: Path, tarballs: dict[str, Path]) -> None:
    node = make_airgap_node(tmp_path)

    status, failures = _play(node, _attack(node, tarballs["site"], _without_pin))

    assert status == "failed"
    assert any("code-not-pinned" in json.dumps(failure) for failure in failures), failures
    assert not (node.state_dir / "proof").exists()
    assert StateStore(node.state_dir).load() == AppliedState()


# --- the reader and verify: every refusal before a member is read -----------------------------------------


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return make_site(tmp_path)


def _refused(site: Site, path: Path, reason: BundleProblem) -> BundleRefused:
    before = snapshot(site.root, skip=site.scratch)
    with pytest.raises(BundleRefused) as caught:
        check_bundle(str(path), site.policy, node_id=NODE_ID, now=NOW, applied=AppliedState())
    assert caught.value.reason is reason, caught.value.message
    assert snapshot(site.root, skip=site.scratch) == before
    return caught.value


def test_a_collection_swapped_under_the_pin_is_refused(site: Site) -> None:
    other = b"\x1f\x8b another collection"

    def swap(payload: dict[str, Any], body: list[Member]) -> None:
        name = next(e["path"] for e in payload["files"] if e["path"].startswith("collection/"))
        payload["files"] = [listed(name, other) if e["path"] == name else e for e in payload["files"]]
        body[:] = [regular(name, other) if info.name == name else (info, data) for info, data in body]

    error = _refused(site, rebuilt_bundle(site, swap), BundleProblem.CODE_MISMATCH)
    assert "collection_sha256" in error.message and hashlib.sha256(other).hexdigest() in error.message


def test_code_the_state_pins_cannot_be_left_out(site: Site) -> None:
    """Dropping the code control chose would apply the state with other code (the host's)."""

    def drop(payload: dict[str, Any], body: list[Member]) -> None:
        payload["files"] = [e for e in payload["files"] if e["path"].startswith("artifacts/")]
        body[:] = [(info, data) for info, data in body if info.name.startswith("artifacts/")]

    error = _refused(site, rebuilt_bundle(site, drop), BundleProblem.CODE_MISMATCH)
    assert "ships no playbooks/ or collection/" in error.message


def test_a_site_that_refuses_shipped_code_refuses_it_pinned_and_takes_bundles_without_it(tmp_path: Path) -> None:
    site = make_site(tmp_path, air_gap={"shipped_code": "refuse"})
    error = _refused(site, rebuilt_bundle(site, lambda payload, body: None), BundleProblem.CODE_REFUSED)
    assert "air_gap.shipped_code: refuse" in error.message

    def without_code(payload: dict[str, Any], body: list[Member]) -> None:
        payload["files"] = [e for e in payload["files"] if e["path"].startswith("artifacts/")]
        body[:] = [(info, data) for info, data in body if info.name.startswith("artifacts/")]
        state = _state_of(payload)
        del state["runbook"]
        payload["desired_state"] = envelope("desired-state", state, [CONTROL])

    checked = check_bundle(
        str(rebuilt_bundle(site, without_code)), site.policy, node_id=NODE_ID, now=NOW, applied=AppliedState()
    )
    assert checked.verified.desired.state.runbook is None


def test_the_pin_is_checked_from_the_signed_listing(site: Site) -> None:
    """``listed_runbook`` of the good bundle's listing is its state's pin, field for field."""

    def keep(payload: dict[str, Any], body: list[Member]) -> None:
        assert listed_runbook(payload["files"]) == _state_of(payload)["runbook"]

    rebuilt_bundle(site, keep)


def test_verify_of_a_bare_bundle_json_reports_unpinned_code(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    import tarfile

    with tarfile.open(rebuilt_bundle(site, _without_pin)) as tar:
        handle = tar.extractfile("bundle.json")
        assert handle is not None
        (site.root / "bundle.json").write_bytes(handle.read())
    read_json((site.root / "bundle.json").read_bytes())  # the envelope alone, as an operator would check it

    status = cli_main(
        [
            *("verify", "--policy", str(site.policy.source), "--kind", "bundle", "--node-id", NODE_ID),
            *("--state-dir", str(site.root / "record"), "--at", "2025-06-01T12:00:00Z"),
            str(site.root / "bundle.json"),
        ]
    )

    result = json.loads(capsys.readouterr().out)
    assert (status, result["accepted"], result["reason"]) == (1, False, "code-not-pinned")

"""Root's locks and record are root's alone (issue 22), process-level, as the agent's user where it matters.

The agent's user is played by a forked child that dropped to ``AGENT_UID``: it is handed every path in
root's directory (more than it could list: the directory is 0711) and opens and ``flock``s what it can,
holding it while root takes and applies a bundle. Root must finish, or say busy within its bounded wait;
never hang, never say "no bundle" while one waits. And an apply of generation N killed mid-run leaves N
accepted: N-1 is refused afterwards, N's own bundle applies again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._lockfile import hold_lock
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.support.airgap_env import (
    AGENT_UID,
    AirGapNode,
    make_airgap_node,
    state_bundle,
)
from ansible_collections.meridian.node.tests.support.shared_tmp import reachable_tmp_dir
from meridian_node_agent.apply.inbox import LOCK_FILE
from meridian_node_agent.boundary.outcomes import read_outcomes
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.root_side import inbox_unit as airgap_root
from meridian_node_agent.root_side.inbox_unit import take_bundles
from meridian_node_agent.root_side.root_dir import prepare_root_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays root and drops to the agent's user: run as root")


@pytest.fixture
def site() -> Iterator[Path]:
    """A directory the agent's user can reach (pytest's own tmp_path lies under a 0700 directory)."""
    with reachable_tmp_dir("mn-root-locks-") as path:
        yield path


def _drop(node: AirGapNode, bundle: Path, name: str) -> None:
    temporary = node.inbox / f".{name}.part"
    shutil.copyfile(bundle, temporary)
    temporary.rename(node.inbox / name)


def _root(node: AirGapNode) -> int:
    return cli_main(["--config", str(node.config_path), "airgap-inbox", "--once"])


def _root_files(root_dir: Path) -> list[Path]:
    found: list[Path] = []
    for directory, _, names in os.walk(root_dir):
        found.extend(Path(directory) / name for name in names)
    return sorted(found)


class AsAgent:
    """A child process as the agent's user that opens and locks every path it is given and holds them."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.opened: dict[str, str] = {}
        self._pid = 0
        self._release = -1

    def __enter__(self) -> AsAgent:
        report_r, report_w = os.pipe()
        release_r, release_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(report_r)
                os.close(release_w)
                os.setgroups([])
                os.setgid(AGENT_UID)
                os.setuid(AGENT_UID)
                results: dict[str, str] = {}
                for path in self.paths:
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                    except OSError as exc:
                        results[str(path)] = f"open: {exc.strerror}"
                        continue
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        results[str(path)] = "locked"  # and kept: the descriptor stays open until released
                    except OSError as exc:
                        results[str(path)] = f"flock: {exc.strerror}"
                os.write(report_w, json.dumps(results).encode())
                os.close(report_w)
                os.read(release_r, 1)
            finally:
                os._exit(0)
        os.close(report_w)
        os.close(release_r)
        self._pid, self._release = pid, release_w
        with os.fdopen(report_r, "rb") as report:
            self.opened = json.loads(report.read())
        return self

    def __exit__(self, *exc: object) -> None:
        os.write(self._release, b"x")
        os.close(self._release)
        os.waitpid(self._pid, 0)

    @property
    def locked(self) -> list[str]:
        return sorted(path for path, result in self.opened.items() if result == "locked")


def test_the_agents_user_can_lock_nothing_root_uses_and_root_takes_a_bundle_while_it_holds_what_it_can(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(site, split=True)
    root_dir = site / "apply"
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    assert _root(node) == 0  # every file root keeps now exists: record, locks, oplog, journal, public/
    capsys.readouterr()
    files = _root_files(root_dir)
    assert {root_dir / name for name in ("applied.json", "applied.json.lock", LOCK_FILE, "apply.lock")} <= set(files)

    with AsAgent(files) as agent:
        # What the agent can open at all is what root hands it: public/, read-only, never locked by root.
        assert [Path(path).relative_to(root_dir).parts[0] for path in agent.locked] == ["public"] * len(agent.locked)
        for name in ("applied.json", "applied.json.lock", LOCK_FILE, "apply.lock", "oplog.jsonl"):
            assert agent.opened[str(root_dir / name)] == "open: Permission denied", name
        _drop(node, state_bundle(node, "g2.tar", generation=2), "g2.tar")
        assert _root(node) == 0

    out = capsys.readouterr().out
    assert "bundle g2.tar: applied" in out and "no bundle" not in out
    assert StateStore(root_dir).load().generation == 2
    for path in files:
        if path.parent == root_dir and path.name.endswith((".lock", ".json", ".jsonl")):
            info = path.lstat()
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600), path


def test_a_lock_an_older_release_left_open_to_the_agent_is_replaced_while_the_agent_holds_it(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(site, split=True)
    root_dir = site / "apply"
    prepare_root_dir(root_dir, agent_dir=node.state_dir)
    StateStore(root_dir).record_applied(1, 0, "0" * 64)
    locks = [root_dir / LOCK_FILE, root_dir / "applied.json.lock"]
    for lock in locks:  # as the previous release created them
        lock.touch()
        lock.chmod(0o644)
    before = {lock: lock.stat().st_ino for lock in locks}
    _drop(node, state_bundle(node, "g2.tar", generation=2), "g2.tar")

    with AsAgent(locks) as agent:
        assert agent.locked == sorted(str(lock) for lock in locks)  # the attack, as it was possible
        assert _root(node) == 0

    out = capsys.readouterr().out
    assert "bundle g2.tar: applied" in out and "no bundle" not in out
    assert node.filed("processed")["g2.tar"]["result"] == "applied"
    for lock in locks:
        info = lock.stat()
        assert info.st_ino != before[lock] and stat.S_IMODE(info.st_mode) == 0o600, lock


@pytest.mark.timeout(120)
def test_an_inbox_held_past_the_bounded_wait_is_reported_busy_never_as_no_bundle(
    site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_airgap_node(site, split=True)
    root_dir = site / "apply"
    prepare_root_dir(root_dir, agent_dir=node.state_dir)
    _drop(node, state_bundle(node, "g1.tar", generation=1), "g1.tar")
    # raising=False: on a release without the bounded wait this test must fail on what root says, not here.
    monkeypatch.setattr(airgap_root, "LOCK_WAIT_S", 0.5, raising=False)

    with hold_lock(root_dir / LOCK_FILE, wait_s=0):  # a stuck holder (only root could be one now)
        assert _root(node) == 1  # within the test's timeout: busy is said, never waited out

    captured = capsys.readouterr()
    assert "error: inbox-busy:" in captured.err and "is busy" in captured.err and "fuser -v" in captured.err
    assert "no bundle" not in captured.out
    assert sorted(os.listdir(node.inbox)) == ["g1.tar"]  # left for the next run, not filed
    assert StateStore(root_dir).load().generation == 0


class _Hangs:
    """An applier whose run never ends (a playbook stuck in a drain, a wedged Docker call)."""

    def __init__(self, marker: Path, **options: Any) -> None:
        self.marker = marker

    def apply(self, envelope: bytes, **kwargs: Any) -> Any:
        self.marker.write_text(str(kwargs["generation"]))
        time.sleep(3600)
        raise AssertionError("killed long before")


def test_a_bundle_below_one_whose_apply_was_killed_is_refused_and_the_killed_one_applies_again(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = make_airgap_node(site, split=True)
    root_dir = site / "apply"
    root = prepare_root_dir(root_dir, agent_dir=node.state_dir)
    old = state_bundle(node, "g1.tar", generation=1)
    _drop(node, state_bundle(node, "g2.tar", generation=2), "g2.tar")
    marker = site / "applying"

    pid = os.fork()
    if pid == 0:  # root's inbox unit, applying generation 2 when it is killed
        try:
            take_bundles(
                node.config,
                root,
                node.policy,
                untrusted_uid=AGENT_UID,
                applier=lambda **options: _Hangs(marker, **options),
            )
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            if time.monotonic() > deadline:  # a liveness bound, not a timing assertion
                pytest.fail("the inbox never started applying generation 2")
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    assert sorted(os.listdir(node.inbox)) == ["g2.tar"]  # killed before it was filed: taken again
    assert StateStore(root_dir).load().generation == 0  # never recorded applied

    _drop(node, old, "g1-redelivered.tar")  # sorts first: refused before g2 runs again
    assert _root(node) == 1

    assert "bundle g1-redelivered.tar: rejected (replayed" in capsys.readouterr().out
    rejected = node.filed("rejected")["g1-redelivered.tar"]
    assert rejected["reason"] == "replayed" and "which this host accepted" in rejected["message"]
    assert node.filed("processed")["g2.tar"]["result"] == "applied"
    after = StateStore(root_dir).load()
    assert (after.generation, after.accepted) == (2, None)
    document = read_outcomes(root_dir / "public", node_id=node.node_id)
    assert document is not None and document.applied.generation == 2 and document.applied.accepted is None

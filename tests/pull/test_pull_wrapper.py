"""meridian-node-pull as meridian-node-pull.service runs it, against a real git repo with SSH-signed commits.

The role is applied once (install paths in a temp dir); each test gets a fresh origin repo at the same URL and
empty state, runs the rendered unit's ExecStart with systemd's environment, and reads the marker file that the
repo's local.yml writes with the applied commit id.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.pull.pull_env import (
    Installed,
    PlaybookRepo,
    apply_role,
    git,
    install_paths,
    make_ssh_key,
    public_key,
    role_vars,
    run_service,
)

EXIT_REFUSED = 3


@dataclass
class World:
    installed: Installed
    repo: PlaybookRepo
    trusted: Path
    untrusted: Path
    marker: Path
    home: Path

    def run(self) -> subprocess.CompletedProcess[str]:
        return run_service(self.installed, self.home)

    def marker_text(self) -> str | None:
        return self.marker.read_text() if self.marker.exists() else None

    def current(self) -> str | None:
        link = self.installed.checkout_dir / "current"
        return link.resolve().name if link.is_symlink() else None

    def last_run(self) -> dict[str, object]:
        loaded: dict[str, object] = json.loads((self.installed.state_dir / "last-run.json").read_text())
        return loaded


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Installed, Path, Path]:
    root = tmp_path_factory.mktemp("pull-install")
    keys = root / "keys"
    keys.mkdir()
    trusted, untrusted = make_ssh_key(keys, "release-signer"), make_ssh_key(keys, "stranger")
    paths = install_paths(root / "host")
    variables = role_vars(
        paths,
        f"file://{root / 'repo' / 'origin.git'}",
        [{"principal": "release@meridian", "key": public_key(trusted)}],
        ansible_pull_extra_vars={"marker": str(root / "marker.txt")},
    )
    done = apply_role(paths, variables)
    assert done.returncode == 0, done.stdout + done.stderr
    return paths, trusted, untrusted


@pytest.fixture
def world(installed: tuple[Installed, Path, Path]) -> Iterator[World]:
    paths, trusted, untrusted = installed
    root = paths.root.parent
    for stale in (root / "repo", paths.state_dir, root / "home"):
        shutil.rmtree(stale, ignore_errors=True)
    (root / "marker.txt").unlink(missing_ok=True)
    (root / "repo").mkdir()
    paths.checkout_dir.mkdir(parents=True)
    yield World(paths, PlaybookRepo(root / "repo"), trusted, untrusted, root / "marker.txt", root / "home")


def assert_refused(world: World, done: subprocess.CompletedProcess[str], commit: str, reason: str) -> None:
    assert done.returncode == EXIT_REFUSED, done.stdout + done.stderr
    assert f"REFUSED commit {commit}" in done.stdout
    assert reason in done.stdout
    assert "Nothing was applied" in done.stdout


def test_signed_commit_is_applied_at_exactly_that_commit(world: World) -> None:
    sha = world.repo.commit("r1", key=world.trusted)

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"commit {sha} (main of {world.repo.url}) is signed by release@meridian" in done.stdout
    assert world.marker_text() == f"{sha} r1\n"
    assert world.current() == sha
    assert world.last_run()["commit"] == sha and world.last_run()["result"] == "ok"


def test_unsigned_commit_is_refused_and_nothing_changes(world: World) -> None:
    applied = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    unsigned = world.repo.commit("r2-unsigned", key=None)

    done = world.run()

    assert_refused(world, done, unsigned, "it is not signed")
    assert world.marker_text() == f"{applied} r1\n"
    assert world.current() == applied
    assert world.last_run()["commit"] == applied


def test_commit_signed_by_untrusted_key_is_refused(world: World) -> None:
    stranger = world.repo.commit("r1-stranger", key=world.untrusted)

    done = world.run()

    assert_refused(world, done, stranger, "signed by a key that is not in the allowed signers file")
    assert "No principal matched" in done.stdout
    assert world.marker_text() is None
    assert world.current() is None


def test_forged_commit_reusing_a_good_signature_is_refused(world: World) -> None:
    applied = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    forged = world.repo.tamper(applied, "r1-forged")
    world.repo.push(forged)

    done = world.run()

    assert_refused(world, done, forged, "bad signature")
    assert world.marker_text() == f"{applied} r1\n"
    assert world.current() == applied


def test_commit_with_altered_signature_bytes_is_refused(world: World) -> None:
    applied = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    altered = world.repo.tamper_signature(world.repo.commit("r2", key=world.trusted))
    world.repo.push(altered)

    done = world.run()

    assert_refused(world, done, altered, "bad signature")
    assert world.marker_text() == f"{applied} r1\n"
    assert world.current() == applied


def test_force_push_to_an_unsigned_commit_is_refused(world: World) -> None:
    base = world.repo.commit("r1", key=world.trusted)
    applied = world.repo.commit("r2", key=world.trusted)
    assert world.run().returncode == 0
    git(world.repo.work, "reset", "--quiet", "--hard", base)
    rewritten = world.repo.commit("r2-rewritten-unsigned", key=None)

    done = world.run()

    assert_refused(world, done, rewritten, "it is not signed")
    assert world.marker_text() == f"{applied} r2\n"
    assert world.current() == applied


def test_rewrite_to_a_signed_commit_is_applied_and_noted(world: World) -> None:
    base = world.repo.commit("r1", key=world.trusted)
    world.repo.commit("r2", key=world.trusted)
    assert world.run().returncode == 0
    git(world.repo.work, "reset", "--quiet", "--hard", base)
    rewritten = world.repo.commit("r2-rewritten", key=world.trusted)

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert "history rewritten" in done.stdout
    assert world.marker_text() == f"{rewritten} r2-rewritten\n"


def test_unchanged_commit_after_success_skips_the_play(world: World) -> None:
    sha = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    world.marker.unlink()

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert "already applied; nothing to do" in done.stdout
    assert world.marker_text() is None, "the play ran again for an unchanged, successful commit"
    assert world.last_run()["commit"] == sha


def test_failed_play_is_retried_on_the_same_commit(world: World) -> None:
    sha = world.repo.commit("r1-failing", key=world.trusted, failing=True)

    first, second = world.run(), world.run()

    assert first.returncode == 1 and second.returncode == 1, first.stdout + second.stdout
    assert "already applied" not in second.stdout
    assert "Fail on purpose" in second.stdout
    assert world.last_run() | {"finished": 0, "seconds": 0, "play": ""} == {
        "commit": sha,
        "play": "",
        "signer": "release@meridian",
        "result": "failed",
        "rc": 2,
        "finished": 0,
        "seconds": 0,
    }


def test_run_while_another_holds_the_lock_does_nothing(world: World) -> None:
    world.repo.commit("r1", key=world.trusted)
    world.installed.state_dir.mkdir(parents=True, exist_ok=True)

    with (world.installed.state_dir / "lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = world.run()

    assert done.returncode == 1
    assert "another run holds" in done.stdout
    assert world.marker_text() is None


def test_changed_extra_vars_rerun_an_unchanged_commit(world: World) -> None:
    sha = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    config_path = world.installed.config_dir / "pull.json"
    original = config_path.read_text()
    config = json.loads(original)
    moved = world.marker.with_name("marker-moved.txt")
    config["extra_vars"]["marker"] = str(moved)
    config_path.write_text(json.dumps(config))
    try:
        done = world.run()
    finally:
        config_path.write_text(original)

    assert done.returncode == 0, done.stdout + done.stderr
    assert moved.read_text() == f"{sha} r1\n"
    moved.unlink()

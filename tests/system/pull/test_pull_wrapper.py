"""meridian-node-pull as meridian-node-pull.service runs it, against a real git repo with SSH-signed commits.

The role is applied once (install paths in a temp dir); each test gets a fresh origin repo at the same URL and
empty state, runs the rendered unit's ExecStart with systemd's environment, and reads the marker file that the
repo's local.yml writes with the applied commit id. Tests are named after what someone with push access but no
key tries: unsigned or forged commits, old signed ones pushed back, commits signed for another repository.
"""

from __future__ import annotations

import ast
import fcntl
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ansible_collections.meridian.node.roles.ansible_pull.files import meridian_node_pull
from ansible_collections.meridian.node.tests.system.pull.pull_env import (
    ROLLBACK_TRAILER,
    TARGET_TRAILER,
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

EXIT_CONFIG, EXIT_REFUSED = 2, 3
WRAPPER = meridian_node_pull.__file__


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

    def record_bytes(self) -> bytes:
        return (self.installed.state_dir / "last-run.json").read_bytes()


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


def assert_refused(
    world: World, done: subprocess.CompletedProcess[str], commit: str, reason: str, rule: str = "signature"
) -> None:
    assert done.returncode == EXIT_REFUSED, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "REFUSED" in line]
    assert line.startswith(f"meridian-node-pull: REFUSED commit {commit}: "), line
    assert reason in line
    assert line.endswith(
        f"Nothing was applied; the current checkout is unchanged (main of {world.repo.url}; refusal={rule})."
    )


def assert_unchanged(world: World, applied: str, revision: str, record: bytes) -> None:
    """The refused run changed nothing: the play did not run, current and the record are as they were."""
    assert world.marker_text() == f"{applied} {revision}\n"
    assert world.current() == applied
    assert world.record_bytes() == record


def test_signed_commit_is_applied_at_exactly_that_commit(world: World) -> None:
    sha = world.repo.commit("r1", key=world.trusted)

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"commit {sha} (main of {world.repo.url}) is signed by release@meridian" in done.stdout
    assert "no last-run record: a first run" in done.stdout
    assert world.marker_text() == f"{sha} r1\n"
    assert world.current() == sha
    assert world.last_run()["commit"] == sha and world.last_run()["result"] == "ok"


def test_commit_signed_by_untrusted_key_is_refused(world: World) -> None:
    stranger = world.repo.commit("r1-stranger", key=world.untrusted)

    done = world.run()

    assert_refused(world, done, stranger, "signed by a key that is not in the allowed signers file")
    assert "No principal matched" in done.stdout
    assert world.marker_text() is None
    assert world.current() is None


def _apply_r1_then_r2(world: World) -> tuple[str, str]:
    """Commit signed r1, then r2, and let the host apply them: (r1's id, r2's id)."""
    base = world.repo.commit("r1", key=world.trusted)
    applied = world.repo.commit("r2", key=world.trusted)
    assert world.run().returncode == 0
    return base, applied


def _rolled_back_to(world: World, base: str, names: str) -> str:
    """Rewrite main to ``base`` plus a signed commit r2-rolled-back whose rollback trailer names ``names``: its id."""
    git(world.repo.work, "reset", "--quiet", "--hard", base)
    trailers = world.repo.trailers(f"{ROLLBACK_TRAILER}: {names}")
    return world.repo.commit("r2-rolled-back", key=world.trusted, trailers=trailers)


# What someone with push access but no key pushes over an applied r2 (on r1): the new tip's id.
Push = Callable[[World, str, str], str]  # (world, r1, r2) -> the pushed tip


def _unsigned_on_top(world: World, base: str, applied: str) -> str:
    return world.repo.commit("r3-unsigned", key=None)


def _forged_reusing_a_good_signature(world: World, base: str, applied: str) -> str:
    forged = world.repo.tamper(applied, "r2-forged")
    world.repo.push(forged)
    return forged


def _altered_signature_bytes(world: World, base: str, applied: str) -> str:
    altered = world.repo.tamper_signature(world.repo.commit("r3", key=world.trusted))
    world.repo.push(altered)
    return altered


def _force_pushed_unsigned_rewrite(world: World, base: str, applied: str) -> str:
    git(world.repo.work, "reset", "--quiet", "--hard", base)
    return world.repo.commit("r2-rewritten-unsigned", key=None)


def _pushed_back_older(world: World, base: str, applied: str) -> str:
    world.repo.push(base)
    return base


def _rewritten_signed_history(world: World, base: str, applied: str) -> str:
    git(world.repo.work, "reset", "--quiet", "--hard", base)
    return world.repo.commit("r2-rewritten", key=world.trusted)


def _unrelated_signed_history(world: World, base: str, applied: str) -> str:
    git(world.repo.work, "checkout", "--quiet", "--orphan", "unrelated")
    return world.repo.commit("u1-unrelated-root", key=world.trusted)


def _push_over_applied(world: World, push: Push) -> tuple[str, str, bytes]:
    """Apply signed r1 then r2, then let ``push`` push over them: (r2's id, the pushed tip's id, the record)."""
    base, applied = _apply_r1_then_r2(world)
    pushed = push(world, base, applied)
    return applied, pushed, world.record_bytes()


@pytest.mark.parametrize(
    ("push", "reason"),
    [
        pytest.param(_unsigned_on_top, "it is not signed", id="unsigned-commit"),
        pytest.param(_forged_reusing_a_good_signature, "bad signature", id="forged-commit-reusing-a-good-signature"),
        pytest.param(_altered_signature_bytes, "bad signature", id="altered-signature-bytes"),
        pytest.param(_force_pushed_unsigned_rewrite, "it is not signed", id="force-push-to-an-unsigned-commit"),
    ],
)
def test_commit_without_a_good_signature_is_refused_and_nothing_changes(world: World, push: Push, reason: str) -> None:
    applied, pushed, before = _push_over_applied(world, push)

    done = world.run()

    assert_refused(world, done, pushed, reason)
    assert_unchanged(world, applied, "r2", before)


@pytest.mark.parametrize(
    "push",
    [
        pytest.param(_pushed_back_older, id="force-push-back-to-an-older-signed-commit"),
        pytest.param(_rewritten_signed_history, id="force-push-to-a-rewritten-signed-history"),
        pytest.param(_unrelated_signed_history, id="signed-history-that-descends-from-nothing"),
    ],
)
def test_signed_commit_that_does_not_descend_from_the_applied_one_is_refused(world: World, push: Push) -> None:
    applied, pushed, before = _push_over_applied(world, push)

    done = world.run()

    assert_refused(world, done, pushed, f"it does not descend from the last applied commit {applied}", rule="rollback")
    assert f"{ROLLBACK_TRAILER}: {applied}" in done.stdout, "the refusal should say how to roll back on purpose"
    assert_unchanged(world, applied, "r2", before)


def test_commit_signed_for_another_repository_is_refused(world: World, tmp_path: Path) -> None:
    # The other repository was forked from this one, so its commit even descends from the applied one: only
    # the signed target tells them apart. Someone with push access here copies it over.
    applied = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    other = PlaybookRepo(tmp_path / "other")
    git(other.work, "fetch", "--quiet", str(world.repo.origin), "main")
    git(other.work, "reset", "--quiet", "--hard", "FETCH_HEAD")
    foreign = other.commit("o2-for-the-other-repo", key=world.trusted)
    git(other.work, "push", "--quiet", "--force", str(world.repo.origin), f"{foreign}:refs/heads/main")
    before = world.record_bytes()

    done = world.run()

    reason = f'signed for another repository or branch ({TARGET_TRAILER}: "{other.repo_id} main")'
    assert_refused(world, done, foreign, reason, rule="target")
    assert f'"{TARGET_TRAILER}: {world.repo.repo_id} main"' in done.stdout
    assert_unchanged(world, applied, "r1", before)


def test_commit_signed_for_another_branch_is_refused(world: World) -> None:
    applied = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    staging = world.repo.commit("r2-for-staging", key=world.trusted, trailers=world.repo.trailers(branch="staging"))
    before = world.record_bytes()

    done = world.run()

    assert_refused(world, done, staging, f"signed for another repository or branch ({TARGET_TRAILER}: ", rule="target")
    assert_unchanged(world, applied, "r1", before)


def test_signed_commit_that_names_no_target_is_refused_even_on_a_first_run(world: World) -> None:
    untargeted = world.repo.commit("r1-no-target", key=world.trusted, trailers=[])

    done = world.run()

    assert_refused(world, done, untargeted, "its signed message names no target repository and branch", rule="target")
    assert world.marker_text() is None
    assert world.current() is None
    assert not (world.installed.state_dir / "last-run.json").exists()


def test_rollback_marker_naming_the_last_applied_commit_is_applied_and_noted(world: World) -> None:
    base, applied = _apply_r1_then_r2(world)
    rolled_back = _rolled_back_to(world, base, applied)

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"does not descend from the last applied {applied}" in done.stdout
    assert "history rewritten" in done.stdout
    assert world.marker_text() == f"{rolled_back} r2-rolled-back\n"
    assert world.last_run()["commit"] == rolled_back


def test_rollback_marker_also_moves_a_host_still_behind_the_replaced_tip(world: World) -> None:
    applied = world.repo.commit("r1", key=world.trusted)
    assert world.run().returncode == 0
    # r2 reached this host's mirror but was never applied (its target was wrong); the rewrite replaces it.
    replaced = world.repo.commit("r2-untargeted", key=world.trusted, trailers=[])
    assert world.run().returncode == EXIT_REFUSED
    git(world.repo.work, "checkout", "--quiet", "--orphan", "rewritten")
    rewritten = world.repo.commit(
        "n1-new-root", key=world.trusted, trailers=world.repo.trailers(f"{ROLLBACK_TRAILER}: {replaced}")
    )

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"does not descend from the last applied {applied}" in done.stdout
    assert world.marker_text() == f"{rewritten} n1-new-root\n"


def test_rollback_commit_pushed_again_after_history_moved_on_is_refused(world: World) -> None:
    base, replaced = _apply_r1_then_r2(world)
    marked = _rolled_back_to(world, base, replaced)
    assert world.run().returncode == 0
    applied = world.repo.commit("r3", key=world.trusted)
    assert world.run().returncode == 0
    world.repo.push(marked)
    before = world.record_bytes()

    done = world.run()

    assert_refused(
        world, done, marked, f"trailer names {replaced}, which is neither that commit nor a descendant", rule="rollback"
    )
    assert_unchanged(world, applied, "r3", before)


@pytest.mark.parametrize("named", ["another-commit", "abbreviated-id"])
def test_rollback_marker_that_does_not_name_this_hosts_commit_is_refused(world: World, named: str) -> None:
    base, applied = _apply_r1_then_r2(world)
    marker = {"another-commit": base, "abbreviated-id": applied[:12]}[named]
    rolled_back = _rolled_back_to(world, base, marker)
    before = world.record_bytes()

    done = world.run()

    reason = {
        "another-commit": f"trailer names {base}, which is neither that commit nor a descendant of it",
        "abbreviated-id": f'trailer "{marker}" is not a full commit id',
    }[named]
    assert_refused(world, done, rolled_back, reason, rule="rollback")
    assert_unchanged(world, applied, "r2", before)


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("", "it is not JSON"),
        ('{"commit": "r2"', "it is not JSON"),
        ('{"result": "ok"}', "its commit is null, not a full commit id"),
    ],
)
def test_damaged_record_stops_the_run_instead_of_starting_over(world: World, damage: str, named: str) -> None:
    # Read as a first run, a damaged record would let an old signed commit back in.
    older, applied = _apply_r1_then_r2(world)
    record = world.installed.state_dir / "last-run.json"
    record.write_text(damage)
    world.repo.push(older)

    done = world.run()

    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    assert f"state error: {record} is damaged ({named}" in done.stdout
    assert "rev-parse refs/meridian-pull/applied" in done.stdout, "the error should say how to restore it"
    assert world.marker_text() == f"{applied} r2\n"
    assert world.current() == applied
    assert record.read_text() == damage


def test_removed_record_is_a_first_run(world: World) -> None:
    # An operator's deliberate reset (the README): root removes the record, the next run accepts any signed tip.
    older, _applied = _apply_r1_then_r2(world)
    (world.installed.state_dir / "last-run.json").unlink()
    world.repo.push(older)

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    assert "no last-run record: a first run" in done.stdout
    assert world.marker_text() == f"{older} r1\n"


def test_record_names_the_commit_before_its_play_runs(world: World) -> None:
    # A run killed mid-play has changed the host: its commit must already be the one later commits descend from.
    seen = world.marker.with_name("record-seen-by-the-play.json")
    copy_record = f"""\
    - name: Copy the wrapper's record as the play sees it
      ansible.builtin.copy:
        src: "{world.installed.state_dir / "last-run.json"}"
        dest: "{seen}"
        remote_src: true
        mode: "0644"
"""
    sha = world.repo.commit("r1", key=world.trusted, extra_tasks=copy_record)

    done = world.run()

    assert done.returncode == 0, done.stdout + done.stderr
    during = json.loads(seen.read_text())
    seen.unlink()
    assert (during["commit"], during["result"]) == (sha, "started")
    assert world.last_run()["result"] == "ok"


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


@pytest.mark.parametrize(
    ("url", "identity"),
    [
        ("https://git.example.com/fleet/node-playbooks.git", "git.example.com/fleet/node-playbooks"),
        ("https://deploy:token@Git.Example.com:8443/fleet/node-playbooks/", "git.example.com/fleet/node-playbooks"),
        ("ssh://git@git.example.com:2222/fleet/node-playbooks.git", "git.example.com/fleet/node-playbooks"),
        ("git@git.example.com:fleet/node-playbooks.git", "git.example.com/fleet/node-playbooks"),
        ("file:///srv/git/node-playbooks.git", "/srv/git/node-playbooks"),
        ("/srv/git/node-playbooks.git/", "/srv/git/node-playbooks"),
    ],
)
def test_repository_identity_is_one_name_whichever_url_reaches_it(url: str, identity: str) -> None:
    assert meridian_node_pull.repo_identity(url) == identity


def test_wrapper_parses_as_python_3_9() -> None:
    # Hosts run it with their own python3 (Debian 11: 3.9); the venv here is newer.
    ast.parse(Path(WRAPPER).read_text(), filename=WRAPPER, feature_version=(3, 9))

"""Attacks on the store by a user who is not root: the agent's account, ``meridian``, taken over.

Tests run as root here, so "another user" is a made-up uid given with ``os.chown``: real filesystem state,
the same the store sees in production. Which check stops which attack:

- ``current`` re-pointed (an absolute path, ``..``, a temporary, a version that is itself a symlink):
  ``artifacts.layout.current_version``, the one rule the store lists by and an engine mounts by
  (``engines.converge.prepare.mounted_artifact``), on the resolved path.
- Writing into the store (a store directory or the index that it owns or can write): ``check_trust``
  refuses the whole store, naming the path, before anything is read or written.
- Replacing the store from above (a directory on the way to it that it owns or can write, or a symlink
  on the way that lives in such a directory): ``check_trust``, on every directory the lookup reads.
- A blob swapped for another file with the recorded size and mtime: its inode no longer matches the
  index, so it is re-hashed (and fetched again). Swapping needs write access to ``blobs/sha256``, which
  ``check_trust`` already refuses; this is the second line.
- A blob rewritten in place (after making it writable by others, or owned by the attacker) or kept through a hard
  link outside the store: the blob's mode, owner and link count. Such a blob is copied through the
  verifying fetcher into a fresh inode (re-ingested), never trusted. A hard link alone gives no write
  access to a root-owned 0444 blob (and fs.protected_hardlinks stops making one); it is refused as a sign
  that the file was once someone else's to write.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import current_version, promoted_dir
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import (
    ArtifactPathError,
    Store,
    StoreTrustError,
    ensure_artifact,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.verified_args import run as run_verified_artifact
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import mounted_artifact
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError
from ansible_collections.meridian.node.plugins.module_utils.trust import policy as policy_module
from ansible_collections.meridian.node.tests.collection.module_utils.artifacts.test_artifact_store import (
    ARTIFACT,
    CONTROL,
    Clock,
    Release,
    install,
)
from ansible_collections.meridian.node.tests.support.http_fixture import ArtifactServer
from ansible_collections.meridian.node.tests.support.shared_tmp import reachable_tmp_dir
from ansible_collections.meridian.node.tests.support.trust_fixtures import signed, write_policy
from meridian_node_agent import cli

OTHER = 4242  # a uid nobody on this machine has: "another user"
LAYOUT = ["", "blobs", "blobs/sha256", "staging", "artifacts", "artifacts/llama"]


@pytest.fixture
def release(server: ArtifactServer, store: Store, tmp_path: Path) -> Release:
    """Version 1.0 of ``llama``, installed and current."""
    installed = Release(server, "1.0", {"config.json": b"{}", "w.bin": os.urandom(64 * 1024)})
    install(store, installed, tmp_path)
    return installed


def snapshot(store: Store) -> dict[str, tuple[Any, ...]]:
    """Every entry under the store: type and mode, owner, inode, links, and its content or link target."""
    seen: dict[str, tuple[Any, ...]] = {}
    for base, dirs, files in os.walk(store.root):
        for name in dirs + files:
            path = os.path.join(base, name)
            info = os.lstat(path)
            if os.path.islink(path):
                content: str | None = os.readlink(path)
            elif os.path.isfile(path) and name != ".lock":  # the lock holds the last holder's pid
                content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                content = None
            seen[path] = (info.st_mode, info.st_uid, info.st_ino, info.st_nlink, content)
    return seen


def blob_of(store: Store, data: bytes) -> Path:
    return Path(store.blob_path(hashlib.sha256(data).hexdigest()))


# --- current ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["absolute", "dot-dot", "store-internals", "temporary", "symlinked-version"])
def test_a_current_link_pointing_outside_the_store_is_refused(
    release: Release, store: Store, tmp_path: Path, kind: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.bin").write_bytes(b"the attacker's weights")
    name_dir = Path(store.artifacts_dir) / "llama"
    target = {
        "absolute": str(outside),
        "dot-dot": os.path.relpath(outside, name_dir),
        "store-internals": "../../blobs/sha256",
        "temporary": ".2.0.build-x",
        "symlinked-version": "2.0",
    }[kind]
    if kind == "temporary":
        (name_dir / target).mkdir()
    if kind == "symlinked-version":
        (name_dir / "2.0").symlink_to(outside)
    link = name_dir / "current"
    link.unlink()
    link.symlink_to(target)
    before = snapshot(store)

    with pytest.raises(ArtifactPathError) as caught:
        install(store, release, tmp_path)
    assert f"{link} points at {target!r}" in str(caught.value)
    with pytest.raises(ArtifactPathError, match="points at"):
        store.list_versions()
    with pytest.raises(ArtifactPathError, match="points at"):
        promoted_dir(store.root, "llama")
    with pytest.raises(EngineInstanceError, match="refusing to mount it") as refused:
        mounted_artifact(store.root, "llama")
    assert str(link) in str(refused.value) and repr(target) in str(refused.value)
    assert refused.value.check == "artifact"
    assert snapshot(store) == before


def test_a_current_link_at_a_version_beside_it_is_followed(release: Release, store: Store) -> None:
    resolved = mounted_artifact(store.root, "llama")
    assert resolved == os.path.realpath(store.version_dir("llama", "1.0"))
    assert current_version(store.root, "llama") == "1.0"


def test_a_name_directory_that_is_a_link_to_another_name_is_refused(release: Release, store: Store) -> None:
    # artifacts/other -> llama: its `current` resolves beside a version, but of another artifact.
    other = Path(store.artifacts_dir) / "other"
    other.symlink_to("llama")
    before = snapshot(store)

    with pytest.raises(ArtifactPathError, match="not a version directory of 'other'"):
        current_version(store.root, "other")
    with pytest.raises(EngineInstanceError, match="refusing to mount it") as refused:
        mounted_artifact(store.root, "other")
    assert refused.value.check == "artifact"
    assert snapshot(store) == before


# --- the store's own directories and files ------------------------------------------------------------


@pytest.mark.parametrize("where", LAYOUT)
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_store_dir_writable_by_others_is_refused_with_its_path(
    release: Release, store: Store, tmp_path: Path, where: str, mode: int
) -> None:
    path = Path(store.root, where)
    os.chmod(path, mode)
    before = snapshot(store)
    with pytest.raises(StoreTrustError) as caught:
        install(store, release, tmp_path)
    message = str(caught.value)
    assert f"{path} is writable by" in message and f"(mode {mode:04o})" in message
    assert "chmod 0755" in message  # the message carries the fix
    with pytest.raises(StoreTrustError):
        store.list_versions()
    assert snapshot(store) == before


@pytest.mark.parametrize("where", [*LAYOUT, "index.json", ".lock"])
def test_a_store_entry_another_user_owns_is_refused_with_its_path(
    release: Release, store: Store, tmp_path: Path, where: str
) -> None:
    path = Path(store.root, where)
    os.chown(path, OTHER, OTHER)
    before = snapshot(store)
    with pytest.raises(StoreTrustError, match=re.escape(f"{path} is owned by uid {OTHER}")):
        install(store, release, tmp_path)
    with pytest.raises(StoreTrustError):
        install(store, release, tmp_path, check_mode=True)
    assert snapshot(store) == before


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646, 0o744])
def test_an_index_others_could_rewrite_is_refused(release: Release, store: Store, tmp_path: Path, mode: int) -> None:
    index = Path(store.root, "index.json")
    os.chmod(index, mode)
    before = snapshot(store)
    with pytest.raises(StoreTrustError, match=re.escape(f"{index} has mode {mode:04o}, more than the 0644")):
        install(store, release, tmp_path)
    assert snapshot(store) == before


def test_the_index_is_written_for_root_only_and_an_old_0644_one_is_still_read(
    release: Release, store: Store, tmp_path: Path
) -> None:
    index = Path(store.root, "index.json")
    assert index.stat().st_mode & 0o777 == 0o600
    assert Path(store.root, ".lock").stat().st_mode & 0o777 == 0o600
    os.chmod(index, 0o644)  # what releases before this one wrote
    assert not install(store, release, tmp_path).changed


def test_an_index_replaced_by_a_symlink_is_refused(release: Release, store: Store, tmp_path: Path) -> None:
    index = Path(store.root, "index.json")
    forged = tmp_path / "forged-index.json"
    forged.write_bytes(index.read_bytes())
    index.unlink()
    index.symlink_to(forged)
    with pytest.raises(StoreTrustError, match=re.escape(f"{index} is not a regular file")):
        install(store, release, tmp_path)


def test_a_symlink_in_the_stores_own_layout_is_refused(release: Release, store: Store, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store.staging_dir, elsewhere)
    shutil.rmtree(store.staging_dir)
    os.symlink(elsewhere, store.staging_dir)
    with pytest.raises(ArtifactPathError, match=re.escape(f"{store.staging_dir} is a symlink")):
        install(store, release, tmp_path)


# --- the directories above the store -------------------------------------------------------------------


def _directory_of_another_user(path: Path) -> Path:
    """``path``, made a directory owned by OTHER (uid and group)."""
    path.mkdir()
    os.chown(path, OTHER, OTHER)
    return path


def test_a_store_under_a_directory_another_user_owns_is_refused(
    server: ArtifactServer, tmp_path: Path, clock: Clock
) -> None:
    home = _directory_of_another_user(tmp_path / "home")
    store = Store(str(home / "store"), clock=clock)
    with pytest.raises(StoreTrustError) as caught:
        install(store, Release(server, "1.0", {"w.bin": b"weights"}), tmp_path)
    assert f"{home}, a directory on the way to it, is owned by uid {OTHER}" in str(caught.value)
    assert not (home / "store").exists()  # refused before anything was created
    assert server.requests == []


@pytest.mark.parametrize(("mode", "refused"), [(0o775, True), (0o757, True), (0o1777, False), (0o755, False)])
def test_a_store_under_a_directory_others_can_write_is_refused_unless_it_is_sticky(
    server: ArtifactServer, tmp_path: Path, clock: Clock, mode: int, refused: bool
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    store = Store(str(shared / "store"), clock=clock)
    release = Release(server, "1.0", {"w.bin": b"weights"})
    if refused:
        with pytest.raises(StoreTrustError, match=re.escape(f"{shared}, a directory on the way to it, is writable by")):
            install(store, release, tmp_path)
        assert not (shared / "store").exists()
    else:
        assert install(store, release, tmp_path).changed  # like /tmp: others cannot rename our entries


@pytest.mark.parametrize("link_in", ["trusted", "other"])
def test_a_store_reached_through_a_symlink_in_another_users_directory_is_refused(
    server: ArtifactServer, tmp_path: Path, clock: Clock, link_in: str
) -> None:
    # The store's real path may lie under trusted directories only, and still be reached through a link that
    # someone else can re-point: every directory the lookup reads counts, not only realpath's ancestors.
    trusted, other = tmp_path / "trusted", tmp_path / "other"
    trusted.mkdir()
    other.mkdir()
    (trusted / "real").mkdir()
    if link_in == "other":
        (other / "store").symlink_to(trusted / "real")
        path = other / "store"
    else:
        (trusted / "store").symlink_to(other / "hop")
        (other / "hop").symlink_to(trusted / "real")
        path = trusted / "store"
    os.chown(other, OTHER, OTHER)
    store = Store(str(path), clock=clock)
    with pytest.raises(
        StoreTrustError, match=re.escape(f"{other}, a directory on the way to it, is owned by uid {OTHER}")
    ):
        install(store, Release(server, "1.0", {"w.bin": b"weights"}), tmp_path)
    assert list((trusted / "real").iterdir()) == []


# --- blobs ---------------------------------------------------------------------------------------------


def test_a_swapped_blob_with_the_recorded_size_and_mtime_is_not_taken_as_verified(
    release: Release, store: Store, tmp_path: Path
) -> None:
    data = release.files["w.bin"]
    blob = blob_of(store, data)
    recorded = blob.stat()
    swapped = tmp_path / "swapped"
    swapped.write_bytes(os.urandom(len(data)))
    os.chmod(swapped, 0o444)
    os.utime(swapped, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))
    os.replace(swapped, blob)  # same name, size, mode, owner and mtime; a new inode
    assert blob.stat().st_size == recorded.st_size and blob.stat().st_mtime_ns == recorded.st_mtime_ns

    outcome = install(store, release, tmp_path)  # quick
    assert outcome.plan.rehash == (hashlib.sha256(data).hexdigest(),)
    assert outcome.result is not None and outcome.result.repaired == outcome.plan.rehash
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").read_bytes() == data


def test_a_blob_made_writable_and_rewritten_in_place_is_not_taken_as_verified(
    release: Release, store: Store, tmp_path: Path, server: ArtifactServer
) -> None:
    data = release.files["w.bin"]
    blob = blob_of(store, data)
    recorded = blob.stat()
    os.chmod(blob, 0o666)
    with open(blob, "r+b") as handle:
        handle.write(b"EVIL")
    os.utime(blob, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))
    assert blob.stat().st_ino == recorded.st_ino  # the index's size, inode and mtime all still match

    preview = install(store, release, tmp_path, check_mode=True)
    sha = hashlib.sha256(data).hexdigest()
    reason = "it is writable by its group and others (mode 0666; the store makes blobs 0444)"
    assert [(r.sha256, r.reason) for r in preview.plan.reingest] == [(sha, reason)]
    assert preview.changed and f"untrusted blob {sha[:12]}..." in preview.plan.diff()["before"]

    outcome = install(store, release, tmp_path)
    assert outcome.result is not None and outcome.result.repaired == (sha,)  # the copy failed its hash
    assert [f.sha256 for f in outcome.result.fetched] == [sha]
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").read_bytes() == data
    assert blob.stat().st_mode & 0o777 == 0o444 and blob.stat().st_ino != recorded.st_ino
    assert not install(store, release, tmp_path).changed


def test_a_blob_another_user_owns_is_reingested_into_a_fresh_inode_of_the_stores_own(
    release: Release, store: Store, tmp_path: Path, server: ArtifactServer
) -> None:
    data = release.files["w.bin"]
    blob = blob_of(store, data)
    old_inode = blob.stat().st_ino
    os.chown(blob, OTHER, OTHER)  # same bytes: but its owner could change them after any hash
    requests = len(server.requests)

    outcome = install(store, release, tmp_path)
    assert outcome.changed and outcome.result is not None
    assert outcome.result.reingested == (hashlib.sha256(data).hexdigest(),) and outcome.result.repaired == ()
    assert len(server.requests) == requests  # copied locally, not downloaded
    info = blob.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o444) and info.st_ino != old_inode
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").stat().st_ino == info.st_ino  # re-linked
    assert not install(store, release, tmp_path).changed


def test_a_blob_with_a_hard_link_outside_the_store_is_reingested_and_the_link_left_behind(
    release: Release, store: Store, tmp_path: Path
) -> None:
    data = release.files["w.bin"]
    blob = blob_of(store, data)
    kept = tmp_path / "kept-by-the-attacker"
    os.link(blob, kept)  # made while the attacker could (before protected_hardlinks, or as its owner)

    outcome = install(store, release, tmp_path)
    assert outcome.plan.reingest and "another name for it exists" in outcome.plan.reingest[0].reason
    assert outcome.result is not None and outcome.result.reingested
    assert kept.stat().st_ino != blob.stat().st_ino and blob.stat().st_nlink == 2  # the blob and w.bin
    assert not install(store, release, tmp_path).changed


def test_a_version_directory_another_user_owns_is_assembled_again(
    release: Release, store: Store, tmp_path: Path
) -> None:
    version_dir = Path(store.version_dir("llama", "1.0"))
    os.chown(version_dir, OTHER, OTHER)
    outcome = install(store, release, tmp_path)
    assert outcome.plan.assemble and outcome.changed
    assert version_dir.stat().st_uid == os.geteuid()
    assert (version_dir / "w.bin").read_bytes() == release.files["w.bin"]


# --- the store left at the old default inside the agent's directory ------------------------------------


def test_a_store_left_in_the_agents_directory_warns_how_to_move_it_instead_of_refusing(
    server: ArtifactServer, tmp_path: Path, clock: Clock
) -> None:
    agent_dir = _directory_of_another_user(tmp_path / "meridian-node")
    new = tmp_path / "meridian-node-artifacts"
    legacy = Store(str(agent_dir / "artifacts"), clock=clock, relocate_to=str(new))
    release = Release(server, "1.0", {"w.bin": b"weights"})
    assert install(legacy, release, tmp_path).changed

    (warning,) = legacy.check_trust()
    assert f"still at the old default {legacy.root}" in warning
    assert f"{agent_dir} is owned by uid {OTHER}, so that user can swap the model files" in warning
    assert f"mv -T {legacy.root} {new}" in warning and f"chown -R root:root {new}" in warning
    assert "re-created, by its replace strategy, on its next converge" in warning

    # Only that one directory is excused, and only for the store the policy defaulted to.
    with pytest.raises(StoreTrustError, match=re.escape(f"{agent_dir}, a directory on the way to it")):
        Store(legacy.root).check_trust()
    os.chown(legacy.blobs_dir, OTHER, OTHER)
    with pytest.raises(StoreTrustError, match=re.escape(f"{legacy.blobs_dir} is owned by uid {OTHER}")):
        legacy.check_trust()


def _store_left_at_the_old_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inside: str) -> tuple[Path, Path]:
    """The default store paths moved under ``tmp_path`` (the new one not made), with a store (its ``inside``
    directory) left at the old default, in the agent's directory, which OTHER owns: (old, new)."""
    agent_dir = tmp_path / "meridian-node"
    old, new = agent_dir / "artifacts", tmp_path / "meridian-node-artifacts"
    (old / inside).mkdir(parents=True)
    os.chown(agent_dir, OTHER, OTHER)
    monkeypatch.setattr(policy_module, "DEFAULT_STORE_PATH", str(new))
    monkeypatch.setattr(policy_module, "LEGACY_STORE_PATH", str(old))
    return old, new


def test_the_module_passes_the_move_warning_on_and_still_installs(
    server: ArtifactServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = _store_left_at_the_old_default(tmp_path, monkeypatch, "artifacts")
    new.mkdir()  # empty, as the apply unit's StateDirectory= leaves it
    release = Release(server, "1.0", {"w.bin": b"weights"})
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(signed("artifact-manifest", release.payload, [ARTIFACT]))
    policy = write_policy(tmp_path / "etc", control=[CONTROL], artifact=[ARTIFACT])  # no store.path
    params = {
        "manifest": str(manifest),
        "source": release.source,
        "state": "present",
        "pin": False,
        "promote": True,
        "verify": "quick",
        "in_use": [],
        "policy": str(policy),
        "timeout": 10.0,
        "attempts": 1,
        "lock_timeout": None,
    }
    warnings: list[str] = []
    result = run_verified_artifact(params, check_mode=False, diff=False, warn=warnings.append)
    assert result["changed"] and result["path"] == str(old / "artifacts" / "llama" / "1.0")
    assert len(warnings) == 1 and f"mv -T {old} {new}" in warnings[0]
    assert os.listdir(new) == []  # nothing was written to the new place


def test_artifact_cli_prints_the_move_warning_on_stderr(
    server: ArtifactServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    old, _new = _store_left_at_the_old_default(tmp_path, monkeypatch, "blobs")
    policy = write_policy(tmp_path / "etc", control=[CONTROL], artifact=[ARTIFACT])
    assert cli.main(["artifact", "list", "--policy", str(policy)]) == 0
    out, err = capsys.readouterr()
    assert f"meridian-node artifact: warning: the artifact store is still at the old default {old}" in err
    assert "holds no artifacts" in out


def test_artifact_list_run_unprivileged_says_the_index_is_roots(
    server: ArtifactServer, tmp_path: Path, clock: Clock
) -> None:
    # A directory others can reach (the test's own tmp_path is root's 0700), holding a root-owned store.
    with reachable_tmp_dir("meridian-store-") as shared:
        store = Store(str(shared / "store"), clock=clock)
        install(store, Release(server, "1.0", {"w.bin": b"weights"}), tmp_path)
        policy = write_policy(shared / "etc", control=[CONTROL])
        status, err = _as_other_user(["artifact", "list", "--policy", str(policy), "--store", store.root])
    assert status == 1
    assert f"the store index {store.root}/index.json is readable by root only" in err
    assert "sudo meridian-node artifact list" in err


def _as_other_user(argv: list[str]) -> tuple[int, str]:
    """``cli.main(argv)`` in a child process that has become uid ``OTHER``; its status and stderr."""
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                status = cli.main(argv)
            os.write(write_end, json.dumps([status, err.getvalue()]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0, data
    status, err = json.loads(data)
    return int(status), str(err)


def test_ensure_artifact_refuses_before_planning_on_a_tampered_store(
    release: Release, store: Store, tmp_path: Path
) -> None:
    # The one-call helper, not only the module, runs the checks (observe does).
    os.chmod(store.blobs_dir, 0o777)
    manifest, digest = release.verified(tmp_path)
    with pytest.raises(StoreTrustError):
        ensure_artifact(store, manifest, manifest_sha256=digest, source=release.source, check_mode=True)

"""The store end to end: signed manifest -> real HTTP server -> blobs -> assembled, promoted version.

Each test names the attack or fault; each checks the previous version stays intact and current.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts import fetch as artifact_fetch
from ansible_collections.meridian.node.plugins.module_utils.artifacts import store as artifact_store
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import FetchConfig
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import (
    ArtifactIntegrityError,
    ArtifactPathError,
    ArtifactStoreError,
    DiskFullError,
    Store,
    StoreLockedError,
    ensure_artifact,
    plan_artifact,
    remove_artifact,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    ArtifactManifest,
    ManifestFile,
    ValidationError,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import (
    Rejection,
    RejectionCode,
    verify_artifact_manifest,
)
from ansible_collections.meridian.node.tests.support.http_fixture import ArtifactServer, small_tmpfs
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    artifact_manifest,
    make_key,
    signed,
    write_policy,
)

MIB = 1024 * 1024
ARTIFACT = make_key()
CONTROL = make_key()
STRANGER = make_key()
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def tick(self, minutes: int = 1) -> None:
        self.now += timedelta(minutes=minutes)


class Release:
    """One artifact version: its files (published on the server) and its signed, verified manifest."""

    def __init__(self, server: ArtifactServer, version: str, files: dict[str, bytes], name: str = "llama") -> None:
        self.name, self.version, self.files = name, version, files
        for path, data in files.items():
            server.files[f"{name}/{version}/{path}"] = data
        self.source = f"{server.url}/{name}/{version}"
        self.payload = artifact_manifest(
            name=name,
            version=version,
            files=[{"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for p, d in files.items()],
        )

    def verified(self, tmp_path: Path) -> tuple[ArtifactManifest, str]:
        policy = load_policy(write_policy(tmp_path / "policy", control=[CONTROL], artifact=[ARTIFACT]))
        result = verify_artifact_manifest(signed("artifact-manifest", self.payload, [ARTIFACT]), policy)
        return result.manifest, result.payload_sha256


def install(store: Store, release: Release, tmp_path: Path, **options: Any) -> artifact_store.StoreOutcome:
    manifest, digest = release.verified(tmp_path)
    options.setdefault("config", FetchConfig(timeout_s=10, attempts=2, sleep=lambda s: None))
    return ensure_artifact(store, manifest, manifest_sha256=digest, source=release.source, **options)


def current(store: Store, name: str = "llama") -> str | None:
    link = Path(store.artifacts_dir) / name / "current"
    return os.readlink(link) if link.is_symlink() else None


def blob_names(store: Store) -> set[str]:
    return set(os.listdir(store.blobs_dir)) if os.path.isdir(store.blobs_dir) else set()


def staged(store: Store) -> list[str]:
    return os.listdir(store.staging_dir) if os.path.isdir(store.staging_dir) else []


def test_untrusted_or_under_threshold_manifest_is_rejected(tmp_path: Path) -> None:
    payload = artifact_manifest()
    policy = load_policy(write_policy(tmp_path, control=[CONTROL], artifact=[ARTIFACT]))
    with pytest.raises(Rejection) as caught:
        verify_artifact_manifest(signed("artifact-manifest", payload, [STRANGER]), policy)
    assert caught.value.code is RejectionCode.THRESHOLD_NOT_MET
    two = make_key()
    strict = load_policy(
        write_policy(tmp_path / "strict", control=[CONTROL], artifact=[ARTIFACT, two], artifact_threshold=2)
    )
    with pytest.raises(Rejection) as caught:
        verify_artifact_manifest(signed("artifact-manifest", payload, [ARTIFACT]), strict)
    assert caught.value.code is RejectionCode.THRESHOLD_NOT_MET


def test_present_fetches_links_records_and_promotes(server: ArtifactServer, store: Store, tmp_path: Path) -> None:
    shared = os.urandom(MIB)
    release = Release(server, "1.0", {"config.json": b"{}", "shards/a.bin": shared, "shards/b.bin": shared})
    outcome = install(store, release, tmp_path, pin=True)
    assert outcome.changed and outcome.result is not None
    assert len(outcome.plan.fetch) == 2  # identical content is fetched once
    version_dir = Path(store.version_dir("llama", "1.0"))
    for path, data in release.files.items():
        file = version_dir / path
        assert file.read_bytes() == data
        blob = Path(store.blob_path(hashlib.sha256(data).hexdigest()))
        assert os.stat(file).st_ino == os.stat(blob).st_ino
        assert not os.access(blob, os.W_OK) or os.geteuid() == 0
    assert current(store) == "1.0"
    rows = store.list_versions()
    assert rows == [
        {
            "name": "llama",
            "version": "1.0",
            "size": MIB + 2,
            "pinned": True,
            "last_used": "2026-01-01T00:00:00Z",
            "current": True,
        }
    ]
    assert staged(store) == []


def count_hashers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (until the test ends), one entry in the list returned per SHA-256 hasher the fetch code
    starts: how many files it hashed."""
    hashers: list[int] = []
    real = artifact_fetch.new_sha256

    def counting() -> Any:
        hashers.append(1)
        return real()

    monkeypatch.setattr(artifact_fetch, "new_sha256", counting)
    return hashers


def test_rerun_with_the_same_manifest_is_unchanged_and_hashes_nothing(
    server: ArtifactServer, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = Release(server, "1.0", {"w.bin": os.urandom(2 * MIB)})
    install(store, release, tmp_path)
    hashers = count_hashers(monkeypatch)
    requests_before = len(server.requests)
    again = install(store, release, tmp_path)
    assert not again.changed and not again.plan.changed
    assert hashers == []
    assert len(server.requests) == requests_before

    full = install(store, release, tmp_path, verify="full")
    assert not full.changed
    assert len(hashers) == 1 and full.result is not None and full.result.rehashed


def test_blob_corrupted_in_place_is_repaired_by_verify_full(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    data = os.urandom(MIB)
    release = Release(server, "1.0", {"w.bin": data})
    install(store, release, tmp_path)
    blob = Path(store.blob_path(hashlib.sha256(data).hexdigest()))
    stat = blob.stat()
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as handle:
        handle.write(b"EVIL")
    os.utime(blob, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # an attacker restores the mtime
    assert not install(store, release, tmp_path).changed  # quick trusts the record: documented limit
    outcome = install(store, release, tmp_path, verify="full")
    assert outcome.changed and outcome.result is not None and outcome.result.repaired
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").read_bytes() == data


@pytest.mark.parametrize(
    ("mode", "reason"), [("substitute", "digest-mismatch"), ("too-long", "too-long"), ("too-short", "too-short")]
)
def test_bad_bytes_are_deleted_and_the_previous_version_keeps_serving(
    server: ArtifactServer, store: Store, tmp_path: Path, mode: str, reason: str
) -> None:
    install(store, Release(server, "1.0", {"w.bin": os.urandom(MIB)}), tmp_path)
    blobs_before = blob_names(store)
    release = Release(server, "2.0", {"w.bin": os.urandom(MIB)})
    if mode == "substitute":
        server.files["llama/2.0/w.bin"] = os.urandom(MIB)
    else:
        server.mode = mode
    with pytest.raises(ArtifactIntegrityError) as caught:
        install(store, release, tmp_path)
    assert caught.value.reason == reason
    assert current(store) == "1.0"
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").is_file()
    assert not Path(store.version_dir("llama", "2.0")).exists()
    assert blob_names(store) == blobs_before
    assert staged(store) == []


@pytest.mark.parametrize(
    ("path", "problem"),
    [("../escape.bin", "'..'"), ("/etc/passwd", "relative"), ("a/./b", "'.'"), ("a\\b", "relative")],
)
def test_escaping_paths_are_refused_by_the_store_itself(store: Store, path: str, problem: str) -> None:
    with pytest.raises(ValidationError):
        ArtifactManifest.model_validate(artifact_manifest(files=[{"path": path, "size": 1, "sha256": "ab" * 32}]))
    forged = ArtifactManifest.model_construct(
        apiVersion="meridian.node/v1",
        kind="ArtifactManifest",
        name="llama",
        version="1.0",
        base_url="http://127.0.0.1:9/",
        files=[ManifestFile.model_construct(path=path, size=1, sha256="ab" * 32, url=None)],
    )
    with pytest.raises(ArtifactPathError, match=problem):
        ensure_artifact(store, forged, manifest_sha256="0" * 64)
    assert not Path(store.artifacts_dir).exists() or os.listdir(store.artifacts_dir) == []


@pytest.mark.parametrize(
    ("paths", "message"), [(["W.bin", "w.bin"], "collide"), (["d", "d/x.bin"], "both a file and the directory")]
)
def test_colliding_paths_are_refused_by_the_store_itself(store: Store, paths: list[str], message: str) -> None:
    forged = ArtifactManifest.model_construct(
        apiVersion="meridian.node/v1",
        kind="ArtifactManifest",
        name="llama",
        version="1.0",
        base_url=None,
        files=[ManifestFile.model_construct(path=p, size=1, sha256="ab" * 32, url=None) for p in paths],
    )
    with pytest.raises(ArtifactPathError, match=message):
        ensure_artifact(store, forged, manifest_sha256="0" * 64)


def test_version_called_current_would_shadow_the_switch(store: Store) -> None:
    with pytest.raises(ValidationError, match="version 'current' is reserved"):
        ArtifactManifest.model_validate(artifact_manifest(version="current"))
    # The contract refuses it; the store refuses it again for callers that skipped validation.
    manifest = ArtifactManifest.model_construct(
        **{**ArtifactManifest.model_validate(artifact_manifest()).__dict__, "version": "current"}
    )
    with pytest.raises(ArtifactPathError, match="current"):
        ensure_artifact(store, manifest, manifest_sha256="0" * 64, check_mode=True)


def test_symlink_where_a_manifest_file_would_go_is_refused(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    install(store, Release(server, "1.0", {"w.bin": os.urandom(1000)}), tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    planted = Path(store.version_dir("llama", "2.0"))
    planted.mkdir()
    (planted / "w.bin").symlink_to(outside)
    with pytest.raises(ArtifactPathError, match="symlink"):
        install(store, Release(server, "2.0", {"w.bin": os.urandom(1000)}), tmp_path)
    assert outside.read_text() == "precious"
    assert current(store) == "1.0"


def test_artifact_directory_replaced_by_a_symlink_is_refused(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Path(store.artifacts_dir).mkdir(parents=True)
    (Path(store.artifacts_dir) / "llama").symlink_to(elsewhere)
    with pytest.raises(ArtifactPathError, match="symlink"):
        install(store, Release(server, "1.0", {"w.bin": b"abc"}), tmp_path)
    assert list(elsewhere.iterdir()) == []


def test_disk_full_mid_download_cleans_staging_and_keeps_the_previous_version(
    server: ArtifactServer, tmp_path: Path, clock: Clock
) -> None:
    with small_tmpfs(tmp_path / "small", "4m") as small:
        store = Store(str(small / "store"), clock=clock)
        install(store, Release(server, "1.0", {"w.bin": os.urandom(MIB)}), tmp_path)
        with pytest.raises(DiskFullError) as caught:
            install(store, Release(server, "2.0", {"w.bin": os.urandom(6 * MIB)}), tmp_path)
        assert "disk is full" in str(caught.value)
        assert staged(store) == []
        assert current(store) == "1.0"
        assert (Path(store.version_dir("llama", "1.0")) / "w.bin").stat().st_size == MIB


_CHILD = """
import json, sys
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import FetchConfig
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store, ensure_artifact
from ansible_collections.meridian.node.plugins.module_utils.contracts import ArtifactManifest
root, manifest, source = sys.argv[1:4]
ensure_artifact(Store(root), ArtifactManifest.model_validate_json(manifest), manifest_sha256="0" * 64,
                source=source, config=FetchConfig(chunk_size=64 * 1024))
"""


def test_sigkill_mid_download_then_rerun_resumes_from_the_partial_file(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    data = os.urandom(4 * MIB)
    release = Release(server, "1.0", {"w.bin": data})
    manifest, digest = release.verified(tmp_path)
    server.mode, server.slow_chunk, server.slow_delay = "slow", 64 * 1024, 0.05
    staging = Path(store.staging_path(hashlib.sha256(data).hexdigest()))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, store.root, manifest.model_dump_json(), release.source])
    try:
        deadline = time.monotonic() + 60
        while not (staging.exists() and staging.stat().st_size >= MIB):
            assert child.poll() is None, "the download finished or failed before it could be killed"
            if time.monotonic() > deadline:  # a liveness limit, not a speed target
                pytest.fail("the child never got 1 MiB into the download")
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
    assert child.returncode == -signal.SIGKILL
    partial = staging.stat().st_size
    assert 0 < partial < len(data)

    server.mode = "normal"
    outcome = ensure_artifact(store, manifest, manifest_sha256=digest, source=release.source, lock_timeout_s=5)
    assert outcome.result is not None
    assert outcome.result.fetched[0].resumed_from == partial
    assert server.ranges()[-1] == f"bytes={partial}-"
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").read_bytes() == data
    assert current(store) == "1.0" and staged(store) == []


def test_two_runs_at_once_one_waits_and_one_verified_copy_results(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    release = Release(server, "1.0", {"w.bin": os.urandom(2 * MIB)})
    manifest, digest = release.verified(tmp_path)
    server.mode, server.slow_chunk, server.slow_delay = "slow", 256 * 1024, 0.02
    outcomes: list[artifact_store.StoreOutcome] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run() -> None:
        try:
            start.wait()
            outcomes.append(ensure_artifact(store, manifest, manifest_sha256=digest, source=release.source))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _run in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert sorted(outcome.changed for outcome in outcomes) == [False, True]
    assert [r.status for r in server.requests] == [200]  # downloaded once
    assert blob_names(store) == {hashlib.sha256(release.files["w.bin"]).hexdigest()}
    assert current(store) == "1.0"


def test_lock_held_too_long_is_a_clear_error_and_a_killed_holder_leaves_no_lock(store: Store) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store\n"
            "with Store(sys.argv[1]).lock():\n    print('locked', flush=True)\n    time.sleep(600)\n",
            store.root,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"), store.lock(timeout_s=0.2):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with store.lock(timeout_s=10):
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        holder.wait(timeout=30)


def test_eviction_is_lru_and_keeps_pinned_current_and_in_use(
    server: ArtifactServer, store: Store, tmp_path: Path, clock: Clock
) -> None:
    def put(name: str, version: str, **options: Any) -> Release:
        release = Release(server, version, {"w.bin": os.urandom(MIB)}, name=name)
        install(store, release, tmp_path, **options)
        clock.tick()
        return release

    put("used", "1", promote=False)  # oldest, but its name is in use by an engine
    old = put("m", "1", promote=False)
    put("m", "2", promote=False, pin=True)
    newer = put("m", "3", promote=False)
    put("m", "4")  # current
    incoming = Release(server, "5", {"w.bin": os.urandom(MIB)}, name="m")
    manifest, digest = incoming.verified(tmp_path)

    roomy = plan_artifact(
        manifest,
        store.observe("m", "5"),
        manifest_sha256=digest,
        source=incoming.source,
        max_bytes=int(5.5 * MIB),
        in_use={"used"},
    )
    assert [(e.name, e.version) for e in roomy.evict] == [("m", "1")]

    outcome = install(store, incoming, tmp_path, max_bytes=4 * MIB, in_use=["used"])
    assert [(e.name, e.version) for e in outcome.plan.evict] == [("m", "1"), ("m", "3")]
    for gone in (old, newer):
        assert not Path(store.version_dir("m", gone.version)).exists()
        assert hashlib.sha256(gone.files["w.bin"]).hexdigest() not in blob_names(store)
    kept = {(row["name"], row["version"]) for row in store.list_versions()}
    assert kept == {("used", "1"), ("m", "2"), ("m", "4"), ("m", "5")}
    assert len(blob_names(store)) == 4
    assert current(store, "m") == "5"


def test_budget_that_cannot_be_met_fails_before_anything_changes(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    install(store, Release(server, "1", {"w.bin": os.urandom(MIB)}), tmp_path, pin=True)
    index_before = Path(store.root, "index.json").read_bytes()
    with pytest.raises(ArtifactStoreError, match=r"does not fit the store budget.*llama/1 \(pinned\)"):
        install(store, Release(server, "2", {"w.bin": os.urandom(MIB)}), tmp_path, max_bytes=MIB + MIB // 2)
    assert Path(store.root, "index.json").read_bytes() == index_before
    assert current(store) == "1"


def test_check_mode_reports_fetch_promote_and_evict_without_touching_the_store(
    server: ArtifactServer, store: Store, tmp_path: Path, clock: Clock
) -> None:
    install(store, Release(server, "1", {"w.bin": os.urandom(MIB)}), tmp_path, promote=False)
    clock.tick()
    install(store, Release(server, "2", {"w.bin": os.urandom(MIB)}), tmp_path)
    snapshot = sorted(str(p) for p in Path(store.root).rglob("*"))
    requests = len(server.requests)
    outcome = install(
        store, Release(server, "3", {"w.bin": os.urandom(MIB)}), tmp_path, check_mode=True, max_bytes=2 * MIB
    )
    assert outcome.result is None and outcome.changed
    summary = outcome.plan.summary()
    assert [f["path"] for f in summary["fetch"]] == ["w.bin"]
    assert summary["promote"] and summary["previous_current"] == "2"
    assert summary["evict"] == [{"name": "llama", "version": "1", "size": MIB}]
    diff = outcome.plan.diff()
    assert "current: 2" in diff["before"] and "current: 3" in diff["after"] and "evicted llama/1" in diff["after"]
    assert sorted(str(p) for p in Path(store.root).rglob("*")) == snapshot
    assert len(server.requests) == requests


def test_absent_removes_the_version_its_switch_and_unreferenced_blobs(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    shared = os.urandom(1000)
    install(store, Release(server, "1", {"s.bin": shared, "a.bin": os.urandom(1000)}), tmp_path, promote=False)
    install(store, Release(server, "2", {"s.bin": shared, "b.bin": os.urandom(1000)}), tmp_path)
    with pytest.raises(ArtifactStoreError, match="an engine uses"):
        remove_artifact(store, "llama", "2", in_use=["llama"])
    outcome = remove_artifact(store, "llama", "2")
    assert outcome.changed
    assert current(store) is None
    assert not Path(store.version_dir("llama", "2")).exists()
    assert len(blob_names(store)) == 2  # shared + a.bin stay for version 1
    assert not remove_artifact(store, "llama", "2").changed
    remove_artifact(store, "llama", "1")
    assert blob_names(store) == set() and not (Path(store.artifacts_dir) / "llama").exists()
    assert json.loads(Path(store.root, "index.json").read_text())["versions"] == {}


def test_blob_left_by_a_crash_before_the_index_write_is_adopted_not_downloaded(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    data = os.urandom(MIB)
    release = Release(server, "1", {"w.bin": data})
    Path(store.blobs_dir).mkdir(parents=True)
    Path(store.blob_path(hashlib.sha256(data).hexdigest())).write_bytes(data)
    outcome = install(store, release, tmp_path)
    assert outcome.plan.fetch == () and outcome.plan.rehash
    assert server.requests == []
    assert (Path(store.version_dir("llama", "1")) / "w.bin").read_bytes() == data


def test_exported_names_exist() -> None:
    for module in (artifact_fetch, artifact_store):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_temporaries_left_by_a_killed_assembly_are_cleared_on_the_next_run(
    server: ArtifactServer, store: Store, tmp_path: Path
) -> None:
    name_dir = Path(store.artifacts_dir) / "llama"
    (name_dir / ".1.build-abc123" / "half").mkdir(parents=True)
    (name_dir / ".current.999.tmp").symlink_to("1")
    install(store, Release(server, "1", {"w.bin": b"weights"}), tmp_path)
    assert sorted(os.listdir(name_dir)) == ["1", "current"]


@pytest.mark.slow
def test_one_gib_artifact_streams_verifies_and_reruns_without_rehash(
    server: ArtifactServer, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with source.open("wb") as handle:
        block = os.urandom(MIB)
        for index in range(1024):
            # Every MiB differs, so a misplaced or repeated chunk changes the digest.
            chunk = index.to_bytes(8, "big") + block[8:]
            digest.update(chunk)
            handle.write(chunk)
    server.disk_files["big/1/model.bin"] = source
    manifest = ArtifactManifest.model_validate(
        artifact_manifest(
            name="big",
            version="1",
            files=[{"path": "model.bin", "size": 1024 * MIB, "sha256": digest.hexdigest()}],
        )
    )
    outcome = ensure_artifact(store, manifest, manifest_sha256="0" * 64, source=f"{server.url}/big/1")
    assert outcome.result is not None and outcome.result.fetched[0].size == 1024 * MIB
    assert (Path(store.version_dir("big", "1")) / "model.bin").stat().st_size == 1024 * MIB

    hashers = count_hashers(monkeypatch)
    assert not ensure_artifact(store, manifest, manifest_sha256="0" * 64, source=f"{server.url}/big/1").changed
    assert hashers == []


def test_abandoned_partial_download_is_removed_while_fresh_and_resumed_ones_stay(
    server: ArtifactServer, store: Store, tmp_path: Path, clock: Clock
) -> None:
    data = os.urandom(2 * MIB)
    release = Release(server, "1.0", {"w.bin": data})
    Path(store.staging_dir).mkdir(parents=True)

    def leave_partial(sha: str, content: bytes, age: timedelta) -> Path:
        path = Path(store.staging_path(sha))
        path.write_bytes(content)
        stamp = (clock.now - age).timestamp()
        os.utime(path, (stamp, stamp))
        return path

    abandoned = leave_partial("e" * 64, os.urandom(5000), timedelta(days=8))
    fresh = leave_partial("d" * 64, os.urandom(3000), timedelta(hours=1))
    resumed = leave_partial(hashlib.sha256(data).hexdigest(), data[:MIB], timedelta(days=30))
    stray = Path(store.staging_dir, "notes.txt")
    stray.write_text("not ours to judge")

    preview = install(store, release, tmp_path, check_mode=True)
    assert [(d.sha256, d.reason) for d in preview.plan.drop_partials] == [("e" * 64, "stale")]
    assert "removed partial download eeeeeeeeeeee... (stale)" in preview.plan.diff()["after"]
    assert abandoned.exists() and fresh.exists() and resumed.exists()  # check mode deletes nothing

    outcome = install(store, release, tmp_path)
    assert outcome.result is not None and outcome.result.dropped_partials == ("e" * 64,)
    assert not abandoned.exists()
    assert fresh.read_bytes() and stray.exists()
    assert outcome.result.fetched[0].resumed_from == MIB  # the old partial of the wanted file was resumed
    assert server.ranges()[-1] == f"bytes={MIB}-"
    assert (Path(store.version_dir("llama", "1.0")) / "w.bin").read_bytes() == data
    assert sorted(staged(store)) == sorted([fresh.name, stray.name])

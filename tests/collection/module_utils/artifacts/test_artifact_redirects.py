"""Redirects against real HTTP and HTTPS servers on loopback (real TLS, a CA made per test session).

Mirrors and object stores answer with redirects to signed URLs; each test is a way that can go wrong.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import (
    ArtifactTransferError,
    FetchConfig,
    FetchResult,
    fetch_file,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store, ensure_artifact
from ansible_collections.meridian.node.plugins.module_utils.contracts import ArtifactManifest
from ansible_collections.meridian.node.tests.support.http_fixture import (
    ArtifactServer,
    TlsMaterial,
    running_artifact_server,
    tls_material,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import artifact_manifest

MIB = 1024 * 1024
DATA = os.urandom(2 * MIB + 777)
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def mirror(tls: TlsMaterial) -> Iterator[ArtifactServer]:
    """The https URL the manifest or source names; it only redirects."""
    with running_artifact_server(tls=tls) as instance:
        yield instance


@pytest.fixture
def bucket(tls: TlsMaterial) -> Iterator[ArtifactServer]:
    """The https object store the redirects end at."""
    with running_artifact_server({"signed/weights.bin": DATA}, tls=tls) as instance:
        yield instance


@pytest.fixture
def plain() -> Iterator[ArtifactServer]:
    """A plain-http server with the same file: somewhere a misconfigured mirror might send us."""
    with running_artifact_server({"signed/weights.bin": DATA}) as instance:
        yield instance


def config(tls: TlsMaterial, **overrides: object) -> FetchConfig:
    options: dict[str, object] = {
        "timeout_s": 10.0,
        "attempts": 3,
        "sleep": lambda seconds: None,
        "jitter": lambda: 1.0,
        "ca_path": str(tls.ca),
    }
    options.update(overrides)
    return FetchConfig(**options)  # type: ignore[arg-type]


def fetch(url: str, staging: Path, tls: TlsMaterial, **overrides: object) -> FetchResult:
    return fetch_file(
        url,
        path="weights.bin",
        size=len(DATA),
        sha256=DIGEST,
        staging_path=str(staging),
        config=config(tls, **overrides),
    )


def chain(server: ArtifactServer, hops: int, end: str, status: int = 302) -> str:
    """``hops`` redirects on ``server``: /r0 -> /r1 -> ... -> ``end``; the URL of the first."""
    for hop in range(hops):
        server.redirects[f"r{hop}"] = (status, f"/r{hop + 1}" if hop + 1 < hops else end)
    return f"{server.url}/r0"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_mirror_redirect_to_a_signed_object_store_url_is_followed_and_verified(
    mirror: ArtifactServer, bucket: ArtifactServer, tls: TlsMaterial, tmp_path: Path, status: int
) -> None:
    mirror.redirects["weights.bin"] = (status, f"{bucket.url}/signed/weights.bin?X-Signature=s3cr3t")
    staging = tmp_path / "x.partial"
    result = fetch(f"{mirror.url}/weights.bin", staging, tls)
    assert result.sha256 == DIGEST and staging.read_bytes() == DATA
    assert [r.status for r in mirror.requests] == [status]
    assert [r.status for r in bucket.requests] == [200]


def test_302_chain_across_servers_is_followed_up_to_the_bound_and_not_beyond(
    mirror: ArtifactServer, bucket: ArtifactServer, tls: TlsMaterial, tmp_path: Path
) -> None:
    start = chain(mirror, 3, f"{bucket.url}/signed/weights.bin")
    result = fetch(start, tmp_path / "ok.partial", tls, max_redirects=3)
    assert result.sha256 == DIGEST
    assert [r.path for r in mirror.requests] == ["r0", "r1", "r2"]

    with pytest.raises(ArtifactTransferError) as caught:
        fetch(start, tmp_path / "over.partial", tls, max_redirects=2)
    message = str(caught.value)
    assert "redirected more than 2 times" in message and f"{mirror.url}/r0" in message
    assert caught.value.attempts == 1  # configuration, not a passing fault: not retried
    assert not (tmp_path / "over.partial").exists()
    assert len(bucket.requests) == 1  # only the first, successful fetch reached the file


def test_resume_after_a_dropped_transfer_sends_range_through_the_redirect_to_the_final_server(
    mirror: ArtifactServer, bucket: ArtifactServer, tls: TlsMaterial, tmp_path: Path
) -> None:
    mirror.redirects["weights.bin"] = (302, f"{bucket.url}/signed/weights.bin")
    bucket.mode, bucket.drops_left = "drop", 1
    staging = tmp_path / "x.partial"
    result = fetch(f"{mirror.url}/weights.bin", staging, tls)
    first, second = bucket.requests
    assert first.range is None and first.status == 200
    assert second.range == f"bytes={result.resumed_from}-" and second.status == 206
    assert 0 < result.resumed_from < len(DATA)
    assert mirror.ranges() == [None, second.range]  # each attempt starts again at the manifest's URL
    assert result.sha256 == DIGEST and staging.read_bytes() == DATA


def test_redirect_loop_is_reported_as_a_loop_and_not_retried(
    mirror: ArtifactServer, tls: TlsMaterial, tmp_path: Path
) -> None:
    mirror.redirects["a"] = (302, "/b")
    mirror.redirects["b"] = (301, f"{mirror.url}/a")
    staging = tmp_path / "x.partial"
    with pytest.raises(ArtifactTransferError) as caught:
        fetch(f"{mirror.url}/a", staging, tls)
    assert f"the redirects loop: {mirror.url}/a -> {mirror.url}/b -> {mirror.url}/a" in str(caught.value)
    assert len(mirror.requests) == 2
    assert not staging.exists()


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("file:///etc/passwd", "only http and https redirects are followed"),
        ("ftp://127.0.0.1/weights.bin", "only http and https redirects are followed"),
        ("", "without a Location header"),
    ],
)
def test_redirect_to_a_non_http_target_is_refused(
    mirror: ArtifactServer, tls: TlsMaterial, tmp_path: Path, location: str, problem: str
) -> None:
    mirror.redirects["weights.bin"] = (302, location)
    with pytest.raises(ArtifactTransferError, match=problem):
        fetch(f"{mirror.url}/weights.bin", tmp_path / "x.partial", tls)


def test_partial_file_resumes_through_a_redirect_to_plain_http_when_the_source_is_http(
    plain: ArtifactServer, tls: TlsMaterial, tmp_path: Path
) -> None:
    # http -> http is no downgrade: an operator who configured plain http gets what they asked for.
    plain.redirects["weights.bin"] = (307, "/signed/weights.bin")
    staging = tmp_path / "x.partial"
    staging.write_bytes(DATA[:MIB])
    result = fetch(f"{plain.url}/weights.bin", staging, tls)
    assert plain.ranges() == [f"bytes={MIB}-", f"bytes={MIB}-"]
    assert result.resumed_from == MIB and staging.read_bytes() == DATA


# --- through the store: nothing is promoted ----------------------------------------------------------------


def manifest_for(version: str, data: bytes) -> ArtifactManifest:
    files = [{"path": "weights.bin", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    return ArtifactManifest.model_validate(artifact_manifest(name="llama", version=version, files=files))


def install_v1(store: Store, mirror: ArtifactServer, tls: TlsMaterial) -> None:
    v1 = os.urandom(1000)
    mirror.files["v1/weights.bin"] = v1
    ensure_artifact(
        store, manifest_for("1", v1), manifest_sha256="0" * 64, source=f"{mirror.url}/v1", config=config(tls)
    )


def current(store: Store) -> str | None:
    link = Path(store.artifacts_dir) / "llama" / "current"
    return os.readlink(link) if link.is_symlink() else None


def test_https_mirror_redirecting_to_plain_http_is_refused_naming_both_urls_and_nothing_is_promoted(
    mirror: ArtifactServer, plain: ArtifactServer, tls: TlsMaterial, tmp_path: Path
) -> None:
    store = Store(str(tmp_path / "store"))
    install_v1(store, mirror, tls)
    blobs_before = sorted(os.listdir(store.blobs_dir))
    mirror.redirects["v2/weights.bin"] = (302, f"{plain.url}/signed/weights.bin?X-Amz-Signature=s3cr3t")
    with pytest.raises(ArtifactTransferError) as caught:
        ensure_artifact(
            store, manifest_for("2", DATA), manifest_sha256="0" * 64, source=f"{mirror.url}/v2", config=config(tls)
        )
    message = str(caught.value)
    assert f"from {mirror.url}/v2/weights.bin to {plain.url}/signed/weights.bin?..." in message
    assert "downgrades https to plain http" in message
    assert "s3cr3t" not in message  # a signed URL's query is a credential: it stays out of logs
    assert plain.requests == []  # the plain-http request was never sent
    assert current(store) == "1"
    assert sorted(os.listdir(store.blobs_dir)) == blobs_before
    assert os.listdir(store.staging_dir) == []
    assert not Path(store.version_dir("llama", "2")).exists()


def test_too_many_hops_through_the_store_fails_clearly_and_nothing_is_promoted(
    mirror: ArtifactServer, bucket: ArtifactServer, tls: TlsMaterial, tmp_path: Path
) -> None:
    store = Store(str(tmp_path / "store"))
    install_v1(store, mirror, tls)
    chain(mirror, 11, f"{bucket.url}/signed/weights.bin")
    mirror.redirects["v2/weights.bin"] = (302, "/r0")
    with pytest.raises(ArtifactTransferError, match="redirected more than 10 times"):
        ensure_artifact(
            store, manifest_for("2", DATA), manifest_sha256="0" * 64, source=f"{mirror.url}/v2", config=config(tls)
        )
    assert bucket.requests == []
    assert current(store) == "1"
    assert os.listdir(store.staging_dir) == []
    assert not Path(store.version_dir("llama", "2")).exists()

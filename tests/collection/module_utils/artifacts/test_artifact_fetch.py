"""The transport against a real HTTP server on loopback: each test is a fault the fetcher must survive."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts import fetch as artifact_fetch
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import (
    ArtifactIntegrityError,
    ArtifactTransferError,
    DiskFullError,
    FetchConfig,
    fetch_file,
    hash_file,
    resolve_location,
)
from ansible_collections.meridian.node.tests.support.http_fixture import (
    ArtifactServer,
    running_artifact_server,
    small_tmpfs,
)

MIB = 1024 * 1024
DATA = os.urandom(4 * MIB + 12345)
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def server() -> Iterator[ArtifactServer]:
    with running_artifact_server({"model/weights.bin": DATA}) as instance:
        yield instance


class Sleeps:
    """An injected sleep: records the backoff delays instead of waiting them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def config(**overrides: object) -> FetchConfig:
    options: dict[str, object] = {"timeout_s": 10.0, "attempts": 3, "sleep": Sleeps(), "jitter": lambda: 1.0}
    options.update(overrides)
    return FetchConfig(**options)  # type: ignore[arg-type]


def fetch(server: ArtifactServer, staging: Path, **overrides: object) -> artifact_fetch.FetchResult:
    return fetch_file(
        f"{server.url}/model/weights.bin",
        path="model/weights.bin",
        size=len(DATA),
        sha256=DIGEST,
        staging_path=str(staging),
        config=config(**overrides),
    )


def transfer_error(url: str, staging: Path, sleeps: Sleeps) -> ArtifactTransferError:
    """Fetch a 3-byte file from ``url``, which must fail with a transfer error (``sleeps`` records the
    backoff); that error."""
    with pytest.raises(ArtifactTransferError) as caught:
        fetch_file(
            url,
            path=url.rsplit("/", 1)[1],
            size=3,
            sha256=DIGEST,
            staging_path=str(staging),
            config=config(sleep=sleeps),
        )
    return caught.value


def test_streamed_download_is_hashed_and_capped_at_the_manifest_size(server: ArtifactServer, tmp_path: Path) -> None:
    staging = tmp_path / "staging" / "x.partial"
    seen: list[int] = []
    result = fetch(server, staging, progress=lambda event: seen.append(event.done))
    assert result.sha256 == DIGEST
    assert result.size == len(DATA) == result.bytes_received
    assert staging.read_bytes() == DATA
    assert server.ranges() == [None]
    assert seen[-1] == len(DATA)


def test_partial_file_resumes_with_range_and_rehashes_the_prefix(
    server: ArtifactServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "x.partial"
    staging.write_bytes(DATA[:MIB])
    result = fetch(server, staging)
    assert server.ranges() == [f"bytes={MIB}-"]
    assert result.resumed_from == MIB
    assert result.bytes_received == len(DATA) - MIB
    assert staging.read_bytes() == DATA


@pytest.mark.parametrize(
    ("mode", "ranges"),
    [
        pytest.param("no-range", [f"bytes={MIB}-"], id="server-without-range-support"),
        pytest.param("wrong-range", [f"bytes={MIB}-", None], id="206-starting-elsewhere-than-asked"),
    ],
)
def test_a_resume_the_server_does_not_honour_restarts_cleanly_from_byte_zero(
    server: ArtifactServer, tmp_path: Path, mode: str, ranges: list[str | None]
) -> None:
    server.mode = mode
    staging = tmp_path / "x.partial"
    staging.write_bytes(DATA[:MIB])
    result = fetch(server, staging)
    assert server.ranges() == ranges
    assert server.requests[-1].status == 200
    assert result.resumed_from == 0
    assert result.bytes_received == len(DATA)
    assert result.sha256 == DIGEST and staging.read_bytes() == DATA


def test_server_sending_more_bytes_is_cut_at_the_cap_and_rejected(server: ArtifactServer, tmp_path: Path) -> None:
    server.mode = "too-long"
    staging = tmp_path / "x.partial"
    written: list[int] = []
    with pytest.raises(ArtifactIntegrityError) as caught:
        fetch(server, staging, progress=lambda event: written.append(event.done))
    assert caught.value.reason == "too-long"
    assert max(written) == len(DATA)  # never wrote past the manifest's size
    assert "more than" in str(caught.value)
    assert not staging.exists()


def test_server_sending_fewer_bytes_is_rejected_as_too_short(server: ArtifactServer, tmp_path: Path) -> None:
    server.mode = "too-short"
    staging = tmp_path / "x.partial"
    with pytest.raises(ArtifactIntegrityError) as caught:
        fetch(server, staging)
    assert caught.value.reason == "too-short"
    assert f"{len(DATA) - server.short_by} of {len(DATA)} bytes" in str(caught.value)
    assert not staging.exists()
    assert len(server.requests) == 1  # bad data is not retried


def test_substituted_file_is_a_digest_mismatch_and_is_deleted(server: ArtifactServer, tmp_path: Path) -> None:
    server.files["model/weights.bin"] = os.urandom(len(DATA))
    staging = tmp_path / "x.partial"
    with pytest.raises(ArtifactIntegrityError) as caught:
        fetch(server, staging)
    assert caught.value.reason == "digest-mismatch"
    assert DIGEST in str(caught.value)
    assert not staging.exists()


def test_500_twice_then_ok_retries_with_growing_backoff(server: ArtifactServer, tmp_path: Path) -> None:
    server.mode = "fail"
    server.failures_left = 2
    sleeps = Sleeps()
    result = fetch(server, tmp_path / "x.partial", sleep=sleeps, backoff_base_s=0.5, attempts=3)
    assert result.attempts == 3
    assert [r.status for r in server.requests] == [500, 500, 200]
    assert sleeps.delays == [0.5, 1.0]


def test_backoff_jitter_spreads_delays_and_respects_the_cap() -> None:
    low = FetchConfig(backoff_base_s=2.0, backoff_max_s=5.0, jitter=lambda: 0.0)
    high = FetchConfig(backoff_base_s=2.0, backoff_max_s=5.0, jitter=lambda: 1.0)
    assert [low.delay(n) for n in (1, 2, 3)] == [1.0, 2.0, 2.5]
    assert [high.delay(n) for n in (1, 2, 3)] == [2.0, 4.0, 5.0]


def test_connection_dropped_mid_body_resumes_with_range(server: ArtifactServer, tmp_path: Path) -> None:
    server.mode = "drop"
    server.drops_left = 1
    staging = tmp_path / "x.partial"
    result = fetch(server, staging)
    ranges = server.ranges()
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert result.resumed_from > 0
    assert staging.read_bytes() == DATA


def test_failure_after_all_retries_is_clear_and_keeps_the_partial_file(server: ArtifactServer, tmp_path: Path) -> None:
    server.mode = "drop"
    server.drops_left = 100
    staging = tmp_path / "x.partial"
    with pytest.raises(ArtifactTransferError) as caught:
        fetch(server, staging, attempts=3)
    error = caught.value
    assert error.attempts == 3
    assert error.partial_bytes == staging.stat().st_size > 0
    assert "after 3 attempt(s)" in str(error) and "resumes" in str(error)
    assert DATA.startswith(staging.read_bytes())
    server.mode = "normal"
    assert fetch(server, staging).resumed_from == error.partial_bytes


def test_silent_server_times_out_on_every_attempt(server: ArtifactServer, tmp_path: Path) -> None:
    server.mode = "slow"
    server.slow_chunk = 1024
    server.slow_delay = 2.0
    with pytest.raises(ArtifactTransferError) as caught:
        fetch(server, tmp_path / "x.partial", timeout_s=0.3, attempts=2)
    assert "timed out" in str(caught.value)
    assert caught.value.attempts == 2


def test_connection_refused_is_a_transfer_error(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sleeps = Sleeps()
    error = transfer_error(f"http://127.0.0.1:{port}/w.bin", tmp_path / "x.partial", sleeps)
    assert "connection failed" in str(error)
    assert len(sleeps.delays) == 2


def test_404_is_not_retried(server: ArtifactServer, tmp_path: Path) -> None:
    sleeps = Sleeps()
    error = transfer_error(f"{server.url}/missing.bin", tmp_path / "x.partial", sleeps)
    assert "HTTP 404" in str(error)
    assert sleeps.delays == [] and len(server.requests) == 1


def test_air_gap_directory_source_copies_verifies_and_resumes(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox" / "model"
    inbox.mkdir(parents=True)
    (inbox / "weights.bin").write_bytes(DATA)
    location = resolve_location(str(tmp_path / "inbox"), "model/weights.bin", file_url=None, base_url=None)
    staging = tmp_path / "x.partial"
    staging.write_bytes(DATA[:1000])
    result = fetch_file(
        location, path="model/weights.bin", size=len(DATA), sha256=DIGEST, staging_path=str(staging), config=config()
    )
    assert result.resumed_from == 1000
    assert staging.read_bytes() == DATA


def test_source_wins_over_manifest_urls_and_a_missing_location_is_explained() -> None:
    assert resolve_location("http://mirror/x/", "a b.bin", file_url="http://f/1", base_url="http://b") == (
        "http://mirror/x/a%20b.bin"
    )
    assert resolve_location(None, "a.bin", file_url="http://f/1", base_url="http://b") == "http://f/1"
    assert resolve_location(None, "d/a.bin", file_url=None, base_url="http://b/") == "http://b/d/a.bin"
    with pytest.raises(ArtifactTransferError, match="no location"):
        resolve_location(None, "a.bin", file_url=None, base_url=None)


def test_hash_file_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(DATA)
    assert hash_file(str(path)) == (DIGEST, len(DATA))


def test_disk_filling_up_mid_download_cleans_staging_and_says_the_disk_is_full(
    server: ArtifactServer, tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path / "small", "2m") as small:
        staging = small / "x.partial"
        with pytest.raises(DiskFullError) as caught:
            fetch(server, staging)
        assert "disk is full" in str(caught.value)
        assert not staging.exists()
        assert os.listdir(small) == []

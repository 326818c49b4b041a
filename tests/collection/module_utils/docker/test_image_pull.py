"""docker.image_pull without a registry: the rules a pull is held to, each reached by its own fault.

The real registry and the real Docker Engine are in tests/collection/modules/test_engine_image_pull.py. Here a
stand-in for the four Engine API calls a pull makes drives ``ImagePuller`` with a hand-moved clock, so the
stall bound is tested without waiting; the disk floor by arithmetic; the credentials file on real files.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker._http import (
    ChunkedDecoder,
    HttpLiteError,
    exchange_streamed,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApiError, PullStream
from ansible_collections.meridian.node.plugins.module_utils.docker.image_pull import (
    ImagePuller,
    ImagePullError,
    PullLimits,
    PullProgress,
    disk_problem,
    read_registry_auth,
    registry_auth_header,
    registry_of,
    split_pinned,
)
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock

DIGEST = "sha256:" + "ab" * 32
REPO = "registry.example:5000/engines/vllm"
PINNED = f"{REPO}@{DIGEST}"


def line(**message: Any) -> bytes:
    return json.dumps(message).encode() + b"\r\n"


def downloading(layer: str, current: int, total: int = 1000) -> bytes:
    return line(status="Downloading", id=layer, progressDetail={"current": current, "total": total})


class FakeStream:
    """What the engine streams: each item is bytes that arrive, or None for a read that waited its whole
    timeout (the clock moves by it)."""

    def __init__(self, items: Sequence[bytes | None], clock: MonotonicClock) -> None:
        self._items = list(items)
        self._clock = clock
        self.closed = False

    def read(self, timeout_s: float) -> bytes | None:
        if not self._items:
            return b""
        item = self._items.pop(0)
        if item is None:
            self._clock.now += timeout_s
        return item

    def close(self) -> None:
        self.closed = True


class FakeApi:
    def __init__(self, stream: FakeStream, repo_digests: Sequence[str] = (PINNED,), root: str = "/var/lib/docker"):
        self.stream = stream
        self.repo_digests = list(repo_digests)
        self.root = root
        self.pulls: list[tuple[str, str, str | None]] = []
        self.waits: list[float | None] = []

    def info(self) -> dict[str, Any]:
        return {"DockerRootDir": self.root}

    def inspect_image(self, reference: str) -> dict[str, Any]:
        return {"Id": "sha256:" + "1" * 64, "RepoDigests": self.repo_digests}

    def distribution(self, reference: str, registry_auth: str | None = None) -> dict[str, Any]:
        return {"Descriptor": {"digest": reference.split("@")[1], "size": 948}}

    def open_pull(
        self, repository: str, digest: str, registry_auth: str | None = None, *, wait_s: float | None = None
    ) -> PullStream:
        self.pulls.append((repository, digest, registry_auth))
        self.waits.append(wait_s)
        return self.stream  # type: ignore[return-value]  # the two methods a pull reads


def puller(
    api: FakeApi,
    clock: MonotonicClock,
    *,
    stall_s: float = 10,
    floor: int = 0,
    free: int = 10**12,
    auth: str | None = None,
) -> ImagePuller:
    return ImagePuller(
        api,
        PullLimits(stall_s=stall_s, min_free_bytes=floor, auth_file=auth),
        allowed=lambda ref: None if ref.startswith("registry.example:5000/") else f"repository of {ref} not allowed",
        clock=clock,
        free_bytes=lambda path: free,
    )


# --- pinned, allowed, verified -------------------------------------------------------------------------


def test_a_pull_by_digest_reports_the_bytes_of_every_layer_and_is_verified() -> None:
    clock = MonotonicClock(0.0)
    stream = FakeStream(
        [downloading("l1", 400), downloading("l2", 100), line(status="Download complete", id="l1"), b""], clock
    )
    api = FakeApi(stream)
    summary = puller(api, clock).pull(PINNED)
    assert api.pulls == [(REPO, DIGEST, None)]
    assert summary.bytes == 1000 + 100  # l1 complete (its total), l2 as far as it got
    assert stream.closed


@pytest.mark.parametrize("reference", [f"{REPO}:latest", REPO, f"{REPO}@sha256:short"])
def test_a_tag_is_never_pulled(reference: str) -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([], clock))
    with pytest.raises(ImagePullError) as info:
        puller(api, clock).pull(reference)
    assert info.value.check == "image-unpinned" and reference in str(info.value)
    assert api.pulls == []


def test_a_tag_beside_the_digest_is_dropped_and_the_digest_pulled() -> None:
    assert split_pinned(f"{REPO}:v1@{DIGEST}") == (REPO, DIGEST)


def test_a_repository_the_policy_does_not_allow_is_not_pulled() -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([], clock))
    with pytest.raises(ImagePullError) as info:
        puller(api, clock).pull(f"evil.example/x@{DIGEST}")
    assert info.value.check == "policy-image" and "not allowed" in str(info.value)
    assert api.pulls == []


def test_an_image_whose_digests_do_not_hold_the_pin_after_the_pull_is_refused() -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([downloading("l1", 10)], clock), repo_digests=[f"{REPO}@sha256:{'cd' * 32}"])
    with pytest.raises(ImagePullError) as info:
        puller(api, clock).pull(PINNED)
    assert info.value.check == "image-digest-mismatch" and PINNED in str(info.value)


def test_the_engines_error_in_the_stream_fails_the_pull_with_its_words() -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([line(error="manifest unknown", errorDetail={"message": "manifest unknown"})], clock))
    with pytest.raises(ImagePullError) as info:
        puller(api, clock).pull(PINNED)
    assert info.value.check == "image-pull" and "manifest unknown" in str(info.value)


def test_a_docker_hub_pin_is_verified_against_the_familiar_name_docker_shows() -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([], clock), repo_digests=[f"vllm/vllm-openai@{DIGEST}"])
    hub = ImagePuller(api, PullLimits(), allowed=lambda ref: None, clock=clock)
    assert hub.pull(f"docker.io/vllm/vllm-openai@{DIGEST}").bytes == 0


# --- the stall bound ---------------------------------------------------------------------------------------


def test_a_pull_whose_bytes_stop_moving_is_cancelled_at_the_bound_with_the_bytes_done() -> None:
    clock = MonotonicClock(0.0)
    stream = FakeStream([downloading("l1", 300), *([None] * 100)], clock)
    with pytest.raises(ImagePullError) as info:
        puller(FakeApi(stream), clock, stall_s=5).pull(PINNED)
    assert info.value.check == "image-pull-stalled"
    assert info.value.bytes_done == 300 and info.value.summary["bytes"] == 300
    assert "no progress for 5s" in str(info.value) and "300 bytes" in str(info.value)
    assert stream.closed  # closing the connection is what makes the engine cancel
    assert clock.now == pytest.approx(5)  # not a read later


def test_a_registry_that_hangs_before_the_first_byte_is_a_stall_too() -> None:
    clock = MonotonicClock(0.0)

    class Hanging(FakeApi):
        def open_pull(
            self, repository: str, digest: str, registry_auth: str | None = None, *, wait_s: float | None = None
        ) -> PullStream:
            self.waits.append(wait_s)
            raise DockerApiError("no answer in time", action="pulling") from TimeoutError("timed out")

    api = Hanging(FakeStream([], clock))
    with pytest.raises(ImagePullError) as info:
        puller(api, clock, stall_s=7).pull(PINNED)
    assert info.value.check == "image-pull-stalled" and info.value.bytes_done == 0
    assert api.waits == [7]  # the engine's first byte waited for no longer than the bound


def test_a_slow_pull_that_keeps_moving_is_not_stalled() -> None:
    clock = MonotonicClock(0.0)
    # Four seconds of silence between progress messages, ten times, under a five-second bound.
    items: list[bytes | None] = []
    for step in range(10):
        items += [None] * 4 + [downloading("l1", (step + 1) * 10)]
    summary = puller(FakeApi(FakeStream(items, clock)), clock, stall_s=5).pull(PINNED)
    assert summary.bytes == 100 and clock.now == pytest.approx(40)


def test_the_same_message_again_is_not_progress() -> None:
    progress = PullProgress()
    assert progress.feed(downloading("l1", 5)) is True
    assert progress.feed(downloading("l1", 5)) is False
    assert progress.feed(line(status="Extracting", id="l1", progressDetail={"current": 1})) is True


def test_progress_split_anywhere_across_reads_is_read_whole() -> None:
    data = downloading("l1", 7) + downloading("l2", 9)
    progress = PullProgress()
    for index in range(len(data)):
        progress.feed(data[index : index + 1])
    assert progress.bytes_done == 16


def test_a_progress_line_that_is_not_json_fails_the_pull() -> None:
    clock = MonotonicClock(0.0)
    with pytest.raises(ImagePullError) as info:
        puller(FakeApi(FakeStream([b"<html>\n"], clock)), clock).pull(PINNED)
    assert info.value.check == "image-pull"


def test_a_transport_failure_mid_pull_is_a_failed_pull() -> None:
    clock = MonotonicClock(0.0)

    class Broken(FakeStream):
        def read(self, timeout_s: float) -> bytes | None:
            raise DockerApiError("connection reset", action="pulling")

    with pytest.raises(ImagePullError) as info:
        puller(FakeApi(Broken([], clock)), clock).pull(PINNED)
    assert info.value.check == "image-pull" and "connection reset" in str(info.value)


# --- the disk floor -----------------------------------------------------------------------------------------


def test_a_pull_below_the_floor_is_refused_before_it_starts_with_both_figures() -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([], clock), root="/srv/docker")
    with pytest.raises(ImagePullError) as info:
        puller(api, clock, floor=5_000, free=4_000).pull(PINNED)
    message = str(info.value)
    assert info.value.check == "disk-low"
    assert "4000 bytes free now" in message and "5000 bytes" in message and "/srv/docker" in message
    assert api.pulls == []


def test_check_mode_refuses_below_the_floor_too() -> None:
    clock = MonotonicClock(0.0)
    with pytest.raises(ImagePullError) as info:
        puller(FakeApi(FakeStream([], clock)), clock, floor=5_000, free=4_000).forecast(PINNED)
    assert info.value.check == "disk-low"


@pytest.mark.parametrize(
    ("free", "floor", "size", "refused"),
    [
        (100, 0, None, False),
        (100, 100, None, False),
        (99, 100, None, True),
        (200, 100, 100, False),
        (200, 100, 101, True),
    ],
)
def test_disk_floor_arithmetic(free: int, floor: int, size: int | None, refused: bool) -> None:
    problem = disk_problem(reference=PINNED, data_root="/d", free_bytes=free, floor=floor, size=size)
    assert (problem is not None) is refused


def test_a_data_root_this_host_cannot_measure_is_refused_not_guessed() -> None:
    clock = MonotonicClock(0.0)

    def unreadable(path: str) -> int:
        raise FileNotFoundError(2, "No such file or directory")

    limits = PullLimits(min_free_bytes=1)
    hub = ImagePuller(FakeApi(FakeStream([], clock)), limits, allowed=lambda ref: None, free_bytes=unreadable)
    with pytest.raises(ImagePullError) as info:
        hub.pull(PINNED)
    assert info.value.check == "disk-low" and "cannot be read" in str(info.value)


# --- check mode ------------------------------------------------------------------------------------------------


def test_check_mode_asks_the_registry_and_pulls_nothing() -> None:
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([], clock))
    forecast = puller(api, clock).forecast(PINNED).as_result()
    assert forecast["would_pull"] is True and forecast["registry"] == "registry.example:5000"
    assert "948 bytes" in forecast["size_note"]
    assert api.pulls == []


# --- registries and credentials -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("repository", "registry"),
    [
        ("vllm/vllm-openai", "docker.io"),
        ("ubuntu", "docker.io"),
        ("docker.io/library/ubuntu", "docker.io"),
        ("index.docker.io/x/y", "docker.io"),
        ("ghcr.io/acme/vllm", "ghcr.io"),
        ("127.0.0.1:5000/a/b", "127.0.0.1:5000"),
        ("localhost/a", "localhost"),
    ],
)
def test_the_registry_of_a_repository_follows_dockers_rule(repository: str, registry: str) -> None:
    assert registry_of(repository) == registry


@pytest.fixture
def auth_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "auth.json"
    entry = base64.b64encode(b"alice:pa:ss").decode()
    path.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": entry},
                    "registry.example:5000": {"username": "bob", "password": "hunter2"},
                }
            }
        )
    )
    path.chmod(0o600)
    yield path


def test_credentials_are_read_per_registry_and_sent_only_as_the_header(auth_file: Path) -> None:
    found = read_registry_auth(str(auth_file))
    assert found["docker.io"] == {"username": "alice", "password": "pa:ss"}
    clock = MonotonicClock(0.0)
    api = FakeApi(FakeStream([], clock))
    puller(api, clock, auth=str(auth_file)).pull(PINNED)
    header = api.pulls[0][2]
    assert header is not None
    assert json.loads(base64.urlsafe_b64decode(header)) == {
        "username": "bob",
        "password": "hunter2",
        "serveraddress": "registry.example:5000",
    }
    assert registry_auth_header(found["docker.io"], "docker.io")


@pytest.mark.skipif(os.geteuid() != 0, reason="owner checks need root to make files of another owner")
@pytest.mark.parametrize("fault", ["group-readable", "world-readable", "not-root", "symlink", "fifo", "missing"])
def test_a_credentials_file_root_cannot_vouch_for_is_refused(fault: str, auth_file: Path, tmp_path: Path) -> None:
    path = auth_file
    if fault == "group-readable":
        path.chmod(0o640)
    elif fault == "world-readable":
        path.chmod(0o604)
    elif fault == "not-root":
        os.chown(path, 1000, 1000)
    elif fault == "symlink":
        path = tmp_path / "link.json"
        path.symlink_to(auth_file)
    elif fault == "fifo":
        path = tmp_path / "fifo.json"
        os.mkfifo(path, 0o600)
    else:
        path = tmp_path / "nothing.json"
    with pytest.raises(ImagePullError) as info:
        read_registry_auth(str(path))
    assert info.value.check == "registry-auth" and str(path) in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        ("not json", "not JSON"),
        ('{"credsStore": "desktop"}', "no 'auths'"),
        ('{"auths": {"r": "x"}}', "not a mapping"),
        ('{"auths": {"r": {"auth": "bm9jb2xvbg=="}}}', "base64 of user:password"),
        ('{"auths": {"r": {"email": "a@b"}}}', "names no credentials"),
    ],
)
def test_a_malformed_credentials_file_is_refused_naming_why(document: str, reason: str, tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    path.write_text(document)
    path.chmod(0o600)
    with pytest.raises(ImagePullError, match=reason) as info:
        read_registry_auth(str(path))
    assert info.value.check == "registry-auth"


# --- the streamed HTTP answer --------------------------------------------------------------------------------


def test_chunked_bodies_decode_the_same_however_the_bytes_arrive() -> None:
    wire = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n"
    for size in (1, 2, 3, 7, len(wire)):
        decoder = ChunkedDecoder()
        body = b"".join(decoder.feed(wire[i : i + size]) for i in range(0, len(wire), size))
        assert body == b"hello world" and decoder.done


@pytest.mark.parametrize("wire", [b"zz\r\n", b"-5\r\n", b"0x2\r\n", b"2\r\nabc\r\n"])
def test_malformed_chunk_framing_is_refused(wire: bytes) -> None:
    with pytest.raises(HttpLiteError):
        ChunkedDecoder().feed(wire)


def test_a_streamed_answer_waits_without_losing_bytes() -> None:
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab")
        answer = exchange_streamed(ours, "POST", "/x", host="docker")
        theirs.recv(4096)  # the request
        assert answer.status == 200
        assert answer.read(0.05) == b"ab"
        assert answer.read(0.05) is None  # nothing more yet: a timeout, not an end
        theirs.sendall(b"c\r\n0\r\n\r\n")
        assert answer.read(1) == b"c"
        assert answer.read(1) == b""

"""``meridian-node artifact pull | list`` against a real HTTP server on 127.0.0.1."""

import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import FetchProgress
from ansible_collections.meridian.node.tests.support.http_fixture import ArtifactServer, running_artifact_server
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    SigningKey,
    artifact_manifest,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent import cli
from meridian_node_agent.cli.artifact import Progress, human_bytes

MIB = 1024 * 1024

FILES = {"config.json": b'{"layers": 2}', "weights/model.safetensors": os.urandom(3 * 1024 * 1024 + 17)}


@pytest.fixture
def server() -> Iterator[ArtifactServer]:
    with running_artifact_server({f"tiny/{path}": data for path, data in FILES.items()}) as running:
        yield running


class Site:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.artifact_key = make_key()
        self.policy = write_policy(
            root,
            control=[make_key()],
            artifact=[self.artifact_key],
            extra={"store": {"path": str(root / "store"), "max_bytes": "1G"}},
        )

    def manifest(self, name: str, keys: list[SigningKey] | None = None, files: dict[str, bytes] = FILES) -> Path:
        payload = artifact_manifest(
            name=name,
            version="1.0",
            files=[{"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for p, d in files.items()],
        )
        path = self.root / f"{name}.manifest.json"
        path.write_bytes(signed("artifact-manifest", payload, keys or [self.artifact_key]))
        return path


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def pull(capsys: pytest.CaptureFixture[str], site: Site, manifest: object, source: str) -> tuple[int, str, str]:
    """``meridian-node artifact pull`` of one manifest from one source, with the site's policy."""
    return run(capsys, "artifact", "pull", "--policy", site.policy, "--manifest", manifest, "--source", source)


def test_pull_fetches_verifies_and_promotes_then_list_shows_it(
    tmp_path: Path, server: ArtifactServer, capsys: pytest.CaptureFixture[str]
) -> None:
    site = Site(tmp_path)
    status, out, err = pull(capsys, site, site.manifest("tiny"), f"{server.url}/tiny/")
    assert status == 0, err
    result = json.loads(out)
    assert (result["ok"], result["changed"], result["name"]) == (True, True, "tiny")
    assert result["fetched_bytes"] == sum(len(d) for d in FILES.values())
    for path, data in FILES.items():
        assert (Path(result["path"]) / path).read_bytes() == data
    assert "tiny 1.0:" in err and "ETA" in err  # plain progress lines: stderr is not a terminal here

    status, out, _ = pull(capsys, site, site.manifest("tiny"), f"{server.url}/tiny/")
    assert (status, json.loads(out)["changed"]) == (0, False)

    status, out, _ = run(capsys, "artifact", "list", "--policy", site.policy)
    assert status == 0
    header, row = out.splitlines()[:2]
    assert header.split()[:3] == ["NAME", "VERSION", "SIZE"]
    assert row.split()[:4] == ["tiny", "1.0", "3.0", "MiB"]

    status, out, _ = run(capsys, "artifact", "list", "--policy", site.policy, "--json")
    assert [(r["name"], r["current"]) for r in json.loads(out)] == [("tiny", True)]


def test_pull_refuses_a_manifest_from_an_untrusted_key_and_fetches_nothing(
    tmp_path: Path, server: ArtifactServer, capsys: pytest.CaptureFixture[str]
) -> None:
    site = Site(tmp_path)
    status, out, _ = pull(capsys, site, site.manifest("tiny", keys=[make_key()]), f"{server.url}/tiny/")
    assert status == 1
    assert json.loads(out)["reason"] == "threshold-not-met"
    assert server.requests == []
    assert not (tmp_path / "store" / "blobs").exists()


def test_pull_of_a_substituted_file_fails_and_promotes_nothing(
    tmp_path: Path, server: ArtifactServer, capsys: pytest.CaptureFixture[str]
) -> None:
    site = Site(tmp_path)
    server.files["tiny/config.json"] = b'{"layers": 3}'  # same size, other bytes
    status, out, _ = pull(capsys, site, site.manifest("tiny"), f"{server.url}/tiny/")
    assert status == 1
    assert json.loads(out)["reason"] == "ArtifactIntegrityError"
    status, out, _ = run(capsys, "artifact", "list", "--policy", site.policy, "--json")
    assert json.loads(out) == []


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site = Site(tmp_path)
    status, out, err = run(capsys, "artifact", "pull", "--policy", site.policy, "--manifest", tmp_path / "nope.json")
    assert (status, out) == (2, "")
    assert "nope.json" in err


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_adds_up_files_and_redraws_one_line_on_a_terminal() -> None:
    now = [0.0]
    stream = FakeTerminal()
    progress = Progress("m 1", {"a": 100, "b": 200}, stream=stream, clock=lambda: now[0])
    for path, done, size in (("a", 50, 100), ("a", 100, 100), ("b", 50, 200), ("b", 200, 200)):
        now[0] += 1.0
        progress(FetchProgress(path, size, done, done))
    assert progress.done == 300
    progress.finish()
    text = stream.getvalue()
    assert text.count("\r") == 5 and text.endswith("\n")
    assert "100.0%" in text.splitlines()[-1]


def test_two_files_of_one_size_are_told_apart_by_path() -> None:
    # The second file resumed so close to its end that its first report is already complete: by the numbers
    # alone (done and size as before) it looked like the first file again and its bytes were lost.
    progress = Progress("m 1", {"a": 100, "b": 100}, stream=io.StringIO(), resumed={"b": 90}, clock=lambda: 0.0)
    progress(FetchProgress("a", 100, 100, 100))
    progress(FetchProgress("b", 100, 100, 10))
    assert (progress.done, progress.total, progress.received) == (200, 200, 110)


def test_resumed_pull_counts_the_partial_in_done_and_total_and_only_new_bytes_in_the_rate() -> None:
    # Issue 25's numbers: 381.5 MiB to fetch, 303.5 MiB of it already in staging.
    size, had = int(381.5 * MIB), int(303.5 * MIB)
    now = [100.0]
    stream = io.StringIO()
    progress = Progress("llama 3", {"w.bin": size}, stream=stream, resumed={"w.bin": had}, clock=lambda: now[0])
    assert progress.line(now[0]) == "llama 3: 303.5 MiB / 381.5 MiB at 0 B/s, ETA --:--"

    now[0] += 10.0
    progress(FetchProgress("w.bin", size, had + 20 * MIB, 20 * MIB))  # 2 MiB/s since the start

    # 58 MiB left at 2 MiB/s: 29 s, however many bytes the earlier run had left behind.
    assert stream.getvalue() == "llama 3: 323.5 MiB / 381.5 MiB at 2.0 MiB/s, ETA 0:00:29\n"
    now[0] += 29.0
    progress(FetchProgress("w.bin", size, size, size - had))
    progress.finish()
    assert stream.getvalue().splitlines()[-1] == "llama 3: 381.5 MiB / 381.5 MiB at 2.0 MiB/s, ETA 0:00:00"


def test_pull_after_an_interrupted_one_resumes_and_shows_the_whole_size(
    tmp_path: Path, server: ArtifactServer, capsys: pytest.CaptureFixture[str]
) -> None:
    site = Site(tmp_path)
    weights = FILES["weights/model.safetensors"]
    sha = hashlib.sha256(weights).hexdigest()
    # What an interrupted pull leaves: the first 2 MiB of the weights in the store's staging directory.
    staging = tmp_path / "store" / "staging"
    staging.mkdir(parents=True)
    (staging / f"{sha}.partial").write_bytes(weights[: 2 * MIB])

    status, out, err = pull(capsys, site, site.manifest("tiny"), f"{server.url}/tiny/")

    assert status == 0, err
    assert f"bytes={2 * MIB}-" in server.ranges()  # really resumed, from the real server
    lines = [line for line in err.splitlines() if line.startswith("tiny 1.0: ")]
    assert lines, err
    whole = human_bytes(sum(len(data) for data in FILES.values()))
    for line in lines:
        match = PROGRESS_LINE.fullmatch(line)
        assert match is not None, line
        assert match["total"] == whole and _bytes(match["done"]) <= _bytes(match["total"])
        assert _bytes(match["done"]) >= 2 * MIB  # the resumed bytes count from the first line on
    # Done is done: the whole size, and no time left (the old total, what remained, made this "--:--").
    assert lines[-1].startswith(f"tiny 1.0: {whole} / {whole} at ") and lines[-1].endswith(", ETA 0:00:00")
    assert json.loads(out)["fetched_bytes"] == len(FILES["config.json"]) + len(weights) - 2 * MIB


PROGRESS_LINE = re.compile(
    r"tiny 1\.0: (?P<done>[\d.]+ \S+) / (?P<total>[\d.]+ \S+) at (?P<rate>[\d.]+ \S+)/s, "
    r"ETA (?P<eta>--:--|\d+:\d\d:\d\d)"
)
_UNITS = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]

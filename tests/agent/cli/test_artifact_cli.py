"""``meridian-node artifact pull | list`` against a real HTTP server on 127.0.0.1."""

import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.http_fixture import ArtifactServer, running_artifact_server
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    SigningKey,
    artifact_manifest,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent import cli
from meridian_node_agent.cli.artifact import Progress

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
    progress = Progress("m 1", total=300, stream=stream, clock=lambda: now[0])
    for done, size in ((0, 100), (100, 100), (50, 200), (200, 200)):
        now[0] += 1.0
        progress(done, size)
    assert progress.done == 300
    progress.finish()
    text = stream.getvalue()
    assert text.count("\r") == 5 and text.endswith("\n")
    assert "100.0%" in text.splitlines()[-1]

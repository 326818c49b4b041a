"""Writing bundles: plain headers, bundle.json first, and a source that changes after it was listed is
refused rather than shipped under a digest it no longer has (nothing left behind either way)."""

from __future__ import annotations

import base64
import json
import stat
import tarfile
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_writer import (
    BundleWriteError,
    plan_members,
    write_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import read_json
from ansible_collections.meridian.node.tests.support.bundle_fixtures import good_bundle, make_site

ENVELOPE = b'{"payloadType": "x", "payload": "", "signatures": []}'


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.endswith(".part"))


def test_written_bundle_has_bundle_json_first_and_plain_headers(tmp_path: Path) -> None:
    path = good_bundle(make_site(tmp_path))
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
        head = tar.extractfile(infos[0])
        assert head is not None
        payload = json.loads(base64.b64decode(read_json(head.read())["payload"]))
    assert infos[0].name == "bundle.json"
    assert [info.name for info in infos[1:]] == [entry["path"] for entry in payload["files"]]
    assert {(info.type, info.mode, info.uid, info.gid, info.uname, info.gname) for info in infos} == {
        (tarfile.REGTYPE, 0o644, 0, 0, "", "")
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "rewritten",
    [
        pytest.param(b"listed bytes and then some", id="grew"),
        pytest.param(b"less", id="shrank"),
        pytest.param(b"LISTED BYTES", id="other-bytes-of-the-same-size"),
    ],
)
def test_source_that_changed_after_it_was_listed_is_refused(tmp_path: Path, rewritten: bytes) -> None:
    source = tmp_path / "weights.bin"
    source.write_bytes(b"listed bytes")
    planned = plan_members([("artifacts/m/1/files/weights.bin", str(source))])
    source.write_bytes(rewritten)
    with pytest.raises(BundleWriteError, match="changed while the bundle was written"):
        write_bundle(str(tmp_path / "b.tar"), ENVELOPE, planned, mtime=0)
    assert not (tmp_path / "b.tar").exists() and leftovers(tmp_path) == []


def test_symlinked_source_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(BundleWriteError, match="not links"):
        plan_members([("playbooks/x", str(tmp_path / "link"))])

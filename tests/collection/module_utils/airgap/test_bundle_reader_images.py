"""The bundle reader with ``images/<name>.tar`` members: real signed bundles, no Docker. An archive is checked
after every member verified, against the control-signed state's pins and the policy's repositories, in check
mode (in place in the bundle) and unpacking (from the copy in scratch) alike; a refusal leaves scratch empty."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import (
    BundleRefused,
    check_bundle,
    unpack_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState
from ansible_collections.meridian.node.tests.support.bundle_fixtures import ARTIFACT, AUTHORITY, CONTROL
from ansible_collections.meridian.node.tests.support.image_archives import (
    HOSTILE,
    REPOSITORY,
    ImageParts,
    archive,
    engine,
    image_bundle,
    layer_tar,
)
from ansible_collections.meridian.node.tests.support.trust_fixtures import NODE_ID, NOW, desired_state, write_policy

FRESH = AppliedState()
CREATED = NOW.replace(minute=0) if NOW.minute >= 10 else NOW.replace(hour=NOW.hour - 1)


def _policy(root: Path, **air_gap: object) -> Policy:
    path = write_policy(
        root / "etc",
        control=[CONTROL],
        artifact=[ARTIFACT],
        air_gap_authority=[AUTHORITY],
        extra={
            "air_gap": {"scratch_dir": str(root / "scratch"), **air_gap},
            "images": {"allowed_repositories": [REPOSITORY], "require_digest": True},
        },
    )
    return load_policy(path)


def _parts() -> ImageParts:
    return ImageParts(layers=[layer_tar({"srv": b"serve\n" * 100})], label="reader")


def _bundle(root: Path, archives: dict[str, bytes], pins: list[str]) -> Path:
    state = desired_state(generation=2, engines=[engine(f"chat{n}", pin, 9400 + n) for n, pin in enumerate(pins)])
    return image_bundle(root / "b.tar", archives, state, created=CREATED)


def test_a_pinned_image_is_verified_in_check_mode_and_unpacked(tmp_path: Path) -> None:
    policy, parts = _policy(tmp_path), _parts()
    path = _bundle(tmp_path, {"chat": archive(parts.members())}, [parts.pin()])

    checked = check_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    unpacked = unpack_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)

    assert [image.image_id for image in checked.images.values()] == [parts.image_id]
    image = unpacked.images["images/chat.tar"]
    assert (image.reference, image.image_id) == (parts.pin(), parts.image_id)
    assert Path(unpacked.files["images/chat.tar"]).read_bytes() == archive(parts.members())
    unpacked.discard()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_image_archive_refuses_the_bundle_and_leaves_scratch_empty(tmp_path: Path, case: str) -> None:
    make, reason = HOSTILE[case]
    policy, parts = _policy(tmp_path), _parts()
    path = _bundle(tmp_path, {"chat": make(parts)}, [parts.pin()])

    for read in (check_bundle, unpack_bundle):
        with pytest.raises(BundleRefused) as refused:
            read(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
        assert (refused.value.reason.value, refused.value.member) == (reason, "images/chat.tar")
    assert os.listdir(tmp_path / "scratch") == []


def test_an_image_the_state_does_not_pin_is_refused(tmp_path: Path) -> None:
    policy, parts = _policy(tmp_path), _parts()
    path = _bundle(tmp_path, {"chat": archive(parts.members())}, [])
    with pytest.raises(BundleRefused) as refused:
        unpack_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert refused.value.reason.value == "image-not-pinned"
    assert parts.image_id in refused.value.message


def test_an_image_from_a_repository_the_policy_does_not_allow_is_refused(tmp_path: Path) -> None:
    policy, parts = _policy(tmp_path), _parts()
    path = _bundle(tmp_path, {"chat": archive(parts.members())}, [parts.pin("debian")])
    with pytest.raises(BundleRefused) as refused:
        unpack_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert refused.value.reason.value == "image-not-allowed"
    assert "'debian' is not allowed" in refused.value.message


def test_the_same_image_twice_is_refused(tmp_path: Path) -> None:
    policy, parts = _policy(tmp_path), _parts()
    data = archive(parts.members())
    path = _bundle(tmp_path, {"a": data, "b": data + b"\0" * 512}, [parts.pin()])
    with pytest.raises(BundleRefused) as refused:
        unpack_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert (refused.value.reason.value, refused.value.member) == ("image-extra-content", "images/b.tar")


def test_the_policy_layer_cap_applies(tmp_path: Path) -> None:
    parts = _parts()
    policy = _policy(tmp_path, max_image_layer_bytes=len(parts.layers[0]) - 1)
    path = _bundle(tmp_path, {"chat": archive(parts.members())}, [parts.pin()])
    with pytest.raises(BundleRefused) as refused:
        check_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert refused.value.reason.value == "image-too-large"


def test_an_image_member_outside_images_name_form_is_refused_by_the_schema(tmp_path: Path) -> None:
    policy, parts = _policy(tmp_path), _parts()
    path = _bundle(tmp_path, {"nested/chat": archive(parts.members())}, [parts.pin()])
    with pytest.raises(BundleRefused) as refused:
        check_bundle(str(path), policy, node_id=NODE_ID, now=NOW, applied=FRESH)
    assert refused.value.reason.value == "schema"
    assert "images/<name>.tar" in refused.value.message


@pytest.mark.parametrize("value", ["lots", True, -1])
def test_a_bad_layer_cap_in_the_policy_is_refused_naming_the_field(tmp_path: Path, value: object) -> None:
    with pytest.raises(PolicyError, match=r"air_gap\.max_image_layer_bytes"):
        _policy(tmp_path, max_image_layer_bytes=value)

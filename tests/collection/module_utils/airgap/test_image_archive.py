"""``airgap.image_archive``: an image archive verified against the state's pins, without Docker; each hostile
archive refused with its reason; and the archive Docker is fed holding only the verified blobs and our tag."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.image_archive import (
    FORM_IMAGE_ID,
    FORM_REGISTRY_DIGEST,
    ImageArchiveRefused,
    VerifiedImage,
    Window,
    load_stream,
    load_tag,
    split_pin,
    verify_image_archive,
)
from ansible_collections.meridian.node.tests.support.image_archives import (
    HOSTILE,
    REPOSITORY,
    ImageParts,
    archive,
    layer_tar,
)

CAP = 1024**3


def _parts() -> ImageParts:
    return ImageParts(layers=[layer_tar({"bin/server": b"#!/bin/sh\n" * 300}), layer_tar({"etc/x": b"x"})])


def _verify(data: bytes, pins: dict[str, str], cap: int = CAP) -> VerifiedImage:
    return verify_image_archive(io.BytesIO(data), len(data), pins=pins, max_layer_bytes=cap, member="images/x.tar")


def test_an_archive_of_the_pinned_image_verifies_with_its_layers_in_order() -> None:
    parts = _parts()
    image = _verify(archive(parts.members()), {parts.image_id: parts.pin()})
    assert (image.form, image.image_id, image.repository) == (FORM_IMAGE_ID, parts.image_id, REPOSITORY)
    assert [layer.size for layer in image.layers] == [len(layer) for layer in parts.layers]


def test_a_registry_digest_pin_is_the_oci_manifest_digest() -> None:
    parts = _parts()
    image = _verify(archive(parts.members()), {parts.manifest_digest: f"{REPOSITORY}@{parts.manifest_digest}"})
    assert (image.form, image.digest, image.image_id) == (FORM_REGISTRY_DIGEST, parts.manifest_digest, parts.image_id)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_archive_is_refused_with_its_reason(case: str) -> None:
    make, reason = HOSTILE[case]
    parts = _parts()
    with pytest.raises(ImageArchiveRefused) as refused:
        _verify(make(parts), {parts.image_id: parts.pin()})
    assert refused.value.reason.value == reason, refused.value.message
    assert "images/x.tar" in refused.value.message


def test_a_layer_over_the_policy_cap_is_refused_at_its_header() -> None:
    parts = _parts()
    with pytest.raises(ImageArchiveRefused) as refused:
        _verify(archive(parts.members()), {parts.image_id: parts.pin()}, cap=len(parts.layers[0]) - 1)
    assert refused.value.reason.value == "image-too-large"
    assert "air_gap.max_image_layer_bytes" in refused.value.message


def test_verified_in_place_inside_a_larger_file() -> None:
    # check mode reads the archive where it lies in the bundle file
    parts = _parts()
    data = archive(parts.members())
    outer = io.BytesIO(b"\xff" * 1536 + data + b"\xee" * 4096)
    image = verify_image_archive(
        Window(outer, 1536, len(data)),  # type: ignore[arg-type]
        len(data),
        pins={parts.image_id: parts.pin()},
        max_layer_bytes=CAP,
        member="images/x.tar",
    )
    assert image.image_id == parts.image_id


def test_the_load_archive_holds_the_verified_blobs_and_only_our_tag() -> None:
    parts = _parts()
    parts.layers.append(parts.layers[0])  # a layer used twice is sent once
    data = archive(parts.members())
    image = _verify(data, {parts.image_id: parts.pin()})
    size, chunks = load_stream(io.BytesIO(data), image)
    sent = b"".join(chunks)

    assert len(sent) == size
    with tarfile.open(fileobj=io.BytesIO(sent)) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert names[0] == "manifest.json" and len(names) == 1 + 1 + 2  # config and two distinct layers
    assert manifest[0]["RepoTags"] == [load_tag(REPOSITORY, parts.image_id)]  # never the archive's own tags
    assert len(manifest[0]["Layers"]) == 3


def test_split_pin_takes_the_repository_and_digest() -> None:
    digest = "sha256:" + "a" * 64
    assert split_pin(f"registry.local:5000/team/vllm@{digest}") == ("registry.local:5000/team/vllm", digest)
    assert split_pin(f"team/vllm:0.6@{digest}") == ("team/vllm", digest)
    assert split_pin("team/vllm:0.6") is None

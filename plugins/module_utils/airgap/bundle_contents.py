"""What a bundle's verified members hold, checked against its control-signed desired state (step 5 of
``bundle_reader``): each artifact's files against its manifest, signed by the artifact keys and pinned by the
state, and each image archive against the state's image pins and the policy's repositories."""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.airgap import image_archive
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_refused import BundleProblem, BundleRefused
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = ["MANIFEST_NAME", "check_artifacts", "check_images"]

MANIFEST_NAME = "manifest.json"


def check_artifacts(
    bundle: contracts.Bundle, kept: Mapping[str, bytes], policy: Policy, state: contracts.DesiredState
) -> tuple[trust.VerifiedManifest, ...]:
    """Each ``artifacts/<name>/<version>/`` holds ``manifest.json`` (signed by the artifact keys, naming
    that name and version, and the very manifest the control-signed state pins for that artifact) and, under
    ``files/``, exactly the files it lists, with the same sizes and digests: the authority cannot ship model
    bytes the artifact keys did not sign, nor an artifact (or another manifest of it) control did not ask for."""
    pinned = {(ref.name, ref.version): _payload_sha256(ref.manifest.payload) for ref in state.artifacts}
    groups: dict[tuple[str, str], dict[str, contracts.BundleFile]] = {}
    manifests: dict[tuple[str, str], str] = {}
    for entry in bundle.files:
        parts = entry.path.split("/")
        if parts[0] != "artifacts":
            continue
        if len(parts) == 4 and parts[3] == MANIFEST_NAME:
            manifests[(parts[1], parts[2])] = entry.path
        elif len(parts) >= 5 and parts[3] == "files":
            groups.setdefault((parts[1], parts[2]), {})["/".join(parts[4:])] = entry
        else:
            raise BundleRefused(
                BundleProblem.ARTIFACT,
                f"{entry.path!r} is neither artifacts/<name>/<version>/{MANIFEST_NAME} nor "
                "artifacts/<name>/<version>/files/<path>",
                entry.path,
            )
    verified: list[trust.VerifiedManifest] = []
    for key in sorted(set(groups) | set(manifests)):
        name, version = key
        where = f"artifacts/{name}/{version}/"
        if key not in manifests:
            raise BundleRefused(BundleProblem.ARTIFACT, f"{where} holds files but no {MANIFEST_NAME}", where)
        member = manifests[key]
        try:
            manifest = trust.verify_artifact_manifest(kept[member], policy)
        except trust.Rejection as rejection:
            raise BundleRefused(rejection.code, f"{member}: {rejection.message}", member) from rejection
        document = manifest.manifest
        if (document.name, document.version) != key:
            raise BundleRefused(
                BundleProblem.ARTIFACT,
                f"{member} is signed for {document.name} {document.version}, but lies under {where}",
                member,
            )
        if key not in pinned:
            raise BundleRefused(
                BundleProblem.ARTIFACT,
                f"{member}: the desired state inside names no artifact {name} {version}; a bundle carries only "
                "the artifacts its control-signed state asks for",
                member,
            )
        if pinned[key] != manifest.payload_sha256:
            raise BundleRefused(
                BundleProblem.ARTIFACT,
                f"{member} is not the manifest the desired state pins for {name} {version}: its payload sha256 is "
                f"{manifest.payload_sha256}, the state's {pinned[key]}; make the bundle with the manifest the state "
                "was published with",
                member,
            )
        listed = groups.get(key, {})
        for file in document.files:
            shipped = listed.get(file.path)
            if shipped is None or (shipped.size, shipped.sha256) != (file.size, file.sha256):
                found = "missing" if shipped is None else f"{shipped.size} bytes, sha256 {shipped.sha256}"
                raise BundleRefused(
                    BundleProblem.ARTIFACT,
                    f"{where}files/{file.path}: the manifest lists {file.size} bytes, sha256 {file.sha256}; the "
                    f"bundle has {found}",
                    f"{where}files/{file.path}",
                )
        extra = sorted(set(listed) - {file.path for file in document.files})
        if extra:
            raise BundleRefused(
                BundleProblem.ARTIFACT,
                f"{where}files/{extra[0]} is not in {document.name} {document.version}'s manifest",
                f"{where}files/{extra[0]}",
            )
        verified.append(manifest)
    return tuple(verified)


def _payload_sha256(payload: str) -> str:
    # The contract has checked it is canonical base64.
    return hashlib.sha256(base64.b64decode(payload)).hexdigest()


# --- images ----------------------------------------------------------------------------------------------


def check_images(
    verified: trust.VerifiedBundle,
    listing: Mapping[str, contracts.BundleFile],
    policy: Policy,
    handle: io.FileIO,
    incoming: Optional[str],
    seen: Mapping[str, int],
    offsets: Mapping[str, int],
) -> dict[str, image_archive.VerifiedImage]:
    """Each ``images/<name>.tar`` must yield exactly one image that an engine of the control-signed state pins
    by digest, from a repository the policy allows, and no two archives the same image. Read from the copy in
    scratch the reader itself wrote (``check_bundle``: in place in the bundle file, read a second time)."""
    pins: dict[str, str] = {}
    for engine in verified.desired.state.engines:
        split = image_archive.split_pin(engine.image)
        if split is not None:
            pins.setdefault(split[1], engine.image)
    images: dict[str, image_archive.VerifiedImage] = {}
    by_digest: dict[str, str] = {}
    for path in sorted(offsets):
        entry = listing[path]
        try:
            if incoming is None:
                source: io.RawIOBase = image_archive.Window(handle, offsets[path], entry.size)
            else:
                fd = os.open(os.path.join(incoming, str(seen[path])), os.O_RDONLY | os.O_NOFOLLOW)
                source = io.FileIO(fd, "rb", closefd=True)
            with source:
                image = image_archive.verify_image_archive(
                    source,  # type: ignore[arg-type]
                    entry.size,
                    pins=pins,
                    max_layer_bytes=policy.air_gap.max_image_layer_bytes,
                    member=path,
                )
        except image_archive.ImageArchiveRefused as exc:
            raise BundleRefused(exc.reason, exc.message, path) from None
        problem = policy.image_allowed(image.reference)
        if problem is not None:
            raise BundleRefused(
                BundleProblem.IMAGE_NOT_ALLOWED,
                f"{path} holds {image.reference}, which may not run here: {problem}",
                path,
            )
        if image.digest in by_digest:
            raise BundleRefused(
                image_archive.ImageArchiveProblem.EXTRA,
                f"{path} holds the same image as {by_digest[image.digest]} ({image.reference}): one archive per image",
                path,
            )
        by_digest[image.digest] = path
        images[path] = image
    return images

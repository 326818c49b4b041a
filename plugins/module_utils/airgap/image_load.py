"""After the reader: the engine images a verified bundle carries, loaded into the local Docker Engine.

Runs on: the side that applies a bundle (root's inbox unit, the in-process air-gapped agent, or the
``airgap_bundle`` module), on the managed host's Python (3.9+).

Only ever called with an ``UnpackedBundle``, so only after the whole bundle verified, and only from the
verified copy in scratch (never the inbox). Docker is fed ``image_archive.load_stream``: the verified config
and layers with a ``manifest.json`` written here, tagged only ``load_tag(repository, image id)``. An image
already present by its pin is not loaded again (``plan_images``, which check mode reports as is).

A registry-digest pin (``repo@sha256:<manifest digest>``) is refused here, before anything is loaded: Docker's
classic image store records a registry digest only for what it pulled, so a loaded image could never be found
by that pin, and an engine would fail later, less clearly (docs/AIR_GAP.md, "Images").
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_archive import (
    FORM_IMAGE_ID,
    VerifiedImage,
    load_stream,
    load_tag,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError

__all__ = ["ImageLoadError", "PlannedImage", "load_images", "plan_images"]


class ImageLoadError(MeridianError):
    """A bundle's verified image could not be put into Docker; the message names the image and what to do."""


@dataclass(frozen=True)
class PlannedImage:
    """One image of the bundle: ``member`` (``images/<name>.tar``), the image, and whether it must be loaded."""

    member: str
    image: VerifiedImage
    load: bool

    def report(self) -> dict[str, Any]:
        return {
            "member": self.member,
            "reference": self.image.reference,
            "image_id": self.image.image_id,
            "bytes": self.image.archive_bytes,
            "loaded": self.load,
        }


def plan_images(images: Mapping[str, VerifiedImage], api: DockerApi) -> list[PlannedImage]:
    """Which images are missing by their pin (to load) and which are there already; refuses, before anything
    is loaded, a pin that loading could not satisfy."""
    planned = []
    for member in sorted(images):
        image = images[member]
        present = _present(api, image)
        if not present and image.form != FORM_IMAGE_ID:
            raise ImageLoadError(
                f"{member} holds {image.reference}, pinned by its registry manifest digest, which this Docker Engine "
                "cannot record for a loaded image (its classic image store keeps registry digests only for pulls): "
                f"pin the engine by its image id instead, {image.repository}@{image.image_id}"
            )
        planned.append(PlannedImage(member, image, load=not present))
    return planned


def load_images(planned: list[PlannedImage], files: Mapping[str, str], api: DockerApi) -> list[dict[str, Any]]:
    """Load each planned image that is missing, from its verified archive at ``files[member]``; then make sure
    Docker has it by its pin. Returns ``PlannedImage.report()`` per image."""
    for item in planned:
        if not item.load:
            continue
        image = item.image
        fd = os.open(files[item.member], os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with io.FileIO(fd, "rb", closefd=True) as handle:
            size, chunks = load_stream(handle, image)
            try:
                api.load(chunks, size, f"{item.member} ({image.reference})")
            except DockerApiError as exc:
                raise ImageLoadError(f"Error loading {image.reference} from {item.member}: {exc}") from exc
        if not _present(api, image):
            raise ImageLoadError(
                f"{image.reference} is not in the Docker Engine after loading {item.member}: the engine reported "
                f"no error, but has no image {image.image_id} tagged in {image.repository}"
            )
    return [item.report() for item in planned]


def _present(api: DockerApi, image: VerifiedImage) -> bool:
    """Whether Docker has ``image`` as ``docker.engine.resolve_image`` will look for it."""
    try:
        attrs = api.inspect_image(image.reference if image.form != FORM_IMAGE_ID else image.image_id)
    except DockerApiError as exc:
        if exc.not_found:
            return False
        raise ImageLoadError(f"Error looking for {image.reference} in the Docker Engine: {exc}") from exc
    if image.form != FORM_IMAGE_ID:
        return True
    tagged = {tag.rsplit(":", 1)[0] for tag in attrs.get("RepoTags") or ()}
    return attrs.get("Id") == image.image_id and image.repository in tagged


def tag_of(image: VerifiedImage) -> str:
    """The tag a loaded image carries (``image_archive.load_tag``)."""
    return load_tag(image.repository, image.image_id)

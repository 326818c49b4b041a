"""The air-gap bundle's signed listing (``Bundle``, the payload of its first member, bundle.json: docs/AIR_GAP.md).

It lists every other member of the tar, so a reader knows each path, size and digest before it reads a byte
of any of them."""

from __future__ import annotations

import unicodedata
from typing import Annotated, Literal

from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import (
    INT64_MAX,
    AfterValidator,
    Field,
    Name,
    NodeId,
    RelativePath,
    Sha256Hex,
    StrictModel,
    UtcTimestamp,
    model_validator,
    refuse_file_and_directory,
)
from ansible_collections.meridian.node.plugins.module_utils.contract_models.signed import Envelope

__all__ = ["BUNDLE_ENVELOPE_NAME", "BUNDLE_TOP_DIRECTORIES", "Bundle", "BundleFile", "BundlePath", "bundle_path_key"]

# The tar's first member; no listed member may take its name.
BUNDLE_ENVELOPE_NAME = "bundle.json"
# Top-level directories a bundle's members live in; each has one meaning (docs/AIR_GAP.md, "Layout").
BUNDLE_TOP_DIRECTORIES = ("artifacts", "playbooks", "collection", "images")


def _bundle_member_path(value: str) -> str:
    top = value.split("/", 1)[0]
    if "/" not in value or top not in BUNDLE_TOP_DIRECTORIES:
        raise ValueError(
            f"path {value!r} must be inside one of the bundle's directories "
            f"({', '.join(d + '/' for d in BUNDLE_TOP_DIRECTORIES)}); see docs/AIR_GAP.md"
        )
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise ValueError(f"path {value!r} contains a control character")
    return value


BundlePath = Annotated[RelativePath, AfterValidator(_bundle_member_path)]


class BundleFile(StrictModel):
    """One member of the bundle's tar besides bundle.json: its path there, its size and its sha256."""

    path: BundlePath
    size: Annotated[int, Field(ge=0, le=INT64_MAX)]
    sha256: Sha256Hex


def bundle_path_key(path: str) -> str:
    """The form two member paths share when some filesystem would store them as one file: Unicode NFC
    (macOS and some tools normalise), then case-folded (case-insensitive filesystems)."""
    return unicodedata.normalize("NFC", path).casefold()


class Bundle(StrictModel):
    """An air-gap delivery for one node: the control-signed desired state it applies (``generation`` is
    that state's generation) and every other member of the tar it travels in."""

    apiVersion: Literal["meridian.node/v1"]
    kind: Literal["Bundle"]
    bundle_id: Name
    node_id: NodeId
    generation: Annotated[int, Field(ge=1, le=INT64_MAX, description="the generation of the desired state inside")]
    created_at: UtcTimestamp
    expires_at: UtcTimestamp
    desired_state: Envelope
    files: list[BundleFile] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Bundle:
        if self.expires_at <= self.created_at:
            raise ValueError("expires_at must be later than created_at")
        seen: dict[str, str] = {}
        for entry in self.files:
            key = bundle_path_key(entry.path)
            if key in seen:
                raise ValueError(
                    f"paths {seen[key]!r} and {entry.path!r} name the same file on some filesystems "
                    "(the same after Unicode NFC and case folding): list each member once"
                )
            seen[key] = entry.path
        refuse_file_and_directory(seen)
        collections = [entry.path for entry in self.files if entry.path.startswith("collection/")]
        has_playbooks = any(entry.path.startswith("playbooks/") for entry in self.files)
        if has_playbooks != bool(collections):
            raise ValueError(
                "a bundle carries playbooks/ and collection/ together or neither: its playbooks run with the "
                "collection shipped beside them"
            )
        if len(collections) > 1 or any(path.count("/") != 1 or not path.endswith(".tar.gz") for path in collections):
            raise ValueError(
                f"collection/ holds exactly one collection tarball, collection/<name>.tar.gz (got {collections})"
            )
        # Engine images: one archive per image, directly under images/ (docs/AIR_GAP.md, "Images").
        images = [entry.path for entry in self.files if entry.path.startswith("images/")]
        odd = [path for path in images if path.count("/") != 1 or not path.endswith(".tar") or path == "images/.tar"]
        if odd:
            raise ValueError(f"images/ holds image archives named images/<name>.tar, nothing else (got {odd[0]!r})")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

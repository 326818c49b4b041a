"""Root's record of the engine images this project pulled, and since when a prune found each unused.

A pulled image cannot carry a label saying who brought it (its config is the registry's, and its id is the
hash of that config), and the repository digest it is known by is the same whoever pulled it. So
``engine_set`` and ``engine_instance`` write down, in their state directory, every image they pulled and for
which ``owner``: ``<state_dir>/images.json``. ``engines.image_prune`` removes only images found here (or loaded
from a bundle, recognised by their ``meridian-<id>`` tag) and keeps here the time a prune first found each one
unused, which is where the grace counts from.

The file is root's (0600): the agent never reads it, and nothing of it is secret or needed outside. A file
that does not parse is an error naming it, never a reset: forgetting what we pulled would only keep images
(never remove a foreign one), but forgetting the unused-since times would silently restart every grace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    atomic_write,
    read_capped,
)

__all__ = [
    "IMAGE_RECORD_FILE",
    "BroughtImage",
    "ImageRecordError",
    "read_image_record",
    "write_image_record",
]

IMAGE_RECORD_FILE = "images.json"
_VERSION = 1
# A few hundred bytes per image; a host that pulled ten thousand distinct engine images is broken elsewhere.
_MAX_RECORD_BYTES = 4 * 1024 * 1024


class ImageRecordError(MeridianError, ValueError):
    """Root's image record could not be read or written; the message names the file and what to do."""


@dataclass(frozen=True)
class BroughtImage:
    """One image we brought: its Docker image id, the reference it was pulled (or loaded) as, the owner whose
    ``engine_set`` brought it (None: loaded from a bundle), how (``pulled`` or ``loaded``), and the wall-clock
    time (seconds since the epoch) a prune first found it unused, or None while something uses it."""

    image_id: str
    reference: str
    owner: str | None
    brought: str
    unused_since: float | None = None

    def unused_from(self, now: float | None) -> BroughtImage:
        return replace(self, unused_since=now)

    def as_json(self) -> dict[str, Any]:
        """Every field but ``image_id``, which keys the record's ``images``."""
        document = asdict(self)
        del document["image_id"]
        return document


def _path(state_dir: str) -> str:
    return os.path.join(state_dir, IMAGE_RECORD_FILE)


def read_image_record(state_dir: str) -> dict[str, BroughtImage]:
    """The record by image id; empty when there is no file yet. Raises ``ImageRecordError`` for a damaged one."""
    path = _path(state_dir)
    try:
        data = read_capped(path, _MAX_RECORD_BYTES, what="the image record")
    except CappedFileMissingError:
        return {}
    except CappedReadError as exc:
        raise ImageRecordError(f"{exc}; the image prune needs it: repair or remove {path}") from exc
    try:
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("version") != _VERSION:
            raise ValueError(f"expected an object with version {_VERSION}")
        images = document["images"]
        if not isinstance(images, dict):
            raise ValueError("'images' is not an object")
        return {str(image_id): _entry(str(image_id), entry) for image_id, entry in images.items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise ImageRecordError(
            f"the image record {path} is damaged ({exc}): nothing was pruned; remove the file to forget which "
            "images were pulled (they are then kept until removed by hand)"
        ) from None


def _entry(image_id: str, entry: Any) -> BroughtImage:
    if not isinstance(entry, Mapping) or not image_id.startswith("sha256:"):
        raise ValueError(f"entry {image_id!r} is not an image id with an object")
    since = entry.get("unused_since")
    if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))):
        raise ValueError(f"entry {image_id!r}: unused_since {since!r} is not a time")
    owner = entry.get("owner")
    brought = entry.get("brought")
    if brought not in ("pulled", "loaded") or not isinstance(entry.get("reference"), str):
        raise ValueError(f"entry {image_id!r}: brought {brought!r} or its reference is not as written")
    return BroughtImage(
        image_id=image_id,
        reference=str(entry["reference"]),
        owner=None if owner is None else str(owner),
        brought=str(brought),
        unused_since=None if since is None else float(since),
    )


def write_image_record(state_dir: str, record: Mapping[str, BroughtImage]) -> None:
    """Replace the record atomically (a reader, or a run cut short, sees the old file or the new one)."""
    path = _path(state_dir)
    document = {"version": _VERSION, "images": {key: record[key].as_json() for key in sorted(record)}}
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        atomic_write(path, json.dumps(document, indent=1, sort_keys=True).encode("utf-8") + b"\n", mode=0o600)
    except OSError as exc:
        raise ImageRecordError(f"cannot write the image record {path}: {exc.strerror or exc}") from exc

"""The artifact store's index, ``index.json``: what was verified (versions with their files, size, pin,
last use and verification time; the stat of every verified blob), read and written whole, atomically, 0600.

A damaged index is an error that says how to recover (move it aside: blobs on disk are re-hashed and adopted),
never a silent reset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactStoreError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.plan import (
    _FORMAT,
    INDEX_FILE,
    BlobRecord,
    VersionRecord,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339

__all__ = ["IndexInProgress", "load_index", "write_index"]


def load_index(root: str) -> dict[str, Any]:
    """What the index at ``root`` records: ``versions`` (``VersionRecord`` by (name, version)) and ``blobs``
    (``BlobRecord`` by sha256), both empty when there is no index yet; ``ArtifactStoreError`` for one that cannot
    be read or is damaged."""
    path = os.path.join(root, INDEX_FILE)
    try:
        with open(path, "rb") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        return {"versions": {}, "blobs": {}}
    except PermissionError as exc:
        # Still an OSError, so callers that skip an unreadable store (the agent's observer) keep doing so.
        raise PermissionError(
            exc.errno,
            f"the store index {path} is readable by root only (the store writes it 0600); run this as root "
            "(for example sudo meridian-node artifact list)",
        ) from exc
    except (OSError, ValueError) as exc:
        raise ArtifactStoreError(
            f"the store index {path} cannot be read ({exc}); move it aside and run again: blobs on disk are "
            "re-hashed and adopted, nothing is downloaded twice"
        ) from exc
    try:
        if raw.get("format") != _FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {_FORMAT}")
        blobs = {sha: BlobRecord(int(b["size"]), int(b["ino"]), int(b["mtime_ns"])) for sha, b in raw["blobs"].items()}
        versions = {}
        for name, by_version in raw["versions"].items():
            for version, v in by_version.items():
                versions[(name, version)] = VersionRecord(
                    name=name,
                    version=version,
                    manifest_sha256=str(v["manifest_sha256"]),
                    files=tuple((str(p), str(s), int(n)) for p, s, n in v["files"]),
                    size=int(v["size"]),
                    pinned=bool(v["pinned"]),
                    last_used=datetime.fromisoformat(v["last_used"]),
                    verified_at=datetime.fromisoformat(v["verified_at"]),
                )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactStoreError(
            f"the store index {path} is damaged ({type(exc).__name__}: {exc}); move it aside and run again"
        ) from exc
    return {"versions": versions, "blobs": blobs}


def write_index(root: str, versions: Mapping[tuple[str, str], VersionRecord], blobs: Mapping[str, BlobRecord]) -> None:
    document: dict[str, Any] = {"format": _FORMAT, "blobs": {}, "versions": {}}
    for sha, blob in sorted(blobs.items()):
        document["blobs"][sha] = {"size": blob.size, "ino": blob.ino, "mtime_ns": blob.mtime_ns}
    for (name, version), record in sorted(versions.items()):
        document["versions"].setdefault(name, {})[version] = {
            "manifest_sha256": record.manifest_sha256,
            "files": [list(item) for item in record.files],
            "size": record.size,
            "pinned": record.pinned,
            "last_used": format_rfc3339(record.last_used),
            "verified_at": format_rfc3339(record.verified_at),
        }
    # Root-only: nothing in it is secret, but no one else has any business with what the store trusts.
    atomic_write(os.path.join(root, INDEX_FILE), json.dumps(document, indent=1).encode(), mode=0o600)


@dataclass
class IndexInProgress:
    """The index as one apply changes it: its versions and blobs, written back after each step."""

    root: str
    document: dict[str, Any]
    versions: dict[tuple[str, str], VersionRecord] = field(init=False)
    blobs: dict[str, BlobRecord] = field(init=False)

    def __post_init__(self) -> None:
        self.versions = dict(self.document["versions"])
        self.blobs = dict(self.document["blobs"])

    def write(self) -> None:
        write_index(self.root, self.versions, self.blobs)

    def referenced(self) -> set[str]:
        return {sha for record in self.versions.values() for sha in record.digests}

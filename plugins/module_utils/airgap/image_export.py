"""``make-bundle --image``: an engine image from the local Docker into the archive form hosts verify.

Runs on: the machine that makes bundles (``meridian-node make-bundle``); standard library only.

The local Docker's export (``GET /images/NAME/get``, what ``docker save`` writes: the legacy layout of Docker
20.10 with ``<id>/layer.tar`` directories and links, or the OCI layout of Docker 25+) is read once and rewritten
as the one strict form ``image_archive`` reads: ``oci-layout``, ``index.json``, ``manifest.json`` and
``blobs/sha256/<hex>``, regular files only. Each layer is written under its config's ``diff_id`` and hashed as
it is copied; a layer whose bytes do not hash to it (a compressed layer, as a containerd image store exports)
is refused with the reason. The result is then verified by ``image_archive.verify_image_archive`` against the
pin before the bundle is signed, so make-bundle never ships an archive a host would refuse.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import tempfile
from typing import IO, Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_archive import MAX_DOCUMENT_BYTES

__all__ = ["ImageExportError", "rewrite_docker_save"]

_CHUNK_BYTES = 1024 * 1024
_HEX = re.compile(r"sha256:([0-9a-f]{64})")
_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


class ImageExportError(MeridianError):
    """The local Docker's export could not be made into a bundle's image archive; the message says why."""


def rewrite_docker_save(source: IO[bytes], out: IO[bytes], *, image_id: str, what: str) -> None:
    """Write the archive for image ``image_id`` (``sha256:<hex>``) to ``out`` from ``source``, a ``docker save``
    of that image. ``what`` names the image in messages."""
    with tarfile.open(fileobj=source, mode="r:") as save:
        entry = _manifest_entry(save, what)
        config_data = _read_member(save, entry.get("Config"), what, MAX_DOCUMENT_BYTES)
        config_hex = hashlib.sha256(config_data).hexdigest()
        if "sha256:" + config_hex != image_id:
            raise ImageExportError(
                f"{what}: Docker exported the image with id sha256:{config_hex}, not {image_id}: export it again"
            )
        diff_ids = _diff_ids(config_data, what)
        layers = entry.get("Layers")
        if not isinstance(layers, list) or len(layers) != len(diff_ids):
            raise ImageExportError(f"{what}: the export lists layers {layers!r} for {len(diff_ids)} diff_ids")
        with tarfile.open(fileobj=out, mode="w:", format=tarfile.USTAR_FORMAT) as archive:
            _add_bytes(archive, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            _add_bytes(archive, f"blobs/sha256/{config_hex}", config_data)
            written: dict[str, int] = {}
            for path, diff_id in zip(layers, diff_ids):
                if diff_id not in written:
                    written[diff_id] = _copy_layer(save, archive, path, diff_id, what)
            manifest = json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": _OCI_MANIFEST,
                    "config": {"mediaType": _OCI_CONFIG, "digest": image_id, "size": len(config_data)},
                    "layers": [{"mediaType": _OCI_LAYER, "digest": d, "size": written[d]} for d in diff_ids],
                },
                separators=(",", ":"),
            ).encode()
            manifest_hex = hashlib.sha256(manifest).hexdigest()
            _add_bytes(archive, f"blobs/sha256/{manifest_hex}", manifest)
            index = {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "manifests": [{"mediaType": _OCI_MANIFEST, "digest": f"sha256:{manifest_hex}", "size": len(manifest)}],
            }
            _add_bytes(archive, "index.json", json.dumps(index, separators=(",", ":")).encode())
            # No RepoTags: a host never reads them; the pinned reference in the signed state names the image.
            docker_manifest = [
                {
                    "Config": f"blobs/sha256/{config_hex}",
                    "RepoTags": None,
                    "Layers": [f"blobs/sha256/{d.split(':', 1)[1]}" for d in diff_ids],
                }
            ]
            _add_bytes(archive, "manifest.json", json.dumps(docker_manifest, separators=(",", ":")).encode())


def _manifest_entry(save: tarfile.TarFile, what: str) -> dict[str, Any]:
    entries = json.loads(_read_member(save, "manifest.json", what, MAX_DOCUMENT_BYTES))
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        raise ImageExportError(f"{what}: Docker's export holds {len(entries)} images, expected exactly one")
    return entries[0]


def _read_member(save: tarfile.TarFile, name: Any, what: str, limit: int) -> bytes:
    if not isinstance(name, str):
        raise ImageExportError(f"{what}: Docker's export names a member {name!r}")
    try:
        handle = save.extractfile(name)  # follows the export's own links (Docker 20.10 links repeated layers)
    except KeyError:
        handle = None
    if handle is None:
        raise ImageExportError(f"{what}: Docker's export has no readable member {name!r}")
    with handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ImageExportError(f"{what}: {name} in Docker's export is larger than {limit} bytes")
    return data


def _diff_ids(config_data: bytes, what: str) -> list[str]:
    config = json.loads(config_data)
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") if isinstance(config, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) and _HEX.fullmatch(d) for d in diff_ids):
        raise ImageExportError(f"{what}: the image config has no rootfs.diff_ids of sha256 digests")
    return list(diff_ids)


def _copy_layer(save: tarfile.TarFile, archive: tarfile.TarFile, path: Any, diff_id: str, what: str) -> int:
    """Copy one layer under its diff_id, hashing as it goes; returns its size."""
    if not isinstance(path, str):
        raise ImageExportError(f"{what}: Docker's export names a layer {path!r}")
    try:
        member = save.getmember(path)
        handle = save.extractfile(member)
    except KeyError:
        handle = None
    if handle is None:
        raise ImageExportError(f"{what}: Docker's export has no readable layer {path!r}")
    # The size is only known for certain once read (a link's header says 0): spool to learn it and the digest.
    with handle, tempfile.TemporaryFile() as spool:
        hasher = hashlib.sha256()
        size = 0
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            hasher.update(chunk)
            spool.write(chunk)
            size += len(chunk)
        if "sha256:" + hasher.hexdigest() != diff_id:
            raise ImageExportError(
                f"{what}: layer {path} hashes to sha256:{hasher.hexdigest()}, not its diff_id {diff_id}: it is "
                "compressed (a containerd image store exports layers as the registry served them), which a "
                "bundle does not carry yet - export the image from a Docker with the classic image store"
            )
        spool.seek(0)
        info = tarfile.TarInfo(f"blobs/sha256/{diff_id.split(':', 1)[1]}")
        info.size, info.mode = size, 0o644
        archive.addfile(info, spool)
    return size


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    archive.addfile(info, io.BytesIO(data))

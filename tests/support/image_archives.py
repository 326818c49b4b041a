"""Image archives for the air-gap image tests: good ones in the form make-bundle writes, and hostile ones.

``ImageParts`` holds one image's pieces (layer tars, config, OCI manifest); ``members()`` lays them out as
``image_export`` does and ``archive()`` writes any list of members as a tar, so each hostile case says exactly
which header or byte is wrong. ``HOSTILE`` names each case with the reason the host gives for it.
``image_bundle`` wraps archives into a real signed bundle whose control-signed state pins ``pins``;
``own_repository`` is a repository name of the test's own to load them into.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.tests.support.bundle_fixtures import AUTHORITY, CONTROL, listed, regular
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    bundle,
    envelope,
    signed,
)

__all__ = [
    "ARCHIVE_SAYS",
    "HOSTILE",
    "REPOSITORY",
    "ImageParts",
    "Members",
    "archive",
    "engine",
    "image_bundle",
    "layer_tar",
    "own_repository",
]

REPOSITORY = "meridian-test/bundled"
ARCHIVE_SAYS = "meridian-test/archive-says:hijacked"
Members = list[tuple[tarfile.TarInfo, "bytes | None"]]


def layer_tar(files: Mapping[str, bytes]) -> bytes:
    """An uncompressed layer: a tar of ``files``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class ImageParts:
    """One image: its layers (in order), the config naming them, and an OCI manifest naming both."""

    layers: list[bytes]
    label: str = "x"
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> bytes:
        document = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Labels": {"meridian.test": self.label}},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{_hex(layer)}" for layer in self.layers]},
            **self.extra_config,
        }
        return json.dumps(document).encode()

    @property
    def image_id(self) -> str:
        return "sha256:" + _hex(self.config)

    @property
    def manifest(self) -> bytes:
        return json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": self.image_id},
                "layers": [{"digest": f"sha256:{_hex(layer)}", "size": len(layer)} for layer in self.layers],
            }
        ).encode()

    @property
    def manifest_digest(self) -> str:
        return "sha256:" + _hex(self.manifest)

    def pin(self, repository: str = REPOSITORY) -> str:
        return f"{repository}@{self.image_id}"

    def members(self, *, docker_manifest: Any = None) -> Members:
        blobs = [self.config, *dict.fromkeys(self.layers), self.manifest]
        docker = docker_manifest or [
            {
                "Config": f"blobs/sha256/{_hex(self.config)}",
                # Hostile on purpose: a host must never apply an archive's tags (this one stands for debian:bookworm,
                # named harmlessly, since the tests share one Docker Engine with everything else on the machine).
                "RepoTags": [ARCHIVE_SAYS],
                "Layers": [f"blobs/sha256/{_hex(layer)}" for layer in self.layers],
            }
        ]
        index = {"schemaVersion": 2, "manifests": [{"digest": self.manifest_digest, "size": len(self.manifest)}]}
        return [
            regular("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            *(regular(f"blobs/sha256/{_hex(blob)}", blob) for blob in blobs),
            regular("index.json", json.dumps(index).encode()),
            regular("manifest.json", json.dumps(docker).encode()),
        ]


def archive(members: Sequence[tuple[tarfile.TarInfo, bytes | None]], tar_format: int = tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tar_format) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return out.getvalue()


def _symlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def _replace(members: Members, name: str, data: bytes) -> Members:
    return [regular(name, data) if info.name == name else (info, old) for info, old in members]


def _huge(parts: ImageParts) -> bytes:
    members = parts.members()
    raw = bytearray(archive(members))
    # The first layer's header: declare 1 TiB (base-256 size field, as GNU tar writes large sizes).
    layer_name = f"blobs/sha256/{_hex(parts.layers[0])}".encode()
    offset = bytes(raw).index(layer_name)
    raw[offset + 124 : offset + 136] = b"\x80" + (1024**4).to_bytes(11, "big")
    checksum = sum(raw[offset : offset + 148]) + 8 * 0x20 + sum(raw[offset + 156 : offset + 512])
    raw[offset + 148 : offset + 156] = f"{checksum:06o}\0 ".encode()
    return bytes(raw)


def _short(parts: ImageParts) -> bytes:
    """A layer header declaring more bytes than the archive holds (the archive cut after it)."""
    data = archive(parts.members())
    layer = parts.layers[0]
    cut = data.index(layer) + len(layer) // 2
    return data[:cut]


def _docker_only(images: Sequence[tuple[bytes, Sequence[bytes]]]) -> bytes:
    """An archive without index.json whose manifest.json names each ``(config, layers)``, with their blobs."""
    blobs = dict.fromkeys(blob for config, layers in images for blob in (config, *layers))
    docker = [
        {"Config": f"blobs/sha256/{_hex(config)}", "Layers": [f"blobs/sha256/{_hex(layer)}" for layer in layers]}
        for config, layers in images
    ]
    return archive(
        [
            *(regular(f"blobs/sha256/{_hex(blob)}", blob) for blob in blobs),
            regular("manifest.json", json.dumps(docker).encode()),
        ]
    )


def _two_images(parts: ImageParts) -> bytes:
    other = ImageParts(layers=[layer_tar({"other": b"2"})], label="second")
    return _docker_only([(parts.config, parts.layers), (other.config, other.layers)])


def _other_image(parts: ImageParts) -> bytes:
    """A well-formed archive of another image than the pinned one (same layers, another config)."""
    return archive(ImageParts(layers=parts.layers, label="not-the-pinned-one").members())


def _bad_layer(parts: ImageParts) -> bytes:
    name = f"blobs/sha256/{_hex(parts.layers[0])}"
    altered = bytearray(parts.layers[0])
    altered[600] ^= 0x01
    return archive(_replace(parts.members(), name, bytes(altered)))


def _diff_ids(parts: ImageParts) -> bytes:
    """A config whose diff_ids name a layer the manifest does not: every blob hashes right, the image is wrong."""
    config = json.loads(parts.config)
    config["rootfs"]["diff_ids"] = ["sha256:" + "0" * 64] * len(parts.layers)
    return _docker_only([(json.dumps(config).encode(), parts.layers)])


def _index_other(parts: ImageParts) -> bytes:
    """index.json's manifest names another config than manifest.json: two images in one archive."""
    other = ImageParts(layers=parts.layers, label="index-says-otherwise")
    members = parts.members()
    members = [m for m in members if m[0].name != "index.json" and m[1] != parts.manifest]
    index = {"schemaVersion": 2, "manifests": [{"digest": other.manifest_digest, "size": len(other.manifest)}]}
    return archive(
        [
            *members[:-1],
            regular(f"blobs/sha256/{_hex(other.manifest)}", other.manifest),
            regular(f"blobs/sha256/{_hex(other.config)}", other.config),
            regular("index.json", json.dumps(index).encode()),
            members[-1],
        ]
    )


def _stowaway(parts: ImageParts) -> bytes:
    extra = b"not part of the image"
    return archive([*parts.members(), regular(f"blobs/sha256/{_hex(extra)}", extra)])


# case: (how to make it from the pinned image's parts, the reason the host gives)
HOSTILE: dict[str, tuple[Callable[[ImageParts], bytes], str]] = {
    "another-image-than-pinned": (_other_image, "image-not-pinned"),
    "index-names-another-manifest": (_index_other, "image-digest-mismatch"),
    "two-images-in-one-archive": (_two_images, "image-extra-content"),
    "unreferenced-blob": (_stowaway, "image-extra-content"),
    "layer-bytes-altered": (_bad_layer, "image-digest-mismatch"),
    "config-names-other-layers": (_diff_ids, "image-digest-mismatch"),
    "symlink-member": (
        lambda parts: archive([*parts.members(), _symlink("blobs/sha256/" + "1" * 64, "/etc/shadow")]),
        "image-unsafe-member",
    ),
    "dot-dot-member": (
        lambda parts: archive([regular("../../etc/cron.d/x", b"* * * * * root true\n"), *parts.members()]),
        "image-unsafe-member",
    ),
    "pax-header": (
        lambda parts: archive(
            [regular("blobs/sha256/" + "2" * 64 + "/" + "a" * 100, b""), *parts.members()], tarfile.PAX_FORMAT
        ),
        "image-unsafe-member",
    ),
    "huge-declared-layer": (_huge, "image-too-large"),
    "declared-size-beyond-the-bytes": (_short, "image-too-large"),
    "duplicated-member": (
        lambda parts: archive([*parts.members(), parts.members()[-1]]),
        "image-duplicate-member",
    ),
}


@contextmanager
def own_repository(client: Any, stem: str) -> Iterator[str]:
    """A repository name of the test's own (``meridian-test/<stem>-<random>``); every image tagged in it is removed
    afterwards."""
    repository = f"meridian-test/{stem}-{secrets.token_hex(4)}"
    yield repository
    for found in client.images.list(name=repository):
        for tag in found.tags:
            client.images.remove(tag)


def engine(name: str, image: str, port: int = 9400) -> dict[str, Any]:
    """An engine of a desired state running ``image`` (the stand-in vLLM shape)."""
    return {
        "name": name,
        "driver": "vllm",
        "image": image,
        "model": {"name": "tiny"},
        "served_model_name": "tiny-chat",
        "port": port,
    }


def image_bundle(
    out: Path,
    archives: Mapping[str, bytes],
    state: Mapping[str, Any],
    *,
    created: datetime,
    node_id: str = NODE_ID,
    tamper: str | None = None,
) -> Path:
    """A signed bundle carrying ``archives`` (``images/<name>.tar``: bytes, in that order) and the control-signed
    ``state``; ``tamper`` names an archive whose last byte is changed after it was listed and signed."""
    members: Sequence[tuple[str, bytes]] = [(f"images/{name}.tar", data) for name, data in archives.items()]
    inner = envelope("desired-state", dict(state), [CONTROL])
    payload = bundle(
        inner,
        node_id=node_id,
        files=[listed(path, data) for path, data in members],
        created_at=created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        expires_at=(created + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    if tamper is not None:
        members = [(p, d[:-1] + bytes([d[-1] ^ 1]) if p == f"images/{tamper}.tar" else d) for p, d in members]
    with tarfile.open(out, "w:", format=tarfile.PAX_FORMAT) as tar:
        for info, data in [
            regular("bundle.json", signed("bundle", payload, [AUTHORITY])),
            *(regular(p, d) for p, d in members),
        ]:
            tar.addfile(info, io.BytesIO(data or b""))
    return out

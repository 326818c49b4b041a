"""Engine images in an air-gap bundle: the archive format, its verification, and the archive Docker is fed.

Runs on: the managed host's Python (3.9+), standard library only; ``make-bundle`` uses the same code.

**Format** (docs/AIR_GAP.md, "Images"): one image per ``images/<name>.tar``, in the layout ``docker save``
writes since Docker 25, an OCI image layout with Docker's ``manifest.json`` beside it, without the legacy
per-layer directories: ``oci-layout``, ``index.json``, ``manifest.json`` and ``blobs/sha256/<hex>`` (config,
uncompressed layers, the OCI manifest), regular files only, ustar headers without extended headers (no name
is longer than 77 characters). ``make-bundle`` rebuilds that from whatever the local Docker's ``docker save``
gives (the legacy layout of Docker 20.10 included), so hosts read one strict form.

**Verification** is I/O-free beyond reading the archive it is handed (a file, or a window of the bundle
file in check mode): every member a safe name of that set, listed once, a regular file whose declared size
fits the archive and the caps; every blob's bytes hash to its name; ``manifest.json`` names exactly one
image; its config's ``rootfs.diff_ids`` are its layers, in order; ``index.json`` (when there) names exactly one
manifest whose config and layers are the same blobs; no blob is left over; and the image is pinned by the
control-signed state: the pin's digest is the config's (an image-id pin, ``repo@sha256:<image id>``) or that
manifest's (a registry-digest pin). Anything else raises ``ImageArchiveRefused`` naming the reason.

**Loading** never hands Docker the archive itself: ``load_stream`` writes a minimal ``docker load`` archive
from the verified blobs with a ``manifest.json`` made here, whose only tag is the pinned repository's
``meridian-<digest prefix>`` (so ``docker.engine.resolve_image`` finds ``repo@sha256:<image id>``); the
archive's own ``RepoTags`` are never read, so it cannot retag ``debian:bookworm``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Optional

from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.airgap.tar_members import EXTENDED_TYPES, member_kind

__all__ = [
    "FORM_IMAGE_ID",
    "FORM_REGISTRY_DIGEST",
    "MAX_DOCUMENT_BYTES",
    "BlobSpan",
    "ImageArchiveProblem",
    "ImageArchiveRefused",
    "VerifiedImage",
    "Window",
    "load_stream",
    "load_tag",
    "split_pin",
    "verify_image_archive",
]

# manifest.json, index.json, the config and the OCI manifest are read into memory; real ones are kilobytes.
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
FORM_IMAGE_ID = "image-id"
FORM_REGISTRY_DIGEST = "registry-digest"
_BLOB = re.compile(r"blobs/sha256/([0-9a-f]{64})")
_PIN = re.compile(r"(?P<repository>[^@]+)@sha256:(?P<hex>[0-9a-f]{64})")
_DOCUMENTS = ("oci-layout", "index.json", "manifest.json")
_CHUNK_BYTES = 1024 * 1024


class ImageArchiveProblem(StrEnum):
    """Why an image archive was refused (the bundle reader's ``reason``)."""

    MALFORMED = "image-malformed"
    UNSAFE = "image-unsafe-member"
    DUPLICATE = "image-duplicate-member"
    TOO_LARGE = "image-too-large"
    DIGEST = "image-digest-mismatch"
    EXTRA = "image-extra-content"
    NOT_PINNED = "image-not-pinned"


class ImageArchiveRefused(MeridianError):
    """An image archive is not one the host loads; ``reason`` for programs, ``message`` for people."""

    def __init__(self, reason: ImageArchiveProblem, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class BlobSpan:
    """Where a verified blob's bytes lie in the archive (offsets from the archive's first byte)."""

    hex: str
    offset: int
    size: int


@dataclass(frozen=True)
class VerifiedImage:
    """One image an archive yields, checked against the pin ``reference`` (``repository@digest``)."""

    reference: str
    repository: str
    digest: str
    form: str  # FORM_IMAGE_ID or FORM_REGISTRY_DIGEST: which digest the pin names
    image_id: str  # sha256:<config digest>, the id Docker gives the loaded image
    config: BlobSpan
    layers: tuple[BlobSpan, ...]  # in the config's order; a layer used twice appears twice
    archive_bytes: int


def split_pin(reference: str) -> Optional[tuple[str, str]]:
    """``(repository, sha256:<hex>)`` of ``repo[:tag]@sha256:<hex>``; None for a reference without a digest."""
    match = _PIN.fullmatch(reference)
    if match is None:
        return None
    repository = match.group("repository")
    last = repository.rsplit("/", 1)[-1]
    if ":" in last:  # repo:tag@digest: the tag says nothing the digest does not
        repository = repository[: len(repository) - len(last)] + last.split(":", 1)[0]
    return repository, "sha256:" + match.group("hex")


def load_tag(repository: str, image_id: str) -> str:
    """The one tag a bundle's image gets: in the pinned repository, named by its digest, so it is ours alone."""
    return f"{repository}:meridian-{image_id.split(':', 1)[1][:16]}"


class Window(io.RawIOBase):
    """``size`` bytes of ``handle`` from ``base``, as a seekable file: an image member read in place."""

    def __init__(self, handle: IO[bytes], base: int, size: int) -> None:
        super().__init__()
        self.handle, self.base, self.size, self.position = handle, base, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, start + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self.size - self.position))
        if not wanted:
            return 0
        self.handle.seek(self.base + self.position)
        count = self.handle.readinto(view[:wanted]) or 0  # type: ignore[attr-defined]
        self.position += count
        return count


def verify_image_archive(
    handle: IO[bytes], size: int, *, pins: Mapping[str, str], max_layer_bytes: int, member: str
) -> VerifiedImage:
    """Verify the image archive of ``size`` bytes in ``handle`` (seekable, read from offset 0).

    ``pins`` maps each digest the control-signed state pins to its reference; ``max_layer_bytes`` caps each
    blob; ``member`` names the archive in messages. Returns the image, or raises ``ImageArchiveRefused``.
    """
    blobs, documents = _walk(handle, size, max_layer_bytes, member)
    config_hex, layer_hexes = _docker_manifest(documents, blobs, member)
    config = _load_json(_read_blob(handle, blobs[config_hex], member), f"{member}: config blob {config_hex}")
    _check_diff_ids(config, layer_hexes, member)
    manifest_hex = _oci_index(handle, documents, blobs, config_hex, layer_hexes, member)
    used = {config_hex, *layer_hexes} | ({manifest_hex} if manifest_hex else set())
    left = sorted(set(blobs) - used)
    if left:
        raise ImageArchiveRefused(
            ImageArchiveProblem.EXTRA,
            f"{member}: blob sha256:{left[0]} is not part of the image manifest.json names ({len(left)} such "
            "blob(s)): an archive carries one image and nothing else",
        )
    image_id = "sha256:" + config_hex
    if image_id in pins:
        digest, form = image_id, FORM_IMAGE_ID
    elif manifest_hex and "sha256:" + manifest_hex in pins:
        digest, form = "sha256:" + manifest_hex, FORM_REGISTRY_DIGEST
    else:
        named = f"image id {image_id}" + (f", manifest sha256:{manifest_hex}" if manifest_hex else "")
        raise ImageArchiveRefused(
            ImageArchiveProblem.NOT_PINNED,
            f"{member} holds the image with {named}, which no engine in the control-signed desired state pins "
            f"(it pins {sorted(pins) or 'no image'}): a bundle carries only the images its state names by digest",
        )
    reference = pins[digest]
    split = split_pin(reference)
    repository = split[0] if split else reference.split("@", 1)[0]
    return VerifiedImage(
        reference=reference,
        repository=repository,
        digest=digest,
        form=form,
        image_id=image_id,
        config=blobs[config_hex],
        layers=tuple(blobs[hex_] for hex_ in layer_hexes),
        archive_bytes=size,
    )


# --- walking the tar ---------------------------------------------------------------------------------------


def _walk(
    handle: IO[bytes], size: int, max_layer_bytes: int, member: str
) -> tuple[dict[str, BlobSpan], dict[str, bytes]]:
    """Every member checked and read once: blobs hashed against their names, documents kept."""
    blobs: dict[str, BlobSpan] = {}
    documents: dict[str, bytes] = {}
    seen: set[str] = set()
    _refuse_extended(handle, 0, member)
    handle.seek(0)
    try:
        # Closing a TarFile opened on a fileobj leaves the fileobj open: the caller's handle stays usable.
        tar = tarfile.open(fileobj=handle, mode="r:")  # noqa: SIM115
    except (tarfile.TarError, ValueError, UnicodeError) as exc:
        raise ImageArchiveRefused(ImageArchiveProblem.MALFORMED, f"{member} is not a plain tar ({exc})") from None
    info = _next(tar, member)  # the header open() parsed; checked for extended headers above
    while info is not None:
        name = _check_member(info, seen, size, max_layer_bytes, member)
        seen.add(name)
        blob = _BLOB.fullmatch(name)
        if blob is None:
            documents[name] = _read_span(handle, info.offset_data, info.size)
        else:
            digest = _hash_span(handle, info.offset_data, info.size)
            if digest != blob.group(1):
                raise ImageArchiveRefused(
                    ImageArchiveProblem.DIGEST,
                    f"{member}: {name} holds bytes whose sha256 is {digest}: a blob must hash to its name - the "
                    "archive was altered or damaged",
                )
            blobs[blob.group(1)] = BlobSpan(blob.group(1), info.offset_data, info.size)
        _refuse_extended(handle, tar.offset, member)
        info = _next(tar, member)
    return blobs, documents


def _next(tar: tarfile.TarFile, member: str) -> Optional[tarfile.TarInfo]:
    try:
        return tar.next()
    except (tarfile.TarError, ValueError, UnicodeError) as exc:
        raise ImageArchiveRefused(
            ImageArchiveProblem.MALFORMED, f"{member}: bad tar header at offset {tar.offset}: {exc}"
        ) from None


def _refuse_extended(handle: IO[bytes], offset: int, member: str) -> None:
    # The format has no use for pax or GNU long-name headers, so none is read (tarfile would hold it in memory).
    handle.seek(offset)
    block = handle.read(tarfile.BLOCKSIZE)
    if len(block) == tarfile.BLOCKSIZE and block[156:157] in EXTENDED_TYPES:
        raise ImageArchiveRefused(
            ImageArchiveProblem.UNSAFE,
            f"{member}: an extended tar header (type {block[156:157]!r}) at offset {offset}: image archive names "
            "are short and plain, so none is read",
        )


def _check_member(info: tarfile.TarInfo, seen: set[str], size: int, max_layer_bytes: int, member: str) -> str:
    name = info.name
    if name.startswith("/") or ".." in name.split("/") or "\\" in name:
        raise ImageArchiveRefused(
            ImageArchiveProblem.UNSAFE,
            f"{member}: member {short_repr(name)} leaves the archive's directory (absolute or '..'): refused",
        )
    if not info.isreg() or info.issparse():
        raise ImageArchiveRefused(
            ImageArchiveProblem.UNSAFE,
            f"{member}: member {short_repr(name)} is {member_kind(info)}: an image archive holds regular files only",
        )
    if name not in _DOCUMENTS and _BLOB.fullmatch(name) is None:
        raise ImageArchiveRefused(
            ImageArchiveProblem.MALFORMED,
            f"{member}: member {short_repr(name)} is not oci-layout, index.json, manifest.json or "
            "blobs/sha256/<64 hex>: make the archive with meridian-node make-bundle --image",
        )
    if name in seen:
        raise ImageArchiveRefused(
            ImageArchiveProblem.DUPLICATE,
            f"{member}: member {name!r} appears twice: one name, one content (a later copy would shadow the one "
            "verified)",
        )
    cap = MAX_DOCUMENT_BYTES if name in _DOCUMENTS else max_layer_bytes
    if info.size > cap:
        what = "air_gap.max_image_layer_bytes" if name not in _DOCUMENTS else "the limit for a JSON document"
        raise ImageArchiveRefused(
            ImageArchiveProblem.TOO_LARGE,
            f"{member}: member {name!r} declares {info.size} bytes, more than {what} ({cap}): refused unread",
        )
    if info.offset_data + info.size > size:
        raise ImageArchiveRefused(
            ImageArchiveProblem.TOO_LARGE,
            f"{member}: member {name!r} declares {info.size} bytes at offset {info.offset_data}, but the archive "
            f"is {size} bytes: its declared size disagrees with the bytes there",
        )
    return name


def _read_span(handle: IO[bytes], offset: int, size: int) -> bytes:
    handle.seek(offset)
    return handle.read(size)


def _hash_span(handle: IO[bytes], offset: int, size: int) -> str:
    hasher = hashlib.sha256()
    handle.seek(offset)
    remaining = size
    while remaining:
        chunk = handle.read(min(_CHUNK_BYTES, remaining))
        if not chunk:
            break  # _check_member made sure the bytes are there; a short read leaves the digest wrong
        hasher.update(chunk)
        remaining -= len(chunk)
    return hasher.hexdigest()


def _read_blob(handle: IO[bytes], span: BlobSpan, member: str) -> bytes:
    if span.size > MAX_DOCUMENT_BYTES:
        raise ImageArchiveRefused(
            ImageArchiveProblem.TOO_LARGE,
            f"{member}: JSON blob sha256:{span.hex} is {span.size} bytes, more than {MAX_DOCUMENT_BYTES}",
        )
    return _read_span(handle, span.offset, span.size)


# --- the chain: manifest.json -> config -> layers, index.json -> the same ---------------------------------


def _load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ImageArchiveRefused(ImageArchiveProblem.MALFORMED, f"{what} is not JSON: {exc}") from None


def _blob_hex(path: Any, blobs: Mapping[str, BlobSpan], what: str) -> str:
    match = _BLOB.fullmatch(path) if isinstance(path, str) else None
    if match is None:
        raise ImageArchiveRefused(
            ImageArchiveProblem.MALFORMED, f"{what} is {short_repr(path)}, not blobs/sha256/<64 hex>"
        )
    if match.group(1) not in blobs:
        raise ImageArchiveRefused(
            ImageArchiveProblem.MALFORMED, f"{what} names {path}, which the archive does not hold"
        )
    return match.group(1)


def _docker_manifest(
    documents: Mapping[str, bytes], blobs: Mapping[str, BlobSpan], member: str
) -> tuple[str, list[str]]:
    if "manifest.json" not in documents:
        raise ImageArchiveRefused(
            ImageArchiveProblem.MALFORMED, f"{member} has no manifest.json: it is not a docker save archive"
        )
    entries = _load_json(documents["manifest.json"], f"{member}: manifest.json")
    entry = _the_one(entries, f"{member}: manifest.json", "images")
    config = _blob_hex(entry.get("Config"), blobs, f"{member}: manifest.json Config")
    layers = entry.get("Layers")
    if not isinstance(layers, list):
        raise ImageArchiveRefused(ImageArchiveProblem.MALFORMED, f"{member}: manifest.json Layers is not a list")
    hexes = [_blob_hex(path, blobs, f"{member}: manifest.json Layers[{n}]") for n, path in enumerate(layers)]
    return config, hexes


def _the_one(items: Any, where: str, noun: str) -> dict[str, Any]:
    # manifest.json and index.json each list the archive's images: exactly one, the one pinned.
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ImageArchiveRefused(ImageArchiveProblem.MALFORMED, f"{where} holds no list of {noun}")
    if len(items) != 1:
        raise ImageArchiveRefused(
            ImageArchiveProblem.EXTRA,
            f"{where} names {len(items)} {noun}: an archive carries exactly one image, the one pinned",
        )
    one: dict[str, Any] = items[0]
    return one


def _check_diff_ids(config: Any, layers: Sequence[str], member: str) -> None:
    rootfs = config.get("rootfs") if isinstance(config, dict) else None
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or (rootfs or {}).get("type") != "layers":
        raise ImageArchiveRefused(
            ImageArchiveProblem.MALFORMED, f"{member}: the config has no rootfs of type 'layers' with diff_ids"
        )
    expected = ["sha256:" + hex_ for hex_ in layers]
    if diff_ids != expected:
        raise ImageArchiveRefused(
            ImageArchiveProblem.DIGEST,
            f"{member}: the config's rootfs.diff_ids {diff_ids} are not the layers manifest.json names {expected}: "
            "the image would not be the one its id names (layers are uncompressed, so each blob is its diff_id)",
        )


def _oci_index(
    handle: IO[bytes],
    documents: Mapping[str, bytes],
    blobs: Mapping[str, BlobSpan],
    config: str,
    layers: Sequence[str],
    member: str,
) -> Optional[str]:
    """The OCI manifest ``index.json`` names (its hex), checked to be the same image; None without index.json."""
    if "index.json" not in documents:
        return None
    index = _load_json(documents["index.json"], f"{member}: index.json")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    digest = _the_one(manifests, f"{member}: index.json", "manifests").get("digest")
    path = f"blobs/sha256/{digest[7:]}" if isinstance(digest, str) and digest.startswith("sha256:") else digest
    hex_ = _blob_hex(path, blobs, f"{member}: index.json's manifest")
    manifest = _load_json(_read_blob(handle, blobs[hex_], member), f"{member}: manifest blob sha256:{hex_}")
    if not isinstance(manifest, dict):
        raise ImageArchiveRefused(ImageArchiveProblem.MALFORMED, f"{member}: manifest blob sha256:{hex_} is no object")
    described = manifest.get("config")
    named_config = described.get("digest") if isinstance(described, dict) else None
    named_layers = [item.get("digest") if isinstance(item, dict) else None for item in manifest.get("layers") or []]
    if named_config != "sha256:" + config or named_layers != ["sha256:" + layer for layer in layers]:
        raise ImageArchiveRefused(
            ImageArchiveProblem.DIGEST,
            f"{member}: index.json's manifest sha256:{hex_} names config {named_config} and layers {named_layers}, "
            f"not manifest.json's config sha256:{config} and layers: two different images in one archive",
        )
    return hex_


# --- what Docker is fed --------------------------------------------------------------------------------------


def load_stream(handle: IO[bytes], image: VerifiedImage) -> tuple[int, Iterator[bytes]]:
    """The ``docker load`` archive of the verified ``image`` (read from ``handle``, the verified archive): its
    size in bytes and its chunks. Holds the config and each distinct layer once, and a ``manifest.json`` made
    here whose only tag is ``load_tag``: nothing the archive says about names reaches Docker."""
    distinct: list[BlobSpan] = []
    for span in (image.config, *image.layers):
        if span.hex not in {known.hex for known in distinct}:
            distinct.append(span)
    manifest = json.dumps(
        [
            {
                "Config": f"blobs/sha256/{image.config.hex}",
                "RepoTags": [load_tag(image.repository, image.image_id)],
                "Layers": [f"blobs/sha256/{span.hex}" for span in image.layers],
            }
        ]
    ).encode("utf-8")
    size = _member_bytes(len(manifest)) + sum(_member_bytes(span.size) for span in distinct) + 2 * tarfile.BLOCKSIZE

    def chunks() -> Iterator[bytes]:
        yield _header("manifest.json", len(manifest)) + _padded(manifest)
        for span in distinct:
            yield _header(f"blobs/sha256/{span.hex}", span.size)
            handle.seek(span.offset)
            remaining = span.size
            while remaining:
                chunk = handle.read(min(_CHUNK_BYTES, remaining))
                if not chunk:
                    raise ImageArchiveRefused(
                        ImageArchiveProblem.TOO_LARGE, f"blob sha256:{span.hex} ended early while it was loaded"
                    )
                remaining -= len(chunk)
                yield chunk
            yield b"\0" * (-span.size % tarfile.BLOCKSIZE)
        yield b"\0" * (2 * tarfile.BLOCKSIZE)

    return size, chunks()


def _member_bytes(size: int) -> int:
    return tarfile.BLOCKSIZE + size + (-size % tarfile.BLOCKSIZE)


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(format=tarfile.USTAR_FORMAT)

"""The air-gap bundle reader: one tar file in, verified files in scratch (or a verdict only) out.

At an air-gapped site the bundle file is the whole attack surface, so this reader trusts nothing in it
until the authority's signature says what to expect, and then checks each byte against that:

1. The file must be a regular file (opened without following a symlink, without blocking on a FIFO).
2. Its first tar member must be ``bundle.json``, at most ``MAX_ENVELOPE_BYTES``; it is verified by
   ``trust.verify_bundle`` (authority threshold, node, expiry, generation, and the control-signed state
   inside) before any other member is looked at; shipped code (``playbooks/``, ``collection/``) must then
   be exactly what that state's ``runbook`` pins, and allowed by ``air_gap.shipped_code`` (``runbook.py``).
3. The signed listing is checked against the policy's caps (``air_gap.max_members``, ``air_gap.max_bytes``)
   and the scratch filesystem's free space before a member is read.
4. Each further tar header is refused unless it is a plain regular file (no symlink, hard link, device,
   FIFO, directory or sparse member) whose name is a safe relative path listed in ``bundle.json``, not
   seen before, with the listed size. Its data is then read once, hashed as it is read, and written
   under a name this reader makes up (never a path from the tar) in a fresh directory in scratch.
5. After the last member: an end-of-archive marker followed by nothing but zero padding, every listed
   member present, every artifact manifest verified by the artifact keys and matching its files, and every
   image archive (``images/<name>.tar``) yielding exactly one image that an engine of the control-signed state
   pins, from a repository the policy allows (``image_archive.py``; read from the copy in scratch).
6. Only then are the files renamed into a tree by their (signed, validated) listed paths, still inside
   that scratch directory. On any refusal the directory is removed and ``BundleRefused`` names the reason.

The tar headers are read by the standard library's ``tarfile`` (which knows the ustar, GNU and pax forms);
the decisions on each header, and the reading of member data, are this module's. Only the sizes of
extended headers (pax, GNU long names) are looked at before ``tarfile`` reads them, so that a hostile one
cannot make it hold a gigabyte in memory.

Plain tar only: model weights do not compress, and a compressed bundle would add a decompression bomb
to the attack surface for no gain (docs/AIR_GAP.md).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Optional, Union

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.airgap import image_archive, runbook
from ansible_collections.meridian.node.plugins.module_utils.airgap.tar_members import EXTENDED_TYPES, member_kind
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "MAX_EXTENDED_HEADER_BYTES",
    "BundleCheck",
    "BundleProblem",
    "BundleRefused",
    "UnpackedBundle",
    "check_bundle",
    "check_scratch",
    "unpack_bundle",
]

# bundle.json and each artifact manifest are read into memory to be verified; a desired state with many
# artifacts is tens of kilobytes, so this is room, not a target.
MAX_ENVELOPE_BYTES = 16 * 1024 * 1024
# A pax header or GNU long name carries a path and a few numbers: kilobytes at most.
MAX_EXTENDED_HEADER_BYTES = 64 * 1024
# After the end-of-archive marker (two zero blocks) tar writers pad with zeros to a whole record.
_END_MARKER_BYTES = 2 * tarfile.BLOCKSIZE
_MAX_TRAILER_BYTES = _END_MARKER_BYTES + tarfile.RECORDSIZE
# The most extended headers one member may carry (a pax header and a GNU long name, each possibly twice).
_MAX_HEADER_CHAIN = 8
# Large enough that the per-read cost vanishes beside hashing; small enough to stay in the CPU caches.
_CHUNK_BYTES = 1024 * 1024
_MANIFEST_NAME = "manifest.json"
_IMAGES = "images/"


class BundleProblem(StrEnum):
    """Why the reader refused a bundle, besides the verifier's own ``trust.RejectionCode`` values."""

    NOT_A_FILE = "not-a-file"
    UNREADABLE = "unreadable"
    NOT_A_TAR = "not-a-tar"
    ENVELOPE_NOT_FIRST = "envelope-not-first"
    UNSAFE_PATH = "unsafe-path"
    NOT_REGULAR = "not-a-regular-file"
    UNLISTED = "unlisted-member"
    DUPLICATE = "duplicate-member"
    MISSING = "missing-member"
    SIZE_MISMATCH = "size-mismatch"
    DIGEST_MISMATCH = "digest-mismatch"
    TOO_LARGE = "too-large"
    TRUNCATED = "truncated"
    TRAILING_DATA = "trailing-data"
    CHANGED = "changed-while-read"
    ARTIFACT = "artifact-mismatch"
    SCRATCH = "scratch-unusable"
    SCRATCH_FULL = "scratch-full"
    CODE_REFUSED = runbook.CODE_REFUSED
    CODE_NOT_PINNED = runbook.CODE_NOT_PINNED
    CODE_MISMATCH = runbook.CODE_MISMATCH
    IMAGE_NOT_ALLOWED = "image-not-allowed"


Reason = Union[BundleProblem, trust.RejectionCode, image_archive.ImageArchiveProblem]
# What one read gives: the verified envelope, the artifact manifests, bytes read, the files in scratch and
# the verified images by member path.
_ReadResult = tuple[
    trust.VerifiedBundle,
    tuple[trust.VerifiedManifest, ...],
    int,
    dict[str, str],
    dict[str, image_archive.VerifiedImage],
]


class BundleRefused(MeridianError):
    """A bundle was refused. ``reason`` is for programs (a ``BundleProblem`` or, for ``bundle.json`` and
    the documents it carries, the verifier's ``RejectionCode``), ``message`` for people; ``member`` names
    the tar member at fault, when one is."""

    def __init__(self, reason: Reason, message: str, member: Optional[str] = None) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.member = member


@dataclass(frozen=True)
class BundleCheck:
    """A bundle verified member by member, nothing kept (``meridian-node verify --kind bundle``)."""

    verified: trust.VerifiedBundle
    manifests: tuple[trust.VerifiedManifest, ...]
    bytes_read: int
    images: Mapping[str, image_archive.VerifiedImage] = field(default_factory=dict)


@dataclass(frozen=True)
class UnpackedBundle:
    """A verified bundle's members in scratch: ``files`` maps each listed path to its file under
    ``directory``. The caller owns ``directory`` and calls ``discard`` when done with it. ``images``: each
    image archive (``images/<name>.tar``, at ``files[image.member]``) verified against the state's pins."""

    verified: trust.VerifiedBundle
    manifests: tuple[trust.VerifiedManifest, ...]
    bytes_read: int
    directory: str
    files: Mapping[str, str] = field(default_factory=dict)
    images: Mapping[str, image_archive.VerifiedImage] = field(default_factory=dict)

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def check_bundle(path: str, policy: Policy, *, node_id: str, now: datetime, applied: trust.AppliedState) -> BundleCheck:
    """Verify the bundle at ``path`` completely (every member read and hashed) without writing anything."""
    verified, manifests, read, _unused, images = _read(
        path, policy, node_id=node_id, now=now, applied=applied, work=None
    )
    return BundleCheck(verified=verified, manifests=manifests, bytes_read=read, images=images)


def unpack_bundle(
    path: str, policy: Policy, *, node_id: str, now: datetime, applied: trust.AppliedState
) -> UnpackedBundle:
    """Verify the bundle at ``path`` and leave its members in a new directory under the policy's
    ``air_gap.scratch_dir``; on refusal that directory is gone and ``BundleRefused`` says why."""
    scratch = _scratch_dir(policy.air_gap.scratch_dir)
    try:
        work = tempfile.mkdtemp(prefix="bundle-", dir=scratch)
    except OSError as exc:
        raise _scratch_error(exc, policy.air_gap.scratch_dir, "creating a working directory in it") from None
    try:
        verified, manifests, read, files, images = _read(
            path, policy, node_id=node_id, now=now, applied=applied, work=work
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return UnpackedBundle(
        verified=verified, manifests=manifests, bytes_read=read, directory=work, files=files, images=images
    )


# --- reading ---------------------------------------------------------------------------------------------


def _read(
    path: str,
    policy: Policy,
    *,
    node_id: str,
    now: datetime,
    applied: trust.AppliedState,
    work: Optional[str],
) -> _ReadResult:
    try:
        return _read_checked(path, policy, node_id=node_id, now=now, applied=applied, work=work)
    except OSError as exc:
        # Scratch errors are already BundleRefused; what is left is the bundle's own medium failing.
        raise BundleRefused(
            BundleProblem.UNREADABLE, f"reading {path} failed: {exc.strerror or exc} - check the medium, copy it again"
        ) from None


def _read_checked(
    path: str,
    policy: Policy,
    *,
    node_id: str,
    now: datetime,
    applied: trust.AppliedState,
    work: Optional[str],
) -> _ReadResult:
    with _open_regular(path) as (handle, size):
        tar = _open_tar(handle, path)
        verified = _read_envelope(tar, handle, path, policy, node_id=node_id, now=now, applied=applied)
        listing = {entry.path: entry for entry in verified.bundle.files}
        _check_caps(verified.bundle, policy, work)
        incoming = None if work is None else os.path.join(work, "incoming")
        if incoming is not None:
            try:
                os.mkdir(incoming, 0o700)
            except OSError as exc:
                raise _scratch_error(exc, policy.air_gap.scratch_dir, "creating a working directory in it") from None
        seen: dict[str, int] = {}
        kept: dict[str, bytes] = {}
        image_offsets: dict[str, int] = {}
        total = 0
        reader = _MemberReader(handle, incoming, policy.air_gap.scratch_dir)
        for info in _members(tar, handle):
            entry = _check_header(info, listing, seen)
            keep = entry.path.startswith("artifacts/") and entry.path.endswith("/" + _MANIFEST_NAME)
            index = len(seen)
            data = reader.read(info, entry, index, keep=keep)
            seen[entry.path] = index
            total += entry.size
            if data is not None:
                kept[entry.path] = data
            if entry.path.startswith(_IMAGES):
                image_offsets[entry.path] = info.offset_data
        _check_end(handle, tar.offset, size, path)
        missing = [name for name in listing if name not in seen]
        if missing:
            raise BundleRefused(
                BundleProblem.MISSING,
                f"bundle.json lists {len(missing)} member(s) the tar does not hold, first {missing[0]!r}: the bundle "
                "is incomplete - copy it again from the original",
                missing[0],
            )
        manifests = _check_artifacts(verified.bundle, kept, policy, verified.desired.state)
        images = _check_images(verified, listing, policy, handle, incoming, seen, image_offsets)
        files = {} if incoming is None or work is None else _materialise(work, incoming, seen)
    return verified, manifests, total, files, images


@contextmanager
def _open_regular(path: str) -> Iterator[tuple[io.FileIO, int]]:
    try:
        # O_NOFOLLOW: an inbox entry that is a symlink is refused, not followed; O_NONBLOCK: a FIFO does
        # not hang the reader until someone writes to it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BundleRefused(
                BundleProblem.NOT_A_FILE, f"{path} is a symbolic link: a bundle is taken only as a regular file"
            ) from None
        raise BundleRefused(BundleProblem.UNREADABLE, f"cannot open {path}: {exc.strerror}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise BundleRefused(
                BundleProblem.NOT_A_FILE,
                f"{path} is {_file_kind(status.st_mode)}, not a regular file: a bundle is one tar file",
            )
        handle = io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle, status.st_size


def _open_tar(handle: io.FileIO, path: str) -> tarfile.TarFile:
    _bound_extended_headers(handle, 0)
    handle.seek(0)  # tarfile starts reading where the file stands
    try:
        # "r:" is plain tar only: a compressed file is not a tar here (see the module docstring).
        return tarfile.open(fileobj=handle, mode="r:")
    except (tarfile.TarError, ValueError, UnicodeError) as exc:
        raise BundleRefused(
            BundleProblem.NOT_A_TAR,
            f"{path} is not a plain (uncompressed) tar file ({exc}): a bundle is what make-bundle writes",
        ) from None


def _read_envelope(
    tar: tarfile.TarFile,
    handle: io.FileIO,
    path: str,
    policy: Policy,
    *,
    node_id: str,
    now: datetime,
    applied: trust.AppliedState,
) -> trust.VerifiedBundle:
    first = tar.next()  # read when the tar was opened; the next call reads the second member
    if first is None:
        raise BundleRefused(BundleProblem.NOT_A_TAR, f"{path} is an empty tar: a bundle starts with bundle.json")
    if first.name != contracts.BUNDLE_ENVELOPE_NAME:
        raise BundleRefused(
            BundleProblem.ENVELOPE_NOT_FIRST,
            f"the first member of {path} is {short_repr(first.name)}, not {contracts.BUNDLE_ENVELOPE_NAME!r}: the "
            "signed listing must come before anything it vouches for",
            first.name,
        )
    _require_plain_file(first)
    if first.size > MAX_ENVELOPE_BYTES:
        raise BundleRefused(
            BundleProblem.TOO_LARGE,
            f"bundle.json is {first.size} bytes, more than the {MAX_ENVELOPE_BYTES} a bundle envelope may be",
            first.name,
        )
    data = _read_exactly(handle, first.offset_data, first.size, first.name)
    try:
        verified = trust.verify_bundle(data, policy, node_id=node_id, now=now, applied=applied)
    except trust.Rejection as rejection:
        raise BundleRefused(rejection.code, f"bundle.json: {rejection.message}", first.name) from rejection
    problem = runbook.shipped_code_problem(verified.bundle, verified.desired.state, policy.air_gap.shipped_code)
    if problem is not None:
        raise BundleRefused(BundleProblem(problem[0]), f"bundle.json: {problem[1]}", first.name)
    return verified


def _check_caps(bundle: contracts.Bundle, policy: Policy, work: Optional[str]) -> None:
    caps = policy.air_gap
    if len(bundle.files) > caps.max_members:
        raise BundleRefused(
            BundleProblem.TOO_LARGE,
            f"bundle {bundle.bundle_id!r} lists {len(bundle.files)} members, more than air_gap.max_members "
            f"{caps.max_members} in policy {policy.source}: refused before reading any",
        )
    total = bundle.total_bytes
    if total > caps.max_bytes:
        raise BundleRefused(
            BundleProblem.TOO_LARGE,
            f"bundle {bundle.bundle_id!r} lists {total} bytes of members, more than air_gap.max_bytes "
            f"{caps.max_bytes} in policy {policy.source}: refused before reading any",
        )
    for entry in bundle.files:
        if entry.path.endswith("/" + _MANIFEST_NAME) and entry.size > MAX_ENVELOPE_BYTES:
            raise BundleRefused(
                BundleProblem.TOO_LARGE,
                f"{entry.path} is listed at {entry.size} bytes, more than the {MAX_ENVELOPE_BYTES} a manifest may be",
                entry.path,
            )
    if work is not None:
        try:
            space = os.statvfs(work)
        except OSError as exc:
            raise _scratch_error(exc, caps.scratch_dir, "reading its free space") from None
        free = space.f_bavail * space.f_frsize
        if free < total:
            raise BundleRefused(
                BundleProblem.SCRATCH_FULL,
                f"bundle {bundle.bundle_id!r} needs {total} bytes in air_gap.scratch_dir {caps.scratch_dir}, which "
                f"has {free} free: free space there or point air_gap.scratch_dir at a larger filesystem",
            )


def _members(tar: tarfile.TarFile, handle: io.FileIO) -> Iterator[tarfile.TarInfo]:
    while True:
        _bound_extended_headers(handle, tar.offset)
        try:
            info = tar.next()
        except tarfile.ReadError as exc:
            reason = BundleProblem.TRUNCATED if "unexpected end" in str(exc) else BundleProblem.NOT_A_TAR
            raise BundleRefused(reason, f"the tar cannot be read past offset {tar.offset}: {exc}") from None
        except (tarfile.TarError, ValueError, UnicodeError) as exc:
            raise BundleRefused(BundleProblem.NOT_A_TAR, f"bad tar header at offset {tar.offset}: {exc}") from None
        if info is None:
            return
        yield info


def _bound_extended_headers(handle: io.FileIO, offset: int) -> None:
    """Refuse an extended header (pax, GNU long name) bigger than ``MAX_EXTENDED_HEADER_BYTES`` before
    ``tarfile`` reads it into memory. Anything not parseable here is left to ``tarfile`` to refuse."""
    for _attempt in range(_MAX_HEADER_CHAIN):
        handle.seek(offset)
        block = handle.read(tarfile.BLOCKSIZE)
        if len(block) < tarfile.BLOCKSIZE or block[156:157] not in EXTENDED_TYPES or not _checksum_ok(block):
            # Not a header (a gzip file's bytes can hold anything at offset 156): tarfile refuses it.
            return
        size = _header_size(block[124:136])
        if size is None:
            return
        if size > MAX_EXTENDED_HEADER_BYTES:
            raise BundleRefused(
                BundleProblem.TOO_LARGE,
                f"an extended tar header at offset {offset} is {size} bytes, more than "
                f"{MAX_EXTENDED_HEADER_BYTES}: no path or attribute needs that much",
            )
        # The member's data is padded up to whole blocks.
        offset += tarfile.BLOCKSIZE + (size + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE
    raise BundleRefused(
        BundleProblem.NOT_A_TAR, f"more than {_MAX_HEADER_CHAIN} extended tar headers in a row at offset {offset}"
    )


def _checksum_ok(block: bytes) -> bool:
    """The header's own checksum (octal, over the block with the checksum field read as spaces) matches."""
    digits = block[148:156].split(b"\0", 1)[0].strip(b" ")
    try:
        stored = int(digits, 8)
    except ValueError:
        return False
    # POSIX: the sum of the header's bytes, the checksum field's eight counted as spaces; some old tars
    # summed signed bytes, which tarfile accepts too.
    rest = block[:148] + block[156:512]
    unsigned = sum(rest) + 8 * 0x20
    signed_sum = sum(byte - 256 if byte > 127 else byte for byte in rest) + 8 * 0x20
    return stored in (unsigned, signed_sum)


def _header_size(value: bytes) -> Optional[int]:
    """A header's size field: octal digits, or (GNU) base-256 when the high bit of the first byte is set."""
    if value[0] & 0x80:
        return int.from_bytes(value[1:], "big")
    digits = value.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        return None


def _check_header(
    info: tarfile.TarInfo, listing: Mapping[str, contracts.BundleFile], seen: Mapping[str, int]
) -> contracts.BundleFile:
    name = info.name
    problem = _path_problem(name)
    if problem is not None:
        raise BundleRefused(BundleProblem.UNSAFE_PATH, f"member {short_repr(name)}: {problem}", name)
    _require_plain_file(info)
    if name == contracts.BUNDLE_ENVELOPE_NAME or name in seen:
        raise BundleRefused(
            BundleProblem.DUPLICATE,
            f"member {name!r} appears twice in the tar: one name, one content - the bundle was tampered with or "
            "built wrongly",
            name,
        )
    entry = listing.get(name)
    if entry is None:
        raise BundleRefused(
            BundleProblem.UNLISTED,
            f"member {short_repr(name)} is not listed in bundle.json: nothing the authority did not sign is read",
            name,
        )
    if info.size != entry.size:
        # The tar header fixes how many bytes follow, so a longer member is refused here, unread.
        raise BundleRefused(
            BundleProblem.SIZE_MISMATCH,
            f"member {name!r} is {info.size} bytes in the tar, bundle.json lists {entry.size}",
            name,
        )
    return entry


def _path_problem(name: str) -> Optional[str]:
    if not name:
        return "an empty name"
    if name.startswith("/"):
        return "an absolute path"
    if "\\" in name or any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        return "a backslash or control character in the path"
    parts = name.split("/")
    if ".." in parts:
        return "a '..' component, which would leave the bundle's directory"
    if any(part in ("", ".") for part in parts):
        return "an empty or '.' component: member names are written in one form only"
    return None


def _require_plain_file(info: tarfile.TarInfo) -> None:
    if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and not info.issparse():
        return
    raise BundleRefused(
        BundleProblem.NOT_REGULAR,
        f"member {short_repr(info.name)} is {member_kind(info)}: a bundle holds regular files only",
        info.name,
    )


class _MemberReader:
    """Reads one member's data once: hashed as it goes, written to scratch when there is a scratch.

    What is written is the very buffer that was hashed, so no byte reaches scratch unhashed. (Hashing
    on a second thread while writing was measured slower here, on 2 cores: bench/airgap.py.)
    """

    def __init__(self, handle: io.FileIO, incoming: Optional[str], scratch_dir: str) -> None:
        self.handle = handle
        self.incoming = incoming
        self.scratch_dir = scratch_dir
        self.buffer = bytearray(_CHUNK_BYTES)

    def read(self, info: tarfile.TarInfo, entry: contracts.BundleFile, index: int, *, keep: bool) -> Optional[bytes]:
        out = None if self.incoming is None else self._create(index, entry.path)
        try:
            digest, data = self._copy(info, entry, out, keep=keep)
            if out is not None:
                os.close(out)
                out = None
        finally:
            if out is not None:
                os.close(out)
        if digest != entry.sha256:
            raise BundleRefused(
                BundleProblem.DIGEST_MISMATCH,
                f"member {entry.path!r} has sha256 {digest}, bundle.json lists {entry.sha256}: the bundle was "
                "altered or damaged after it was signed",
                entry.path,
            )
        return data

    def _create(self, index: int, member: str) -> int:
        if self.incoming is None:
            raise RuntimeError("_create called before the scratch directory was made (a bug in the reader)")
        try:
            return os.open(
                os.path.join(self.incoming, str(index)),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                0o600,
            )
        except OSError as exc:
            raise _scratch_error(exc, self.scratch_dir, f"creating the file for member {member!r}") from None

    def _copy(
        self, info: tarfile.TarInfo, entry: contracts.BundleFile, out: Optional[int], *, keep: bool
    ) -> tuple[str, Optional[bytes]]:
        hasher = hashlib.sha256()
        view = memoryview(self.buffer)
        kept = bytearray() if keep else None
        self.handle.seek(info.offset_data)
        remaining = entry.size
        while remaining:
            count = self.handle.readinto(view[: min(len(view), remaining)])
            if not count:
                raise BundleRefused(
                    BundleProblem.TRUNCATED,
                    f"member {entry.path!r} ends after {entry.size - remaining} of its {entry.size} bytes: the "
                    "bundle file is cut short - copy it again",
                    entry.path,
                )
            chunk = view[:count]
            if kept is not None:
                kept += chunk
            hasher.update(chunk)
            if out is not None:
                self._write(out, chunk, entry)
            remaining -= count
        return hasher.hexdigest(), None if kept is None else bytes(kept)

    def _write(self, out: int, chunk: memoryview, entry: contracts.BundleFile) -> None:
        while chunk:
            try:
                written = os.write(out, chunk)
            except OSError as exc:
                raise _scratch_error(exc, self.scratch_dir, f"writing member {entry.path!r}") from None
            chunk = chunk[written:]


def _read_exactly(handle: io.FileIO, offset: int, size: int, member: str) -> bytes:
    handle.seek(offset)
    data = handle.read(size)
    if len(data) != size:
        raise BundleRefused(
            BundleProblem.TRUNCATED,
            f"member {member!r} ends after {len(data)} of its {size} bytes: the bundle file is cut short",
            member,
        )
    return data


def _check_end(handle: io.FileIO, offset: int, size: int, path: str) -> None:
    """After the last member: the end-of-archive marker, then zero padding to a record, nothing else."""
    now_size = os.fstat(handle.fileno()).st_size
    if now_size != size:
        raise BundleRefused(
            BundleProblem.CHANGED,
            f"{path} grew from {size} to {now_size} bytes while it was read: still being copied? Bundles are "
            "written under another name and renamed into the inbox when complete",
        )
    rest = size - offset
    if rest < _END_MARKER_BYTES:
        raise BundleRefused(
            BundleProblem.TRUNCATED,
            f"{path} ends {rest} bytes after its last member, without the tar's end-of-archive marker: the copy is "
            "incomplete - copy it again",
        )
    if rest > _MAX_TRAILER_BYTES:
        raise BundleRefused(
            BundleProblem.TRAILING_DATA,
            f"{path} has {rest} bytes after its last member, more than the end-of-archive marker and padding "
            f"({_MAX_TRAILER_BYTES} at most): something was appended to the bundle",
        )
    handle.seek(offset)
    tail = handle.read(rest)
    if len(tail) != rest:
        raise BundleRefused(BundleProblem.TRUNCATED, f"{path} ended early while its end was read")
    if tail.count(0) != rest:
        first = next(index for index, byte in enumerate(tail) if byte)
        raise BundleRefused(
            BundleProblem.TRAILING_DATA,
            f"{path} has non-zero bytes {first} bytes after its last member (at offset {offset + first}): data that is "
            "not a listed member - something was appended to the bundle or a member was hidden there",
        )


# --- artifacts -------------------------------------------------------------------------------------------


def _check_artifacts(
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
        if len(parts) == 4 and parts[3] == _MANIFEST_NAME:
            manifests[(parts[1], parts[2])] = entry.path
        elif len(parts) >= 5 and parts[3] == "files":
            groups.setdefault((parts[1], parts[2]), {})["/".join(parts[4:])] = entry
        else:
            raise BundleRefused(
                BundleProblem.ARTIFACT,
                f"{entry.path!r} is neither artifacts/<name>/<version>/{_MANIFEST_NAME} nor "
                "artifacts/<name>/<version>/files/<path>",
                entry.path,
            )
    verified: list[trust.VerifiedManifest] = []
    for key in sorted(set(groups) | set(manifests)):
        name, version = key
        where = f"artifacts/{name}/{version}/"
        if key not in manifests:
            raise BundleRefused(BundleProblem.ARTIFACT, f"{where} holds files but no {_MANIFEST_NAME}", where)
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


def _check_images(
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


# --- scratch ---------------------------------------------------------------------------------------------


def check_scratch(path: str, needed_bytes: int) -> None:
    """Refuse, without writing anything, what ``unpack_bundle`` would refuse about the scratch directory at
    ``path``: one it cannot make (its parent missing or not writable by this user), one it would not trust,
    or too little free space for ``needed_bytes`` of members. Check mode calls this, so that a run that
    passes ``--check`` does not then fail on its scratch directory."""
    try:
        status: Optional[os.stat_result] = os.lstat(path)
    except FileNotFoundError:
        status = None
    except OSError as exc:
        raise _scratch_error(exc, path, "reading it") from None
    if status is None:
        # The real run makes it with os.mkdir: the parent must exist and be writable by this user.
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise _scratch_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), path, "creating it")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise _scratch_error(OSError(errno.EACCES, os.strerror(errno.EACCES)), path, "creating it")
        where = parent
    else:
        _refuse_untrusted_scratch(path, status)
        where = path
    try:
        space = os.statvfs(where)
    except OSError as exc:
        raise _scratch_error(exc, path, "reading its free space") from None
    free = space.f_bavail * space.f_frsize
    if free < needed_bytes:
        raise BundleRefused(
            BundleProblem.SCRATCH_FULL,
            f"the bundle needs {needed_bytes} bytes in air_gap.scratch_dir {path}, which has {free} free: free "
            "space there or point air_gap.scratch_dir at a larger filesystem",
        )


def _scratch_dir(path: str) -> str:
    """The policy's scratch directory, made if missing (mode 0700): a real directory (not a symlink),
    owned by this user and writable by no one else, so no one else can swap a file in it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _scratch_error(exc, path, "creating it") from None
    try:
        status = os.lstat(path)
    except OSError as exc:
        raise _scratch_error(exc, path, "reading it") from None
    _refuse_untrusted_scratch(path, status)
    return path


def _refuse_untrusted_scratch(path: str, status: os.stat_result) -> None:
    problem = None
    if not stat.S_ISDIR(status.st_mode):
        problem = f"is {_file_kind(status.st_mode)}, not a directory"
    elif status.st_uid != os.geteuid():
        problem = f"is owned by uid {status.st_uid}, not by this process's uid {os.geteuid()}"
    elif status.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(status.st_mode):04o})"
    if problem is not None:
        raise BundleRefused(
            BundleProblem.SCRATCH,
            f"air_gap.scratch_dir {path} {problem}: it must be a directory only the reader's user can write",
        )


def _scratch_error(exc: OSError, scratch: str, doing: str) -> BundleRefused:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return BundleRefused(
            BundleProblem.SCRATCH_FULL,
            f"air_gap.scratch_dir {scratch} is full ({exc.strerror}) while {doing}: free space there or point "
            "air_gap.scratch_dir at a larger filesystem",
        )
    message = f"air_gap.scratch_dir {scratch}: {doing} failed: {exc.strerror}"
    if doing == "creating it":
        message += (
            f"; the directory above it ({os.path.dirname(os.path.abspath(scratch))}) must exist and be writable by "
            f"this user (uid {os.geteuid()}): create it, or point air_gap.scratch_dir in the policy at such a place"
        )
    return BundleRefused(BundleProblem.SCRATCH, message)


def _materialise(work: str, incoming: str, seen: Mapping[str, int]) -> dict[str, str]:
    """Move the verified files to their listed paths under ``work/tree``. The paths were validated by the
    contract and signed; every directory on the way is made here, in a directory only this user can write."""
    tree = os.path.join(work, "tree")
    files: dict[str, str] = {}
    try:
        os.mkdir(tree, 0o700)
        for member, index in seen.items():
            target = os.path.join(tree, *member.split("/"))
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            os.rename(os.path.join(incoming, str(index)), target)
            files[member] = target
        os.rmdir(incoming)
    except OSError as exc:
        raise _scratch_error(exc, os.path.dirname(work), "moving verified files into place") from None
    return files


def _file_kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return word
    return "not a regular file"

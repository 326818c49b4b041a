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

Where each step lives: ``bundle_tar`` (the file and its tar: steps 1, 4 and the end of archive),
``bundle_contents`` (artifacts and images against the state: step 5), ``bundle_scratch`` (the scratch
directory and step 6), ``bundle_refused`` (``BundleRefused`` and its ``BundleProblem`` codes); this file puts
them in order, with the envelope (step 2) and the caps (step 3).

The tar headers are read by the standard library's ``tarfile`` (which knows the ustar, GNU and pax forms);
the decisions on each header, and the reading of member data, are this module's. Only the sizes of
extended headers (pax, GNU long names) are looked at before ``tarfile`` reads them, so that a hostile one
cannot make it hold a gigabyte in memory.

Plain tar only: model weights do not compress, and a compressed bundle would add a decompression bomb
to the attack surface for no gain (docs/AIR_GAP.md).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Optional

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.airgap import image_archive, runbook
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_contents import (
    MANIFEST_NAME,
    check_artifacts,
    check_images,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_refused import BundleProblem, BundleRefused
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_scratch import (
    check_scratch,
    materialise,
    scratch_dir,
    scratch_error,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_tar import (
    MAX_EXTENDED_HEADER_BYTES,
    MemberReader,
    check_end,
    check_header,
    members,
    open_regular,
    open_tar,
    read_exactly,
    require_plain_file,
)
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
_IMAGES = "images/"

# What one read gives: the verified envelope, the artifact manifests, bytes read, the files in scratch and
# the verified images by member path.
_ReadResult = tuple[
    trust.VerifiedBundle,
    tuple[trust.VerifiedManifest, ...],
    int,
    dict[str, str],
    dict[str, image_archive.VerifiedImage],
]


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
    scratch = scratch_dir(policy.air_gap.scratch_dir)
    try:
        work = tempfile.mkdtemp(prefix="bundle-", dir=scratch)
    except OSError as exc:
        raise scratch_error(exc, policy.air_gap.scratch_dir, "creating a working directory in it") from None
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


@contextlib.contextmanager
def _medium(path: str) -> Iterator[None]:
    # Scratch errors are already BundleRefused; an OSError left is the bundle's own medium failing.
    try:
        yield
    except OSError as exc:
        raise BundleRefused(
            BundleProblem.UNREADABLE, f"reading {path} failed: {exc.strerror or exc} - check the medium, copy it again"
        ) from None


def _read(
    path: str,
    policy: Policy,
    *,
    node_id: str,
    now: datetime,
    applied: trust.AppliedState,
    work: Optional[str],
) -> _ReadResult:
    with _medium(path), open_regular(path) as (handle, size):
        tar = open_tar(handle, path)
        verified = _read_envelope(tar, handle, path, policy, node_id=node_id, now=now, applied=applied)
        listing = {entry.path: entry for entry in verified.bundle.files}
        _check_caps(verified.bundle, policy, work)
        incoming = None if work is None else os.path.join(work, "incoming")
        if incoming is not None:
            try:
                os.mkdir(incoming, 0o700)
            except OSError as exc:
                raise scratch_error(exc, policy.air_gap.scratch_dir, "creating a working directory in it") from None
        seen: dict[str, int] = {}
        kept: dict[str, bytes] = {}
        image_offsets: dict[str, int] = {}
        total = 0
        reader = MemberReader(handle, incoming, policy.air_gap.scratch_dir)
        for info in members(tar, handle):
            entry = check_header(info, listing, seen)
            keep = entry.path.startswith("artifacts/") and entry.path.endswith("/" + MANIFEST_NAME)
            index = len(seen)
            data = reader.read(info, entry, index, keep=keep)
            seen[entry.path] = index
            total += entry.size
            if data is not None:
                kept[entry.path] = data
            if entry.path.startswith(_IMAGES):
                image_offsets[entry.path] = info.offset_data
        check_end(handle, tar.offset, size, path)
        missing = [name for name in listing if name not in seen]
        if missing:
            raise BundleRefused(
                BundleProblem.MISSING,
                f"bundle.json lists {len(missing)} member(s) the tar does not hold, first {missing[0]!r}: the bundle "
                "is incomplete - copy it again from the original",
                missing[0],
            )
        manifests = check_artifacts(verified.bundle, kept, policy, verified.desired.state)
        images = check_images(verified, listing, policy, handle, incoming, seen, image_offsets)
        files = {} if incoming is None or work is None else materialise(work, incoming, seen)
    return verified, manifests, total, files, images


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
    require_plain_file(first)
    if first.size > MAX_ENVELOPE_BYTES:
        raise BundleRefused(
            BundleProblem.TOO_LARGE,
            f"bundle.json is {first.size} bytes, more than the {MAX_ENVELOPE_BYTES} a bundle envelope may be",
            first.name,
        )
    data = read_exactly(handle, first.offset_data, first.size, first.name)
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
        if entry.path.endswith("/" + MANIFEST_NAME) and entry.size > MAX_ENVELOPE_BYTES:
            raise BundleRefused(
                BundleProblem.TOO_LARGE,
                f"{entry.path} is listed at {entry.size} bytes, more than the {MAX_ENVELOPE_BYTES} a manifest may be",
                entry.path,
            )
    if work is not None:
        try:
            space = os.statvfs(work)
        except OSError as exc:
            raise scratch_error(exc, caps.scratch_dir, "reading its free space") from None
        free = space.f_bavail * space.f_frsize
        if free < total:
            raise BundleRefused(
                BundleProblem.SCRATCH_FULL,
                f"bundle {bundle.bundle_id!r} needs {total} bytes in air_gap.scratch_dir {caps.scratch_dir}, which "
                f"has {free} free: free space there or point air_gap.scratch_dir at a larger filesystem",
            )

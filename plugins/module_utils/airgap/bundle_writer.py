"""Writing an air-gap bundle: the tar ``airgap.bundle_reader`` accepts, and nothing it would refuse.

``plan_members`` hashes the files a bundle will carry (the listing ``bundle.json`` signs), and
``write_bundle`` writes the tar: ``bundle.json`` first, then each member, read again and hashed again
while it is copied, so a file that changed after it was listed is refused rather than shipped under a
digest it no longer has. The tar is written under a temporary name beside the output and renamed into
place when complete (fsync'd), so a reader watching that directory never sees half a bundle.

Headers are plain: regular files, mode 0644, owner 0, the bundle's creation time, pax only where a path
needs it (over 100 characters), so any tar tool lists the bundle and every reader sees the same names.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = ["BundleWriteError", "PlannedMember", "plan_members", "write_bundle"]

_CHUNK_BYTES = 1024 * 1024


class BundleWriteError(MeridianError):
    """A bundle could not be written; the message names the file and what to do."""


@dataclass(frozen=True)
class PlannedMember:
    """A file to ship: ``path`` inside the bundle, ``source`` on this machine, and what it held when listed."""

    path: str
    source: str
    size: int
    sha256: str

    def listing(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def plan_members(members: Sequence[tuple[str, str]]) -> list[PlannedMember]:
    """Size and sha256 of each ``(bundle path, source file)``; a source that is not a regular file (a
    symlink included: the bundle ships bytes, never links) is refused."""
    planned = []
    for path, source in members:
        size, digest = _hash_file(source)
        planned.append(PlannedMember(path=path, source=source, size=size, sha256=digest))
    return planned


def write_bundle(out: str, envelope: bytes, members: Sequence[PlannedMember], *, mtime: int) -> None:
    """Write the bundle tar to ``out`` atomically: ``envelope`` (the signed bundle.json) first, then ``members``."""
    directory = os.path.dirname(os.path.abspath(out))
    handle = tempfile.NamedTemporaryFile(dir=directory, prefix=".bundle-", suffix=".part", delete=False)  # noqa: SIM115
    try:
        with handle, tarfile.open(fileobj=handle, mode="w:", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_header(contracts.BUNDLE_ENVELOPE_NAME, len(envelope), mtime), io.BytesIO(envelope))
            for member in members:
                with _open_source(member.source) as source:
                    hashing = _HashingReader(source)
                    try:
                        tar.addfile(_header(member.path, member.size, mtime), hashing)
                        # addfile copies the listed size; a file that grew must not pass for the listed one.
                        changed = hashing.hexdigest() != member.sha256 or bool(source.read(1))
                    except OSError:  # tarfile's "unexpected end of data": the file shrank
                        changed = True
                    if changed:
                        raise BundleWriteError(
                            f"{member.source} changed while the bundle was written (listed as {member.size} bytes, "
                            f"sha256 {member.sha256}): make the bundle again from files nothing is writing to"
                        )
            tar.close()
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)
        os.replace(handle.name, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    _fsync_directory(directory)


def _header(path: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.size = size
    info.mode = 0o644
    info.mtime = mtime
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _HashingReader(io.RawIOBase):
    """What ``tarfile.addfile`` reads from: the source's bytes, hashed on the way through."""

    def __init__(self, source: BinaryIO) -> None:
        super().__init__()
        self.source = source
        self.hasher = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size)
        self.hasher.update(data)
        return data

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()


def _open_source(source: str) -> BinaryIO:
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BundleWriteError(
            f"cannot read {source}: {exc.strerror} (a bundle ships regular files, not links)"
        ) from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise BundleWriteError(f"{source} is not a regular file: a bundle ships regular files only")
    return open(fd, "rb", buffering=_CHUNK_BYTES)


def _hash_file(source: str) -> tuple[int, str]:
    hasher = hashlib.sha256()
    size = 0
    with _open_source(source) as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

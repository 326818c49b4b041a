"""The bundle file and its tar, read the bundle reader's way (steps 1 and 4 of ``bundle_reader``, and the end of 5).

The file is opened as a regular file only. Its tar headers are read by the standard library's ``tarfile``
(which knows the ustar, GNU and pax forms) after the sizes of any extended headers (pax, GNU long names) are
bounded here, so that a hostile one cannot make it hold a gigabyte in memory. Each member is refused unless it
is a plain regular file whose name is a safe relative path listed in ``bundle.json``, not seen before, with the
listed size; its data is then read once, hashed as it is read, and written under a name the reader makes up
(never a path from the tar). After the last member comes the end-of-archive marker and nothing but zero padding.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Optional

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._fileutil import file_kind
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_refused import BundleProblem, BundleRefused
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_scratch import scratch_error
from ansible_collections.meridian.node.plugins.module_utils.airgap.tar_members import EXTENDED_TYPES, member_kind

__all__ = [
    "MAX_EXTENDED_HEADER_BYTES",
    "MemberReader",
    "check_end",
    "check_header",
    "members",
    "open_regular",
    "open_tar",
    "read_exactly",
    "require_plain_file",
]

# A pax header or GNU long name carries a path and a few numbers: kilobytes at most.
MAX_EXTENDED_HEADER_BYTES = 64 * 1024
# After the end-of-archive marker (two zero blocks) tar writers pad with zeros to a whole record.
_END_MARKER_BYTES = 2 * tarfile.BLOCKSIZE
_MAX_TRAILER_BYTES = _END_MARKER_BYTES + tarfile.RECORDSIZE
# The most extended headers one member may carry (a pax header and a GNU long name, each possibly twice).
_MAX_HEADER_CHAIN = 8
# Large enough that the per-read cost vanishes beside hashing; small enough to stay in the CPU caches.
_CHUNK_BYTES = 1024 * 1024


@contextmanager
def open_regular(path: str) -> Iterator[tuple[io.FileIO, int]]:
    """The bundle file at ``path``, opened without following a symlink or blocking on a FIFO, and its size;
    refused unless it is a regular file."""
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
                f"{path} is a {file_kind(status.st_mode)}, not a regular file: a bundle is one tar file",
            )
        handle = io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle, status.st_size


def open_tar(handle: io.FileIO, path: str) -> tarfile.TarFile:
    """``tarfile`` over the opened bundle: plain tar only, its first extended headers bounded first."""
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


def members(tar: tarfile.TarFile, handle: io.FileIO) -> Iterator[tarfile.TarInfo]:
    """The tar's further members, each one's extended headers bounded before ``tarfile`` reads them."""
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


def check_header(
    info: tarfile.TarInfo, listing: Mapping[str, contracts.BundleFile], seen: Mapping[str, int]
) -> contracts.BundleFile:
    """The listed entry for a member: refused unless its name is a safe path, it is a plain file, not
    seen before, listed in ``bundle.json`` and of the listed size (then refused unread)."""
    name = info.name
    problem = _path_problem(name)
    if problem is not None:
        raise BundleRefused(BundleProblem.UNSAFE_PATH, f"member {short_repr(name)}: {problem}", name)
    require_plain_file(info)
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


def require_plain_file(info: tarfile.TarInfo) -> None:
    """Refuse a member that is not a plain regular file (a link, device, FIFO, directory or sparse file)."""
    if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and not info.issparse():
        return
    raise BundleRefused(
        BundleProblem.NOT_REGULAR,
        f"member {short_repr(info.name)} is {member_kind(info)}: a bundle holds regular files only",
        info.name,
    )


class MemberReader:
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
            raise scratch_error(exc, self.scratch_dir, f"creating the file for member {member!r}") from None

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
                raise scratch_error(exc, self.scratch_dir, f"writing member {entry.path!r}") from None
            chunk = chunk[written:]


def read_exactly(handle: io.FileIO, offset: int, size: int, member: str) -> bytes:
    """The ``size`` bytes at ``offset``; refused as truncated when the file ends first."""
    handle.seek(offset)
    data = handle.read(size)
    if len(data) != size:
        raise BundleRefused(
            BundleProblem.TRUNCATED,
            f"member {member!r} ends after {len(data)} of its {size} bytes: the bundle file is cut short",
            member,
        )
    return data


def check_end(handle: io.FileIO, offset: int, size: int, path: str) -> None:
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

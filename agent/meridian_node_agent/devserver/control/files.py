"""Key and certificate files in the data dir: private ones 0600 and never clobbered, public ones atomic."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write, fsync_directory

__all__ = ["private_file_exclusive", "public_file_exclusive", "write_public_file"]


def private_file_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` (mode 0600) with ``data`` unless it exists; True when this call created it.

    The bytes go to a temporary file first and are hard-linked into place: ``link`` fails when the name
    exists, so two processes creating the same key at once cannot interleave and the loser keeps the
    winner's key, and nobody ever sees a half-written key.
    """
    return _create_exclusive(path, data, 0o600)


def public_file_exclusive(path: Path, data: bytes) -> bool:
    """``private_file_exclusive`` for a public file (0644): the CA certificate two servers may both be making."""
    return _create_exclusive(path, data, 0o644)


def _create_exclusive(path: Path, data: bytes, mode: int) -> bool:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        fsync_directory(path.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            Path(temp).unlink()


def write_public_file(path: Path, data: bytes) -> None:
    atomic_write(path, data, mode=0o644)

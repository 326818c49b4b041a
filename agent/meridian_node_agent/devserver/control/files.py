"""Key and certificate files in the data dir: private ones 0600 and never clobbered, public ones atomic."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write, create_exclusive

__all__ = ["private_file_exclusive", "public_file_exclusive", "write_public_file"]


def private_file_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` (mode 0600) with ``data`` unless it exists; True when this call created it.

    Two processes creating the same key at once cannot interleave: the loser keeps the winner's key, and
    nobody ever sees a half-written key (``_fileutil.create_exclusive``).
    """
    return create_exclusive(path, data, 0o600)


def public_file_exclusive(path: Path, data: bytes) -> bool:
    """``private_file_exclusive`` for a public file (0644): the CA certificate two servers may both be making."""
    return create_exclusive(path, data, 0o644)


def write_public_file(path: Path, data: bytes) -> None:
    atomic_write(path, data, mode=0o644)

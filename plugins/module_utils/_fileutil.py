"""Durable file writes: a reader sees the old content or the new content, never a torn mix.

Used wherever a half-written file would be dangerous: the applied-state record (rollback protection), the
artifact store, the agent's spool.
"""

import contextlib
import os
import tempfile

__all__ = ["atomic_write", "fsync_directory"]


def fsync_directory(path: "os.PathLike[str] | str") -> None:
    """Flush a directory entry change (a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: "os.PathLike[str] | str", data: bytes, mode: int = 0o600, group: int = -1) -> None:
    """Replace ``path`` with ``data`` atomically and durably; ``group`` (a gid) is set before the rename.

    The temporary file lives in the destination's directory because ``os.replace`` is only atomic within
    one filesystem. File data is fsynced before the rename and the directory after it, so after a crash
    the name points at complete old or complete new content. The temporary file is removed on any error.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        try:
            # mkstemp creates 0600; set the requested mode before any data is in the file.
            os.fchmod(fd, mode)
            if group != -1:
                os.fchown(fd, -1, group)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_directory(directory)

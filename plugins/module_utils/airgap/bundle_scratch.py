"""The bundle reader's scratch directory (the policy's ``air_gap.scratch_dir``): made and trusted (a directory
only the reader's user can write), its free space, the verified members moved into place under it, and what
a failure there is called. ``check_scratch`` is check mode's look at it, writing nothing."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from typing import Optional

from ansible_collections.meridian.node.plugins.module_utils._fileutil import file_kind
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_refused import BundleProblem, BundleRefused

__all__ = ["check_scratch", "materialise", "scratch_dir", "scratch_error"]


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
        raise scratch_error(exc, path, "reading it") from None
    if status is None:
        # The real run makes it with os.mkdir: the parent must exist and be writable by this user.
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise scratch_error(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), path, "creating it")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise scratch_error(OSError(errno.EACCES, os.strerror(errno.EACCES)), path, "creating it")
        where = parent
    else:
        _refuse_untrusted_scratch(path, status)
        where = path
    try:
        space = os.statvfs(where)
    except OSError as exc:
        raise scratch_error(exc, path, "reading its free space") from None
    free = space.f_bavail * space.f_frsize
    if free < needed_bytes:
        raise BundleRefused(
            BundleProblem.SCRATCH_FULL,
            f"the bundle needs {needed_bytes} bytes in air_gap.scratch_dir {path}, which has {free} free: free "
            "space there or point air_gap.scratch_dir at a larger filesystem",
        )


def scratch_dir(path: str) -> str:
    """The policy's scratch directory, made if missing (mode 0700): a real directory (not a symlink),
    owned by this user and writable by no one else, so no one else can swap a file in it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise scratch_error(exc, path, "creating it") from None
    try:
        status = os.lstat(path)
    except OSError as exc:
        raise scratch_error(exc, path, "reading it") from None
    _refuse_untrusted_scratch(path, status)
    return path


def _refuse_untrusted_scratch(path: str, status: os.stat_result) -> None:
    problem = None
    if not stat.S_ISDIR(status.st_mode):
        problem = f"is a {file_kind(status.st_mode)}, not a directory"
    elif status.st_uid != os.geteuid():
        problem = f"is owned by uid {status.st_uid}, not by this process's uid {os.geteuid()}"
    elif status.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(status.st_mode):04o})"
    if problem is not None:
        raise BundleRefused(
            BundleProblem.SCRATCH,
            f"air_gap.scratch_dir {path} {problem}: it must be a directory only the reader's user can write",
        )


def scratch_error(exc: OSError, scratch: str, doing: str) -> BundleRefused:
    """The refusal for an ``OSError`` while ``doing`` something in the scratch directory: full, or
    unusable (with how to fix it)."""
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


def materialise(work: str, incoming: str, seen: Mapping[str, int]) -> dict[str, str]:
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
        raise scratch_error(exc, os.path.dirname(work), "moving verified files into place") from None
    return files

"""Who may change the artifact store (docs/SECURITY.md, "Who may change the store"): the owner, mode, inode and
link-count checks that make the store's quick verification sound.

Quick verification trusts the index (a blob's size, inode and mtime recorded when it was hashed), which is only
sound if nobody but the store's writer can have changed what it trusts. So the store refuses to work
(``StoreTrustError``, naming the path) unless: every directory looked up on the way to the root, symlinks
followed, is owned by root or the effective uid and not writable by group or others unless sticky (sshd's
StrictModes rule); the root, ``blobs/``, ``blobs/sha256``, ``staging/``, ``artifacts/`` and every
``artifacts/<name>/`` are owned by root or the effective uid and writable by nobody else; ``index.json`` and
``.lock`` likewise, and no more than 0644. Root is accepted beside the effective uid because root can change
anything anyway: in production the writer is root, and an unprivileged reader (``artifact list``) gets past
these checks and then a clear error for the 0600 index. ``check_store_trust`` runs on every observe and apply
(a few ``lstat`` calls); ``relocate_to`` is the one exception, for a store left at the old default inside the
agent's directory (see ``policy``): that directory is warned about, not refused, until the store moves.

A blob another user owns, that its group or others can write, or that has more hard links than the store made
(``untrusted_blobs``) is never taken as verified: it is re-ingested (see ``artifacts.plan``). A version directory
another user owns or can write (``dirs_are_ours``) is not intact and is assembled again.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Mapping, Sequence

from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactPathError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.plan import (
    _BLOB_MODE,
    INDEX_FILE,
    LOCK_FILE,
    StoreTrustError,
)

__all__ = ["check_store_trust", "dirs_are_ours", "untrusted_blobs"]


def check_store_trust(root: str, layout_dirs: Sequence[str], relocate_to: str | None) -> tuple[str, ...]:
    """Refuse the store at ``root`` if anyone but its user or root could have changed it; return the warnings to
    show. ``layout_dirs`` are the store's own directories (``Store.check_trust`` lists them).

    Raises ``StoreTrustError`` (an owner or mode) or ``ArtifactPathError`` (a symlink in the store's
    own layout), naming the path. Parts that do not exist yet are skipped: the store creates them.
    """
    euid = os.geteuid()
    warnings: list[str] = []
    legacy_parent = os.path.realpath(os.path.dirname(root)) if relocate_to else None
    parent_problem = None
    for directory in _lookup_dirs(root):
        problem = _dir_problem(os.lstat(directory), euid, sticky_ok=True)
        if problem is None:
            continue
        if directory == legacy_parent:
            parent_problem = f"{directory} {problem}"
            continue
        raise StoreTrustError(
            f"refusing the artifact store {root}: {directory}, a directory on the way to it, {problem}, "
            "so whoever controls it can replace the store and swap the model files engines mount. Keep the "
            f"store under directories that only root can change, or fix {directory} "
            f"(chown root:root, chmod go-w) if that is safe"
        )
    if relocate_to is not None:
        warnings.append(_relocation_warning(root, relocate_to, parent_problem))
    for path in layout_dirs:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise ArtifactPathError(
                f"{path} is a symlink; the store does not follow symlinks in its own layout. Remove it and run again"
            )
        problem = _dir_problem(info, euid, sticky_ok=False)
        if problem is not None:
            raise StoreTrustError(_tampered(root, path, problem, euid, "chmod 0755"))
    for name in (INDEX_FILE, LOCK_FILE):
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        problem = _file_problem(info, euid, limit=0o644)
        if problem is not None:
            raise StoreTrustError(_tampered(root, path, problem, euid, "chmod 0600"))
    return tuple(warnings)


def _tampered(root: str, path: str, problem: str, euid: int, mode_fix: str) -> str:
    owner = "root:root" if euid == 0 else str(euid)
    return (
        f"refusing the artifact store {root}: {path} {problem}; only {_who(euid)} may change the "
        "store, or another user could swap the model files engines mount. Find out how it changed, then "
        f"fix it (chown {owner} {path}; {mode_fix} {path}) and run again"
    )


def untrusted_blobs(stats: Mapping[str, os.stat_result], artifacts_dir: str) -> dict[str, str]:
    """Why each blob (by sha256, with its ``lstat``) may have changed behind its recorded stat: only those that may."""
    links = _links_under(artifacts_dir) if stats else {}
    euid = os.geteuid()
    return {sha: why for sha, info in stats.items() if (why := _blob_problem(info, euid, links)) is not None}


# The kernel's own bound on symlinks followed in one lookup (ELOOP).
_MAX_SYMLINKS = 40


def _lookup_dirs(path: str) -> list[str]:
    """Every directory a name is looked up in while resolving ``path`` the kernel's way, in order.

    Checking only the ancestors of ``realpath(path)`` would miss a directory that holds a symlink on the
    way, and whoever can write that directory can re-point the link. Resolution stops at the first
    missing component: the store creates the rest itself, in the last directory listed.
    """
    pending = list(reversed(path.split("/")))
    current = "/"
    looked_in: list[str] = []
    hops = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        if current not in looked_in:
            looked_in.append(current)
        candidate = os.path.join(current, part)
        try:
            mode = os.lstat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break
        if not stat.S_ISLNK(mode):
            current = candidate
            continue
        hops += 1
        if hops > _MAX_SYMLINKS:
            raise ArtifactPathError(f"resolving {path} follows more than {_MAX_SYMLINKS} symlinks (a loop?)")
        target = os.readlink(candidate)
        if target.startswith("/"):
            current = "/"
        pending.extend(reversed(target.split("/")))
    return looked_in


def _dir_problem(info: os.stat_result, euid: int, *, sticky_ok: bool) -> str | None:
    """Why another user could change entries in this directory; None when only root or ``euid`` can."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (0, euid):
        return f"is owned by {_who(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not (sticky_ok and mode & stat.S_ISVTX):
        return f"is writable by {_writers(mode)} (mode {mode:04o})"
    return None


def _file_problem(info: os.stat_result, euid: int, *, limit: int) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid not in (0, euid):
        return f"is owned by {_who(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & ~limit:
        return f"has mode {mode:04o}, more than the {limit:04o} the store allows"
    return None


def _blob_problem(info: os.stat_result, euid: int, links: Mapping[tuple[int, int], int]) -> str | None:
    """Why a blob's bytes may have changed behind its recorded stat; None when only root or ``euid`` could."""
    if info.st_uid not in (0, euid):
        return f"it is owned by {_who(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    # The owner's write bit is left alone: the owner is root or the store's own user, who could write anyway.
    if mode & 0o022:
        return f"it is writable by {_writers(mode)} (mode {mode:04o}; the store makes blobs {_BLOB_MODE:04o})"
    ours = 1 + links.get((info.st_dev, info.st_ino), 0)
    if info.st_nlink > ours:
        return f"it has {info.st_nlink} hard links and only {ours} are the store's: another name for it exists"
    return None


def _links_under(directory: str) -> dict[tuple[int, int], int]:
    """How many names each file (device, inode) has under ``directory``, symlinks not followed."""
    counts: dict[tuple[int, int], int] = {}
    for base, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(base, name))
                if stat.S_ISREG(info.st_mode):
                    key = (info.st_dev, info.st_ino)
                    counts[key] = counts.get(key, 0) + 1
    return counts


def dirs_are_ours(base: str, euid: int) -> bool:
    for directory, _dirs, _files in os.walk(base):
        with contextlib.suppress(OSError):
            if _dir_problem(os.lstat(directory), euid, sticky_ok=False) is not None:
                return False
    return True


def _who(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _relocation_warning(root: str, new: str, parent_problem: str | None) -> str:
    exposure = (
        f"{parent_problem}, so that user can swap the model files engines mount until the store moves"
        if parent_problem
        else "inside the agent's directory"
    )
    return (
        f"the artifact store is still at the old default {root}: the policy sets no store.path, and the "
        f"default moved to {new}, a directory of root's own, because {exposure}. To move it: stop the units "
        "(systemctl stop meridian-node.service meridian-node-apply.path meridian-node-apply.service); run "
        f"mv -T {root} {new} (it replaces the empty directory the apply unit creates there), "
        f"chown -R root:root {new} and chmod go-w {new}; start the units again. Engines mount the resolved "
        "version directory, so every engine that uses an artifact changes its mount source and is "
        "re-created, by its replace strategy, on its next converge"
    )

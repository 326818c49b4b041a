"""A version's directory in the artifact store, on disk, and the store's small file operations.

A version is assembled in a fresh temporary directory beside its final place, every file a hard link to its
blob, and renamed in, so a reader never sees half a version; replacing an existing (damaged) version swaps it
out by two renames. ``current`` is switched by renaming a new link over it. A version is removed by renaming
it aside first. The temporaries a killed run leaves are cleared on the next assembly (under the store's lock,
none is live). Nothing here follows a symlink it did not make: one where a directory or file of the version
would go is refused, naming it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence

from ansible_collections.meridian.node.plugins.module_utils._fileutil import fsync_directory
from ansible_collections.meridian.node.plugins.module_utils.artifacts import layout
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import CURRENT, ArtifactPathError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.plan import _DIR_MODE, _check_relative

__all__ = [
    "assemble_version",
    "make_dir",
    "remove_link",
    "remove_version_dir",
    "switch_current",
    "symlinks_under",
    "unlink_if_present",
]


def assemble_version(root: str, name: str, version: str, links: Sequence[tuple[str, str]]) -> None:
    """Build ``artifacts/<name>/<version>`` afresh: ``links`` are (path in the version, the blob it is a hard link
    to), in the manifest's order. Built beside its final place and renamed in; a version already there (damaged)
    is swapped out by two renames."""
    name_dir = os.path.join(layout.artifacts_dir(root), name)
    if os.path.islink(name_dir):
        raise ArtifactPathError(f"{name_dir} is a symlink the store did not create; remove it and run again")
    make_dir(name_dir)
    _clear_leftovers(name_dir)
    final = layout.version_dir(root, name, version)
    build = tempfile.mkdtemp(prefix=f".{version}.build-", dir=name_dir)
    try:
        os.chmod(build, _DIR_MODE)
        for path, blob in links:
            os.link(blob, _safe_target(build, path), follow_symlinks=False)
        for directory, _dirs, _files in os.walk(build):
            fsync_directory(directory)
        if os.path.lexists(final):
            if os.path.islink(final):
                raise ArtifactPathError(f"{final} is a symlink the store did not create; remove it and run again")
            trash = tempfile.mkdtemp(prefix=f".{version}.old-", dir=name_dir)
            os.rename(final, os.path.join(trash, "v"))
            os.rename(build, final)
            shutil.rmtree(trash)
        else:
            os.rename(build, final)
        fsync_directory(name_dir)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def switch_current(root: str, name: str, version: str) -> None:
    """Point ``artifacts/<name>/current`` at ``version``: a new link renamed over the old one."""
    name_dir = os.path.join(layout.artifacts_dir(root), name)
    link = os.path.join(name_dir, CURRENT)
    if os.path.lexists(link) and not os.path.islink(link):
        raise ArtifactPathError(f"{link} is not a symlink; the store only replaces its own switch")
    temp = os.path.join(name_dir, f".{CURRENT}.{os.getpid()}.tmp")
    remove_link(temp)
    os.symlink(version, temp)
    os.replace(temp, link)
    fsync_directory(name_dir)


def remove_version_dir(root: str, name: str, version: str) -> None:
    """Remove ``artifacts/<name>/<version>`` (renamed aside first, so no reader sees half of it), and
    ``artifacts/<name>`` with it once nothing is left there."""
    final = layout.version_dir(root, name, version)
    if os.path.islink(final):
        unlink_if_present(final)
    elif os.path.isdir(final):
        name_dir = os.path.dirname(final)
        trash = tempfile.mkdtemp(prefix=f".{version}.evict-", dir=name_dir)
        os.rename(final, os.path.join(trash, "v"))
        fsync_directory(name_dir)
        shutil.rmtree(trash)
    name_dir = os.path.join(layout.artifacts_dir(root), name)
    with contextlib.suppress(OSError):
        os.rmdir(name_dir)  # only succeeds once nothing (no current link, no version) is left


def _safe_target(base: str, path: str) -> str:
    """Where ``path`` goes under ``base``, creating parents; refuses symlinks and anything outside."""
    _check_relative(path)
    parts = path.split("/")
    current = base
    for part in parts[:-1]:
        current = os.path.join(current, part)
        try:
            os.mkdir(current, _DIR_MODE)
        except FileExistsError:
            if os.path.islink(current) or not os.path.isdir(current):
                raise ArtifactPathError(f"{current} is a symlink or a file where a directory should be") from None
    target = os.path.join(current, parts[-1])
    if os.path.lexists(target):
        raise ArtifactPathError(f"{target} already exists (a symlink or a colliding path); refusing to overwrite it")
    real_base = os.path.realpath(base)
    if os.path.commonpath([real_base, os.path.realpath(target)]) != real_base:
        raise ArtifactPathError(f"path {path!r} resolves outside its version directory {base}")
    return target


def _clear_leftovers(name_dir: str) -> None:
    """Remove build, swap and link temporaries a killed run left behind (we hold the lock: none is live)."""
    for entry in os.scandir(name_dir):
        if entry.name.startswith(".") and any(mark in entry.name for mark in (".build-", ".old-", ".evict-")):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                unlink_if_present(entry.path)
        elif entry.name.startswith(f".{CURRENT}.") and entry.name.endswith(".tmp"):
            unlink_if_present(entry.path)


def symlinks_under(base: str) -> list[str]:
    """Every symlink under ``base``, sorted: a version directory the store did not record may hold some."""
    found = []
    for directory, dirs, files in os.walk(base):
        for entry in dirs + files:
            full = os.path.join(directory, entry)
            if os.path.islink(full):
                found.append(full)
    return sorted(found)


def make_dir(path: str) -> None:
    """``os.makedirs`` with the store's directory mode, refusing a symlink where the directory should be."""
    if os.path.islink(path):
        raise ArtifactPathError(f"{path} is a symlink; the store does not follow symlinks in its own layout")
    os.makedirs(path, mode=_DIR_MODE, exist_ok=True)


def unlink_if_present(path: str) -> None:
    """Remove ``path``; already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_link(path: str) -> None:
    """Remove ``path`` if it is a symlink; anything else is left alone."""
    if os.path.islink(path):
        os.unlink(path)

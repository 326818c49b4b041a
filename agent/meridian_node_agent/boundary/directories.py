"""Directory rules both sides apply to root's directories: real, root's, writable by no one else.

Runs on: both sides. Root's units check the inbox (and every directory above it) before they take anything
from it; the agent's ``check-config`` runs the same checks with ``lstat`` alone, to say what root would refuse.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from meridian_node_agent.boundary.spool import SpoolError

__all__ = ["BoundaryError", "check_root_inbox"]


class BoundaryError(SpoolError):
    """A path root would use is not safe to use: the message names it, what is wrong and the fix."""


def check_root_inbox(inbox: Path, *, agent_dir: Path, agent_gid: int | None) -> os.stat_result:
    """Check the inbox as root would use it; its ``lstat``, or ``BoundaryError`` naming the path and the fix.

    Every directory from ``/`` down must be a real directory owned by root (or the euid), writable by no one
    else (a sticky world-writable directory such as /tmp is allowed above the inbox: no one else can rename
    what root put there). The inbox itself may be group-writable for an operators' group, never for the
    agent's group, and it must not lie inside the agent's directory, whose owner can rename anything there.
    """
    inbox = Path(inbox).absolute()
    real = Path(os.path.realpath(inbox))
    if real != inbox:
        raise BoundaryError(f"refusing air_gap.inbox {inbox}: it resolves to {real}; name the real directory")
    agent_real = os.path.realpath(agent_dir)
    if os.path.commonpath([agent_real, str(real)]) in (agent_real, str(real)):
        raise BoundaryError(
            f"refusing air_gap.inbox {inbox}: it overlaps the agent's directory {agent_real}, whose owner can "
            "rename anything in it; give the inbox a root-owned directory of its own (default "
            "/var/lib/meridian-node-inbox)"
        )
    euid = os.geteuid()
    for ancestor in reversed(inbox.parents):
        _check_directory(ancestor, euid, group_ok=None, sticky_ok=True)
    return _check_directory(inbox, euid, group_ok=agent_gid, sticky_ok=False)


def _check_directory(path: Path, euid: int, *, group_ok: int | None, sticky_ok: bool) -> os.stat_result:
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise BoundaryError(
            f"refusing {path}: it does not exist; create the inbox as root (install -d -o root -g root -m 0700 "
            f"{path}, or -m 0770 with an operators' group that is not the agent's)"
        ) from None
    except OSError as exc:
        raise BoundaryError(f"cannot check {path}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise BoundaryError(f"refusing {path}: it is not a directory (symlinks are never followed here)")
    if info.st_uid not in (0, euid):
        raise BoundaryError(
            f"refusing {path}: it is owned by uid {info.st_uid}, who could swap the inbox's bundles; chown root {path}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o002 and not (sticky_ok and mode & stat.S_ISVTX):
        raise BoundaryError(f"refusing {path}: mode {mode:04o} lets every user write in it; chmod o-w {path}")
    if mode & 0o020:
        if group_ok is None and not (sticky_ok and mode & stat.S_ISVTX):
            raise BoundaryError(
                f"refusing {path}: mode {mode:04o} lets group {info.st_gid} write above the inbox; chmod g-w {path}"
            )
        if group_ok is not None and info.st_gid == group_ok:
            raise BoundaryError(
                f"refusing {path}: it is writable by group {info.st_gid}, the agent's group, so the agent could "
                f"drop or replace bundles; chgrp it to an operators' group the agent's user is not in, or chmod g-w"
            )
    return info

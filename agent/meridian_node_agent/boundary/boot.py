"""The kernel's id of this boot: what both sides scope their boot-bound records by.

Runs on: both sides. The agent's supervision record keeps its monotonic times only for the boot that wrote them
(``agent_side.supervision_record``); root's shutdown drain names the boot in the draining marks it writes, and
clears another boot's (``root_side.drain_on_shutdown``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped

__all__ = ["BOOT_ID_FILE", "read_boot_id"]

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
_BOOT_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def read_boot_id(path: Path = BOOT_ID_FILE) -> str | None:
    """The kernel's id of this boot (a random UUID, new at every boot), or None where there is none to read."""
    try:
        text = read_capped(path, 64, what="kernel boot id", nofollow=False).decode("ascii").strip()
    except (CappedReadError, UnicodeDecodeError):
        return None
    return text if _BOOT_ID.fullmatch(text) else None

"""What module code takes from Python 3.10 and newer, written for the managed host's Python 3.9.

Modules and module_utils run on the host's own interpreter (Debian 11 and RHEL 9 ship 3.9, Ubuntu 22.04
ships 3.10), so they cannot use ``enum.StrEnum`` or ``datetime.UTC`` (3.11). ``make compat`` (vermin)
keeps the rest of ``plugins/`` to 3.9.
"""

from __future__ import annotations

from datetime import timezone
from enum import Enum

__all__ = ["UTC", "StrEnum"]

UTC = timezone.utc


class StrEnum(str, Enum):
    """``enum.StrEnum`` on every Python: a member is a ``str`` equal to its value, and prints as it.

    One definition for every interpreter (rather than the stdlib class where it exists) so that a
    module behaves the same on each host it runs on.
    """

    def __str__(self) -> str:
        return str(self.value)

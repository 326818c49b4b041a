"""The checkout's systemd unit files, read as the tests check them."""

from __future__ import annotations

from pathlib import Path

__all__ = ["UNITS", "read_unit"]

UNITS = Path(__file__).resolve().parents[2] / "systemd"


def read_unit(name: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value assigned (systemd keys may repeat), comments and blanks skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _equals, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections

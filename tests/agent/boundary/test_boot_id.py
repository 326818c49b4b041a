"""The kernel's boot id, as both sides read it (``boundary.boot``): the agent's supervision record and root's
shutdown drain scope what they keep to one boot by it."""

from __future__ import annotations

from pathlib import Path

from meridian_node_agent.boundary.boot import read_boot_id

BOOT = "0f4b5a0e-8c1d-4f7e-9a51-3c2d1e0f9b8a"


def test_the_boot_id_is_the_kernels_or_none(tmp_path: Path) -> None:
    here = read_boot_id()
    if Path("/proc/sys/kernel/random/boot_id").exists():
        assert here is not None and len(here) == 36
    garbage = tmp_path / "boot_id"
    garbage.write_text("not a boot id\n")
    assert read_boot_id(garbage) is None
    assert read_boot_id(tmp_path / "missing") is None
    garbage.write_text(BOOT + "\n")
    assert read_boot_id(garbage) == BOOT

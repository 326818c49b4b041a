"""Helpers of the packaging tests: the checkout, a checked subprocess, the clean agent venv."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["BIN", "CHECKOUT", "AgentVenv", "cache_dir", "find_python", "requirements", "run"]

CHECKOUT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


def run(
    argv: Sequence[str | Path], *, env: dict[str, str] | None = None, cwd: Path | None = None, expect: int = 0
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to completion, expected to exit ``expect``; a failure shows its output."""
    result = subprocess.run(
        [str(arg) for arg in argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=900, check=False
    )
    if result.returncode != expect:
        pytest.fail(
            f"{' '.join(map(str, argv))} exited {result.returncode}, not {expect}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}",
            pytrace=False,
        )
    return result


def cache_dir() -> Path:
    return Path(os.environ.get("MERIDIAN_NODE_CACHE", Path.home() / ".cache" / "meridian-node"))


@dataclass(frozen=True)
class AgentVenv:
    root: Path
    python: Path

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a shell in which only this venv is activated (no dev tools, no checkout)."""
        env = {
            key: value for key, value in os.environ.items() if not key.startswith(("ANSIBLE_", "PYTHON", "VIRTUAL_ENV"))
        }
        env["PATH"] = f"{self.root / 'bin'}:/usr/bin:/bin"
        env["VIRTUAL_ENV"] = str(self.root)
        env.update(extra)
        return env


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        metadata = archive.read(name).decode()
    return sorted(
        line.partition(":")[2].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    )


def find_python(version: str) -> Path | None:
    """A working ``python<version>``: on PATH, else pyenv's; a pyenv shim for a version it lacks is no answer."""
    candidates = [
        shutil.which(f"python{version}"),
        *sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python{version}")),
    ]
    wanted = tuple(int(part) for part in version.split("."))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[0], sys.version_info[1], sys.executable)"],
            capture_output=True,
            text=True,
            check=False,
        )
        fields = probe.stdout.split()
        if probe.returncode == 0 and len(fields) == 3 and (int(fields[0]), int(fields[1])) == wanted:
            return Path(fields[2])
    return None

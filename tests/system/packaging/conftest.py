"""What an operator gets: the wheel and the Galaxy tarball built from this checkout, and a clean virtualenv
with only the wheel (and its own dependencies) installed.

The dependencies come from a wheel cache (``~/.cache/meridian-node/wheels/agent-py<X.Y>-<hash>``, filled
once by ``pip download``), so the install itself runs with ``--no-index``: what the wheel pulls in is
exactly what its metadata says, nothing picked up from the dev environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.system.packaging.packaging_env import (
    BIN,
    CHECKOUT,
    AgentVenv,
    cache_dir,
    requirements,
    run,
)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard wheel of this checkout, built the way a release is (hatchling, no build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    run([BIN / "python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out, CHECKOUT])
    (wheel,) = out.glob("meridian_node-*.whl")
    return wheel


@pytest.fixture(scope="session")
def collection_tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("galaxy")
    run([BIN / "ansible-galaxy", "collection", "build", "--output-path", out, CHECKOUT])
    (tarball,) = out.glob("meridian-node-*.tar.gz")
    return tarball


@pytest.fixture(scope="session")
def agent_venv(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path) -> AgentVenv:
    """A fresh venv holding the wheel as ``pip install meridian-node`` installs it: no extras."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    cache_key = [sysconfig.get_platform(), *requirements(built_wheel)]
    key = hashlib.sha256("\n".join(cache_key).encode()).hexdigest()[:16]
    wheels = cache_dir() / "wheels" / f"agent-py{version}-{key}"
    wheels.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("agent-venv")
    run([Path(sys.base_prefix) / "bin" / f"python{version}", "-m", "venv", root])
    venv = AgentVenv(root, root / "bin" / "python")
    install: list[str | Path] = [
        venv.python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--find-links",
        wheels,
        built_wheel,
    ]
    with (wheels.parent / f"{wheels.name}.lock").open("w") as lock:
        # Another session may be filling the same cache: one download at a time.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if subprocess.run([str(arg) for arg in install], capture_output=True, check=False).returncode != 0:
            run([venv.python, "-m", "pip", "download", "--quiet", "--dest", wheels, built_wheel])
            (wheels / built_wheel.name).unlink(missing_ok=True)  # the cache is for dependencies only
            run(install)
    return venv

"""Module code runs on every managed-host Python this machine has: 3.9 (Debian 11, RHEL 9) to 3.13.

Each run is ``host_python_check.py`` in a venv holding only what the modules need on a host (pydantic,
cryptography, PyYAML, nvidia-ml-py, and ansible-core for ``ansible.module_utils``), cached under
``~/.cache/meridian-node/host-pythons``. A Python this machine lacks is skipped, naming it; the
controller's own Python is always there, so the check never skips as a whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import sys
from pathlib import Path

import pytest

import ansible_collections.meridian.node.plugins.module_utils as module_utils
from ansible_collections.meridian.node.tests.system.packaging.packaging_env import CHECKOUT, cache_dir, find_python, run

HOST_REQUIREMENTS = ("pydantic>=2.6", "cryptography>=42", "PyYAML>=6.0", "nvidia-ml-py>=12.535", "ansible-core")
TARGET_PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")

pytestmark = pytest.mark.slow


def _host_venv(python: Path, version: str) -> Path:
    key = hashlib.sha256("\n".join([str(python), *HOST_REQUIREMENTS]).encode()).hexdigest()[:16]
    root = cache_dir() / "host-pythons" / f"py{version}-{key}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f"{root.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building the same venv
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            run([python, "-m", "venv", root])
            run([root / "bin" / "python", "-m", "pip", "install", "--quiet", *HOST_REQUIREMENTS])
            (root / ".complete").touch()
    return root / "bin" / "python"


@pytest.mark.parametrize("version", TARGET_PYTHONS)
def test_module_code_runs_on_host_python(version: str) -> None:
    python = find_python(version)
    if python is None:
        if version == f"{sys.version_info.major}.{sys.version_info.minor}":
            pytest.fail(f"the running Python {version} was not found by find_python", pytrace=False)
        pytest.skip(f"Python {version} is not on this machine (PATH or /root/.pyenv/versions)")
    # The collection as this test session imports it: the checkout, through .build/collections.
    collections = Path(next(iter(module_utils.__path__))).parents[4]
    result = run(
        [
            _host_venv(python, version),
            CHECKOUT / "tests" / "system" / "packaging" / "host_python_check.py",
            collections,
            CHECKOUT / "contracts" / "v1" / "fixtures",
        ]
    )
    summary = result.stdout.rstrip().splitlines()[-1]
    assert re.fullmatch(rf"Python {re.escape(version)}\.\d+: 4 passed, 0 failed", summary), result.stdout

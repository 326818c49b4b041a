"""The README's ad-hoc ``gpu_facts`` lines, run as written, where interpreter discovery finds a shim.

A directory of pyenv-like shims (``python3``, ``python3.13``, ... that print ``pyenv: ...: command not found``
and exit 127) comes first on PATH, as on a workstation with pyenv or asdf: discovery picks one, and a line
that leaves the interpreter to it fails with "Module result deserialization failed" (issue 25). The lines
name the interpreter, so they work there. A Python without nvidia-ml-py runs the module, which then says
which interpreter it was and what to do.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = REPO / ".venv" / "bin"
SHIM_NAMES = ("python", "python3", *(f"python3.{minor}" for minor in range(8, 16)))

pytestmark = pytest.mark.slow


def _readme_line(start: str) -> list[str]:
    (line,) = [
        line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(start) and "gpu_facts" in line
    ]
    return shlex.split(line)


def _shimmed_env(tmp_path: Path) -> dict[str, str]:
    shims = tmp_path / "shims"
    shims.mkdir()
    for name in SHIM_NAMES:
        shim = shims / name
        shim.write_text(f'#!/bin/sh\necho "pyenv: {name}: command not found" >&2\nexit 127\n')
        shim.chmod(0o755)
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("[gpu_hosts]\nlocalhost ansible_connection=local\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("ANSIBLE_", "PYTHON"))}
    env.update(
        PATH=f"{shims}:{VENV_BIN}:/usr/bin:/bin",
        ANSIBLE_COLLECTIONS_PATH=str(REPO / ".build" / "collections"),
        ANSIBLE_INVENTORY=str(inventory),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
        ANSIBLE_REMOTE_TEMP=str(tmp_path / "ansible-tmp"),
    )
    return env


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)


def _succeeded(proc: subprocess.CompletedProcess[str]) -> bool:
    return proc.returncode == 0 and proc.stdout.startswith("localhost | SUCCESS")


def test_readme_localhost_line_works_where_discovery_finds_a_shim(tmp_path: Path) -> None:
    env = _shimmed_env(tmp_path)
    bare = ["ansible", "localhost", "-c", "local", "-i", "localhost,", "-m", "meridian.node.gpu_facts"]
    # What the README said before: discovery takes the shim, and the module never runs.
    assert not _succeeded(_run(bare, env))

    proc = _run(_readme_line("ansible localhost "), env)

    assert _succeeded(proc), proc.stdout + proc.stderr
    assert '"nvml_available"' in proc.stdout
    assert "lacks the Python package nvidia-ml-py" not in proc.stdout + proc.stderr


def test_readme_group_line_names_the_agents_python_and_says_what_is_missing_elsewhere(tmp_path: Path) -> None:
    env = _shimmed_env(tmp_path)
    line = _readme_line("ansible gpu_hosts ")
    option = line.index("-e") + 1
    key, _, interpreter = line[option].partition("=")
    venv = yaml.safe_load((REPO / "roles" / "node_agent" / "vars" / "main.yml").read_text())["node_agent_venv"]
    # The README names the virtualenv roles/node_agent installs (with nvidia-ml-py): kept in step with the role.
    assert (key, interpreter) == ("ansible_python_interpreter", f"{venv}/bin/python")

    # That virtualenv is not on this machine: the test venv (which has nvidia-ml-py too) stands in for it.
    line[option] = f"{key}={VENV_BIN / 'python'}"
    proc = _run(line, env)
    assert _succeeded(proc), proc.stdout + proc.stderr
    assert "lacks the Python package nvidia-ml-py" not in proc.stdout + proc.stderr

    # A Python without nvidia-ml-py (a fresh venv): the module runs and says which Python and what to do.
    bare = tmp_path / "bare-venv"
    subprocess.run(
        [
            Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}",
            "-m",
            "venv",
            "--without-pip",
            bare,
        ],
        check=True,
        timeout=120,
    )
    line[option] = f"{key}={bare / 'bin' / 'python'}"
    proc = _run(line, env)
    assert _succeeded(proc), proc.stdout + proc.stderr
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"gpu_facts ran on {bare / 'bin' / 'python'}, which lacks the Python package nvidia-ml-py" in said
    assert "set ansible_python_interpreter to a Python that has it" in said
    assert "Traceback" not in said

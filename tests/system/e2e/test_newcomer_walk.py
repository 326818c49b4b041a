"""The newcomer's walk: docs/QUICKSTART.md's `sh` blocks, run as they are written, in order, in one bash, take a
machine from nothing to an enrolled agent whose engine serves and is in the serving projection; the walk is timed.

What the test substitutes, all through the variables the page itself asks a reader to set: ``WORK`` (a temporary
directory), ``EXAMPLES`` (this checkout's), ``IMAGE`` (the stand-in vLLM image, tagged under a repository of its
own so that the walk's agent, which prunes engines of ours whose image its policy allows, never touches another
suite's), ``ENGINE`` (the test's container prefix), ``ENGINE_PORT`` and ``CP_PORT`` (free ports). The block
fenced ``sh install`` (a virtualenv and the wheel) is not run: the checkout's ``.venv`` stands in for it, first
on ``PATH``, and tests/system/packaging installs the wheel itself.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.engine_harness import SERVER
from ansible_collections.meridian.node.tests.support.ports import reserve_ports
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "docs" / "QUICKSTART.md"
BIN = Path(sys.executable).parent
# A repository no other suite's policy allows (see the module docstring).
WALK_REPOSITORY = "meridian-node/quickstart-standin"
BLOCK = re.compile(r"^```(sh[^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def walk_blocks(text: str) -> list[str]:
    """The page's shell blocks to run, in order: every ```sh block but the one fenced ```sh install."""
    return [body for info, body in BLOCK.findall(text) if info.split()[1:] != ["install"]]


def free_port(low: int, high: int) -> int:
    return reserve_ports(low, high)[0]


@pytest.fixture
def walk_image(docker_client: Any, standin_base_image: LocalImage) -> Iterator[LocalImage]:
    """The stand-in vLLM image under ``WALK_REPOSITORY`` with a tag of this test's own, untagged afterwards."""
    built = ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")
    tag = secrets.token_hex(4)
    docker_client.images.get(built.id).tag(WALK_REPOSITORY, tag=tag)
    try:
        yield LocalImage(tag=f"{WALK_REPOSITORY}:{tag}", id=built.id)
    finally:
        docker_client.images.remove(f"{WALK_REPOSITORY}:{tag}")


def test_the_quickstart_takes_a_fresh_machine_to_an_engine_that_serves(
    walk_image: LocalImage, prefix: str, tmp_path: Path, docker_client: Any
) -> None:
    assert shutil.which("curl"), "docs/QUICKSTART.md uses curl: install it (Debian: apt-get install curl)"
    blocks = walk_blocks(QUICKSTART.read_text(encoding="utf-8"))
    assert len(blocks) >= 6, f"docs/QUICKSTART.md has {len(blocks)} sh blocks to run; the walk expects its steps"
    work = tmp_path / "work"
    engine = f"{prefix}-chat"
    port, cp_port = free_port(8000, 8999), free_port(20000, 29999)
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith(("MERIDIAN_NODE_", "ANSIBLE_"))},
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "WORK": str(work),
        "EXAMPLES": str(REPO / "examples"),
        "IMAGE": walk_image.pinned,
        "ENGINE": engine,
        "ENGINE_PORT": str(port),
        "CP_PORT": str(cp_port),
    }
    # One shell, as a reader's terminal; each block marked so that its time and output can be told apart.
    # (A mark starts a line of its own: curl's JSON ends without a newline.)
    marks = [f'printf "\\n::block {index} %s\\n" "$(date +%s.%N)"\n{body}' for index, body in enumerate(blocks)]
    script = "set -eo pipefail\n" + "".join(marks) + 'printf "\\n::done %s\\n" "$(date +%s.%N)"\n'
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
        )
    finally:
        stop_devserver(work / "devserver.pid")
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr

    assert done.returncode == 0, f"the walk stopped (exit {done.returncode}):\n{output[-6000:]}"
    assert "ok" in done.stdout.splitlines(), output  # check-config's last line
    assert '"id":"chat"' in done.stdout.replace(" ", ""), output  # the engine's /v1/models, served model "chat"
    assert f'"address":"127.0.0.1:{port}"' in done.stdout.replace(" ", ""), output  # the serving projection
    assert f'"engine":"{engine}"' in done.stdout.replace(" ", ""), output
    # The clean-up step removed the engine it started.
    assert not [c for c in docker_client.containers.list(all=True, filters={"name": engine}) if c.name == engine]
    print(f"\nnewcomer walk (docs/QUICKSTART.md, {len(blocks)} blocks): {elapsed:.1f} s")
    for line in block_times(done.stdout, blocks):
        print(line)
    if os.environ.get("MERIDIAN_SHOW_WALK"):
        print(output)


def block_times(stdout: str, blocks: list[str]) -> list[str]:
    stamps = [(m.group(1), float(m.group(2))) for m in re.finditer(r"^::(block \d+|done) ([\d.]+)$", stdout, re.M)]
    lines = []
    for (name, start), (_, end) in itertools.pairwise(stamps):
        index = int(name.split()[1])
        first = next((line for line in blocks[index].splitlines() if line and not line.startswith("#")), "")
        lines.append(f"  {end - start:6.2f} s  {first[:90]}")
    return lines


def stop_devserver(pid_file: Path) -> None:
    """The walk's own devserver, if its last step did not stop it (the walk failed before)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return

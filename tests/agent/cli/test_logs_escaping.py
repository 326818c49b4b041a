"""``meridian-node logs``: an engine that prints escape sequences must not drive the terminal of whoever reads its
log. Real parts: a container on the real Docker Engine (the stand-in base image's ``sh``) prints ESC, CSI (clear
screen), OSC 0 (title), OSC 52 (clipboard), BEL, C1 controls as text and as raw bytes, and bytes that are not UTF-8;
the in-process agent's keeper (``keep_engine_logs``) keeps its tail; the real program reads it, through a
pseudo-terminal (so ``isatty`` is true) and through a pipe.

The container logs with Docker's ``local`` driver, which keeps every byte (the default ``json-file`` driver turns a
byte that is not UTF-8 into U+FFFD before anyone reads it), so that ``--raw`` can be held to "unchanged".
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import tty
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_INSTANCE,
    LABEL_OWNED,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.collectors.engine_log_keeper import keep_engine_logs

pytestmark = pytest.mark.docker

HANG_GUARD_S = 60
# What the engine prints, line by line, as bytes; and what `logs` shows of each line.
PRINTED = [
    (b"clear \x1b[2J\x1b[H done", r"clear \x1b[2J\x1b[H done"),
    (b"title \x1b]0;pwned\x07", r"title \x1b]0;pwned\x07"),
    (b"clipboard \x1b]52;c;cm0gLXJmIC8K\x07", r"clipboard \x1b]52;c;cm0gLXJmIC8K\x07"),
    (b"bell \x07\x07", r"bell \x07\x07"),
    (b"c1 as text \xc2\x9b2J \xc2\x9d0;t\x07", r"c1 as text \xc2\x9b2J \xc2\x9d0;t\x07"),
    (b"c1 as bytes \x9b2J \x9d0;t\x07", r"c1 as bytes \x9b2J \x9d0;t\x07"),
    (b"not utf-8 \xff\xfe end", r"not utf-8 \xff\xfe end"),
    (b"a backslash \\x1b as text, C:\\models", r"a backslash \\x1b as text, C:\models"),
    ("température ✓".encode(), "température ✓"),
]
FORBIDDEN = {chr(code) for code in [*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}


def _printing(lines: list[bytes]) -> str:
    """A shell script that prints ``lines`` byte for byte (printf with octal escapes for everything)."""
    octal = ["".join(f"\\{byte:03o}" for byte in line + b"\n") for line in lines]
    return "; ".join(f"printf '{text}'" for text in octal)


@pytest.fixture
def kept(tmp_path: Path, docker_client: Any, standin_base_image: LocalImage, prefix: str) -> tuple[Path, str]:
    """The config of an in-process node whose engine printed ``PRINTED``, its tail kept as the agent keeps it."""
    node, engine = f"{prefix}-node", f"{prefix}-chat"
    state = tmp_path / "state"
    state.mkdir()
    config = write_node_config(tmp_path, node_id=node, via="in-process")
    container = docker_client.containers.run(
        standin_base_image.id,
        [_printing([line for line, _shown in PRINTED])],
        entrypoint=["sh", "-c"],
        name=engine,
        labels={LABEL_OWNED: "true", LABEL_INSTANCE: engine, LABEL_OWNER: f"agent:{node}"},
        log_config={"Type": "local"},
        detach=True,
    )
    assert container.wait(timeout=HANG_GUARD_S)["StatusCode"] == 0
    kept = keep_engine_logs(
        DockerEngine.from_env(timeout_s=30),
        owner=f"agent:{node}",
        directory=state / "logs",
        read_at="2026-12-05T07:00:00Z",
    )
    assert list(kept.tails) == [engine] and not kept.problems
    return config, engine


def _command(config: Path, *args: str) -> list[str]:
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    return [*command, "--config", str(config), "logs", *args]


def _on_a_terminal(command: list[str]) -> tuple[int, bytes, bytes]:
    """Run ``command`` with its stdout on a pseudo-terminal (raw mode: what is written arrives as written)."""
    master, slave = os.openpty()
    tty.setraw(slave)
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the last writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif process.poll() is not None:
                break
        else:
            process.kill()
            pytest.fail(f"{' '.join(command)} did not finish in {HANG_GUARD_S} s")
        _out, err = process.communicate(timeout=HANG_GUARD_S)
    finally:
        os.close(master)
    return process.returncode, bytes(out), err


def test_on_a_terminal_every_sequence_is_shown_escaped(kept: tuple[Path, str]) -> None:
    config, engine = kept

    status, out, err = _on_a_terminal(_command(config, engine))

    assert status == 0, err
    for raw in (b"\x1b", b"\x07", b"\x9b", b"\x9d", b"\xff"):
        assert raw not in out
    text = out.decode("utf-8")  # strict
    assert not FORBIDDEN & set(text.replace("\n", ""))
    lines = text.splitlines()
    assert lines[0].startswith(f"--- {engine}: container ")
    assert lines[1:] == [shown for _line, shown in PRINTED]


def test_to_a_pipe_without_raw_it_is_escaped_too(kept: tuple[Path, str]) -> None:
    config, engine = kept

    done = subprocess.run(_command(config, engine), capture_output=True, timeout=HANG_GUARD_S, check=False)

    assert done.returncode == 0, done.stderr
    assert done.stdout.decode("utf-8").splitlines()[1:] == [shown for _line, shown in PRINTED]


def test_raw_to_a_pipe_passes_the_engines_bytes_unchanged(kept: tuple[Path, str]) -> None:
    config, engine = kept

    done = subprocess.run(_command(config, engine, "--raw"), capture_output=True, timeout=HANG_GUARD_S, check=False)

    assert done.returncode == 0, done.stderr
    header, _, body = done.stdout.partition(b"\n")
    assert header.startswith(f"--- {engine}: container ".encode())
    assert body == b"".join(line + b"\n" for line, _shown in PRINTED)


def test_raw_to_a_terminal_is_refused(kept: tuple[Path, str]) -> None:
    config, engine = kept

    status, out, err = _on_a_terminal(_command(config, engine, "--raw"))

    assert status == 2 and out == b""
    assert "--raw writes the escape sequences an engine printed as they are, and stdout is a terminal" in err.decode()


def test_the_observations_lines_carry_u_fffd_for_what_was_not_utf8(kept: tuple[Path, str]) -> None:
    from meridian_node_agent.boundary.engine_logs_file import read_log_tail

    config, engine = kept

    lines = read_log_tail(config.parent / "state" / "logs", engine).lines()

    assert lines[5] == "c1 as bytes \ufffd2J \ufffd0;t\x07" and lines[6] == "not utf-8 \ufffd\ufffd end"
    assert lines[0] == "clear \x1b[2J\x1b[H done"  # kept as printed: escaped where shown, JSON-escaped where sent

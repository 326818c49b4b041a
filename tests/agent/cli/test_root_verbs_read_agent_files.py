"""``meridian-node status`` and ``gpu-health show|clear``, run as root (these tests' user), against what a
compromised agent plants in the directory it owns: a FIFO, a symlink to /dev/zero or to a file only root may read,
a hard link to one, a file larger than any the agent writes, and text carrying escape sequences.

Each case runs the real program as its own process, with a timeout that fails the test if it hangs and an
address-space limit so that an unbounded read fails it with a MemoryError instead of taking the host's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.fake_nvml import FAKES, two_healthy_gpus
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config

HANG_GUARD_S = 30
MEMORY_LIMIT = 4 * 1024**3
SECRET = "root-only-secret-7f3a"
UUID1 = "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01"
# What a terminal acts on: ESC, CSI (clear the screen), OSC 0 (the window title), OSC 52 (the clipboard), BEL,
# and the C1 forms of CSI and OSC.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIC8K\x07\x9b31m\x9d0;t\x07"
SHOWN = r"\x1b[2J\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIC8K\x07\xc2\x9b31m\xc2\x9d0;t\x07"
FORBIDDEN = {chr(code) for code in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}


def _config(root: Path, *, via: str = "systemd") -> Path:
    (root / "state" / "identity").mkdir(parents=True)
    (root / "apply").mkdir()
    return write_node_config(root, node_id="gpu-node-planted", via=via)


def meridian_node(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The real program, on the fake pynvml, as its own process; a hang fails the test."""
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps(two_healthy_gpus()))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")])),
        "MERIDIAN_FAKE_NVML_SCENARIO": str(scenario),
    }
    # The limit is set by util-linux's prlimit rather than a preexec_fn: Python code run between fork and exec in
    # this process, which earlier tests left with gRPC's threads and fork handlers, could crash the child (it did,
    # on a loaded machine); without a preexec_fn the child is spawned without running them.
    limited = ["prlimit", f"--as={MEMORY_LIMIT}", "--"]
    try:
        return subprocess.run(
            [*limited, *command, "--config", str(tmp_path / "config.yaml"), *args],
            capture_output=True,
            timeout=HANG_GUARD_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"meridian-node {' '.join(args)} hung for {HANG_GUARD_S} s on a file the agent planted")


def _root_only_file(tmp_path: Path) -> Path:
    secret = tmp_path / "root-only" / "secret.json"
    secret.parent.mkdir(mode=0o700)
    secret.write_text(json.dumps({"lease_epoch": SECRET, "gpus": [{"uuid": UUID1, "verdict": SECRET}]}))
    secret.chmod(0o600)
    return secret


def plant_fifo(tmp_path: Path, path: Path) -> str:
    os.mkfifo(path)
    return f"refusing {path}: it is a FIFO, not a regular file"


def plant_dev_zero(tmp_path: Path, path: Path) -> str:
    path.symlink_to("/dev/zero")
    return f"refusing {path}: it is a symlink"


def plant_root_only_symlink(tmp_path: Path, path: Path) -> str:
    path.symlink_to(_root_only_file(tmp_path))
    return f"refusing {path}: it is a symlink"


def plant_root_only_hard_link(tmp_path: Path, path: Path) -> str:
    os.link(_root_only_file(tmp_path), path)
    return f"refusing {path}: it has 2 hard links"


def plant_oversize(tmp_path: Path, path: Path) -> str:
    with path.open("wb") as file:
        file.truncate(64 * 1024 * 1024)
    return f"refusing {path}: it is larger than"


PLANTS: dict[str, Callable[[Path, Path], str]] = {
    "fifo": plant_fifo,
    "symlink-to-dev-zero": plant_dev_zero,
    "symlink-to-root-only-file": plant_root_only_symlink,
    "hard-link-to-root-only-file": plant_root_only_hard_link,
    "oversize": plant_oversize,
}
# The files of the agent each verb reads, relative to its state_dir.
READS = {
    "status": ["status.json", "applied.json", "oplog.jsonl", "identity/node.pem"],
    "gpu-health show": ["status.json"],
}
CASES = [
    pytest.param(verb, name, plant, id=f"{verb.replace(' ', '-')}-{name.replace('/', '-')}-{plant}")
    for verb, names in READS.items()
    for name in names
    for plant in PLANTS
    # The operation log only grows: it is read from its end (test_a_long_operation_log_is_read_from_its_end).
    if (name, plant) != ("oplog.jsonl", "oversize")
]


@pytest.mark.parametrize(("verb", "name", "plant"), CASES)
def test_a_planted_file_is_refused_in_one_line_without_a_hang(tmp_path: Path, verb: str, name: str, plant: str) -> None:
    _config(tmp_path)
    path = tmp_path / "state" / name
    expected = PLANTS[plant](tmp_path, path)

    done = meridian_node(tmp_path, *verb.split())

    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert expected in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert SECRET not in done.stdout.decode() + err


def test_clear_refuses_a_planted_status_file_too(tmp_path: Path) -> None:
    _config(tmp_path)
    path = tmp_path / "state" / "status.json"
    os.mkfifo(path)

    done = meridian_node(tmp_path, "gpu-health", "clear", "0")

    assert done.returncode == 1
    assert f"refusing {path}: it is a FIFO, not a regular file" in done.stderr.decode()


def _shown(done: subprocess.CompletedProcess[bytes]) -> str:
    assert done.returncode == 0, done.stderr
    for raw in (b"\x1b", b"\x07", b"\x9b", b"\x9d"):
        assert raw not in done.stdout
    text = done.stdout.decode("utf-8")  # strict: nothing but valid UTF-8 reaches the terminal
    assert not FORBIDDEN & set(text)
    return text


def test_escape_sequences_in_the_status_file_are_shown_escaped(tmp_path: Path) -> None:
    _config(tmp_path)
    status = {
        "lease_epoch": HOSTILE,
        "engines": [{"name": "chat", "state": "restarting", "exit_reason": HOSTILE, "managed": True}],
        "gpus": [{"index": 1, "uuid": UUID1, "verdict": "unhealthy", "held": True, "reasons": [HOSTILE]}],
        "updated_at": "2026-12-05T07:00:00Z\nnode  forged-row",
    }
    (tmp_path / "state" / "status.json").write_text(json.dumps(status))

    text = _shown(meridian_node(tmp_path, "status"))

    rows = {line.split("  ", 1)[0].strip(): line for line in text.splitlines()}
    assert rows["lease epoch"].endswith(SHOWN)
    assert f"last exit: {SHOWN}" in rows["engines"] and f"({SHOWN})" in rows["gpu health"]
    assert rows["status updated"].endswith(r"2026-12-05T07:00:00Z\x0anode  forged-row")
    assert rows["node"].endswith("gpu-node-planted")


def test_escape_sequences_in_the_agents_gpu_report_are_shown_escaped(tmp_path: Path) -> None:
    _config(tmp_path)
    status = {"gpus": [{"index": 1, "uuid": UUID1, "verdict": "unhealthy", "held": True, "reasons": [HOSTILE]}]}
    (tmp_path / "state" / "status.json").write_text(json.dumps(status))

    text = _shown(meridian_node(tmp_path, "gpu-health", "show"))

    assert f"the agent's last report: unhealthy, held since None ({SHOWN})" in text


def test_the_json_documents_carry_escape_sequences_only_as_json_escapes(tmp_path: Path) -> None:
    _config(tmp_path)
    (tmp_path / "state" / "status.json").write_text(json.dumps({"lease_epoch": HOSTILE}))

    done = meridian_node(tmp_path, "status", "--json")

    assert json.loads(_shown(done))["agent"]["lease_epoch"] == HOSTILE


def test_a_long_operation_log_is_read_from_its_end(tmp_path: Path) -> None:
    _config(tmp_path)
    entry = {"op": "apply", "epoch": 1, "payload_sha256": "0" * 64, "result": "successful", "at": "2026-12-05T07:00Z"}
    lines = [json.dumps({**entry, "generation": number, "run_ident": f"run-{number}"}) for number in range(1, 4001)]
    (tmp_path / "state" / "oplog.jsonl").write_text("\n".join(lines) + "\n")  # about 700 KiB: over the cap

    done = meridian_node(tmp_path, "status")

    assert done.returncode == 0, done.stderr
    assert "run-4000 successful at 2026-12-05T07:00Z" in done.stdout.decode()

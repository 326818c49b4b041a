"""``meridian-node logs ENGINE [--tail N]``: what it prints from a kept tail, and what it says when there is none.

The tails are written here by ``boundary.engine_logs_file`` as the keepers write them; tests/agent/root_side/
test_observe_engine_logs.py has root's observe unit keep them from a real crash-looping container and runs this
verb as ``nobody``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from meridian_node_agent.boundary.engine_logs_file import EngineLogTail, KeptRun, write_log_tail
from meridian_node_agent.boundary.engines_file import Inventory, InventoryEngine, write_inventory
from meridian_node_agent.cli import main as cli_main

NODE = "gpu-node-logs-cli"
AT = "2026-12-05T07:00:00Z"


def _config(root: Path, via: str) -> Path:
    config = write_node_config(root, node_id=NODE, via=via)
    (root / "state").mkdir()
    (root / "apply" / "public").mkdir(parents=True)
    return config


def _run(container: str, lines: list[str], *, state: str = "restarting", reason: str | None = "exit 3") -> KeptRun:
    return KeptRun(container, 2, state, reason, AT, tuple(lines))


def _listed(name: str) -> InventoryEngine:
    return InventoryEngine(
        name=name,
        driver="vllm",
        served_model_name=None,
        image=None,
        host="127.0.0.1",
        port=9450,
        probe_driver="vllm",
        health_path="/health",
        gpus=(),
        min_vram_mib=0,
        state="restarting",
    )


RECREATED = EngineLogTail(
    "chat",
    AT,
    current=_run("bbbbbbbbbbbb", ["starting again"], state="running", reason=None),
    previous=_run("aaaaaaaaaaaa", ["loading model", "fatal: CUDA error: out of memory"]),
)


def test_in_process_it_prints_the_previous_containers_lines_then_the_current_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, "in-process")
    write_log_tail(tmp_path / "state" / "logs", RECREATED)

    assert cli_main(["--config", str(config), "logs", "chat"]) == 0

    assert capsys.readouterr().out.splitlines() == [
        f"--- chat: previous container aaaaaaaaaaaa (restarting, 2 restarts, last exit 3; read {AT}) ---",
        "loading model",
        "fatal: CUDA error: out of memory",
        f"--- chat: container bbbbbbbbbbbb (running, 2 restarts; read {AT}) ---",
        "starting again",
    ]


def test_tail_counts_the_last_lines_across_both_containers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, "in-process")
    write_log_tail(tmp_path / "state" / "logs", RECREATED)

    assert cli_main(["--config", str(config), "logs", "chat", "--tail", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if not line.startswith("---")] == [
        "fatal: CUDA error: out of memory",
        "starting again",
    ]

    assert cli_main(["--config", str(config), "logs", "chat", "--tail", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1] == "starting again" and "previous" not in out[0]


def test_under_the_split_it_reads_roots_public_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, "systemd")
    write_log_tail(tmp_path / "apply" / "public" / "logs", RECREATED)

    assert cli_main(["--config", str(config), "logs", "chat", "--tail", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "starting again"


def test_an_engine_this_node_does_not_run_is_named_with_the_ones_it_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, "systemd")
    public = tmp_path / "apply" / "public"
    write_inventory(public, Inventory(NODE, AT, (_listed("chat"), _listed("embed"))))

    assert cli_main(["--config", str(config), "logs", "chta"]) == 1

    assert "no engine 'chta' on this node (engines: chat, embed)" in capsys.readouterr().err


def test_an_engine_with_no_tail_yet_points_at_roots_observe_timer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, "systemd")
    public = tmp_path / "apply" / "public"
    write_inventory(public, Inventory(NODE, AT, (_listed("chat"),)))

    assert cli_main(["--config", str(config), "logs", "chat"]) == 1

    err = capsys.readouterr().err
    assert "no log is kept for engine 'chat' yet" in err
    assert "systemctl status meridian-node-apply-observe.timer" in err


def test_in_process_no_tail_yet_asks_whether_the_agent_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, "in-process")

    assert cli_main(["--config", str(config), "logs", "chat"]) == 1

    assert "is it running?" in capsys.readouterr().err


def test_a_name_no_engine_can_have_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, "in-process")

    assert cli_main(["--config", str(config), "logs", "../../etc/shadow"]) == 2

    assert "is not an engine name" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["0", "-3", "x"])
def test_a_count_that_is_not_a_positive_number_is_a_usage_error(
    tmp_path: Path, count: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, "in-process")

    with pytest.raises(SystemExit) as exited:
        cli_main(["--config", str(config), "logs", "chat", "--tail", count])

    assert exited.value.code == 2 and "--tail" in capsys.readouterr().err

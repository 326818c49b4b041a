"""How ``meridian-node`` ends when its reader goes away or its person presses Ctrl-C: a line, never a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from meridian_node_agent import cli
from meridian_node_agent.cli import trust


def test_a_reader_that_went_away_ends_the_verb_with_141_and_no_traceback(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    proc = subprocess.Popen(
        [*command, "keygen", "--out", str(tmp_path / "control.pem")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    # Closed before the interpreter is even up: the verb's one line of output meets a pipe nobody reads (`| head`).
    proc.stdout.close()
    err = proc.stderr.read().decode()
    status = proc.wait(timeout=60)

    assert status == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert (tmp_path / "control.pem").exists(), "the work was done; only its report had nowhere to go"


def test_ctrl_c_says_interrupted_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def pressed(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(trust, "cmd_keygen", pressed)

    status = cli.main(["keygen", "--out", str(tmp_path / "control.pem")])

    assert status == 130
    assert capsys.readouterr().err == "meridian-node keygen: interrupted\n"

"""Shell completion of ``meridian-node``: the real program answers argcomplete's protocol (``_ARGCOMPLETE``,
``COMP_LINE``, ``COMP_POINT``; the answer on ``_ARGCOMPLETE_STDOUT_FILENAME``), as argcomplete's own tests drive
it, and completing never costs a normal run anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meridian_node_agent.cli import VERB_MODULES

SCRIPT = Path(sys.executable).parent / "meridian-node"


# Runs the program as its console script does, but writes the modules loaded by the time argcomplete ends the
# process (with os._exit, so nothing at exit would run) to $LOADED.
_RUN_AND_LIST_MODULES = """
import os, sys
exit_now = os._exit
def listing_exit(code):
    with open(os.environ["LOADED"], "w") as out:
        out.write("\\n".join(sorted(sys.modules)))
    exit_now(code)
os._exit = listing_exit
from meridian_node_agent.cli import main
sys.exit(main())
"""


def complete(line: str, tmp_path: Path) -> tuple[list[str], set[str]]:
    """What a TAB at the end of ``line`` offers, and the modules the program had loaded when it answered."""
    answer, loaded = tmp_path / "answer", tmp_path / "loaded"
    env = {
        **os.environ,
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_SHELL": "bash",
        "_ARGCOMPLETE_STDOUT_FILENAME": str(answer),
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "COMP_TYPE": "9",
        "LOADED": str(loaded),
    }
    done = subprocess.run(
        [sys.executable, "-c", _RUN_AND_LIST_MODULES], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    words = sorted(word.strip() for word in answer.read_text().split("\013") if word.strip())
    return words, set(loaded.read_text().split())


@pytest.mark.parametrize(
    ("line", "offered"),
    [
        ("meridian-node ch", ["check-config"]),
        ("meridian-node run", ["run", "runbook-pin"]),
        ("meridian-node --config /etc/meridian-node/config.yaml st", ["status"]),
        ("meridian-node gpu-health s", ["show"]),
    ],
)
def test_a_partial_word_completes_to_the_verbs_it_starts(line: str, offered: list[str], tmp_path: Path) -> None:
    assert complete(line, tmp_path)[0] == offered


def test_an_empty_word_offers_every_verb(tmp_path: Path) -> None:
    words, _ = complete("meridian-node ", tmp_path)
    assert set(VERB_MODULES) <= set(words)


def test_options_complete_after_a_verb_from_that_verbs_module_alone(tmp_path: Path) -> None:
    words, loaded = complete("meridian-node status --", tmp_path)
    assert "--json" in words
    assert "meridian_node_agent.cli.agent" in loaded
    assert "meridian_node_agent.cli.trust" not in loaded, "completing one verb's options loaded every verb"


def test_a_normal_run_does_not_import_argcomplete() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("_ARGCOMPLETE", "COMP_"))}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(SCRIPT), "status", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "argcomplete" not in done.stderr

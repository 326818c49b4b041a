"""The in-worker action plugins (engine_set, engine_instance): which interpreter counts as the controller's own
(the rest of their choice is shown by real runs in tests/collection/action/test_engine_set_worker.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ansible_collections.meridian.node.plugins.plugin_utils.in_worker import same_interpreter


def test_the_interpreter_itself_is_the_same() -> None:
    assert same_interpreter(sys.executable, sys.executable)


def test_another_name_for_it_in_its_own_directory_is_the_same(tmp_path: Path) -> None:
    real = tmp_path / "bin" / "python3.11"
    real.parent.mkdir()
    real.write_text("")
    (tmp_path / "bin" / "python").symlink_to("python3.11")
    assert same_interpreter(str(tmp_path / "bin" / "python"), str(real))


def test_the_file_a_virtualenv_links_to_is_not_the_same(tmp_path: Path) -> None:
    # A venv's python links to the system's: one file, other site-packages.
    system = tmp_path / "usr" / "bin" / "python3"
    system.parent.mkdir(parents=True)
    system.write_text("")
    venv = tmp_path / "venv" / "bin" / "python"
    venv.parent.mkdir(parents=True)
    venv.symlink_to(system)
    assert os.path.samefile(venv, system)
    assert not same_interpreter(str(system), str(venv))
    assert not same_interpreter(str(venv), str(system))


def test_unset_discovered_relative_or_missing_interpreters_are_not_the_same(tmp_path: Path) -> None:
    for interpreter in ("", "auto_silent", "python3", str(tmp_path / "missing" / "python3")):
        assert not same_interpreter(interpreter, sys.executable), interpreter

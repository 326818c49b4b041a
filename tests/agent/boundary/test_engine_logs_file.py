"""``boundary.engine_logs_file``: the kept tail's format, its bounds, and a writer that follows no planted path.

Real files in a temporary directory; tests/agent/root_side/test_observe_engine_logs.py writes them from a real
crash-looping container through root's observe unit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import OBSERVED_LOG_LINE_CHARS
from meridian_node_agent.boundary.engine_logs_file import (
    LOG_FILE_MODE,
    LOGS_DIR_MODE,
    MAX_LINE_CHARS,
    MAX_LOG_FILE_BYTES,
    TAIL_LINES,
    EngineLogError,
    EngineLogTail,
    KeptRun,
    cap_line,
    read_log_tail,
    write_log_tail,
)

AT = "2026-12-05T07:00:00Z"


def _run(container: str, lines: list[str], *, restarts: int = 0) -> KeptRun:
    return KeptRun(container, restarts, "restarting", "exit 3", AT, tuple(lines))


def test_a_tail_written_reads_back_the_same_previous_lines_first(tmp_path: Path) -> None:
    tail = EngineLogTail(
        "chat", AT, _run("bbbbbbbbbbbb", ["starting"]), _run("aaaaaaaaaaaa", ["loading", "fatal: oom"])
    )

    path = write_log_tail(tmp_path / "logs", tail, group=os.getgid())

    assert read_log_tail(tmp_path / "logs", "chat") == tail
    assert tail.lines() == ["loading", "fatal: oom", "starting"]
    assert tail.lines(2) == ["fatal: oom", "starting"]
    assert path.stat().st_mode & 0o777 == LOG_FILE_MODE
    assert (tmp_path / "logs").stat().st_mode & 0o777 == LOGS_DIR_MODE


def test_a_long_line_is_cut_with_a_note_and_fits_the_observations_bound() -> None:
    cut = cap_line("x" * 100_000)
    assert cut.startswith("x" * MAX_LINE_CHARS) and cut.endswith(f"[... {100_000 - MAX_LINE_CHARS} more characters]")
    assert len(cut) <= OBSERVED_LOG_LINE_CHARS
    assert cap_line("short") == "short"


def test_a_tail_too_large_for_the_cap_loses_its_oldest_lines_first(tmp_path: Path) -> None:
    # Escapes: each of these characters takes six bytes in JSON, so full lines overflow the cap.
    wide = "\u0001" * MAX_LINE_CHARS
    previous = _run("aaaaaaaaaaaa", [f"old {i} {wide}" for i in range(TAIL_LINES)])
    current = _run("bbbbbbbbbbbb", [f"new {i} {wide}" for i in range(TAIL_LINES)])

    path = write_log_tail(tmp_path / "logs", EngineLogTail("chat", AT, current, previous))

    assert path.stat().st_size <= MAX_LOG_FILE_BYTES
    kept = read_log_tail(tmp_path / "logs", "chat")
    assert kept.current.lines[-1].startswith(f"new {TAIL_LINES - 1} ")  # the newest is always kept
    assert kept.previous is not None and len(kept.previous.lines) < TAIL_LINES


def test_a_symlink_planted_where_the_file_goes_is_replaced_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's own file\n")
    logs = tmp_path / "logs"
    logs.mkdir(LOGS_DIR_MODE)
    (logs / "chat.json").symlink_to(victim)

    write_log_tail(logs, EngineLogTail("chat", AT, _run("bbbbbbbbbbbb", ["hello"])))

    assert victim.read_text() == "root's own file\n"
    assert not (logs / "chat.json").is_symlink()
    assert read_log_tail(logs, "chat").current.lines == ("hello",)


def test_a_symlinked_logs_directory_is_refused_and_nothing_is_written_through_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "logs").symlink_to(elsewhere)

    with pytest.raises(EngineLogError, match="symlinks are never followed"):
        write_log_tail(tmp_path / "logs", EngineLogTail("chat", AT, _run("bbbbbbbbbbbb", ["hello"])))

    assert list(elsewhere.iterdir()) == []


def test_a_logs_directory_others_may_write_in_is_refused(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o770)

    with pytest.raises(EngineLogError, match="chmod go-w"):
        write_log_tail(logs, EngineLogTail("chat", AT, _run("bbbbbbbbbbbb", ["hello"])))


def test_reading_refuses_a_symlink(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write_log_tail(logs, EngineLogTail("real", AT, _run("bbbbbbbbbbbb", ["hello"])))
    (logs / "chat.json").symlink_to(logs / "real.json")

    with pytest.raises(EngineLogError, match="symlink"):
        read_log_tail(logs, "chat")


@pytest.mark.parametrize("name", ["../etc/passwd", "Chat", "", "a/b", "x" * 64])
def test_a_name_no_engine_can_have_never_becomes_a_path(tmp_path: Path, name: str) -> None:
    with pytest.raises(EngineLogError, match="is not an engine name"):
        write_log_tail(tmp_path / "logs", EngineLogTail(name, AT, _run("bbbbbbbbbbbb", ["x"])))
    with pytest.raises(EngineLogError, match="is not an engine name"):
        read_log_tail(tmp_path / "logs", name)


def test_a_missing_tail_says_so(tmp_path: Path) -> None:
    with pytest.raises(EngineLogError, match="no log is kept for engine 'chat' yet"):
        read_log_tail(tmp_path, "chat")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d.update(format=2), "format must be 1"),
        (lambda d: d.update(engine="other"), "written for engine 'other'"),
        (lambda d: d["current"].update(lines=["x"] * (TAIL_LINES + 1)), "lines must be a list"),
        (lambda d: d["current"].update(lines=["x" * (OBSERVED_LOG_LINE_CHARS + 1)]), "at most"),
        (lambda d: d["current"].update(container_id="../../x"), "container_id"),
        (lambda d: d.update(extra=1), "the fields must be"),
    ],
    ids=["format", "engine", "too-many-lines", "line-too-long", "container-id", "unknown-field"],
)
def test_a_malformed_file_is_refused_naming_the_field(tmp_path: Path, change: object, problem: str) -> None:
    path = write_log_tail(tmp_path / "logs", EngineLogTail("chat", AT, _run("bbbbbbbbbbbb", ["x"])))
    document = json.loads(path.read_text())
    change(document)  # type: ignore[operator]
    path.write_text(json.dumps(document))

    with pytest.raises(EngineLogError, match=problem):
        read_log_tail(tmp_path / "logs", "chat")

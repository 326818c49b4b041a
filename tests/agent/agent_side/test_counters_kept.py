"""The counters ``meridian-node status`` shows are kept across the agent's restarts (issue 25: they reset with each
process), taken back from the status file; a damaged file starts them at zero with one log line, never a crash."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.node_env import make_node, publish
from meridian_node_agent.agent_side.counters import Counters, restore_counters
from meridian_node_agent.agent_side.status_file import read_status
from meridian_node_agent.boundary.agent_files import STATUS_FILE
from meridian_node_agent.logs import EventLogger


def test_a_restarted_agent_counts_on_from_what_the_last_run_wrote(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node = make_node(server, tmp_path / "node", node_id)
    publish(server, node.node_id)
    first = node.agent()
    assert first.run(max_cycles=1) == 0
    first.close()
    before = read_status(node.state_dir)
    assert before is not None
    assert (before["counters"]["cycles"], before["counters"]["applies"]) == (1, 1)
    applied_at = before["last_applied_at"]
    assert applied_at is not None

    restarted = node.agent()  # a new process's agent: it reads the status file the first one wrote
    assert restarted.counters == Counters(cycles=1, applies=1)
    assert restarted.run(max_cycles=1) == 0
    restarted.close()

    after = read_status(node.state_dir)
    assert after is not None
    assert (after["counters"]["cycles"], after["counters"]["applies"]) == (2, 1)
    assert after["last_applied_at"] == applied_at  # nothing applied in this run: the earlier success stands


def _write(state_dir: Path, document: object) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / STATUS_FILE
    path.write_text(json.dumps(document))
    return path


def test_counts_and_rejections_come_back_and_unknown_keys_are_left_out(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {
            "counters": {"cycles": 7, "apply_failures": 2, "rejections": {"expired": 3}, "from_a_newer_agent": 1},
            "last_applied_at": "2026-12-05T07:00:00Z",
            "engines": [],
        },
    )

    carried = restore_counters(path, log=EventLogger())

    assert carried.counters == Counters(cycles=7, apply_failures=2, rejections={"expired": 3})
    assert carried.last_applied_at is not None and carried.last_applied_at.isoformat() == "2026-12-05T07:00:00+00:00"


def test_no_status_file_is_a_first_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="meridian_node_agent"):
        carried = restore_counters(tmp_path / STATUS_FILE, log=EventLogger())
    assert carried.counters == Counters() and carried.last_applied_at is None
    assert not caplog.records


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "json"),
        ({"counters": {"applies": -1}}, "counters.applies"),
        ({"counters": {"cycles": "7"}}, "counters.cycles"),
        ({"counters": {"rejections": {"expired": 1.5}}}, "counters.rejections"),
        ({"counters": {}, "last_applied_at": "yesterday"}, "last_applied_at"),
        ([1, 2], "object"),
    ],
    ids=["not-json", "negative-count", "count-as-string", "fractional-rejections", "bad-time", "not-an-object"],
)
def test_a_damaged_status_file_starts_the_counters_at_zero_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: object, reason: str
) -> None:
    path = tmp_path / STATUS_FILE
    path.write_text(content if isinstance(content, str) else json.dumps(content))

    with caplog.at_level(logging.WARNING, logger="meridian_node_agent"):
        carried = restore_counters(path, log=EventLogger())

    assert carried.counters == Counters() and carried.last_applied_at is None
    [record] = caplog.records
    assert record.getMessage() == "counters-not-restored"
    fields = getattr(record, "fields", {})
    assert fields["path"] == str(path)
    assert reason in fields["reason"].lower(), fields["reason"]


def test_a_status_file_swapped_for_a_symlink_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = _write(tmp_path / "elsewhere", {"counters": {"applies": 99}})
    os.symlink(elsewhere, tmp_path / STATUS_FILE)

    with caplog.at_level(logging.WARNING, logger="meridian_node_agent"):
        carried = restore_counters(tmp_path / STATUS_FILE, log=EventLogger())

    assert carried.counters == Counters()
    assert [record.getMessage() for record in caplog.records] == ["counters-not-restored"]

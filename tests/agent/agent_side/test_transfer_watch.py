"""The agent's view of the pulls in flight: logged and shown at a pace for people, from the file the modules write.

The module side writes with ``TransferReporter`` (the real writer); the watch runs on an injected clock.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TRANSFERS_FILE, TransferReporter
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock
from meridian_node_agent.agent_side.transfer_watch import PROGRESS_EVERY_S, TransferWatch
from meridian_node_agent.logs import EventLogger

IMAGE = "127.0.0.1:5000/team/vllm@sha256:" + "b" * 64


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, Any]]]:
    return [(r.getMessage(), dict(getattr(r, "fields", {}))) for r in caplog.records]


@pytest.fixture
def parts(tmp_path: Path) -> tuple[TransferReporter, TransferWatch, MonotonicClock]:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    clock = MonotonicClock(50.0)
    writer = TransferReporter(str(directory / TRANSFERS_FILE), clock=clock, wall=lambda: datetime.now(UTC))
    return writer, TransferWatch(directory / TRANSFERS_FILE, EventLogger(), clock), clock


def test_a_pull_is_logged_at_its_start_every_ten_seconds_and_at_its_end(
    parts: tuple[TransferReporter, TransferWatch, MonotonicClock], caplog: pytest.LogCaptureFixture
) -> None:
    writer, watch, clock = parts
    with caplog.at_level(logging.INFO, logger="meridian_node_agent"):
        writer.start("image", IMAGE)
        assert watch.poll() is True
        for _second in range(25):  # 25 s of a pull moving 4 MiB a second, polled each second as the cycle does
            clock.now += 1.0
            writer.advance(IMAGE, (int(clock.now) - 50) * 4 * 1024 * 1024, 200 * 1024 * 1024)
            watch.poll()
        writer.end(IMAGE)
        clock.now += 1.0
        assert watch.poll() is True
    logged = events(caplog)
    assert [name for name, _fields in logged] == [
        "transfer-started",
        "transfer-progress",
        "transfer-progress",
        "transfer-ended",
    ]
    first, second = logged[1][1], logged[2][1]
    assert (first["seconds"], second["seconds"]) == (PROGRESS_EVERY_S, 2 * PROGRESS_EVERY_S)
    assert first["bytes_done"] == 40 * 1024 * 1024 and first["percent"] == 20.0
    assert first["bytes_per_second"] == 4 * 1024 * 1024
    assert logged[3][1]["bytes_done"] == 100 * 1024 * 1024
    assert watch.transfers == []


def test_what_is_shown_changes_at_a_start_an_end_and_at_most_every_ten_seconds_between(
    parts: tuple[TransferReporter, TransferWatch, MonotonicClock],
) -> None:
    writer, watch, clock = parts
    writer.start("image", IMAGE)
    changes = [watch.poll()]
    for _second in range(21):
        clock.now += 1.0
        writer.advance(IMAGE, int(clock.now), None)
        changes.append(watch.poll())
    # At the start, then 10 s and 20 s later: the observation a long pull costs is one per 10 s.
    assert [index for index, changed in enumerate(changes) if changed] == [0, 10, 20]
    assert watch.transfers[0]["bytes_done"] == 70 and watch.transfers[0]["kind"] == "image"


def test_clear_ends_what_the_apply_left_in_flight(
    parts: tuple[TransferReporter, TransferWatch, MonotonicClock], caplog: pytest.LogCaptureFixture
) -> None:
    writer, watch, _clock = parts
    writer.start("artifact", "tiny 1.0: model.gguf", 10)
    watch.poll()
    with caplog.at_level(logging.INFO, logger="meridian_node_agent"):
        watch.clear()
    assert [name for name, _fields in events(caplog)] == ["transfer-ended"]
    assert watch.transfers == []


def test_a_damaged_file_is_logged_once_and_reads_as_nothing_in_flight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / TRANSFERS_FILE
    path.write_text('{"format": 1, "transfers": "everything"}')
    watch = TransferWatch(path, EventLogger(), MonotonicClock(50.0))
    with caplog.at_level(logging.INFO, logger="meridian_node_agent"):
        watch.poll()
        watch.poll()
    logged = events(caplog)
    assert [name for name, _fields in logged] == ["transfer-progress-unreadable"]
    assert "must be a list" in logged[0][1]["reason"] and watch.transfers == []

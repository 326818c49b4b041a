"""The supervision record on its own (``agent_side/supervision_record.py``): what one run of the agent writes,
the next reads back; a damaged, foreign or oversized record is ignored with a reason and never crashes the
agent; a record of another boot keeps its counts and drops its times; nothing is written unless it changed.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.recorded_events import SeenEvents
from meridian_node_agent.agent_side.supervise import EngineTrack, Supervisor
from meridian_node_agent.agent_side.supervision_record import (
    MAX_RECORD_BYTES,
    RECORD_FILE,
    RECORD_FORMAT,
    RememberedRetry,
    RememberedState,
    SupervisionRecord,
)

BOOT = "0f4b5a0e-8c1d-4f7e-9a51-3c2d1e0f9b8a"
OTHER_BOOT = "7d3e2c1b-0a9f-4e8d-b7c6-5a4b3c2d1e0f"
SHA = "ab" * 32
FAILED_AT = datetime(2025, 3, 1, 12, 0, 5, 250000, tzinfo=UTC)


def _record(tmp_path: Path, *, boot: str | None = BOOT, log: SeenEvents | None = None) -> SupervisionRecord:
    return SupervisionRecord(tmp_path, log=log or SeenEvents(), boot_id=lambda: boot)


def _tracks() -> dict[str, EngineTrack]:
    return {
        "chat": EngineTrack(
            name="chat",
            expected_since=100.0,
            seen_ready=True,
            ready_since=None,
            problem="not running (exited)",
            bad_since=150.5,
            repairs=3,
            retry_at=230.25,
        ),
        "embed": EngineTrack(name="embed", expected_since=100.0, seen_ready=True, ready_since=101.0),
    }


def _retry() -> RememberedRetry:
    return RememberedRetry(
        generation=8,
        payload_sha256="cd" * 32,
        failures=2,
        retry_at=260.0,
        backoff_s=20.0,
        failed_at=FAILED_AT,
        error="engine 'chat' never became ready: exit 1",
        etag='"8-cdcdcdcd"',
    )


def _written(tmp_path: Path) -> dict[str, Any]:
    """A valid record document, as one run writes it (for the damage tests to start from)."""
    _record(tmp_path).save(RememberedState(7, SHA, _tracks()), _retry())
    document: dict[str, Any] = json.loads((tmp_path / RECORD_FILE).read_text())
    return document


def test_what_one_run_writes_the_next_reads_back_whole(tmp_path: Path) -> None:
    first = _record(tmp_path)
    assert first.load(now=90.0) is None  # a first start: nothing to remember, and nothing said about it

    assert first.save(RememberedState(7, SHA, _tracks()), _retry()) is True

    restarted = _record(tmp_path).load(now=240.0)
    assert restarted is not None and restarted.same_clock
    assert restarted.supervised == RememberedState(7, SHA, _tracks())
    assert restarted.apply_retry == _retry()
    path = tmp_path / RECORD_FILE
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # the agent's own
    assert json.loads(path.read_text())["boot_id"] == BOOT


def test_a_record_is_written_only_when_what_it_holds_changed(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.load(now=90.0)
    tracks = _tracks()
    assert record.save(None, None) is False  # nothing to remember and no file: nothing to write
    assert not (tmp_path / RECORD_FILE).exists()

    assert record.save(RememberedState(7, SHA, tracks), None) is True
    inode = (tmp_path / RECORD_FILE).stat().st_ino
    for _ in range(100):  # idle cycles
        assert record.save(RememberedState(7, SHA, tracks), None) is False
    tracks["embed"].ready_since = 300.0  # a change: written once
    assert record.save(RememberedState(7, SHA, tracks), None) is True

    assert record.writes == 2
    assert (tmp_path / RECORD_FILE).stat().st_ino != inode
    # A restarted agent that finds what it would write already there writes nothing either.
    restarted = _record(tmp_path)
    assert restarted.load(now=400.0) is not None
    assert restarted.save(RememberedState(7, SHA, tracks), None) is False
    assert restarted.writes == 0


def _damage(kind: str, tmp_path: Path) -> None:
    path = tmp_path / RECORD_FILE
    document = _written(tmp_path)
    if kind == "symlink":
        target = tmp_path / "elsewhere.json"
        path.rename(target)
        path.symlink_to(target)
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif kind == "oversized":
        path.write_text(_dump({**document, "padding": "x" * MAX_RECORD_BYTES}))
    else:
        data = DAMAGED[kind](document)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())


def _dump(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"))


DAMAGED: dict[str, Any] = {
    "truncated": lambda d: _dump(d)[:-20],
    "not-utf8": lambda d: b"\xff\xfe" + _dump(d).encode(),
    "nan": lambda d: _dump(d).replace('"retry_at":230.25', '"retry_at":NaN'),
    "duplicate-key": lambda d: _dump(d).replace('"version":1', '"version":1,"version":1'),
    "an-array": lambda d: "[]",
    "another-format": lambda d: _dump({**d, "format": "meridian.node/status"}),
    "another-version": lambda d: _dump({**d, "version": 2}),
    "negative-count": lambda d: _dump(d).replace('"repairs":3', '"repairs":-3'),
    "time-as-text": lambda d: _dump(d).replace('"bad_since":150.5', '"bad_since":"150.5"'),
    "unknown-field": lambda d: _dump({**d, "hint": "trust me"}),
    "bad-digest": lambda d: _dump(d).replace(SHA, "not-a-digest"),
    "local-time": lambda d: _dump(d).replace("12:00:05.250000Z", "12:00:05.250000+02:00"),
    "etag-with-a-newline": lambda d: _dump(d).replace("8-cdcdcdcd", "8\\r\\nX-Injected: 1"),
}
REASONS = {
    "symlink": "symlink",
    "directory": "not-regular",
    "fifo": "not-regular",
    "oversized": "too-large",
    "truncated": "not-json",
    "not-utf8": "not-json",
    "nan": "not-json",
    "duplicate-key": "not-json",
    "an-array": "foreign-format",
    "another-format": "foreign-format",
    "another-version": "other-version",
    "negative-count": "malformed",
    "time-as-text": "malformed",
    "unknown-field": "malformed",
    "bad-digest": "malformed",
    "local-time": "malformed",
    "etag-with-a-newline": "malformed",  # it goes back to the control plane as a header: never a forged one
}


@pytest.mark.parametrize("kind", list(REASONS))
def test_a_damaged_foreign_or_oversized_record_is_ignored_with_its_reason_and_replaced(
    tmp_path: Path, kind: str
) -> None:
    _damage(kind, tmp_path)
    log = SeenEvents()
    record = _record(tmp_path, log=log)

    assert record.load(now=240.0) is None  # the counts start over; nothing raised

    [ignored] = log.named("supervision-record-ignored")
    assert ignored["reason"] == REASONS[kind], ignored
    assert ignored["path"] == str(tmp_path / RECORD_FILE)
    assert "counts start over" in ignored["fix"]
    saved = record.save(RememberedState(7, SHA, _tracks()), None)
    if kind == "directory":
        # Nothing can replace a directory by rename: said once, never raised, and the agent goes on.
        assert saved is False
        assert len(log.named("supervision-record-not-written")) == 1
        assert record.save(RememberedState(7, SHA, _tracks()), None) is False
        assert len(log.named("supervision-record-not-written")) == 1
        return
    assert saved is True  # the bad record is replaced by the next save, even one with nothing new in it
    assert (tmp_path / RECORD_FILE).is_file() and not (tmp_path / RECORD_FILE).is_symlink()
    again = _record(tmp_path).load(now=240.0)
    assert again is not None and again.supervised == RememberedState(7, SHA, _tracks())


def test_the_ignored_line_names_what_was_wrong_with_the_value(tmp_path: Path) -> None:
    _damage("negative-count", tmp_path)
    log = SeenEvents()

    _record(tmp_path, log=log).load(now=240.0)

    [ignored] = log.named("supervision-record-ignored")
    assert "supervised.engines.chat.repairs" in ignored["detail"] and "-3" in ignored["detail"], ignored


@pytest.mark.parametrize(
    ("boot", "now", "why"),
    [
        (OTHER_BOOT, 240.0, "it was written in another boot"),
        (None, 240.0, "this boot's id cannot be read"),
        (BOOT, 120.0, "its times lie ahead of this clock"),  # bad_since 150.5 was never in this clock's past
    ],
    ids=["another-boot", "no-boot-id", "times-ahead"],
)
def test_a_record_of_another_clock_keeps_its_counts_but_not_its_times(
    tmp_path: Path, boot: str | None, now: float, why: str
) -> None:
    _written(tmp_path)
    log = SeenEvents()

    remembered = _record(tmp_path, boot=boot, log=log).load(now=now)

    assert remembered is not None and not remembered.same_clock
    assert [fields["reason"] for fields in log.named("supervision-record-rebased")] == [why]
    supervisor = Supervisor(settle_s=10, clock=lambda: now)
    supervisor.expect(7, ["chat", "embed"])
    assert remembered.supervised is not None
    assert supervisor.resume(7, remembered.supervised.tracks, same_clock=False) == ["chat", "embed"]
    chat = supervisor.tracks["chat"]
    # The count survives; the grace starts over from now, and readiness must be seen again.
    assert (chat.repairs, chat.bad_since, chat.problem, chat.seen_ready, chat.retry_at) == (3, None, None, False, 0.0)
    assert chat.expected_since == now
    assert remembered.apply_retry is not None and remembered.apply_retry.failures == 2


def test_a_record_of_this_clock_is_taken_as_it_was_its_backoff_cut_to_the_settings_now(tmp_path: Path) -> None:
    _written(tmp_path)
    remembered = _record(tmp_path).load(now=160.0)
    assert remembered is not None and remembered.same_clock and remembered.supervised is not None
    supervisor = Supervisor(settle_s=10, backoff_initial_s=2, backoff_max_s=8, clock=lambda: 160.0)
    supervisor.expect(7, ["chat", "embed", "new"])

    taken = supervisor.resume(7, remembered.supervised.tracks, same_clock=True)

    assert taken == ["chat", "embed"]  # "new" was not in the record: it starts as expect() left it
    chat = supervisor.tracks["chat"]
    assert (chat.repairs, chat.bad_since, chat.seen_ready) == (3, 150.5, True)
    assert chat.retry_at == 160.0 + 8  # 230.25 was the old, longer backoff; the settings now allow 8 s
    assert supervisor.tracks["embed"].ready_since == 101.0
    assert supervisor.resume(8, remembered.supervised.tracks, same_clock=True) == []  # another generation


def test_a_record_too_large_to_write_is_removed_so_no_stale_one_outlives_it(tmp_path: Path) -> None:
    _written(tmp_path)
    log = SeenEvents()
    record = _record(tmp_path, log=log)
    record.load(now=240.0)
    problem = "changed by hand: " + "x" * 1000
    many = {
        f"engine-{n}": EngineTrack(name=f"engine-{n}", expected_since=1.0, problem=problem, bad_since=2.0)
        for n in range(300)
    }

    assert record.save(RememberedState(7, SHA, many), None) is False

    assert not (tmp_path / RECORD_FILE).exists()
    [too_large] = log.named("supervision-record-too-large")
    assert too_large["bytes"] > MAX_RECORD_BYTES == too_large["limit"]
    assert record.save(RememberedState(7, SHA, many), None) is False  # not retried, not logged, every cycle
    assert len(log.named("supervision-record-too-large")) == 1


def test_a_record_that_cannot_be_written_is_logged_once_and_never_raises(tmp_path: Path) -> None:
    log = SeenEvents()
    record = SupervisionRecord(tmp_path / "gone", log=log, boot_id=lambda: BOOT)

    for _ in range(3):
        assert record.save(RememberedState(7, SHA, _tracks()), None) is False

    [failed] = log.named("supervision-record-not-written")
    assert "No such file or directory" in failed["error"] and "writable" in failed["fix"]
    (tmp_path / "gone").mkdir()
    assert record.save(RememberedState(7, SHA, _tracks()), None) is True  # retried until it could be written


def test_the_record_names_its_format_version_clock_and_boot(tmp_path: Path) -> None:
    document = _written(tmp_path)

    assert {key: document[key] for key in ("format", "version", "clock", "boot_id")} == {
        "format": RECORD_FORMAT,
        "version": 1,
        "clock": "monotonic",
        "boot_id": BOOT,
    }
    assert document["supervised"]["engines"]["chat"]["repairs"] == 3
    assert document["apply_retry"]["failed_at"] == "2025-03-01T12:00:05.250000Z"

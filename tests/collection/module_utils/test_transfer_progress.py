"""The transfers file: what a module's pulls and downloads write for the agent, paced, and what the agent accepts.

The writer is driven with an injected clock (no waiting); the reader is handed each malformed file a careless or
hostile writer could leave, and must name the problem.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import (
    MAX_FILE_BYTES,
    MAX_TRANSFERS,
    TRANSFERS_FILE,
    Transfer,
    TransferFileError,
    TransferReporter,
    read_transfers,
)
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock

IMAGE = "127.0.0.1:5000/team/vllm@sha256:" + "a" * 64
WALL = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)


def reporter(directory: Path, clock: MonotonicClock) -> TransferReporter:
    directory.mkdir(mode=0o750, exist_ok=True)
    directory.chmod(0o750)
    return TransferReporter(str(directory / TRANSFERS_FILE), clock=clock, wall=lambda: WALL)


def on_disk(directory: Path) -> list[tuple[str, int, int | None]]:
    return [(t.name, t.bytes_done, t.bytes_total) for t in read_transfers(str(directory / TRANSFERS_FILE))]


def test_a_start_is_written_at_once_progress_at_most_once_a_second_and_an_end_at_once(tmp_path: Path) -> None:
    clock = MonotonicClock(100.0)
    progress = reporter(tmp_path / "public", clock)
    progress.start("image", IMAGE)
    assert on_disk(tmp_path / "public") == [(IMAGE, 0, None)]
    clock.now += 0.4
    progress.advance(IMAGE, 10, None)
    assert on_disk(tmp_path / "public") == [(IMAGE, 0, None)]  # held back: the last write is 0.4 s old
    clock.now += 0.7
    progress.advance(IMAGE, 10, None)  # the same figures again, once the second is up: the held-back change goes
    assert on_disk(tmp_path / "public") == [(IMAGE, 10, None)]
    clock.now += 1.0
    progress.advance(IMAGE, 50, 200)
    assert on_disk(tmp_path / "public") == [(IMAGE, 50, 200)]
    progress.end(IMAGE)
    assert on_disk(tmp_path / "public") == []
    assert progress.problem is None


def test_the_file_is_0640_with_the_directorys_group_and_a_planted_symlink_is_replaced_not_followed(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "public"
    directory.mkdir(mode=0o750)
    os.chown(directory, -1, 4242)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (directory / TRANSFERS_FILE).symlink_to(victim)
    progress = TransferReporter(str(directory / TRANSFERS_FILE), clock=MonotonicClock(100.0), wall=lambda: WALL)
    progress.start("artifact", "tiny 1.0: model.gguf", 4096)
    info = (directory / TRANSFERS_FILE).lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o640 and info.st_gid == 4242
    assert victim.read_text() == "keep"
    document = json.loads((directory / TRANSFERS_FILE).read_text())
    assert document["transfers"] == [
        {
            "kind": "artifact",
            "name": "tiny 1.0: model.gguf",
            "bytes_done": 0,
            "bytes_total": 4096,
            "started_at": "2026-12-05T10:00:00Z",
            "updated_at": "2026-12-05T10:00:00Z",
        }
    ]


def _someone_elses(directory: Path) -> None:
    directory.mkdir()
    os.chown(directory, 65534, -1)


@pytest.mark.parametrize(
    ("prepare", "reason"),
    [
        (lambda d: d.mkdir(mode=0o777) or d.chmod(0o777), "has mode 0777"),
        (lambda d: d.mkdir(mode=0o770) or d.chmod(0o770), "has mode 0770"),
        (lambda d: (d.parent / "real").mkdir() or d.symlink_to(d.parent / "real"), "not a directory"),
        (lambda d: _someone_elses(d), "owned by uid 65534"),
        (lambda d: None, "cannot use"),
    ],
    ids=["world-writable", "group-writable", "symlink", "someone-elses", "missing"],
)
def test_a_directory_others_could_write_in_gets_no_progress_and_says_why(
    tmp_path: Path, prepare: Any, reason: str
) -> None:
    directory = tmp_path / "public"
    prepare(directory)
    progress = TransferReporter(str(directory / TRANSFERS_FILE), clock=MonotonicClock(100.0), wall=lambda: WALL)
    progress.start("image", IMAGE)
    progress.advance(IMAGE, 5)
    progress.end_all()
    assert progress.problem is not None and reason in progress.problem, progress.problem
    assert not os.path.lexists(directory / TRANSFERS_FILE)
    assert not (tmp_path / "real" / TRANSFERS_FILE).exists()


def test_without_a_path_nothing_is_written_and_nothing_is_wrong(tmp_path: Path) -> None:
    progress = TransferReporter(None, clock=MonotonicClock(100.0))
    progress.start("image", IMAGE)
    progress.advance(IMAGE, 5)
    progress.end(IMAGE)
    assert progress.problem is None and list(tmp_path.iterdir()) == []


def test_end_all_ends_what_a_failed_run_left_in_flight(tmp_path: Path) -> None:
    progress = reporter(tmp_path / "public", MonotonicClock(100.0))
    progress.start("artifact", "a 1: x")
    progress.start("artifact", "a 1: y")
    assert len(on_disk(tmp_path / "public")) == 2
    progress.end_all()
    assert on_disk(tmp_path / "public") == []


def test_no_file_reads_as_nothing_in_flight(tmp_path: Path) -> None:
    assert read_transfers(str(tmp_path / TRANSFERS_FILE)) == []


def _entry(**changes: Any) -> dict[str, Any]:
    entry = {
        "kind": "image",
        "name": IMAGE,
        "bytes_done": 1,
        "bytes_total": None,
        "started_at": "2026-12-05T10:00:00Z",
        "updated_at": "2026-12-05T10:00:01Z",
    }
    entry.update(changes)
    return entry


def _file(transfers: Any, **top: Any) -> bytes:
    return json.dumps({"format": 1, "written_at": "2026-12-05T10:00:01Z", "transfers": transfers, **top}).encode()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{not json", "is not JSON"),
        (b"[]", "not a format 1"),
        (_file([], format=2), "not a format 1"),
        (_file({"a": 1}), "must be a list"),
        (_file([_entry()] * (MAX_TRANSFERS + 1)), "at most 32"),
        (_file([_entry(extra=1)]), "exactly the fields"),
        (_file([{"kind": "image"}]), "exactly the fields"),
        (_file([_entry(kind="model")]), "kind 'model' is not one of image, artifact"),
        (_file([_entry(name="")]), "name must be a string"),
        (_file([_entry(name="x" * 513)]), "name must be a string"),
        (_file([_entry(bytes_done=-1)]), "whole numbers"),
        (_file([_entry(bytes_done=True)]), "whole numbers"),
        (_file([_entry(bytes_done=1.5)]), "whole numbers"),
        (_file([_entry(bytes_total="10")]), "whole numbers"),
        (_file([_entry(started_at="yesterday")]), "started_at must be an RFC 3339"),
        (_file([_entry(updated_at="2026-12-05T10:00:01+01:00")]), "updated_at must be an RFC 3339"),
        (b" " * (MAX_FILE_BYTES + 1), f"larger than {MAX_FILE_BYTES} bytes"),
    ],
    ids=[
        "not-json",
        "not-an-object",
        "format-2",
        "transfers-not-a-list",
        "too-many",
        "unknown-field",
        "missing-fields",
        "bad-kind",
        "empty-name",
        "long-name",
        "negative",
        "bool",
        "float",
        "string-total",
        "bad-start",
        "offset-time",
        "too-large",
    ],
)
def test_a_malformed_file_is_refused_naming_the_problem(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / TRANSFERS_FILE
    path.write_bytes(content)
    with pytest.raises(TransferFileError) as caught:
        read_transfers(str(path))
    assert reason in str(caught.value) and str(path) in str(caught.value), str(caught.value)


def test_a_symlink_at_the_name_is_refused_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.json"
    real.write_bytes(_file([_entry()]))
    (tmp_path / TRANSFERS_FILE).symlink_to(real)
    with pytest.raises(TransferFileError, match="symlink"):
        read_transfers(str(tmp_path / TRANSFERS_FILE))


def test_what_the_writer_writes_the_reader_reads_back(tmp_path: Path) -> None:
    progress = reporter(tmp_path / "public", MonotonicClock(100.0))
    progress.start("image", IMAGE, None)
    assert read_transfers(str(tmp_path / "public" / TRANSFERS_FILE)) == [
        Transfer("image", IMAGE, 0, None, "2026-12-05T10:00:00Z", "2026-12-05T10:00:00Z")
    ]

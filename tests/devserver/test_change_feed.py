"""The SQLite change log and the lease table's failure path, in-process: what a reader takes, and when it must
re-read every node instead (a line it cannot read, a log truncated under it)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import cast

import pytest

from meridian_node_agent.devserver.serving.lease_table import LeaseTable
from meridian_node_agent.devserver.store.change_feed import ChangeKind, SqliteChangeLog, StateChange, decode_change
from meridian_node_agent.devserver.store.database import Database

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _log(tmp_path: Path, max_bytes: int = 1 << 20) -> tuple[SqliteChangeLog, SqliteChangeLog]:
    """A writer (the CLI) and a reader (a server) of one change log."""
    path = tmp_path / "db.sqlite3-changes"
    reader = SqliteChangeLog(path, max_bytes=max_bytes)
    reader.listen()
    return SqliteChangeLog(path, max_bytes=max_bytes), reader


def test_a_reader_takes_each_announcement_once_even_from_a_log_made_after_it_listened(tmp_path: Path) -> None:
    writer, reader = _log(tmp_path)
    assert not reader.behind() and reader.take() == []

    writer.announce(StateChange(ChangeKind.PUBLISHED, "gpu-a"))
    writer.announce(StateChange(ChangeKind.REVOKED, "gpu-b"))

    assert reader.behind()
    assert reader.take() == [StateChange(ChangeKind.PUBLISHED, "gpu-a"), StateChange(ChangeKind.REVOKED, "gpu-b")]
    assert not reader.behind() and reader.take() == []


def test_half_a_line_waits_for_the_rest(tmp_path: Path) -> None:
    writer, reader = _log(tmp_path)
    with writer.path.open("ab") as log:
        log.write(b"fenced gp")
    assert reader.take() == []
    with writer.path.open("ab") as log:
        log.write(b"u-a\n")
    assert reader.take() == [StateChange(ChangeKind.FENCED, "gpu-a")]


def test_a_line_that_is_not_an_announcement_means_re_read_every_node(tmp_path: Path) -> None:
    writer, reader = _log(tmp_path)
    with writer.path.open("ab") as log:
        log.write(b"renamed gpu-a\n")
    assert reader.take() is None
    assert decode_change("published") is None and decode_change("published a b") is None


def test_a_log_truncated_under_its_reader_means_re_read_every_node(tmp_path: Path) -> None:
    writer, reader = _log(tmp_path, max_bytes=64)
    writer.announce(StateChange(ChangeKind.ENROLLED, "gpu-a"))
    assert reader.take() == [StateChange(ChangeKind.ENROLLED, "gpu-a")]
    for index in range(4):  # the fourth crosses 64 bytes: the writer truncates the log
        writer.announce(StateChange(ChangeKind.PUBLISHED, f"gpu-{index}"))

    assert reader.take() is None  # shorter than what was read: lines were lost
    writer.announce(StateChange(ChangeKind.FENCED, "gpu-z"))
    assert reader.take() == [StateChange(ChangeKind.FENCED, "gpu-z")]


class _DownStore:
    """A database that refuses every write, as one that is unreachable does."""

    def __init__(self) -> None:
        self.batches: list[dict[str, tuple[datetime, datetime]]] = []
        self.down = True

    def renew_leases(self, renewals: dict[str, tuple[datetime, datetime]]) -> None:
        if self.down:
            raise ConnectionError("the database does not answer")
        self.batches.append(dict(renewals))


def test_a_failed_lease_flush_keeps_the_renewals_and_the_newest_per_node_wins(tmp_path: Path) -> None:
    store = _DownStore()
    leases = LeaseTable(cast(Database, store))
    lease = timedelta(seconds=30)
    leases.renew("gpu-a", 1, NOW, lease)
    leases.renew("gpu-b", 1, NOW, lease)
    with pytest.raises(ConnectionError):
        leases.flush()
    leases.renew("gpu-a", 1, NOW + timedelta(seconds=15), lease)  # answered from memory meanwhile

    store.down = False
    assert leases.flush() == 2
    assert store.batches == [
        {"gpu-a": (NOW + timedelta(seconds=15), NOW + timedelta(seconds=45)), "gpu-b": (NOW, NOW + lease)}
    ]
    assert leases.pending == 0

"""The image pulls and artifact downloads of the apply in flight, as the playbook's modules say, paced for people.

Runs on: the agent side. The modules write ``transfers.json`` (``_transfer_progress``: at most once a second)
where the agent can read it: its own state directory in process, root's ``public/`` under the split (the apply
unit passes the path, ``meridian_progress_file``). While an apply runs the cycle polls it each ``APPLY_REPORT_S``
(``cycle.Agent._reporting_while_applying``); this keeps what is shown to the pace people and a control plane want:

- the log says ``transfer-started`` and ``transfer-ended`` once each, and ``transfer-progress`` (bytes, total,
  percent, rate) for each transfer at most every ``PROGRESS_EVERY_S`` seconds: a 100 GB download is a line
  every 10 s, not one per chunk or per second;
- ``transfers`` (what the observation and ``status.json`` carry) changes when a transfer starts or ends and at
  most every ``PROGRESS_EVERY_S`` seconds between: a long pull costs the control plane one observation per 10 s.

A file that cannot be read (damaged, a symlink planted in the agent's own directory) is logged once per distinct
reason and reads as nothing in flight: progress is a courtesy, the apply's own result is the truth.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import (
    TRANSFERS_FILE,
    Transfer,
    TransferFileError,
    read_transfers,
)
from meridian_node_agent.boundary.spool import PUBLIC_DIR
from meridian_node_agent.config import AgentConfig
from meridian_node_agent.logs import EventLogger

__all__ = ["PROGRESS_EVERY_S", "TransferWatch", "transfers_path"]

PROGRESS_EVERY_S = 10.0


def transfers_path(config: AgentConfig) -> Path:
    """Where the playbook's modules write their progress: root's ``public/`` under the split, else the state dir."""
    if config.apply.via == "systemd":
        return Path(config.apply.state_dir) / PUBLIC_DIR / TRANSFERS_FILE
    return Path(config.state_dir) / TRANSFERS_FILE


class TransferWatch:
    """Polls the transfers file; logs and keeps ``transfers`` at a pace for people (see the module docstring)."""

    def __init__(self, path: Path, log: EventLogger, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._log = log
        self._monotonic = monotonic
        self._seen: dict[str, tuple[Transfer, float]] = {}  # name -> (last read, when first seen)
        self._logged_at: dict[str, float] = {}
        self._shown_at: float | None = None
        self._problem: str | None = None
        self.transfers: list[dict[str, Any]] = []

    def poll(self) -> bool:
        """Read the file once; True when ``transfers`` changed (the status and observation should follow)."""
        try:
            found = {transfer.name: transfer for transfer in read_transfers(str(self.path))}
        except TransferFileError as exc:
            if str(exc) != self._problem:
                self._problem = str(exc)
                self._log.warning("transfer-progress-unreadable", path=str(self.path), reason=str(exc))
            found = {}
        now = self._monotonic()
        started = [name for name in found if name not in self._seen]
        ended = [name for name in self._seen if name not in found]
        for name in ended:
            self._end(name, now)
        for name in started:
            transfer = found[name]
            self._seen[name] = (transfer, now)
            self._logged_at[name] = now
            self._log.info(
                "transfer-started",
                kind=transfer.kind,
                name=name,
                bytes_done=transfer.bytes_done,
                bytes_total=transfer.bytes_total,
            )
        for name, transfer in found.items():
            if name in started:
                continue
            self._seen[name] = (transfer, self._seen[name][1])
            if now - self._logged_at[name] >= PROGRESS_EVERY_S:
                self._logged_at[name] = now
                self._log.info("transfer-progress", **self._progress_fields(name, now))
        due = self._shown_at is None or now - self._shown_at >= PROGRESS_EVERY_S
        if not (started or ended or due):
            return False
        shown = [transfer.as_dict() for transfer, _first in self._seen.values()]
        self._shown_at = now
        if shown == self.transfers:
            return False
        self.transfers = shown
        return True

    def clear(self) -> None:
        """The apply is over: whatever it was still moving ended with it."""
        now = self._monotonic()
        for name in list(self._seen):
            self._end(name, now)
        self.transfers = []
        self._shown_at = None

    def _end(self, name: str, now: float) -> None:
        fields = self._progress_fields(name, now)
        del self._seen[name]
        self._logged_at.pop(name, None)
        self._log.info("transfer-ended", **fields)

    def _progress_fields(self, name: str, now: float) -> dict[str, Any]:
        transfer, first = self._seen[name]
        seconds = now - first
        total = transfer.bytes_total
        return {
            "kind": transfer.kind,
            "name": name,
            "bytes_done": transfer.bytes_done,
            "bytes_total": total,
            "percent": round(100 * transfer.bytes_done / total, 1) if total else None,
            "seconds": round(seconds, 1),
            # Over the whole transfer as the agent saw it: what a person compares against the link's speed.
            "bytes_per_second": round(transfer.bytes_done / seconds) if seconds > 0 else None,
        }

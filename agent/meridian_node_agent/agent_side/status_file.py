"""The agent's status document, ``<state_dir>/status.json``: what ``meridian-node status`` shows of a running agent.

Runs on: the agent side (``meridian-node run`` writes it each cycle); ``status`` and ``gpu-health`` read it as the
agent's user or as root, through ``boundary.agent_files`` (no-follow, capped), and a restarted agent takes its
counters back from it (``agent_side.counters``).

Small, rewritten when something in it changed, or ``STATUS_REFRESH_S`` after the last write so that ``updated_at``
still shows a live agent; not fsync'd (the next cycle writes it again). Written to a temporary file beside it and
renamed over it: a reader never sees half a document. The metrics endpoint's gauges are the same document
(``agent_side.metrics``), handed over whole by the cycle.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState
from meridian_node_agent.agent_side.counters import Counters
from meridian_node_agent.agent_side.reporter import Reporter, run_summary
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.boundary.agent_files import STATUS_FILE
from meridian_node_agent.config import AgentConfig

__all__ = ["STATUS_REFRESH_S", "StatusWriter", "read_status", "status_document", "supervision_status"]

STATUS_REFRESH_S = 60.0


def status_document(
    config: AgentConfig,
    *,
    now: datetime,
    lease: Lease | None,
    applied: AppliedState,
    last_run: ApplyResult | None,
    last_applied_at: datetime | None,
    counters: Counters,
    seen: Reporter,
    supervision: dict[str, dict[str, Any]],
    apply_retry: dict[str, Any] | None,
    certificate: dict[str, Any],
    refused: dict[str, Any] | None,
    transfers: list[dict[str, Any]],
) -> dict[str, Any]:
    """The document, its keys in the order status.json has always had them; ``seen``: what the last report said."""
    return {
        "node_id": config.node_id,
        "mode": config.mode,
        "updated_at": format_rfc3339(now),
        "lease_epoch": lease.epoch if lease else None,
        "lease_expires_at": format_rfc3339(lease.expires_at) if lease else None,
        "applied_generation": applied.generation,
        "applied_epoch": applied.epoch,
        "last_run": run_summary(last_run),
        # Kept with the counters across restarts: a failed apply never moves it.
        "last_applied_at": format_rfc3339(last_applied_at) if last_applied_at else None,
        "counters": asdict(counters),
        "engines": seen.engines,
        "supervision": supervision,
        "apply_retry": apply_retry,
        "certificate": certificate,
        # Mode kubernetes-integrated: what the kubelet said at the last report, and the state last refused.
        "kubernetes": seen.kubernetes,
        "refused_state": refused,
        # Each GPU's verdict at the last report, and the cordons then in force.
        "gpus": seen.gpus,
        "cordons": seen.cordons,
        # The image pulls and artifact downloads of the apply in flight (``transfer_watch``); [] between applies.
        "transfers": transfers,
    }


def supervision_status(report: dict[str, dict[str, Any]], now: datetime) -> dict[str, dict[str, Any]]:
    """Supervision's report with the next repair as a wall-clock time too: status.json is read later, by
    another process, when "in 40 s" no longer says when."""
    for entry in report.values():
        left_s = entry.get("next_repair_in_seconds")
        entry["next_repair_at"] = None if not left_s else format_rfc3339(now + timedelta(seconds=left_s))
    return report


class StatusWriter:
    """Writes ``<state_dir>/status.json`` when what it says changed, or ``STATUS_REFRESH_S`` after the last write."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / STATUS_FILE
        # The document last written less what changes every cycle, and when it was written (monotonic).
        self._written: tuple[dict[str, Any], float] | None = None

    def write(self, document: dict[str, Any], now: float) -> None:
        """Write ``document``, unless it only differs from the last one written by its time and its cycle count and
        that was less than ``STATUS_REFRESH_S`` ago (``now`` on the monotonic clock): an unchanged cycle would
        otherwise cost a file write."""
        counters = document["counters"]
        assert isinstance(counters, dict)
        unchanged = {**document, "updated_at": None, "counters": {**counters, "cycles": None}}
        last = self._written
        if last is not None and last[0] == unchanged and now - last[1] < STATUS_REFRESH_S:
            return
        temp = self.path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
        temp.write_text(json.dumps(document, separators=(",", ":")) + "\n")
        temp.replace(self.path)
        self._written = (unchanged, now)


def read_status(state_dir: Path) -> dict[str, Any] | None:
    """The status document the agent last wrote in ``state_dir``; None when there is none, or not a JSON object."""
    try:
        document: Any = json.loads((Path(state_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None

"""Root holds the GPUs the agent reports unhealthy by XID: the relay that closes the split's XID gap.

Runs on: the root side only.

Why: NVML delivers an XID only to an event set registered before it happened, and each of root's units is a fresh
process, so under the privilege split an XID (79 off the bus, 74 NVLink, 119 GSP, ...) reaches the agent's
``XidWatch`` alone. The agent relays the GPUs its watch holds unhealthy by a critical XID in its apply request
(``boundary.spool.GpuReport``); the apply unit calls :func:`relay_gpu_reports` after it verified the request's
envelope and before the playbook runs, so the playbook's placement refuses those GPUs.

The report is the agent's word, and the agent is assumed compromised (docs/SECURITY.md), so root only ever adds:

- a reported GPU is held unhealthy (``HealthHolds.add_reasons``): one ``xid-critical`` reason per XID, its source
  naming the relay; a GPU already held keeps its verdict, ``since`` and counters and gains the XIDs it lacks. No
  report clears, releases or weakens a hold: that stays an operator's (``meridian-node gpu-health clear``) or a
  reset root's own read shows (``root_side.observe_unit``);
- only critical XIDs count, as the rules class them (``health_rules``): an application or warning XID never makes
  a GPU unhealthy, whoever reports it;
- when root can read NVML, a uuid this host's NVML does not list is ignored, so a forged uuid cannot grow the file;
  the new hold starts from root's own read of that GPU (its counters: a later reset releases it). When it cannot,
  the report is taken, but no GPU is added once the file holds ``MAX_GPU_REPORTS``, and no hold gains an XID past
  ``MAX_HELD_REASONS`` reasons: the file stays bounded, request after request;
- reports are merged by uuid (their XIDs together, the earliest ``seen_at``), and a ``seen_at`` after root's clock
  counts from now.

So the most a forged report does is keep real GPUs of this host out of placement, which a compromised agent can
already do by never asking for an apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHoldError, HealthHolds
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import APPLICATION_XIDS, WARNING_XIDS
from meridian_node_agent.boundary.spool import MAX_GPU_REPORTS, GpuReport

__all__ = ["MAX_HELD_REASONS", "RELAY_SOURCE", "RelayedHolds", "record_gpu_reports", "relay_gpu_reports"]

# The reason's source: the call that saw the XID, and that it came to root through the agent's request.
RELAY_SOURCE = "nvmlEventSetWait, relayed by the agent"
# A hold gains no XID past this many reasons: request after request cannot grow the file towards its size cap
# (a hold file too large to read would stop placement and root's timer until an operator removed it).
MAX_HELD_REASONS = 32


@dataclass
class RelayedHolds:
    """What root did with one request's reports: each line for the unit's journal, and what went wrong."""

    held: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    problem: str | None = None

    def lines(self) -> list[str]:
        said = [f"GPU health: {line}" for line in self.held]
        if self.ignored:
            said.append(f"GPU health: ignored the agent's report of {'; '.join(self.ignored)}")
        return said


def relay_gpu_reports(
    state_dir: str | Path, reports: Sequence[GpuReport], *, now: datetime, nvml: Any = None
) -> RelayedHolds:
    """Hold the GPUs ``reports`` name in ``<state_dir>/gpu-health-holds.json``, after reading this host's GPUs
    once (NVML, read-only; ``nvml`` a pynvml module, the seam's by default). Nothing is read without a report."""
    if not reports:
        return RelayedHolds()
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

    holds = HealthHolds(state_dir)
    try:
        held = holds.all()
    except HealthHoldError as exc:
        return RelayedHolds(problem=f"the agent's GPU reports were not recorded: {exc}")
    facts = collect_gpu_facts(
        nvml,
        processes=False,
        nvlink=False,
        # Root's own read, judged as its observe timer judges it: for the counters a new hold starts from.
        previous={uuid: verdict.health for uuid, verdict in held.items()},
        now=now,
    )
    return record_gpu_reports(holds, reports, gpu_facts=facts if facts.get("nvml_available") else None, now=now)


def record_gpu_reports(
    holds: HealthHolds,
    reports: Sequence[GpuReport],
    *,
    gpu_facts: Mapping[str, Any] | None,
    now: datetime,
) -> RelayedHolds:
    """Hold each GPU ``reports`` name for its critical XIDs; ``gpu_facts`` is this host's GPUs as root read them
    (None: NVML could not be read, and no uuid can be checked). Only ever adds to ``holds``."""
    outcome = RelayedHolds()
    gpus = {str(gpu["uuid"]): gpu for gpu in (gpu_facts or {}).get("gpus") or [] if gpu.get("uuid")}
    for uuid, (xids, seen_at) in _merged(reports).items():
        critical = sorted(xid for xid in xids if xid not in APPLICATION_XIDS and xid not in WARNING_XIDS)
        gpu = gpus.get(uuid)
        if gpu_facts is not None and gpu is None:
            outcome.ignored.append(f"{uuid} (not a GPU of this host)")
            continue
        if not critical:
            outcome.ignored.append(f"{uuid} (XID {', '.join(map(str, sorted(xids)))}: none is critical)")
            continue
        health: Mapping[str, Any] = (gpu or {}).get("health") or {}
        readings = dict(health.get("readings") or {})
        readings["xid_events"] = []  # the reasons hold the XIDs; the window is the agent's
        try:
            changed = holds.add_reasons(
                uuid,
                [{"code": "xid-critical", "source": RELAY_SOURCE, "value": xid} for xid in critical],
                since=format_rfc3339(min(seen_at, now)),
                readings=readings,
                gpu=gpu,
                max_held=None if gpu_facts is not None else MAX_GPU_REPORTS,
                max_reasons=MAX_HELD_REASONS,
            )
        except HealthHoldError as exc:
            outcome.problem = f"the agent's GPU reports were not all recorded: {exc}"
            break
        if changed:
            where = f"GPU {gpu.get('index')} " if gpu is not None else "GPU "
            outcome.held.append(f"held {where}{uuid} for XID {', '.join(map(str, critical))} the agent reported")
    return outcome


def _merged(reports: Sequence[GpuReport]) -> dict[str, tuple[set[int], datetime]]:
    """The reports by uuid: their XIDs together and the earliest time the agent saw one."""
    merged: dict[str, tuple[set[int], datetime]] = {}
    for report in reports:
        xids, seen_at = merged.get(report.uuid, (set(), report.seen_at))
        merged[report.uuid] = (xids | set(report.xids), min(seen_at, report.seen_at))
    return merged

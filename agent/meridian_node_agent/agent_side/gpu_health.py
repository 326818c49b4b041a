"""The agent's GPU facts with their health, read statefully: what ``Observer.gpu`` reads every GPU refresh.

Runs on: the agent side (``meridian-node run``).

A verdict needs history that one read cannot have (docs/GPU_HEALTH.md): the XIDs since the last read, the
previous read's counters for the rising rules and the PCIe replay rate, and the verdict that holds until a reset
or an operator. So the agent keeps, for its whole life:

- one ``XidWatch`` (NVML's event set registered once: every XID between two reads is queued in it), closed by
  :meth:`GpuHealthWatch.close` when the agent stops;
- each GPU's last ``GpuHealth`` and when it was read, handed to ``collect_gpu_facts`` as ``previous`` and
  ``previous_at``.

**Held verdicts cross processes through root's hold file** (``gpu.health_hold``, ``<record_dir>/gpu-health-holds.json``,
where placement reads them). It is read at every refresh and seeds ``previous``, so a verdict held before the
agent started, or by root's own read, shows in the observations. Who writes it follows ``apply.via``: under the
privilege split it is root's (root's observe timer, ``root_side.observe_unit``, syncs it every 30 s) and the agent
only reads it; in-process the agent applies as the owner of that directory and syncs it itself after each read
(``writes_holds``). A missing file holds nothing; an unreadable or damaged one is logged once (per distinct error)
and the agent goes on from its own memory: observing never stops for it.

How a hold that went away is read: when the file held a GPU at the last refresh and no longer does, an operator
cleared it (``meridian-node gpu-health clear``) or root saw a reset, and the agent's own held verdict is dropped
with it (``HealthHolds.previous_for``). A GPU the agent finds unhealthy that the file does not hold keeps its
verdict in the agent's memory.

**XIDs are relayed to root** (:meth:`GpuHealthWatch.xid_reports`). Under the split root's timer reads no XID
events (a fresh process each run cannot keep an event set), so an XID is seen by this watch alone. Each apply
request the agent spools carries the GPUs this watch holds unhealthy by a critical XID (``boundary.spool.GpuReport``),
and root holds them before its playbook places anything (``root_side.gpu_reports``). A GPU whose hold the agent saw
and an operator has cleared since is not reported again, so a clear sticks; after the request was answered the
watch reads the file again (:meth:`GpuHealthWatch.note_holds`), so a hold root added is known as the agent's too.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import parse_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import (
    HealthHoldError,
    HealthHolds,
    HeldVerdict,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.xid_events import XidWatch
from meridian_node_agent.boundary.spool import GPU_UUID_PATTERN, MAX_GPU_REPORTS, MAX_REPORTED_XIDS, GpuReport
from meridian_node_agent.logs import EventLogger

__all__ = ["GpuHealthWatch", "verdict_summary"]

_GPU_UUID = re.compile(GPU_UUID_PATTERN)


def verdict_summary(gpu: Mapping[str, Any]) -> dict[str, Any]:
    """One GPU's verdict as status shows it: index, uuid, verdict, held, since, reason codes, cordoned."""
    health = gpu.get("health") or {}
    return {
        "index": gpu.get("index"),
        "uuid": gpu.get("uuid"),
        "verdict": health.get("verdict") if health else None,
        "held": bool(health.get("held")),
        "since": health.get("since"),
        "reasons": [_reason_text(reason) for reason in health.get("reasons") or []],
        "cordoned": bool(gpu.get("cordoned")),
    }


def _reason_text(reason: Mapping[str, Any]) -> str:
    value = reason.get("value")
    return str(reason.get("code")) if value is None else f"{reason.get('code')} {value}"


class GpuHealthWatch:
    """A callable giving ``contracts.GpuFacts`` as a dict, each GPU judged against its last read.

    ``holds_dir`` is where the hold file is (``AgentConfig.record_dir``; None: no hold file, as in tests and the
    benchmarks); ``writes_holds`` whether this process syncs it (``apply.via: in-process``). ``nvml`` a pynvml
    module (the seam's by default), ``nvlink`` whether NVLink peers are read (the observations carry them),
    ``clock`` the wall clock the verdicts and the XID window run on.
    """

    def __init__(
        self,
        holds_dir: str | Path | None = None,
        *,
        writes_holds: bool = False,
        nvml: Any = None,
        nvlink: bool = True,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        log: EventLogger | None = None,
    ) -> None:
        self.holds = None if holds_dir is None else HealthHolds(holds_dir)
        self.writes_holds = writes_holds and self.holds is not None
        self._nvml = nvml
        self._nvlink = nvlink
        self._clock = clock
        self._log = log or EventLogger()
        self._watch = XidWatch()
        self._last: dict[str, Mapping[str, Any]] = {}  # uuid -> the GpuHealth of the last read
        self._last_at: datetime | None = None
        self._seen_held: set[str] = set()  # the uuids the hold file held at the last refresh
        self._said: dict[str, tuple[Any, ...]] = {}  # uuid -> the verdict last logged
        self._problems: set[str] = set()  # hold-file problems already logged
        # A read runs in the observer's thread, which reports while an apply runs; the relay in the applier's.
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            return self._read()

    def _read(self) -> dict[str, Any]:
        now = self._clock()
        held = self._read_holds()
        facts = collect_gpu_facts(
            self._nvml,
            processes=False,
            nvlink=self._nvlink,
            previous=self._previous(held),
            previous_at=self._last_at,
            now=now,
            xids=self._watch,
        )
        if not facts.get("nvml_available"):
            return facts  # nothing read: what was known stays, for the read after NVML comes back
        gpus = [gpu for gpu in facts["gpus"] if gpu.get("uuid") and gpu.get("health")]
        self._last = {str(gpu["uuid"]): gpu["health"] for gpu in gpus}
        self._last_at = now
        if held is not None:
            self._seen_held = set(held)
        if self.writes_holds:
            self._sync(gpus, held or {})
        for gpu in gpus:
            self._say(gpu)
        return facts

    def close(self) -> None:
        """Give back the XID watch's event set and NVML initialisation (the agent is stopping)."""
        self._watch.close()

    # --- the relay to root -----------------------------------------------------------------------------

    def xid_reports(self) -> list[GpuReport]:
        """The GPUs this watch holds unhealthy by critical XIDs, as the apply request relays them to root.

        From the last read's verdicts: only ``unhealthy`` ones, only their ``xid-critical`` reasons (a whole GPU;
        an XID scoped to one MIG device does not make its GPU unhealthy), at most ``MAX_GPU_REPORTS`` GPUs and
        ``MAX_REPORTED_XIDS`` XIDs each. The hold file is read first: a GPU whose hold this watch saw and that is
        gone now was cleared by an operator (or released at a reset) since the last read, and is not reported,
        so that the clear is not undone before the next read drops the agent's own copy."""
        with self._lock:
            held = self._read_holds()
            cleared: set[str] = set()
            if held is not None and self.holds is not None:
                cleared = self._seen_held - set(held)
                self._seen_held |= set(held)  # the cleared stay: the next read drops them (_previous)
            reports: list[GpuReport] = []
            for uuid, health in self._last.items():
                if uuid in cleared or not _GPU_UUID.fullmatch(uuid) or health.get("verdict") != "unhealthy":
                    continue
                xids = sorted({xid for xid in map(_xid, health.get("reasons") or []) if xid is not None})
                if xids and len(reports) < MAX_GPU_REPORTS:
                    seen_at = _seen_at(health, xids) or self._last_at or self._clock()
                    reports.append(GpuReport(uuid=uuid, xids=xids[:MAX_REPORTED_XIDS], seen_at=seen_at))
            return reports

    def note_holds(self) -> None:
        """Read the hold file after root answered an apply request: the GPUs it holds now (those this watch
        relayed among them) are known as held, so that an operator's clear before the next read is seen."""
        with self._lock:
            held = self._read_holds()
            if held is not None and self.holds is not None:
                self._seen_held |= set(held)

    # --- the hold file ---------------------------------------------------------------------------------

    def _read_holds(self) -> dict[str, HeldVerdict] | None:
        """The held verdicts by uuid; None when the file cannot be read (said once)."""
        if self.holds is None:
            return {}
        try:
            return self.holds.all()
        except HealthHoldError as exc:
            self._problem("gpu-health-holds-unreadable", exc, "observing on from the agent's own verdicts")
            return None

    def _previous(self, held: Mapping[str, HeldVerdict] | None) -> dict[str, Mapping[str, Any]]:
        """Per uuid, the ``previous`` for ``judge``: the agent's last verdict, or what the hold file says of it."""
        previous: dict[str, Mapping[str, Any]] = dict(self._last)
        if held is None or self.holds is None:
            return previous
        for uuid, verdict in held.items():
            last = self._last.get(uuid)
            # Held, and the agent's last verdict is that hold's (fresher readings): go on from it. Otherwise (a
            # restart, or root held what the agent did not see) the held verdict is the previous one.
            previous[uuid] = last if last is not None and last.get("verdict") == "unhealthy" else verdict.health
        for uuid in self._seen_held - set(held):
            last = self._last.get(uuid)
            if last is not None and last.get("verdict") == "unhealthy":
                # Held at the last refresh, gone now: cleared by an operator, or released by root at a reset.
                cleared = self.holds.previous_for(uuid, last)
                if cleared is not None:
                    previous[uuid] = cleared
        return previous

    def _sync(self, gpus: list[dict[str, Any]], held: Mapping[str, HeldVerdict]) -> None:
        """In-process: hold each unhealthy verdict, release each hold whose GPU is no longer unhealthy."""
        assert self.holds is not None
        for gpu in gpus:
            uuid, health = str(gpu["uuid"]), gpu["health"]
            if health.get("verdict") != "unhealthy" and uuid not in held:
                continue  # nothing to hold and nothing to release: no need to take the file's lock
            try:
                changed = self.holds.sync(uuid, health, gpu=gpu)
            except HealthHoldError as exc:
                self._problem("gpu-health-hold-not-written", exc, "the verdict shows in observations only")
                continue
            if not changed:
                continue
            if health.get("verdict") == "unhealthy":
                self._seen_held.add(uuid)
            else:
                self._seen_held.discard(uuid)
            self._log.info(
                "gpu-health-hold-written",
                uuid=uuid,
                index=gpu.get("index"),
                held=health.get("verdict") == "unhealthy",
                path=self.holds.path,
            )

    def _problem(self, event: str, exc: Exception, consequence: str) -> None:
        text = str(exc)
        if text in self._problems:
            return
        self._problems.add(text)
        self._log.warning(event, error=text, consequence=consequence)

    # --- the log ---------------------------------------------------------------------------------------

    def _say(self, gpu: Mapping[str, Any]) -> None:
        """Log a GPU's verdict when it changed (a first read only when it is not healthy)."""
        summary = verdict_summary(gpu)
        uuid = str(summary["uuid"])
        key = (summary["verdict"], summary["held"], tuple(summary["reasons"]))
        before = self._said.get(uuid)
        self._said[uuid] = key
        if before == key or (before is None and summary["verdict"] == "healthy"):
            return
        emit = self._log.info if summary["verdict"] == "healthy" else self._log.warning
        emit(
            "gpu-health-changed",
            index=summary["index"],
            uuid=uuid,
            verdict=summary["verdict"],
            held=summary["held"],
            since=summary["since"],
            reasons=summary["reasons"],
            was=None if before is None else before[0],
        )


def _xid(reason: Mapping[str, Any]) -> int | None:
    """The XID of a whole-GPU critical XID reason; None for any other reason."""
    value = reason.get("value")
    if reason.get("code") != "xid-critical" or isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= 2**31 - 1 else None


def _seen_at(health: Mapping[str, Any], xids: list[int]) -> datetime | None:
    """When the agent first saw one of ``xids``: the earliest of them still in the window, else since when the
    verdict is held; None when neither can be read."""
    wanted = set(xids)
    events = (health.get("readings") or {}).get("xid_events") or []
    seen = [
        _time(event.get("at"))
        for event in events
        if isinstance(event, Mapping) and event.get("xid") in wanted and not event.get("mig_uuid")
    ]
    return min((at for at in seen if at is not None), default=None) or _time(health.get("since"))


def _time(value: Any) -> datetime | None:
    try:
        return parse_rfc3339(value).astimezone(UTC) if isinstance(value, str) else None
    except ValueError:
        return None

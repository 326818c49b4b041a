"""What the agent tells the control plane about its node: the observation, kept, sized and posted when it changed.

Runs on: the agent side (``meridian-node run``); the cycle observes (``agent_side.observe``) and hands the
observation here, once per cycle, after a repair, and each ``APPLY_REPORT_S`` while an apply runs.

- What it costs the control plane is kept small (bench/protocol_cost.py measures it per node and hour): an
  observation is posted when what it says changed (a digest of it, a GPU's gauges of the moment left out) or every
  ``REPORT_REFRESH_S`` (±``TIMER_JITTER``), never on every cycle.
- Every observation is made to fit the control plane's limit before it is posted (``ObservationSizeGuard``:
  kubernetes detail first); one the control plane refuses is logged (``observation-refused``), never retried.
- While an apply runs, what the engines look like is observed each ``APPLY_REPORT_S`` and posted when it changed
  (``Reporter.while_applying``): a replace that starts the new engine beside the old one switches the serving
  projection when the new one is ready and the old one is marked draining, mid-apply, which ``reconcile.yml``'s
  ``meridian_drain_settle`` (5 s) waits for before the old one's gauges are trusted. A failed look is logged once
  and backs off (``Backoff``) on a count of its own; it never touches the apply.
- What the last observation said is kept for supervision and ``status``: the engines (with what the observer found
  drifted), the kubelet's view (mode kubernetes-integrated), each GPU's verdict and the cordons in force.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    Observation,
    TransferObservation,
    format_rfc3339,
)
from meridian_node_agent.agent_side.control_client import ControlCallStopped, ControlPlaneRejected
from meridian_node_agent.agent_side.gpu_health import verdict_summary
from meridian_node_agent.agent_side.lease import Backoff, jittered
from meridian_node_agent.agent_side.observe import ObservationSizeGuard
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.logs import EventLogger

__all__ = ["APPLY_REPORT_S", "REPORT_REFRESH_S", "ObservePort", "Reporter", "run_summary"]

# An unchanged observation is re-sent this often (±TIMER_JITTER); a changed one at once. The heartbeat already
# proves the node alive, so the refresh only carries the gauges that move on their own (below). Five minutes is
# the kubelet's node status report (KEP 0009, ``nodeStatusReportFrequency``) and balena-supervisor's metrics report.
REPORT_REFRESH_S = 300.0
# How often an apply in progress is observed, so that a replace's switch reaches the serving projection while
# it happens; well inside the reconcile playbook's drain settle (5 s).
APPLY_REPORT_S = 1.0
# A GPU's readings of the moment: they move with load while nothing changed that the control plane acts on, so
# they are left out of the digest that decides whether an observation is new. They ride along with every post
# and the refresh (balena-supervisor holds its metrics back the same way). Everything else (engines, readiness,
# draining, health verdicts with their counters and reasons, MIG layout, processes, cordons, the applied
# generation, the lease epoch) is in the digest, and a change in it is posted in the cycle that sees it.
_GPU_GAUGES: dict[str, Any] = {
    "gpus": {
        "__all__": {
            "memory": {"used_mib", "free_mib"},
            "utilization_gpu_percent": True,
            "utilization_memory_percent": True,
            "temperature_c": True,
            "power_draw_w": True,
            "processes": {"__all__": {"used_memory_mib"}},
            "clocks": {"graphics_mhz", "sm_mhz", "memory_mhz"},
            # The link as trained now: GPUs retrain it down when idle. A downgrade that matters is in the verdict.
            "pcie": {"generation", "width"},
            "health": {"readings": {"clock_event_reasons", "power_violation_ns", "thermal_violation_ns"}},
        }
    }
}
# The observation outside its GPU facts (digested apart, once per GPU refresh): its time and the free VRAM.
_OBSERVATION_GAUGES: dict[str, Any] = {"observed_at": True, "gpu": True, "capacity": {"vram_free_mib"}}


class ObservePort(Protocol):
    def observe(
        self,
        *,
        node_id: str,
        mode: str,
        epoch: int,
        applied_generation: int,
        last_run: dict[str, Any] | None,
        now: datetime,
        cordon: dict[str, Any] | None = None,
        refused_state: dict[str, Any] | None = None,
    ) -> Observation: ...

    def forget(self) -> None: ...


class Reporter:
    """The observations of one agent: what the last one said, and when an unchanged one is due again.

    ``last_posted`` is the digest of the observation last posted and when it is due again unchanged (on the agent's
    monotonic clock); ``None`` makes the next one due at once. ``backoff`` paces the looks that fail while an apply
    runs. The cycle hands in its clock, random source, log and control client at each call: a test that stands in
    another one moves the reports with it.
    """

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.size_guard = ObservationSizeGuard()
        self.last_posted: tuple[bytes, float] | None = None
        # What the last observation said, for supervision and status (``_keep``).
        self.engines: list[dict[str, Any]] = []
        self.kubernetes: dict[str, Any] | None = None
        self.gpu_facts: dict[str, Any] | None = None
        self.gpus: list[dict[str, Any]] = []
        self.cordons: list[dict[str, Any]] = []
        # The GPU facts object last seen and its JSON without gauges (the digest's part): dumped once per GPU refresh.
        self._gpu: tuple[Any, bytes] | None = None

    def report(
        self,
        observation: Observation,
        *,
        transfers: list[dict[str, Any]],
        drifted: Mapping[str, tuple[str, ...]],
        post: Callable[[Observation], None],
        log: EventLogger,
        now: float,
        rng: random.Random,
    ) -> None:
        """Keep what ``observation`` says (with the pulls and downloads in flight, and what the observer found
        ``drifted``) and ``post`` it, fitted to the control plane's limit, when it changed or its refresh is due."""
        if transfers:
            observation = observation.model_copy(
                update={"transfers": [TransferObservation.model_validate(entry) for entry in transfers]}
            )
        self._keep(observation, drifted)
        assert self._gpu is not None
        # The GPU facts (most of an observation's bytes) digested without their gauges, once per GPU refresh.
        digest = hashlib.sha256(self._gpu[1])
        digest.update(observation.model_dump_json(exclude=_OBSERVATION_GAUGES).encode())
        content = digest.digest()
        if self.last_posted is not None and self.last_posted[0] == content and now < self.last_posted[1]:
            return
        try:
            post(self.size_guard(observation, log))
        except ControlPlaneRejected as exc:
            log.warning("observation-refused", status=exc.status, reason=exc.reason, detail=exc.detail)
        self.last_posted = (content, now + jittered(REPORT_REFRESH_S, rng))

    def _keep(self, observation: Observation, drifted: Mapping[str, tuple[str, ...]]) -> None:
        """Keep the observation's engines, the kubelet's view, GPU verdicts and cordons for supervision and status.
        The observer hands the same GPU facts object until its next GPU refresh: they are turned into dicts once per
        refresh, not per cycle."""
        gpu = observation.gpu
        if self._gpu is None or self._gpu[0] is not gpu:
            self.gpu_facts = gpu.model_dump(mode="json")
            self._gpu = (gpu, gpu.model_dump_json(exclude=_GPU_GAUGES).encode())
            self.gpus = [verdict_summary(entry) for entry in self.gpu_facts["gpus"]]
        self.cordons = [cordon.model_dump(mode="json") for cordon in observation.cordons] if observation.cordons else []
        self.kubernetes = None if observation.kubernetes is None else observation.kubernetes.model_dump(mode="json")
        self.engines = [
            {
                "name": e.name,
                "managed": e.managed,
                "state": e.state,
                "ready": e.ready,
                "draining": e.draining,
                "restarts": e.restarts,
                "exit_reason": e.exit_reason,
                "last_lines": e.last_lines,
                "ready_since": None if e.ready_since is None else format_rfc3339(e.ready_since),
                "drifted": list(drifted.get(e.name, ())),
            }
            for e in observation.engines
        ]

    @contextmanager
    def while_applying(self, look: Callable[[], None], log: EventLogger) -> Iterator[None]:
        """Call ``look`` each ``APPLY_REPORT_S`` in a thread while the body (an apply) runs.

        The cycle's own thread only waits on the apply meanwhile; a failed look is logged once, backs off, and never
        touches the apply. ``ControlCallStopped`` ends the looks: the agent is stopping and the apply is abandoned.
        """
        stop = threading.Event()

        def looks() -> None:
            logged = False
            failures = 0
            pause_s = APPLY_REPORT_S
            while not stop.wait(pause_s):
                try:
                    look()
                except ControlCallStopped:
                    return  # the agent is stopping: the apply is being abandoned, there is nothing to report
                except Exception as exc:  # noqa: BLE001 - reporting mid-apply is a courtesy, the apply is the job
                    if not logged:
                        log.warning("apply-report-failed", reason=f"{type(exc).__name__}: {exc}")
                    logged = True
                    # An apply can last an hour (a model download): a control plane that is down is asked less and
                    # less often, not every APPLY_REPORT_S.
                    failures += 1
                    pause_s = max(APPLY_REPORT_S, self.backoff.delay(failures))
                else:
                    failures, pause_s = 0, APPLY_REPORT_S

        thread = threading.Thread(target=looks, name="report-while-applying", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def run_summary(result: ApplyResult | None) -> dict[str, Any] | None:
    """The last run as an observation's ``last_run`` and status.json's: its ident, generation, status and counts."""
    if result is None:
        return None
    status = result.status if result.status in ("successful", "failed", "canceled", "timeout") else "failed"
    return {
        "ident": result.ident,
        "generation": result.generation,
        "status": status,
        "changed": result.changed,
        "failed": result.failed,
        "finished_at": format_rfc3339(result.finished_at),
    }

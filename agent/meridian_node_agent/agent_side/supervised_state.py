"""What the agent supervises: the state it last applied, its engines' tracks, and the record that keeps them.

Runs on: the agent side (``meridian-node run``); the cycle (``agent_side.cycle``) hands it each apply's result, asks
``Supervisor.assess`` for drift each cycle and repairs it (``Agent._supervise``), and keeps it in the record.

- The state last applied successfully, verified, is what supervision repairs towards (``desired``). A newer
  generation that failed part-way drops it (``applied_failed``): repairing towards the older one would fight the
  retries of the newer; supervision resumes when a generation is applied.
- What supervision and a failing apply's retry know (first seen, graces, repair and retry counts, backoff) is kept
  in the agent's own record (``supervision_record``), written when it changes (``remember``) and taken over at
  start-up (``take_over``): ``run --once`` from cron, a restarted agent and a crash-looping one decide as one
  long-running agent would. A part written for another state is not used, and the log says so.
- GPU health (docs/GPU_HEALTH.md "In the agent"): an engine of the applied state on a GPU whose verdict turned
  ``unhealthy`` is reported by supervision (``on_unhealthy_gpus``), logged once per change
  (``engine-on-unhealthy-gpu``), and never repaired: the signed state pins its GPUs, so a reconcile would change
  nothing. The control plane moves it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.trust.verify import VerifiedState
from meridian_node_agent.agent_side.supervise import Supervisor, engines_on_unhealthy_gpus
from meridian_node_agent.agent_side.supervision_record import (
    Remembered,
    RememberedRetry,
    RememberedState,
    SupervisionRecord,
)
from meridian_node_agent.config import Supervision
from meridian_node_agent.logs import EventLogger

__all__ = ["SupervisedState"]


class SupervisedState:
    """The state under supervision (``desired``: its envelope and its verification), the ``supervisor`` deciding on
    its engines, the ``record`` keeping both across restarts, and the engines last reported on an unhealthy GPU."""

    def __init__(self, supervisor: Supervisor, record: SupervisionRecord) -> None:
        self.supervisor = supervisor
        self.record = record
        self.desired: tuple[bytes, VerifiedState] | None = None
        self._gpu_trouble: dict[str, str] = {}

    @classmethod
    def configured(
        cls, config: Supervision, state_dir: Path, *, clock: Callable[[], float], log: EventLogger
    ) -> SupervisedState:
        """Supervision as ``config`` sets it, on the agent's monotonic ``clock``, its record in ``state_dir``."""
        supervisor = Supervisor(
            settle_s=config.settle_seconds,
            startup_grace_s=config.startup_grace_seconds,
            backoff_initial_s=config.backoff_initial_seconds,
            backoff_max_s=config.backoff_max_seconds,
            healthy_reset_s=config.healthy_reset_seconds,
            clock=clock,
        )
        return cls(supervisor, SupervisionRecord(state_dir, log=log))

    def applied(self, envelope: bytes, verified: VerifiedState) -> None:
        """``verified`` was applied: supervise its started engines from now on."""
        self.desired = (envelope, verified)
        started = [engine.name for engine in verified.state.engines if engine.state == "started"]
        self.supervisor.expect(verified.state.generation, started)

    def applied_failed(self, generation: int) -> None:
        """An apply of ``generation`` failed: a newer generation than the one supervised drops supervision."""
        if generation != self.supervisor.generation:
            self.supervisor.forget()
            self.desired = None

    def take_over(self, remembered: Remembered, verified: VerifiedState, log: EventLogger) -> RememberedRetry | None:
        """At start-up, with ``verified`` the spooled state: resume the engines' tracks when the record is for this
        state (generation and payload digest), and return the failed apply's count and next attempt when the spool
        holds the state that failed (the caller resumes the retry). A part written for another state is logged and
        not used."""
        generation, digest = verified.state.generation, verified.payload_sha256
        state, retry = remembered.supervised, remembered.apply_retry
        if state is not None and self.supervisor.generation is not None:
            if (state.generation, state.payload_sha256) == (generation, digest):
                self.supervisor.resume(generation, state.tracks, same_clock=remembered.same_clock)
            else:
                log.info(
                    "supervision-record-not-used",
                    part="supervised",
                    recorded_generation=state.generation,
                    supervising_generation=generation,
                    reason="written for another state",
                )
        if retry is None or verified.already_applied:
            return None
        if retry.payload_sha256 != digest:
            log.info(
                "supervision-record-not-used",
                part="apply_retry",
                recorded_generation=retry.generation,
                spooled_generation=generation,
                reason="written for another state than the spooled one",
            )
            return None
        return retry

    def remember(self, retry: RememberedRetry | None) -> None:
        """Keep what supervision and the apply retry know in the record; it writes only what changed."""
        supervised = None
        if self.desired is not None and self.supervisor.generation is not None:
            supervised = RememberedState(
                generation=self.supervisor.generation,
                payload_sha256=self.desired[1].payload_sha256,
                tracks=self.supervisor.tracks,
            )
        self.record.save(supervised, retry)

    def on_unhealthy_gpus(self, gpu_facts: dict[str, Any] | None, log: EventLogger) -> dict[str, str]:
        """Per engine of the applied state on a GPU ``gpu_facts`` (the last observation's) find unhealthy, why; said
        once per change."""
        if self.desired is None or gpu_facts is None:
            return {}
        engines = [{"name": engine.name, "gpus": engine.gpus} for engine in self.desired[1].state.engines]
        trouble = engines_on_unhealthy_gpus(engines, gpu_facts)
        if trouble != self._gpu_trouble:
            generation = self.desired[1].state.generation
            for name, why in sorted(trouble.items()):
                if self._gpu_trouble.get(name) != why:
                    # Not repaired here: the state pins the engine to these GPUs. The control plane moves it.
                    log.warning("engine-on-unhealthy-gpu", engine=name, generation=generation, problem=why)
            for name in sorted(set(self._gpu_trouble) - set(trouble)):
                log.info("engine-off-unhealthy-gpu", engine=name, generation=generation)
            self._gpu_trouble = trouble
        return trouble

    def cordon(self) -> dict[str, Any] | None:
        """The cordon of the state last applied (the one the engines run by), as a dict."""
        if self.desired is None or self.desired[1].state.cordon is None:
            return None
        return self.desired[1].state.cordon.model_dump(mode="json")

"""bench/fleet.py's simulated node: the agent's cycle and timers, without the host work between the calls.

``SimNode.cycle`` is ``Agent._cycle`` (agent_side/cycle.py) on the wire:

- a heartbeat when the renewal is due (``LeaseKeeper.due``/``renewed``, agent_side/lease.py):
  ``heartbeat_seconds`` ±``TIMER_JITTER`` after the last one was asked for, never later than half the lease, and at
  once while the lease is unknown;
- the conditional long-poll (``LeaseKeeper.long_poll_wait``): ``long_poll_seconds`` less up to ``TIMER_JITTER`` of
  it, ending at the next renewal when that comes first (so with the defaults a steady cycle is one renewal and one
  304, ``heartbeat_seconds`` ±10 % apart), sent in milliseconds, with ``If-None-Match`` and the ETag held;
- the observation (``Reporter.report``, agent_side/reporter.py): posted when its content digest changed, or
  ``REPORT_REFRESH_S`` ±10 % after the last post.

The next cycle starts as soon as one ends, as ``Agent.run`` does with a long-poll configured; a failed call backs
off with the agent's own ``Backoff`` (its jitter included) and counts. Every jitter is drawn through the agent's
``jittered`` from the node's own random source.

The digest is what ``Reporter.report`` compares, reduced to what changes here: the content of the GPU facts (re-read
every ``gpu_refresh_s`` of the ``Observer``; with chance ``changing`` a read finds something the digest covers
changed, an engine's readiness or a health counter, and the node posts at once), the generation applied and
the lease epoch. A GPU's gauges of the moment (utilization, power, temperature) move at every read, so the
bodies a node posts differ, but the agent leaves them out of the digest and so does this. The step models a
fleet that has been running: each node's first GPU read and first observation refresh after its first post
fall anywhere in their intervals, not all at the step's start. A new desired state
is taken as applied at once (no verification, no playbook: that is the node's time, not the control plane's),
so its observation follows in the same cycle as on a real node.

Every interval comes from the agent's own defaults and constants (``AgentTimers.of_agent``), not from numbers
typed here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import time
from dataclasses import KW_ONLY, dataclass
from datetime import datetime

from ansible_collections.meridian.node.bench.fleet_client import Answer, Link, TransferFailed
from ansible_collections.meridian.node.bench.fleet_observation import VARIANTS, ObservationBodies
from ansible_collections.meridian.node.bench.fleet_stats import HEARTBEAT, LONG_POLL, OBSERVATION, Recorder
from meridian_node_agent.agent_side.lease import Backoff, jittered
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.reporter import REPORT_REFRESH_S
from meridian_node_agent.config import TIMER_JITTER, BackoffConfig, ControlPlaneConfig

__all__ = ["AgentTimers", "Refused", "SimNode"]

_HEADERS = [(b"accept", b"application/json"), (b"user-agent", b"meridian-node-agent")]
_JSON_BODY = [*_HEADERS, (b"content-type", b"application/json")]
# lease._RENEWAL_SLACK_S: a long-poll ended a little before the renewal it was sized to reach still renews.
_RENEWAL_SLACK_S = 0.1


class Refused(Exception):
    """The control plane answered with a status the agent does not expect (a 4xx or 5xx)."""


@dataclass(frozen=True)
class AgentTimers:
    """The agent's intervals, in seconds (each drawn ±``jitter`` where the agent sets it)."""

    heartbeat_s: float  # ControlPlaneConfig.heartbeat_seconds: the lease renewal
    long_poll_s: float  # ControlPlaneConfig.long_poll_seconds: the longest a fetch waits (it ends at the renewal)
    timeout_s: float  # ControlPlaneConfig.timeout_seconds: each call's bound (a long-poll adds its wait)
    report_refresh_s: float  # reporter.REPORT_REFRESH_S: an unchanged observation is re-sent this often
    gpu_refresh_s: float  # Observer's gpu_refresh_s: how often GPU facts are read again
    backoff_initial_s: float  # BackoffConfig: the retry after a failed call, doubling with jitter
    backoff_max_s: float
    jitter: float  # config.TIMER_JITTER, as cycle.py takes it

    @classmethod
    def of_agent(cls) -> AgentTimers:
        control = ControlPlaneConfig.model_fields
        backoff = BackoffConfig.model_fields
        return cls(
            heartbeat_s=float(control["heartbeat_seconds"].default),
            long_poll_s=float(control["long_poll_seconds"].default),
            timeout_s=float(control["timeout_seconds"].default),
            report_refresh_s=REPORT_REFRESH_S,
            gpu_refresh_s=float(inspect.signature(Observer).parameters["gpu_refresh_s"].default),
            backoff_initial_s=float(backoff["initial_seconds"].default),
            backoff_max_s=float(backoff["max_seconds"].default),
            jitter=TIMER_JITTER,
        )

    @property
    def cycle_s(self) -> float:
        """A steady cycle's mean length: the long-poll ends at the renewal when that comes first."""
        return min(self.heartbeat_s, self.long_poll_s * (1 - self.jitter / 2)) if self.long_poll_s else self.heartbeat_s

    def calls_per_node_s(self, changing: float) -> float:
        """What one node offers per second in the steady state: a renewal every ``heartbeat_s`` (its jitter is
        even, so the mean stays), a long-poll per cycle, and an observation per change or refresh (GPU reads every
        ``gpu_refresh_s``, each finding a change with chance ``changing``; an unchanged observation posted anyway
        once ``report_refresh_s`` passed)."""
        interval, chance_left, reads = 0.0, 1.0, 1
        while chance_left > 1e-9:
            posted = 1.0 if reads * self.gpu_refresh_s >= self.report_refresh_s else changing
            interval += chance_left * posted * reads * self.gpu_refresh_s
            chance_left *= 1 - posted
            reads += 1
        return 1 / self.heartbeat_s + 1 / self.cycle_s + 1 / interval


@dataclass(eq=False)
class SimNode:
    """One enrolled node on its own kept-alive connection."""

    node_id: str
    link: Link
    timers: AgentTimers
    bodies: ObservationBodies
    recorder: Recorder
    _: KW_ONLY
    changing: float
    rng: random.Random

    def __post_init__(self) -> None:
        self.backoff = Backoff(self.timers.backoff_initial_s, self.timers.backoff_max_s, self.rng)
        self.heartbeat_target = f"/v1/nodes/{self.node_id}/heartbeat".encode()
        self.fetch_target = f"/v1/nodes/{self.node_id}/desired-state".encode()
        self.observation_target = f"/v1/nodes/{self.node_id}/observations".encode()
        # The agent's memory, on perf_counter: the lease (epoch, when it is renewed next), the ETag, what was applied
        # and reported (the digest, and when it is due again unchanged), the GPU reading last taken.
        self.epoch: int | None = None
        self.renew_at: float | None = None
        self.etag: bytes | None = None
        self.applied_generation = 0
        self.variant = self.rng.randrange(VARIANTS)  # the gauges of the moment, which ride along with every post
        self.content = 0  # what the digest covers in the GPU facts, as a version: it moves when a read changed it
        self.gpu_read_at: float | None = None
        self.reported: tuple[tuple[int, int, int], float] | None = None
        self.cycles = 0

    async def run(self, start_delay_s: float) -> None:
        """Cycle until cancelled, after ``start_delay_s`` (nodes of a fleet start at different moments)."""
        await asyncio.sleep(start_delay_s)
        failures = 0
        while True:
            try:
                await self.cycle()
            except (TransferFailed, Refused):
                failures += 1
                await asyncio.sleep(self.backoff.delay(failures))
                continue
            failures = 0

    async def cycle(self) -> None:
        self.cycles += 1
        if self._heartbeat_due(time.perf_counter()):
            answer = await self._call(HEARTBEAT, b"POST", self.heartbeat_target, _HEADERS, None, self.timers.timeout_s)
            if answer.status != 200:
                raise self._refused(HEARTBEAT, answer.status, answer.body)
            self.recorder.answer(HEARTBEAT, answer.done_at, answer.done_at - answer.sent_at)
            lease = json.loads(answer.body)
            lease_s = (
                datetime.fromisoformat(lease["expires_at"]) - datetime.fromisoformat(lease["renewed_at"])
            ).total_seconds()
            self.epoch = int(lease["epoch"])
            interval_s = min(self.timers.heartbeat_s, max(1.0, lease_s / 2))
            self.renew_at = answer.sent_at + jittered(interval_s, self.rng)  # from the ask, as ``LeaseKeeper.renewed``
        headers = _HEADERS if self.etag is None else [*_HEADERS, (b"if-none-match", self.etag)]
        wait_s = self._long_poll_wait(time.perf_counter())
        target = self.fetch_target + (f"?wait={wait_s:g}".encode() if wait_s else b"")
        answer = await self._call(LONG_POLL, b"GET", target, headers, None, self.timers.timeout_s + wait_s)
        if answer.status == 304:
            self.recorder.answer(LONG_POLL, answer.done_at, max(0.0, answer.done_at - answer.sent_at - wait_s))
        elif answer.status == 200:
            self.recorder.answer(LONG_POLL, answer.done_at, None)
            self.etag = answer.headers.get(b"etag")
            self.applied_generation = int(answer.headers.get(b"x-meridian-generation", b"0"))
            self.recorder.delivered(self.node_id, answer.done_at)
        elif answer.status == 204:
            self.recorder.answer(LONG_POLL, answer.done_at, None)
        else:
            raise self._refused(LONG_POLL, answer.status, answer.body)
        await self._report()

    def _heartbeat_due(self, now: float) -> bool:
        return self.epoch is None or self.renew_at is None or now >= self.renew_at - _RENEWAL_SLACK_S

    def _long_poll_wait(self, now: float) -> float:
        """``long_poll_s`` less up to ``jitter`` of it, ending at the next renewal, in whole milliseconds."""
        if self.timers.long_poll_s <= 0:
            return 0.0
        wait = self.timers.long_poll_s * (1 - self.timers.jitter * self.rng.random())
        if self.renew_at is not None:
            wait = min(wait, self.renew_at - now)
        return max(0.0, round(wait, 3))

    async def _report(self) -> None:
        now = time.perf_counter()
        if self.gpu_read_at is None or now - self.gpu_read_at >= self.timers.gpu_refresh_s:
            # The first read is placed somewhere in its interval, as in a fleet that has been running a while.
            first = self.gpu_read_at is None
            self.gpu_read_at = now - (self.rng.uniform(0, self.timers.gpu_refresh_s) if first else 0.0)
            self.variant = (self.variant + self.rng.randrange(1, VARIANTS)) % VARIANTS
            if self.rng.random() < self.changing:
                self.content += 1
        assert self.epoch is not None
        digest = (self.content, self.applied_generation, self.epoch)
        if self.reported is not None and self.reported[0] == digest and now < self.reported[1]:
            return
        body = self.bodies.body(self.node_id, self.epoch, self.applied_generation, self.variant)
        answer = await self._call(
            OBSERVATION, b"POST", self.observation_target, _JSON_BODY, body, self.timers.timeout_s
        )
        if answer.status in (200, 204):
            self.recorder.answer(OBSERVATION, answer.done_at, answer.done_at - answer.sent_at)
        elif 400 <= answer.status < 500:
            # The agent logs a refused observation and goes on (``_report``): counted, no backoff.
            self.recorder.refused(OBSERVATION, self.node_id, answer.status, answer.body)
        else:
            raise self._refused(OBSERVATION, answer.status, answer.body)
        refresh_s = jittered(self.timers.report_refresh_s, self.rng)
        if self.reported is None:
            # The node's first post of the step: its next refresh falls anywhere in the interval, as in a fleet that
            # has been running a while (not REPORT_REFRESH_S after a step that began for all of them at once).
            refresh_s *= self.rng.random()
        self.reported = (digest, now + refresh_s)

    async def _call(
        self,
        endpoint: str,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        timeout_s: float,
    ) -> Answer:
        try:
            return await self.link.exchange(method, target, headers, body, timeout_s)
        except TransferFailed as exc:
            self.recorder.failed(endpoint, self.node_id, exc)
            raise

    def _refused(self, endpoint: str, status: int, body: bytes) -> Refused:
        self.recorder.refused(endpoint, self.node_id, status, body)
        return Refused(f"{endpoint}: HTTP {status}")

"""The agent's timers against the real devserver, on a test clock: jittered, paced by the lease, cheap when idle.

Each test drives the real loop (``Agent.run``) or the real cycle with an injected monotonic clock, sleep and random
source: the clock moves only when the loop sleeps or a long-poll would have waited, so an hour of cycles runs in
seconds and no assertion depends on how fast this machine is. Every call reaches the real control plane over mutual
TLS; only a long-poll's wait is not sat out (the server answers at once, and the clock moves by the wait asked).

The faults held: nodes started together calling in lockstep for ever (a timer without jitter), a long-poll that
asks the server for more than its limit, a renewal left past the lease, an unchanged observation re-posted every
cycle, a GPU's moving gauges taken for a change, a real change held back until the refresh, a fetch without the
ETag it holds, and the reports made during an apply hammering a control plane that is down.
"""

from __future__ import annotations

import itertools
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, Observation
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.instant_apply import instant_success
from ansible_collections.meridian.node.tests.support.node_env import Node, make_node, publish
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock
from meridian_node_agent.agent_side.control_client import (
    ControlPlaneUnavailable,
    DesiredStateFetch,
    FetchStatus,
)
from meridian_node_agent.agent_side.cycle import Agent
from meridian_node_agent.agent_side.lease import Backoff
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.reporter import REPORT_REFRESH_S
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.config import TIMER_JITTER

HEARTBEAT_S = 15
LONG_POLL_S = 30


class _Recording:
    """The real control client, each call recorded with the test clock's time; a long-poll is answered at once
    and the clock moved by the wait it asked for, as if the server had held it that long with nothing new."""

    def __init__(self, real: Any, clock: MonotonicClock) -> None:
        self.real = real
        self.clock = clock
        self.heartbeats: list[float] = []
        self.fetches: list[tuple[float, str | None, float]] = []  # (when, If-None-Match, wait asked)
        self.posted: list[tuple[float, Observation]] = []

    def heartbeat(self, node_id: str) -> Lease:
        self.heartbeats.append(self.clock.now)
        lease: Lease = self.real.heartbeat(node_id)
        return lease

    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait_s: float = 0) -> DesiredStateFetch:
        self.fetches.append((self.clock.now, etag, wait_s))
        fetched: DesiredStateFetch = self.real.fetch_desired_state(node_id, etag=etag)
        if fetched.status != FetchStatus.NEW:
            self.clock.now += wait_s
        return fetched

    def post_observation(self, observation: Observation) -> None:
        self.real.post_observation(observation)
        self.posted.append((self.clock.now, observation))


class _Gpu:
    """One GPU whose gauges move at every read, as under load; its health verdict is the test's to turn."""

    def __init__(self) -> None:
        self.reads = 0
        self.verdict = "healthy"

    def __call__(self) -> dict[str, Any]:
        self.reads += 1
        used = 40000 + self.reads % 7 * 100
        return {
            "nvml_available": True,
            "driver_version": "550.54.15",
            "count": 1,
            "gpus": [
                {
                    "index": 0,
                    "uuid": "GPU-00000000-6b1c-4f2e-9a51-000000000000",
                    "name": "NVIDIA H100 80GB HBM3",
                    "pci_bus_id": "00000000:1B:00.0",
                    "memory": {"total_mib": 81559, "used_mib": used, "free_mib": 81559 - used},
                    "utilization_gpu_percent": self.reads % 101,
                    "utilization_memory_percent": self.reads * 3 % 101,
                    "temperature_c": 40 + self.reads % 20,
                    "power_draw_w": 300.0 + self.reads,
                    "power_limit_w": 700.0,
                    "ecc_errors_corrected": 0,
                    "ecc_errors_uncorrected": 0,
                    "mig_mode": False,
                    "mig_instances": [],
                    "processes": [{"pid": 4242, "used_memory_mib": used - 500}],
                    "nvlink_peers": [],
                    "clocks": {"graphics_mhz": 1500 + self.reads % 480, "max_graphics_mhz": 1980},
                    "health": {
                        "verdict": self.verdict,
                        "reasons": [] if self.verdict == "healthy" else [{"code": "xid-79", "source": "xid"}],
                        "readings": {"power_violation_ns": self.reads * 1000},
                    },
                }
            ],
        }


def _agent(
    server: DevServer, tmp_path: Path, node_id: str, *, long_poll_seconds: int, heartbeat_seconds: int = HEARTBEAT_S
) -> tuple[Node, Agent, MonotonicClock, _Recording]:
    """A node in observe-only mode (it verifies and reports, no playbook runs) with one published state, on a test
    clock and a seeded random source, long-polling and renewing its lease at these intervals."""
    node = make_node(server, tmp_path / "node", node_id, mode="observe-only")
    control = {"long_poll_seconds": long_poll_seconds, "heartbeat_seconds": heartbeat_seconds}
    node.configure(control_plane={"url": server.base_url, **control})
    publish(server, node_id)
    clock = MonotonicClock()
    agent = node.agent(sleep=clock.sleep, monotonic=clock, rng=random.Random(27))
    agent.observer = Observer(store_path=None, gpu_facts=_Gpu(), engines=list, monotonic=clock)
    recording = _Recording(agent.client, clock)
    agent.client = recording
    return node, agent, clock, recording


def _gaps(times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def test_heartbeats_without_a_long_poll_come_each_interval_within_ten_percent_and_not_in_lockstep(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _, agent, _, recording = _agent(server, tmp_path, node_id, long_poll_seconds=0)

    assert agent.run(max_cycles=40) == 0

    gaps = _gaps(recording.heartbeats)
    assert len(gaps) == 39  # the pause between cycles lasts until the next renewal: one renewal per cycle
    for gap in gaps:
        assert HEARTBEAT_S * (1 - TIMER_JITTER) <= gap <= HEARTBEAT_S * (1 + TIMER_JITTER), gaps
    # Spread over the band, not one value: two nodes started together drift apart instead of calling together.
    assert max(gaps) - min(gaps) > HEARTBEAT_S * TIMER_JITTER


def test_long_polls_end_at_the_jittered_renewal_and_never_ask_more_than_the_setting(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _, agent, _, recording = _agent(server, tmp_path, node_id, long_poll_seconds=LONG_POLL_S)

    assert agent.run(max_cycles=40) == 0

    # One renewal and one fetch per cycle: the long-poll (30 s allowed) ends when the lease is next due (15 s ±10 %).
    # The first fetch returned the published state at once, so one more fetch finished that interval.
    assert len(recording.fetches) == 40
    assert len(recording.heartbeats) == 39
    gaps = _gaps(recording.heartbeats)
    for gap in gaps:
        assert HEARTBEAT_S * (1 - TIMER_JITTER) <= gap <= HEARTBEAT_S * (1 + TIMER_JITTER), gaps
    assert max(gaps) - min(gaps) > HEARTBEAT_S * TIMER_JITTER
    waits = [wait for _, _, wait in recording.fetches]
    assert all(0 < wait <= LONG_POLL_S for wait in waits), waits
    assert len(set(waits)) > 1


def test_a_long_poll_shorter_than_the_heartbeat_is_jittered_below_its_setting(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _, agent, _, recording = _agent(server, tmp_path, node_id, long_poll_seconds=4)

    assert agent.run(max_cycles=30) == 0

    waits = [wait for _, _, wait in recording.fetches]
    # Up to 10 % shorter, never longer (the server refuses a wait over its limit), cut short by a renewal now and then.
    assert all(0 < wait <= 4 for wait in waits), waits
    assert len({wait for wait in waits if wait >= 4 * (1 - TIMER_JITTER)}) > 5
    # The renewals still keep their interval: the long-poll that reaches one ends there (a renewal falling within
    # 0.1 s after a long-poll's end is made at that cycle, a little early, rather than after one more short fetch).
    for gap in _gaps(recording.heartbeats):
        assert HEARTBEAT_S * (1 - TIMER_JITTER) - 0.1 <= gap <= HEARTBEAT_S * (1 + TIMER_JITTER)


def test_every_fetch_after_the_first_asks_with_the_etag_it_holds(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _, agent, _, recording = _agent(server, tmp_path, node_id, long_poll_seconds=LONG_POLL_S)

    assert agent.run(max_cycles=5) == 0

    etags = [etag for _, etag, _ in recording.fetches]
    assert etags[0] is None and etags[1] is not None
    assert etags[1:] == [etags[1]] * 4  # answered 304 each time: nothing but the ETag came back


def test_an_observation_whose_gauges_alone_moved_waits_for_the_jittered_refresh(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _, agent, _, recording = _agent(server, tmp_path, node_id, long_poll_seconds=0)

    # Half an hour: the GPU is read every 30 s and its utilisation, temperature, power and memory move each time.
    assert agent.run(max_cycles=int(1800 / HEARTBEAT_S)) == 0

    times = [when for when, _ in recording.posted]
    gaps = _gaps(times)
    # 6 refreshes of 5 min ±10 % in the half hour, each one cycle late at most, none early; not one post per cycle.
    assert 5 <= len(gaps) <= 6, times
    for gap in gaps:
        assert (
            REPORT_REFRESH_S * (1 - TIMER_JITTER)
            <= gap
            <= REPORT_REFRESH_S * (1 + TIMER_JITTER) + HEARTBEAT_S * (1 + TIMER_JITTER)
        ), gaps
    assert max(gaps) - min(gaps) > HEARTBEAT_S  # jittered, not a fixed period
    # What a refresh carries is the reading of the moment, not the first one replayed.
    first, last = recording.posted[0][1].gpu.gpus[0], recording.posted[-1][1].gpu.gpus[0]
    assert (first.utilization_gpu_percent, first.power_draw_w) != (last.utilization_gpu_percent, last.power_draw_w)


def test_a_gpu_verdict_that_turns_is_posted_in_the_cycle_that_reads_it(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    _, agent, clock, recording = _agent(server, tmp_path, node_id, long_poll_seconds=0)
    gpu = agent.observer._gpu_facts  # type: ignore[attr-defined]
    assert isinstance(gpu, _Gpu)
    agent.cycle()
    for _ in range(3):  # past the GPU refresh (30 s) each time: new gauges, nothing else
        clock.now += 31
        agent.cycle()
    assert len(recording.posted) == 1

    gpu.verdict = "unhealthy"
    clock.now += 31
    agent.cycle()

    assert len(recording.posted) == 2
    health = recording.posted[1][1].gpu.gpus[0].health
    assert health is not None and health.verdict == "unhealthy"


def test_renewal_points_of_agents_started_together_spread_within_ten_percent(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node = make_node(server, tmp_path / "node", node_id)
    built = node.agent()
    configured = node.config.certificate_renewal.remaining_fraction

    fractions = [
        Agent(
            node.config, built.policy, built.client, built.applier, built.observer, rng=random.Random(seed)
        ).renewal.remaining_fraction
        for seed in range(20)
    ]

    for fraction in fractions:
        assert configured * (1 - TIMER_JITTER) <= fraction <= configured * (1 + TIMER_JITTER)
    assert max(fractions) - min(fractions) > configured * TIMER_JITTER


class _CountingBackoff(Backoff):
    """The reports' backoff, each attempt it was asked about kept; the apply waits on ``enough``."""

    def __init__(self, base: Backoff) -> None:
        super().__init__(base.initial_s, base.maximum_s, base.rng)
        self.attempts: list[int] = []
        self.enough = threading.Event()

    def delay(self, attempt: int) -> float:
        self.attempts.append(attempt)
        if len(self.attempts) >= 2:
            self.enough.set()
        return super().delay(attempt)


class _Down(_Recording):
    """Heartbeats and fetches reach the control plane; every observation is refused as by an outage."""

    def post_observation(self, observation: Observation) -> None:
        raise ControlPlaneUnavailable("the control plane is down (test)")


class _SlowApply:
    """An apply that lasts until the reports made during it have backed off twice (or 60 s, which fails the test)."""

    def __init__(self, until: threading.Event) -> None:
        self.until = until

    def apply(self, envelope: bytes, *, generation: int, **_: Any) -> ApplyResult:
        self.until.wait(60)
        return instant_success(generation)


def test_reports_during_an_apply_back_off_while_the_control_plane_is_down(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node = make_node(server, tmp_path / "node", node_id)
    publish(server, node_id)
    log, events = recording_logger(node_id)
    agent = node.agent(rng=random.Random(27), log=log)
    agent.observer = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False}, engines=list)
    backoff = _CountingBackoff(agent.reporter.backoff)
    agent.reporter.backoff = backoff
    agent.client = _Down(agent.client, MonotonicClock())
    agent.applier = _SlowApply(backoff.enough)

    with pytest.raises(ControlPlaneUnavailable):
        agent.cycle()  # the apply succeeds; the report after it finds the control plane down

    assert backoff.enough.is_set()
    assert backoff.attempts[:2] == [1, 2]  # growing: attempt n waits up to 2^(n-1) s, not APPLY_REPORT_S each time
    assert len(events.named("apply-report-failed")) == 1  # said once, however long the outage lasts
    assert agent.counters.applies == 1 and agent.last_run is not None and agent.last_run.ok

"""Supervision survives the agent's own restarts: a fresh agent per cycle (``run --once`` from cron, a restarted
or crash-looping agent) decides exactly as one long-running agent fed the same observations on the same clock.

Two levels. ``Supervisor`` alone: a new one (and a new record reader) per step against one that lives through
the whole table. The ``Agent``: a new one per step running ``run(once=True)`` against one that cycles, both
against the real devserver on 127.0.0.1, with the engines they observe and the applies' results scripted (the
applier stands in for ansible-runner: what is under test is when the agent applies, not the apply).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import E2E_REPOSITORY, engine_spec, make_e2e_node
from ansible_collections.meridian.node.tests.support.node_env import Node, publish
from ansible_collections.meridian.node.tests.support.recorded_events import SeenEvents
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.metrics import Metrics
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.supervise import EngineTrack, Supervisor
from meridian_node_agent.agent_side.supervision_record import (
    RECORD_FILE,
    RememberedState,
    SupervisionRecord,
)
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.logs import EventLogger

# --- Supervisor alone ---------------------------------------------------------------------------------------

ENGINES = ["chat", "embed", "slow"]
GENERATION, DIGEST = 7, "ab" * 32


def _up(name: str) -> dict[str, Any]:
    return {"name": name, "state": "running", "ready": True, "draining": False}


def _exited(name: str) -> dict[str, Any]:
    return {"name": name, "state": "exited", "ready": False, "draining": False}


def _unready(name: str) -> dict[str, Any]:
    return {"name": name, "state": "running", "ready": False, "draining": False}


def _drained(name: str) -> dict[str, Any]:
    return {**_exited(name), "draining": True}


# (seconds since the step before, what the cycle observes): a host with three engines for six minutes.
TABLE: list[tuple[float, list[dict[str, Any]]]] = [
    (1, [_up("chat"), _up("embed"), _unready("slow")]),  # slow loads its model
    (5, [_exited("chat"), _up("embed"), _unready("slow")]),  # chat killed: first seen
    (5, [_exited("chat"), _up("embed"), _unready("slow")]),  # settling
    (5, [_exited("chat"), _up("embed"), _unready("slow")]),  # settle time over: repair 1
    (1, [_exited("chat"), _up("embed"), _unready("slow")]),  # it crashes again: backing off 10 s
    (9, [_exited("chat"), _up("embed"), _unready("slow")]),  # repair 2
    (10, [_exited("chat"), _up("embed"), _unready("slow")]),  # backing off 20 s
    (10, [_exited("chat"), _up("embed"), _unready("slow")]),  # repair 3
    (1, [_up("chat"), _unready("embed"), _unready("slow")]),  # chat back; embed lost readiness
    (10, [_up("chat"), _unready("embed"), _unready("slow")]),  # embed: the settle time, not the startup grace
    (5, [_up("chat"), _up("embed"), _unready("slow")]),  # slow: the startup grace is over, repaired
    (30, [_up("chat"), _up("embed"), _up("slow")]),
    (30, [_up("chat"), _up("embed"), _up("slow")]),  # chat healthy 61 s: its count is forgotten
    (1, [_exited("chat"), _up("embed"), _up("slow")]),
    (10, [_exited("chat"), _up("embed"), _up("slow")]),  # repaired, the backoff back at its first step
    (1, [_drained("chat"), _up("embed"), _up("slow")]),  # drained on purpose: never drift
    (60, [_drained("chat"), _up("embed")]),  # slow removed behind the agent's back
    (10, [_drained("chat"), _up("embed")]),  # missing for the settle time: repaired
    (300, [_drained("chat"), _up("embed"), _up("slow")]),
]

Decision = tuple[tuple[tuple[str, str], ...] | None, dict[str, dict[str, Any]]]


def _supervisor(clock: MonotonicClock) -> Supervisor:
    return Supervisor(
        settle_s=10, startup_grace_s=60, backoff_initial_s=10, backoff_max_s=40, healthy_reset_s=60, clock=clock
    )


def _decide(supervisor: Supervisor, observed: list[dict[str, Any]]) -> Decision:
    drift = supervisor.assess(observed)
    if drift is not None:
        supervisor.repaired(drift)  # the cycle repairs it (whatever the result)
    return (None if drift is None else drift.engines), supervisor.status()


def _one_supervisor_for_the_whole_table() -> list[Decision]:
    clock = MonotonicClock(5000.0)
    supervisor = _supervisor(clock)
    supervisor.expect(GENERATION, ENGINES)
    decisions = []
    for seconds, observed in TABLE:
        clock.now += seconds
        decisions.append(_decide(supervisor, observed))
    return decisions


def _a_new_supervisor_for_each_step(
    state_dir: Path, boot: Callable[[], str | None], table: list[tuple[float, list[dict[str, Any]]]] = TABLE
) -> list[Decision]:
    clock = MonotonicClock(5000.0)
    decisions = []
    for seconds, observed in table:
        clock.now += seconds
        # A new process: nothing in memory, only the record in the agent's directory.
        record = SupervisionRecord(state_dir, boot_id=boot)
        supervisor = _supervisor(clock)
        supervisor.expect(GENERATION, ENGINES)
        remembered = record.load(clock())
        if remembered is not None and remembered.supervised is not None:
            supervisor.resume(GENERATION, remembered.supervised.tracks, same_clock=remembered.same_clock)
        decisions.append(_decide(supervisor, observed))
        record.save(RememberedState(GENERATION, DIGEST, supervisor.tracks), None)
    return decisions


def test_a_new_supervisor_each_cycle_decides_exactly_as_one_long_running_supervisor(tmp_path: Path) -> None:
    reference = _one_supervisor_for_the_whole_table()

    restarted = _a_new_supervisor_for_each_step(tmp_path, lambda: "0f4b5a0e-8c1d-4f7e-9a51-3c2d1e0f9b8a")

    assert restarted == reference
    # The table reaches what it is meant to: each kind of drift repaired, a growing backoff, a reset.
    repairs = [engines for engines, _status in reference if engines]
    assert {why for engines in repairs for _name, why in engines} == {
        "not running (exited)",
        "lost readiness",
        "not ready since it was applied",
        "missing",
    }
    assert [
        status["chat"]["backoff_seconds"]
        for engines, status in reference
        if engines == (("chat", "not running (exited)"),)
    ] == [10.0, 20.0, 40.0, 10.0]
    assert reference[12][1].get("chat") is None  # healthy for healthy_reset_s: nothing left to report


def test_without_the_record_a_new_supervisor_each_cycle_never_repairs(tmp_path: Path) -> None:
    """What ``run --once`` did before the record: every run saw the killed engine for the first time."""
    clock = MonotonicClock(5000.0)
    decisions = []
    for seconds, observed in TABLE[:8]:
        clock.now += seconds
        supervisor = _supervisor(clock)
        supervisor.expect(GENERATION, ENGINES)
        decisions.append(_decide(supervisor, observed))

    assert [engines for engines, _status in decisions] == [None] * 8
    assert len([engines for engines, _status in _one_supervisor_for_the_whole_table()[:8] if engines]) == 3


def test_after_a_reboot_the_repair_count_is_kept_and_the_grace_starts_over(tmp_path: Path) -> None:
    before = _a_new_supervisor_for_each_step(tmp_path, lambda: "0f4b5a0e-8c1d-4f7e-9a51-3c2d1e0f9b8a", TABLE[:8])
    assert before[7][1]["chat"]["repairs"] == 3

    # The host rebooted: a new clock that starts near zero, a new boot id.
    clock = MonotonicClock(30.0)
    record = SupervisionRecord(tmp_path, boot_id=lambda: "7d3e2c1b-0a9f-4e8d-b7c6-5a4b3c2d1e0f")
    supervisor = _supervisor(clock)
    supervisor.expect(GENERATION, ENGINES)
    remembered = record.load(clock())
    assert remembered is not None and not remembered.same_clock and remembered.supervised is not None
    supervisor.resume(GENERATION, remembered.supervised.tracks, same_clock=False)
    crashed = [_exited("chat"), _up("embed"), _unready("slow")]

    assert supervisor.assess(crashed) is None  # first seen in this boot: Docker's restart policy goes first
    clock.now += 10
    drift = supervisor.assess(crashed)
    assert drift is not None and drift.engines == (("chat", "not running (exited)"),)
    supervisor.repaired(drift)
    assert supervisor.status()["chat"]["backoff_seconds"] == 40.0  # the 4th repair: the count went on
    # slow loads its model again after the reboot: the startup grace, from this boot's first look.
    assert supervisor.status()["slow"]["state"] == "settling"


# --- The agent ----------------------------------------------------------------------------------------------

AGENT_SUPERVISION = {
    "settle_seconds": 10,
    "startup_grace_seconds": 60,
    "backoff_initial_seconds": 10,
    "backoff_max_seconds": 40,
    "healthy_reset_seconds": 60,
}
IMAGE = LocalImage(tag=f"{E2E_REPOSITORY}:restarts", id="sha256:" + "5e" * 32)


class Killed(BaseException):
    """The agent's process dies here (SIGKILL, the OOM killer): nothing after this line of it runs."""


class Outcomes(Metrics):
    """The real metrics (on a registry of their own), keeping each cycle's outcome as ``run`` reports it."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[CycleStatus] = []

    def cycle_done(self, wall_s: float, outcome: Any) -> None:
        super().cycle_done(wall_s, outcome)
        self.outcomes.append(outcome.outcome)


@dataclass
class Host:
    """What the agents see, moved by the test: the engines Docker shows, whether an apply fails or kills the
    agent, and the reason of each apply asked for."""

    engines: list[dict[str, Any]] = field(default_factory=list)
    fail: bool = False
    kill: bool = False
    asked: list[str | None] = field(default_factory=list)
    on_apply: Callable[[], None] | None = None

    def apply(self, envelope: bytes, *, generation: int, reason: str | None = None, **_: Any) -> ApplyResult:
        self.asked.append(reason)
        if self.on_apply is not None:
            self.on_apply()
        if self.kill:
            raise Killed
        now = datetime.now(UTC)
        return ApplyResult(
            ident=f"gen-{generation}-{now:%Y%m%dT%H%M%S.%fZ}",
            generation=generation,
            status="failed" if self.fail else "successful",
            rc=2 if self.fail else 0,
            changed=0,
            failed=1 if self.fail else 0,
            journal=Path(),
            started_at=now,
            finished_at=now,
            wall_s=0.0,
            failures=["engine 'chat' never became ready: exit 1"] if self.fail else [],
        )


def _engine(name: str, state: str = "running", *, ready: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "managed": True,
        "driver": "vllm",
        "image": IMAGE.pinned,
        "state": state,
        "ready": ready,
        "draining": False,
        "port": 9450,
        "served_model_name": "tiny-chat",
    }


def _node(server: DevServer, root: Path, node_id: str) -> Node:
    node = make_e2e_node(server, root, node_id).node
    node.configure(supervision=AGENT_SUPERVISION)
    return node


def _serving_chat(server: DevServer, tmp_path: Path, node_id: str) -> tuple[Node, Host, MonotonicClock]:
    """A node whose published state runs one engine, ``chat``, which its host shows up; the clock at 5000 s."""
    node = _node(server, tmp_path / "node", node_id)
    publish(server, node_id, document={"engines": [engine_spec("chat", IMAGE, 9450)]})
    return node, Host(engines=UP), MonotonicClock(5000.0)


def _agent(node: Node, host: Host, clock: MonotonicClock, log: EventLogger | None = None) -> tuple[Agent, Outcomes]:
    """The agent as ``meridian-node run`` builds it, with the host's engines, its applies and the test's clock."""
    outcomes = Outcomes()
    observer = Observer(
        store_path=None,
        gpu_facts=lambda: {"nvml_available": False},
        engines=lambda: [dict(engine) for engine in host.engines],
        monotonic=clock,
    )
    agent = node.agent(observer=observer, applier=host, monotonic=clock, metrics=outcomes)
    if log is not None:
        agent.log = agent.record.log = log
    return agent, outcomes


@dataclass
class Seen:
    outcome: CycleStatus
    asked: list[str | None]
    supervision: dict[str, dict[str, Any]]
    retry: dict[str, Any] | None


def _seen(agent: Agent, outcome: CycleStatus, host: Host) -> Seen:
    asked, host.asked = host.asked, []
    retry = None if agent._retry is None else agent._retry.status(agent.monotonic())
    if retry is not None:  # wall-clock times differ between two hosts; the pacing must not
        retry = {key: retry[key] for key in ("state", "failures", "backoff_seconds", "next_attempt_in_seconds")}
    return Seen(outcome, asked, agent.supervisor.status(), retry)


Script = list[tuple[float, Callable[[Host], None]]]


def _long_running(node: Node, script: Script) -> list[Seen]:
    host, clock = Host(), MonotonicClock(5000.0)
    agent, _ = _agent(node, host, clock)
    agent.resume_supervision()
    agent.recover()
    seen = []
    for seconds, change in script:
        clock.now += seconds
        change(host)
        seen.append(_seen(agent, agent.cycle().outcome, host))
    return seen


def _once_per_step(node: Node, script: Script) -> list[Seen]:
    host, clock = Host(), MonotonicClock(5000.0)
    seen = []
    for seconds, change in script:
        clock.now += seconds
        change(host)
        agent, outcomes = _agent(node, host, clock)
        agent.run(once=True)
        [outcome] = outcomes.outcomes
        seen.append(_seen(agent, outcome, host))
    return seen


def _set(**values: Any) -> Callable[[Host], None]:
    def change(host: Host) -> None:
        for name, value in values.items():
            setattr(host, name, value)

    return change


UP, DOWN, UNREADY = [_engine("chat")], [_engine("chat", "exited", ready=False)], [_engine("chat", ready=False)]
KEEP = _set()

DRIFT: Script = [
    (1, _set(engines=UP)),  # applied
    (1, KEEP),
    (1, _set(engines=DOWN)),  # killed: first seen
    (5, KEEP),
    (5, KEEP),  # repair 1
    (1, KEEP),  # the engine crashes again at once: backing off
    (9, KEEP),  # repair 2
    (10, KEEP),
    (10, KEEP),  # repair 3
    (1, _set(engines=UP)),
    (40, _set(engines=UNREADY)),  # lost readiness (it was seen ready): the settle time, not the startup grace
    (10, KEEP),  # repair 4
    (1, _set(engines=UP)),
    (61, KEEP),  # healthy for healthy_reset_seconds: the count is forgotten
    (1, _set(engines=DOWN)),
    (10, KEEP),  # repaired, and the backoff is back at its first step
    (1, KEEP),
]

RETRY: Script = [
    (1, _set(engines=DOWN, fail=True)),  # the state's apply fails
    (1, KEEP),  # backing off 10 s
    (9, KEEP),  # retry 1 fails
    (10, KEEP),  # backing off 20 s
    (10, KEEP),  # retry 2 fails
    (1, _set(fail=False, engines=UP)),  # fixed (an image pulled meanwhile), but the backoff still holds
    (39, KEEP),  # retry 3 succeeds
    (1, KEEP),
]


@pytest.mark.parametrize(("script", "kind"), [(DRIFT, "drift"), (RETRY, "retry")], ids=["drift", "apply-retry"])
def test_run_once_each_cycle_decides_exactly_as_one_long_running_agent(
    server: DevServer, tmp_path: Path, node_id: str, script: Script, kind: str
) -> None:
    spec = {"engines": [engine_spec("chat", IMAGE, 9450)]}
    long_node = _node(server, tmp_path / "long", f"{node_id}-long")
    once_node = _node(server, tmp_path / "once", f"{node_id}-once")
    publish(server, long_node.node_id, document=spec)
    publish(server, once_node.node_id, document=spec)

    reference = _long_running(long_node, script)
    restarted = _once_per_step(once_node, script)

    assert restarted == reference
    outcomes = [seen.outcome for seen in reference]
    asked = [reason for seen in reference for reason in seen.asked]
    if kind == "drift":
        assert outcomes.count(CycleStatus.REPAIRED) == 5, outcomes
        assert asked[1:] == [
            *["drift: chat: not running (exited)"] * 3,
            "drift: chat: lost readiness",
            "drift: chat: not running (exited)",
        ]
        assert reference[-2].supervision["chat"]["backoff_seconds"] == 10.0  # forgotten after 61 s healthy
    else:
        assert outcomes == [
            CycleStatus.APPLY_FAILED,
            CycleStatus.APPLY_BACKING_OFF,
            CycleStatus.APPLY_FAILED,
            CycleStatus.APPLY_BACKING_OFF,
            CycleStatus.APPLY_FAILED,
            CycleStatus.APPLY_BACKING_OFF,
            CycleStatus.APPLIED,
            CycleStatus.UNCHANGED,
        ]
        assert asked == [None, *[f"retry after {n} failed apply(s)" for n in (1, 2, 3)]]
        assert reference[5].retry == {
            "state": "backing-off",
            "failures": 3,
            "backoff_seconds": 40.0,
            "next_attempt_in_seconds": 39.0,
        }


def test_without_the_record_run_once_never_repairs_a_killed_engine(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    """The issue as filed: the record removed before each run, four ``run --once`` over 45 s repair nothing."""
    node, host, clock = _serving_chat(server, tmp_path, node_id)
    agent, _ = _agent(node, host, clock)
    agent.run(once=True)
    host.engines, host.asked = DOWN, []
    for _ in range(4):
        clock.now += 15
        (node.state_dir / RECORD_FILE).unlink(missing_ok=True)
        agent, outcomes = _agent(node, host, clock)
        agent.run(once=True)
        assert outcomes.outcomes == [CycleStatus.UNCHANGED]
    assert host.asked == []


def test_an_agent_killed_during_a_repair_finds_it_counted_and_backs_off_when_it_starts_again(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    node, host, clock = _serving_chat(server, tmp_path, node_id)

    def once() -> tuple[Agent, list[CycleStatus]]:
        agent, outcomes = _agent(node, host, clock)
        agent.run(once=True)
        return agent, outcomes.outcomes

    assert once()[1] == [CycleStatus.APPLIED]
    host.engines = DOWN
    clock.now += 1
    assert once()[1] == [CycleStatus.UNCHANGED]  # first seen
    clock.now += 10
    recorded: list[int] = []
    host.kill = True
    host.on_apply = lambda: recorded.append(
        json.loads((node.state_dir / RECORD_FILE).read_text())["supervised"]["engines"]["chat"]["repairs"]
    )
    with pytest.raises(Killed):
        once()
    assert recorded == [1]  # the repair was on disk before its apply began: record, then act

    host.kill, host.on_apply, host.asked = False, None, []
    clock.now += 1
    agent, outcomes = once()  # the agent's supervisor (systemd) starts it again at once
    assert outcomes == [CycleStatus.UNCHANGED] and host.asked == []
    assert agent.supervisor.status()["chat"]["state"] == "backing-off"
    clock.now += 9
    assert once()[1] == [CycleStatus.REPAIRED]
    assert host.asked == ["drift: chat: not running (exited)"]


def test_a_record_written_for_another_state_is_not_used(server: DevServer, tmp_path: Path, node_id: str) -> None:
    node, host, clock = _serving_chat(server, tmp_path, node_id)
    agent, _ = _agent(node, host, clock)
    agent.run(once=True)
    stale = {
        "chat": EngineTrack(
            name="chat", expected_since=1.0, seen_ready=True, problem="missing", bad_since=2.0, repairs=5
        )
    }
    SupervisionRecord(node.state_dir).save(RememberedState(99, "cd" * 32, stale), None)
    events = SeenEvents()
    clock.now += 1

    agent, outcomes = _agent(node, host, clock, log=events)
    agent.run(once=True)

    assert outcomes.outcomes == [CycleStatus.UNCHANGED]
    [not_used] = [fields for event, fields in events.seen if event == "supervision-record-not-used"]
    assert (not_used["part"], not_used["recorded_generation"]) == ("supervised", 99)
    assert agent.supervisor.tracks["chat"].repairs == 0
    document = json.loads((node.state_dir / RECORD_FILE).read_text())
    assert document["supervised"]["generation"] == agent.supervisor.generation != 99  # replaced by this state's


def test_an_idle_agent_writes_no_record_per_cycle(server: DevServer, tmp_path: Path, node_id: str) -> None:
    node, host, clock = _serving_chat(server, tmp_path, node_id)
    agent, _ = _agent(node, host, clock)
    agent.run(once=True)  # applies, and sees the engine ready: one write
    path = node.state_dir / RECORD_FILE
    written = path.stat()

    for _ in range(50):  # a long-running agent, idle
        clock.now += 1
        assert agent.cycle().outcome == CycleStatus.UNCHANGED
    for _ in range(5):  # run --once from cron, idle
        clock.now += 60
        again, _ = _agent(node, host, clock)
        again.run(once=True)
        assert again.record.writes == 0

    assert agent.record.writes == 1
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)

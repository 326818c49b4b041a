"""Supervision as data: observations and a clock in, the repair due out (``agent_side/supervise.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock
from meridian_node_agent.agent_side.supervise import Supervisor


def _engine(
    name: str = "chat", *, state: str = "running", ready: bool = True, draining: bool = False
) -> dict[str, Any]:
    return {"name": name, "state": state, "ready": ready, "draining": draining}


@pytest.fixture
def clock() -> MonotonicClock:
    return MonotonicClock()


@pytest.fixture
def supervisor(clock: MonotonicClock) -> Supervisor:
    watch = Supervisor(settle_s=10, startup_grace_s=300, clock=clock)
    watch.expect(4, ["chat"])
    return watch


def _crashed_since_10s(supervisor: Supervisor, clock: MonotonicClock) -> list[dict[str, Any]]:
    """The engine list of a host whose engine ``supervisor`` saw exited 10 s ago (so its first repair is due)."""
    crashed = [_engine(state="exited", ready=False)]
    supervisor.assess(crashed)
    clock.now += 10
    return crashed


@pytest.mark.parametrize(
    ("observed", "why"),
    [
        ([], "missing"),
        ([_engine(state="exited")], "not running (exited)"),
    ],
    ids=["missing", "exited"],
)
def test_an_engine_gone_or_stopped_longer_than_the_settle_time_is_drift(
    supervisor: Supervisor, clock: MonotonicClock, observed: list[dict[str, Any]], why: str
) -> None:
    assert supervisor.assess(observed) is None  # first seen: Docker's restart policy gets the first go
    clock.now += 9.9
    assert supervisor.assess(observed) is None
    clock.now += 0.1

    drift = supervisor.assess(observed)

    assert drift is not None and (drift.generation, drift.engines) == (4, (("chat", why),))
    assert drift.describe() == f"chat: {why}"


def test_a_brief_restart_by_docker_is_not_drift(supervisor: Supervisor, clock: MonotonicClock) -> None:
    assert supervisor.assess([_engine()]) is None
    assert supervisor.assess([_engine(state="restarting", ready=False)]) is None
    clock.now += 5
    assert supervisor.assess([_engine()]) is None
    clock.now += 60
    assert supervisor.assess([_engine()]) is None


def test_losing_readiness_is_drift_after_settling_but_a_slow_first_start_gets_the_startup_grace(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    loading = [_engine(ready=False)]
    assert supervisor.assess(loading) is None
    clock.now += 299
    assert supervisor.assess(loading) is None
    clock.now += 1
    drift = supervisor.assess(loading)
    assert drift is not None and drift.engines == (("chat", "not ready since it was applied"),)

    other = Supervisor(settle_s=10, clock=clock)
    other.expect(4, ["chat"])
    assert other.assess([_engine()]) is None
    assert other.assess(loading) is None
    clock.now += 10
    drift = other.assess(loading)
    assert drift is not None and drift.engines == (("chat", "lost readiness"),)


def test_a_draining_engine_is_left_stopped(supervisor: Supervisor, clock: MonotonicClock) -> None:
    drained = [_engine(state="exited", ready=False, draining=True)]
    assert supervisor.assess(drained) is None
    clock.now += 3600
    assert supervisor.assess(drained) is None
    assert supervisor.status() == {}


def test_repairs_of_a_crash_looping_engine_back_off_10s_doubling_to_5_minutes(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    crashed = _crashed_since_10s(supervisor, clock)
    waits = []
    for _ in range(8):
        drift = supervisor.assess(crashed)
        assert drift is not None
        supervisor.repaired(drift)
        started = clock.now
        while supervisor.assess(crashed) is None:  # each repair: up for a moment, then crashed again
            clock.now += 1
        waits.append(clock.now - started)

    assert waits == [10, 20, 40, 80, 160, 300, 300, 300]
    assert supervisor.status()["chat"] == {
        "state": "repair-due",
        "problem": "not running (exited)",
        "for_seconds": pytest.approx(clock.now - 1000),  # crashed since the first look
        "repairs": 8,
        "backoff_seconds": 300.0,
        "next_repair_in_seconds": 0.0,
    }


def test_ten_minutes_healthy_forget_the_backoff_but_a_short_recovery_does_not(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    crashed, healthy = [_engine(state="exited", ready=False)], [_engine()]
    supervisor.assess(crashed)
    clock.now += 10
    for _ in range(3):
        drift = supervisor.assess(crashed)
        assert drift is not None
        supervisor.repaired(drift)
        clock.now += supervisor.backoff(supervisor.tracks["chat"].repairs)
    supervisor.assess(healthy)
    clock.now += 599
    supervisor.assess(healthy)
    assert supervisor.tracks["chat"].repairs == 3
    clock.now += 1
    supervisor.assess(healthy)
    assert supervisor.tracks["chat"].repairs == 0

    supervisor.assess(crashed)
    clock.now += 10
    drift = supervisor.assess(crashed)
    assert drift is not None
    supervisor.repaired(drift)
    assert supervisor.tracks["chat"].retry_at == clock.now + 10  # back to the first step


def test_only_engines_not_backing_off_trigger_a_repair_and_are_named(clock: MonotonicClock) -> None:
    supervisor = Supervisor(settle_s=0, clock=clock)
    supervisor.expect(7, ["a", "b"])
    first = supervisor.assess([_engine("b")])
    assert first is not None and first.engines == (("a", "missing"),)
    supervisor.repaired(first)

    clock.now += 1
    second = supervisor.assess([])  # a is backing off (10 s); b just went missing

    assert second is not None and second.engines == (("b", "missing"),)


def test_the_same_generation_again_keeps_the_backoff_and_a_new_one_starts_over(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    supervisor.assess([])
    clock.now += 10
    drift = supervisor.assess([])
    assert drift is not None
    supervisor.repaired(drift)

    supervisor.expect(4, ["chat"])  # the repair's own apply succeeded
    assert supervisor.tracks["chat"].repairs == 1
    supervisor.expect(5, ["chat"])
    assert supervisor.tracks["chat"].repairs == 0 and supervisor.generation == 5


def test_nothing_is_supervised_before_a_state_is_applied(clock: MonotonicClock) -> None:
    assert Supervisor(clock=clock).assess([]) is None


def test_an_engine_changed_by_hand_is_drift_naming_the_settings(supervisor: Supervisor, clock: MonotonicClock) -> None:
    changed = [{**_engine(), "drifted": ["restart_policy", "memory"]}]
    assert supervisor.assess(changed) is None  # a replace in progress settles first, like a missing engine
    assert supervisor.status()["chat"]["state"] == "settling"
    clock.now += 10

    drift = supervisor.assess(changed)

    assert drift is not None and drift.engines == (("chat", "changed by hand: restart_policy, memory"),)
    assert supervisor.status()["chat"]["state"] == "repair-due"


@pytest.mark.parametrize("drifted", [None, [], ()], ids=["no-digests", "empty-list", "empty-tuple"])
def test_an_engine_with_no_drifted_settings_or_none_to_compare_is_healthy(
    supervisor: Supervisor, clock: MonotonicClock, drifted: Any
) -> None:
    for _ in range(3):
        assert supervisor.assess([{**_engine(), "drifted": drifted}]) is None
        clock.now += 10
    assert supervisor.status() == {}


def test_status_says_backing_off_and_how_long_the_backoff_is_until_it_is_due(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    crashed = _crashed_since_10s(supervisor, clock)
    for expected_backoff in (10.0, 20.0):
        drift = supervisor.assess(crashed)
        assert drift is not None
        supervisor.repaired(drift)
        clock.now += 1
        assert supervisor.assess(crashed) is None
        shown = supervisor.status()["chat"]
        assert (shown["state"], shown["backoff_seconds"]) == ("backing-off", expected_backoff)
        assert shown["next_repair_in_seconds"] == expected_backoff - 1
        clock.now += expected_backoff - 1
        assert supervisor.status()["chat"]["state"] == "repair-due"


# --- engines on a GPU that turned unhealthy ---------------------------------------------------------------

_FACTS: dict[str, Any] = {
    "gpus": [
        {"index": 0, "uuid": "GPU-good", "mig_instances": [], "health": {"verdict": "healthy", "reasons": []}},
        {
            "index": 1,
            "uuid": "GPU-bad",
            "mig_instances": [{"uuid": "MIG-bad-1"}],
            "health": {
                "verdict": "unhealthy",
                "reasons": [{"code": "xid-critical", "source": "nvmlEventSetWait", "value": 79}],
            },
        },
        {"index": 2, "uuid": "GPU-slow", "mig_instances": [], "health": {"verdict": "degraded", "reasons": []}},
    ]
}


def test_engines_on_an_unhealthy_gpu_are_found_by_uuid_index_or_mig_instance() -> None:
    from meridian_node_agent.agent_side.supervise import engines_on_unhealthy_gpus

    trouble = engines_on_unhealthy_gpus(
        [
            {"name": "by-uuid", "gpus": ["GPU-bad"]},
            {"name": "by-index", "gpus": ["0", "1"]},
            {"name": "by-mig", "gpus": ["MIG-bad-1"]},
            {"name": "fine", "gpus": ["0"]},
            {"name": "degraded-only", "gpus": ["2"]},
            {"name": "cpu", "gpus": []},
        ],
        _FACTS,
    )

    assert set(trouble) == {"by-uuid", "by-index", "by-mig"}
    assert trouble["by-mig"] == "on unhealthy GPU GPU-bad (xid-critical)"


def test_a_running_engine_on_an_unhealthy_gpu_is_reported_never_repaired(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    trouble = {"chat": "on unhealthy GPU GPU-bad (xid-critical)"}

    assert supervisor.assess([_engine()], trouble) is None
    clock.now += 3600
    assert supervisor.assess([_engine()], trouble) is None, "a repair cannot move it: the state pins its GPUs"
    report = supervisor.status()["chat"]
    assert report["state"] == "reported"
    assert report["problem"] == "on unhealthy GPU GPU-bad (xid-critical)"
    assert report["for_seconds"] == 3600.0
    assert report["repairs"] == 0


def test_a_stopped_engine_on_an_unhealthy_gpu_is_still_repaired_and_a_healed_gpu_clears_the_report(
    supervisor: Supervisor, clock: MonotonicClock
) -> None:
    trouble = {"chat": "on unhealthy GPU GPU-bad (xid-critical)"}
    supervisor.assess([_engine(state="exited", ready=False)], trouble)
    clock.now += 10

    drift = supervisor.assess([_engine(state="exited", ready=False)], trouble)
    assert drift is not None and drift.engines == (("chat", "not running (exited)"),)
    supervisor.repaired(drift)
    supervisor.assess([_engine()], {})
    assert supervisor.status()["chat"]["state"] == "healthy"

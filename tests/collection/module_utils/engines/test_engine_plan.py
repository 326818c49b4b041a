"""engine_plan: every (target state, what Docker shows) pair, as a table row; and every container setting
that reaches the config hash, as a row that replaces the engine."""

from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.instance import engine_settings, poll_intervals
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    Action,
    NameTakenError,
    Observed,
    plan_engine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import parse_engine_spec

NEW = "hash-new"
OLD = "hash-old"
SPEC = {"image": "registry.local/vllm@sha256:" + "1" * 64, "port": 8000}

DRAIN, STOP, REMOVE, CREATE, START, READY = (
    Action.DRAIN,
    Action.STOP,
    Action.REMOVE,
    Action.CREATE,
    Action.START,
    Action.WAIT_READY,
)


def ours(status: str, config_hash: str = NEW) -> Observed:
    return Observed(owned=True, status=status, config_hash=config_hash, spec={"port": 8000})


# (target state, observed container, replace strategy, expected actions)
ROWS: list[tuple[str, Observed | None, str, tuple[Action, ...]]] = [
    # nothing there yet
    ("absent", None, "drain-then-replace", ()),
    ("present", None, "drain-then-replace", (CREATE,)),
    ("stopped", None, "drain-then-replace", (CREATE,)),
    ("started", None, "drain-then-replace", (CREATE, START, READY)),
    # same spec: converged, or only the running state differs
    ("started", ours("running"), "drain-then-replace", ()),
    ("present", ours("running"), "drain-then-replace", ()),
    ("present", ours("exited"), "drain-then-replace", ()),
    ("stopped", ours("exited"), "drain-then-replace", ()),
    ("stopped", ours("created"), "drain-then-replace", ()),
    ("started", ours("exited"), "drain-then-replace", (START, READY)),
    ("started", ours("created"), "drain-then-replace", (START, READY)),
    ("stopped", ours("running"), "drain-then-replace", (STOP,)),
    ("stopped", ours("paused"), "drain-then-replace", (STOP,)),
    # removal
    ("absent", ours("running"), "drain-then-replace", (STOP, REMOVE)),
    ("absent", ours("restarting"), "stop-then-start", (STOP, REMOVE)),
    ("absent", ours("exited"), "drain-then-replace", (REMOVE,)),
    # Docker restarting a crashed engine under its restart policy: it is live, and it is ours to keep or stop
    ("started", ours("restarting"), "drain-then-replace", ()),
    ("present", ours("restarting"), "drain-then-replace", ()),
    ("stopped", ours("restarting"), "drain-then-replace", (STOP,)),
    ("started", ours("restarting", OLD), "drain-then-replace", (DRAIN, STOP, REMOVE, CREATE, START, READY)),
    ("started", ours("restarting", OLD), "stop-then-start", (STOP, REMOVE, CREATE, START, READY)),
    # changed spec: replace, draining a live engine first unless told not to
    ("started", ours("running", OLD), "drain-then-replace", (DRAIN, STOP, REMOVE, CREATE, START, READY)),
    ("started", ours("running", OLD), "stop-then-start", (STOP, REMOVE, CREATE, START, READY)),
    ("started", ours("exited", OLD), "drain-then-replace", (REMOVE, CREATE, START, READY)),
    ("present", ours("running", OLD), "drain-then-replace", (DRAIN, STOP, REMOVE, CREATE, START, READY)),
    ("present", ours("exited", OLD), "drain-then-replace", (REMOVE, CREATE)),
    ("stopped", ours("running", OLD), "drain-then-replace", (DRAIN, STOP, REMOVE, CREATE)),
    ("stopped", ours("exited", OLD), "stop-then-start", (REMOVE, CREATE)),
    # a dead container is never "converged", whatever its labels say
    ("started", ours("dead"), "drain-then-replace", (REMOVE, CREATE, START, READY)),
]


@pytest.mark.parametrize(("state", "observed", "strategy", "expected"), ROWS)
def test_plan(state: Any, observed: Observed | None, strategy: Any, expected: tuple[Action, ...]) -> None:
    plan = plan_engine(
        name="chat", state=state, config_hash=NEW, spec=SPEC, observed=observed, replace_strategy=strategy
    )
    assert plan.actions == expected
    assert plan.changed is bool(expected)


def test_converged_plan_diff_is_empty_change() -> None:
    plan = plan_engine(name="chat", state="started", config_hash=NEW, spec=SPEC, observed=ours("running"))
    assert plan.diff()["before"] == plan.diff()["after"]


def test_replacement_diff_shows_old_and_new_spec() -> None:
    plan = plan_engine(name="chat", state="started", config_hash=NEW, spec=SPEC, observed=ours("running", OLD))
    assert plan.replaces
    assert plan.diff() == {
        "before": {"state": "started", "config_hash": OLD, "spec": {"port": 8000}},
        "after": {"state": "started", "config_hash": NEW, "spec": SPEC},
    }


def test_stop_diff_keeps_the_spec_and_changes_the_state() -> None:
    plan = plan_engine(name="chat", state="stopped", config_hash=NEW, spec=SPEC, observed=ours("running"))
    assert (plan.diff()["before"]["state"], plan.diff()["after"]["state"]) == ("started", "stopped")


def test_absent_diff_after_is_empty() -> None:
    plan = plan_engine(name="chat", state="absent", config_hash=NEW, spec=SPEC, observed=ours("exited"))
    assert plan.diff()["after"] == {}


def test_no_wait_ready_when_not_asked() -> None:
    plan = plan_engine(name="chat", state="started", config_hash=NEW, spec=SPEC, observed=None, wait_ready=False)
    assert plan.actions == (CREATE, START)


@pytest.mark.parametrize("state", ["present", "started", "stopped", "absent"])
def test_a_foreign_container_with_our_name_is_refused_in_every_state(state: Any) -> None:
    foreign = Observed(owned=False, status="running")
    with pytest.raises(NameTakenError, match=r"'chat' exists but was not created by meridian\.node"):
        plan_engine(name="chat", state=state, config_hash=NEW, spec=SPEC, observed=foreign)


# --- the host settings reach the config hash -----------------------------------------------------------------

ENGINE: dict[str, Any] = {
    "name": "chat",
    "driver": "vllm",
    "image": "registry.local/vllm@sha256:" + "1" * 64,
    "model": {"name": "tiny"},
    "port": 8000,
}


def hash_of(**changes: Any) -> str:
    """The config hash engine_instance computes for ENGINE with ``changes`` (labels included), without Docker."""
    spec = parse_engine_spec({**ENGINE, **changes})
    launch = get_driver(spec.driver).container_settings(spec)
    return engine_settings(spec, launch, bind_address="127.0.0.1").config_hash()


# (what changed, from, to): each one alone must replace a running engine, drained first
CHANGES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("restart policy set", {}, {"restart_policy": "on-failure"}),
    ("restart policy off", {}, {"restart_policy": "no"}),
    ("shm from the driver's to the spec's", {}, {"shm_size_mib": 2048}),
    ("shm resized", {"shm_size_mib": 2048}, {"shm_size_mib": 4096}),
    ("host IPC", {}, {"ipc_mode": "host"}),
    ("ulimit added", {}, {"ulimits": {"memlock": -1}}),
    ("ulimit raised", {"ulimits": {"stack": 8388608}}, {"ulimits": {"stack": 67108864}}),
    ("soft limit only", {"ulimits": {"nofile": 65536}}, {"ulimits": {"nofile": {"soft": 1024, "hard": 65536}}}),
    ("volume added", {}, {"volumes": [{"source": "/srv/tok", "target": "/tok"}]}),
    (
        "volume moved",
        {"volumes": [{"source": "/srv/tok", "target": "/tok"}]},
        {"volumes": [{"source": "/srv/tok", "target": "/data/tok"}]},
    ),
    ("label added", {}, {"labels": {"com.example.team": "search"}}),
    ("label changed", {"labels": {"com.example.team": "search"}}, {"labels": {"com.example.team": "chat"}}),
]


@pytest.mark.parametrize(("before", "after"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_changed_host_setting_drains_and_replaces_the_running_engine(
    before: dict[str, Any], after: dict[str, Any]
) -> None:
    running = Observed(owned=True, status="running", config_hash=hash_of(**before), spec={})
    plan = plan_engine(name="chat", state="started", config_hash=hash_of(**after), spec=SPEC, observed=running)
    assert plan.actions == (DRAIN, STOP, REMOVE, CREATE, START, READY)


# (what, one spelling, another of the same container): no change, no action
SAME: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("defaults spelt out", {}, {"restart_policy": "unless-stopped", "ipc_mode": "private", "ulimits": {}}),
    ("one number for both limits", {"ulimits": {"stack": 8}}, {"ulimits": {"stack": {"soft": 8, "hard": 8}}}),
    (
        "limits and labels in another order",
        {"ulimits": {"stack": 8, "core": 0}, "labels": {"a.b": "1", "c.d": "2"}},
        {"ulimits": {"core": 0, "stack": 8}, "labels": {"c.d": "2", "a.b": "1"}},
    ),
]


@pytest.mark.parametrize(("first", "second"), [c[1:] for c in SAME], ids=[c[0] for c in SAME])
def test_the_same_host_settings_however_spelt_change_nothing(first: dict[str, Any], second: dict[str, Any]) -> None:
    running = Observed(owned=True, status="running", config_hash=hash_of(**first), spec={})
    plan = plan_engine(name="chat", state="started", config_hash=hash_of(**second), spec=SPEC, observed=running)
    assert plan.actions == ()


def test_readiness_is_probed_soon_after_the_start_then_every_quarter_second() -> None:
    intervals = poll_intervals()
    assert [next(intervals) for _ in range(7)] == [0.05, 0.1, 0.2, 0.25, 0.25, 0.25, 0.25]

"""engine_plan: every (target state, what Docker shows) pair, as a table row; and every container setting
that reaches the config hash, as a row that replaces the engine."""

from functools import partial
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import engine_settings
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.waits import poll_intervals
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    Action,
    NameTakenError,
    Observed,
    Room,
    aside_name,
    plan_engine,
    rollback_actions,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import parse_engine_spec
from ansible_collections.meridian.node.tests.support.trust_fixtures import vllm_engine

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
ASIDE, BESIDE, DRAIN_OLD, STOP_OLD, REMOVE_OLD, PROMOTE, CLEAN_UP = (
    Action.SET_ASIDE,
    Action.CREATE_BESIDE,
    Action.DRAIN_OLD,
    Action.STOP_OLD,
    Action.REMOVE_OLD,
    Action.PROMOTE,
    Action.CLEAN_UP,
)
ROOM = Room(port=8001)
NO_ROOM = Room(why_not="no free port in the policy's range 8000-8000 on 127.0.0.1")


# The engine every row plans: "chat", with SPEC hashed as NEW unless a row says otherwise.
plan_chat = partial(plan_engine, name="chat", config_hash=NEW, spec=SPEC)


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
    # a crash-looping old engine serves nothing: retired, then the new one built
    ("started", ours("restarting", OLD), "drain-then-replace", (DRAIN, STOP, REMOVE, CREATE, START, READY)),
    ("started", ours("restarting", OLD), "stop-then-start", (STOP, REMOVE, CREATE, START, READY)),
    # changed spec of a running engine that stays live, no room beside it: stopped but kept until the new is ready
    ("started", ours("running", OLD), "drain-then-replace", (DRAIN, STOP, ASIDE, CREATE, START, READY, REMOVE_OLD)),
    ("started", ours("running", OLD), "stop-then-start", (STOP, ASIDE, CREATE, START, READY, REMOVE_OLD)),
    ("present", ours("running", OLD), "drain-then-replace", (DRAIN, STOP, ASIDE, CREATE, START, READY, REMOVE_OLD)),
    # nothing serving to keep: retire, then build
    ("started", ours("exited", OLD), "drain-then-replace", (REMOVE, CREATE, START, READY)),
    ("present", ours("exited", OLD), "drain-then-replace", (REMOVE, CREATE)),
    ("stopped", ours("running", OLD), "drain-then-replace", (DRAIN, STOP, REMOVE, CREATE)),
    ("stopped", ours("exited", OLD), "stop-then-start", (REMOVE, CREATE)),
    # a dead container is never "converged", whatever its labels say
    ("started", ours("dead"), "drain-then-replace", (REMOVE, CREATE, START, READY)),
]


@pytest.mark.parametrize(("state", "observed", "strategy", "expected"), ROWS)
def test_plan(state: Any, observed: Observed | None, strategy: Any, expected: tuple[Action, ...]) -> None:
    plan = plan_chat(state=state, observed=observed, replace_strategy=strategy)
    assert plan.actions == expected
    assert plan.changed is bool(expected)


# (target state, observed, strategy, room, wait_ready, expected way, expected actions): how a replace keeps the
# model served, as the caller's room decides
REPLACES: list[tuple[str, Observed, str, Room | None, bool, str, tuple[Action, ...]]] = [
    # room: the new one starts beside the old, which drains only once the new one is ready
    (
        "started",
        ours("running", OLD),
        "drain-then-replace",
        ROOM,
        True,
        "beside",
        (BESIDE, START, READY, DRAIN_OLD, STOP_OLD, REMOVE_OLD, PROMOTE),
    ),
    (
        "started",
        ours("running", OLD),
        "stop-then-start",
        ROOM,
        True,
        "beside",
        (BESIDE, START, READY, STOP_OLD, REMOVE_OLD, PROMOTE),
    ),
    (
        "present",
        ours("running", OLD),
        "drain-then-replace",
        ROOM,
        True,
        "beside",
        (BESIDE, START, READY, DRAIN_OLD, STOP_OLD, REMOVE_OLD, PROMOTE),
    ),
    # no room (or none looked for): in place, the old one kept aside for a rollback
    (
        "started",
        ours("running", OLD),
        "drain-then-replace",
        NO_ROOM,
        True,
        "in-place",
        (DRAIN, STOP, ASIDE, CREATE, START, READY, REMOVE_OLD),
    ),
    (
        "started",
        ours("running", OLD),
        "drain-then-replace",
        None,
        True,
        "in-place",
        (DRAIN, STOP, ASIDE, CREATE, START, READY, REMOVE_OLD),
    ),
    # without a readiness wait nothing says the new one works: neither way can hold on to the old one
    (
        "started",
        ours("running", OLD),
        "drain-then-replace",
        ROOM,
        False,
        "recreate",
        (DRAIN, STOP, REMOVE, CREATE, START),
    ),
    # an old one that serves nothing, or an engine asked to stop: room changes nothing
    ("started", ours("exited", OLD), "drain-then-replace", ROOM, True, "recreate", (REMOVE, CREATE, START, READY)),
    (
        "started",
        ours("restarting", OLD),
        "stop-then-start",
        ROOM,
        True,
        "recreate",
        (STOP, REMOVE, CREATE, START, READY),
    ),
    ("stopped", ours("running", OLD), "drain-then-replace", ROOM, True, "recreate", (DRAIN, STOP, REMOVE, CREATE)),
]


@pytest.mark.parametrize(("state", "observed", "strategy", "room", "wait", "way", "expected"), REPLACES)
def test_replace_way(
    state: Any, observed: Observed, strategy: Any, room: Room | None, wait: bool, way: str, expected: tuple[Action, ...]
) -> None:
    plan = plan_chat(state=state, observed=observed, replace_strategy=strategy, wait_ready=wait, room=room)
    assert (plan.way, plan.actions) == (way, expected)
    assert plan.diff()["after"]["replace"]["way"] == way
    assert plan.why


def test_the_diff_says_why_there_was_no_room() -> None:
    plan = plan_chat(state="started", observed=ours("running", OLD), room=NO_ROOM)
    assert "no free port in the policy's range 8000-8000" in plan.diff()["after"]["replace"]["why"]
    beside = plan_chat(state="started", observed=ours("running", OLD), room=ROOM)
    assert "free port 8001" in beside.why


@pytest.mark.parametrize(
    ("state", "observed", "expected"),
    [
        ("started", ours("running"), (CLEAN_UP,)),
        ("started", None, (CLEAN_UP, CREATE, START, READY)),
        ("absent", None, (CLEAN_UP,)),
        ("absent", ours("exited"), (CLEAN_UP, REMOVE)),
    ],
)
def test_what_an_interrupted_replace_left_is_cleaned_up_first(
    state: Any, observed: Observed | None, expected: tuple[Action, ...]
) -> None:
    plan = plan_chat(state=state, observed=observed, leftovers=(aside_name("chat", "old"),))
    assert plan.actions == expected


def test_aside_names_cannot_be_engine_names() -> None:
    assert (aside_name("chat", "new"), aside_name("chat", "old")) == ("chat.NEW", "chat.OLD")
    with pytest.raises(ValueError, match="is not one of"):
        aside_name("chat", "tmp")


# (way, actions done when a step failed, what the rollback does[, the step that failed])
ROLLBACKS: list[tuple[Any, ...]] = [
    # beside: nothing of the old was touched before the new one was created: nothing to undo
    ("beside", (), ()),
    ("beside", (BESIDE,), ("stop-new", "remove-new")),
    ("beside", (BESIDE, START), ("stop-new", "remove-new")),
    ("beside", (BESIDE, START, READY, DRAIN_OLD), ("stop-new", "remove-new", "undrain-old")),
    ("beside", (BESIDE, START, READY), ("stop-new", "remove-new", "undrain-old"), DRAIN_OLD),
    # once the old one is stopped, the new one is serving: a later failure is reported, not undone
    ("beside", (BESIDE, START, READY, DRAIN_OLD, STOP_OLD), ()),
    ("beside", (BESIDE, START, READY, DRAIN_OLD, STOP_OLD, REMOVE_OLD), ()),
    # in place: before the old one is set aside a failure leaves it as the drain/stop left it (as before)
    ("in-place", (DRAIN,), ()),
    ("in-place", (DRAIN, STOP), ()),
    ("in-place", (DRAIN, STOP, ASIDE), ("restore-old", "start-old", "wait-ready-old")),
    (
        "in-place",
        (DRAIN, STOP, ASIDE, CREATE, START),
        ("stop-new", "remove-new", "restore-old", "start-old", "wait-ready-old"),
    ),
    ("in-place", (DRAIN, STOP, ASIDE, CREATE, START, READY, REMOVE_OLD), ()),
    # not a replace, or a recreate: nothing is kept to go back to
    (None, (CREATE, START), ()),
    ("recreate", (DRAIN, STOP, REMOVE, CREATE, START), ()),
]


@pytest.mark.parametrize("row", ROLLBACKS)
def test_rollback(row: tuple[Any, ...]) -> None:
    way, done, expected, failed = (*row, None)[:4]
    assert rollback_actions(way, [str(action) for action in done], None if failed is None else str(failed)) == expected


def test_converged_plan_diff_is_empty_change() -> None:
    plan = plan_chat(state="started", observed=ours("running"))
    assert plan.diff()["before"] == plan.diff()["after"]


def test_replacement_diff_shows_old_and_new_spec() -> None:
    plan = plan_chat(state="started", observed=ours("running", OLD))
    assert plan.replaces
    assert plan.diff() == {
        "before": {"state": "started", "config_hash": OLD, "spec": {"port": 8000}},
        "after": {
            "state": "started",
            "config_hash": NEW,
            "spec": SPEC,
            "replace": {"way": "in-place", "why": plan.why},
        },
    }


def test_stop_diff_keeps_the_spec_and_changes_the_state() -> None:
    plan = plan_chat(state="stopped", observed=ours("running"))
    assert (plan.diff()["before"]["state"], plan.diff()["after"]["state"]) == ("started", "stopped")


def test_absent_diff_after_is_empty() -> None:
    plan = plan_chat(state="absent", observed=ours("exited"))
    assert plan.diff()["after"] == {}


def test_no_wait_ready_when_not_asked() -> None:
    plan = plan_chat(state="started", observed=None, wait_ready=False)
    assert plan.actions == (CREATE, START)


@pytest.mark.parametrize("state", ["present", "started", "stopped", "absent"])
def test_a_foreign_container_with_our_name_is_refused_in_every_state(state: Any) -> None:
    foreign = Observed(owned=False, status="running")
    with pytest.raises(NameTakenError, match=r"'chat' exists but was not created by meridian\.node"):
        plan_chat(state=state, observed=foreign)


# --- the host settings reach the config hash -----------------------------------------------------------------


def hash_of(**changes: Any) -> str:
    """The config hash engine_instance computes for ``vllm_engine`` with ``changes`` (labels included), without
    Docker."""
    spec = parse_engine_spec(vllm_engine(**changes))
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
    ("env value changed", {"env": {"MODE": "0"}}, {"env": {"MODE": "1"}}),
    ("secret added", {}, {"secret_env": {"HF_TOKEN": "t"}}),
    ("secret changed", {"secret_env": {"HF_TOKEN": "t"}}, {"secret_env": {"HF_TOKEN": "u"}}),
    ("secret renamed", {"secret_env": {"HF_TOKEN": "t"}}, {"secret_env": {"HUGGING_FACE_HUB_TOKEN": "t"}}),
    ("variable made secret", {"env": {"HF_TOKEN": "t"}}, {"secret_env": {"HF_TOKEN": "t"}}),
]


@pytest.mark.parametrize(("before", "after"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_changed_host_setting_drains_and_replaces_the_running_engine(
    before: dict[str, Any], after: dict[str, Any]
) -> None:
    running = Observed(owned=True, status="running", config_hash=hash_of(**before), spec={})
    plan = plan_chat(state="started", config_hash=hash_of(**after), observed=running)
    assert plan.actions == (DRAIN, STOP, ASIDE, CREATE, START, READY, REMOVE_OLD)


# (what, one spelling, another of the same container): no change, no action
SAME: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("defaults spelt out", {}, {"restart_policy": "unless-stopped", "ipc_mode": "private", "ulimits": {}}),
    ("one number for both limits", {"ulimits": {"stack": 8}}, {"ulimits": {"stack": {"soft": 8, "hard": 8}}}),
    (
        "limits and labels in another order",
        {"ulimits": {"stack": 8, "core": 0}, "labels": {"a.b": "1", "c.d": "2"}},
        {"ulimits": {"core": 0, "stack": 8}, "labels": {"c.d": "2", "a.b": "1"}},
    ),
    ("the same secret again", {"secret_env": {"HF_TOKEN": "t"}}, {"secret_env": {"HF_TOKEN": "t"}}),
    ("no secrets spelt out", {}, {"secret_env": {}}),
    (
        "secrets in another order",
        {"secret_env": {"A": "1", "B": "2"}},
        {"secret_env": {"B": "2", "A": "1"}},
    ),
]


@pytest.mark.parametrize(("first", "second"), [c[1:] for c in SAME], ids=[c[0] for c in SAME])
def test_the_same_host_settings_however_spelt_change_nothing(first: dict[str, Any], second: dict[str, Any]) -> None:
    running = Observed(owned=True, status="running", config_hash=hash_of(**first), spec={})
    plan = plan_chat(state="started", config_hash=hash_of(**second), observed=running)
    assert plan.actions == ()


def test_readiness_is_probed_soon_after_the_start_then_every_quarter_second() -> None:
    intervals = poll_intervals()
    assert [next(intervals) for _ in range(7)] == [0.05, 0.1, 0.2, 0.25, 0.25, 0.25, 0.25]

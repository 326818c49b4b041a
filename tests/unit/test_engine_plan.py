"""engine_plan: every (target state, what Docker shows) pair, as a table row."""

from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engine_plan import (
    Action,
    ForeignContainerError,
    Observed,
    plan_engine,
)

NEW = "hash-new"
OLD = "hash-old"
SPEC = {"image": "registry.local/vllm@sha256:" + "1" * 64, "port": 8000}

DRAIN, STOP, REMOVE, CREATE, START, READY = (
    Action.DRAIN, Action.STOP, Action.REMOVE, Action.CREATE, Action.START, Action.WAIT_READY,
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
    plan = plan_engine(name="chat", state=state, config_hash=NEW, spec=SPEC, observed=observed,
                       replace_strategy=strategy)
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
    with pytest.raises(ForeignContainerError, match=r"'chat' exists but was not created by meridian\.node"):
        plan_engine(name="chat", state=state, config_hash=NEW, spec=SPEC, observed=foreign)

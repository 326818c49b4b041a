"""Plan an engine container's lifecycle: desired spec + what Docker shows -> the actions to take.

Pure: no Docker, no clock, no I/O. ``engines.instance`` observes, calls ``plan_engine``, reports the plan
(check mode and diff mode stop there) and only then applies it, action by action. Keeping the decision here
is what lets every state transition be tested as a table row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.drift import describe_drift

__all__ = [
    "Action",
    "EnginePlan",
    "NameTakenError",
    "Observed",
    "TargetState",
    "plan_engine",
]

TargetState = Literal["present", "started", "stopped", "absent"]
ReplaceStrategy = Literal["drain-then-replace", "stop-then-start"]

# Docker statuses in which the container's process exists and must be stopped before removal.
_LIVE_STATUSES = frozenset({"running", "restarting", "paused"})


class Action(StrEnum):
    DRAIN = "drain"
    STOP = "stop"
    REMOVE = "remove"
    CREATE = "create"
    START = "start"
    WAIT_READY = "wait-ready"


class NameTakenError(MeridianError):
    """A container holds the engine's name but meridian.node did not create it: never touch it."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"a container named {name!r} exists but was not created by meridian.node (it has no "
            "meridian.node ownership label); it is left untouched. Remove or rename it, or give the engine "
            "another name."
        )
        self.name = name


@dataclass(frozen=True)
class Observed:
    """The container Docker has under the engine's name, reduced to what planning needs."""

    owned: bool
    status: str
    config_hash: str | None = None
    spec: dict[str, Any] | None = None
    # The settings that differ from those it would be created with now: name -> (live, expected), in
    # engine_drift's form. Changed by hand (docker update, recreated with our labels): replaced like a spec change.
    drifted: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.status in _LIVE_STATUSES


@dataclass(frozen=True)
class EnginePlan:
    actions: tuple[Action, ...]
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    drifted: tuple[str, ...] = ()  # the settings changed by hand that this plan puts back

    @property
    def changed(self) -> bool:
        return bool(self.actions)

    @property
    def replaces(self) -> bool:
        return Action.REMOVE in self.actions and Action.CREATE in self.actions

    def diff(self) -> dict[str, Any]:
        """Ansible's diff form: running state (started/stopped), config hash and spec, before and after."""
        return {"before": self.before, "after": self.after}


def plan_engine(
    *,
    name: str,
    state: TargetState,
    config_hash: str,
    spec: dict[str, Any],
    observed: Observed | None,
    replace_strategy: ReplaceStrategy = "drain-then-replace",
    wait_ready: bool = True,
) -> EnginePlan:
    """The actions that take ``observed`` to ``state`` with the container settings hashed as ``config_hash``.

    A spec change replaces the container (a new container from the new settings, never an in-place
    edit), and so does a container whose live settings drifted from its config hash (``observed.drifted``):
    the diff then shows those settings as they are (before) and as they will be (after). Replacing a live
    engine with ``drain-then-replace`` drains it first, so in-flight requests finish; a replaced engine
    comes back in the state it is asked for (``present`` keeps a live one live). ``wait-ready`` follows
    every start when ``wait_ready`` is set.
    """
    if observed is not None and not observed.owned:
        raise NameTakenError(name)
    actions = _actions(state, config_hash, observed, replace_strategy, wait_ready)
    before = _describe(observed)
    if not actions:
        return EnginePlan(actions=(), before=before, after=before)
    if state == "absent":
        return EnginePlan(actions=tuple(actions), before=before, after={})
    live_after = Action.START in actions or (observed is not None and observed.live and Action.STOP not in actions)
    after = {"state": "started" if live_after else "stopped", "config_hash": config_hash, "spec": spec}
    drifted = tuple(observed.drifted) if observed is not None and Action.CREATE in actions else ()
    if drifted and observed is not None:
        shown = {name: describe_drift(name, *observed.drifted[name]) for name in drifted}
        before["settings"] = {name: pair[0] for name, pair in shown.items()}
        after["settings"] = {name: pair[1] for name, pair in shown.items()}
    return EnginePlan(actions=tuple(actions), before=before, after=after, drifted=drifted)


def _actions(
    state: TargetState,
    config_hash: str,
    observed: Observed | None,
    replace_strategy: ReplaceStrategy,
    wait_ready: bool,
) -> list[Action]:
    start = [Action.START, Action.WAIT_READY] if wait_ready else [Action.START]
    if observed is None:
        return {"absent": [], "present": [Action.CREATE], "stopped": [Action.CREATE]}.get(
            state, [Action.CREATE, *start]
        )
    if state == "absent":
        return [Action.STOP, Action.REMOVE] if observed.live else [Action.REMOVE]

    current = observed.config_hash == config_hash and observed.status != "dead" and not observed.drifted
    if current:
        if state == "started" and not observed.live:
            return start
        if state == "stopped" and observed.live:
            return [Action.STOP]
        return []

    # Replace: retire the old container, then build the new one in the state asked for.
    retire: list[Action] = [Action.REMOVE]
    if observed.live:
        retire = [Action.STOP, Action.REMOVE]
        if replace_strategy == "drain-then-replace":
            retire.insert(0, Action.DRAIN)
    keep_live = state == "started" or (state == "present" and observed.live)
    return [*retire, Action.CREATE, *(start if keep_live else [])]


def _describe(observed: Observed | None) -> dict[str, Any]:
    if observed is None:
        return {}
    return {
        "state": "started" if observed.live else "stopped",
        "config_hash": observed.config_hash,
        "spec": observed.spec or {},
    }

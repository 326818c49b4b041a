"""Plan an engine container's lifecycle: desired spec + what Docker shows -> the actions to take.

Pure: no Docker, no clock, no I/O. ``engines.instance`` observes, calls ``plan_engine``, reports the plan
(check mode and diff mode stop there) and only then applies it, action by action. Keeping the decision here
is what lets every state transition be tested as a table row.

A replace never leaves the model down. Replacing a running engine that is to stay live takes one of two ways:

- ``beside``, when the host has room (``Room``: a free port, and the GPUs or VRAM the new engine needs
  besides the old one's): the new container is created as ``<name>.NEW`` on the free port and started while
  the old one keeps serving; once it is ready the old one is drained (only it: the draining mark names its
  port), stopped and removed, and the new one takes the engine's name. If the new one fails, it is removed and
  the old one never stopped serving.
- ``in-place``, without room: the old one is drained and stopped, but kept, renamed ``<name>.OLD``, until the
  new one is ready; then it is removed. If the new one fails, it is removed and the old one is renamed back
  and started again (``rollback_actions``).

Both need a readiness wait to know the new engine works; without one (``wait_ready: false``), or when the old
container serves nothing (stopped, exited, restarting, paused), a replace ``recreate``s: retire the old,
build the new, as before. ``.NEW`` and ``.OLD`` are not engine names (engine names are lowercase), so they
cannot collide with another engine; containers left under them by an interrupted replace are removed first
(``Action.CLEAN_UP``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.drift import describe_drift

__all__ = [
    "ASIDE_SUFFIXES",
    "Action",
    "EnginePlan",
    "NameTakenError",
    "Observed",
    "ReplaceWay",
    "Room",
    "TargetState",
    "aside_name",
    "plan_engine",
    "rollback_actions",
]

TargetState = Literal["present", "started", "stopped", "absent"]
ReplaceStrategy = Literal["drain-then-replace", "stop-then-start"]
ReplaceWay = Literal["beside", "in-place", "recreate"]
# The names a replace keeps its second container under, beside the engine's own: upper case, which no engine
# name has, so they never belong to another engine.
ASIDE_SUFFIXES = (".NEW", ".OLD")

# Docker statuses in which the container's process exists and must be stopped before removal.
_LIVE_STATUSES = frozenset({"running", "restarting", "paused"})


class Action(StrEnum):
    CLEAN_UP = "clean-up"  # stop and remove what an interrupted replace left under <name>.NEW / <name>.OLD
    DRAIN = "drain"
    STOP = "stop"
    REMOVE = "remove"
    SET_ASIDE = "set-aside"  # in-place: rename the stopped old container <name>.OLD, kept for a rollback
    CREATE = "create"
    CREATE_BESIDE = "create-beside"  # beside: the new container as <name>.NEW on the free port
    START = "start"
    WAIT_READY = "wait-ready"
    DRAIN_OLD = "drain-old"  # beside: once the new one is ready; the mark names the old one's port
    STOP_OLD = "stop-old"
    REMOVE_OLD = "remove-old"
    PROMOTE = "promote"  # beside: rename <name>.NEW to <name>


# After these, a failure rolls back (``rollback_actions``); before them nothing was retired, after them the
# new engine is serving and a failure only leaves the old container behind.
_CREATES = frozenset({Action.CREATE, Action.CREATE_BESIDE})


def aside_name(name: str, which: str) -> str:
    """``<name>.NEW`` or ``<name>.OLD``: where a replace keeps its second container."""
    suffix = "." + which.upper()
    if suffix not in ASIDE_SUFFIXES:
        raise ValueError(f"{which!r} is not one of {ASIDE_SUFFIXES}")
    return name + suffix


@dataclass(frozen=True)
class Room:
    """Whether a new engine fits beside the one it replaces until it is ready: the free port it would be
    published on, or why it does not fit (shown in check mode's diff). The caller looks (``engines.instance``
    for one engine, ``engines.set`` for a set); the planner only reads the answer."""

    port: int | None = None
    why_not: str = ""

    @property
    def fits(self) -> bool:
        return self.port is not None


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
    way: ReplaceWay | None = None  # how a replace keeps the model served; None: not a replace
    why: str = ""  # why that way (the room it found, or why there was none)

    @property
    def changed(self) -> bool:
        return bool(self.actions)

    @property
    def replaces(self) -> bool:
        return self.way is not None

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
    room: Room | None = None,
    leftovers: Sequence[str] = (),
) -> EnginePlan:
    """The actions that take ``observed`` to ``state`` with the container settings hashed as ``config_hash``.

    A spec change replaces the container (a new container from the new settings, never an in-place
    edit), and so does a container whose live settings drifted from its config hash (``observed.drifted``):
    the diff then shows those settings as they are (before) and as they will be (after). A running engine
    that stays live is replaced ``beside`` it when ``room`` fits, else ``in-place`` (see the module
    docstring); with ``drain-then-replace`` the old one is drained before it stops, so in-flight requests
    finish. A replaced engine comes back in the state it is asked for (``present`` keeps a live one live).
    ``wait-ready`` follows every start when ``wait_ready`` is set. ``leftovers``, the containers an
    interrupted replace left under the engine's aside names, are cleaned up first.
    """
    if observed is not None and not observed.owned:
        raise NameTakenError(name)
    actions, way, why = _actions(state, config_hash, observed, replace_strategy, wait_ready, room)
    if leftovers:
        actions.insert(0, Action.CLEAN_UP)
    before = _describe(observed)
    if not actions:
        return EnginePlan(actions=(), before=before, after=before)
    if state == "absent":
        return EnginePlan(actions=tuple(actions), before=before, after={})
    live_after = Action.START in actions or (observed is not None and observed.live and Action.STOP not in actions)
    after: dict[str, Any] = {"state": "started" if live_after else "stopped", "config_hash": config_hash, "spec": spec}
    if way is not None:
        after["replace"] = {"way": way, "why": why}
    creates = Action.CREATE in actions or Action.CREATE_BESIDE in actions
    drifted = tuple(observed.drifted) if observed is not None and creates else ()
    if drifted and observed is not None:
        shown = {name: describe_drift(name, *observed.drifted[name]) for name in drifted}
        before["settings"] = {name: pair[0] for name, pair in shown.items()}
        after["settings"] = {name: pair[1] for name, pair in shown.items()}
    return EnginePlan(actions=tuple(actions), before=before, after=after, drifted=drifted, way=way, why=why)


def rollback_actions(way: ReplaceWay | None, done: Sequence[str], failed: str | None = None) -> tuple[str, ...]:
    """What undoes a replace whose action ``failed`` failed after ``done`` (the actions finished, as strings),
    so that the engine that served before serves again; () when there is nothing to undo.

    ``beside``: the old container never stopped before the new one was ready, so rolling back is removing
    the new one (and the old one's draining mark, when the drain had begun). Once the old one is stopped the
    new one is serving, and a later failure (removing the old container, the rename) is reported, not undone.
    ``in-place``: once the old container is set aside, a failure of the new one removes it, renames the old
    one back and starts it again.
    """
    finished = set(done)
    new_exists = bool(finished & {str(action) for action in _CREATES})
    if way == "beside" and new_exists and str(Action.STOP_OLD) not in finished:
        undo = ["stop-new", "remove-new"]
        if str(Action.DRAIN_OLD) in finished or failed == str(Action.DRAIN_OLD):
            undo.append("undrain-old")
        return tuple(undo)
    if way == "in-place" and str(Action.SET_ASIDE) in finished and str(Action.REMOVE_OLD) not in finished:
        undo = ["stop-new", "remove-new"] if new_exists else []
        return (*undo, "restore-old", "start-old", "wait-ready-old")
    return ()


def _actions(
    state: TargetState,
    config_hash: str,
    observed: Observed | None,
    replace_strategy: ReplaceStrategy,
    wait_ready: bool,
    room: Room | None,
) -> tuple[list[Action], ReplaceWay | None, str]:
    start = [Action.START, Action.WAIT_READY] if wait_ready else [Action.START]
    if observed is None:
        created = {"absent": [], "present": [Action.CREATE], "stopped": [Action.CREATE]}.get(
            state, [Action.CREATE, *start]
        )
        return created, None, ""
    if state == "absent":
        return ([Action.STOP, Action.REMOVE] if observed.live else [Action.REMOVE]), None, ""

    current = observed.config_hash == config_hash and observed.status != "dead" and not observed.drifted
    if current:
        if state == "started" and not observed.live:
            return start, None, ""
        if state == "stopped" and observed.live:
            return [Action.STOP], None, ""
        return [], None, ""

    drain = replace_strategy == "drain-then-replace"
    keep_live = state == "started" or (state == "present" and observed.live)
    if keep_live and wait_ready and observed.status == "running":
        if room is not None and room.fits:
            beside = [Action.CREATE_BESIDE, Action.START, Action.WAIT_READY]
            retire = [Action.DRAIN_OLD] if drain else []
            why = f"room beside the old engine: the new one starts on free port {room.port} while the old serves"
            return [*beside, *retire, Action.STOP_OLD, Action.REMOVE_OLD, Action.PROMOTE], "beside", why
        why = "no room beside the old engine" + (f" ({room.why_not})" if room is not None and room.why_not else "")
        why += ": the old one is stopped but kept until the new one is ready, and started again if it fails"
        retire = [Action.DRAIN] if drain else []
        steps = [*retire, Action.STOP, Action.SET_ASIDE, Action.CREATE, *start, Action.REMOVE_OLD]
        return steps, "in-place", why

    # Nothing serving to keep (or no readiness wait to know the new one works): retire, then build.
    recreate: list[Action] = [Action.REMOVE]
    if observed.live:
        recreate = [Action.DRAIN, Action.STOP, Action.REMOVE] if drain else [Action.STOP, Action.REMOVE]
    built = [Action.CREATE, *(start if keep_live else [])]
    if observed.status != "running":
        why = f"the old container serves nothing ({observed.status})"
    elif not keep_live:
        why = f"the engine is to be {state}"
    else:
        why = "without a readiness wait (wait_ready: false) nothing tells whether the new one works"
    return [*recreate, *built], "recreate", why


def _describe(observed: Observed | None) -> dict[str, Any]:
    if observed is None:
        return {}
    return {
        "state": "started" if observed.live else "stopped",
        "config_hash": observed.config_hash,
        "spec": observed.spec or {},
    }

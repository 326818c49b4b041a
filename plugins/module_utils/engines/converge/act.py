"""The act phase of one engine: its plan's actions done in order, or (check mode, nothing to do) its report.

A replace that fails once its new container exists is rolled back (``engines.plan.rollback_actions``): the old
engine serves again, and the result's ``replace`` says ``rolled-back`` with the reason. The drain and the
readiness waits are ``waits``'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    DockerEngine,
    DockerEngineError,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import EngineRun
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.waits import (
    drain,
    probe,
    wait_old_ready,
    wait_ready,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import driver_of
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import DrainStateError, clear_draining
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import ProbeVerdict
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import (
    ASIDE_SUFFIXES,
    Action,
    aside_name,
    rollback_actions,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError

__all__ = ["RETIRING", "apply_engine", "apply_or_report", "report_engine"]

# What an engines.set run may do before the engines it hands a port or GPU to are built.
RETIRING = frozenset({Action.CLEAN_UP, Action.DRAIN, Action.STOP, Action.REMOVE, Action.SET_ASIDE})


def apply_or_report(
    run: EngineRun,
    *,
    check_mode: bool,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    retire_only: bool = False,
) -> dict[str, Any]:
    """The act phase: a run in check mode, or with nothing to do, is reported (``report_engine``); any other
    has its actions done (``apply_engine``, ``retire_only`` as there)."""
    if check_mode or not run.plan.actions:
        return report_engine(run, check_mode)
    return apply_engine(run, sleep, clock, retire_only=retire_only)


def report_engine(run: EngineRun, check_mode: bool) -> dict[str, Any]:
    """The result of a run that changes nothing (check mode, or nothing to do): probed when it runs."""
    ready: bool | None = None
    detail: str | None = None
    if not check_mode and run.current is not None and run.current.running and run.driver is not None:
        verdict = probe(run, run.current)
        ready, detail = verdict.ready, verdict.detail
    pending = {"pending": run.pending} if run.pending else {}
    if check_mode and run.plan.way is not None:
        run.outcome = "planned"
    return run.result(planned=check_mode and bool(run.plan.actions), ready=ready, probe=detail, **pending)


def apply_engine(
    run: EngineRun,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    *,
    retire_only: bool = False,
) -> dict[str, Any]:
    """Do the plan's actions not done yet, in order; returns the result. Raises ``EngineInstanceError``.

    With ``retire_only`` it stops before the first action that builds (create, start, wait-ready) and returns
    the partial result; a later call carries on from there. ``engines.set`` retires engines that hand their
    port or GPU to each other first, then builds them.

    A replace that fails once its new container exists is rolled back (``plan.rollback_actions``): the old
    engine serves again, and the error's result says ``rolled-back`` and why.
    """
    verdict: ProbeVerdict | None = None
    for action in run.plan.actions[len(run.done) :]:
        if retire_only and action not in RETIRING:
            return run.result()
        try:
            verdict = _act(run, action, sleep, clock) or verdict
        except (EngineInstanceError, DockerEngineError, DrainStateError) as exc:
            undo = rollback_actions(run.plan.way, run.done, str(action))
            if not undo:
                raise
            _roll_back(run, undo, exc, sleep, clock)
        run.done.append(str(action))
    if retire_only:
        return run.result()
    if run.options.state == "absent" or {str(Action.DRAIN), str(Action.DRAIN_OLD)} & set(run.done):
        clear_draining(run.options.state_dir, run.name)
    if run.current is not None:
        run.current = run.engine.container(run.current.id)
    if run.plan.way is not None:
        run.outcome = "replaced"
    if verdict is None and run.current is not None and run.current.running and run.driver is not None:
        verdict = probe(run, run.current)
    return run.result(
        ready=None if verdict is None else verdict.ready, probe=None if verdict is None else verdict.detail
    )


def _act(
    run: EngineRun, action: Action, sleep: Callable[[float], None], clock: Callable[[], float]
) -> ProbeVerdict | None:
    """One action of the plan. ``run.current`` is the engine's container (the new one, once created);
    ``run.previous`` the old one a replace keeps until the new one is ready."""
    engine = run.engine
    if action is Action.CLEAN_UP:
        _clean_up(run)
    elif action is Action.DRAIN:
        drain(run, _existing(run.current, run, "drain"), sleep, clock)
    elif action is Action.DRAIN_OLD:
        drain(run, _existing(run.previous, run, "drain the old container"), sleep, clock, only=True)
    elif action is Action.STOP:
        run.current = _stopped(engine, _existing(run.current, run, "stop"))
    elif action is Action.STOP_OLD:
        run.previous = _stopped(engine, _existing(run.previous, run, "stop the old container"))
    elif action is Action.REMOVE:
        engine.remove(_existing(run.current, run, "remove"))
        run.current = None
    elif action is Action.REMOVE_OLD:
        engine.remove(_existing(run.previous, run, "remove the old container"))
        run.previous = None
    elif action is Action.SET_ASIDE:
        run.previous = engine.rename(_existing(run.current, run, "set aside"), aside_name(run.name, "old"))
        run.current = None
    elif action in (Action.CREATE, Action.CREATE_BESIDE):
        if run.settings is None:
            raise RuntimeError(f"engine {run.name!r}: the plan asks to create without settings")
        settings = run.settings
        if action is Action.CREATE_BESIDE:
            if run.room is None or run.room.port is None:
                raise RuntimeError(f"engine {run.name!r}: the plan asks to create beside without a free port")
            settings = settings.placed_at(aside_name(run.name, "new"), run.room.port)
        created = engine.create(settings)
        if action is Action.CREATE_BESIDE:
            run.previous = run.current
        run.current = created
    elif action is Action.START:
        current = _existing(run.current, run, "start")
        engine.start(current)
        run.current = engine.container(current.id)
    elif action is Action.WAIT_READY:
        verdict = wait_ready(run, _existing(run.current, run, "wait-ready"), sleep, clock)
        # Ready: it takes work from now on, whatever is left to do with the old one (in-place: remove it).
        if str(Action.DRAIN) in run.done:
            clear_draining(run.options.state_dir, run.name)
        return verdict
    elif action is Action.PROMOTE:
        run.current = engine.rename(_existing(run.current, run, "take the engine's name"), run.name)
    return None


def _stopped(engine: DockerEngine, container: ContainerInfo) -> ContainerInfo:
    engine.stop(container, timeout_s=driver_of(container).facts.stop_timeout_s)
    return engine.container(container.id)


def _clean_up(run: EngineRun) -> None:
    """Remove what an interrupted replace left under the engine's aside names (stopped first, the driver's way)."""
    found = run.engine.find_names([run.name + suffix for suffix in ASIDE_SUFFIXES])
    for container in found.values():
        if not container.owned or container.instance != run.name:
            continue
        if container.running or container.state in ("restarting", "paused"):
            container = _stopped(run.engine, container)
        run.engine.remove(container)


def _roll_back(
    run: EngineRun,
    undo: Sequence[str],
    cause: EngineInstanceError | DockerEngineError | DrainStateError,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> None:
    """Undo a failed replace so that the engine that served before serves again; always raises.

    The error keeps the cause's check (``readiness``, ``docker``...) and says what was undone; the result's
    ``replace.outcome`` is ``rolled-back`` (the old engine is ready again) or ``rollback-failed`` (it is not:
    the message says what is left where).
    """
    check = getattr(cause, "check", "docker")
    reason = str(cause).split(". Last ", 1)[0]
    run.reason = reason
    engine = run.engine
    try:
        for step in undo:
            if step == "stop-new" and run.current is not None:
                current = engine.container(run.current.id)
                if current.running or current.state in ("restarting", "paused"):
                    _stopped(engine, current)
            elif step == "remove-new" and run.current is not None:
                engine.remove(run.current, force=True)
                run.current = None
            elif step == "undrain-old":
                clear_draining(run.options.state_dir, run.name)
            elif step == "restore-old":
                run.current = engine.rename(_existing(run.previous, run, "restore the old container"), run.name)
                run.previous = None
            elif step == "start-old":
                current = _existing(run.current, run, "start the old container")
                engine.start(current)
                run.current = engine.container(current.id)
            elif step == "wait-ready-old":
                old = _existing(run.current, run, "wait for the old container")
                verdict = wait_old_ready(run, old, sleep, clock)
                if not verdict.ready:
                    raise EngineInstanceError(
                        f"the old engine did not become ready again: {verdict.detail}", check="readiness"
                    )
            run.done.append(step)
    except (EngineInstanceError, DockerEngineError, DrainStateError, RuntimeError) as exc:
        run.outcome = "rollback-failed"
        raise EngineInstanceError(
            f"engine {run.name!r}: the replace failed ({reason}) and rolling back failed too: {exc}. Done: "
            f"{', '.join(run.done)}; look at 'docker ps -a --filter name={run.name}' and publish again",
            check=check,
            result=run.result(ready=False),
        ) from cause
    run.outcome = "rolled-back"
    if str(Action.DRAIN) in run.done or str(Action.DRAIN_OLD) in run.done:
        clear_draining(run.options.state_dir, run.name)
    raise EngineInstanceError(
        f"{cause}\nRolled back: the engine that served before serves again ({', '.join(undo)}).",
        check=check,
        result=run.result(ready=run.current is not None),
    ) from cause


def _existing(container: ContainerInfo | None, run: EngineRun, action: str) -> ContainerInfo:
    # The planner only orders an action on a container that the steps before it leave there.
    if container is None:
        raise RuntimeError(f"engine {run.name!r}: the plan asks to {action} but there is no container")
    return container

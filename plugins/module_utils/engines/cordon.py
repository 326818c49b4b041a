"""Cordon GPUs or the whole node, and lift the cordon: what ``meridian.node.cordon`` does.

The order is the point, as for a drain. The cordon file (``engines.cordon_file``) is written first, so no
engine module places anything new on the cordoned GPUs from that moment; only then are the engines on them
drained (``engines.drain``: a draining mark, the wait for in-flight requests, the stop), one at a time, and
each stopped engine is recorded as ``held`` in the file as soon as it stops. A drain that times out leaves
the cordon in force and the engines drained so far held; a re-run goes on from there.

Lifting the cordon starts the held engines again (their containers are unchanged: starting them is not a
new placement), clears their draining marks, and removes the file last, so an interrupted lift is finished
by a re-run. Engines the cordon did not stop are not touched, whatever state they are in.

Engines are matched by the GPUs their spec label names (uuid, index or MIG uuid, all compared through the
GPU facts, so a cordon by index covers an engine placed by uuid). A node cordon covers every engine of
ours, GPU or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import ResultError
from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    DockerEngine,
    DockerEngineError,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import (
    CordonStateError,
    HostCordon,
    read_cordon,
    remove_cordon,
    write_cordon,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import (
    DrainError,
    DrainOptions,
    drain_engine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DrainStateError,
    clear_draining,
    read_mark,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import label_spec

__all__ = [
    "CORDON_REASON_PREFIX",
    "CordonError",
    "CordonOptions",
    "cordon_host",
    "cordon_refusal",
    "engine_covered",
    "hold_engine",
    "release_cordon_mark",
]

# Draining marks the cordon writes start with this, so lifting it clears only its own.
CORDON_REASON_PREFIX = "cordoned"


class CordonError(ResultError):
    """The cordon could not be put in force or lifted; ``result`` says what was done so far."""


@dataclass(frozen=True)
class CordonOptions:
    state: str = "present"  # or "absent"
    gpus: tuple[str, ...] = ()
    drain: bool | None = None  # None: a node cordon drains, a GPU cordon does not
    reason: str | None = None
    timeout_s: float = 300
    grace_s: float = 10
    force: bool = False
    state_dir: str = DEFAULT_STATE_DIR

    @property
    def drains(self) -> bool:
        return (not self.gpus) if self.drain is None else self.drain


def cordon_host(
    options: CordonOptions,
    *,
    engine: DockerEngine,
    gpu_facts: Callable[[], Mapping[str, Any]],
    check_mode: bool,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Take the host's cordon to ``options.state``; the module's result. Raises ``CordonError``."""
    try:
        existing = read_cordon(options.state_dir)
        if options.state == "absent":
            return _lift(existing, options, engine, check_mode)
        return _cordon(existing, options, engine, gpu_facts, check_mode, sleep, clock)
    except (CordonStateError, DrainStateError, DockerEngineError) as exc:
        raise CordonError(str(exc)) from exc


def _result(changed: bool, cordon: HostCordon | None, *, drained: list[str], started: list[str]) -> dict[str, Any]:
    return {
        "changed": changed,
        "cordon": None if cordon is None else cordon.as_dict(),
        "drained": drained,
        "started": started,
    }


def _covered(container: ContainerInfo, cordon: HostCordon, facts: Mapping[str, Any] | None) -> bool:
    if cordon.node:
        return True
    gpus = label_spec(container).get("gpus")
    return isinstance(gpus, list) and bool(gpus) and cordon.covers([str(g) for g in gpus], facts)


def _cordon(
    existing: HostCordon | None,
    options: CordonOptions,
    engine: DockerEngine,
    gpu_facts: Callable[[], Mapping[str, Any]],
    check_mode: bool,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict[str, Any]:
    wanted = HostCordon(
        gpus=tuple(sorted(set(options.gpus))),
        drain=options.drains,
        reason=options.reason,
        # A cordon that changes keeps the engines it already holds: lifting it starts them all.
        held=existing.held if existing is not None else (),
        since=existing.since if existing is not None else None,
    )
    facts = gpu_facts() if wanted.gpus else None
    to_drain = (
        [
            container
            for container in engine.list_owned()
            if container.instance
            and container.running
            and container.instance not in wanted.held
            and _covered(container, wanted, facts)
        ]
        if wanted.drain
        else []
    )
    names = sorted({str(container.instance) for container in to_drain})
    file_changes = existing is None or (existing.gpus, existing.drain, existing.reason) != (
        wanted.gpus,
        wanted.drain,
        wanted.reason,
    )
    changed = file_changes or bool(names)
    if check_mode:
        return _result(changed, replace(wanted, held=(*wanted.held, *names)), drained=names, started=[])
    cordon = write_cordon(options.state_dir, wanted) if file_changes else wanted
    drained: list[str] = []
    for name in names:
        drain = DrainOptions(
            timeout_s=options.timeout_s,
            grace_s=options.grace_s,
            force=options.force,
            stop=True,
            state_dir=options.state_dir,
            reason=f"{CORDON_REASON_PREFIX}: {options.reason or 'no reason given'}",
        )
        try:
            drain_engine(name, drain, engine=engine, check_mode=False, sleep=sleep, clock=clock)
        except DrainError as exc:
            raise CordonError(
                f"the cordon is in force, but {exc}",
                _result(True, cordon, drained=drained, started=[]),
            ) from exc
        drained.append(name)
        cordon = write_cordon(options.state_dir, replace(cordon, held=(*cordon.held, name)))
    return _result(changed, cordon, drained=drained, started=[])


def _lift(
    existing: HostCordon | None, options: CordonOptions, engine: DockerEngine, check_mode: bool
) -> dict[str, Any]:
    if existing is None:
        return _result(False, None, drained=[], started=[])
    to_start: list[ContainerInfo] = []
    for name in existing.held:
        container = engine.find_owned(name)
        if container is not None and not container.running:
            to_start.append(container)
    started = sorted(str(container.instance) for container in to_start)
    if check_mode:
        return _result(True, None, drained=[], started=started)
    for name in existing.held:
        mark = read_mark(options.state_dir, name)
        if mark is not None and mark.reason.startswith(CORDON_REASON_PREFIX):
            clear_draining(options.state_dir, name)
    for container in to_start:
        engine.start(container)
    remove_cordon(options.state_dir)
    return _result(True, None, drained=[], started=started)


# --- the engine modules under a cordon ------------------------------------------------------------------


def engine_covered(cordon: HostCordon, gpus: Sequence[str], gpu_facts: Callable[[], Mapping[str, Any]]) -> bool:
    """Whether an engine asking for ``gpus`` is inside ``cordon``; the GPU facts are read only when the ids
    alone cannot tell (a cordon by index, an engine by uuid)."""
    if cordon.node:
        return True
    if not gpus:
        return False
    if set(gpus) & set(cordon.gpus):
        return True
    return cordon.covers(list(gpus), gpu_facts())


def hold_engine(
    name: str,
    cordon: HostCordon,
    *,
    engine: DockerEngine,
    state_dir: str,
    timeout_s: float,
    grace_s: float,
    check_mode: bool,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """An engine to be started that a draining cordon covers: drained and stopped if it runs, never created
    or started while the cordon holds. The result has the engine modules' keys, and ``held`` says by what."""
    held = {"by": cordon.by, "reason": cordon.reason, "gpus": list(cordon.gpus)}
    container = engine.find(name)
    before = {"state": "absent"} if container is None else {"state": "started" if container.running else "stopped"}
    after = {"state": before["state"] if before["state"] == "absent" else "stopped", "held": held}
    result: dict[str, Any] = {
        "changed": False,
        "actions": [],
        "done": [],
        "held": held,
        "container": None,
        "drifted": [],
        "replace": None,
        "diff": {"before": before, "after": after},
    }
    if container is None:
        return result
    if not container.owned:
        raise CordonError(
            f"container {name!r} is not managed by meridian.node (no ownership labels); it was left alone. "
            "Remove or rename it, or pick another name for the engine"
        )
    result["container"] = {"id": container.id, "name": container.name, "status": container.state}
    if not container.running:
        return result
    drain = DrainOptions(
        timeout_s=timeout_s,
        grace_s=grace_s,
        stop=True,
        state_dir=state_dir,
        reason=f"{CORDON_REASON_PREFIX}: {cordon.reason or 'no reason given'}",
    )
    try:
        drained = drain_engine(name, drain, engine=engine, check_mode=check_mode, sleep=sleep, clock=clock)
    except DrainError as exc:
        raise CordonError(f"engine {name!r} is cordoned ({_why(cordon)}) but {exc}", exc.result) from exc
    return {
        **result,
        "changed": drained["changed"],
        "actions": drained["actions"],
        "done": [] if check_mode else drained["actions"],
        "container": drained["container"],
    }


def _why(cordon: HostCordon) -> str:
    where = "the whole node" if cordon.node else f"GPUs {', '.join(cordon.gpus)}"
    return f"{where}, by {cordon.by}" + (f": {cordon.reason}" if cordon.reason else "")


def cordon_refusal(cordon: HostCordon | None, name: str) -> str | None:
    """Why an engine may not be created on a node cordoned without drain; None when it may (placement refuses
    cordoned GPUs by their facts' ``cordoned`` flag: this is the node-wide case, GPUs or not)."""
    if cordon is None or not cordon.node:
        return None
    return (
        f"engine {name!r} would be a new engine on a cordoned node ({_why(cordon)}); lift the cordon first "
        "(meridian.node.cordon state=absent, or a desired state without it)"
    )


def release_cordon_mark(state_dir: str, name: str, *, check_mode: bool) -> bool:
    """Clear the draining mark a cordon left on ``name``, now that no cordon holds it; whether there was one.
    Marks of other drains (an operator's, a replace's) are left alone."""
    mark = read_mark(state_dir, name)
    if mark is None or not mark.reason.startswith(CORDON_REASON_PREFIX):
        return False
    if not check_mode:
        clear_draining(state_dir, name)
    return True

"""Draining an engine: mark it, wait until nothing is in flight, optionally stop it.

The order is the point. The durable mark (``engines.drain_marks``) comes first, so the agent's observations and
the serving projection drop the engine before anything else happens; only then do we wait for the
engine's own running + waiting gauges to reach zero (engines without metrics get a fixed ``grace``);
only then, if asked, is the container stopped with the driver's signal and stop timeout.

``wait_until_idle`` is the waiting part alone, shared by a converge's drain-then-replace
(``engines.converge.waits``) and by ``drain_engine`` (``meridian.node.drain``). Both take ``sleep`` and
``clock`` so tests need no real time.

On a timeout ``drain_engine`` keeps the mark: whoever asked for the drain asked that the engine get no
new work, and a re-run continues the same drain (the mark keeps when it began). A converge (``engines.converge``)
clears it instead, because there the old engine goes on serving until a later replacement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import ResultError
from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    DockerEngine,
    DockerEngineError,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DrainStateError,
    clear_draining,
    mark_draining,
    read_mark,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    Driver,
    DriverError,
    InFlight,
    get_driver,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import read_in_flight
from ansible_collections.meridian.node.plugins.module_utils.engines.prometheus_text import MetricsFormatError

__all__ = [
    "DrainError",
    "DrainOptions",
    "IdleOutcome",
    "drain_engine",
    "driver_of",
    "loopback_for",
    "probe_address",
    "wait_until_idle",
]

POLL_S = 0.25
_METRICS_TIMEOUT_S = 2.0


class DrainError(ResultError):
    """The drain could not finish; ``result`` is the module's result so far (what was done, what is in flight)."""


@dataclass(frozen=True)
class IdleOutcome:
    """How a wait ended. ``idle`` is False only when ``timeout_s`` passed with work still in flight."""

    idle: bool
    waited_s: float
    method: str  # "metrics" (the gauges said 0) or "grace" (no gauges to read: waited a fixed time)
    last: InFlight | None  # the last reading; None when there were no metrics or they never answered

    def in_flight(self) -> dict[str, int | None] | None:
        if self.last is None:
            return None
        return {"running": _count(self.last.running), "waiting": _count(self.last.waiting)}

    def describe(self) -> str:
        if self.method == "grace":
            return "it publishes no in-flight metrics"
        if self.last is None:
            return "its metrics did not answer"
        return f"{_count(self.last.running) or 0} running, {_count(self.last.waiting) or 0} waiting"


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def loopback_for(bind: str) -> str:
    """Where to reach an engine published on ``bind``: one published on every address is asked on loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind, bind)  # noqa: S104


def driver_of(container: ContainerInfo) -> Driver:
    """The driver a container was made by (its label), for its gauges, stop signal and stop timeout.

    An unknown label falls back to the generic driver: no metrics, so a drain waits its grace period.
    """
    try:
        return get_driver(container.driver or "openai")
    except DriverError:
        return get_driver("openai")


def probe_address(container: ContainerInfo, driver: Driver | None = None) -> tuple[str, int] | None:
    """``(host, port)`` the engine answers on from the host: the published port of the driver's container port
    (else the first published tcp port); None when nothing is published."""
    ports = [p for p in container.ports if p.protocol == "tcp"]
    if driver is not None:
        ports.sort(key=lambda p: p.container_port != driver.facts.container_port)
    if not ports:
        return None
    return loopback_for(ports[0].host_ip), ports[0].host_port


def wait_until_idle(
    driver: Driver,
    address: tuple[str, int] | None,
    *,
    timeout_s: float,
    grace_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> IdleOutcome:
    """Poll the engine's running + waiting gauges until they sum to 0, or until ``timeout_s`` passes.

    Engines without gauges (or without a published port to read them on) cannot tell us: wait
    ``min(grace_s, timeout_s)`` and call that idle. Metrics that do not answer or do not parse count as
    "not known to be idle", never as zero.
    """
    start = clock()
    if not driver.facts.has_metrics or address is None:
        sleep(max(0.0, min(grace_s, timeout_s)))
        return IdleOutcome(idle=True, waited_s=clock() - start, method="grace", last=None)
    deadline = start + timeout_s
    last: InFlight | None = None
    while True:
        try:
            last = read_in_flight(driver, address[0], address[1], timeout_s=_METRICS_TIMEOUT_S)
        except MetricsFormatError:
            last = None
        total = None if last is None else last.total
        if total is not None and total == 0:
            return IdleOutcome(idle=True, waited_s=clock() - start, method="metrics", last=last)
        if clock() >= deadline:
            return IdleOutcome(idle=False, waited_s=clock() - start, method="metrics", last=last)
        sleep(POLL_S)


# --- meridian.node.drain --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainOptions:
    state: str = "drained"  # or "undrained"
    timeout_s: float = 300
    grace_s: float = 10
    force: bool = False
    stop: bool = True
    stop_timeout_s: int | None = None  # None: the driver's own
    state_dir: str = DEFAULT_STATE_DIR
    reason: str = "drained by meridian.node.drain"


def drain_engine(
    name: str,
    options: DrainOptions,
    *,
    engine: DockerEngine,
    check_mode: bool,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Take engine ``name`` to ``options.state``; returns the module's result, raises ``DrainError``."""
    try:
        container = engine.find(name)
        if container is not None and not container.owned:
            raise DrainError(
                f"container {name!r} is not managed by meridian.node (no ownership labels); it was left "
                "alone. Drain it by its own means, or pick the name of an engine this collection runs"
            )
        if options.state == "undrained":
            return _undrain(name, options, container, check_mode)
        return _drain(name, options, container, engine, check_mode, sleep, clock)
    except DrainStateError as exc:
        raise DrainError(str(exc)) from exc
    except DockerEngineError as exc:
        raise DrainError(str(exc)) from exc


def _result(
    changed: bool,
    actions: list[str],
    container: ContainerInfo | None,
    *,
    marked: bool,
    outcome: IdleOutcome | None = None,
    stopped: bool = False,
) -> dict[str, Any]:
    return {
        "changed": changed,
        "actions": actions,
        "draining": marked,
        "waited_s": 0.0 if outcome is None else round(outcome.waited_s, 3),
        "drained_by": None if outcome is None else outcome.method,
        "in_flight": None if outcome is None else outcome.in_flight(),
        "stopped": stopped,
        "container": None
        if container is None
        else {"id": container.id, "name": container.name, "status": container.state},
    }


def _undrain(name: str, options: DrainOptions, container: ContainerInfo | None, check_mode: bool) -> dict[str, Any]:
    marked = read_mark(options.state_dir, name) is not None
    if marked and not check_mode:
        clear_draining(options.state_dir, name)
    # After the run (or, in check mode, after the real run) the engine is not marked.
    return _result(marked, ["unmark"] if marked else [], container, marked=False)


def _drain(
    name: str,
    options: DrainOptions,
    container: ContainerInfo | None,
    engine: DockerEngine,
    check_mode: bool,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> dict[str, Any]:
    if container is None:
        # Nothing serves under this name, so nothing can be drained; a stale mark is harmless and kept.
        marked = read_mark(options.state_dir, name) is not None
        return _result(False, [], None, marked=marked)
    already = read_mark(options.state_dir, name) is not None
    running = container.running
    actions = [] if already else ["mark"]
    if running:
        actions.append("wait")
        if options.stop:
            actions.append("stop")
    # Waiting only observes: an engine already marked, and not to be stopped, is drained already.
    changed = any(action != "wait" for action in actions)
    if check_mode:
        return _result(changed, actions, container, marked=True)

    if not already:
        mark_draining(options.state_dir, name, reason=options.reason)
    if not running:
        return _result(changed, actions, container, marked=True)
    driver = driver_of(container)
    outcome = wait_until_idle(
        driver,
        probe_address(container, driver),
        timeout_s=options.timeout_s,
        grace_s=options.grace_s,
        sleep=sleep,
        clock=clock,
    )
    if not outcome.idle and not options.force:
        raise DrainError(
            f"engine {name!r}: drain timed out after {options.timeout_s:g}s ({outcome.describe()}); it is left "
            "running and marked draining, so it gets no new work. Re-run to keep waiting, raise timeout, "
            "use force: true to stop it anyway, or undrain it to put it back",
            result=_result(changed, actions, container, marked=True, outcome=outcome),
        )
    stopped = False
    if options.stop:
        stop_timeout_s = driver.facts.stop_timeout_s if options.stop_timeout_s is None else options.stop_timeout_s
        engine.stop(container, timeout_s=stop_timeout_s)
        stopped = True
        container = engine.container(container.id)
    return _result(changed, actions, container, marked=True, outcome=outcome, stopped=stopped)

"""What root's shutdown drain does, and when: mark this node's engines draining, wait, release; and clear the marks.

Runs on: the root side only (``meridian-node shutdown-drain``, ``root_side.shutdown_drain``, the verb; logind is
heard through ``root_side.logind_bus``). Nothing here talks to D-Bus: logind is a ``LogindPort``, its signals
arrive as events, and the tests stand in for it at that seam.

Why: at shutdown dockerd stops every container with its stop signal and a timeout; vLLM and llama.cpp drop
what is in flight on SIGTERM. kubelet's graceful node shutdown shows the way out, and this follows it: hold a
systemd-logind *delay* inhibitor lock for ``shutdown``; when logind announces a shutdown
(``PrepareForShutdown(true)``) it waits, up to its ``InhibitDelayMaxSec``, for every delay lock to be released
before it starts ``poweroff.target``, so nothing is stopped yet. In that window this service marks each of the
node's running engines draining, lets the mark reach the serving projection, waits for in-flight work to
reach zero (or the bound to pass), and only then closes the lock's file descriptor, which lets the shutdown
proceed. Shutdowns that bypass logind (``systemctl poweroff --force``, ``systemctl start poweroff.target``) are
not seen, as they are not by kubelet.

Why root, not the agent: the draining marks live in root's directory (``<apply.state_dir>/draining``), which
the agent's user cannot write; the engines are listed through Docker, which the agent has no access to under
the privilege split; and the agent is treated as compromised, so it must not be the one that can hold a
shutdown or take engines out of the projection by root's hand. What the agent could do on the bus is forge
the signal (``root_side.logind_bus`` tells a forged one apart: ``ForgedShutdownSignal``, logged and ignored).

The order, and why each wait is there:

1. list this node's running engines (owner ``agent:<node id>``) through a read-only Docker client;
2. mark each draining (``engines.drain_marks``), reason naming this service and the boot;
3. if any mark is new, wait one *observation interval*: the agent reads ``draining/`` directly at most every
   ``AGENT_ENGINES_REFRESH_S`` and reports once per cycle (at most ``control_plane.heartbeat_seconds`` and its
   10 % jitter, or the long-poll when shorter), and until the control plane has that report, the gateway still
   sends requests. Rewriting ``engines.json`` would not make this faster: draining is not in that file, the agent
   reads the marks themselves. An in-flight count of zero before this wait ends would not mean that no request is
   still on its way;
4. wait until each engine's running + waiting gauges are 0 (engines without gauges get a fixed grace), all
   within one deadline: ``--timeout-seconds`` from the signal, or logind's ``InhibitDelayMaxSec`` when that is
   shorter (logind goes on without us then, and the log says to raise it);
5. close the lock. Engines stay marked: they are about to stop.

Marks are boot-scoped. A mark this service wrote names the boot (``boundary.boot``); at start,
before anything else, the marks it wrote in another boot are removed, and, once logind says no shutdown is under
way, those of this boot too (a shutdown that was cancelled). Marks written by anyone else (``meridian.node.drain``,
a replace) are never touched. If logind cancels the shutdown (``PrepareForShutdown(false)``) the service removes
its marks and takes a new lock. If logind restarts (a new owner of its name) the service takes a lock from the
new one and then lets go of the old one.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import (
    IdleOutcome,
    driver_of,
    probe_address,
    wait_until_idle,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DrainStateError,
    clear_draining,
    list_draining,
    mark_draining,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import Driver
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from meridian_node_agent.config import TIMER_JITTER, AgentConfig
from meridian_node_agent.logs import EventLogger

__all__ = [
    "AGENT_ENGINES_REFRESH_S",
    "DEFAULT_GRACE_S",
    "DEFAULT_TIMEOUT_S",
    "LOGIND_NAME",
    "LOGIND_PATH",
    "MARK_REASON",
    "DrainReport",
    "DrainSettings",
    "DrainTarget",
    "ForgedShutdownSignal",
    "IdleWaiter",
    "LogindEvent",
    "LogindOwnerChanged",
    "LogindPort",
    "LogindUnavailableError",
    "ShutdownDrain",
    "ShutdownSignal",
    "clear_shutdown_marks",
    "is_shutdown_mark",
    "observation_interval_s",
    "running_engines",
    "shutdown_reason",
]

# The whole drain, from PrepareForShutdown to the lock's release. The settle wait is part of it: with the
# agent's defaults that is 20 s, which leaves 40 s for the requests already running to finish. The role's
# logind drop-in raises InhibitDelayMaxSec to this plus a margin.
DEFAULT_TIMEOUT_S = 60.0
# What an engine without in-flight gauges (ollama, the generic driver) gets, as meridian.node.drain gives it.
DEFAULT_GRACE_S = 10.0
# How long the agent keeps its reading of root's draining marks (agent_side.observe.InventoryEngines'
# refresh_s; the root side may not import the agent's side, so a test checks that the two agree).
AGENT_ENGINES_REFRESH_S = 5.0
MARK_REASON = "host shutting down: drained by meridian-node-shutdown-drain.service"
_BOOT = re.compile(r"\(boot ([0-9A-Za-z-]{1,64})\)$")

# Who alone may announce a shutdown: logind's well-known name, at its object path.
LOGIND_NAME = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
_WHO = "meridian-node"
_WHY = "drain inference engines before they are stopped"


class LogindUnavailableError(MeridianError):
    """The system bus or logind cannot be reached, refused a call, or went away; the message says which."""


# --- what logind says -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShutdownSignal:
    """logind's ``PrepareForShutdown``: ``active`` True when a shutdown starts, False when one was cancelled."""

    active: bool


@dataclass(frozen=True)
class LogindOwnerChanged:
    """``org.freedesktop.login1`` has a new owner (logind restarted), or none (``owner`` None: it left the bus)."""

    owner: str | None


@dataclass(frozen=True)
class ForgedShutdownSignal:
    """A ``PrepareForShutdown`` that logind did not send: another bus client's, or at another object path."""

    sender: str
    path: str


LogindEvent = ShutdownSignal | LogindOwnerChanged | ForgedShutdownSignal


class LogindPort(Protocol):
    """What the service needs of logind: the seam the tests replace (``SystemBusLogind`` is the real one)."""

    def take_delay_lock(self, who: str, why: str) -> int:
        """A delay inhibitor lock on ``shutdown``: the file descriptor to close to release it (the caller's)."""
        ...

    def preparing_for_shutdown(self) -> bool: ...

    def inhibit_delay_max_s(self) -> float:
        """logind's ``InhibitDelayMaxSec``: how long it waits for delay locks at most."""
        ...

    def next_event(self) -> LogindEvent:
        """Block until logind says something; raises ``LogindUnavailableError`` when the bus is lost."""
        ...

    def close(self) -> None: ...


# --- engines ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainTarget:
    """One running engine of this node: its name (the draining mark's), its driver and where its gauges are."""

    name: str
    driver: Driver
    address: tuple[str, int] | None

    @property
    def has_gauges(self) -> bool:
        return self.driver.facts.has_metrics and self.address is not None


def running_engines(engine: Any, node_id: str) -> list[DrainTarget]:
    """This node's running engines (owner ``agent:<node id>``, as reconcile.yml labels them), by name.

    Foreign containers and other owners' engines (an operator's playbook, another agent on a shared Docker
    Engine) are not this agent's to take out of its projection.
    """
    owner = f"agent:{node_id}"
    targets = []
    for container in engine.list_owned():
        if container.labels.get(LABEL_OWNER) != owner or not container.running:
            continue
        driver = driver_of(container)
        targets.append(DrainTarget(container.instance or container.name, driver, probe_address(container, driver)))
    return sorted(targets, key=lambda target: (target.name, target.address or ("", 0)))


# --- the marks this service writes ------------------------------------------------------------------------


def shutdown_reason(boot_id: str) -> str:
    return f"{MARK_REASON} (boot {boot_id})"


def is_shutdown_mark(reason: str) -> bool:
    return reason.startswith(MARK_REASON)


def clear_shutdown_marks(state_dir: str, *, boot_id: str, this_boot: bool, log: EventLogger) -> list[str]:
    """Remove the marks this service wrote in another boot, and with ``this_boot`` those of this boot too.

    Another boot's mark is stale whatever logind says: that shutdown is over. A mark of this boot is stale
    only when no shutdown is under way (the caller has asked logind). Marks anyone else wrote are kept.
    Problems are logged, never raised: a bad mark must not keep the lock from being taken.
    """
    try:
        marks = list_draining(state_dir)
    except DrainStateError as exc:
        log.error("shutdown-marks-unreadable", reason=str(exc), hint="remove the file named, or run undrain")
        return []
    cleared = []
    for mark in marks:
        if not is_shutdown_mark(mark.reason):
            continue
        found = _BOOT.search(mark.reason)
        if found is not None and found.group(1) == boot_id and not this_boot:
            continue
        try:
            clear_draining(state_dir, mark.name)
        except DrainStateError as exc:
            log.error("shutdown-mark-not-cleared", engine=mark.name, reason=str(exc))
            continue
        cleared.append(mark.name)
    if cleared:
        log.info("shutdown-marks-cleared", engines=cleared, since_boot="this" if this_boot else "earlier")
    return cleared


# --- the drain --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainSettings:
    """The bound of the whole drain, the observation interval waited after marking, and the grace given to
    engines without in-flight gauges; all in seconds."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    # The agent's default heartbeat at its latest (observation_interval_s).
    settle_s: float = 15.0 * (1 + TIMER_JITTER) + AGENT_ENGINES_REFRESH_S
    grace_s: float = DEFAULT_GRACE_S


class IdleWaiter(Protocol):
    """``engines.drain.wait_until_idle``'s shape: the tests pass their own."""

    def __call__(
        self,
        driver: Driver,
        address: tuple[str, int] | None,
        *,
        timeout_s: float,
        grace_s: float,
        sleep: Callable[[float], None],
        clock: Callable[[], float],
    ) -> IdleOutcome: ...


@dataclass
class DrainReport:
    """What one drain did: for the log line, and for the tests."""

    bound_s: float
    engines: list[str] = field(default_factory=list)
    marked: list[str] = field(default_factory=list)  # marks this drain wrote (already marked ones are not)
    mark_failed: dict[str, str] = field(default_factory=dict)
    settled_s: float = 0.0
    outcomes: dict[str, IdleOutcome] = field(default_factory=dict)
    listing_failed: str | None = None
    waited_s: float = 0.0

    def busy(self) -> dict[str, str]:
        """The engines still busy when the bound passed, with what was in flight."""
        return {name: outcome.describe() for name, outcome in self.outcomes.items() if not outcome.idle}

    def fields(self) -> dict[str, Any]:
        return {
            "engines": self.engines,
            "marked": self.marked,
            "mark_failed": self.mark_failed or None,
            "settled_s": round(self.settled_s, 3),
            "still_busy": self.busy() or None,
            "waited_s": round(self.waited_s, 3),
            "bound_s": self.bound_s,
            "listing_failed": self.listing_failed,
        }


class ShutdownDrain:
    """The service's state: the lock it holds (a file descriptor) and whether this shutdown was drained.

    ``start`` arms it (clears stale marks, takes the lock); ``handle`` takes each event logind sends; ``release``
    closes the lock on every way out. Armed: the lock is held and no drain has run. Drained: the lock was
    released after a drain (or a shutdown was already under way at start), and only a cancellation re-arms it.
    """

    def __init__(
        self,
        logind: LogindPort,
        list_engines: Callable[[], list[DrainTarget]],
        *,
        state_dir: str,
        boot_id: str,
        settings: DrainSettings,
        log: EventLogger,
        wait: IdleWaiter = wait_until_idle,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        notify: Callable[[str], object] = lambda state: None,
    ) -> None:
        self.logind = logind
        self.list_engines = list_engines
        self.state_dir = state_dir
        self.boot_id = boot_id
        self.settings = settings
        self.log = log
        self._wait = wait
        self._sleep = sleep
        self._clock = clock
        self._notify = notify
        self.lock: int | None = None
        self.drained = False
        self.reports: list[DrainReport] = []

    def start(self) -> None:
        """Clear this service's stale marks and take the lock, unless a shutdown is under way already."""
        if self.logind.preparing_for_shutdown():
            # A restart of this service during a shutdown: its marks are this shutdown's, and logind has started
            # waiting already. Keep them; a cancellation re-arms.
            self.drained = True
            self.log.warning("shutdown-under-way-at-start", action="marks kept, no lock taken")
            self._notify("READY=1\nSTATUS=a shutdown is under way; not armed")
            return
        clear_shutdown_marks(self.state_dir, boot_id=self.boot_id, this_boot=True, log=self.log)
        self._take_lock()
        delay_max_s = self.logind.inhibit_delay_max_s()
        self.log.info(
            "shutdown-drain-armed",
            timeout_s=self.settings.timeout_s,
            settle_s=self.settings.settle_s,
            grace_s=self.settings.grace_s,
            logind_delay_max_s=delay_max_s,
        )
        if delay_max_s < self.settings.timeout_s:
            self.log.warning("logind-delay-too-short", **_delay_advice(delay_max_s, self.settings.timeout_s))
        if self.settings.settle_s >= self.settings.timeout_s:
            self.log.warning(
                "shutdown-drain-no-time-to-wait",
                settle_s=self.settings.settle_s,
                timeout_s=self.settings.timeout_s,
                hint="the observation interval uses the whole bound, so nothing is left for requests in flight; "
                "raise --timeout-seconds (and logind's InhibitDelayMaxSec with it)",
            )
        self._notify(f"READY=1\nSTATUS=armed: holding a delay lock, drain bound {self.settings.timeout_s:g} s")

    def handle(self, event: LogindEvent) -> None:
        if isinstance(event, ForgedShutdownSignal):
            self.log.warning(
                "shutdown-signal-ignored",
                sender=event.sender,
                path=event.path,
                why=f"only {LOGIND_NAME} at {LOGIND_PATH} may announce a shutdown; another bus client sent this",
            )
        elif isinstance(event, LogindOwnerChanged):
            self._owner_changed(event.owner)
        elif event.active:
            if self.drained:
                self.log.info("shutdown-already-drained")
                return
            self.drain()
        elif self.drained:
            self.log.info("shutdown-cancelled", action="marks of this shutdown cleared, lock taken again")
            self.drained = False
            clear_shutdown_marks(self.state_dir, boot_id=self.boot_id, this_boot=True, log=self.log)
            self._take_lock()
            self._notify("STATUS=armed again: the shutdown was cancelled")

    def drain(self) -> DrainReport:
        """The drain for one shutdown; the lock is released when it ends, whatever happened in it."""
        try:
            bound_s = self.settings.timeout_s
            try:
                delay_max_s = self.logind.inhibit_delay_max_s()
            except LogindUnavailableError:
                delay_max_s = bound_s  # logind is shutting us down; the configured bound is all we know
            if delay_max_s < bound_s:
                self.log.warning("logind-delay-too-short", **_delay_advice(delay_max_s, bound_s))
                bound_s = delay_max_s
            self.log.info("shutdown-drain-started", bound_s=bound_s)
            self._notify(f"STATUS=draining engines (bound {bound_s:g} s)")
            report = self._drain_engines(bound_s)
            self.reports.append(report)
            level = self.log.warning if report.busy() or report.mark_failed or report.listing_failed else self.log.info
            level("shutdown-drain-done", **report.fields())
            return report
        finally:
            self.drained = True
            self.release()
            self._notify("STATUS=drained; the shutdown may proceed")

    def _drain_engines(self, bound_s: float) -> DrainReport:
        """Mark, settle, wait: everything within ``bound_s`` of the call. Never raises for an engine's or Docker's
        trouble (it is logged in the report): whatever happens, ``drain`` releases the lock after this."""
        start = self._clock()
        deadline = start + bound_s
        report = DrainReport(bound_s=bound_s)
        try:
            targets = self.list_engines()
        except DockerEngineError as exc:
            # Nothing known to mark or wait for: the lock goes at once, as without this service.
            report.listing_failed = str(exc)
            report.waited_s = self._clock() - start
            return report
        # Two containers of one engine (a replace that starts the new one beside the old) share its name and mark.
        report.engines = list(dict.fromkeys(target.name for target in targets))
        repeated = {name for name in report.engines if sum(target.name == name for target in targets) > 1}
        for target in targets:
            if target.name in report.marked or target.name in report.mark_failed:
                continue
            try:
                _mark, new = mark_draining(self.state_dir, target.name, reason=shutdown_reason(self.boot_id))
            except DrainStateError as exc:
                report.mark_failed[target.name] = str(exc)  # still waited for: its requests may yet finish
                continue
            if new:
                report.marked.append(target.name)
        if report.marked:
            settle = min(self.settings.settle_s, max(0.0, deadline - self._clock()))
            self.log.info("shutdown-drain-settling", engines=report.marked, seconds=round(settle, 3))
            self._sleep(settle)
            report.settled_s = settle
        # One deadline for all: the engines drain at once, so waiting on one is time the others had too. Engines
        # with gauges first; those without share one grace from here rather than one each.
        idle_from = self._clock()
        for target in sorted(targets, key=lambda target: not target.has_gauges):
            remaining = max(0.0, deadline - self._clock())
            grace = max(0.0, self.settings.grace_s - (self._clock() - idle_from))
            key = (
                f"{target.name} (port {target.address[1]})"
                if target.name in repeated and target.address
                else target.name
            )
            report.outcomes[key] = self._wait(
                target.driver, target.address, timeout_s=remaining, grace_s=grace, sleep=self._sleep, clock=self._clock
            )
        report.waited_s = self._clock() - start
        return report

    def release(self) -> None:
        """Close the lock's descriptor if one is held: logind sees it released. Safe to call more than once."""
        lock, self.lock = self.lock, None
        if lock is not None:
            os.close(lock)
            self.log.info("delay-lock-released")

    def _take_lock(self) -> None:
        old, self.lock = self.lock, self.logind.take_delay_lock(_WHO, _WHY)
        if old is not None:
            os.close(old)  # after the new one is held: never a moment without a lock

    def _owner_changed(self, owner: str | None) -> None:
        if owner is None:
            self.log.warning("logind-left-the-bus", action="waiting for it to come back; the lock is kept")
            return
        self.log.info("logind-restarted", owner=owner)
        if self.lock is not None:
            # A lock taken from the old logind may not have survived the restart: take one from the new one.
            self._take_lock()


def _delay_advice(delay_max_s: float, timeout_s: float) -> dict[str, Any]:
    return {
        "logind_delay_max_s": delay_max_s,
        "timeout_s": timeout_s,
        "hint": (
            f"logind waits at most {delay_max_s:g} s for delay locks, so engines may be stopped with work in "
            f"flight after that; set InhibitDelayMaxSec={int(timeout_s) + 15} in "
            "/etc/systemd/logind.conf.d/ (roles/node_agent installs one) and run "
            "systemctl kill --signal=SIGHUP systemd-logind.service"
        ),
    }


def observation_interval_s(config: AgentConfig) -> float:
    """How long after a mark the agent has surely reported it: its cycle (the long-poll, else the heartbeat's
    pause) plus how long it keeps its reading of the marks. 0 without a control plane (air-gapped: no live
    projection to update)."""
    control = config.control_plane
    if control is None:
        return 0.0
    # A cycle ends at the lease's next renewal, jittered up to TIMER_JITTER late, or at the long-poll's end, which
    # the agent never makes longer than its setting.
    renewal_s = control.heartbeat_seconds * (1 + TIMER_JITTER)
    cycle_s = min(control.long_poll_seconds, renewal_s) if control.long_poll_seconds else renewal_s
    return float(cycle_s) + AGENT_ENGINES_REFRESH_S

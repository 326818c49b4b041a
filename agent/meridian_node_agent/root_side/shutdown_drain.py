"""``meridian-node shutdown-drain``: drain this node's engines before the host shuts down, run by root's
``meridian-node-shutdown-drain.service``.

Runs on: the root side only.

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
the signal: the system bus delivers any client's signals, so a ``PrepareForShutdown`` counts only when it comes
from the unique name that owns ``org.freedesktop.login1`` at ``/org/freedesktop/login1`` (a forged one is logged
and ignored).

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

Marks are boot-scoped. A mark this service wrote names the boot (``/proc/sys/kernel/random/boot_id``); at start,
before anything else, the marks it wrote in another boot are removed, and, once logind says no shutdown is under
way, those of this boot too (a shutdown that was cancelled). Marks written by anyone else (``meridian.node.drain``,
a replace) are never touched. If logind cancels the shutdown (``PrepareForShutdown(false)``) the service removes
its marks and takes a new lock. If logind restarts (a new owner of its name) the service takes a lock from the
new one and then lets go of the old one.

Exit status: 0 when stopped (SIGTERM), 1 when the system bus or logind is unavailable or lost (the unit restarts
it, within a start limit), 2 when the config says this node is not one root's units serve (no restart).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from jeepney import (
    DBusAddress,
    DBusErrorResponse,
    HeaderFields,
    MatchRule,
    Properties,
    message_bus,
    new_method_call,
)
from jeepney.io.blocking import open_dbus_connection
from jeepney.wrappers import unwrap_msg

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
from meridian_node_agent.logs import EventLogger, configure_logging
from meridian_node_agent.root_side.apply_unit import open_root_side
from meridian_node_agent.root_side.read_only_docker import connect_read_only

__all__ = [
    "AGENT_ENGINES_REFRESH_S",
    "DEFAULT_GRACE_S",
    "DEFAULT_TIMEOUT_S",
    "MARK_REASON",
    "VERB",
    "DrainReport",
    "DrainSettings",
    "DrainTarget",
    "ForgedShutdownSignal",
    "LogindOwnerChanged",
    "LogindPort",
    "LogindUnavailableError",
    "ServiceStopped",
    "ShutdownDrain",
    "ShutdownSignal",
    "SystemBusLogind",
    "add_parsers",
    "clear_shutdown_marks",
    "cmd_shutdown_drain",
    "drain_for_shutdown",
    "is_shutdown_mark",
    "notify_systemd",
    "observation_interval_s",
    "running_engines",
    "shutdown_reason",
]

VERB = "shutdown-drain"
# The whole drain, from PrepareForShutdown to the lock's release. The settle wait is part of it: with the
# agent's defaults that is 20 s, which leaves 40 s for the requests already running to finish. The role's
# logind drop-in raises InhibitDelayMaxSec to this plus a margin.
DEFAULT_TIMEOUT_S = 60.0
# What an engine without in-flight gauges (ollama, the generic driver) gets, as meridian.node.drain gives it.
DEFAULT_GRACE_S = 10.0
MAX_SECONDS = 3600.0
# How long the agent keeps its reading of root's draining marks (agent_side.observe.InventoryEngines'
# refresh_s; the root side may not import the agent's side, so a test checks that the two agree).
AGENT_ENGINES_REFRESH_S = 5.0
MARK_REASON = "host shutting down: drained by meridian-node-shutdown-drain.service"
_BOOT = re.compile(r"\(boot ([0-9A-Za-z-]{1,64})\)$")
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")

LOGIND_NAME = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
LOGIND_MANAGER = "org.freedesktop.login1.Manager"
_BUS_NAME = "org.freedesktop.DBus"
_BUS_PATH = "/org/freedesktop/DBus"
_WHO = "meridian-node"
_WHY = "drain inference engines before they are stopped"
_DOCKER_TIMEOUT_S = 10


class LogindUnavailableError(MeridianError):
    """The system bus or logind cannot be reached, refused a call, or went away; the message says which."""


class ServiceStopped(MeridianError):
    """Raised from the SIGTERM handler: the service is being stopped; the lock is released on the way out."""


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


def drain_for_shutdown(
    list_engines: Callable[[], list[DrainTarget]],
    *,
    state_dir: str,
    boot_id: str,
    settings: DrainSettings,
    bound_s: float,
    log: EventLogger,
    wait: IdleWaiter = wait_until_idle,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> DrainReport:
    """Mark, settle, wait: everything within ``bound_s`` of the call. Never raises for an engine's or Docker's
    trouble (it is logged in the report): whatever happens, the caller releases the lock after this."""
    start = clock()
    deadline = start + bound_s
    report = DrainReport(bound_s=bound_s)
    try:
        targets = list_engines()
    except DockerEngineError as exc:
        # Nothing known to mark or wait for: the lock goes at once, as without this service.
        report.listing_failed = str(exc)
        report.waited_s = clock() - start
        return report
    # Two containers of one engine (a replace that starts the new one beside the old) share its name and mark.
    report.engines = list(dict.fromkeys(target.name for target in targets))
    repeated = {name for name in report.engines if sum(target.name == name for target in targets) > 1}
    for target in targets:
        if target.name in report.marked or target.name in report.mark_failed:
            continue
        try:
            _mark, new = mark_draining(state_dir, target.name, reason=shutdown_reason(boot_id))
        except DrainStateError as exc:
            report.mark_failed[target.name] = str(exc)  # still waited for: its requests may yet finish
            continue
        if new:
            report.marked.append(target.name)
    if report.marked:
        settle = min(settings.settle_s, max(0.0, deadline - clock()))
        log.info("shutdown-drain-settling", engines=report.marked, seconds=round(settle, 3))
        sleep(settle)
        report.settled_s = settle
    # One deadline for all: the engines drain at once, so waiting on one is time the others had too. Engines
    # with gauges first; those without share one grace from here rather than one each.
    idle_from = clock()
    for target in sorted(targets, key=lambda target: not target.has_gauges):
        remaining = max(0.0, deadline - clock())
        grace = max(0.0, settings.grace_s - (clock() - idle_from))
        key = f"{target.name} (port {target.address[1]})" if target.name in repeated and target.address else target.name
        report.outcomes[key] = wait(
            target.driver, target.address, timeout_s=remaining, grace_s=grace, sleep=sleep, clock=clock
        )
    report.waited_s = clock() - start
    return report


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
            report = drain_for_shutdown(
                self.list_engines,
                state_dir=self.state_dir,
                boot_id=self.boot_id,
                settings=self.settings,
                bound_s=bound_s,
                log=self.log,
                wait=self._wait,
                sleep=self._sleep,
                clock=self._clock,
            )
            self.reports.append(report)
            level = self.log.warning if report.busy() or report.mark_failed or report.listing_failed else self.log.info
            level("shutdown-drain-done", **report.fields())
            return report
        finally:
            self.drained = True
            self.release()
            self._notify("STATUS=drained; the shutdown may proceed")

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


# --- logind on the system bus, through jeepney ------------------------------------------------------------


class SystemBusLogind:
    """``LogindPort`` over a real D-Bus connection (jeepney, blocking I/O).

    Every signal that arrives, also while a method call waits for its reply, goes to one queue, so none is
    lost between calls. Signals are matched on the bus (``AddMatch``) and checked again here: the bus also
    delivers signals addressed to this connection alone, whoever sent them.
    """

    def __init__(self, connection: Any, *, call_timeout_s: float = 25.0) -> None:
        self._connection = connection
        self._timeout_s = call_timeout_s
        self._signals: deque[Any] = deque()
        self._filter = connection.filter(MatchRule(type="signal"), queue=self._signals)
        self._owner: str | None = None

    @classmethod
    def connect(cls, bus: str = "SYSTEM") -> SystemBusLogind:
        """Connect to the system bus (``DBUS_SYSTEM_BUS_ADDRESS``, else /run/dbus/system_bus_socket), subscribe to
        logind's ``PrepareForShutdown`` and its name's owner changes, and find that owner."""
        try:
            connection = open_dbus_connection(bus=bus, enable_fds=True, auth_timeout=5.0)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            where = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "/run/dbus/system_bus_socket"
            raise LogindUnavailableError(
                f"cannot connect to the system bus at {where}: {exc!r}; is dbus running (systemctl status "
                "dbus.service)? The shutdown drain needs it to hear from systemd-logind"
            ) from exc
        logind = cls(connection)
        try:
            logind._subscribe()
            # A method call activates logind if it is not running yet; only then has its name an owner.
            logind.preparing_for_shutdown()
            logind._owner = logind._name_owner()
        except BaseException:
            connection.close()
            raise
        return logind

    def take_delay_lock(self, who: str, why: str) -> int:
        body = self._call(
            new_method_call(self._manager(), "Inhibit", "ssss", ("shutdown", who, why, "delay")),
            "taking a delay inhibitor lock for shutdown (org.freedesktop.login1.Manager.Inhibit)",
        )
        fd: int = body[0].to_raw_fd()
        return fd

    def preparing_for_shutdown(self) -> bool:
        return bool(self._property("PreparingForShutdown"))

    def inhibit_delay_max_s(self) -> float:
        return int(self._property("InhibitDelayMaxUSec")) / 1_000_000

    def next_event(self) -> LogindEvent:
        while True:
            while not self._signals:
                try:
                    self._connection.recv_messages(timeout=None)
                except (OSError, ValueError) as exc:
                    raise LogindUnavailableError(
                        f"lost the system bus ({exc!r}): logind's shutdown signal can no longer be heard"
                    ) from exc
            event = self._event(self._signals.popleft())
            if event is not None:
                return event

    def close(self) -> None:
        self._filter.close()
        self._connection.close()

    def _event(self, message: Any) -> LogindEvent | None:
        fields: Mapping[Any, Any] = message.header.fields
        sender = str(fields.get(HeaderFields.sender, ""))
        path = str(fields.get(HeaderFields.path, ""))
        interface = fields.get(HeaderFields.interface)
        member = fields.get(HeaderFields.member)
        body = message.body
        if (interface, member) == (_BUS_NAME, "NameOwnerChanged"):
            # Only the bus itself can send as org.freedesktop.DBus.
            if sender != _BUS_NAME or path != _BUS_PATH or len(body) != 3 or body[0] != LOGIND_NAME:
                return None
            self._owner = str(body[2]) or None
            return LogindOwnerChanged(self._owner)
        if (interface, member) != (LOGIND_MANAGER, "PrepareForShutdown"):
            return None
        if self._owner is None or sender != self._owner or path != LOGIND_PATH:
            return ForgedShutdownSignal(sender=sender, path=path)
        if len(body) != 1 or not isinstance(body[0], bool):
            return ForgedShutdownSignal(sender=sender, path=path)
        return ShutdownSignal(active=body[0])

    def _subscribe(self) -> None:
        shutdown = MatchRule(
            type="signal", sender=LOGIND_NAME, interface=LOGIND_MANAGER, member="PrepareForShutdown", path=LOGIND_PATH
        )
        owner = MatchRule(
            type="signal", sender=_BUS_NAME, interface=_BUS_NAME, member="NameOwnerChanged", path=_BUS_PATH
        )
        owner.add_arg_condition(0, LOGIND_NAME)
        for rule in (shutdown, owner):
            self._call(message_bus.AddMatch(rule), f"subscribing to {rule.serialise()}")

    def _name_owner(self) -> str:
        return str(self._call(message_bus.GetNameOwner(LOGIND_NAME), f"finding who owns {LOGIND_NAME}")[0])

    def _property(self, name: str) -> Any:
        body = self._call(Properties(self._manager()).get(name), f"reading logind's {name}")
        return body[0][1]  # a variant: (signature, value)

    def _manager(self) -> Any:
        return DBusAddress(LOGIND_PATH, bus_name=LOGIND_NAME, interface=LOGIND_MANAGER)

    def _call(self, message: Any, what: str) -> tuple[Any, ...]:
        try:
            reply = self._connection.send_and_get_reply(message, timeout=self._timeout_s)
        except TimeoutError as exc:
            raise LogindUnavailableError(f"{what}: no answer within {self._timeout_s:g} s") from exc
        except (OSError, ValueError) as exc:
            raise LogindUnavailableError(f"{what}: lost the system bus ({exc!r})") from exc
        try:
            body: tuple[Any, ...] = unwrap_msg(reply)
        except DBusErrorResponse as exc:
            raise LogindUnavailableError(
                f"{what}: {exc.name}: {' '.join(map(str, exc.data))}; is systemd-logind running (systemctl "
                "status systemd-logind.service), and does this run as root?"
            ) from exc
        return body


# --- the service ------------------------------------------------------------------------------------------


def notify_systemd(state: str, *, environ: Mapping[str, str] = os.environ) -> bool:
    """Tell systemd ``state`` (``READY=1``, ``STATUS=...``) on ``$NOTIFY_SOCKET``; False when not run by it."""
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as channel:
        channel.connect(target)
        channel.sendall(state.encode("utf-8"))
    return True


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return "unknown"  # marks then clear only when logind says no shutdown is under way


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} s is outside 0-{MAX_SECONDS:g} s")
    return value


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        VERB,
        help="(root) drain engines before the host shuts down; run by meridian-node-shutdown-drain.service",
        description="Hold a systemd-logind delay lock on shutdown. When logind announces a shutdown "
        "(PrepareForShutdown), mark this node's running engines draining in <apply.state_dir>/draining, wait one "
        "observation interval so the serving projection drops them, wait until their in-flight requests reach 0 "
        "or the bound passes, then release the lock. Runs until stopped. Exit 0 when stopped, 1 when the system "
        "bus or logind is unavailable, 2 when the config is not one root's units serve.",
    )
    verb.add_argument(
        "--timeout-seconds",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"longest the shutdown is held, observation interval included (default {DEFAULT_TIMEOUT_S:g}); logind "
        "waits at most InhibitDelayMaxSec, so raise that too",
    )
    verb.add_argument(
        "--settle-seconds",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help="wait this long after marking before counting in-flight work (default: one observation interval of "
        f"the agent, control_plane's long-poll or heartbeat plus {AGENT_ENGINES_REFRESH_S:g} s)",
    )
    verb.add_argument(
        "--grace-seconds",
        type=_positive_seconds,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help=f"what an engine without in-flight gauges gets (default {DEFAULT_GRACE_S:g})",
    )
    verb.set_defaults(handler=cmd_shutdown_drain)


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    def stop(signum: int, frame: FrameType | None) -> None:
        raise ServiceStopped(f"stopped by signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_shutdown_drain(
    args: argparse.Namespace,
    *,
    connect: Callable[[], LogindPort] = SystemBusLogind.connect,
    docker: Callable[[], Any] = lambda: connect_read_only(timeout_s=_DOCKER_TIMEOUT_S),
    boot_id: Callable[[], str] = read_boot_id,
    notify: Callable[[str], object] = notify_systemd,
    wait: IdleWaiter = wait_until_idle,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    opened = open_root_side(
        args.config,
        unit="shutdown drain (disable it: systemctl disable --now meridian-node-shutdown-drain.service)",
        nothing_done="no shutdown will be drained",
    )
    if opened is None:
        return 2  # a config that will not change by itself: the unit does not restart on 2
    config, root = opened
    configure_logging(config.log.level, config.log.format)
    log = EventLogger()
    state_dir, boot = str(root.path), boot_id()
    settle_s = observation_interval_s(config) if args.settle_seconds is None else args.settle_seconds
    settings = DrainSettings(timeout_s=args.timeout_seconds, settle_s=settle_s, grace_s=args.grace_seconds)
    # First, and without the bus: another boot's marks are stale whatever happens next.
    clear_shutdown_marks(state_dir, boot_id=boot, this_boot=False, log=log)

    def list_engines() -> list[DrainTarget]:
        return running_engines(docker(), config.node_id)

    with _stop_on_sigterm():
        try:
            logind = connect()
        except LogindUnavailableError as exc:
            print(f"error: {exc}; no shutdown will be drained until it is fixed", file=sys.stderr)
            return 1
        except ServiceStopped:
            return 0
        service = ShutdownDrain(
            logind,
            list_engines,
            state_dir=state_dir,
            boot_id=boot,
            settings=settings,
            log=log,
            wait=wait,
            sleep=sleep,
            clock=clock,
            notify=_notifier(notify, log),
        )
        try:
            service.start()
            while True:
                service.handle(logind.next_event())
        except ServiceStopped:
            return 0
        except LogindUnavailableError as exc:
            print(f"error: {exc}; no shutdown will be drained until it is fixed", file=sys.stderr)
            return 1
        finally:
            service.release()
            logind.close()


def _notifier(notify: Callable[[str], object], log: EventLogger) -> Callable[[str], object]:
    def send(state: str) -> object:
        try:
            return notify(state)
        except OSError as exc:
            log.warning("systemd-notify-failed", state=state.splitlines()[0], error=str(exc))
            return None

    return send

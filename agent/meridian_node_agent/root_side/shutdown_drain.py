"""``meridian-node shutdown-drain``: drain this node's engines before the host shuts down, run by root's
``meridian-node-shutdown-drain.service``.

Runs on: the root side only.

The verb: its arguments, root's config and directory, the system bus, SIGTERM and systemd's notify socket. What
the service does with logind's signals, and why (a delay lock; mark, settle, wait; boot-scoped marks), is
``root_side.drain_on_shutdown``; logind on the bus is ``root_side.logind_bus``.

Exit status: 0 when stopped (SIGTERM), 1 when the system bus or logind is unavailable or lost (the unit restarts
it, within a start limit), 2 when the config says this node is not one root's units serve (no restart).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import wait_until_idle
from meridian_node_agent.boundary.boot import read_boot_id
from meridian_node_agent.logs import EventLogger, configure_logging
from meridian_node_agent.root_side.apply_unit import open_root_side
from meridian_node_agent.root_side.drain_on_shutdown import (
    AGENT_ENGINES_REFRESH_S,
    DEFAULT_GRACE_S,
    DEFAULT_TIMEOUT_S,
    DrainSettings,
    DrainTarget,
    IdleWaiter,
    LogindPort,
    LogindUnavailableError,
    ShutdownDrain,
    clear_shutdown_marks,
    observation_interval_s,
    running_engines,
)
from meridian_node_agent.root_side.logind_bus import SystemBusLogind
from meridian_node_agent.root_side.read_only_docker import connect_read_only

__all__ = ["MAX_SECONDS", "VERB", "ServiceStopped", "add_parsers", "cmd_shutdown_drain", "notify_systemd"]

VERB = "shutdown-drain"
MAX_SECONDS = 3600.0
# A mark of a boot whose id could not be read names this one: such marks clear only when logind says no shutdown is
# under way.
_UNKNOWN_BOOT = "unknown"
_DOCKER_TIMEOUT_S = 10


class ServiceStopped(MeridianError):
    """Raised from the SIGTERM handler: the service is being stopped; the lock is released on the way out."""


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
    boot_id: Callable[[], str | None] = read_boot_id,
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
    state_dir, boot = str(root.path), boot_id() or _UNKNOWN_BOOT
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

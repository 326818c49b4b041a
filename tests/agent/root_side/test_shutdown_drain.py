"""``meridian-node shutdown-drain``: root's drain before the host shuts down, without D-Bus.

logind is stood in for at the service's one seam (``LogindPort``): the fake hands out real pipe ends as its
locks and reads the other end the way logind reads its FIFO, so "released" means the descriptor really was
closed. The engines' gauges come from a real HTTP server on loopback, read by the real ``wait_until_idle``
and vLLM driver; only the clock is fake (the server reads it too), so the bound and the ordering are exact.
The jeepney adapter's checks (who may announce a shutdown) run on real jeepney messages through a scripted
connection. tests/system/systemd_host/test_shutdown_drain_host.py runs the unit against the real logind.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from jeepney import DBusAddress, HeaderFields, MatchRule, new_signal

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_CONFIG_HASH,
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
    ContainerInfo,
    DockerUnavailableError,
    PublishedPort,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DRAINING_DIR,
    list_draining,
    mark_draining,
    read_mark,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.tests.support.systemd_units import UNITS, read_unit
from meridian_node_agent.agent_side.observe import InventoryEngines
from meridian_node_agent.cli import build_parser
from meridian_node_agent.config import DEFAULT_CONFIG_PATH, AgentConfig
from meridian_node_agent.logs import EventLogger
from meridian_node_agent.root_side import shutdown_drain
from meridian_node_agent.root_side.drain_on_shutdown import (
    AGENT_ENGINES_REFRESH_S,
    DEFAULT_TIMEOUT_S,
    DrainSettings,
    DrainTarget,
    ForgedShutdownSignal,
    LogindEvent,
    LogindOwnerChanged,
    LogindUnavailableError,
    ShutdownDrain,
    ShutdownSignal,
    clear_shutdown_marks,
    observation_interval_s,
    running_engines,
    shutdown_reason,
)
from meridian_node_agent.root_side.logind_bus import SystemBusLogind
from meridian_node_agent.root_side.shutdown_drain import ServiceStopped, cmd_shutdown_drain, notify_systemd

NODE = "gpu-node-7"
BOOT, OLD_BOOT = "9f0e4c1a-0000-4000-8000-000000000001", "1b2c3d4e-0000-4000-8000-000000000002"
UNIT = "meridian-node-shutdown-drain.service"
LOGIND_OWNER, INTRUDER = ":1.3", ":1.42"


# --- stand-ins --------------------------------------------------------------------------------------------


_LOGIND_ENDS: list[int] = []


@pytest.fixture(autouse=True)
def _close_logind_ends() -> Iterator[None]:
    yield
    while _LOGIND_ENDS:
        os.close(_LOGIND_ENDS.pop())


class FakeTime:
    """A monotonic clock that moves only when something sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, f"slept {seconds} s"
        self.now += seconds


class FakeLogind:
    """``LogindPort`` with real locks: each is a pipe whose write end the service holds, as logind's FIFO."""

    def __init__(self, *, events: list[LogindEvent | Callable[[], LogindEvent]] | None = None, **state: Any) -> None:
        self.preparing: bool = state.get("preparing", False)
        self.delay_max_s: float = state.get("delay_max_s", 75.0)
        self.events: deque[LogindEvent | Callable[[], LogindEvent]] = deque(events or [])
        self.lock_ends: list[int] = []  # logind's end of each lock, in the order they were taken
        self.closed = False

    def take_delay_lock(self, who: str, why: str) -> int:
        assert who == "meridian-node" and why
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        self.lock_ends.append(read_end)
        _LOGIND_ENDS.append(read_end)
        return write_end

    def held(self) -> list[bool]:
        """Per lock taken, whether the service still holds it (its end of the pipe is open)."""
        states = []
        for end in self.lock_ends:
            try:
                states.append(os.read(end, 1) != b"")
            except BlockingIOError:
                states.append(True)
        return states

    def preparing_for_shutdown(self) -> bool:
        return self.preparing

    def inhibit_delay_max_s(self) -> float:
        return self.delay_max_s

    def next_event(self) -> LogindEvent:
        if not self.events:
            raise ServiceStopped("the test has no more events to send")
        event = self.events.popleft()
        return event() if callable(event) else event

    def close(self) -> None:
        self.closed = True  # logind's ends stay readable: the test asks afterwards what was released


class Gauges:
    """A vLLM metrics page on loopback whose running gauge counts the busy windows the fake clock is in."""

    def __init__(self, time: FakeTime) -> None:
        self.time = time
        self.busy: list[tuple[float, float]] = []  # (from, until) in the fake clock's seconds
        gauges = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                now = gauges.time.now
                running = sum(1 for start, end in gauges.busy if start <= now < end)
                body = (
                    f'vllm:num_requests_running{{model_name="m"}} {float(running)}\n'
                    f'vllm:num_requests_waiting{{model_name="m"}} 0.0\n'
                ).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def target(self, name: str) -> DrainTarget:
        return DrainTarget(name, get_driver("vllm"), ("127.0.0.1", self.port))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname.lower(), record.getMessage(), dict(getattr(record, "fields", {}))))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for _level, name, fields in self.seen if name == event]


@pytest.fixture
def time_() -> FakeTime:
    return FakeTime()


@pytest.fixture
def gauges(time_: FakeTime) -> Iterator[Gauges]:
    server = Gauges(time_)
    yield server
    server.close()


@pytest.fixture
def events() -> Iterator[tuple[EventLogger, Events]]:
    logger = logging.getLogger(f"test-shutdown-drain-{secrets.token_hex(4)}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = Events()
    logger.addHandler(handler)
    yield EventLogger(logger), handler
    logger.removeHandler(handler)


def generic(name: str) -> DrainTarget:
    """An engine without in-flight gauges (the generic OpenAI-compatible driver)."""
    return DrainTarget(name, get_driver("openai"), ("127.0.0.1", 9))


def service(
    logind: FakeLogind,
    targets: Callable[[], list[DrainTarget]],
    state_dir: Path,
    time_: FakeTime,
    log: EventLogger,
    settings: DrainSettings | None = None,
) -> ShutdownDrain:
    return ShutdownDrain(
        logind,
        targets,
        state_dir=str(state_dir),
        boot_id=BOOT,
        settings=settings or DrainSettings(timeout_s=60, settle_s=20, grace_s=10),
        log=log,
        sleep=time_.sleep,
        clock=time_.clock,
    )


# --- the drain: which engines, in which order, within which bound ---------------------------------------


def _container(name: str, *, owner: str | None, state: str = "running", driver: str = "vllm") -> ContainerInfo:
    labels = {LABEL_OWNED: "true", LABEL_INSTANCE: name, LABEL_DRIVER: driver, LABEL_CONFIG_HASH: "x"}
    if owner is not None:
        labels[LABEL_OWNER] = owner
    return ContainerInfo(
        id=secrets.token_hex(8),
        name=name,
        image="repo@sha256:" + "0" * 64,
        image_id="sha256:" + "1" * 64,
        state=state,
        status=state,
        labels=labels,
        ports=(PublishedPort("0.0.0.0", 8101, 8000),),
        owned=True,
    )


class FakeDocker:
    def __init__(self, containers: list[ContainerInfo]) -> None:
        self.containers = containers

    def list_owned(self) -> list[ContainerInfo]:
        return list(self.containers)


def test_only_this_nodes_running_engines_are_drained_not_another_owners_or_a_stopped_one() -> None:
    docker = FakeDocker(
        [
            _container("chat", owner=f"agent:{NODE}"),
            _container("embed", owner=f"agent:{NODE}", driver="ollama"),
            _container("stopped", owner=f"agent:{NODE}", state="exited"),
            _container("operators", owner=None),  # a playbook's engine: not the agent's projection
            _container("neighbours", owner="agent:gpu-node-8"),  # another node on a shared Docker Engine
        ]
    )

    targets = running_engines(docker, NODE)

    assert [(t.name, t.driver.name, t.address) for t in targets] == [
        ("chat", "vllm", ("127.0.0.1", 8101)),
        ("embed", "ollama", ("127.0.0.1", 8101)),
    ]
    assert [t.has_gauges for t in targets] == [True, False]


def test_a_request_routed_during_the_settle_wait_finishes_before_the_lock_is_released(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    # Idle when the shutdown starts; a request the gateway sends before it has the agent's report arrives 5 s
    # later and runs 15 s. Counting in-flight work at once would release the lock at 0 s and cut it.
    start = time_.now
    gauges.busy = [(start + 5, start + 20)]
    logind = FakeLogind(events=[ShutdownSignal(True)])
    drain = service(logind, lambda: [gauges.target("chat")], tmp_path, time_, events[0])
    drain.start()
    assert logind.held() == [True]

    drain.handle(logind.next_event())

    report = drain.reports[0]
    assert report.marked == ["chat"] and report.settled_s == 20
    assert report.outcomes["chat"].idle and report.outcomes["chat"].method == "metrics"
    assert time_.now - start == pytest.approx(20, abs=0.3)  # the request's end, not 0 s
    assert logind.held() == [False]
    mark = read_mark(str(tmp_path), "chat")
    assert mark is not None and mark.reason == shutdown_reason(BOOT)


def test_an_engine_that_never_goes_idle_holds_the_shutdown_exactly_the_bound_then_is_reported_busy(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    start = time_.now
    gauges.busy = [(0, float("inf"))]
    logind = FakeLogind()
    drain = service(logind, lambda: [gauges.target("chat")], tmp_path, time_, events[0])
    drain.start()

    drain.handle(ShutdownSignal(True))

    assert time_.now - start == pytest.approx(60, abs=0.3)
    assert drain.reports[0].busy() == {"chat": "1 running, 0 waiting"}
    assert logind.held() == [False]
    (done,) = events[1].named("shutdown-drain-done")
    assert done["still_busy"] == {"chat": "1 running, 0 waiting"} and done["bound_s"] == 60


def test_loginds_shorter_delay_cuts_the_bound_and_says_how_to_raise_it(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    # logind's default InhibitDelayMaxSec is 5 s: past it logind shuts down without us, so waiting longer is a lie.
    start = time_.now
    gauges.busy = [(0, float("inf"))]
    logind = FakeLogind(delay_max_s=5.0)
    drain = service(logind, lambda: [gauges.target("chat")], tmp_path, time_, events[0])
    drain.start()

    drain.handle(ShutdownSignal(True))

    assert time_.now - start == pytest.approx(5, abs=0.3)
    warnings = events[1].named("logind-delay-too-short")
    assert len(warnings) == 2  # at start, and when the shutdown came
    assert "InhibitDelayMaxSec=75" in warnings[0]["hint"] and "SIGHUP" in warnings[0]["hint"]


def test_engines_already_marked_by_an_operator_need_no_settle_and_keep_their_mark(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    mark_draining(str(tmp_path), "chat", reason="drained by meridian.node.drain")
    start = time_.now
    logind = FakeLogind()
    drain = service(logind, lambda: [gauges.target("chat")], tmp_path, time_, events[0])
    drain.start()

    drain.handle(ShutdownSignal(True))

    assert drain.reports[0].marked == [] and drain.reports[0].settled_s == 0
    assert time_.now - start < 1  # out of the projection already, and idle: nothing to wait for
    mark = read_mark(str(tmp_path), "chat")
    assert mark is not None and mark.reason == "drained by meridian.node.drain"


def test_engines_without_gauges_share_one_grace_instead_of_one_each(
    tmp_path: Path, time_: FakeTime, events: tuple[EventLogger, Events]
) -> None:
    start = time_.now
    logind = FakeLogind()
    drain = service(logind, lambda: [generic("a"), generic("b"), generic("c")], tmp_path, time_, events[0])
    drain.start()

    drain.handle(ShutdownSignal(True))

    assert time_.now - start == pytest.approx(20 + 10)  # settle, then one grace
    assert {o.method for o in drain.reports[0].outcomes.values()} == {"grace"}


def test_both_containers_of_an_engine_being_replaced_get_one_mark_and_are_both_waited_for(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    # A replace starts the new container beside the old under the same engine name, on another port.
    start = time_.now
    gauges.busy = [(0, start + 25)]
    other = Gauges(time_)
    try:
        logind = FakeLogind()
        drain = service(logind, lambda: [gauges.target("chat"), other.target("chat")], tmp_path, time_, events[0])
        drain.start()

        drain.handle(ShutdownSignal(True))
    finally:
        other.close()

    report = drain.reports[0]
    assert report.engines == ["chat"] and report.marked == ["chat"]
    assert sorted(report.outcomes) == sorted([f"chat (port {gauges.port})", f"chat (port {other.port})"])
    assert all(outcome.idle for outcome in report.outcomes.values())
    assert time_.now - start == pytest.approx(25, abs=0.3)


def test_docker_unreachable_at_shutdown_lets_the_shutdown_go_at_once_and_says_why(
    tmp_path: Path, time_: FakeTime, events: tuple[EventLogger, Events]
) -> None:
    def unreachable() -> list[DrainTarget]:
        raise DockerUnavailableError("Error connecting to the Docker Engine: no socket")

    start = time_.now
    logind = FakeLogind()
    drain = service(logind, unreachable, tmp_path, time_, events[0])
    drain.start()

    drain.handle(ShutdownSignal(True))

    assert time_.now == start and logind.held() == [False]
    (done,) = events[1].named("shutdown-drain-done")
    assert "no socket" in done["listing_failed"]


def test_a_mark_that_cannot_be_written_is_reported_and_the_engine_is_still_waited_for(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    (tmp_path / DRAINING_DIR).write_text("not a directory")
    start = time_.now
    gauges.busy = [(0, start + 8)]
    logind = FakeLogind()
    drain = service(logind, lambda: [gauges.target("chat")], tmp_path, time_, events[0])
    drain.start()

    drain.handle(ShutdownSignal(True))

    report = drain.reports[0]
    assert "draining mark" in report.mark_failed["chat"] and "Not a directory" in report.mark_failed["chat"]
    assert report.outcomes["chat"].idle and time_.now - start == pytest.approx(8, abs=0.3)
    assert logind.held() == [False]


@pytest.mark.parametrize(
    "fault",
    ["SIGTERM while settling", "a bug in the wait", "logind gone while reading its delay"],
)
def test_the_lock_is_released_on_every_way_out_of_a_drain(
    fault: str, tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    logind = FakeLogind()

    def sleep(seconds: float) -> None:
        if fault == "SIGTERM while settling":
            raise ServiceStopped("stopped by signal SIGTERM")
        time_.sleep(seconds)

    def wait(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    drain = ShutdownDrain(
        logind,
        lambda: [gauges.target("chat")],
        state_dir=str(tmp_path),
        boot_id=BOOT,
        settings=DrainSettings(timeout_s=60, settle_s=20, grace_s=10),
        log=events[0],
        sleep=sleep,
        clock=time_.clock,
        **({"wait": wait} if fault == "a bug in the wait" else {}),
    )
    drain.start()
    if fault == "logind gone while reading its delay":

        def gone() -> float:
            raise LogindUnavailableError("lost the system bus")

        logind.inhibit_delay_max_s = gone  # type: ignore[method-assign]

    with contextlib.suppress(ServiceStopped, RuntimeError):
        drain.handle(ShutdownSignal(True))

    assert logind.held() == [False]
    assert drain.lock is None


# --- forged signals, cancellations, restarts, boots -------------------------------------------------------


def test_a_forged_prepare_for_shutdown_changes_nothing(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    logind = FakeLogind()
    drain = service(logind, lambda: [gauges.target("chat")], tmp_path, time_, events[0])
    drain.start()

    drain.handle(ForgedShutdownSignal(sender=INTRUDER, path="/org/freedesktop/login1"))

    assert list_draining(str(tmp_path)) == [] and logind.held() == [True] and not drain.reports
    (ignored,) = events[1].named("shutdown-signal-ignored")
    assert ignored["sender"] == INTRUDER


def test_a_cancelled_shutdown_puts_the_engines_back_and_takes_a_new_lock(
    tmp_path: Path, time_: FakeTime, gauges: Gauges, events: tuple[EventLogger, Events]
) -> None:
    mark_draining(str(tmp_path), "embed", reason="drained by meridian.node.drain")
    logind = FakeLogind()
    drain = service(logind, lambda: [gauges.target("chat"), gauges.target("embed")], tmp_path, time_, events[0])
    drain.start()
    drain.handle(ShutdownSignal(True))
    assert [m.name for m in list_draining(str(tmp_path))] == ["chat", "embed"]

    drain.handle(ShutdownSignal(True))  # logind repeats itself: drained already, nothing happens twice
    drain.handle(ShutdownSignal(False))

    assert [m.name for m in list_draining(str(tmp_path))] == ["embed"]  # the operator's drain stays
    assert logind.held() == [False, True] and len(drain.reports) == 1


def test_a_logind_restart_gets_a_lock_from_the_new_logind_before_the_old_one_goes(
    tmp_path: Path, time_: FakeTime, events: tuple[EventLogger, Events]
) -> None:
    logind = FakeLogind()
    drain = service(logind, list, tmp_path, time_, events[0])
    drain.start()

    drain.handle(LogindOwnerChanged(None))  # gone for a moment: keep what we hold
    assert logind.held() == [True]
    drain.handle(LogindOwnerChanged(":1.99"))

    assert logind.held() == [False, True]


def test_marks_of_an_earlier_boot_go_at_start_the_operators_stay(
    tmp_path: Path, events: tuple[EventLogger, Events]
) -> None:
    state = str(tmp_path)
    mark_draining(state, "old", reason=shutdown_reason(OLD_BOOT))
    mark_draining(state, "this", reason=shutdown_reason(BOOT))
    mark_draining(state, "operators", reason="drained by meridian.node.drain")

    # Without asking logind (the bus may be down): only what is surely over.
    assert clear_shutdown_marks(state, boot_id=BOOT, this_boot=False, log=events[0]) == ["old"]
    assert [m.name for m in list_draining(state)] == ["operators", "this"]
    assert clear_shutdown_marks(state, boot_id=BOOT, this_boot=True, log=events[0]) == ["this"]
    assert [m.name for m in list_draining(state)] == ["operators"]


def test_a_restart_during_a_shutdown_keeps_the_marks_and_takes_no_lock(
    tmp_path: Path, time_: FakeTime, events: tuple[EventLogger, Events]
) -> None:
    mark_draining(str(tmp_path), "chat", reason=shutdown_reason(BOOT))
    logind = FakeLogind(preparing=True)
    drain = service(logind, list, tmp_path, time_, events[0])

    drain.start()
    drain.handle(ShutdownSignal(True))

    assert [m.name for m in list_draining(str(tmp_path))] == ["chat"]
    assert logind.lock_ends == [] and drain.drained and not drain.reports
    drain.handle(ShutdownSignal(False))  # and if it is cancelled after all, the service arms again
    assert list_draining(str(tmp_path)) == [] and logind.held() == [True]


def test_an_unreadable_mark_is_logged_and_the_lock_is_still_taken(
    tmp_path: Path, time_: FakeTime, events: tuple[EventLogger, Events]
) -> None:
    (tmp_path / DRAINING_DIR).mkdir()
    (tmp_path / DRAINING_DIR / "chat.json").write_text("{not json")
    logind = FakeLogind()

    service(logind, list, tmp_path, time_, events[0]).start()

    assert logind.held() == [True]
    (problem,) = events[1].named("shutdown-marks-unreadable")
    assert "chat.json is not JSON" in problem["reason"]


# --- the jeepney adapter: who may announce a shutdown -----------------------------------------------------


def _signal(sender: str, member: str, signature: str, body: tuple[Any, ...], **where: str) -> Any:
    path = where.get("path", "/org/freedesktop/login1")
    interface = where.get("interface", "org.freedesktop.login1.Manager")
    message = new_signal(DBusAddress(path, interface=interface), member, signature, body)
    message.header.fields[HeaderFields.sender] = sender
    return message


class ScriptedConnection:
    """What ``SystemBusLogind`` uses of a jeepney blocking connection, fed with scripted incoming messages."""

    def __init__(self, incoming: list[Any]) -> None:
        self.incoming = deque(incoming)
        self.filters: list[tuple[MatchRule, deque[Any]]] = []

    def filter(self, rule: MatchRule, *, queue: deque[Any]) -> Any:
        self.filters.append((rule, queue))
        return contextlib.nullcontext(lambda: None)

    def recv_messages(self, *, timeout: float | None = None) -> None:
        if not self.incoming:
            raise ConnectionResetError("the bus closed the connection")
        message = self.incoming.popleft()
        for rule, queue in self.filters:
            if rule.matches(message):
                queue.append(message)


def test_only_loginds_own_prepare_for_shutdown_counts_a_unicast_forgery_does_not() -> None:
    bus_owner_change = _signal(
        "org.freedesktop.DBus",
        "NameOwnerChanged",
        "sss",
        ("org.freedesktop.login1", LOGIND_OWNER, ":1.50"),
        path="/org/freedesktop/DBus",
        interface="org.freedesktop.DBus",
    )
    connection = ScriptedConnection(
        [
            _signal(INTRUDER, "PrepareForShutdown", "b", (True,)),  # the agent's user, on the same bus
            _signal(LOGIND_OWNER, "PrepareForShutdown", "b", (True,), path="/org/freedesktop/login1/session/x"),
            _signal(
                INTRUDER,
                "NameOwnerChanged",
                "sss",
                ("org.freedesktop.login1", "", INTRUDER),
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
            ),
            _signal(LOGIND_OWNER, "PrepareForShutdown", "b", (True,)),
            bus_owner_change,  # logind restarted: from now on only :1.50 speaks for it
            _signal(LOGIND_OWNER, "PrepareForShutdown", "b", (False,)),
            _signal(":1.50", "PrepareForShutdown", "b", (False,)),
        ]
    )
    logind = SystemBusLogind(connection)
    logind._owner = LOGIND_OWNER

    seen = []
    with contextlib.suppress(LogindUnavailableError):
        while True:
            seen.append(logind.next_event())

    assert seen == [
        ForgedShutdownSignal(sender=INTRUDER, path="/org/freedesktop/login1"),
        ForgedShutdownSignal(sender=LOGIND_OWNER, path="/org/freedesktop/login1/session/x"),
        # the intruder's NameOwnerChanged is dropped: only the bus itself sends as org.freedesktop.DBus
        ShutdownSignal(active=True),
        LogindOwnerChanged(":1.50"),
        ForgedShutdownSignal(sender=LOGIND_OWNER, path="/org/freedesktop/login1"),
        ShutdownSignal(active=False),
    ]


def test_a_lost_bus_ends_the_wait_with_what_happened() -> None:
    logind = SystemBusLogind(ScriptedConnection([]))

    with pytest.raises(LogindUnavailableError, match=r"lost the system bus.*ConnectionResetError"):
        logind.next_event()


def test_no_system_bus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path / 'no-bus'}")

    with pytest.raises(LogindUnavailableError) as raised:
        SystemBusLogind.connect()

    assert f"cannot connect to the system bus at unix:path={tmp_path / 'no-bus'}" in str(raised.value)
    assert "systemctl status dbus.service" in str(raised.value)


# --- the verb, its defaults and its unit -------------------------------------------------------------------


def _config(root: Path, *, via: str = "systemd", **control: Any) -> Path:
    config = {
        "node_id": NODE,
        "mode": "managed-host",
        "state_dir": str(root / "state"),
        "control_plane": {"url": "https://127.0.0.1:9", **control},
        "apply": {"via": via, "state_dir": str(root / "apply")},
        "log": {"format": "text", "level": "debug"},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def _args(config: Path, *extra: str) -> argparse.Namespace:
    return build_parser("shutdown-drain").parse_args(["--config", str(config), "shutdown-drain", *extra])


def test_the_verb_drains_on_the_signal_and_exits_0_on_sigterm_with_the_lock_released(
    tmp_path: Path, time_: FakeTime, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, heartbeat_seconds=2, long_poll_seconds=0)
    logind = FakeLogind(events=[ShutdownSignal(True)])
    docker = FakeDocker([_container("chat", owner=f"agent:{NODE}", driver="openai")])
    notified: list[str] = []

    status = cmd_shutdown_drain(
        _args(config, "--grace-seconds", "3"),
        connect=lambda: logind,
        docker=lambda: docker,
        boot_id=lambda: BOOT,
        notify=notified.append,
        sleep=time_.sleep,
        clock=time_.clock,
    )

    assert status == 0
    assert logind.held() == [False] and logind.closed
    assert [m.name for m in list_draining(str(tmp_path / "apply"))] == ["chat"]
    assert notified[0].startswith("READY=1\nSTATUS=armed")
    # Settle from the config (the heartbeat at its latest, jitter included), then the grace.
    assert time_.now - 1000 == pytest.approx((2 * 1.1 + AGENT_ENGINES_REFRESH_S) + 3)
    assert "shutdown-drain-done" in capsys.readouterr().err


def test_no_bus_exits_1_saying_so_after_clearing_an_earlier_boots_marks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    # An earlier boot left a mark in root's directory.
    (tmp_path / "apply").mkdir(mode=0o711)
    mark_draining(str(tmp_path / "apply"), "chat", reason=shutdown_reason(OLD_BOOT))

    def no_bus() -> FakeLogind:
        raise LogindUnavailableError("cannot connect to the system bus at /run/dbus/system_bus_socket: refused")

    status = cmd_shutdown_drain(_args(config), connect=no_bus, boot_id=lambda: BOOT)

    assert status == 1
    assert "error: cannot connect to the system bus" in capsys.readouterr().err
    assert list_draining(str(tmp_path / "apply")) == []


def test_an_in_process_config_exits_2_which_the_unit_does_not_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, via="in-process")

    assert cmd_shutdown_drain(_args(config), connect=FakeLogind) == 2

    error = capsys.readouterr().err
    assert "apply.via: in-process" in error and "systemctl disable --now meridian-node-shutdown-drain.service" in error
    assert _one("Service", "RestartPreventExitStatus") == "2"


@pytest.mark.parametrize(
    ("control", "expected"),
    [
        # The renewal ends a cycle up to 10 % (the agent's timer jitter) after heartbeat_seconds; a long-poll never
        # lasts longer than its setting.
        ({}, 15 * 1.1 + AGENT_ENGINES_REFRESH_S),
        ({"long_poll_seconds": 0, "heartbeat_seconds": 1}, 1 * 1.1 + AGENT_ENGINES_REFRESH_S),
        ({"long_poll_seconds": 4, "heartbeat_seconds": 30}, 4 + AGENT_ENGINES_REFRESH_S),
    ],
)
def test_the_settle_wait_is_one_observation_interval_of_the_agent(
    tmp_path: Path, control: dict[str, Any], expected: float
) -> None:
    from meridian_node_agent.config import load_config

    assert observation_interval_s(load_config(_config(tmp_path, **control))) == pytest.approx(expected)


def test_the_settle_wait_knows_how_long_the_agent_keeps_its_reading_of_the_marks() -> None:
    refresh = inspect.signature(InventoryEngines).parameters["refresh_s"].default
    assert refresh == AGENT_ENGINES_REFRESH_S
    airgapped = AgentConfig.model_validate(
        {"node_id": NODE, "mode": "air-gapped", "air_gap": {"inbox": "/i", "outbox": "/o"}}
    )
    assert observation_interval_s(airgapped) == 0  # no live projection to wait for


@pytest.mark.parametrize("bad", ["-1", "3601", "soon"])
def test_a_bad_bound_is_refused_by_the_parser(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser("shutdown-drain").parse_args(["shutdown-drain", "--timeout-seconds", bad])
    assert "--timeout-seconds" in capsys.readouterr().err


@pytest.mark.parametrize("abstract", [False, True])
def test_readiness_reaches_systemds_notify_socket(tmp_path: Path, abstract: bool) -> None:
    name = f"@meridian-test-{secrets.token_hex(4)}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name[1:] if abstract else name)

        assert notify_systemd("READY=1", environ={"NOTIFY_SOCKET": name})

        assert listener.recv(100) == b"READY=1"
    assert not notify_systemd("READY=1", environ={})


def _one(section: str, key: str) -> str:
    values = read_unit(UNIT)[section][key]
    assert len(values) == 1, f"{UNIT} [{section}] {key}= is set {len(values)} times"
    return values[0]


def test_the_unit_runs_the_verb_as_root_notify_typed_after_docker_and_restarts_only_on_failure() -> None:
    argv = shlex.split(_one("Service", "ExecStart"))
    args = build_parser().parse_args(argv[1:])
    assert args.handler is cmd_shutdown_drain and args.config == DEFAULT_CONFIG_PATH
    assert args.timeout_seconds == DEFAULT_TIMEOUT_S
    assert (_one("Service", "User"), _one("Service", "Type")) == ("root", "notify")
    assert "docker.service" in _one("Unit", "After").split()
    assert (_one("Service", "Restart"), _one("Unit", "StartLimitBurst")) == ("on-failure", "5")
    assert _one("Service", "StateDirectory") == "meridian-node-apply"
    assert _one("Install", "WantedBy") == "multi-user.target"


def test_the_unit_passes_systemd_analyze_verify_without_a_word(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    binary = Path(sys.executable).parent / "meridian-node"
    text = (UNITS / UNIT).read_text().replace("/opt/meridian-node/bin/meridian-node", str(binary))
    (tmp_path / UNIT).write_text(text)

    verify = subprocess.run([analyze, "verify", str(tmp_path / UNIT)], capture_output=True, text=True, check=False)

    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")


def test_the_role_installs_the_unit_and_raises_loginds_delay_above_the_bound() -> None:
    role = Path(shutdown_drain.__file__).resolve().parents[3] / "roles" / "node_agent"
    assert UNIT in yaml.safe_load((role / "vars" / "main.yml").read_text())["node_agent_units"]
    tasks = yaml.safe_load((role / "tasks" / "main.yml").read_text())
    (dropin,) = [
        t for t in tasks if t.get("ansible.builtin.copy", {}).get("dest", "").startswith("/etc/systemd/logind")
    ]
    values = dict(line.split("=", 1) for line in dropin["ansible.builtin.copy"]["content"].splitlines() if "=" in line)
    assert float(values["InhibitDelayMaxSec"].removesuffix("s")) > DEFAULT_TIMEOUT_S
    (start,) = [t for t in tasks if "Enable and start" in t.get("name", "")]
    assert UNIT in start["loop"]

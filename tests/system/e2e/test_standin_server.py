"""The stand-in engine server, run as a local process on 127.0.0.1, speaks each driver's documented API.

Each test starts the server with the command line its engine driver builds, then talks to it only through
what the driver knows (probe path and how to read it, model list, gauge names), so a fact the driver and the
stand-in disagree on fails here before any container is involved.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    Driver,
    InFlight,
    ProbeVerdict,
    SigtermBehaviour,
    get_driver,
    in_flight,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import parse_engine_spec

pytestmark = pytest.mark.slow

SERVER = Path(__file__).resolve().parents[2] / "support" / "standin_server.py"
ENGINES = sorted(contracts.DRIVERS)
DEADLINE_S = 20.0  # how long a test waits for something that should happen in well under a second
HTTP_TIMEOUT_S = 10.0
SERVED = "standin-chat"
HELD_S = 120.0  # a request this slow stays in flight until the test releases it (SIGUSR1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {DEADLINE_S} s waiting for {what}")
        time.sleep(0.02)


class Standin:
    """One stand-in server process and an HTTP client for it."""

    def __init__(self, engine: str, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.engine = engine
        self.driver: Driver = get_driver(engine)
        self.process = process
        self.port = port
        self.log = log

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = HTTP_TIMEOUT_S
    ) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            return response.status, response.read().decode()
        finally:
            connection.close()

    def probe(self) -> tuple[int | None, ProbeVerdict]:
        try:
            status, body = self.request("GET", self.driver.facts.health_path, timeout=2.0)
        except (ConnectionRefusedError, ConnectionResetError):
            # Refused, or reset by a listener closing under a queued connection: nothing answers.
            return None, self.driver.interpret_probe(None)
        return status, self.driver.interpret_probe(status, body)

    def in_flight(self) -> InFlight:
        status, body = self.request("GET", self.driver.facts.metrics_path or "/metrics")
        assert status == 200, f"{self.engine} /metrics answered {status}: {body}"
        return in_flight(body, self.driver.facts)

    def hook_in_flight(self) -> int:
        status, body = self.request("GET", "/standin/in-flight")
        assert status == 200
        counts = json.loads(body)
        return int(counts["running"]) + int(counts["waiting"])

    def complete(self, seconds: float) -> tuple[int, str]:
        if self.engine == "ollama":
            return self.request("POST", "/api/generate", {"model": SERVED, "prompt": "hi", "standin_seconds": seconds})
        return self.request("POST", "/v1/completions", {"model": SERVED, "prompt": "hi", "standin_seconds": seconds})

    def release(self) -> None:
        """Let every request in flight finish now (the stand-in's SIGUSR1 hook)."""
        self.process.send_signal(signal.SIGUSR1)

    def exit_code(self, timeout: float = DEADLINE_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.engine} stand-in still running {timeout} s after SIGTERM; log:\n{self.log.read_text()}")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Standin]]:
    started: list[Standin] = []

    def _start(engine: str, *, load_s: float = 0.0, never_ready: bool = False, slots: int = 4) -> Standin:
        spec = parse_engine_spec(
            {
                "name": "standin",
                "driver": engine,
                "image": "meridian-node/standin@sha256:" + "0" * 64,
                "model": {"name": SERVED},
                "port": 9000,
                # The generic driver knows no flags; give it the ones a typical server takes.
                "args": ["--served-model-name", SERVED] if engine == "openai" else [],
            }
        )
        settings = get_driver(engine).container_settings(spec)
        port = free_port()
        env = {
            **os.environ,
            **settings.environment,
            "STANDIN_ENGINE": engine,
            "STANDIN_HOST": "127.0.0.1",
            "STANDIN_PORT": str(port),
            "STANDIN_LOAD_SECONDS": str(load_s),
            "STANDIN_SLOTS": str(slots),
        }
        if engine == "ollama":
            # Ollama lists the models in its store; nothing on its command line names one.
            env["STANDIN_MODEL"] = SERVED
        if never_ready:
            env["STANDIN_NEVER_READY"] = "1"
        log = tmp_path / f"{engine}-{len(started)}.log"
        with log.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, str(SERVER), *settings.command], env=env, stdout=stderr, stderr=stderr
            )
        standin = Standin(engine, process, port, log)
        started.append(standin)
        return standin

    yield _start
    for standin in started:
        if standin.process.poll() is None:
            standin.process.kill()
            standin.process.wait(timeout=10)


def wait_ready(standin: Standin) -> list[tuple[int | None, ProbeVerdict]]:
    """Probe until ready; return every answer seen before (and including) the ready one."""
    seen: list[tuple[int | None, ProbeVerdict]] = []

    def ready() -> bool:
        seen.append(standin.probe())
        return seen[-1][1].ready

    wait_for(f"{standin.engine} to become ready", ready)
    return seen


def run_in_threads(count: int, work: Callable[[], tuple[int, str]]) -> tuple[list[threading.Thread], list[Any]]:
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(work())
        except (OSError, http.client.HTTPException) as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _index in range(count)]
    for thread in threads:
        thread.start()
    return threads, results


# -- loading, then ready ------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_not_ready_while_the_model_loads_the_engines_way_then_ready(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine, load_s=1.5)
    seen = wait_ready(standin)
    before = seen[:-1]
    assert before, "the first probe already found it ready: the load delay was not observed"
    assert all(verdict.loading for _status, verdict in before), [v.detail for _s, v in before]
    statuses = {status for status, _verdict in before}
    if engine == "llamacpp":
        assert 503 in statuses, "llama.cpp listens at once and answers 503 Loading model"
    elif engine == "sglang":
        assert statuses <= {None, 503}
    else:
        assert statuses == {None}, f"{engine} does not listen before its model is loaded"
    assert seen[-1][0] == 200


@pytest.mark.parametrize("engine", ENGINES)
def test_model_list_names_the_served_model(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine)
    wait_ready(standin)
    status, body = standin.request("GET", standin.driver.facts.model_list_path)
    assert status == 200
    document = json.loads(body)
    names = [m["name"] for m in document["models"]] if engine == "ollama" else [m["id"] for m in document["data"]]
    assert names == [SERVED]


# -- in-flight gauges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", [e for e in ENGINES if get_driver(e).facts.has_metrics])
def test_gauges_count_slow_requests_in_flight_and_return_to_zero(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine, slots=2)
    wait_ready(standin)
    assert standin.in_flight() == InFlight(running=0.0, waiting=0.0)
    threads, results = run_in_threads(3, lambda: standin.complete(seconds=HELD_S))
    wait_for("3 requests in flight", lambda: standin.in_flight().total == 3)
    assert standin.in_flight() == InFlight(running=2.0, waiting=1.0), "2 slots: 2 run, 1 waits"
    standin.release()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert [status for status, _body in results] == [200] * 3
    assert standin.in_flight().total == 0


@pytest.mark.parametrize("engine", [e for e in ENGINES if not get_driver(e).facts.has_metrics])
def test_engine_without_metrics_has_no_metrics_endpoint(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine)
    wait_ready(standin)
    status, _body = standin.request("GET", "/metrics")
    assert status == 404


def test_llamacpp_without_the_metrics_flag_refuses_metrics(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "STANDIN_ENGINE": "llamacpp", "STANDIN_HOST": "127.0.0.1", "STANDIN_PORT": str(port)}
    process = subprocess.Popen([sys.executable, str(SERVER), "-m", "/m.gguf"], env=env, stderr=subprocess.DEVNULL)
    standin = Standin("llamacpp", process, port, tmp_path / "none.log")
    try:
        wait_ready(standin)
        status, body = standin.request("GET", "/metrics")
        assert status == 501
        assert "--metrics" in body
    finally:
        process.kill()
        process.wait(timeout=10)


# -- SIGTERM ------------------------------------------------------------------------------------------------


def _sigterm_with_requests_in_flight(
    standin: Standin, count: int, seconds: float
) -> tuple[list[threading.Thread], list[Any]]:
    """Once ``standin`` is ready, ``count`` requests (each lasting ``seconds``) held in flight, then its SIGTERM;
    the requests' threads and results."""
    wait_ready(standin)
    threads, results = run_in_threads(count, lambda: standin.complete(seconds=seconds))
    wait_for(f"{count} requests in flight", lambda: standin.hook_in_flight() == count)
    standin.process.send_signal(signal.SIGTERM)
    return threads, results


@pytest.mark.parametrize(
    "engine", [e for e in ENGINES if get_driver(e).facts.sigterm is SigtermBehaviour.FINISHES_IN_FLIGHT]
)
def test_sigterm_finishes_requests_in_flight_and_takes_no_new_work(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine)
    threads, results = _sigterm_with_requests_in_flight(standin, 3, HELD_S)
    if engine == "sglang":
        # SGLang keeps serving while it drains: readiness fails and new requests are turned away.
        wait_for("sglang to report draining", lambda: standin.probe()[1].ready is False)
        assert standin.complete(seconds=0)[0] == 503
    else:
        wait_for(f"{engine} to stop accepting connections", lambda: standin.probe()[0] is None)
    assert standin.process.poll() is None, "exited with requests still in flight"
    standin.release()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert [r[0] if isinstance(r, tuple) else r for r in results] == [200] * 3
    assert standin.exit_code() == 0


@pytest.mark.parametrize(
    "engine", [e for e in ENGINES if get_driver(e).facts.sigterm is SigtermBehaviour.ABORTS_IN_FLIGHT]
)
def test_sigterm_aborts_requests_in_flight(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine)
    # Held far longer than the test waits for the exit: an engine that finished them would fail exit_code().
    threads, results = _sigterm_with_requests_in_flight(standin, 3, HELD_S)
    assert standin.exit_code() == 0
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert len(results) == 3
    assert all(isinstance(r, (OSError, http.client.HTTPException)) for r in results), results


@pytest.mark.parametrize(
    "engine", [e for e in ENGINES if get_driver(e).facts.sigterm is SigtermBehaviour.HANGS_UNTIL_KILLED]
)
def test_sigterm_leaves_requests_in_flight_unanswered_until_killed(engine: str, start: Callable[..., Standin]) -> None:
    standin = start(engine)
    threads, results = _sigterm_with_requests_in_flight(standin, 2, 0.5)
    wait_for(f"{engine} to stop accepting connections", lambda: standin.probe()[0] is None)
    time.sleep(1.0)  # twice what the requests needed: they are held, not finished
    assert standin.process.poll() is None and results == [], "answered or exited with requests in flight"
    standin.process.kill()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert len(results) == 2
    assert all(isinstance(r, (OSError, http.client.HTTPException)) for r in results), results


def test_llamacpp_idle_exits_at_once_on_sigterm(start: Callable[..., Standin]) -> None:
    standin = start("llamacpp")
    wait_ready(standin)
    standin.process.send_signal(signal.SIGTERM)
    assert standin.exit_code() == 0


# -- never ready --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_that_never_loads_never_reports_ready_and_still_stops(
    engine: str, start: Callable[..., Standin]
) -> None:
    standin = start(engine, never_ready=True)
    if engine in ("llamacpp", "sglang"):
        wait_for(f"{engine} to listen", lambda: standin.probe()[0] is not None)
    answers = []
    for _attempt in range(20):
        answers.append(standin.probe())
        time.sleep(0.05)
    assert not any(verdict.ready for _status, verdict in answers)
    assert all(verdict.loading for _status, verdict in answers), [v.detail for _s, v in answers]
    standin.process.send_signal(signal.SIGTERM)
    assert standin.exit_code() == 0

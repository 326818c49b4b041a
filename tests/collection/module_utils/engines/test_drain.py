"""Waiting for an engine to go idle, against a real metrics server on loopback and a fake clock.

The server answers each GET /metrics with the next scripted body, so a test decides exactly what the
engine's gauges say at each poll; time is a fake clock that ``sleep`` advances, so nothing waits.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import ContainerInfo, PublishedPort
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import (
    driver_of,
    loopback_for,
    probe_address,
    wait_until_idle,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import get_driver
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock


def vllm_metrics(running: float, waiting: float) -> tuple[int, str]:
    return 200, (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
    )


class ScriptedMetrics:
    """A loopback HTTP server answering GET /metrics with scripted (status, body) pairs; the last repeats."""

    def __init__(self, answers: list[tuple[int, str]]) -> None:
        self.answers = list(answers)
        self.asked = 0
        script = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                index = min(script.asked, len(script.answers) - 1)
                script.asked += 1
                status, body = script.answers[index]
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def clock() -> MonotonicClock:
    return MonotonicClock()


@pytest.fixture
def metrics() -> Iterator[list[ScriptedMetrics]]:
    servers: list[ScriptedMetrics] = []
    yield servers
    for server in servers:
        server.close()


def serve(servers: list[ScriptedMetrics], answers: list[tuple[int, str]]) -> ScriptedMetrics:
    server = ScriptedMetrics(answers)
    servers.append(server)
    return server


def test_drain_waits_until_running_and_waiting_both_reach_zero(
    clock: MonotonicClock, metrics: list[ScriptedMetrics]
) -> None:
    server = serve(metrics, [vllm_metrics(4, 4), vllm_metrics(3, 0), vllm_metrics(0, 1), vllm_metrics(0, 0)])
    outcome = wait_until_idle(
        get_driver("vllm"), ("127.0.0.1", server.port), timeout_s=60, grace_s=5, sleep=clock.sleep, clock=clock
    )

    assert outcome.idle is True
    assert outcome.method == "metrics"
    assert server.asked == 4
    assert outcome.in_flight() == {"running": 0, "waiting": 0}
    assert outcome.waited_s == pytest.approx(0.75)


def test_drain_timeout_reports_what_is_still_in_flight(clock: MonotonicClock, metrics: list[ScriptedMetrics]) -> None:
    server = serve(metrics, [vllm_metrics(2, 1)])
    outcome = wait_until_idle(
        get_driver("vllm"), ("127.0.0.1", server.port), timeout_s=3, grace_s=5, sleep=clock.sleep, clock=clock
    )

    assert outcome.idle is False
    assert outcome.in_flight() == {"running": 2, "waiting": 1}
    assert outcome.describe() == "2 running, 1 waiting"
    assert outcome.waited_s >= 3


def test_metrics_that_fail_or_are_garbage_never_count_as_idle(
    clock: MonotonicClock, metrics: list[ScriptedMetrics]
) -> None:
    server = serve(metrics, [(500, "boom"), (200, "this is {not prometheus"), (200, "other_metric 0\n")])
    outcome = wait_until_idle(
        get_driver("vllm"), ("127.0.0.1", server.port), timeout_s=2, grace_s=5, sleep=clock.sleep, clock=clock
    )

    assert outcome.idle is False
    assert server.asked >= 3
    # The last answer parsed but had neither gauge: nothing can be told, which is not zero.
    assert outcome.in_flight() == {"running": None, "waiting": None}


def test_nothing_answering_on_the_metrics_port_is_not_idle(clock: MonotonicClock) -> None:
    outcome = wait_until_idle(
        get_driver("vllm"), ("127.0.0.1", 1), timeout_s=1, grace_s=5, sleep=clock.sleep, clock=clock
    )

    assert outcome.idle is False
    assert outcome.describe() == "its metrics did not answer"


def test_engine_without_metrics_waits_grace_and_never_asks(
    clock: MonotonicClock, metrics: list[ScriptedMetrics]
) -> None:
    server = serve(metrics, [vllm_metrics(9, 9)])
    outcome = wait_until_idle(
        get_driver("ollama"), ("127.0.0.1", server.port), timeout_s=60, grace_s=7, sleep=clock.sleep, clock=clock
    )

    assert outcome.idle is True
    assert outcome.method == "grace"
    assert clock.sleeps == [7]
    assert server.asked == 0
    assert outcome.in_flight() is None


def test_grace_is_capped_by_the_timeout(clock: MonotonicClock) -> None:
    outcome = wait_until_idle(get_driver("ollama"), None, timeout_s=2, grace_s=30, sleep=clock.sleep, clock=clock)

    assert clock.sleeps == [2]
    assert outcome.idle is True


def container(ports: tuple[PublishedPort, ...], driver: str | None = "vllm") -> ContainerInfo:
    labels = {"meridian.node/driver": driver} if driver else {}
    return ContainerInfo("id", "eng", "img", "sha256:x", "running", "Up", labels, ports, owned=True)


def test_probe_address_prefers_the_drivers_container_port_and_asks_wildcards_on_loopback() -> None:
    ports = (PublishedPort("0.0.0.0", 9001, 9999), PublishedPort("0.0.0.0", 8123, 8000))

    assert probe_address(container(ports), get_driver("vllm")) == ("127.0.0.1", 8123)
    assert probe_address(container(()), get_driver("vllm")) is None
    assert loopback_for("::") == "::1"
    assert loopback_for("10.1.2.3") == "10.1.2.3"


def test_unknown_driver_label_falls_back_to_a_grace_wait() -> None:
    assert driver_of(container((), driver="not-a-driver")).facts.has_metrics is False
    assert driver_of(container((), driver="tgi")).name == "tgi"

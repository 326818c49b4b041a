"""The optional Prometheus endpoint (``metrics.listen`` in the config; prometheus-client is the ``metrics`` extra).

Runs on: the agent side (``meridian-node run``). docs/METRICS.md lists every series, the shipped alert rules
(``extras/prometheus/``) and the dashboard (``extras/grafana/``).

Two kinds of series, each from where it is true:

- **Events are counters, counted where they happen**: cycles timed, applies by result, apply failures by
  reason, rejections by reason, repairs per engine, certificate renewal failures, bytes brought into the
  artifact store. The cycle calls a method here for each (``cycle.Agent`` holds this object as ``metrics``).
- **Current values are read at scrape time** by ``StatusCollector`` from the status document the cycle last
  wrote (``status_written``, the document ``meridian-node status`` prints): lease and certificate expiry,
  generation applied, last successful apply, each engine's state, readiness, restarts and supervision, each
  GPU's verdict, cordons. One document, handed over whole: the scrape runs in the HTTP server's thread and
  never reads what the cycle's thread may be changing, and the endpoint says what ``status`` says. The values
  are those of the last cycle; the timestamps are absolute, so an alert on one needs no fresh cycle to fire.

A registry of its own, so nothing else (the process and GC collectors, another library's) leaks in.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from meridian_node_agent import package_version
from meridian_node_agent.boundary.spool import ApplyResult

__all__ = [
    "APPLY_FAILURE_REASONS",
    "ENGINE_STATES",
    "GPU_VERDICTS",
    "SUPERVISION_STATES",
    "Metrics",
    "StatusCollector",
    "apply_failure_reason",
]

# Docker's container states, and the observer's "unknown" (the engines could not be listed this time).
ENGINE_STATES = ("created", "running", "restarting", "paused", "exited", "dead", "removing", "unknown")
# supervise.Supervisor.status's states.
SUPERVISION_STATES = ("healthy", "settling", "backing-off", "repair-due", "reported")
# gpu.health_rules' verdicts.
GPU_VERDICTS = ("healthy", "degraded", "unhealthy", "unknown")
# Why an apply failed, as the ``reason`` label of meridian_node_apply_failures_total says it (few values, so
# that each is a series to alert on; the journal and ``status`` carry the words).
APPLY_FAILURE_REASONS = {
    "task-failed": "a task of the reconcile playbook failed (refused by a module, an engine not ready...)",
    "playbook-failed": "the playbook run failed without a failed task (it did not start, a host unreachable)",
    "timeout": "the run outlasted its timeout (apply.timeout_seconds under the split)",
    "canceled": "the run was canceled (the agent was stopping)",
    "not-run": "the apply could not even be asked for (the applier raised, root's unit did not answer)",
    "not-spooled": "the verified state could not be written to the spool (a full disk, a broken state dir)",
}
_CYCLE_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300)


def apply_failure_reason(result: ApplyResult) -> str:
    """The ``reason`` label of a failed apply (a key of ``APPLY_FAILURE_REASONS``)."""
    if not result.ident:
        return "not-run"  # ApplyResult.not_run: no playbook, no journal
    if result.status in ("timeout", "canceled"):
        return result.status
    return "task-failed" if result.failed else "playbook-failed"


class Metrics:
    """The agent's series; ``serve`` them on ``metrics.listen``, or read ``registry`` directly (tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.cycle_seconds = Histogram(
            "meridian_node_cycle_seconds",
            "Duration of one agent cycle, long-poll wait included",
            registry=self.registry,
            buckets=_CYCLE_BUCKETS,
        )
        self.last_cycle = Gauge(
            "meridian_node_last_cycle_timestamp_seconds",
            "Unix time the last cycle ended, whatever its outcome (the agent is alive and reaches its control plane)",
            registry=self.registry,
        )
        self.desired_generation = Gauge(
            "meridian_node_desired_generation",
            "Generation of the last verified desired state the control plane published for this node",
            registry=self.registry,
        )
        self.applies = Counter(
            "meridian_node_applies", "Reconcile runs by ansible-runner's result", ["status"], registry=self.registry
        )
        self.apply_failures = Counter(
            "meridian_node_apply_failures",
            "Failed applies by reason (docs/METRICS.md lists the reasons)",
            ["reason"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "meridian_node_rejections", "Desired states rejected, by reason", ["reason"], registry=self.registry
        )
        self.repairs = Counter(
            "meridian_node_repairs",
            "Reconciles of the applied generation because this engine drifted from it",
            ["engine"],
            registry=self.registry,
        )
        self.renewal_failures = Counter(
            "meridian_node_certificate_renewal_failures",
            "Failed renewals of the client certificate",
            registry=self.registry,
        )
        self.artifact_bytes = Counter(
            "meridian_node_artifact_fetched_bytes",
            "Bytes the reconcile playbook brought into the artifact store (downloaded or copied)",
            registry=self.registry,
        )
        # Images pulled by digest in the agent's applies (``ApplyResult.image_bytes``, from the engine modules'
        # ``image_pull``); ``image_fetched`` is the hook for other fetches (bundle loads do not call it yet).
        self.image_bytes = Counter(
            "meridian_node_image_fetched_bytes",
            "Bytes of engine images the agent's applies pulled",
            registry=self.registry,
        )
        self.collector = StatusCollector()
        self.registry.register(self.collector)
        self._server: Any = None

    @classmethod
    def serve(cls, listen: str) -> Metrics:
        """Metrics served over HTTP on ``host:port`` (``metrics.listen``) from a daemon thread."""
        host, _, port = listen.rpartition(":")
        metrics = cls()
        metrics._server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=metrics.registry)
        return metrics

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # Hooks the cycle calls.

    def cycle_done(self, wall_s: float, outcome: Any) -> None:
        """A cycle ended (``cycle.CycleOutcome``): timed, and its generation is the one desired now."""
        self.cycle_seconds.observe(wall_s)
        self.last_cycle.set(time.time())
        generation = getattr(outcome, "generation", None)
        if isinstance(generation, int):
            self.desired_generation.set(generation)

    def applied(self, result: ApplyResult) -> None:
        self.applies.labels(status=str(result.status)).inc()
        if not result.ok:
            self.apply_failures.labels(reason=apply_failure_reason(result)).inc()
        if result.fetched_bytes:
            self.artifact_bytes.inc(result.fetched_bytes)
        if result.image_bytes:
            self.image_fetched(result.image_bytes)

    def apply_not_spooled(self) -> None:
        self.apply_failures.labels(reason="not-spooled").inc()

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def repaired(self, engines: Iterable[str]) -> None:
        for engine in engines:
            self.repairs.labels(engine=engine).inc()

    def renewal_failed(self) -> None:
        self.renewal_failures.inc()

    def image_fetched(self, size: int) -> None:
        """Bytes of engine images pulled or loaded (``applied`` calls it with what an apply pulled)."""
        self.image_bytes.inc(size)

    def status_written(self, document: Mapping[str, Any]) -> None:
        self.collector.document = document


class StatusCollector(Collector):
    """The current-value series, read from the last status document (``cycle.Agent.write_status``).

    Every family is yielded at each scrape, empty while the agent has not written a document yet, so a scrape
    always lists the same names (HELP and TYPE lines): rules and dashboards can be checked against it.
    """

    def __init__(self) -> None:
        self.document: Mapping[str, Any] | None = None
        self._build: dict[str, str] | None = None

    def collect(self) -> Iterator[Any]:
        document = self.document or {}
        yield self._build_info()
        yield from self._agent(document)
        yield from self._engines(document.get("engines") or [], document.get("supervision") or {})
        yield from self._gpus(document.get("gpus") or [], document.get("cordons") or [])

    def _build_info(self) -> InfoMetricFamily:
        if self._build is None:
            # Looked up once: importlib.metadata reads the installed distributions' files.
            self._build = {
                "version": package_version(),
                "python": platform.python_version(),
                "ansible_core": _distribution_version("ansible-core"),
            }
        family = InfoMetricFamily("meridian_node_build", "The agent's version, its Python's and ansible-core's")
        family.add_metric([], self._build)
        return family

    def _agent(self, document: Mapping[str, Any]) -> Iterator[Any]:
        info = InfoMetricFamily("meridian_node_agent", "This agent's node id and mode (from its config)")
        if document.get("node_id") is not None:
            info.add_metric([], {"node_id": str(document["node_id"]), "mode": str(document.get("mode"))})
        yield info
        lease = GaugeMetricFamily(
            "meridian_node_lease_expiry_timestamp_seconds", "Unix time this node's lease expires unless renewed"
        )
        _add(lease, _timestamp(document.get("lease_expires_at")))
        yield lease
        epoch = GaugeMetricFamily("meridian_node_lease_epoch", "Lease epoch of the last heartbeat")
        _add(epoch, document.get("lease_epoch"))
        yield epoch
        certificate = document.get("certificate") or {}
        expiry = GaugeMetricFamily(
            "meridian_node_certificate_expiry_timestamp_seconds", "Unix time the client certificate expires"
        )
        _add(expiry, _timestamp(certificate.get("not_after")))
        yield expiry
        applied = GaugeMetricFamily(
            "meridian_node_applied_generation", "Generation last applied successfully (the agent's record)"
        )
        _add(applied, document.get("applied_generation"))
        yield applied
        last = GaugeMetricFamily(
            "meridian_node_last_successful_apply_timestamp_seconds",
            "Unix time an apply last succeeded; a failed apply never moves it (kept across restarts)",
        )
        _add(last, _timestamp(document.get("last_applied_at")))
        yield last
        retry = document.get("apply_retry") or {}
        failing = GaugeMetricFamily(
            "meridian_node_apply_retry_failures",
            "Failed applies in a row of the state the agent retries on its backoff (0: none is failing)",
        )
        if document:
            failing.add_metric([], float(retry.get("failures") or 0))
        yield failing
        counters = document.get("counters") or {}
        for name, key, text in (
            ("meridian_node_control_plane_unavailable", "unavailable", "Cycles the control plane could not be reached"),
            ("meridian_node_control_plane_refused", "refused", "Cycles the control plane refused (revoked, unknown)"),
        ):
            family = CounterMetricFamily(name, text + " (kept across restarts)")
            if document:
                family.add_metric([], float(counters.get(key) or 0))
            yield family

    def _engines(self, engines: Sequence[Mapping[str, Any]], supervision: Mapping[str, Any]) -> Iterator[Any]:
        state = GaugeMetricFamily(
            "meridian_node_engine_state",
            "1 for the engine's container state, 0 for the others",
            labels=["engine", "state"],
        )
        ready = GaugeMetricFamily("meridian_node_engine_ready", "1 when the engine's probe passes", labels=["engine"])
        draining = GaugeMetricFamily("meridian_node_engine_draining", "1 while the engine drains", labels=["engine"])
        restarts = CounterMetricFamily(
            "meridian_node_engine_restarts", "Docker's restart count of the engine's container", labels=["engine"]
        )
        for engine in engines:
            if not engine.get("managed"):
                continue  # not ours: nothing here acts on it, nothing to alert on
            name = str(engine.get("name"))
            current = str(engine.get("state"))
            for known in (*ENGINE_STATES, *((current,) if current not in ENGINE_STATES else ())):
                state.add_metric([name, known], 1.0 if known == current else 0.0)
            ready.add_metric([name], 1.0 if engine.get("ready") else 0.0)
            draining.add_metric([name], 1.0 if engine.get("draining") else 0.0)
            if engine.get("restarts") is not None:
                restarts.add_metric([name], float(engine["restarts"]))
        yield from (state, ready, draining, restarts)
        supervised = GaugeMetricFamily(
            "meridian_node_engine_supervision_state",
            "1 for supervision's state of an engine with a problem or recent repairs, 0 for the others",
            labels=["engine", "state"],
        )
        repairs = GaugeMetricFamily(
            "meridian_node_engine_repairs_since_healthy",
            "Repairs of the engine since it was last healthy for supervision.healthy_reset_seconds (crash loop)",
            labels=["engine"],
        )
        backoff = GaugeMetricFamily(
            "meridian_node_engine_backoff_seconds",
            "Wait after the engine's last repair before the next",
            labels=["engine"],
        )
        for name, entry in sorted(supervision.items()):
            current = str(entry.get("state"))
            for known in SUPERVISION_STATES:
                supervised.add_metric([name, known], 1.0 if known == current else 0.0)
            repairs.add_metric([name], float(entry.get("repairs") or 0))
            backoff.add_metric([name], float(entry.get("backoff_seconds") or 0))
        yield from (supervised, repairs, backoff)

    def _gpus(self, gpus: Sequence[Mapping[str, Any]], cordons: Sequence[Mapping[str, Any]]) -> Iterator[Any]:
        health = GaugeMetricFamily(
            "meridian_node_gpu_health",
            "1 for the GPU's health verdict, 0 for the others (docs/GPU_HEALTH.md)",
            labels=["gpu", "uuid", "verdict"],
        )
        held = GaugeMetricFamily(
            "meridian_node_gpu_held",
            "1 when the GPU's verdict is held until an operator clears it",
            labels=["gpu", "uuid"],
        )
        cordoned = GaugeMetricFamily("meridian_node_gpu_cordoned", "1 when the GPU is cordoned", labels=["gpu", "uuid"])
        for gpu in gpus:
            labels = [str(gpu.get("index")), str(gpu.get("uuid"))]
            verdict = str(gpu.get("verdict") or "unknown")
            for known in GPU_VERDICTS:
                health.add_metric([*labels, known], 1.0 if known == verdict else 0.0)
            held.add_metric(labels, 1.0 if gpu.get("held") else 0.0)
            cordoned.add_metric(labels, 1.0 if gpu.get("cordoned") else 0.0)
        yield from (health, held, cordoned)
        in_force = GaugeMetricFamily(
            "meridian_node_cordons", "Cordons in force, by who set them (policy, desired-state)", labels=["by"]
        )
        whole = GaugeMetricFamily("meridian_node_node_cordoned", "1 while a cordon covers the whole node")
        counts: dict[str, int] = {"policy": 0, "desired-state": 0}
        for cordon in cordons:
            by = str(cordon.get("by"))
            counts[by] = counts.get(by, 0) + 1
        if self.document:
            for by, count in sorted(counts.items()):
                in_force.add_metric([by], float(count))
            whole.add_metric([], 1.0 if any(not cordon.get("gpus") for cordon in cordons) else 0.0)
        yield from (in_force, whole)


def _add(family: GaugeMetricFamily, value: Any) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        family.add_metric([], float(value))


def _timestamp(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _distribution_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"

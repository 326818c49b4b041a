"""The optional Prometheus endpoint (``metrics.listen`` in the config): cycle duration, applies,
rejections by reason, last successful cycle. A registry of its own, so nothing else leaks in.

Runs on: the agent side (``meridian-node run``).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics"]


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.cycle_seconds = Histogram(
            "meridian_node_cycle_seconds",
            "Duration of one agent cycle",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300),
        )
        self.applies = Counter("meridian_node_applies", "Reconcile runs by result", ["status"], registry=self.registry)
        self.rejections = Counter(
            "meridian_node_rejections", "Desired states rejected, by reason", ["reason"], registry=self.registry
        )
        self.last_success = Gauge(
            "meridian_node_last_success_timestamp_seconds",
            "Unix time of the last cycle that completed",
            registry=self.registry,
        )

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

    def cycle_done(self, wall_s: float, outcome: Any) -> None:
        self.cycle_seconds.observe(wall_s)
        self.last_success.set(time.time())

    def applied(self, result: Any) -> None:
        self.applies.labels(status=str(result.status)).inc()

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

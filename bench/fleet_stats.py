"""bench/fleet.py's bookkeeping: what the simulated nodes saw during one step, and its percentiles.

Answers count when they complete inside the measured window (after every node's first cycle); failures and
refusals count over the whole step, ramp included, because a smoke test must see every one of them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ansible_collections.meridian.node.bench.fleet_client import TimedOut, TransferFailed

__all__ = ["ENDPOINTS", "Distribution", "Recorder"]

# The three calls of an agent's cycle, as the tables name them. The long-poll's latency is how long after its
# wait the 304 came back (the time the server spent past the deadline it was given).
HEARTBEAT = "heartbeat"
LONG_POLL = "desired-state"
OBSERVATION = "observations"
ENDPOINTS = (HEARTBEAT, LONG_POLL, OBSERVATION)
_KEPT_MESSAGES = 5


@dataclass(frozen=True)
class Distribution:
    """Percentiles of a list of seconds, in milliseconds (nearest rank); all None for an empty list."""

    count: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, seconds: list[float]) -> Distribution:
        if not seconds:
            return cls(0, None, None, None)
        ordered = sorted(seconds)

        def rank(fraction: float) -> float:
            return 1000 * ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]

        return cls(len(ordered), rank(0.50), rank(0.99), 1000 * ordered[-1])


@dataclass
class Recorder:
    """Shared by every node of a step (one event loop: no locks)."""

    window: tuple[float, float] | None = None  # perf_counter() bounds of the measured window
    answered: Counter[str] = field(default_factory=Counter)  # in the window, per endpoint
    latencies: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in ENDPOINTS})
    # Before the window: the fleet's first cycles (a server's restart as its agents see it), every endpoint.
    ramp_latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # over the step, per endpoint
    timeouts: Counter[str] = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)  # the first few failures, for whoever reads the output
    # Read staleness: publish started (perf_counter) per node whose new state has not reached it yet.
    pending: dict[str, float] = field(default_factory=dict)
    staleness: list[float] = field(default_factory=list)
    published: int = 0

    def in_window(self, at: float) -> bool:
        return self.window is not None and self.window[0] <= at < self.window[1]

    def answer(self, endpoint: str, done_at: float, latency_s: float | None) -> None:
        if self.in_window(done_at):
            self.answered[endpoint] += 1
            if latency_s is not None:
                self.latencies[endpoint].append(latency_s)
        elif self.window is None and latency_s is not None:
            self.ramp_latencies.append(latency_s)

    def failed(self, endpoint: str, node_id: str, error: TransferFailed) -> None:
        (self.timeouts if isinstance(error, TimedOut) else self.errors)[endpoint] += 1
        self._keep(f"{node_id} {endpoint}: {error}")

    def refused(self, endpoint: str, node_id: str, status: int, body: bytes) -> None:
        self.errors[endpoint] += 1
        self._keep(f"{node_id} {endpoint}: HTTP {status} {body[:200]!r}")

    def delivered(self, node_id: str, done_at: float) -> None:
        """A new desired state reached ``node_id``: its staleness, if this step published it."""
        started = self.pending.pop(node_id, None)
        if started is not None:
            self.staleness.append(done_at - started)

    def _keep(self, message: str) -> None:
        if len(self.messages) < _KEPT_MESSAGES:
            self.messages.append(message)

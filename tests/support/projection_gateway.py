"""A gateway stand-in for replace tests and the bench: it routes as a gateway that follows the serving projection.

Every ``interval_s`` (50 ms, as the issue measured it) it asks its ``route`` where one engine is served (the
control plane's ``GET /v1/serving`` over mutual TLS: ``from_projection``; or the host's own listing, for module
tests without a control plane) and sends it one completion. What it counts is what a gateway's users would see:
requests answered, requests refused (nowhere to send it, or the endpoint did not answer 200), and the longest
time between two answered requests (the model unserved, as seen from outside).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import ServingProjection

__all__ = ["GatewayTally", "ProjectionGateway", "Route"]

# Where the engine is served now ("host:port"), or None when nowhere.
Route = Callable[[], "str | None"]


@dataclass
class GatewayTally:
    answered: int = 0
    refused: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)  # each address routed to, in the order first seen
    longest_gap_s: float = 0.0

    @property
    def sent(self) -> int:
        return self.answered + len(self.refused)

    def describe(self) -> str:
        return (
            f"{len(self.refused)} of {self.sent} refused, longest gap between answers {self.longest_gap_s:.2f} s, "
            f"addresses {self.addresses}"
        )


class ProjectionGateway(threading.Thread):
    """Routes one completion every ``interval_s`` to where ``route`` says the engine is served.

    ``model`` is the served model name asked for. Use it as a context manager: it starts on enter and stops,
    joined, on exit.
    """

    def __init__(self, route: Route, model: str, *, interval_s: float = 0.05, timeout_s: float = 10.0) -> None:
        super().__init__(name="gateway", daemon=True)
        self.route = route
        self.model = model
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.tally = GatewayTally()
        self._halt = threading.Event()

    def run(self) -> None:
        last_answer = time.monotonic()
        while not self._halt.is_set():
            tick = time.monotonic()
            try:
                address = self.route()
            except Exception:  # a route that cannot be read routes nothing: counted as refused
                address = None
            if address is None:
                self.tally.refused.append("nowhere to route it")
            else:
                if address not in self.tally.addresses:
                    self.tally.addresses.append(address)
                problem = self._send(address)
                if problem is None:
                    now = time.monotonic()
                    self.tally.answered += 1
                    self.tally.longest_gap_s = max(self.tally.longest_gap_s, now - last_answer)
                    last_answer = now
                else:
                    self.tally.refused.append(f"{address}: {problem}")
            self._halt.wait(max(0.0, self.interval_s - (time.monotonic() - tick)))
        self.tally.longest_gap_s = max(self.tally.longest_gap_s, time.monotonic() - last_answer)

    @classmethod
    def from_projection(cls, projection: Callable[[], ServingProjection], engine: str, model: str) -> ProjectionGateway:
        """A gateway that sends to the first endpoint of ``engine`` the projection (``ControlClient.serving``) lists."""

        def route() -> str | None:
            return next((e.address for e in projection().endpoints if e.engine == engine), None)

        return cls(route, model)

    def _send(self, address: str) -> str | None:
        body = json.dumps({"model": self.model, "prompt": "hi", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"http://{address}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except Exception as exc:  # what a user would get back is what is counted
            return repr(exc)

    def __enter__(self) -> ProjectionGateway:
        self.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._halt.set()
        self.join(timeout=60)

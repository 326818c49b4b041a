"""The apply unit keeps engines.json fresh while an apply runs, so the agent sees a replace as it happens."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any, cast

from meridian_node_agent.config import AgentConfig
from meridian_node_agent.root_side.apply_unit import LiveInventory
from meridian_node_agent.root_side.root_dir import RootDir


class Refresh:
    """Stands in for refresh_inventory: counts rewrites, fails the first ``failing`` of them."""

    def __init__(self, failing: int = 0) -> None:
        self.calls: list[float] = []
        self.failing = failing
        self.lock = threading.Lock()

    def __call__(self, config: Any, root: Any, *, clock: Any, connect: Any) -> str | None:
        with self.lock:
            self.calls.append(time.monotonic())
            return "could not write engines.json: disk full" if len(self.calls) <= self.failing else None


def live(refresh: Refresh) -> LiveInventory:
    now = lambda: datetime.now(UTC)  # noqa: E731
    return LiveInventory(cast(AgentConfig, None), cast(RootDir, None), clock=now, interval_s=0.02, refresh=refresh)


def wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + 10  # a liveness limit, not a speed target
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the inventory was never rewritten")
        time.sleep(0.01)


def test_it_rewrites_while_the_apply_runs_and_stops_when_it_ends() -> None:
    refresh = Refresh()
    with live(refresh) as inventory:
        wait_for(lambda: len(refresh.calls) >= 3)
    ended = len(refresh.calls)
    time.sleep(0.1)
    assert len(refresh.calls) == ended, "rewrote engines.json after the apply ended"
    assert inventory.rewrites == ended


def test_a_failing_rewrite_is_said_once_and_the_next_ones_still_run(capsys: Any) -> None:
    refresh = Refresh(failing=3)
    with live(refresh) as inventory:
        wait_for(lambda: inventory.rewrites >= 2)
    assert capsys.readouterr().err.count("disk full") == 1

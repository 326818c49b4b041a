"""Ports for the engines tests publish, reserved across the pytest-xdist workers of a run (and across runs side by
side on one machine).

A port that can be bound now is not a port that is free when the engine binds it: a test picks its port, then
publishes the desired state, a cycle fetches it and an apply starts the container, which can be a minute later on a
loaded machine. Two workers that picked the same port in that window made one apply fail with "port ... is already
in use" (CI, test_e2e_image_pull). So a pick is written down, under a file lock, in a record every worker reads:
a port picked in the last ``HOLD_S`` seconds is not picked again while another can be. Past that the bind check
alone decides (an engine that is up holds its port; one that is gone has given it back).
"""

from __future__ import annotations

import fcntl
import json
import secrets
import tempfile
import time
from pathlib import Path

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import port_bind_problem

__all__ = ["BIND", "HOLD_S", "RECORD", "reserve_ports"]

BIND = "127.0.0.1"
# Longer than a pick takes to become a bound port on a loaded 2-core machine (a cycle, an apply, a container start).
HOLD_S = 300.0
RECORD = Path(tempfile.gettempdir()) / "meridian-node-test-ports.json"


def reserve_ports(first: int, last: int, count: int = 1, *, bind: str = BIND) -> list[int]:
    """``count`` distinct ports of ``first``..``last`` (inclusive) that can be bound on ``bind`` now and that no
    test picked in the last ``HOLD_S`` seconds, from a random start; recorded as picked. Where too few are unpicked,
    ports picked earlier that can still be bound make up the rest (oldest pick first), so a long run does not run
    out; RuntimeError when fewer than ``count`` can be bound at all."""
    start = first + secrets.randbelow(last - first + 1)
    candidates = [*range(start, last + 1), *range(first, start)]
    with RECORD.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        held = {port: until for port, until in _read().items() if until > now}
        fresh = [port for port in candidates if port not in held]
        reused = sorted((port for port in candidates if port in held), key=held.__getitem__)
        found: list[int] = []
        for port in [*fresh, *reused]:
            if len(found) == count:
                break
            if port_bind_problem(bind, port) is None:
                found.append(port)
        if len(found) < count:
            raise RuntimeError(f"only {len(found)} ports of {first}-{last} can be bound on {bind}, need {count}")
        held.update((port, now + HOLD_S) for port in found)
        _write(held)
    return found


def _read() -> dict[int, float]:
    try:
        record = json.loads(RECORD.read_text())
    except (FileNotFoundError, ValueError):
        return {}  # none yet, or cut short by a run killed mid-write: nothing is held
    return {int(port): float(until) for port, until in record.items()} if isinstance(record, dict) else {}


def _write(held: dict[int, float]) -> None:
    scratch = RECORD.with_suffix(".tmp")
    scratch.write_text(json.dumps({str(port): until for port, until in held.items()}))
    scratch.replace(RECORD)

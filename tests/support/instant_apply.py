"""An apply that succeeded at once, changing nothing: what an applier seam returns when the test is about what
happens around an apply (the log line before it, the holds root sees), not about the apply itself."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from meridian_node_agent.apply.applier import ApplyResult

__all__ = ["instant_success"]


def instant_success(generation: int, *, ident: str | None = None, journal: Path | None = None) -> ApplyResult:
    now = datetime.now(UTC)
    return ApplyResult(
        ident=ident or f"gen-{generation}-{now:%Y%m%dT%H%M%S.%fZ}",
        generation=generation,
        status="successful",
        rc=0,
        changed=0,
        failed=0,
        journal=journal or Path(),
        started_at=now,
        finished_at=now,
        wall_s=0.0,
        failures=[],
    )

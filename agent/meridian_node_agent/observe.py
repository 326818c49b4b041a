"""What the agent reports each cycle: GPU facts, artifacts in the store, engines, the last run.

Each source is a plain callable so the agent stays usable where one is missing (no NVML, no Docker)
and tests can swap the hardware seam. GPU facts are re-read at most every ``gpu_refresh_seconds``:
NVML reads cost far more than the rest of an unchanged cycle, and they change slowly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.artifact_store import Store
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    GpuFacts,
    Observation,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.docker_engine import DockerEngine, DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.engine_discovery import discover_engines
from ansible_collections.meridian.node.plugins.module_utils.gpu_inventory import collect_gpu_facts

__all__ = ["DockerEngines", "EngineSource", "Observer", "no_engines"]

EngineSource = Callable[[], list[dict[str, Any]]]


def no_engines() -> list[dict[str, Any]]:
    """The default engine source until Docker discovery is wired in: report none."""
    return []


class DockerEngines:
    """Engines as the local Docker Engine lists them: ours (ownership labels) and unmanaged containers.

    An owned, running engine is ready when its driver's readiness probe says so on its published port;
    an unmanaged container is never reported ready (nothing routes to what we do not run). Draining
    marks are the files ``<state_dir>/draining/<name>.json`` the drain path writes. The listing is
    re-read at most every ``refresh_seconds``.
    """

    def __init__(
        self,
        engine: DockerEngine,
        *,
        state_dir: Path,
        refresh_seconds: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.state_dir = Path(state_dir)
        self.refresh_seconds = refresh_seconds
        self._monotonic = monotonic
        self._cache: tuple[float, list[dict[str, Any]]] | None = None

    def __call__(self) -> list[dict[str, Any]]:
        now = self._monotonic()
        if self._cache is not None and now - self._cache[0] < self.refresh_seconds:
            return self._cache[1]
        try:
            engines = discover_engines(self.engine, state_dir=str(self.state_dir), probe=True)
        except DockerEngineError:
            # Docker down is an observation problem, not a cycle failure; engines keep their last report.
            return self._cache[1] if self._cache else []
        self._cache = (now, engines)
        return engines

    def forget(self) -> None:
        """Drop the cached list: the next call asks Docker (after an apply changed the engines)."""
        self._cache = None


class Observer:
    def __init__(
        self,
        *,
        store_path: str | None,
        gpu_facts: Callable[[], dict[str, Any]] | None = None,
        engines: EngineSource = no_engines,
        gpu_refresh_seconds: float = 30.0,
        artifact_refresh_seconds: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = Store(store_path) if store_path else None
        self._gpu_facts = gpu_facts or (lambda: collect_gpu_facts(processes=False, nvlink=False))
        self._engines = engines
        self._gpu_refresh = gpu_refresh_seconds
        self._monotonic = monotonic
        self._gpu_cache: tuple[float, GpuFacts] | None = None
        self._artifact_refresh = artifact_refresh_seconds
        self._artifact_cache: tuple[float, list[dict[str, Any]]] | None = None

    def forget(self) -> None:
        """Drop every cached reading, so the next observation is taken afresh: what an apply changes
        (engines, artifacts) must show in the observation that follows it, not one refresh later."""
        self._gpu_cache = self._artifact_cache = None
        forget = getattr(self._engines, "forget", None)
        if callable(forget):
            forget()

    def gpu(self) -> GpuFacts:
        now = self._monotonic()
        if self._gpu_cache is None or now - self._gpu_cache[0] >= self._gpu_refresh:
            self._gpu_cache = (now, GpuFacts.model_validate(self._gpu_facts()))
        return self._gpu_cache[1]

    def artifacts(self) -> list[dict[str, Any]]:
        """The store's versions, re-read at most every ``artifact_refresh_seconds`` (or after ``forget``)."""
        if self._store is None:
            return []
        now = self._monotonic()
        if self._artifact_cache is not None and now - self._artifact_cache[0] < self._artifact_refresh:
            return self._artifact_cache[1]
        try:
            rows = self._store.list_versions()
        except OSError:
            return []
        listed = [
            {
                "name": r["name"],
                "version": r["version"],
                "size_bytes": r["size"],
                "pinned": r["pinned"],
                "current": r["current"],
            }
            for r in rows
        ]
        self._artifact_cache = (now, listed)
        return listed

    def observe(
        self,
        *,
        node_id: str,
        mode: str,
        epoch: int,
        applied_generation: int,
        last_run: dict[str, Any] | None,
        now: datetime,
    ) -> Observation:
        return Observation.model_validate(
            {
                "apiVersion": "meridian.node/v1",
                "kind": "Observation",
                "node_id": node_id,
                "lease_epoch": epoch,
                "observed_at": format_rfc3339(now),
                "mode": mode,
                "applied_generation": applied_generation,
                "gpu": self.gpu(),
                "engines": self._engines(),
                "artifacts": self.artifacts(),
                "last_run": last_run,
            }
        )

"""What the agent reports each cycle: GPU facts and their health, artifacts in the store, engines, the
cordons in force, the last run.

Runs on: the agent side; under the split it reads the engines root published (``boundary/engines_file``).

Each source is a plain callable so the agent stays usable where one is missing (no NVML, no Docker)
and tests can swap the hardware seam. GPU facts are re-read at most every ``gpu_refresh_s``:
NVML reads cost far more than the rest of an unchanged cycle, and they change slowly. By default they come
from a ``gpu_health.GpuHealthWatch``, which keeps an XID watch and each GPU's last verdict across reads;
:meth:`Observer.close` gives its NVML event set back when the agent stops.

The cordons (``engines.cordon_file``) are read each observation: the host's cordon file in the directory
placement reads (``cordon_dir``), the policy's ``cordon`` and the applied state's, each reported as a
``NodeCordon``, and every GPU they cover is marked ``cordoned``. A damaged cordon file is logged once and
left out: the observation goes on with the others (placement refuses on its own when it cannot read it).

``ObservationSizeGuard`` is the last step before an observation is posted: one over the control plane's limit on a
request (``OBSERVATION_MAX_BYTES``) would be refused whole, and the control plane would keep a stale view of a node
that still heartbeats. It drops detail until it fits, the kubernetes part's first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    OBSERVED_LOG_LINES,
    GpuFacts,
    Observation,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    DockerEngine,
    DockerEngineError,
    address_overlaps,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import (
    CordonStateError,
    HostCordon,
    cordons_in_force,
    mark_cordoned,
    merge_cordons,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.discovery import (
    capacity,
    discover_engines,
    free_ports,
    vram_left,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DrainMark,
    DrainStateError,
    list_draining,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import Driver, DriverError, get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import Reservation
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import probe_readiness
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import CordonPolicy
from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
from meridian_node_agent.agent_side.kubernetes_observer import KubernetesView, lighter
from meridian_node_agent.boundary.engine_logs_file import LOGS_DIR, EngineLogError, EngineLogTail, read_log_tail
from meridian_node_agent.boundary.engines_file import (
    INVENTORY_FILE,
    FileIdentity,
    InventoryEngine,
    InventoryError,
    file_identity,
    read_inventory,
)
from meridian_node_agent.boundary.spool import PUBLIC_DIR
from meridian_node_agent.collectors.engine_log_keeper import keep_engine_logs
from meridian_node_agent.logs import EventLogger

__all__ = [
    "OBSERVATION_MAX_BYTES",
    "DockerEngines",
    "EngineSource",
    "InventoryEngines",
    "KubernetesSource",
    "ObservationSizeGuard",
    "Observer",
    "no_engines",
]

_PROBE_TIMEOUT_S = 1.0  # the same bound engine discovery gives one readiness probe

# The control plane's limit on a request body (docs/PROTOCOL.md: 413 too-large over 1 MiB; the devserver's
# MAX_REQUEST_BYTES, which a test holds equal to this).
OBSERVATION_MAX_BYTES = 1024 * 1024

EngineSource = Callable[[], list[dict[str, Any]]]
KubernetesSource = Callable[[GpuFacts], KubernetesView]


def no_engines() -> list[dict[str, Any]]:
    """The default engine source until Docker discovery is wired in: report none."""
    return []


class DockerEngines:
    """Engines as the local Docker Engine lists them: ours (ownership labels) and unmanaged containers.

    An owned, running engine is ready when its driver's readiness probe says so on its published port;
    an unmanaged container is never reported ready (nothing routes to what we do not run). Draining
    marks are the files ``<state_dir>/draining/<name>.json`` the drain path writes. The listing is
    re-read at most every ``refresh_s``. While the Docker Engine does not answer, the engines of its
    last listing are reported with state ``unknown`` and not ready.

    With ``owner``, it also keeps the tail of each of its engines' logs in ``<state_dir>/logs``
    (``collectors.engine_log_keeper``: what root's observe unit does under the split), at most every
    ``log_refresh_s``, and at each listing while one of them is failing; a failing engine is reported with the
    last lines of its kept tail (``last_lines``).
    """

    def __init__(
        self,
        engine: DockerEngine,
        *,
        state_dir: Path,
        refresh_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
        owner: str | None = None,
        log: EventLogger | None = None,
        log_refresh_s: float = 30.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.engine = engine
        self.owner = owner  # "agent:<node id>": only this agent's engines are reported as ours
        self.state_dir = Path(state_dir)
        self.refresh_s = refresh_s
        self.log_refresh_s = log_refresh_s
        self._monotonic = monotonic
        self._clock = clock
        self._log = log or EventLogger()
        self._cache: tuple[float, list[dict[str, Any]]] | None = None
        self._last: list[dict[str, Any]] = []  # the last listing Docker answered, kept across forget()
        self._unavailable: str | None = None
        self._tails: Mapping[str, EngineLogTail] = {}
        self._logs_at: float | None = None
        self._logs_problem: str | None = None

    def __call__(self) -> list[dict[str, Any]]:
        now = self._monotonic()
        if self._cache is not None and now - self._cache[0] < self.refresh_s:
            return self._cache[1]
        try:
            engines = discover_engines(
                self.engine, state_dir=str(self.state_dir), probe=True, owner=self.owner, exits=True
            )
        except DockerEngineError as exc:
            # Docker down is an observation problem, not a cycle failure. The engines it last listed are still
            # reported, but as unknown and not ready: a stopped daemon stops its containers, and nothing is
            # routed to what cannot be vouched for. Logged once per outage.
            if self._unavailable is None:
                self._log.warning("docker-engine-unavailable", error=str(exc), engines=len(self._last))
            self._unavailable = str(exc)
            return [{**engine, "state": "unknown", "ready": False, "drifted": None} for engine in self._last]
        if self._unavailable is not None:
            self._log.info("docker-engine-available-again", engines=len(engines))
            self._unavailable = None
        engines = self._with_last_lines(engines, now)
        self._cache = (now, engines)
        self._last = engines
        return engines

    def forget(self) -> None:
        """Drop the cached list: the next call asks Docker (after an apply changed the engines)."""
        self._cache = None

    def _with_last_lines(self, engines: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        if self.owner is None:
            return engines  # whose engines' logs to keep is not known: none are
        failing = [engine for engine in engines if _failing(engine)]
        if failing or self._logs_at is None or now - self._logs_at >= self.log_refresh_s:
            self._logs_at = now
            try:
                kept = keep_engine_logs(
                    self.engine,
                    owner=self.owner,
                    directory=self.state_dir / LOGS_DIR,
                    read_at=format_rfc3339(self._clock()),
                )
                self._tails, problem = kept.tails, "; ".join(kept.problems) or None
            except (DockerEngineError, EngineLogError, OSError) as exc:
                problem = str(exc)  # the tails read last stay what a failing engine is reported with
            if problem is not None and problem != self._logs_problem:
                self._log.warning("engine-logs-not-kept", reason=problem)
            self._logs_problem = problem
        return [_with_tail(engine, self._tails.get(str(engine.get("name")))) for engine in engines]

    def capacity(self, gpu_facts: Mapping[str, Any], port_range: Sequence[int], bind_address: str) -> dict[str, Any]:
        """What is left for new engines, as ``engine_info`` computes it; an empty room when Docker is down."""
        try:
            return capacity(self.engine, gpu_facts=gpu_facts, port_range=port_range, bind_address=bind_address)
        except DockerEngineError:
            return {}


class InventoryEngines:
    """Engines as the root apply unit last listed them in ``<apply.state_dir>/public/engines.json``
    (``boundary.engines_file``), for an agent without Docker access (``apply.via: systemd``).

    The file is re-read only when its identity (inode, mtime, size) changes. Readiness is the agent's own:
    each running engine with an address is probed once the driver's way per refresh (at most every
    ``refresh_s``, or after ``forget``), and draining comes from the marks in
    ``<apply.state_dir>/draining`` (world-readable, written by root). The dicts are the ones
    ``DockerEngines`` gives for our engines, so the observation and the serving projection read the same;
    foreign containers are not listed (root lists only this node's engines). A missing or invalid file is
    logged once per change of the file and gives no engines: nothing is routed to what cannot be vouched for.
    A failing engine carries the last lines of the log root keeps for it (``<apply.state_dir>/public/logs``,
    ``root_side.observe_unit``), when there is one the agent may read.
    """

    def __init__(
        self,
        *,
        root_dir: Path,
        node_id: str,
        refresh_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
        log: EventLogger | None = None,
        probe_timeout_s: float = _PROBE_TIMEOUT_S,
    ) -> None:
        self.root_dir = Path(root_dir)
        self.path = self.root_dir / PUBLIC_DIR / INVENTORY_FILE
        self.node_id = node_id
        self.refresh_s = refresh_s
        self.probe_timeout_s = probe_timeout_s
        self._monotonic = monotonic
        self._log = log or EventLogger()
        self._identity: FileIdentity | None = None
        self._looked = False
        self._engines: tuple[InventoryEngine, ...] = ()
        self._read_once = False  # a valid file was read since the last missing or invalid one
        self._cache: tuple[float, list[dict[str, Any]]] | None = None

    def __call__(self) -> list[dict[str, Any]]:
        now = self._monotonic()
        if self._cache is not None and now - self._cache[0] < self.refresh_s:
            return self._cache[1]
        self._reload()
        try:
            draining = {mark.name: mark for mark in list_draining(str(self.root_dir))}
            marks_readable = True
        except DrainStateError as exc:
            # Which engine is draining is unknown: none is reported ready, so none gets new work.
            self._log.warning("draining-marks-unreadable", reason=str(exc))
            draining, marks_readable = {}, False
        engines = [self._observe(engine, draining, marks_readable) for engine in self._engines]
        self._cache = (now, engines)
        return engines

    def forget(self) -> None:
        """Drop the cached list: the next call looks at the file again and probes (after an apply)."""
        self._cache = None

    def capacity(self, gpu_facts: Mapping[str, Any], port_range: Sequence[int], bind_address: str) -> dict[str, Any]:
        """What is left for new engines, from the engines root listed (their reservations and ports)."""
        self._reload()
        reservations = [Reservation(e.name, e.gpus, e.min_vram_mib) for e in self._engines if e.gpus and e.min_vram_mib]
        vram = vram_left(gpu_facts, reservations) if gpu_facts.get("nvml_available") else {}
        published = {
            e.port for e in self._engines if e.port is not None and address_overlaps(e.host or "", bind_address)
        }
        return {"vram_free_mib": vram, "free_ports": free_ports(published, port_range, bind_address)}

    def _reload(self) -> None:
        identity = file_identity(self.path)
        if self._looked and identity == self._identity:
            return
        self._identity, self._looked = identity, True
        try:
            inventory = read_inventory(self.path, node_id=self.node_id)
        except InventoryError as exc:
            self._engines, self._read_once = (), False
            self._log.warning("engines-not-observed", reason=str(exc))
            return
        # Root's observe timer rewrites the file every interval: say so only when what it lists changed.
        if inventory.engines != self._engines or not self._read_once:
            self._log.info("engine-inventory-read", path=str(self.path), engines=len(inventory.engines))
        self._engines, self._read_once = inventory.engines, True

    def _observe(
        self, engine: InventoryEngine, draining: Mapping[str, DrainMark], marks_readable: bool
    ) -> dict[str, Any]:
        observed = self._listed(engine, draining, marks_readable)
        if not _failing(observed):
            return observed
        try:
            tail: EngineLogTail | None = read_log_tail(self.root_dir / PUBLIC_DIR / LOGS_DIR, engine.name)
        except EngineLogError:
            tail = None  # none kept yet, or not readable by this user: the observation goes without
        return _with_tail(observed, tail)

    def _listed(
        self, engine: InventoryEngine, draining: Mapping[str, DrainMark], marks_readable: bool
    ) -> dict[str, Any]:
        return {
            "name": engine.name,
            "managed": True,
            "driver": engine.driver,
            "image": engine.image,
            "state": engine.state,
            "ready": marks_readable and self._ready(engine),
            "draining": engine.name in draining and draining[engine.name].applies_to(engine.port),
            "port": engine.port,
            "served_model_name": engine.served_model_name,
            "restarts": engine.restarts,
            "exit_code": engine.exit_code,
            "exit_reason": engine.exit_reason,
            # Root's reading of the settings changed by hand, as of written_at: the timer's observe unit keeps
            # it fresh (apply_observe); supervision repairs it as it does in-process.
            "drifted": None if engine.drifted is None else list(engine.drifted),
        }

    def _ready(self, engine: InventoryEngine) -> bool:
        if engine.state != "running" or engine.host is None or engine.port is None:
            return False
        driver = _driver(engine.probe_driver, engine.health_path)
        if driver is None:
            return False
        return probe_readiness(driver, engine.host, engine.port, timeout_s=self.probe_timeout_s).ready


def _failing(engine: Mapping[str, Any]) -> bool:
    """One of ours that is not running, or running but not ready: whose last lines an observation carries."""
    return bool(engine.get("managed")) and (engine.get("state") != "running" or not engine.get("ready"))


def _with_tail(engine: dict[str, Any], tail: EngineLogTail | None) -> dict[str, Any]:
    if tail is None or not _failing(engine):
        return engine
    return {**engine, "last_lines": tail.lines(OBSERVED_LOG_LINES)}


def _driver(name: str, health_path: str) -> Driver | None:
    try:
        return get_driver(name, health_path=health_path if name == "openai" else None)
    except DriverError:
        return None


class Observer:
    def __init__(
        self,
        *,
        store_path: str | None,
        gpu_facts: Callable[[], dict[str, Any]] | None = None,
        engines: EngineSource = no_engines,
        gpu_refresh_s: float = 30.0,
        artifact_refresh_s: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
        placement: tuple[Sequence[int], str] | None = None,
        kubernetes: KubernetesSource | None = None,
        cordon_dir: str | None = None,
        policy_cordon: CordonPolicy | None = None,
        log: EventLogger | None = None,
    ) -> None:
        self._store = Store(store_path) if store_path else None
        # Mode kubernetes-integrated: what the kubelet says runs here, joined to the GPU facts (kubernetes_observer).
        self._kubernetes = kubernetes
        # (port range, bind address) from the policy: with it, observations carry the capacity left.
        self._placement = placement
        self._capacity_cache: tuple[float, dict[str, Any]] | None = None
        # Since when each engine has been seen ready (wall clock): readiness comes and goes between looks.
        self._ready_since: dict[str, str] = {}
        # Stateful by default: an XID watch and each GPU's last verdict, kept across reads (gpu_health).
        self._gpu_facts = gpu_facts or GpuHealthWatch()
        self._engines = engines
        self._gpu_refresh_s = gpu_refresh_s
        self._monotonic = monotonic
        self._gpu_cache: tuple[float, GpuFacts] | None = None
        self._artifact_cache: tuple[float, list[dict[str, Any]]] | None = None
        self._artifact_refresh_s = artifact_refresh_s
        # The host's cordon file is in the directory placement reads (AgentConfig.record_dir); the policy's cordon.
        self._cordon_dir = cordon_dir
        self._policy_cordon = policy_cordon
        self._log = log or EventLogger()
        self._cordon_problem: str | None = None
        # The GPU facts with the cordoned GPUs marked, for the facts and the cordon they were marked from.
        self._marked: tuple[GpuFacts, HostCordon | None, GpuFacts] | None = None
        # Per engine of ours, the settings changed by hand since it was created (``docker.drift``), from the
        # last observation: for supervision, not for the control plane (the observation contract has no
        # place for it, and what matters there is that the engine is repaired).
        self.drifted: dict[str, tuple[str, ...]] = {}

    def close(self) -> None:
        """Release what the sources hold open for the agent's life (the GPU reader's NVML event set)."""
        close = getattr(self._gpu_facts, "close", None)
        if callable(close):
            close()

    def forget(self) -> None:
        """Drop every cached reading, so the next observation is taken afresh: what an apply changes
        (engines, artifacts) must show in the observation that follows it, not one refresh later."""
        self._gpu_cache = self._artifact_cache = self._capacity_cache = None
        for source in (self._engines, self._kubernetes):
            forget = getattr(source, "forget", None)
            if callable(forget):
                forget()

    def gpu(self) -> GpuFacts:
        now = self._monotonic()
        if self._gpu_cache is None or now - self._gpu_cache[0] >= self._gpu_refresh_s:
            self._gpu_cache = (now, GpuFacts.model_validate(self._gpu_facts()))
        return self._gpu_cache[1]

    def _with_ready_since(self, engines: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
        seen: dict[str, str] = {}
        drifted: dict[str, tuple[str, ...]] = {}
        listed = []
        for observed in engines:
            name = str(observed.get("name"))
            engine = {key: value for key, value in observed.items() if key != "drifted"}
            changed = observed.get("drifted")
            if changed and engine.get("managed"):
                drifted[name] = tuple(str(setting) for setting in changed)
            if engine.get("ready") and engine.get("managed"):
                seen[name] = self._ready_since.get(name) or format_rfc3339(now)
                listed.append({**engine, "ready_since": seen[name]})
            else:
                listed.append(engine)
        self._ready_since = seen
        self.drifted = drifted
        return listed

    def capacity(self) -> dict[str, Any]:
        """Free VRAM per device after reservations and free ports in the policy's range, re-computed at most as
        often as the GPU facts are read (a port probe per port costs more than the rest of a steady cycle)."""
        compute = getattr(self._engines, "capacity", None)
        if self._placement is None or not callable(compute):
            return {}
        now = self._monotonic()
        if self._capacity_cache is None or now - self._capacity_cache[0] >= self._gpu_refresh_s:
            port_range, bind_address = self._placement
            room: dict[str, Any] = compute(self.gpu().model_dump(mode="json"), port_range, bind_address)
            self._capacity_cache = (now, room)
        return self._capacity_cache[1]

    def artifacts(self) -> list[dict[str, Any]]:
        """The store's versions, re-read at most every ``artifact_refresh_s`` (or after ``forget``)."""
        if self._store is None:
            return []
        now = self._monotonic()
        if self._artifact_cache is not None and now - self._artifact_cache[0] < self._artifact_refresh_s:
            return self._artifact_cache[1]
        from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactStoreError

        try:
            rows = self._store.list_versions()
        except (OSError, ArtifactStoreError):
            # Unreadable (the index is root's, 0600, under the split) or refused as untrusted: report none
            # rather than let what is on disk stop the cycle.
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

    def cordons(self, state_cordon: Mapping[str, Any] | None = None) -> list[HostCordon]:
        """The cordons in force: the host's file, the policy's and ``state_cordon`` (the applied state's
        ``contracts.Cordon`` as a dict). A cordon file that cannot be read is said once per problem and left out."""
        if not self._cordon_dir:
            return cordons_in_force(None, self._policy_cordon, state_cordon)
        try:
            found = cordons_in_force(self._cordon_dir, self._policy_cordon, state_cordon)
        except CordonStateError as exc:
            if str(exc) != self._cordon_problem:
                self._log.warning("cordon-file-unreadable", error=str(exc), consequence="left out of the observation")
            self._cordon_problem = str(exc)
            return cordons_in_force(None, self._policy_cordon, state_cordon)
        if self._cordon_problem is not None:
            self._log.info("cordon-file-readable-again", path=self._cordon_dir)
            self._cordon_problem = None
        return found

    def _cordoned(self, facts: GpuFacts, cordon: HostCordon | None) -> GpuFacts:
        """``facts`` with every GPU ``cordon`` covers marked ``cordoned``; computed once per facts and cordon."""
        if cordon is None:
            return facts
        marked = self._marked
        if marked is not None and marked[0] is facts and marked[1] == cordon:
            return marked[2]
        result = GpuFacts.model_validate(mark_cordoned(facts.model_dump(mode="json"), cordon))
        self._marked = (facts, cordon, result)
        return result

    def observe(
        self,
        *,
        node_id: str,
        mode: str,
        epoch: int,
        applied_generation: int,
        last_run: dict[str, Any] | None,
        now: datetime,
        cordon: Mapping[str, Any] | None = None,
        refused_state: Mapping[str, Any] | None = None,
    ) -> Observation:
        """The observation of this node now. ``cordon``: the applied state's cordon (a ``contracts.Cordon`` dict);
        ``refused_state``: the state this node's mode refused last (``contracts.StateRefusal`` as a dict)."""
        cordons = self.cordons(cordon)
        gpu = self._cordoned(self.gpu(), merge_cordons(cordons))
        kubernetes = None if self._kubernetes is None else self._kubernetes(gpu)
        engines = self._engines() + (kubernetes.engines if kubernetes is not None else [])
        return Observation.model_validate(
            {
                "apiVersion": "meridian.node/v1",
                "kind": "Observation",
                "node_id": node_id,
                "lease_epoch": epoch,
                "observed_at": format_rfc3339(now),
                "mode": mode,
                "applied_generation": applied_generation,
                "gpu": gpu,
                "engines": self._with_ready_since(engines, now),
                "artifacts": self.artifacts(),
                "capacity": self.capacity(),
                "last_run": last_run,
                "kubernetes": None if kubernetes is None else kubernetes.observation,
                "cordons": [cordon.observed() for cordon in cordons],
                "refused_state": refused_state,
            }
        )


class ObservationSizeGuard:
    """An observation made to fit ``max_bytes`` as it is sent (its JSON, in UTF-8), before it is posted.

    Over the limit, detail goes in this order until it fits: the kubernetes part's (``kubernetes_observer.lighter``:
    what is allocatable, then the allocations halved with their engines, each counted in ``kubernetes.left_out`` as
    ``too-large``), then the engines' last log lines. What went is logged once per change
    (``observation-degraded``, ``observation-whole-again`` when it fits again). One that still does not fit is sent
    as it is, logged (``observation-too-large``): nothing else in it can go, and the control plane's answer decides.
    """

    def __init__(self, *, max_bytes: int = OBSERVATION_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._said: tuple[str, ...] | None = None  # what went last time, as logged; None: it fitted whole

    def __call__(self, observation: Observation, log: EventLogger) -> Observation:
        """``observation``, or the first lighter copy of it that fits; what went said in ``log``."""
        size = _json_bytes(observation)
        if size <= self.max_bytes:
            if self._said is not None:
                log.info("observation-whole-again", bytes=size, limit=self.max_bytes)
                self._said = None
            return observation
        sent, sent_size, dropped = observation, size, []
        for sent, what in _lighter(observation):
            dropped.append(what)
            sent_size = _json_bytes(sent)
            if sent_size <= self.max_bytes:
                break
        fits = sent_size <= self.max_bytes
        said = (*dropped, "" if fits else "still too large")
        if said != self._said:
            event, say = ("observation-degraded", log.warning) if fits else ("observation-too-large", log.error)
            say(event, bytes=size, limit=self.max_bytes, sent_bytes=sent_size, dropped=dropped)
            self._said = said
        return sent


def _json_bytes(observation: Observation) -> int:
    return len(observation.model_dump_json().encode())


def _lighter(observation: Observation) -> Iterator[tuple[Observation, str]]:
    lightest = observation
    for lightest, what in lighter(observation):
        yield lightest, what
    if any(engine.last_lines for engine in lightest.engines):
        engines = [engine.model_copy(update={"last_lines": None}) for engine in lightest.engines]
        yield lightest.model_copy(update={"engines": engines}), "engines' last_lines"

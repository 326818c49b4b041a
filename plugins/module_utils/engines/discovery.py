"""What engines run on this host, and what room is left: the engine half of the agent's observation.

``discover_engines`` lists every container that is an inference engine, as plain dicts shaped like
``contracts.EngineObservation``:

- ours (meridian.node's ownership labels): name, driver and served model name from our labels, state
  from Docker, ``ready`` from one readiness probe the driver's way (only when running), ``draining``
  from the durable mark (``engines.drain_marks``), the published host port;
- anybody else's, when they look like an engine: ``managed: false``, read-only. Nothing is ever done to
  them; they are listed so the control plane knows what holds VRAM and ports here.

Recognising a foreign engine (a heuristic, so it errs towards "not an engine"):

1. the image's repository name (the part after the last ``/``, tag and digest dropped, lowercased)
   contains a known engine word: ``vllm``, ``text-generation-inference`` or ``tgi``, ``sglang``,
   ``ollama``, ``llama.cpp`` / ``llama-cpp`` / ``llamacpp`` / ``llama-server``, ``lmdeploy``; the
   driver is then that engine;
2. else, a published container port that only one engine uses by default: 11434 (Ollama),
   30000 (SGLang), 23333 (LMDeploy). Common ports (80, 8000, 8080) alone say nothing;
3. else it is not an engine and is left out.

A running foreign engine with a published port for its guessed driver's container port is probed once
on its health path (a GET, read-only); otherwise ``ready`` is false, meaning "not known to be ready".

``engine_info`` gives both, engines and capacity, for one host under its policy: what the
``meridian.node.engine_info`` module returns. Its engines also carry ``gpus`` and ``min_vram_mib`` from our
spec label, which the reconcile playbook needs to decide what to prune before converging.

``capacity`` is what a new engine could still get, shaped like ``contracts.Capacity``: per GPU uuid (and
per MIG instance uuid), ``min(free, total - reserved)`` where ``reserved`` sums the ``min_vram_mib``
of the engines we own on it (the same rule placement uses); and the ports of the policy range that no
container publishes on the bind address and the kernel lets us bind, the lowest ``max_ports`` of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    DockerEngine,
    DockerEngineError,
    address_overlaps,
    port_bind_problem,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import driver_of, probe_address
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import DrainMark, list_draining
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import Driver, get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER, label_spec
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import (
    Reservation,
    reservations_from,
    resolve_devices,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import probe_readiness
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy

__all__ = [
    "MAX_PORTS",
    "capacity",
    "discover_engines",
    "engine_info",
    "free_ports",
    "guess_driver",
    "observe_engines",
    "vram_left",
]

MAX_PORTS = 100
_PROBE_TIMEOUT_S = 1.0
# Checked in this order: "llama" would also match inside other names, so the specific words come first.
_IMAGE_WORDS: tuple[tuple[str, str], ...] = (
    ("text-generation-inference", "tgi"),
    ("lmdeploy", "lmdeploy"),
    ("sglang", "sglang"),
    ("ollama", "ollama"),
    ("vllm", "vllm"),
    ("llama.cpp", "llamacpp"),
    ("llama-cpp", "llamacpp"),
    ("llamacpp", "llamacpp"),
    ("llama-server", "llamacpp"),
)
_TGI_WORD = re.compile(r"(^|[^a-z0-9])tgi([^a-z0-9]|$)")
_DISTINCT_PORTS = {11434: "ollama", 30000: "sglang", 23333: "lmdeploy"}


def _repository_name(image: str) -> str:
    reference = image.split("@", 1)[0]
    last = reference.rsplit("/", 1)[-1]
    return last.split(":", 1)[0].lower()


def guess_driver(container: ContainerInfo) -> str | None:
    """The engine a foreign container looks like (see the module docstring), or None: not an engine."""
    repository = _repository_name(container.image)
    for word, driver in _IMAGE_WORDS:
        if word in repository:
            return driver
    if _TGI_WORD.search(repository):
        return "tgi"
    for port in container.ports:
        if port.container_port in _DISTINCT_PORTS:
            return _DISTINCT_PORTS[port.container_port]
    return None


def _ready(container: ContainerInfo, driver: Driver, address: tuple[str, int] | None) -> bool:
    if not container.running or address is None:
        return False
    return probe_readiness(driver, address[0], address[1], timeout_s=_PROBE_TIMEOUT_S).ready


def discover_engines(
    engine: DockerEngine, *, state_dir: str, probe: bool = True, owner: str | None = None, exits: bool = False
) -> list[dict[str, Any]]:
    """Every engine container on the host, ours first then foreign ones, each by name.

    With ``owner``, an engine is ours only when its ``meridian.node/owner`` label is exactly that: another
    agent's or an operator's meridian.node engine on the same Docker Engine is listed like a foreign
    container (``managed: false``, never ready), so nothing is routed to it through this observer.
    ``exits`` adds, for ours, Docker's restart count and how each last ended (``restarts``, ``exit_code``,
    ``exit_reason``) and the settings changed by hand since it was created (``drifted``: names, or None when
    it carries no digests to compare with; ``docker.drift``): one inspect per engine, which the agent's
    observations pay and modules do not.
    """
    draining = {mark.name: mark for mark in list_draining(state_dir)}
    ours: list[dict[str, Any]] = []
    foreign: list[dict[str, Any]] = []
    for container in engine.list_containers():
        if container.owned and (owner is None or _owner_of(container) == owner):
            entry = _observe_ours(container, draining, probe)
            if exits:
                entry.update(_exits(engine, container))
            ours.append(entry)
        elif container.owned:
            foreign.append({**_observe_ours(container, {}, False), "managed": False})
        else:
            observed = _observe_foreign(container, probe)
            if observed is not None:
                foreign.append(observed)
    return sorted(ours, key=lambda e: e["name"]) + sorted(foreign, key=lambda e: e["name"])


def _exits(engine: DockerEngine, container: ContainerInfo) -> dict[str, Any]:
    try:
        inspected = engine.inspect_engine(container.id)
    except DockerEngineError:  # removed between the listing and the inspect: nothing to say about it
        return {"restarts": None, "exit_code": None, "exit_reason": None, "drifted": None}
    info = inspected.exit
    return {
        "restarts": info.restarts,
        "exit_code": info.exit_code,
        "exit_reason": info.exit_reason,
        "drifted": None if inspected.drifted is None else list(inspected.drifted),
    }


def _observe_ours(container: ContainerInfo, draining: Mapping[str, DrainMark], probe: bool) -> dict[str, Any]:
    driver = driver_of(container)
    address = probe_address(container, driver)
    spec = label_spec(container)
    name = container.instance or container.name
    served = spec.get("served_model_name")
    return {
        "name": name,
        "managed": True,
        "driver": container.driver,
        "image": str(spec.get("image") or container.image),
        "state": container.state,
        "ready": probe and _ready(container, driver, address),
        "draining": name in draining and draining[name].applies_to(None if address is None else address[1]),
        "port": None if address is None else address[1],
        "served_model_name": served if isinstance(served, str) else None,
    }


def _observe_foreign(container: ContainerInfo, probe: bool) -> dict[str, Any] | None:
    guessed = guess_driver(container)
    if guessed is None:
        return None
    driver = get_driver(guessed)
    # Only the port the guessed engine listens on is asked: another published port may be anything.
    published = probe_address(container, driver)
    listens = any(p.protocol == "tcp" and p.container_port == driver.facts.container_port for p in container.ports)
    address = published if listens else None
    return {
        "name": container.name,
        "managed": False,
        "driver": guessed,
        "image": container.image,
        "state": container.state,
        "ready": probe and _ready(container, driver, address),
        "draining": False,
        "port": None if published is None else published[1],
        "served_model_name": None,
    }


def capacity(
    engine: DockerEngine,
    *,
    gpu_facts: Mapping[str, Any] | None,
    port_range: Sequence[int] | None,
    bind_address: str,
    max_ports: int = MAX_PORTS,
) -> dict[str, Any]:
    """Free VRAM per GPU / MIG uuid after our reservations, and free ports in the policy range (None without a
    ``port_range``: no policy says which ports engines may take)."""
    containers = engine.list_containers()
    reservations = reservations_from(containers)
    vram: dict[str, int] = {}
    if gpu_facts is not None and gpu_facts.get("nvml_available"):
        vram = vram_left(gpu_facts, reservations)
    if port_range is None:
        return {"vram_free_mib": vram, "free_ports": None}
    published = {
        p.host_port
        for container in containers
        for p in container.ports
        if p.protocol == "tcp" and address_overlaps(p.host_ip, bind_address)
    }
    return {"vram_free_mib": vram, "free_ports": free_ports(published, port_range, bind_address, max_ports)}


def free_ports(
    published: Iterable[int], port_range: Sequence[int], bind_address: str, max_ports: int = MAX_PORTS
) -> list[int]:
    """The first ``max_ports`` ports of the range no container publishes and nothing else holds."""
    taken = set(published)
    low, high = int(port_range[0]), int(port_range[1])
    ports: list[int] = []
    for port in range(low, high + 1):
        if len(ports) >= max_ports:
            break
        if port not in taken and port_bind_problem(bind_address, port) is None:
            ports.append(port)
    return ports


def vram_left(gpu_facts: Mapping[str, Any], reservations: Sequence[Reservation]) -> dict[str, int]:
    """``min(free, total - reserved)`` MiB per GPU uuid and MIG instance uuid; GPUs in MIG mode only by
    instance (a whole-GPU engine cannot go there). Pure."""
    reserved: dict[str, int] = {}
    for reservation in reservations:
        devices, _missing = resolve_devices(reservation.gpus, gpu_facts)
        for device in devices:
            reserved[device.key] = reserved.get(device.key, 0) + reservation.min_vram_mib
    left: dict[str, int] = {}
    for gpu in gpu_facts.get("gpus") or []:
        wanted = [str(gpu.get("uuid"))] if not gpu.get("mig_mode") else []
        wanted += [str(m.get("uuid")) for m in gpu.get("mig_instances") or []]
        devices, _missing = resolve_devices(wanted, gpu_facts)
        for device in devices:
            room = min(device.free_mib, device.total_mib - reserved.get(device.key, 0))
            left[device.key] = max(room, 0)
    return left


def observe_engines(
    engine: DockerEngine,
    *,
    state_dir: str,
    gpu_facts: Mapping[str, Any] | None,
    port_range: Sequence[int],
    bind_address: str,
    probe: bool = True,
) -> dict[str, Any]:
    """``{"engines": [...], "capacity": {...}}`` for the agent's observation document."""
    return {
        "engines": discover_engines(engine, state_dir=state_dir, probe=probe),
        "capacity": capacity(engine, gpu_facts=gpu_facts, port_range=port_range, bind_address=bind_address),
    }


def _owner_of(container: ContainerInfo | None) -> str | None:
    return None if container is None else container.labels.get(LABEL_OWNER)


def _placement(container: ContainerInfo | None) -> dict[str, Any]:
    """What an engine of ours holds for placement, from its spec label: ``gpus`` (ids as its spec gave them)
    and ``min_vram_mib``; nothing (``[]``, ``0``) for a foreign engine or an unreadable label."""
    spec = label_spec(container) if container is not None else {}
    gpus = spec.get("gpus")
    vram = spec.get("min_vram_mib")
    return {
        "gpus": [str(gpu) for gpu in gpus] if isinstance(gpus, list) else [],
        "min_vram_mib": vram if isinstance(vram, int) and not isinstance(vram, bool) and vram > 0 else 0,
    }


def engine_info(
    connect: Callable[[], DockerEngine],
    *,
    policy_path: str | None,
    state_dir: str,
    managed_only: bool = False,
    owner: str | None = None,
    probe: bool = True,
    gpu_facts: Callable[[], Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """``{"engines": [...], "capacity": {...} or None}`` for this host under the policy at ``policy_path``.

    Each engine is ``discover_engines``' entry plus what it holds for placement (from our spec label):
    ``gpus`` and ``min_vram_mib``, empty and 0 for foreign engines. The agent's observation leaves these two
    out (its schema has no place for them); the reconcile playbook needs them to order pruning.

    Reads only: the Docker Engine's container list (through ``connect()``), the draining marks, one
    readiness GET per running engine (unless ``probe`` is false) and, when ``gpu_facts`` is given, the GPUs
    it reads for capacity. ``capacity`` is None without ``gpu_facts``: the caller did not ask for it.

    ``owner`` keeps only our engines whose ``meridian.node/owner`` label is exactly that (what
    engine_instance's ``owner`` option set): the engines one converger started, not an operator's or
    another agent's on a shared Docker Engine. An owner's engines can only have been created under a policy
    that allows some image; under a policy that allows none, the list is empty and Docker is not asked, so a
    host that runs no engines (artifacts only) needs no Docker Engine to reconcile.

    ``policy_path`` None means the host has no policy: the listing needs none, so engines are listed all the
    same, and only what the policy decides is left out - ``capacity``'s ``free_ports`` is None (the port range
    and bind address are the policy's) and the no-image shortcut for ``owner`` does not apply.

    Raises ``PolicyError`` for a bad policy and ``DockerEngineError`` when Docker fails, both with messages
    meant for the operator.
    """
    # Read first even when capacity is not asked for: a wrong policy fails the same way every time.
    policy = None if policy_path is None else load_policy(policy_path, keys=False)
    if owner is not None and policy is not None and not policy.images.allowed_repositories and gpu_facts is None:
        return {"engines": [], "capacity": None}
    engine = connect()
    try:
        engines = discover_engines(engine, state_dir=state_dir, probe=probe)
        if managed_only or owner is not None:
            engines = [entry for entry in engines if entry["managed"]]
        owned = {c.instance or c.name: c for c in engine.list_owned()}
        if owner is not None:
            engines = [entry for entry in engines if _owner_of(owned.get(entry["name"])) == owner]
        engines = [{**entry, **_placement(owned.get(entry["name"]) if entry["managed"] else None)} for entry in engines]
        room: dict[str, Any] | None = None
        if gpu_facts is not None:
            room = capacity(
                engine,
                gpu_facts=gpu_facts(),
                port_range=None if policy is None else policy.engines.port_range,
                bind_address="" if policy is None else policy.engines.bind_address,
            )
    finally:
        engine.close()
    return {"engines": engines, "capacity": room}

"""One engine's generic spec, as ``engines.instance`` runs it: the ``ParsedEngineSpec`` contract without pydantic.

``contracts.EngineSpec`` is the wire form (inside a desired state, with its JSON schema). The engine
modules validate the same fields with ``parse_engine_spec`` instead, because an Ansible task is a fresh
process and pydantic would be most of its start-up (see ``_plain_checks``). The two must accept and
refuse the same documents: ``tests/collection/module_utils/engines/test_engine_spec.py`` holds them to
it over a table, and both
take their patterns and driver names from here, and the rules for the container's host settings
(``volume_problem``, ``label_problem``, ``ulimit_problem``), so neither can drift from the other.

Host settings, and why they are limited the way they are (a signed but mistaken desired state must not be
able to hand an engine the host):

- ``restart_policy`` is Docker's, without ``always``: ``always`` differs from ``unless-stopped`` only in
  starting again, when dockerd restarts, a container that was stopped on purpose (by a drain, by
  ``state: stopped``, by a failed readiness wait).
- ``ipc_mode`` is ``private`` or ``host``; whether ``host`` may run is the host policy's call
  (``engines.allow_host_ipc``), never the spec's.
- ``volumes`` are always read-only. A host path must be absolute and normal, and must not overlap
  ``RESERVED_HOST_PATHS``: host configuration and secrets, the kernel's and the container runtimes'
  interfaces (a read-only mount of a Unix socket still lets a process connect to it: the Docker socket is
  root), and meridian.node's own directories. Which other paths may be mounted is the host policy's
  allow-list (``engines.allowed_volume_sources``), checked on the host where the path is resolved. Inside
  the container, ``/meridian`` is ours (the model mount) and ``/proc``, ``/sys``, ``/dev`` are Docker's.
- ``labels`` may not use meridian.node's prefix (ownership, owner, spec and config hash live there) nor
  Docker's reserved namespaces.
- ``ulimits`` are limited to the names engines need; ``rtprio``, ``nice`` and ``rttime`` would let an engine
  raise its scheduling priority above the host's own processes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils._errors import ResultError
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import (
    FieldError,
    check_bool,
    check_choice,
    check_int,
    check_list,
    check_mapping,
    check_str,
    check_str_list,
    check_str_map,
    join,
    short_repr,
)
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import (
    DRIVERS,
    ENGINE_STATES,
    IMAGE_REFERENCE,
    IMAGE_REFERENCE_FORM,
    IPC_MODES,
    MAX_LABELS,
    MAX_VOLUMES,
    NAME_FORM,
    NAME_PATTERN,
    READY_TIMEOUT_MAX_S,
    REPLACE_STRATEGIES,
    RESTART_POLICIES,
    SHM_SIZE_MAX_MIB,
    ULIMIT_MAX,
    ULIMIT_NAMES,
    label_problem,
    secret_env_problem,
    ulimit_problem,
    volume_problem,
    volume_targets_problem,
)

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.engines.plan import ReplaceStrategy
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = [
    "EngineInstanceError",
    "FieldError",
    "ParsedEngineSpec",
    "ParsedModelRef",
    "ParsedUlimit",
    "ParsedVolume",
    "build_spec",
    "check_policy",
    "parse_engine_spec",
]

_NAME = re.compile(NAME_PATTERN)

_REQUIRED = ("name", "driver", "image", "model", "port")
_OPTIONAL = (
    "served_model_name",
    "gpus",
    "min_vram_mib",
    "force",
    "args",
    "env",
    "secret_env",
    "state",
    "replace_strategy",
    "restart_policy",
    "shm_size_mib",
    "ipc_mode",
    "ulimits",
    "volumes",
    "labels",
    "ready_timeout_seconds",
)


@dataclass(frozen=True)
class ParsedModelRef:
    """A promoted artifact in the local store, or a model name for engines that manage their own."""

    artifact: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {key: value for key, value in (("artifact", self.artifact), ("name", self.name)) if value is not None}


@dataclass(frozen=True)
class ParsedVolume:
    """A host path mounted read-only at ``target`` inside the engine's container (there is no writable form)."""

    source: str
    target: str


@dataclass(frozen=True)
class ParsedUlimit:
    """A soft and a hard limit; -1 is unlimited. A spec may also give one number for both."""

    soft: int
    hard: int


# Built by keyword only (parse_engine_spec, the tests); kw_only=True would need Python 3.10 on the host.
@dataclass(frozen=True)
class ParsedEngineSpec:
    name: str
    driver: str
    image: str
    model: ParsedModelRef
    port: int
    served_model_name: str | None = None
    gpus: tuple[str, ...] = ()
    min_vram_mib: int = 0
    # Place on GPUs whose health verdict is unhealthy or unknown (engines.placement), saying so in a warning.
    # How to place, not what the container is: not in the public spec, nor in the config hash.
    force: bool = False
    args: tuple[str, ...] = ()
    # env's values are shown in diffs and results; secret_env's only reach the container (labels.shown_spec).
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, str] = field(default_factory=dict)
    state: str = "started"
    replace_strategy: str = "drain-then-replace"
    restart_policy: str = "unless-stopped"
    # None: the driver's default (docs/ENGINE_DRIVERS.md), else Docker's 64 MiB
    shm_size_mib: int | None = None
    ipc_mode: str = "private"
    ulimits: Mapping[str, int | ParsedUlimit] = field(default_factory=dict)
    volumes: tuple[ParsedVolume, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    # How long a new container may take to become ready; None: the applying module's ready_timeout. Not part of
    # the container (nor of its config hash): changing it replaces nothing.
    ready_timeout_seconds: int | None = None


def parse_engine_spec(data: Any, where: str = "") -> ParsedEngineSpec:
    """Validate one engine spec; the first problem raises ``FieldError`` naming the field and value."""
    document = check_mapping(data, where, required=_REQUIRED, optional=_OPTIONAL)
    served = document.get("served_model_name")
    shm = document.get("shm_size_mib")
    ready = document.get("ready_timeout_seconds")
    ipc_mode = check_choice(document.get("ipc_mode", "private"), join(where, "ipc_mode"), IPC_MODES)
    if ipc_mode == "host" and shm is not None:
        raise FieldError(join(where, "shm_size_mib"), _SHM_WITH_HOST_IPC)
    env = check_str_map(document.get("env", {}), join(where, "env"))
    secret_env = check_str_map(document.get("secret_env", {}), join(where, "secret_env"))
    both = secret_env_problem(env, secret_env)
    if both is not None:
        raise FieldError(join(where, "secret_env"), both)
    return ParsedEngineSpec(
        name=check_str(document["name"], join(where, "name"), pattern=_NAME, what=NAME_FORM),
        driver=check_choice(document["driver"], join(where, "driver"), DRIVERS),
        image=check_str(document["image"], join(where, "image"), pattern=IMAGE_REFERENCE, what=IMAGE_REFERENCE_FORM),
        model=_parse_model(document["model"], join(where, "model")),
        port=check_int(document["port"], join(where, "port"), ge=1, le=65535),
        served_model_name=None if served is None else check_str(served, join(where, "served_model_name")),
        gpus=check_str_list(document.get("gpus", []), join(where, "gpus")),
        min_vram_mib=check_int(document.get("min_vram_mib", 0), join(where, "min_vram_mib"), ge=0),
        force=check_bool(document.get("force", False), join(where, "force")),
        args=check_str_list(document.get("args", []), join(where, "args")),
        env=env,
        secret_env=secret_env,
        state=check_choice(document.get("state", "started"), join(where, "state"), ENGINE_STATES),
        replace_strategy=check_choice(
            document.get("replace_strategy", "drain-then-replace"), join(where, "replace_strategy"), REPLACE_STRATEGIES
        ),
        restart_policy=check_choice(
            document.get("restart_policy", "unless-stopped"), join(where, "restart_policy"), RESTART_POLICIES
        ),
        shm_size_mib=None if shm is None else check_int(shm, join(where, "shm_size_mib"), ge=1, le=SHM_SIZE_MAX_MIB),
        ipc_mode=ipc_mode,
        ulimits=_parse_ulimits(document.get("ulimits", {}), join(where, "ulimits")),
        volumes=_parse_volumes(document.get("volumes", []), join(where, "volumes")),
        labels=_parse_labels(document.get("labels", {}), join(where, "labels")),
        ready_timeout_seconds=None
        if ready is None
        else check_int(ready, join(where, "ready_timeout_seconds"), ge=1, le=READY_TIMEOUT_MAX_S),
    )


def _parse_model(data: Any, where: str) -> ParsedModelRef:
    document = check_mapping(data, where, optional=("artifact", "name"))
    artifact, name = document.get("artifact"), document.get("name")
    if (artifact is None) == (name is None):
        raise FieldError(where, "model needs exactly one of 'artifact' or 'name'")
    if artifact is not None:
        return ParsedModelRef(artifact=check_str(artifact, join(where, "artifact"), pattern=_NAME, what=NAME_FORM))
    return ParsedModelRef(name=check_str(name, join(where, "name")))


_SHM_WITH_HOST_IPC = (
    "shm_size_mib has no effect with ipc_mode host (the engine uses the host's /dev/shm); drop one of them"
)


def _parse_ulimits(data: Any, where: str) -> dict[str, int | ParsedUlimit]:
    # Every key is let through here so that an unknown one is refused below with the names that are allowed.
    document = check_mapping(data, where, optional=tuple(data) if isinstance(data, Mapping) else ())
    ulimits: dict[str, int | ParsedUlimit] = {}
    for name, value in document.items():
        at = join(where, str(name))
        if name not in ULIMIT_NAMES:
            raise FieldError(at, f"ulimit {short_repr(name)} is not one of {', '.join(ULIMIT_NAMES)}")
        if isinstance(value, Mapping):
            pair = check_mapping(value, at, required=("soft", "hard"))
            soft = check_int(pair["soft"], join(at, "soft"), ge=-1, le=ULIMIT_MAX)
            hard = check_int(pair["hard"], join(at, "hard"), ge=-1, le=ULIMIT_MAX)
            limit: int | ParsedUlimit = ParsedUlimit(soft=soft, hard=hard)
        else:
            soft = hard = check_int(value, at, ge=-1, le=ULIMIT_MAX)
            limit = soft
        problem = ulimit_problem(name, soft, hard)
        if problem is not None:
            raise FieldError(at, problem)
        ulimits[name] = limit
    return ulimits


def _parse_volumes(data: Any, where: str) -> tuple[ParsedVolume, ...]:
    items = check_list(data, where, max_items=MAX_VOLUMES)
    volumes: list[ParsedVolume] = []
    for index, item in enumerate(items):
        at = join(where, index)
        document = check_mapping(item, at, required=("source", "target"))
        volume = ParsedVolume(
            source=check_str(document["source"], join(at, "source")),
            target=check_str(document["target"], join(at, "target")),
        )
        problem = volume_problem(volume.source, volume.target)
        if problem is not None:
            raise FieldError(at, problem)
        volumes.append(volume)
    problem = volume_targets_problem([volume.target for volume in volumes])
    if problem is not None:
        raise FieldError(where, problem)
    return tuple(volumes)


def _parse_labels(data: Any, where: str) -> dict[str, str]:
    labels = check_str_map(data, where)
    if len(labels) > MAX_LABELS:
        raise FieldError(where, f"at most {MAX_LABELS} labels (got {len(labels)})")
    for key, value in labels.items():
        problem = label_problem(key, value)
        if problem is not None:
            raise FieldError(join(where, key), problem)
    return labels


# --- one engine instance's spec, from a module's parameters and against the host's policy -------------


class EngineInstanceError(ResultError):
    """A check refused the engine or an action failed; ``check`` names which, ``result`` what was done."""

    check: str  # always set: every refusal or failure of one engine names its check

    def __init__(self, message: str, *, check: str, result: Mapping[str, Any] | None = None) -> None:
        super().__init__(message, result, check=check)


# A module's parameters that are the spec: all but how to converge (``state``, ``replace_strategy``).
_SPEC_KEYS = tuple(key for key in (*_REQUIRED, *_OPTIONAL) if key not in ("state", "replace_strategy"))


def build_spec(params: Mapping[str, Any], replace_strategy: ReplaceStrategy = "drain-then-replace") -> ParsedEngineSpec:
    """The engine spec from the module's parameters (None means 'not given')."""
    data = {key: params[key] for key in _SPEC_KEYS if params.get(key) is not None}
    if isinstance(data.get("model"), Mapping):
        data["model"] = {key: value for key, value in data["model"].items() if value is not None}
    data["replace_strategy"] = replace_strategy
    try:
        return parse_engine_spec(data)
    except FieldError as exc:
        raise EngineInstanceError(f"engine {params.get('name')!r}: invalid spec: {exc}", check="spec") from exc


def check_policy(policy: Policy, spec: ParsedEngineSpec) -> None:
    """Image, driver, port, IPC mode and volume paths against the host's policy; the first refusal raises,
    naming the check. Pure: the volumes' paths as the spec gives them (``engines.volumes`` resolves them)."""
    for check, problem in (
        ("policy-image", policy.image_allowed(spec.image)),
        ("policy-driver", policy.driver_allowed(spec.driver)),
        ("policy-port", policy.port_allowed(spec.port)),
        ("policy-ipc", policy.engines.host_ipc_problem(spec.ipc_mode)),
        *(("policy-volume", policy.engines.volume_source_problem(volume.source)) for volume in spec.volumes),
    ):
        if problem is not None:
            raise EngineInstanceError(f"engine {spec.name!r} refused by policy: {problem}", check=check)

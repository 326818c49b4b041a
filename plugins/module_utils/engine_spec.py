"""One engine's generic spec, as ``engine_instance`` runs it: the ``EngineSpec`` contract without pydantic.

``contracts.EngineSpec`` is the wire form (inside a desired state, with its JSON schema). The engine
modules validate the same fields with ``parse_engine_spec`` instead, because an Ansible task is a fresh
process and pydantic would be most of its start-up (see ``plain_checks``). The two must accept and
refuse the same documents: ``tests/unit/test_engine_spec.py`` holds them to it over a table, and both
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

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.plain_checks import (
    FieldError,
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

__all__ = [
    "DRIVERS",
    "ENGINE_STATES",
    "IMAGE_REFERENCE",
    "IPC_MODES",
    "MAX_LABELS",
    "MAX_LABEL_VALUE",
    "MAX_VOLUMES",
    "NAME_PATTERN",
    "REPLACE_STRATEGIES",
    "RESERVED_CONTAINER_PATHS",
    "RESERVED_HOST_PATHS",
    "RESERVED_LABEL_PREFIXES",
    "RESTART_POLICIES",
    "SHM_SIZE_MAX_MIB",
    "ULIMIT_MAX",
    "ULIMIT_NAMES",
    "EngineSpec",
    "FieldError",
    "ModelRef",
    "Ulimit",
    "Volume",
    "label_problem",
    "parse_engine_spec",
    "path_within",
    "paths_overlap",
    "ulimit_problem",
    "volume_problem",
]

DRIVERS = ("vllm", "tgi", "sglang", "ollama", "llamacpp", "lmdeploy", "openai")
ENGINE_STATES = ("started", "stopped", "absent")
REPLACE_STRATEGIES = ("drain-then-replace", "stop-then-start")
RESTART_POLICIES = ("no", "on-failure", "unless-stopped")
IPC_MODES = ("private", "host")
ULIMIT_NAMES = ("core", "memlock", "nofile", "nproc", "stack")
# -1 is "unlimited" (RLIM_INFINITY); anything else fits the int64 the Engine API carries.
ULIMIT_MAX = 2**63 - 1
# /dev/shm is a tmpfs: the size is a cap, not an allocation. The bound only keeps the byte count (MiB * 2**20)
# far inside int64; it is larger than any host's memory.
SHM_SIZE_MAX_MIB = 16 * 1024 * 1024
MAX_VOLUMES = 16
MAX_LABELS = 32
MAX_LABEL_VALUE = 1024

# Host paths no engine may mount, nor any directory above them (mounting /var would expose /var/run/docker.sock).
RESERVED_HOST_PATHS = (
    "/boot",
    "/dev",
    "/etc",
    "/proc",
    "/root",
    "/run",
    "/sys",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/kubelet",
    "/var/lib/meridian-node",
    "/var/lib/meridian-node-apply",
    "/var/lib/meridian-node-artifacts",
    "/var/run",
)
# Container paths a volume may not cover: /meridian holds the collection's own mounts (the model artifact).
RESERVED_CONTAINER_PATHS = ("/dev", "/meridian", "/proc", "/sys")
RESERVED_LABEL_PREFIXES = ("meridian.node", "com.docker.", "io.docker.", "org.dockerproject.")
_LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,126}[a-z0-9])?$")

# Names of engines and artifacts: they become container names, label values and store directories.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"
_NAME = re.compile(NAME_PATTERN)

# repository[:tag]@sha256:<64 hex>. Whether a digest is *required* is policy's call, not the contract's;
# the contract only insists the reference is well formed.
IMAGE_REFERENCE = re.compile(
    r"^(?P<repository>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
IMAGE_REFERENCE_FORM = "repository[:tag][@sha256:<64 hex>]"
NAME_FORM = "a lowercase name of 1-63 letters, digits, '.', '_' or '-'"

_REQUIRED = ("name", "driver", "image", "model", "port")
_OPTIONAL = (
    "served_model_name",
    "gpus",
    "min_vram_mib",
    "args",
    "env",
    "state",
    "replace_strategy",
    "restart_policy",
    "shm_size_mib",
    "ipc_mode",
    "ulimits",
    "volumes",
    "labels",
)


@dataclass(frozen=True)
class ModelRef:
    """A promoted artifact in the local store, or a model name for engines that manage their own."""

    artifact: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {key: value for key, value in (("artifact", self.artifact), ("name", self.name)) if value is not None}


@dataclass(frozen=True)
class Volume:
    """A host path mounted read-only at ``target`` inside the engine's container (there is no writable form)."""

    source: str
    target: str


@dataclass(frozen=True)
class Ulimit:
    """A soft and a hard limit; -1 is unlimited. A spec may also give one number for both."""

    soft: int
    hard: int


# Built by keyword only (parse_engine_spec, the tests); kw_only=True would need Python 3.10 on the host.
@dataclass(frozen=True)
class EngineSpec:
    name: str
    driver: str
    image: str
    model: ModelRef
    port: int
    served_model_name: str | None = None
    gpus: tuple[str, ...] = ()
    min_vram_mib: int = 0
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    state: str = "started"
    replace_strategy: str = "drain-then-replace"
    restart_policy: str = "unless-stopped"
    # None: the driver's default (docs/ENGINE_DRIVERS.md), else Docker's 64 MiB
    shm_size_mib: int | None = None
    ipc_mode: str = "private"
    ulimits: Mapping[str, int | Ulimit] = field(default_factory=dict)
    volumes: tuple[Volume, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


def parse_engine_spec(data: Any, where: str = "") -> EngineSpec:
    """Validate one engine spec; the first problem raises ``FieldError`` naming the field and value."""
    document = check_mapping(data, where, required=_REQUIRED, optional=_OPTIONAL)
    served = document.get("served_model_name")
    shm = document.get("shm_size_mib")
    ipc_mode = check_choice(document.get("ipc_mode", "private"), join(where, "ipc_mode"), IPC_MODES)
    if ipc_mode == "host" and shm is not None:
        raise FieldError(join(where, "shm_size_mib"), _SHM_WITH_HOST_IPC)
    return EngineSpec(
        name=check_str(document["name"], join(where, "name"), pattern=_NAME, what=NAME_FORM),
        driver=check_choice(document["driver"], join(where, "driver"), DRIVERS),
        image=check_str(document["image"], join(where, "image"), pattern=IMAGE_REFERENCE, what=IMAGE_REFERENCE_FORM),
        model=_parse_model(document["model"], join(where, "model")),
        port=check_int(document["port"], join(where, "port"), ge=1, le=65535),
        served_model_name=None if served is None else check_str(served, join(where, "served_model_name")),
        gpus=check_str_list(document.get("gpus", []), join(where, "gpus")),
        min_vram_mib=check_int(document.get("min_vram_mib", 0), join(where, "min_vram_mib"), ge=0),
        args=check_str_list(document.get("args", []), join(where, "args")),
        env=check_str_map(document.get("env", {}), join(where, "env")),
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
    )


def _parse_model(data: Any, where: str) -> ModelRef:
    document = check_mapping(data, where, optional=("artifact", "name"))
    artifact, name = document.get("artifact"), document.get("name")
    if (artifact is None) == (name is None):
        raise FieldError(where, "model needs exactly one of 'artifact' or 'name'")
    if artifact is not None:
        return ModelRef(artifact=check_str(artifact, join(where, "artifact"), pattern=_NAME, what=NAME_FORM))
    return ModelRef(name=check_str(name, join(where, "name")))


_SHM_WITH_HOST_IPC = (
    "shm_size_mib has no effect with ipc_mode host (the engine uses the host's /dev/shm); drop one of them"
)


def _parse_ulimits(data: Any, where: str) -> dict[str, int | Ulimit]:
    # Every key is let through here so that an unknown one is refused below with the names that are allowed.
    document = check_mapping(data, where, optional=tuple(data) if isinstance(data, Mapping) else ())
    ulimits: dict[str, int | Ulimit] = {}
    for name, value in document.items():
        at = join(where, str(name))
        if name not in ULIMIT_NAMES:
            raise FieldError(at, f"ulimit {short_repr(name)} is not one of {', '.join(ULIMIT_NAMES)}")
        if isinstance(value, Mapping):
            pair = check_mapping(value, at, required=("soft", "hard"))
            soft = check_int(pair["soft"], join(at, "soft"), ge=-1, le=ULIMIT_MAX)
            hard = check_int(pair["hard"], join(at, "hard"), ge=-1, le=ULIMIT_MAX)
            limit: int | Ulimit = Ulimit(soft=soft, hard=hard)
        else:
            soft = hard = check_int(value, at, ge=-1, le=ULIMIT_MAX)
            limit = soft
        problem = ulimit_problem(name, soft, hard)
        if problem is not None:
            raise FieldError(at, problem)
        ulimits[name] = limit
    return ulimits


def _parse_volumes(data: Any, where: str) -> tuple[Volume, ...]:
    items = check_list(data, where, max_items=MAX_VOLUMES)
    volumes: list[Volume] = []
    for index, item in enumerate(items):
        at = join(where, index)
        document = check_mapping(item, at, required=("source", "target"))
        volume = Volume(
            source=check_str(document["source"], join(at, "source")),
            target=check_str(document["target"], join(at, "target")),
        )
        problem = volume_problem(volume.source, volume.target)
        if problem is not None:
            raise FieldError(at, problem)
        volumes.append(volume)
    problem = _targets_problem([volume.target for volume in volumes])
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


# --- the rules both checks share (contracts.EngineSpec calls them too) -------------------------------------


def path_within(path: str, root: str) -> bool:
    """Whether normal absolute ``path`` is ``root`` or below it, by whole components (/data2 is not in /data)."""
    return root == "/" or path == root or path.startswith(root + "/")


def paths_overlap(first: str, second: str) -> bool:
    """Whether one of two normal absolute paths contains the other: mounting either exposes both."""
    return path_within(first, second) or path_within(second, first)


def _path_problem(path: str, what: str) -> str | None:
    if not path.startswith("/") or "\x00" in path or posixpath.normpath(path) != path or path.startswith("//"):
        return (
            f"{what} {short_repr(path)} must be an absolute path without '.', '..', '//' or a trailing '/'; "
            f"write it as {short_repr(posixpath.normpath(path))} if that is what you mean"
        )
    return None


def volume_problem(source: str, target: str) -> str | None:
    """None when host path ``source`` may be mounted read-only at ``target`` as far as the spec can tell, else
    why not. The host also checks its policy's allow-list against the path with symlinks resolved."""
    problem = _path_problem(source, "volume source") or _path_problem(target, "volume target")
    if problem is not None:
        return problem
    for reserved in RESERVED_HOST_PATHS:
        if paths_overlap(source, reserved):
            return (
                f"volume source {source!r} overlaps {reserved}, which no engine may mount (host configuration, "
                "secrets, the kernel's and container runtimes' interfaces, or meridian.node's own state); mount a "
                "data directory of its own instead"
            )
    if target == "/":
        return "volume target '/' would cover the whole container; mount at a directory such as /data"
    for reserved in RESERVED_CONTAINER_PATHS:
        if paths_overlap(target, reserved):
            return (
                f"volume target {target!r} overlaps {reserved} inside the container, which meridian.node or Docker "
                "mounts itself; choose another directory such as /data"
            )
    return None


def _targets_problem(targets: list[str]) -> str | None:
    for index, target in enumerate(targets):
        for other in targets[index + 1 :]:
            if paths_overlap(target, other):
                return f"volume targets {target!r} and {other!r} overlap: one mount would hide the other"
    return None


def label_problem(key: str, value: str) -> str | None:
    """None when ``key: value`` may be one of an engine's own labels, else why not."""
    if not _LABEL_KEY.match(key):
        return (
            f"label key {short_repr(key)} must be 1-128 lowercase letters, digits, '.', '_', '/' or '-', starting "
            "and ending with a letter or digit (such as com.example.team)"
        )
    for prefix in RESERVED_LABEL_PREFIXES:
        if key.startswith(prefix):
            return (
                f"label key {key!r} starts with {prefix!r}, which is reserved (meridian.node's ownership and spec "
                "labels, Docker's own namespaces); use a prefix of your own such as com.example."
            )
    if len(value) > MAX_LABEL_VALUE:
        return f"label {key!r}: the value is {len(value)} characters, more than {MAX_LABEL_VALUE}"
    return None


def ulimit_problem(name: str, soft: int, hard: int) -> str | None:
    """None when ``soft``/``hard`` (-1 = unlimited) is a limit the kernel accepts for ``name``, else why not."""
    if name not in ULIMIT_NAMES:
        return f"ulimit {name!r} is not one of {', '.join(ULIMIT_NAMES)}"
    if name == "nofile" and -1 in (soft, hard):
        return "ulimit nofile cannot be unlimited (the kernel caps it at fs.nr_open); give a number such as 1048576"
    if hard != -1 and (soft == -1 or soft > hard):
        return f"ulimit {name}: soft limit {soft} is above hard limit {hard} (-1 is unlimited)"
    return None

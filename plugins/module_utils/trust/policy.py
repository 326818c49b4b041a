"""The host's root-owned policy: which keys it trusts, and what engines may run.

The policy is the host's own word, not the control plane's: modules re-check images, drivers and ports
against it even when the agent already did. Parsing is strict (unknown fields are errors: a misspelt
``threshhold`` must not silently leave the default in force) and every error names the field path and
the bad value, so the operator can fix the file from the message alone.

Choices worth knowing:
- A public-key entry is PEM text when it contains ``-----BEGIN``, otherwise a path to a PEM file; a
  relative path is resolved against the policy file's directory.
- Only *public* Ed25519 keys are accepted; a private-key PEM is an error (see ``dsse.load_public_key_pem``).
- ``control`` must be configured. ``artifact`` and ``air_gap_authority`` may be left out: documents of a
  role without keys are then refused (``threshold-not-met``), never accepted.
- ``store.path`` defaults to ``DEFAULT_STORE_PATH``, a root-owned directory of its own: the store used to
  default to ``LEGACY_STORE_PATH``, inside the agent's directory, where the agent's user could swap the
  model files engines mount. An install that relied on the old default keeps working: when the policy
  names no path and only the old default holds a store, the old path is used and ``StorePolicy.path_source``
  says ``legacy-default`` (``StorePolicy.relocate_to`` names the new home), so the store can warn and say
  how to move it. That decision reads the disk (a few ``lstat`` calls), and is the only part of parsing
  that does, apart from key files. A policy that names ``store.path`` is taken as it is.
- ``store.max_bytes`` takes an integer or a size string: ``K``/``M``/``G``/``T`` (optionally followed
  by ``B``) are powers of 1000, ``Ki``/``Mi``/``Gi``/``Ti`` (optionally ``B``) powers of 1024.
- ``store.local_sources`` lists the absolute directories inside which a signed artifact manifest may name
  local files (its per-file ``url`` or its ``base_url``); empty (the default), a manifest may name none
  and must use http(s). The store compares after ``realpath`` (see ``artifacts.fetch``). A ``source``
  given to ``verified_artifact`` or ``artifact pull`` is not limited by it.
- ``images.allowed_repositories`` entries match the repository part of a reference exactly
  (``ghcr.io/org/vllm``), or every repository below a prefix when they end in ``/*``. No registry
  name normalisation: ``vllm/vllm-openai`` and ``docker.io/vllm/vllm-openai`` are different entries.
- ``images.registry_auth_file`` (optional, absolute) names the registry credentials a pull sends, in docker's
  ``config.json`` ``auths`` form; ``images.pull_stall_seconds`` (default 120) and ``images.min_free_bytes``
  (default 1Gi; a size as ``store.max_bytes``, or 0 for no floor) bound a pull (``docker.image_pull``).
  ``images.prune_grace_seconds`` (default 86400, one day; 0 to 31536000) is how long an image the project
  brought stays after a pruning ``engine_set`` first found no engine using it (``engines.image_prune``).
- ``trust.control.max_lifetime`` (optional, e.g. ``7d``; units ``s``, ``m``, ``h``, ``d``, ``w``) caps how
  long a desired state may be valid: a state whose ``expires_at`` is further than that from its
  ``issued_at`` is refused (``schema``). Without it any lifetime is accepted. Only ``control`` takes it:
  manifests do not expire. ``trust.air_gap_authority.max_lifetime`` caps a bundle's ``expires_at -
  created_at`` the same way: delivery by hand does not make a bundle good for years.
- ``air_gap`` (docs/AIR_GAP.md) names ``scratch_dir``, the only directory the bundle reader writes to
  (absolute; default ``DEFAULT_BUNDLE_SCRATCH``, inside root's own directory), and the caps a bundle is
  refused beyond before any member is read: ``max_bytes`` (the sum of the sizes ``bundle.json`` lists;
  a size like ``max_bytes`` of the store) and ``max_members``; and ``shipped_code`` (``pinned``, the
  default, or ``refuse``): whether a bundle's own playbooks and collection may run, and then only when the
  control-signed state pins their digests (``runbook.py``); and ``max_image_layer_bytes`` (a size, default
  64 GiB), the most any blob of a bundle's image archive may declare.
- ``cordon`` (optional; docs/GPU_HEALTH.md) lists ``gpus`` (uuid, index or MIG uuid, at least one) that take
  no new engine, with ``drain`` (stop and hold the engines there too) and a ``reason``. It is read together
  with the host's cordon file and the signed state's cordon (``engines.cordon_file.merge_cordons``).
- YAML mappings with a duplicated key are refused: two ``trust:`` blocks would otherwise keep the last.
- ``load_policy(path, keys=False)`` validates the whole file but reads no key: the engine modules check
  images, drivers and ports and verify no signature, and loading keys means importing ``cryptography``,
  a cost every engine task would pay for nothing. Such a policy refuses to answer ``trusted_keys``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._module import (
    AGENT_STATE_DIR,
    DEFAULT_POLICY,
    DEFAULT_STATE_DIR,
    DEFAULT_STORE_PATH,
)
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import (
    FieldError,
    check_bool,
    check_choice,
    check_int,
    check_list,
    check_mapping,
    check_str,
    check_str_list,
    join,
    short_repr,
)
from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import (
    YamlFileError,
    parse_yaml,
    read_text_file,
)
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import (
    DRIVERS,
    IMAGE_REFERENCE,
    RESERVED_HOST_PATHS,
    path_within,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = [
    "AGENT_MODES",
    "DEFAULT_BUNDLE_SCRATCH",
    "DEFAULT_POLICY_PATH",
    "DEFAULT_STORE_PATH",
    "LEGACY_STORE_PATH",
    "ROLES",
    "SHIPPED_CODE",
    "AirGapPolicy",
    "CordonPolicy",
    "Policy",
    "PolicyError",
    "Role",
    "StorePolicy",
    "default_store_path",
    "format_duration",
    "load_policy",
    "parse_duration",
    "parse_policy",
    "parse_size",
]

DEFAULT_POLICY_PATH = DEFAULT_POLICY
# The default before the store moved out of the agent's directory (now ``DEFAULT_STORE_PATH``, root's own); still
# honoured (see default_store_path).
LEGACY_STORE_PATH = f"{AGENT_STATE_DIR}/artifacts"
StorePathSource = Literal["policy", "default", "legacy-default"]

Role = Literal["control", "artifact", "air_gap_authority"]
ROLES: tuple[Role, ...] = ("control", "artifact", "air_gap_authority")
AGENT_MODES = ("observe-only", "managed-host", "kubernetes-integrated", "air-gapped")

# Policy files are small; a multi-megabyte one is a mistake (or a YAML bomb), not a policy.
_MAX_POLICY_BYTES = 1024 * 1024


class PolicyError(MeridianError, ValueError):
    """The policy file is unreadable or invalid; the message names the file, the field and the value."""


# --- sizes -----------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?)?B?\s*$")
_UNITS = {
    None: 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or ``"500G"``/``"500GB"`` (powers of 1000) or ``"2TiB"``/``"2Ti"`` (powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a byte count or a size like 500G or 2TiB (got {value!r})")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if not match:
            raise ValueError(
                f"must be a byte count or a size like 500G (powers of 1000) or 2TiB (powers of 1024) (got {value!r})"
            )
        size = int(match.group(1)) * _UNITS[match.group(2)]
    if size <= 0:
        raise ValueError(f"must be more than 0 bytes (got {value!r})")
    return size


# --- durations ---------------------------------------------------------------------------------------

_DURATION = re.compile(r"([0-9]+)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# timedelta's own ceiling is 999999999 days; a lifetime near it is "forever", which is what leaving the
# field out says.
_MAX_DURATION = timedelta(days=100 * 366)


def parse_duration(value: Any) -> timedelta:
    """A positive duration from ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"`` or ``"2w"``; ``ValueError`` saying why not."""
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"must be a duration: a whole number and one unit of s, m, h, d or w, such as 7d or 12h "
            f"(got {short_repr(value)})"
        )
    total_s = int(match.group(1)) * _UNIT_S[match.group(2)]
    if total_s <= 0 or total_s > _MAX_DURATION.total_seconds():
        raise ValueError(f"must be more than 0 and at most 100 years (got {value!r})")
    return timedelta(seconds=total_s)


def format_duration(value: timedelta) -> str:
    """``7d``, ``1d 12h``, ``2h 30m 5.5s``: a duration in the units ``parse_duration`` reads."""
    parts = []
    days, rest = value.days, value - timedelta(days=value.days)
    if days:
        parts.append(f"{days}d")
    hours, rest_s = divmod(rest.total_seconds(), 3600)
    minutes, seconds = divmod(rest_s, 60)
    if hours:
        parts.append(f"{int(hours)}h")
    if minutes:
        parts.append(f"{int(minutes)}m")
    if seconds or not parts:
        parts.append(f"{seconds:g}s")
    return " ".join(parts)


# --- the document, as the file spells it -------------------------------------------------------------
# Checked with plain_checks rather than pydantic: every engine task loads the policy, and pydantic's
# import alone would be a third of that task's start-up.

_SECTIONS = ("images", "engines", "store", "agent", "air_gap", "cordon")


@dataclass(frozen=True)
class _RoleSpec:
    threshold: int
    public_keys: tuple[str, ...]
    max_lifetime: timedelta | None = None


def _role_spec(data: Any, where: str, role: Role) -> _RoleSpec:
    # Only control (desired state) and air_gap_authority (bundles) sign documents that expire, so only
    # they take max_lifetime.
    optional = ("threshold", "max_lifetime") if role in ("control", "air_gap_authority") else ("threshold",)
    document = check_mapping(data, where, required=("public_keys",), optional=optional)
    max_lifetime = None
    if document.get("max_lifetime") is not None:
        try:
            max_lifetime = parse_duration(document["max_lifetime"])
        except ValueError as exc:
            raise FieldError(join(where, "max_lifetime"), str(exc)) from None
    return _RoleSpec(
        threshold=check_int(document.get("threshold", 1), join(where, "threshold"), ge=1),
        public_keys=check_str_list(document["public_keys"], join(where, "public_keys"), min_items=1),
        max_lifetime=max_lifetime,
    )


def _trust(data: Any) -> dict[str, _RoleSpec]:
    document = check_mapping(data, "trust", required=("control",), optional=ROLES[1:])
    # control must be a role; the others may be left out or null (their documents are then refused).
    return {
        role: _role_spec(document[role], f"trust.{role}", role)
        for role in ROLES
        if role == "control" or document.get(role) is not None
    }


def _known(values: tuple[str, ...], where: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    for value in values:
        if value not in known:
            raise FieldError(where, f"unknown {what} {value!r}; known {what}s: {', '.join(known)}")
    return values


def _images(data: Any) -> ImagesPolicy:
    document = check_mapping(
        data,
        "images",
        optional=(
            "allowed_repositories",
            "require_digest",
            "registry_auth_file",
            "pull_stall_seconds",
            "min_free_bytes",
            "prune_grace_seconds",
        ),
    )
    auth_file = document.get("registry_auth_file")
    if auth_file is not None:
        auth_file = check_str(auth_file, "images.registry_auth_file")
        if not os.path.isabs(auth_file) or os.path.normpath(auth_file) != auth_file:
            raise FieldError(
                "images.registry_auth_file", f"must be a normal absolute path (got {short_repr(auth_file)})"
            )
    floor = document.get("min_free_bytes", ImagesPolicy.min_free_bytes)
    if isinstance(floor, bool) or not isinstance(floor, (int, str)):
        raise FieldError("images.min_free_bytes", f"must be a byte count or a size like 10G (got {short_repr(floor)})")
    try:
        # 0 switches the floor off; anything else is a size as store.max_bytes takes it.
        min_free = 0 if floor == 0 else parse_size(floor)
    except ValueError as exc:
        raise FieldError("images.min_free_bytes", str(exc)) from None
    return ImagesPolicy(
        allowed_repositories=check_str_list(document.get("allowed_repositories", []), "images.allowed_repositories"),
        require_digest=check_bool(document.get("require_digest", True), "images.require_digest"),
        registry_auth_file=auth_file,
        pull_stall_seconds=check_int(
            document.get("pull_stall_seconds", ImagesPolicy.pull_stall_seconds),
            "images.pull_stall_seconds",
            ge=1,
            le=86400,
        ),
        min_free_bytes=min_free,
        prune_grace_seconds=check_int(
            document.get("prune_grace_seconds", ImagesPolicy.prune_grace_seconds),
            "images.prune_grace_seconds",
            ge=0,
            le=365 * 86400,
        ),
    )


def _engines(data: Any) -> EnginesPolicy:
    document = check_mapping(
        data,
        "engines",
        optional=("allowed_drivers", "bind_address", "port_range", "allowed_volume_sources", "allow_host_ipc"),
    )
    drivers = check_str_list(document.get("allowed_drivers", list(DRIVERS)), "engines.allowed_drivers")
    bind = check_str(document.get("bind_address", "127.0.0.1"), "engines.bind_address")
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise FieldError("engines.bind_address", f"must be an IP address such as 127.0.0.1 (got {bind!r})") from None
    ports = check_list(document.get("port_range", [8000, 8999]), "engines.port_range", min_items=2, max_items=2)
    low, high = (check_int(port, join("engines.port_range", index)) for index, port in enumerate(ports))
    if not 1 <= low <= high <= 65535:
        raise FieldError("engines.port_range", f"must be [low, high] with 1 <= low <= high <= 65535 (got {ports})")
    return EnginesPolicy(
        _known(drivers, "engines.allowed_drivers", DRIVERS, "driver"),
        bind,
        (low, high),
        allowed_volume_sources=_volume_sources(document.get("allowed_volume_sources", [])),
        allow_host_ipc=check_bool(document.get("allow_host_ipc", False), "engines.allow_host_ipc"),
    )


def _volume_sources(data: Any) -> tuple[str, ...]:
    where = "engines.allowed_volume_sources"
    sources = check_str_list(data, where)
    for index, source in enumerate(sources):
        at = join(where, index)
        if not source.startswith("/") or source.startswith("//") or os.path.normpath(source) != source:
            raise FieldError(at, f"must be an absolute path without '.', '..', '//' or a trailing '/' (got {source!r})")
        if source == "/":
            raise FieldError(at, "'/' would let engines mount any directory; name the directories they may read")
        for reserved in RESERVED_HOST_PATHS:
            if path_within(source, reserved):
                problem = f"{source!r} is inside {reserved}, which no engine may mount; name a data directory"
                raise FieldError(at, problem)
    return sources


def _store(data: Any) -> StorePolicy:
    document = check_mapping(data, "store", optional=("path", "max_bytes", "local_sources"))
    source: StorePathSource = "policy"
    if "path" in document:
        path = check_str(document["path"], "store.path")
    else:
        path, source = default_store_path()
    if not os.path.isabs(path):
        raise FieldError("store.path", f"must be an absolute path (got {path!r})")
    max_bytes = document.get("max_bytes", 500 * 1000**3)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, str)):
        raise FieldError("store.max_bytes", f"must be a byte count or a size like 500G (got {short_repr(max_bytes)})")
    try:
        size = parse_size(max_bytes)
    except ValueError as exc:
        raise FieldError("store.max_bytes", str(exc)) from None
    local_sources = check_str_list(document.get("local_sources", []), "store.local_sources")
    for index, directory in enumerate(local_sources):
        if not os.path.isabs(directory):
            raise FieldError(
                join("store.local_sources", index), f"must be an absolute directory path (got {directory!r})"
            )
    return StorePolicy(path, size, source, local_sources)


def default_store_path(new: str | None = None, old: str | None = None) -> tuple[str, StorePathSource]:
    """The store a policy without ``store.path`` means: ``new`` (``DEFAULT_STORE_PATH``), unless only ``old``
    (``LEGACY_STORE_PATH``) holds a store. The new directory may exist and be empty: the apply unit's
    ``StateDirectory=`` creates it on every start, before anyone moved the old store there."""
    new = DEFAULT_STORE_PATH if new is None else new
    old = LEGACY_STORE_PATH if old is None else old
    if _holds_store(old) and not _holds_store(new):
        return old, "legacy-default"
    return new, "default"


def _holds_store(path: str) -> bool:
    # Any of the store's own entries: a crash can leave blobs before the first index write.
    return any(os.path.lexists(os.path.join(path, entry)) for entry in ("index.json", "blobs", "artifacts"))


def _agent(data: Any) -> AgentPolicy:
    document = check_mapping(data, "agent", optional=("allowed_modes",))
    modes = check_str_list(document.get("allowed_modes", list(AGENT_MODES)), "agent.allowed_modes", min_items=1)
    return AgentPolicy(_known(modes, "agent.allowed_modes", AGENT_MODES, "mode"))


# --- air-gap bundles (docs/AIR_GAP.md) -------------------------------------------------------------------

# Root's own directory (the apply unit's StateDirectory=): the agent's user cannot swap a verified file there.
DEFAULT_BUNDLE_SCRATCH = f"{DEFAULT_STATE_DIR}/bundle-scratch"
# air_gap.shipped_code: run a bundle's playbooks/ and collection/ only when control pinned them, or never.
SHIPPED_CODE = ("pinned", "refuse")


@dataclass(frozen=True)
class AirGapPolicy:
    """Where and how much the bundle reader may write. ``scratch_dir`` is never the inbox: a file there
    is written by the reader alone, from bytes it hashed on the way in. ``max_bytes`` and ``max_members``
    refuse a bundle whose signed listing asks for more, before any member is read. ``shipped_code`` says
    whether a bundle's own ``playbooks/`` and ``collection/`` may run at all: ``pinned`` (the default) runs
    them only when the control-signed state inside pins exactly those bytes (``runbook``), ``refuse`` refuses
    every bundle that ships code, pinned or not. ``max_image_layer_bytes`` caps each blob of an image archive
    a bundle carries (``images/``), refused at its header before a byte of it is read."""

    scratch_dir: str = DEFAULT_BUNDLE_SCRATCH
    max_bytes: int = 1024**4
    max_members: int = 10_000
    shipped_code: str = "pinned"
    # The largest engine images (CUDA inference servers) have single layers of 10-20 GB.
    max_image_layer_bytes: int = 64 * 1024**3


def _air_gap(data: Any) -> AirGapPolicy:
    document = check_mapping(
        data, "air_gap", optional=("scratch_dir", "max_bytes", "max_members", "shipped_code", "max_image_layer_bytes")
    )
    scratch = check_str(document.get("scratch_dir", DEFAULT_BUNDLE_SCRATCH), "air_gap.scratch_dir")
    if not scratch.startswith("/") or os.path.normpath(scratch) != scratch or scratch == "/":
        raise FieldError(
            "air_gap.scratch_dir",
            f"must be an absolute path without '.', '..', '//' or a trailing '/' (got {scratch!r})",
        )
    size = _air_gap_size(document, "max_bytes", AirGapPolicy.max_bytes)
    layer = _air_gap_size(document, "max_image_layer_bytes", AirGapPolicy.max_image_layer_bytes)
    members = check_int(document.get("max_members", AirGapPolicy.max_members), "air_gap.max_members", ge=1)
    shipped = check_choice(
        document.get("shipped_code", AirGapPolicy.shipped_code), "air_gap.shipped_code", SHIPPED_CODE
    )
    return AirGapPolicy(scratch, size, members, shipped, layer)


def _air_gap_size(document: Mapping[str, Any], key: str, default: int) -> int:
    value = document.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FieldError(f"air_gap.{key}", f"must be a byte count or a size like 2TiB (got {short_repr(value)})")
    try:
        return parse_size(value)
    except ValueError as exc:
        raise FieldError(f"air_gap.{key}", str(exc)) from None


# --- cordoned GPUs (docs/GPU_HEALTH.md) -------------------------------------------------------------------


@dataclass(frozen=True)
class CordonPolicy:
    """GPUs the host's owner keeps out of placement for good (a card known bad, one kept for other work):
    no new engine lands there; with ``drain`` the engines there are stopped and held too. Node-wide cordons
    are the ``meridian.node.cordon`` module's (maintenance) or the signed state's, never the policy's."""

    gpus: tuple[str, ...] = ()
    drain: bool = False
    reason: str | None = None


def _cordon(data: Any) -> CordonPolicy:
    document = check_mapping(data, "cordon", required=("gpus",), optional=("drain", "reason"))
    gpus = check_str_list(document["gpus"], "cordon.gpus", min_items=1)
    for index, gpu in enumerate(gpus):
        if not gpu.strip() or len(gpu) > 128:
            raise FieldError(join("cordon.gpus", index), f"must name a GPU by uuid, index or MIG uuid (got {gpu!r})")
    reason = document.get("reason")
    return CordonPolicy(
        gpus=gpus,
        drain=check_bool(document.get("drain", False), "cordon.drain"),
        reason=None if reason is None else check_str(reason, "cordon.reason"),
    )


# --- the loaded policy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImagesPolicy:
    """Which images engines may run, and how a missing one is pulled (``docker.image_pull``): from
    ``registry_auth_file``'s credentials (a root-owned 0600 file in docker's config.json ``auths`` form; None:
    anonymous), cancelled when its bytes do not move for ``pull_stall_seconds``, and refused before it starts
    when it would leave less than ``min_free_bytes`` free under Docker's data-root (0: no floor). An image the
    project brought and no engine uses any more is removed ``prune_grace_seconds`` after a prune first found it
    unused (``engines.image_prune``; 0: at once)."""

    allowed_repositories: tuple[str, ...]
    require_digest: bool
    registry_auth_file: str | None = None
    pull_stall_seconds: int = 120
    min_free_bytes: int = 1024**3
    prune_grace_seconds: int = 86400


@dataclass(frozen=True)
class EnginesPolicy:
    """What engines may run. ``allowed_volume_sources``: host directories an engine may mount (read-only) at or
    below; empty, the default, allows no extra volume at all. ``allow_host_ipc``: whether an engine may share the
    host's IPC namespace (``ipc_mode: host``), and so its SysV and POSIX shared memory with the host and every
    other such engine; the default keeps engines in their own namespace with a private /dev/shm."""

    allowed_drivers: tuple[str, ...]
    bind_address: str
    port_range: tuple[int, int]
    allowed_volume_sources: tuple[str, ...] = ()
    allow_host_ipc: bool = False

    def volume_source_problem(self, path: str) -> str | None:
        """None when normal absolute host ``path`` is at or below an allowed volume source, else why not."""
        if any(path_within(path, source) for source in self.allowed_volume_sources):
            return None
        allowed = ", ".join(self.allowed_volume_sources) or "none: engines.allowed_volume_sources is empty"
        return (
            f"volume source {path!r} is not at or below a directory engines.allowed_volume_sources lists "
            f"(allowed: {allowed}); add the directory there if engines may read it"
        )

    def host_ipc_problem(self, ipc_mode: str) -> str | None:
        if ipc_mode != "host" or self.allow_host_ipc:
            return None
        return (
            "ipc_mode host shares the host's IPC namespace and shared memory with the engine, and "
            "engines.allow_host_ipc is false; use the private default (with shm_size_mib if the engine needs a "
            "larger /dev/shm), or set engines.allow_host_ipc: true"
        )


@dataclass(frozen=True)
class StorePolicy:
    """``path_source`` says where ``path`` came from: ``policy`` (the file names it, also the default for
    callers that build one), ``default`` (``DEFAULT_STORE_PATH``), or ``legacy-default`` (the file names
    none and the store still sits at ``LEGACY_STORE_PATH``; see the module docstring)."""

    path: str
    max_bytes: int
    path_source: StorePathSource = "policy"
    # Directories a signed manifest may name local files in (``store.local_sources``); none by default.
    local_sources: tuple[str, ...] = ()

    @property
    def relocate_to(self) -> str | None:
        """Where a store left at the old default should move; None for every other store."""
        return DEFAULT_STORE_PATH if self.path_source == "legacy-default" else None


@dataclass(frozen=True)
class AgentPolicy:
    allowed_modes: tuple[str, ...]


@dataclass(frozen=True)
class _RoleTrust:
    threshold: int
    keys: Mapping[str, Ed25519PublicKey]
    max_lifetime: timedelta | None = None


@dataclass(frozen=True)
class Policy:
    """A validated policy with its keys loaded. Build it with ``load_policy`` or ``parse_policy``."""

    source: str
    images: ImagesPolicy
    engines: EnginesPolicy
    store: StorePolicy
    agent: AgentPolicy
    _roles: Mapping[str, _RoleTrust] | None = field(repr=False)
    air_gap: AirGapPolicy = field(default_factory=AirGapPolicy)
    cordon: CordonPolicy | None = None

    def trusted_keys(self, role: Role) -> dict[str, Ed25519PublicKey]:
        """keyid -> public key trusted for ``role``; empty when the policy configures no such role."""
        trust = self._role(role)
        return dict(trust.keys) if trust else {}

    def threshold(self, role: Role) -> int:
        """How many distinct trusted keys must sign; 1 for an unconfigured role (which has no keys)."""
        trust = self._role(role)
        return trust.threshold if trust else 1

    def max_lifetime(self, role: Role) -> timedelta | None:
        """The longest a document of ``role`` may be valid (``trust.<role>.max_lifetime``); None: no cap."""
        trust = self._role(role)
        return trust.max_lifetime if trust else None

    def _role(self, role: Role) -> _RoleTrust | None:
        _check_role(role)
        if self._roles is None:
            raise RuntimeError(f"policy {self.source} was loaded without its keys (keys=False); load it with keys")
        return self._roles.get(role)

    def image_allowed(self, ref: str) -> str | None:
        """None when ``ref`` may run here, else the reason it may not."""
        match = IMAGE_REFERENCE.match(ref)
        if not match:
            return f"image {ref!r} is not a valid reference (repository[:tag]@sha256:<64 hex>)"
        if self.images.require_digest and not match.group("digest"):
            return f"image {ref!r} is unpinned: policy requires a digest (@sha256:<64 hex>)"
        repository = match.group("repository")
        if not any(_repository_matches(pattern, repository) for pattern in self.images.allowed_repositories):
            allowed = ", ".join(self.images.allowed_repositories) or "none"
            return f"repository {repository!r} is not allowed by policy {self.source} (allowed: {allowed})"
        return None

    def repository_allowed(self, repository: str) -> bool:
        """Whether ``images.allowed_repositories`` takes ``repository`` (the image prune's test for loaded images)."""
        return any(_repository_matches(pattern, repository) for pattern in self.images.allowed_repositories)

    def driver_allowed(self, driver: str) -> str | None:
        if driver in self.engines.allowed_drivers:
            return None
        allowed = ", ".join(self.engines.allowed_drivers) or "none"
        return f"driver {driver!r} is not allowed by policy {self.source} (allowed: {allowed})"

    def port_allowed(self, port: int) -> str | None:
        low, high = self.engines.port_range
        if low <= port <= high:
            return None
        return f"port {port} is outside the policy's engine port range {low}-{high} ({self.source})"

    def mode_allowed(self, mode: str) -> str | None:
        if mode in self.agent.allowed_modes:
            return None
        allowed = ", ".join(self.agent.allowed_modes)
        return f"agent mode {mode!r} is not allowed by policy {self.source} (allowed: {allowed})"


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown trust role {role!r}; roles are {', '.join(ROLES)}")


def _repository_matches(pattern: str, repository: str) -> bool:
    if pattern.endswith("/*"):
        return repository.startswith(pattern[:-1])
    return repository == pattern


# --- loading -------------------------------------------------------------------------------------------


def load_policy(path: os.PathLike[str] | str = DEFAULT_POLICY_PATH, *, keys: bool = True) -> Policy:
    """Read and validate the policy file; any problem raises ``PolicyError`` naming the file. With
    ``keys=False`` the trust section is validated but no key is read (see the module docstring)."""
    source = os.fspath(path)
    try:
        text = read_text_file(source, what=f"policy {source}", max_bytes=_MAX_POLICY_BYTES)
    except YamlFileError as exc:
        raise PolicyError(str(exc)) from exc
    return parse_policy(text, Path(source).parent, source=source, keys=keys)


def parse_policy(text: str, base_dir: Path, *, source: str = "<text>", keys: bool = True) -> Policy:
    """Validate policy YAML; relative key paths resolve against ``base_dir``. ``source`` names it in errors."""
    prefix = f"policy {source}"
    try:
        data = parse_yaml(text, what=prefix)
    except YamlFileError as exc:
        raise PolicyError(str(exc)) from exc
    if not isinstance(data, dict):
        raise PolicyError(f"{prefix}: the top level must be a mapping with a 'trust' section (got {short_repr(data)})")
    try:
        check_mapping(data, "", required=("trust",), optional=_SECTIONS)
        trust = _trust(data["trust"])
        images, engines = _images(data.get("images", {})), _engines(data.get("engines", {}))
        store, agent = _store(data.get("store", {})), _agent(data.get("agent", {}))
        air_gap = _air_gap(data.get("air_gap", {}))
        cordon = _cordon(data["cordon"]) if "cordon" in data else None
    except FieldError as exc:
        raise PolicyError(f"{prefix}: {exc}") from exc

    roles = (
        {role: _load_role(spec, f"{prefix}: trust.{role}", base_dir) for role, spec in trust.items()} if keys else None
    )
    return Policy(
        source=source,
        images=images,
        engines=engines,
        store=store,
        agent=agent,
        _roles=roles,
        air_gap=air_gap,
        cordon=cordon,
    )


def _load_role(spec: _RoleSpec, where: str, base_dir: Path) -> _RoleTrust:
    from ansible_collections.meridian.node.plugins.module_utils.trust.dsse import (  # see the module docstring
        KeyLoadError,
        keyid_for,
        load_public_key_pem,
    )

    keys: dict[str, Ed25519PublicKey] = {}
    for index, entry in enumerate(spec.public_keys):
        field_path = f"{where}.public_keys[{index}]"
        if "-----BEGIN" in entry:
            pem, origin = entry.encode("utf-8"), "inline PEM"
        else:
            key_path = Path(entry) if os.path.isabs(entry) else base_dir / entry
            origin = f"key file {key_path}"
            try:
                pem = key_path.read_bytes()
            except OSError as exc:
                raise PolicyError(f"{field_path}: cannot read {origin}: {exc.strerror or exc}") from exc
        try:
            key = load_public_key_pem(pem)
        except KeyLoadError as exc:
            raise PolicyError(f"{field_path}: {origin}: {exc}") from exc
        keys[keyid_for(key)] = key
    # The same key listed twice is one signer: a threshold it could meet alone is no threshold.
    if spec.threshold > len(keys):
        raise PolicyError(
            f"{where}.threshold: must be <= the number of distinct public keys ({len(keys)}) (got {spec.threshold})"
        )
    return _RoleTrust(spec.threshold, keys, spec.max_lifetime)


# --- messages --------------------------------------------------------------------------------------------

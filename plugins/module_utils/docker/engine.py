"""The Docker adapter: every call the engine modules make to the Docker Engine, and no decisions.

What this file guarantees, so the modules above it cannot get it wrong:

- It never touches a container it does not own. Owned means our labels (``meridian.node/owned=true`` plus
  instance, driver and config hash) set by ``create`` itself, on a container whose image does not carry
  those labels: Docker copies image labels into containers, so an image with ``LABEL
  meridian.node/owned=true`` would otherwise make a stranger's container look like ours. ``start``,
  ``stop`` and ``remove`` refuse a foreign container; finding one by name reports it and leaves it alone.
- It never pulls (``docker.image_pull`` does, by digest, for the engine modules before they create).
  ``resolve_image`` looks in the local engine only; a digest-pinned reference resolves
  through the registry digest (``RepoDigests``) or, for images built or imported here that have no
  registry digest, through the image id (``repository@sha256:<image id>``, accepted only when the image
  is tagged in that repository). Containers are created from the resolved image id, so what runs is
  exactly what was checked.
- GPUs are asked for only where the engine has the NVIDIA runtime: without it Docker would create the
  container and fail at start, leaving a half-made container behind, so ``create`` refuses first.
- Every Docker failure surfaces as a ``DockerEngineError`` saying what we were doing, to what, and why
  ("Error creating container 'x': ..."); misuse of this API (bad settings) raises ``ValueError``.

The transport is ``docker.api`` (the Engine API over its socket, standard library only): the engine
modules need no Python package on the host, and pay no SDK import on every task.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import ipaddress
import json
import shutil
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.drift import (
    LABEL_SETTINGS,
    compare_settings,
    drifted_from_label,
    expected_settings,
    read_settings,
    settings_label,
)

__all__ = [
    "IPC_MODES",
    "LABEL_CONFIG_HASH",
    "LABEL_DRIVER",
    "LABEL_HOST_PORT",
    "LABEL_INSTANCE",
    "LABEL_OWNED",
    "LABEL_SETTINGS",
    "RESERVED_LABELS",
    "RESTART_POLICIES",
    "BindMount",
    "ContainerInfo",
    "ContainerNotFoundError",
    "ContainerSettings",
    "DockerEngine",
    "DockerEngineError",
    "DockerUnavailableError",
    "EngineInspection",
    "ExitInfo",
    "ForeignContainerError",
    "ImageInfo",
    "ImageNotFoundError",
    "NvidiaRuntimeMissingError",
    "Placement",
    "PortBinding",
    "PublishedPort",
    "UnsafeImageError",
    "address_overlaps",
    "config_hash",
    "port_bind_problem",
]

LABEL_OWNED = "meridian.node/owned"
LABEL_INSTANCE = "meridian.node/instance"
LABEL_DRIVER = "meridian.node/driver"
LABEL_CONFIG_HASH = "meridian.node/config-hash"
# The host port of a container created beside its engine's old one (``Placement``): Docker lists no ports for a
# stopped container, and the settings it was created from must still be known then.
LABEL_HOST_PORT = "meridian.node/host-port"
RESERVED_LABELS = (LABEL_OWNED, LABEL_INSTANCE, LABEL_DRIVER, LABEL_CONFIG_HASH, LABEL_SETTINGS, LABEL_HOST_PORT)
RESTART_POLICIES = ("no", "on-failure", "unless-stopped", "always")
IPC_MODES = ("private", "shareable", "host")
# A host runs a handful of engines: more cached readings than this means containers came and went.
_DRIFT_CACHE_SIZE = 64
# The device-request hook Docker uses for driver "nvidia" when no "nvidia" runtime is configured.
_NVIDIA_HOOK = "nvidia-container-runtime-hook"


class DockerEngineError(MeridianError):
    """A Docker Engine call failed; the message names the action, the object and the reason."""


class DockerUnavailableError(DockerEngineError):
    """No Docker Engine answering (or DOCKER_HOST names one this code cannot reach)."""


class ImageNotFoundError(DockerEngineError):
    """The image is not in the local engine (this adapter never pulls; ``docker.image_pull`` does)."""


class UnsafeImageError(DockerEngineError):
    """The image carries meridian.node's ownership labels, which would make its containers look owned."""


class ContainerNotFoundError(DockerEngineError):
    """The container is gone (removed by someone else between listing and acting)."""


class ForeignContainerError(DockerEngineError):
    """A container meridian.node does not own was about to be touched; it was left alone."""

    def __init__(self, message: str, container: ContainerInfo) -> None:
        super().__init__(message)
        self.container = container


class NvidiaRuntimeMissingError(DockerEngineError):
    """GPUs were requested on an engine without the NVIDIA runtime; nothing was created."""


def _value_digest(value: str) -> str:
    return "sha256:" + hashlib.sha256(value.encode("utf-8")).hexdigest()


def config_hash(data: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``data`` (sorted keys, no spaces): stable across runs,
    Python versions and dict ordering, so an unchanged spec gives an unchanged label."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class BindMount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class PortBinding:
    """Publish ``container_port`` (tcp) on ``host_ip:host_port``."""

    container_port: int
    host_port: int
    host_ip: str = "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    """Where one container of an engine actually runs when it is not the engine's own name and port: a
    replace's new container, created beside the old as ``<name>.NEW`` on a free port, then renamed."""

    name: str
    host_port: int | None = None


@dataclass(frozen=True)
class ContainerSettings:
    """Everything a container is created from. Plain data: drivers build it, the config hash covers it.

    ``placed`` is not hashed: a container created beside its engine's old one (another name, another host
    port) carries the same config hash as one created in its place, so once it has taken over it is the
    engine as asked, and is not replaced again.

    ``secret_env`` joins ``env`` in the container's environment (a name in both is refused); ``canonical`` and
    so the config hash hold a sha256 of each of its values, never a value, so that a changed secret replaces
    the container while no hash input or label can print one.

    ``ulimits`` are ``(name, soft, hard)``, -1 unlimited. ``ipc_mode`` is always sent (the daemon's own default
    may be ``shareable``); ``shm_size_mib`` None is Docker's 64 MiB and must be None with ``ipc_mode`` host,
    where Docker would silently ignore it.
    """

    name: str
    instance: str
    driver: str
    image: str
    command: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    port: PortBinding | None = None
    mounts: tuple[BindMount, ...] = ()
    gpus: tuple[str, ...] = ()
    init: bool = True
    stop_signal: str = "SIGTERM"
    stop_timeout_s: int = 30
    restart_policy: str = "no"
    shm_size_mib: int | None = None
    ipc_mode: str = "private"
    ulimits: tuple[tuple[str, int, int], ...] = ()
    placed: Placement | None = None

    def __post_init__(self) -> None:
        reserved = sorted(set(self.labels) & set(RESERVED_LABELS))
        if reserved:
            raise ValueError(f"labels {reserved} are set by DockerEngine.create itself; remove them from settings")
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"env names {both} are in both env and secret_env; keep each name in one of them")
        if self.restart_policy not in RESTART_POLICIES:
            raise ValueError(f"restart_policy {self.restart_policy!r} is not one of {', '.join(RESTART_POLICIES)}")
        if self.stop_timeout_s < 0:
            raise ValueError(f"stop_timeout_s must be >= 0 seconds, got {self.stop_timeout_s}")
        if self.ipc_mode not in IPC_MODES:
            raise ValueError(f"ipc_mode {self.ipc_mode!r} is not one of {', '.join(IPC_MODES)}")
        if self.shm_size_mib is not None and (self.shm_size_mib < 1 or self.ipc_mode == "host"):
            raise ValueError(
                f"shm_size_mib {self.shm_size_mib} needs a private or shareable ipc_mode and at least 1 MiB "
                f"(ipc_mode is {self.ipc_mode!r})"
            )
        names = [name for name, _soft, _hard in self.ulimits]
        if len(set(names)) != len(names):
            raise ValueError(f"ulimits {sorted(names)} name a limit more than once; give each limit once")
        for name, soft, hard in self.ulimits:
            if min(soft, hard) < -1 or (hard != -1 and (soft == -1 or soft > hard)):
                raise ValueError(f"ulimit {name}: soft {soft} / hard {hard} is not a limit (-1 is unlimited)")
        for mount in self.mounts:
            if not mount.source.startswith("/") or not mount.target.startswith("/"):
                raise ValueError(f"mount {mount.source!r} -> {mount.target!r}: both paths must be absolute")
        if self.port is not None:
            for number in (self.port.container_port, self.port.host_port):
                if not 1 <= number <= 65535:
                    raise ValueError(f"port {number} is outside 1-65535")
            ipaddress.ip_address(self.port.host_ip)
        if self.placed is not None and self.placed.host_port is not None and not 1 <= self.placed.host_port <= 65535:
            raise ValueError(f"port {self.placed.host_port} is outside 1-65535")

    @property
    def container_name(self) -> str:
        """The name the container is created under: the engine's, or its placement's."""
        return self.name if self.placed is None else self.placed.name

    @property
    def published(self) -> PortBinding | None:
        """The port binding the container is created with: the engine's, on its placement's host port if any."""
        if self.port is None or self.placed is None or self.placed.host_port is None:
            return self.port
        return dataclasses.replace(self.port, host_port=self.placed.host_port)

    def placed_at(self, name: str, host_port: int | None) -> ContainerSettings:
        """These settings for a container named ``name`` published on ``host_port`` (None: the engine's)."""
        return dataclasses.replace(self, placed=Placement(name=name, host_port=host_port))

    def canonical(self) -> dict[str, Any]:
        """The settings as plain JSON data, the input of ``config_hash``."""
        return {
            "name": self.name,
            "instance": self.instance,
            "driver": self.driver,
            "image": self.image,
            "command": list(self.command),
            "entrypoint": None if self.entrypoint is None else list(self.entrypoint),
            "env": dict(self.env),
            "labels": dict(self.labels),
            "port": None if self.port is None else [self.port.host_ip, self.port.host_port, self.port.container_port],
            "mounts": [[m.source, m.target, m.read_only] for m in self.mounts],
            "gpus": list(self.gpus),
            "init": self.init,
            "stop_signal": self.stop_signal,
            "stop_timeout": self.stop_timeout_s,  # the hash's key: renaming it would recreate every engine
            "restart_policy": self.restart_policy,
            "shm_size_mib": self.shm_size_mib,
            # Only when set, so that a container created before these settings existed keeps its hash.
            **({} if self.ipc_mode == "private" else {"ipc_mode": self.ipc_mode}),
            **({"ulimits": [list(limit) for limit in self.ulimits]} if self.ulimits else {}),
            **({"secret_env": self.secret_digests()} if self.secret_env else {}),
        }

    def config_hash(self) -> str:
        return config_hash(self.canonical())

    def secret_digests(self) -> dict[str, str]:
        """Each secret_env name with a sha256 of its value: what the config hash covers of a secret."""
        return {key: _value_digest(value) for key, value in sorted(self.secret_env.items())}

    @property
    def environment(self) -> dict[str, str]:
        """The container's whole environment, secret values included: for Docker's create request only."""
        return {**self.env, **self.secret_env}


@dataclass(frozen=True)
class PublishedPort:
    host_ip: str
    host_port: int
    container_port: int
    protocol: str = "tcp"


@dataclass(frozen=True)
class ExitInfo:
    """How often Docker restarted a container and how it last ended, from its inspect document."""

    restarts: int
    exit_code: int | None  # None: it never exited
    exit_reason: str | None  # "OOMKilled", "killed by signal 9", "exit 1", Docker's own error text

    @classmethod
    def from_inspect(cls, attrs: Mapping[str, Any]) -> ExitInfo:
        state = attrs.get("State") or {}
        restarts = attrs.get("RestartCount")
        finished = str(state.get("FinishedAt") or "")
        code = state.get("ExitCode")
        # Docker says ExitCode 0 and a zero FinishedAt for a container that never stopped.
        never = finished.startswith("0001-01-01") or not finished
        exit_code = None if never or not isinstance(code, int) or isinstance(code, bool) else code
        reason: str | None = None
        if state.get("OOMKilled"):
            reason = "OOMKilled"
        elif state.get("Error"):
            reason = str(state["Error"])[:200]
        elif exit_code is not None and exit_code > 128:
            reason = f"killed by signal {exit_code - 128}"
        elif exit_code:
            reason = f"exit {exit_code}"
        return cls(
            restarts=restarts if isinstance(restarts, int) and not isinstance(restarts, bool) else 0,
            exit_code=exit_code,
            exit_reason=reason,
        )


@dataclass(frozen=True)
class EngineInspection:
    """One inspect of an engine container, read two ways: how it last ended, and which of its settings
    differ from those it was created with (``docker.drift``; None when it carries nothing to compare with)."""

    exit: ExitInfo
    drifted: tuple[str, ...] | None


@dataclass(frozen=True)
class ContainerInfo:
    """One container as the engine lists it. ``owned`` is decided here once, by the rules above."""

    id: str
    name: str
    image: str
    image_id: str
    state: str
    status: str
    labels: Mapping[str, str]
    ports: tuple[PublishedPort, ...]
    owned: bool

    @property
    def instance(self) -> str | None:
        return self.labels.get(LABEL_INSTANCE)

    @property
    def driver(self) -> str | None:
        return self.labels.get(LABEL_DRIVER)

    @property
    def config_hash(self) -> str | None:
        return self.labels.get(LABEL_CONFIG_HASH)

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class ImageInfo:
    """A local image a reference resolved to; ``pinned_by`` says how a digest reference matched."""

    reference: str
    id: str
    repo_tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    labels: Mapping[str, str]
    pinned_by: str  # "registry-digest", "image-id" or "" (not a digest reference)
    # The image's own Config (command, entrypoint, env, labels): what Docker merges into its containers.
    config: Mapping[str, Any] = field(default_factory=dict)


@contextmanager
def _docker_call(action: str, not_found: type[DockerEngineError] = DockerEngineError) -> Iterator[None]:
    """Fold every API and transport error into our family, naming what we were doing: 'Error <action>: ...'."""
    try:
        yield
    except DockerApiError as exc:
        raise (not_found if exc.not_found else DockerEngineError)(f"Error {action}: {exc.reason}") from exc


def port_bind_problem(address: str, port: int) -> str | None:
    """None when a TCP listener could bind ``address:port`` now, else why not (with the numbers).

    SO_REUSEADDR makes a port held only by TIME_WAIT connections count as free, as it is for the
    engine that will bind it; Linux still refuses it while anyone listens there, wildcard listeners too.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {address} is already in use by another process"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"address {address} is not an address of this host (binding port {port} failed)"
            return f"port {port} on {address} cannot be bound: {exc.strerror or exc}"
    return None


def _claims_ownership(entry: Mapping[str, Any]) -> bool:
    labels = entry.get("Labels") or {}
    return labels.get(LABEL_OWNED) == "true" and bool(labels.get(LABEL_INSTANCE))


def _published_ports(entry: Mapping[str, Any]) -> tuple[PublishedPort, ...]:
    ports = []
    for port in entry.get("Ports") or []:
        if port.get("PublicPort"):
            ports.append(
                PublishedPort(
                    host_ip=str(port.get("IP", "")),
                    host_port=int(port["PublicPort"]),
                    container_port=int(port["PrivatePort"]),
                    protocol=str(port.get("Type", "tcp")),
                )
            )
    return tuple(ports)


class DockerEngine:
    """The local Docker Engine, through one ``DockerApi`` reused for every call."""

    def __init__(self, api: DockerApi) -> None:
        self.api = api
        self._info: dict[str, Any] | None = None
        # image id -> whether that image carries our ownership labels. Image ids are content hashes, so the
        # answer never changes: a long-lived engine object (the agent's) asks once per image, not per listing.
        self._image_spoofs: dict[str, bool] = {}
        # container id -> (the inspect parts the settings are read from, what was drifted): see inspect_engine.
        self._drift_cache: dict[str, tuple[tuple[Any, Any, Any], tuple[str, ...] | None]] = {}

    @classmethod
    def from_env(cls, timeout_s: int = 60) -> DockerEngine:
        """Connect as the ``docker`` CLI would (DOCKER_HOST, or the local socket) and check it answers."""
        try:
            api = DockerApi.from_env(timeout_s=timeout_s)
        except DockerApiError as exc:
            raise DockerUnavailableError(
                f"Error connecting to the Docker Engine: {exc.reason}; is dockerd running and is its socket "
                "(/var/run/docker.sock or DOCKER_HOST) reachable by this user?"
            ) from exc
        return cls(api)

    def close(self) -> None:
        """Nothing to release (every call opens and closes its own connection); kept for callers' symmetry."""

    # --- reading -----------------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """``docker info``, read once per engine object (runtimes do not change under a module run)."""
        if self._info is None:
            with _docker_call("reading docker info"):
                self._info = self.api.info()
        return self._info

    def has_nvidia_runtime(self) -> bool:
        """Whether a device request for driver ``nvidia`` can work: an ``nvidia`` runtime is configured, or
        the NVIDIA hook Docker falls back to is installed on this (the engine's) host."""
        runtimes = self.info().get("Runtimes") or {}
        return "nvidia" in runtimes or shutil.which(_NVIDIA_HOOK) is not None

    def _spoofing_image_ids(self) -> frozenset[str]:
        with _docker_call("listing images that carry meridian.node labels"):
            images = self.api.images({"label": [LABEL_OWNED]})
        return frozenset(image["Id"] for image in images)

    def _info_from_entry(self, entry: Mapping[str, Any], spoofing: frozenset[str]) -> ContainerInfo:
        labels = dict(entry.get("Labels") or {})
        owned = _claims_ownership(entry) and entry.get("ImageID", "") not in spoofing
        names = entry.get("Names") or []
        return ContainerInfo(
            id=str(entry["Id"]),
            name=str(names[0]).lstrip("/") if names else "",
            image=str(entry.get("Image", "")),
            image_id=str(entry.get("ImageID", "")),
            state=str(entry.get("State", "")),
            status=str(entry.get("Status", "")),
            labels=labels,
            ports=_published_ports(entry),
            owned=owned,
        )

    def _list(self, filters: Mapping[str, Any], action: str) -> list[ContainerInfo]:
        with _docker_call(action):
            entries = self.api.containers(filters)
        claimed = {str(entry.get("ImageID", "")) for entry in entries if _claims_ownership(entry)}
        if claimed - self._image_spoofs.keys():
            spoofing = self._spoofing_image_ids()
            for image_id in claimed - self._image_spoofs.keys():
                self._image_spoofs[image_id] = image_id in spoofing
        forged = frozenset(image_id for image_id in claimed if self._image_spoofs[image_id])
        return [self._info_from_entry(entry, forged) for entry in entries]

    def list_containers(self) -> list[ContainerInfo]:
        """Every container on the host, ours and others (``owned`` tells them apart); for discovery."""
        return self._list({}, "listing containers")

    def list_owned(self, instance: str | None = None) -> list[ContainerInfo]:
        """Containers we own, running or not; only those of ``instance`` when given."""
        labels = [f"{LABEL_OWNED}=true"]
        if instance is not None:
            labels.append(f"{LABEL_INSTANCE}={instance}")
        found = self._list({"label": labels}, "listing meridian.node containers")
        return [container for container in found if container.owned]

    def find(self, name: str) -> ContainerInfo | None:
        """The container called exactly ``name``, ours or not, or None.

        Not ``inspect(name)``: the engine also matches ids by prefix there, so an instance called
        ``abc`` would find some stranger's container whose id starts with abc.
        """
        found = self._list({"name": f"^/{_go_regex_escape(name)}$"}, f"looking up container {name!r}")
        exact = [container for container in found if container.name == name]
        return exact[0] if exact else None

    def find_names(self, names: Sequence[str]) -> dict[str, ContainerInfo]:
        """The containers called exactly one of ``names``, ours or not, by name: one listing for all of them."""
        if not names:
            return {}
        pattern = "^/(" + "|".join(_go_regex_escape(name) for name in names) + ")$"
        found = self._list({"name": pattern}, f"looking up containers {list(names)!r}")
        return {container.name: container for container in found if container.name in names}

    def find_owned(self, name: str) -> ContainerInfo | None:
        """Like ``find``, but a foreign container with that name raises ``ForeignContainerError``."""
        container = self.find(name)
        if container is not None:
            self._require_owned(container, "use")
        return container

    def container(self, container_id: str) -> ContainerInfo:
        """Fresh state of a container we already know by id."""
        found = self._list({"id": container_id}, f"reading container {container_id[:12]}")
        exact = [container for container in found if container.id == container_id]
        if not exact:
            raise ContainerNotFoundError(f"Error reading container {container_id[:12]}: it no longer exists")
        return exact[0]

    def exit_info(self, container_id: str) -> ExitInfo:
        """Restarts and the last exit of a container (one inspect): what an observation reports."""
        with _docker_call(f"inspecting container {container_id[:12]}", not_found=ContainerNotFoundError):
            attrs = self.api.inspect_container(container_id)
        return ExitInfo.from_inspect(attrs)

    def inspect_engine(self, container_id: str) -> EngineInspection:
        """How an engine container last ended and which settings were changed by hand, from one inspect:
        what the agent reads of each of its engines every cycle."""
        with _docker_call(f"inspecting container {container_id[:12]}", not_found=ContainerNotFoundError):
            attrs = self.api.inspect_container(container_id)
        # Reading the settings back costs far more than comparing the documents they come from, and an
        # engine's documents stay the same from one cycle to the next until someone changes it.
        sources = (attrs.get("Image"), attrs.get("Config"), attrs.get("HostConfig"))
        cached = self._drift_cache.get(container_id)
        if cached is not None and cached[0] == sources:
            drifted = cached[1]
        else:
            drifted = drifted_from_label(attrs)
            if len(self._drift_cache) >= _DRIFT_CACHE_SIZE:
                self._drift_cache.clear()
            self._drift_cache[container_id] = (sources, drifted)
        return EngineInspection(exit=ExitInfo.from_inspect(attrs), drifted=drifted)

    def settings_drift(self, container: ContainerInfo, settings: ContainerSettings) -> dict[str, tuple[Any, Any]]:
        """The settings of ``container`` that differ from those it would be created with from ``settings`` now,
        each as ``(live, expected)`` in ``docker.drift``'s form; {} when it runs as asked."""
        image = self.resolve_image(settings.image)
        expected = expected_settings(_create_body(settings, image.id, _our_labels(settings)), {"Config": image.config})
        with _docker_call(f"inspecting container {container.name!r}", not_found=ContainerNotFoundError):
            live = read_settings(self.api.inspect_container(container.id))
        return {name: (live.get(name), expected[name]) for name in compare_settings(expected, live)}

    def resolve_image(self, reference: str) -> ImageInfo:
        """The local image ``reference`` names; never pulls. See the module docstring for local pins."""
        repository, digest = _split_digest(reference)
        pinned_by = ""
        try:
            with _docker_call(f"inspecting image {reference!r}", not_found=ImageNotFoundError):
                attrs = self.api.inspect_image(reference)
            if digest:
                pinned_by = "registry-digest"
        except ImageNotFoundError:
            if not digest:
                raise ImageNotFoundError(
                    f"image {reference!r} is not in the local Docker Engine, and meridian.node never pulls a "
                    "reference without a digest; pin it by digest (it is then pulled) or load it first"
                ) from None
            attrs = self._by_image_id(reference, repository, digest)
            pinned_by = "image-id"
        config = attrs.get("Config") or {}
        return ImageInfo(
            reference=reference,
            id=str(attrs["Id"]),
            repo_tags=tuple(attrs.get("RepoTags") or ()),
            repo_digests=tuple(attrs.get("RepoDigests") or ()),
            labels=dict(config.get("Labels") or {}),
            pinned_by=pinned_by,
            config=dict(config),
        )

    def _by_image_id(self, reference: str, repository: str, digest: str) -> dict[str, Any]:
        try:
            with _docker_call(f"inspecting image {digest}", not_found=ImageNotFoundError):
                attrs: dict[str, Any] = self.api.inspect_image(digest)
        except ImageNotFoundError:
            raise ImageNotFoundError(
                f"image {reference!r} is not in the local Docker Engine: no image has registry digest or image "
                f"id {digest}; this adapter never pulls (the engine modules pull it by digest before they create)"
            ) from None
        # The image id is content-addressed, but the repository is what policy allows: the image must
        # really be that repository's, or 'allowed/repo@<id of anything>' would slip past the allowlist.
        tagged = {tag.rsplit(":", 1)[0] for tag in attrs.get("RepoTags") or ()}
        if attrs.get("Id") != digest or repository not in tagged:
            raise ImageNotFoundError(
                f"image {reference!r}: the local image with id {digest} is tagged "
                f"{sorted(tagged) or 'with no repository'}, not {repository!r}; tag it into {repository!r} "
                "or use a reference the image really has"
            )
        return attrs

    def logs_tail(self, container: ContainerInfo, lines: int = 50) -> str:
        """The last ``lines`` lines of stdout and stderr, decoded leniently; reading is allowed on any."""
        with _docker_call(f"reading logs of container {container.name!r}", not_found=ContainerNotFoundError):
            data = self.api.logs(container.id, tail=lines)
        return data.decode("utf-8", errors="replace")

    def port_in_use(self, address: str, port: int) -> str | None:
        """None when ``address:port`` is free both for Docker (no running container publishes it there or on
        a wildcard address) and for the kernel (it can be bound now); else who holds it."""
        for container in self.list_containers():
            for published in container.ports:
                if published.host_port != port or published.protocol != "tcp":
                    continue
                if address_overlaps(published.host_ip, address):
                    return (
                        f"port {port} on {address} is published by container {container.name!r} "
                        f"({published.host_ip or '*'}:{port} -> {published.container_port})"
                    )
        return port_bind_problem(address, port)

    # --- changing ----------------------------------------------------------------------------------------

    def create(self, settings: ContainerSettings) -> ContainerInfo:
        """Create (not start) a container we own from ``settings``.

        Refuses, with nothing created: GPUs without the NVIDIA runtime, an image missing locally or carrying
        our ownership labels. A name already taken fails in the engine (409) and is reported as such.
        """
        if settings.gpus and not self.has_nvidia_runtime():
            runtimes = ", ".join(sorted(self.info().get("Runtimes") or {})) or "none"
            raise NvidiaRuntimeMissingError(
                f"Error creating container {settings.name!r}: it asks for GPUs {list(settings.gpus)} but this "
                f"host's Docker Engine has no NVIDIA runtime (runtimes: {runtimes}); install the NVIDIA "
                "Container Toolkit and run 'nvidia-ctk runtime configure --runtime=docker', then restart dockerd"
            )
        image = self.resolve_image(settings.image)
        reserved = sorted(set(image.labels) & set(RESERVED_LABELS))
        if reserved:
            raise UnsafeImageError(
                f"Error creating container {settings.name!r}: image {settings.image!r} carries labels {reserved}, "
                "which Docker would copy into the container and make it pass as meridian.node's; rebuild the "
                "image without them"
            )
        labels = _our_labels(settings)
        # What the container will show when inspected, as a digest per setting: the agent, which has no
        # settings at hand, tells a container changed by hand from these (engine_drift).
        expected = expected_settings(_create_body(settings, image.id, labels), {"Config": image.config})
        labels[LABEL_SETTINGS] = settings_label(expected)
        with _docker_call(f"creating container {settings.container_name!r}"):
            created = self.api.create_container(settings.container_name, _create_body(settings, image.id, labels))
        container_id = str(created["Id"])
        with _docker_call(f"inspecting the new container {settings.name!r}", not_found=ContainerNotFoundError):
            live = read_settings(self.api.inspect_container(container_id))
        differ = compare_settings(expected, live)
        if differ:
            # A daemon that fills in settings of its own would make every later run see a change and
            # replace the engine again and again: refuse once, clearly, instead.
            with _docker_call(f"removing the new container {settings.name!r}"):
                self.api.remove(container_id, force=True)
            shown = "; ".join(
                f"{name}: {live.get(name)!r}, asked {expected[name]!r}" for name in differ if name != "env"
            )
            raise DockerEngineError(
                f"Error creating container {settings.name!r}: the Docker Engine created it with other settings "
                f"than asked ({', '.join(differ)}{': ' + shown if shown else ''}), so it was removed. Check the "
                "daemon's configuration (daemon.json defaults) and report it as a meridian.node bug"
            )
        return self.container(container_id)

    def start(self, container: ContainerInfo) -> None:
        self._require_owned(container, "start")
        with _docker_call(f"starting container {container.name!r}", not_found=ContainerNotFoundError):
            self.api.start(container.id)

    def stop(self, container: ContainerInfo, timeout_s: int) -> None:
        """Send the container's stop signal, then SIGKILL after ``timeout_s`` seconds.

        The timeout is required: the engine answers only once the grace period is over, so the HTTP call
        waits that much longer than the client timeout.
        """
        self._require_owned(container, "stop")
        if timeout_s < 0:
            raise ValueError(f"stop timeout must be >= 0 seconds, got {timeout_s}")
        with _docker_call(f"stopping container {container.name!r}", not_found=ContainerNotFoundError):
            self.api.stop(container.id, timeout_s)

    def remove(self, container: ContainerInfo, force: bool = False) -> None:
        self._require_owned(container, "remove")
        with _docker_call(f"removing container {container.name!r}", not_found=ContainerNotFoundError):
            self.api.remove(container.id, force=force)

    def rename(self, container: ContainerInfo, name: str) -> ContainerInfo:
        """Give an owned container another name (running or not: Docker renames live containers); returns
        it as it is now. A replace keeps its old and new containers under names beside the engine's."""
        self._require_owned(container, "rename")
        with _docker_call(f"renaming container {container.name!r} to {name!r}", not_found=ContainerNotFoundError):
            self.api.rename(container.id, name)
        return self.container(container.id)

    @staticmethod
    def _require_owned(container: ContainerInfo, verb: str) -> None:
        if not container.owned:
            raise ForeignContainerError(
                f"container {container.name!r} ({container.id[:12]}, image {container.image}) is not managed by "
                f"meridian.node (no ownership labels); refusing to {verb} it. Rename or remove it yourself, "
                "or choose another instance name",
                container,
            )


def _our_labels(settings: ContainerSettings) -> dict[str, str]:
    """The settings' labels and the ownership labels ``create`` adds (all but the settings digests)."""
    labels = {
        **settings.labels,
        LABEL_OWNED: "true",
        LABEL_INSTANCE: settings.instance,
        LABEL_DRIVER: settings.driver,
        LABEL_CONFIG_HASH: settings.config_hash(),
    }
    if settings.placed is not None and settings.placed.host_port is not None:
        labels[LABEL_HOST_PORT] = str(settings.placed.host_port)
    return labels


def _create_body(settings: ContainerSettings, image_id: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """The Engine API's container-create document for ``settings``; ``image_id``, not the reference: what
    runs is what was resolved and checked."""
    host_config: dict[str, Any] = {
        "Init": settings.init,
        "IpcMode": settings.ipc_mode,
        "Mounts": [
            {"Type": "bind", "Source": m.source, "Target": m.target, "ReadOnly": m.read_only} for m in settings.mounts
        ],
    }
    body: dict[str, Any] = {
        "Image": image_id,
        "Env": [f"{key}={value}" for key, value in sorted(settings.environment.items())],
        "Labels": dict(labels),
        "StopSignal": settings.stop_signal,
        "StopTimeout": settings.stop_timeout_s,
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "Tty": False,
        "OpenStdin": False,
        "HostConfig": host_config,
    }
    if settings.command:
        body["Cmd"] = list(settings.command)
    if settings.entrypoint is not None:
        body["Entrypoint"] = list(settings.entrypoint)
    published = settings.published
    if published is not None:
        key = f"{published.container_port}/tcp"
        body["ExposedPorts"] = {key: {}}
        host_config["PortBindings"] = {key: [{"HostIp": published.host_ip, "HostPort": str(published.host_port)}]}
    if settings.gpus:
        host_config["DeviceRequests"] = [
            {"Driver": "nvidia", "DeviceIDs": list(settings.gpus), "Capabilities": [["gpu"]], "Count": 0, "Options": {}}
        ]
    if settings.restart_policy != "no":
        host_config["RestartPolicy"] = {"Name": settings.restart_policy}
    if settings.shm_size_mib is not None:
        host_config["ShmSize"] = settings.shm_size_mib * 1024 * 1024
    if settings.ulimits:
        host_config["Ulimits"] = [{"Name": name, "Soft": soft, "Hard": hard} for name, soft, hard in settings.ulimits]
    return body


def _split_digest(reference: str) -> tuple[str, str]:
    """('repo[:tag]' without tag, 'sha256:...') or (reference, '') for references without a digest."""
    name, at, digest = reference.partition("@")
    if not at:
        return reference, ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name, digest


def address_overlaps(published_ip: str, address: str) -> bool:
    """Whether a port published on ``published_ip`` also takes it on ``address`` (a wildcard takes all)."""
    if not published_ip or published_ip == address:
        return True
    try:
        return ipaddress.ip_address(published_ip).is_unspecified or ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def _go_regex_escape(text: str) -> str:
    # Container names are [a-zA-Z0-9][a-zA-Z0-9_.-]*; escape everything else too, for Go's RE2.
    return "".join(char if char.isalnum() or char in "_-" else "\\" + char for char in text)

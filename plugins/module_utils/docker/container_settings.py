"""What an engine's container is created from: ``ContainerSettings`` (plain data, which drivers build and the
config hash covers), the labels that mark a container as meridian.node's, and the Engine API's create document
for them. No I/O: ``docker.engine`` sends the document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.drift import LABEL_SETTINGS

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
    "ContainerSettings",
    "Placement",
    "PortBinding",
    "config_hash",
    "create_body",
    "our_labels",
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


def our_labels(settings: ContainerSettings) -> dict[str, str]:
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


def create_body(settings: ContainerSettings, image_id: str, labels: Mapping[str, str]) -> dict[str, Any]:
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

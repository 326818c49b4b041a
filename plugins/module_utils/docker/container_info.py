"""What the Docker Engine says about containers and images, read into plain records: ``ContainerInfo`` (with
``owned`` decided once, by the rules in ``docker.engine``), ``ExitInfo``, ``EngineInspection``, ``ImageInfo``.
No I/O: ``docker.engine`` asks the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.container_settings import (
    LABEL_CONFIG_HASH,
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
)

__all__ = ["ContainerInfo", "EngineInspection", "ExitInfo", "ImageInfo", "PublishedPort", "claims_ownership"]


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
    """One container as the engine lists it. ``owned`` is decided here once (``from_listing``), by the ownership
    rules ``docker.engine``'s docstring states."""

    id: str
    name: str
    image: str
    image_id: str
    state: str
    status: str
    labels: Mapping[str, str]
    ports: tuple[PublishedPort, ...]
    owned: bool

    @classmethod
    def from_listing(cls, entry: Mapping[str, Any], spoofing: frozenset[str]) -> ContainerInfo:
        """One entry of the engine's container list; ``spoofing``: the ids of images that carry our ownership
        labels themselves (their containers are never ours)."""
        labels = dict(entry.get("Labels") or {})
        owned = claims_ownership(entry) and entry.get("ImageID", "") not in spoofing
        names = entry.get("Names") or []
        return cls(
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


def claims_ownership(entry: Mapping[str, Any]) -> bool:
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

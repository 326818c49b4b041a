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

import errno
import ipaddress
import shutil
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.container_info import (
    ContainerInfo,
    EngineInspection,
    ExitInfo,
    ImageInfo,
    PublishedPort,
    claims_ownership,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.container_settings import (
    IPC_MODES,
    LABEL_CONFIG_HASH,
    LABEL_DRIVER,
    LABEL_HOST_PORT,
    LABEL_INSTANCE,
    LABEL_OWNED,
    LABEL_SETTINGS,
    RESERVED_LABELS,
    RESTART_POLICIES,
    BindMount,
    ContainerSettings,
    Placement,
    PortBinding,
    config_hash,
    create_body,
    our_labels,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.drift import (
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
    def from_env(
        cls, timeout_s: int = 60, *, api_class: type[DockerApi] = DockerApi, who: str = "this user"
    ) -> DockerEngine:
        """Connect as the ``docker`` CLI would (DOCKER_HOST, or the local socket) and check it answers.

        ``api_class`` is the transport to connect with (root's listings pass a read-only one); ``who`` names,
        in the message when the socket cannot be reached, the user that must be able to reach it.
        """
        try:
            api = api_class.from_env(timeout_s=timeout_s)
        except DockerApiError as exc:
            raise DockerUnavailableError(
                f"Error connecting to the Docker Engine: {exc.reason}; is dockerd running and is its socket "
                f"(/var/run/docker.sock or DOCKER_HOST) reachable by {who}?"
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

    def _list(self, filters: Mapping[str, Any], action: str) -> list[ContainerInfo]:
        with _docker_call(action):
            entries = self.api.containers(filters)
        claimed = {str(entry.get("ImageID", "")) for entry in entries if claims_ownership(entry)}
        if claimed - self._image_spoofs.keys():
            spoofing = self._spoofing_image_ids()
            for image_id in claimed - self._image_spoofs.keys():
                self._image_spoofs[image_id] = image_id in spoofing
        forged = frozenset(image_id for image_id in claimed if self._image_spoofs[image_id])
        return [ContainerInfo.from_listing(entry, forged) for entry in entries]

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
        expected = expected_settings(create_body(settings, image.id, our_labels(settings)), {"Config": image.config})
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
        labels = our_labels(settings)
        # What the container will show when inspected, as a digest per setting: the agent, which has no
        # settings at hand, tells a container changed by hand from these (engine_drift).
        expected = expected_settings(create_body(settings, image.id, labels), {"Config": image.config})
        labels[LABEL_SETTINGS] = settings_label(expected)
        with _docker_call(f"creating container {settings.container_name!r}"):
            created = self.api.create_container(settings.container_name, create_body(settings, image.id, labels))
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

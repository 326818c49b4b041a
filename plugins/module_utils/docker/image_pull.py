"""Pinned images onto the host: pulled by digest through the Engine API, bounded, and verified before use.

What this file guarantees to the engine modules above it:

- Only ``repository@sha256:<64 hex>`` is ever pulled (``POST /images/create?fromImage=REPO&tag=sha256:...``);
  a reference without a digest is refused (``image-unpinned``), and so is one the policy does not allow
  (``policy-image``: the caller hands in the policy's own check, re-asked here before anything moves).
- After the pull, the local image's ``RepoDigests`` must hold exactly ``repository@digest``
  (``image-digest-mismatch`` otherwise): what a container is then created from is what was pinned.
- Registry credentials come only from the file the policy names (``images.registry_auth_file``: docker's
  ``config.json`` ``auths`` form), which must be a regular file owned by root with no group or other
  permission bits, and not a symlink (``registry-auth`` otherwise). They go to the Docker Engine in the
  ``X-Registry-Auth`` header and nowhere else: no message, result or summary here carries them.
- A pull whose progress does not move for ``stall_s`` seconds is abandoned (the connection closed, which makes
  the engine cancel it) and reported as ``image-pull-stalled`` with the bytes done. "Moves" means any new
  progress message from the engine: a layer's bytes, or a layer's status (verifying, extracting, complete).
- A pull that would leave less than ``min_free_bytes`` free under Docker's data-root (``GET /info``
  ``DockerRootDir``, measured with ``statvfs``) is refused before it starts (``disk-low``, both figures).
  The image's size counts when known; the Engine API does not say it before the pull (its distribution
  inspect gives the manifest's descriptor, not the layers' total), so today the floor is held against the
  free space as it is.

``ImagePuller.forecast`` is check mode's view: the same refusals, and the registry asked (through the engine's
``GET /distribution/NAME/json``) whether it has that digest, nothing pulled.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApiError, PullStream

__all__ = [
    "ImagePullError",
    "ImagePuller",
    "PullForecast",
    "PullLimits",
    "PullProgress",
    "PullSummary",
    "disk_problem",
    "read_registry_auth",
    "registry_auth_header",
    "registry_of",
    "split_pinned",
]

_PINNED = re.compile(r"^(?P<repository>[^@]+)@(?P<digest>sha256:[0-9a-f]{64})$")
# How long one read waits before the stall clock is looked at again: short enough that a stall is seen
# within about a second of its bound, long enough that an idle wait costs no CPU to speak of.
_READ_SLICE_S = 1.0
# One progress message is a few hundred bytes; a line longer than this is not one.
_MAX_MESSAGE_BYTES = 1024 * 1024
_MAX_AUTH_FILE_BYTES = 1024 * 1024
_DOCKER_HUB = "docker.io"
_HUB_ALIASES = ("index.docker.io", "registry-1.docker.io", "registry.hub.docker.com")


class ImagePullError(MeridianError):
    """An image could not be pulled, or was refused before pulling; ``check`` names why, ``summary`` what was
    done (bytes and seconds) for the module's result."""

    def __init__(self, message: str, *, check: str, image: str, bytes_done: int = 0, seconds: float = 0.0) -> None:
        super().__init__(message)
        self.check = check
        self.image = image
        self.bytes_done = bytes_done
        self.seconds = seconds

    @property
    def summary(self) -> dict[str, Any]:
        return {"image": self.image, "pulled": False, "bytes": self.bytes_done, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class PullLimits:
    """The policy's bounds on a pull (``trust.policy.ImagesPolicy``)."""

    stall_s: float = 120
    min_free_bytes: int = 0
    auth_file: str | None = None


@dataclass(frozen=True)
class PullSummary:
    """A pull done: what the module's result says per engine (``ansible-playbook -v`` shows it)."""

    image: str
    bytes: int
    seconds: float

    def as_result(self) -> dict[str, Any]:
        return {"image": self.image, "pulled": True, "bytes": self.bytes, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class PullForecast:
    """The pull a real run would make (check mode): the registry has the digest; sizes as far as known."""

    image: str
    registry: str
    manifest_bytes: int | None
    free_bytes: int | None

    def as_result(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "pulled": False,
            "would_pull": True,
            "registry": self.registry,
            "size_bytes": None,
            "size_note": (
                "the registry has this digest; the Engine API names its manifest "
                f"({self.manifest_bytes if self.manifest_bytes is not None else 'unknown'} bytes), "
                "not the layers' total, before a pull"
            ),
            "free_bytes": self.free_bytes,
        }


class _PullApi(Protocol):
    """The calls of ``docker.api.DockerApi`` a pull makes (tests hand in a stand-in for the stall clock)."""

    def info(self) -> dict[str, Any]:
        """``GET /info``: the engine's data-root (``DockerRootDir``)."""

    def inspect_image(self, reference: str) -> dict[str, Any]:
        """``GET /images/NAME/json``."""

    def distribution(self, reference: str, registry_auth: str | None = None) -> dict[str, Any]:
        """``GET /distribution/NAME/json``: the registry's descriptor, nothing pulled."""

    def open_pull(
        self, repository: str, digest: str, registry_auth: str | None = None, *, wait_s: float | None = None
    ) -> PullStream:
        """``POST /images/create`` for ``repository@digest``: the progress stream, read by the caller."""


def split_pinned(reference: str) -> tuple[str, str]:
    """``(repository, digest)`` of ``repository[:tag]@sha256:<64 hex>``; a tag is dropped (a digest is what is
    pulled). Anything without a digest raises ``ImagePullError`` (check ``image-unpinned``)."""
    match = _PINNED.match(reference)
    if match is None:
        raise ImagePullError(
            f"image {reference!r} is not pinned by digest; meridian.node pulls only repository@sha256:<64 hex>, "
            "never a tag: pin the image's registry digest",
            check="image-unpinned",
            image=reference,
        )
    repository = match.group("repository")
    last = repository.rsplit("/", 1)[-1]
    if ":" in last:  # a tag beside the digest: the digest decides
        repository = repository[: len(repository) - len(last)] + last.split(":", 1)[0]
    return repository, match.group("digest")


def registry_of(repository: str) -> str:
    """The registry host a repository lives on, by Docker's rule: the first component when it has a dot or a
    port or is ``localhost``, else Docker Hub."""
    first, slash, _rest = repository.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return _DOCKER_HUB if first in _HUB_ALIASES else first
    return _DOCKER_HUB


def _familiar(repository: str) -> str:
    """The name Docker shows in ``RepoDigests`` for ``repository`` (Docker Hub's prefixes dropped)."""
    for prefix in (f"{_DOCKER_HUB}/library/", f"{_DOCKER_HUB}/"):
        if repository.startswith(prefix):
            return repository[len(prefix) :]
    return repository


def _auth_key(key: str) -> str:
    """A config.json ``auths`` key as a registry host: scheme and path dropped (``https://index.docker.io/v1/``
    is Docker Hub)."""
    host = re.sub(r"^[a-z]+://", "", key.strip()).split("/", 1)[0]
    return _DOCKER_HUB if host in _HUB_ALIASES else host


def _require_root_private(path: str) -> Callable[[os.stat_result], None]:
    def check(info: os.stat_result) -> None:
        if info.st_uid != 0 or stat.S_IMODE(info.st_mode) & 0o077:
            raise ImagePullError(
                f"registry credentials file {path} is owned by uid {info.st_uid} with mode "
                f"{stat.S_IMODE(info.st_mode):04o}; it must be owned by root with mode 0600 (chown root:root "
                f"{path}; chmod 0600 {path}), so no other user can read or swap it",
                check="registry-auth",
                image="",
            )

    return check


def read_registry_auth(path: str) -> dict[str, dict[str, str]]:
    """The credentials per registry host in ``path`` (docker's ``{"auths": {HOST: {"auth": base64(user:pass)}}}``,
    or ``username``/``password`` in place of ``auth``). The file must be root's, 0600, not a symlink; every
    problem raises ``ImagePullError`` (check ``registry-auth``) naming the file, never a value from it."""
    try:
        data = read_capped(
            path, _MAX_AUTH_FILE_BYTES, what="registry credentials file", check=_require_root_private(path)
        )
    except CappedReadError as exc:
        raise ImagePullError(f"{exc}; fix images.registry_auth_file", check="registry-auth", image="") from exc
    try:
        document = json.loads(data)
    except ValueError:
        raise ImagePullError(
            f"registry credentials file {path} is not JSON; write it as docker's config.json: "
            '{"auths": {"registry.example:443": {"auth": "<base64 of user:password>"}}}',
            check="registry-auth",
            image="",
        ) from None
    auths = document.get("auths") if isinstance(document, dict) else None
    if not isinstance(auths, dict):
        raise ImagePullError(
            f"registry credentials file {path} has no 'auths' mapping; write it as docker's config.json",
            check="registry-auth",
            image="",
        )
    found: dict[str, dict[str, str]] = {}
    for key, entry in auths.items():
        where = f"registry credentials file {path}, entry {str(key)[:80]!r}"
        if not isinstance(entry, dict):
            raise ImagePullError(f"{where} is not a mapping", check="registry-auth", image="")
        user, password = entry.get("username"), entry.get("password")
        if isinstance(entry.get("auth"), str):
            try:
                user, colon, password = base64.b64decode(entry["auth"], validate=True).decode("utf-8").partition(":")
            except (ValueError, UnicodeDecodeError):
                colon = ""
            if not colon:
                raise ImagePullError(
                    f"{where}: 'auth' is not base64 of user:password", check="registry-auth", image=""
                ) from None
        if not isinstance(user, str) or not isinstance(password, str) or not user:
            raise ImagePullError(
                f"{where} names no credentials: give 'auth' (base64 of user:password) or 'username' and 'password'",
                check="registry-auth",
                image="",
            )
        found[_auth_key(str(key))] = {"username": user, "password": password}
    return found


def registry_auth_header(credentials: Mapping[str, str], registry: str) -> str:
    """The ``X-Registry-Auth`` value the Engine API takes: base64url of the credentials as JSON."""
    server = "https://index.docker.io/v1/" if registry == _DOCKER_HUB else registry
    document = {"username": credentials["username"], "password": credentials["password"], "serveraddress": server}
    return base64.urlsafe_b64encode(json.dumps(document).encode("utf-8")).decode("ascii")


def disk_problem(*, reference: str, data_root: str, free_bytes: int, floor: int, size: int | None) -> str | None:
    """None when pulling ``reference`` (``size`` bytes, when known) leaves at least ``floor`` bytes free, else
    why not with both figures. Pure arithmetic."""
    left = free_bytes - (size or 0)
    if floor <= 0 or left >= floor:
        return None
    needs = f" and the image needs {size} bytes" if size else ""
    return (
        f"pulling image {reference!r} would leave {max(left, 0)} bytes free under Docker's data-root {data_root} "
        f"({free_bytes} bytes free now{needs}), below the policy's floor images.min_free_bytes {floor} bytes; "
        "free some space (docker image prune, old models) or lower the floor"
    )


class PullProgress:
    """The engine's progress messages (one JSON object a line), read as they arrive: the bytes downloaded over
    all layers, whether anything moved, and the engine's error if it sent one."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._last: dict[str, tuple[Any, Any]] = {}  # layer -> (status, current): what moved means
        self._downloaded: dict[str, int] = {}
        self._totals: dict[str, int] = {}
        self.error: str | None = None

    @property
    def bytes_done(self) -> int:
        return sum(self._downloaded.values())

    @property
    def bytes_total(self) -> int | None:
        """The bytes to download over all layers, once every layer the engine named has said its size (a layer
        the host already has counts nothing); None before that."""
        if any(layer not in self._totals and state[0] != "Already exists" for layer, state in self._last.items()):
            return None
        return sum(self._totals.values())

    def feed(self, data: bytes) -> bool:
        """Take the bytes that arrived; True when they carried a message that moved the pull on."""
        self._pending += data
        moved = False
        while True:
            end = self._pending.find(b"\n")
            if end < 0:
                if len(self._pending) > _MAX_MESSAGE_BYTES:
                    raise ValueError(f"the engine sent a progress line longer than {_MAX_MESSAGE_BYTES} bytes")
                return moved
            line = bytes(self._pending[:end]).strip()
            del self._pending[: end + 1]
            if line:
                moved = self._take(json.loads(line)) or moved

    def _take(self, message: Any) -> bool:
        if not isinstance(message, dict):
            raise ValueError(f"the engine sent a progress line that is not an object: {str(message)[:80]!r}")
        if message.get("error") or message.get("errorDetail"):
            detail = message.get("errorDetail") or {}
            self.error = str((detail.get("message") if isinstance(detail, dict) else None) or message.get("error"))
            return True
        layer, status = message.get("id"), message.get("status")
        detail = message.get("progressDetail") or {}
        current = detail.get("current") if isinstance(detail, dict) else None
        total = detail.get("total") if isinstance(detail, dict) else None
        if not isinstance(layer, str):
            return True  # a line about the whole pull ("Digest: ...", "Status: Downloaded newer image ...")
        if status == "Downloading" and isinstance(current, int):
            self._downloaded[layer] = max(self._downloaded.get(layer, 0), current)
            if isinstance(total, int) and total > 0:
                self._totals[layer] = total
        elif status == "Download complete" and layer in self._totals:
            self._downloaded[layer] = self._totals[layer]
        state = (status, current)
        moved = self._last.get(layer) != state
        self._last[layer] = state
        return moved


def _free_bytes(path: str) -> int:
    found = os.statvfs(path)
    return int(found.f_bavail) * int(found.f_frsize)


class ImagePuller:
    """Pulls pinned images into one Docker Engine under the policy's limits (see the module docstring).

    ``allowed`` is the policy's image check (``trust.policy.Policy.image_allowed``): None or the reason not.
    ``clock`` and ``free_bytes`` are injected so the stall bound and the disk floor are tested without waiting
    or filling a disk.
    """

    def __init__(
        self,
        api: _PullApi,
        limits: PullLimits,
        *,
        allowed: Callable[[str], str | None],
        clock: Callable[[], float] = time.monotonic,
        free_bytes: Callable[[str], int] = _free_bytes,
    ) -> None:
        self._api = api
        self._limits = limits
        self._allowed = allowed
        self._clock = clock
        self._free_bytes = free_bytes
        self._credentials: dict[str, dict[str, str]] | None = None

    def forecast(self, reference: str) -> PullForecast:
        """Check mode: every refusal a pull would meet before it starts, and the registry asked whether it has
        the digest (``image-pull`` if not). Nothing is pulled."""
        repository, digest = self._admit(reference)
        auth = self._auth_header(repository)
        free = self._check_disk(reference)
        try:
            found = self._api.distribution(f"{repository}@{digest}", auth)
        except DockerApiError as exc:
            raise ImagePullError(
                f"image {reference!r} cannot be pulled: the registry {registry_of(repository)} answered: {exc.reason}",
                check="image-pull",
                image=reference,
            ) from exc
        descriptor = found.get("Descriptor") or {}
        if descriptor.get("digest") != digest:
            raise ImagePullError(
                f"image {reference!r}: the registry answered for digest {descriptor.get('digest')!r}, not {digest}",
                check="image-digest-mismatch",
                image=reference,
            )
        size = descriptor.get("size")
        return PullForecast(
            image=reference,
            registry=registry_of(repository),
            manifest_bytes=size if isinstance(size, int) and not isinstance(size, bool) else None,
            free_bytes=free,
        )

    def pull(self, reference: str, on_progress: Callable[[int, int | None], None] | None = None) -> PullSummary:
        """Pull ``reference`` by its digest, within the stall bound, and check the image Docker then holds.

        ``on_progress`` is told the bytes downloaded so far (and the total, once known) after each read of the
        engine's stream, at least every ``_READ_SLICE_S`` seconds, whether the pull moved or not."""
        repository, digest = self._admit(reference)
        auth = self._auth_header(repository)
        self._check_disk(reference)
        started = self._clock()
        progress = PullProgress()

        def failed(message: str, check: str) -> ImagePullError:
            return ImagePullError(
                message, check=check, image=reference, bytes_done=progress.bytes_done, seconds=self._clock() - started
            )

        try:
            # The engine answers once the registry gave it the manifest: a registry that hangs before that is a
            # stall as much as one that hangs mid-layer.
            stream = self._api.open_pull(repository, digest, auth, wait_s=self._limits.stall_s)
        except DockerApiError as exc:
            if isinstance(exc.__cause__, (TimeoutError, socket.timeout)):
                raise failed(self._stalled_text(reference, repository, 0), "image-pull-stalled") from exc
            raise failed(f"the Docker Engine could not pull image {reference!r}: {exc.reason}", "image-pull") from exc
        try:
            last_moved = started
            while True:
                left = self._limits.stall_s - (self._clock() - last_moved)
                if left <= 0:
                    raise failed(self._stalled_text(reference, repository, progress.bytes_done), "image-pull-stalled")
                data = stream.read(min(left, _READ_SLICE_S))
                if data == b"":
                    break
                if data is not None and progress.feed(data):
                    last_moved = self._clock()
                if on_progress is not None:
                    # Each slice, moved or not: a paced reporter writes what it held back once its interval is up.
                    on_progress(progress.bytes_done, progress.bytes_total)
        except DockerApiError as exc:
            raise failed(f"pulling image {reference!r} failed: {exc.reason}", "image-pull") from exc
        except ValueError as exc:  # the engine's progress stream was not what the Engine API documents
            raise failed(f"pulling image {reference!r}: {exc}", "image-pull") from exc
        finally:
            stream.close()
        if progress.error is not None:
            raise failed(
                f"the Docker Engine could not pull image {reference!r}: {progress.error}; check that the registry "
                "has this digest and that images.registry_auth_file holds credentials for it",
                "image-pull",
            )
        self._verify(reference, repository, digest, failed)
        return PullSummary(image=reference, bytes=progress.bytes_done, seconds=self._clock() - started)

    def _stalled_text(self, reference: str, repository: str, bytes_done: int) -> str:
        return (
            f"pulling image {reference!r} made no progress for {self._limits.stall_s:g}s "
            f"(images.pull_stall_seconds) after {bytes_done} bytes; it was cancelled. Check the registry "
            f"{registry_of(repository)} and the network, then run again"
        )

    def _admit(self, reference: str) -> tuple[str, str]:
        repository, digest = split_pinned(reference)
        refusal = self._allowed(reference)
        if refusal is not None:
            raise ImagePullError(f"not pulling: {refusal}", check="policy-image", image=reference)
        return repository, digest

    def _auth_header(self, repository: str) -> str | None:
        if self._limits.auth_file is None:
            return None
        if self._credentials is None:
            self._credentials = read_registry_auth(self._limits.auth_file)
        registry = registry_of(repository)
        credentials = self._credentials.get(registry)
        return None if credentials is None else registry_auth_header(credentials, registry)

    def _check_disk(self, reference: str) -> int | None:
        """The free bytes under Docker's data-root (None when no floor is set: not even looked at)."""
        floor = self._limits.min_free_bytes
        if floor <= 0:
            return None
        try:
            data_root = str(self._api.info().get("DockerRootDir") or "")
        except DockerApiError as exc:
            raise ImagePullError(
                f"reading Docker's data-root for the disk floor: {exc.reason}", check="docker", image=reference
            ) from exc
        try:
            free = self._free_bytes(data_root)
        except OSError as exc:
            raise ImagePullError(
                f"the free space under Docker's data-root {data_root!r} cannot be read on this host "
                f"({exc.strerror or exc}); the disk floor images.min_free_bytes needs the engine's disk here, or "
                "set it to 0",
                check="disk-low",
                image=reference,
            ) from exc
        problem = disk_problem(reference=reference, data_root=data_root, free_bytes=free, floor=floor, size=None)
        if problem is not None:
            raise ImagePullError(problem, check="disk-low", image=reference)
        return free

    def _verify(
        self, reference: str, repository: str, digest: str, failed: Callable[[str, str], ImagePullError]
    ) -> None:
        pinned = f"{repository}@{digest}"
        try:
            attrs = self._api.inspect_image(pinned)
        except DockerApiError as exc:
            raise failed(
                f"image {reference!r} is not in Docker after its pull: {exc.reason}", "image-digest-mismatch"
            ) from exc
        digests = {str(entry) for entry in attrs.get("RepoDigests") or ()}
        if f"{_familiar(repository)}@{digest}" not in digests and pinned not in digests:
            raise failed(
                f"image {reference!r}: after the pull the local image's registry digests are {sorted(digests)}, "
                f"not {pinned}; nothing was created from it",
                "image-digest-mismatch",
            )

"""Stand-in engine images, built here because no registry can be reached from these machines.

Two layers:

* a **base image**: a minimal Debian rootfs with python3 (``debootstrap --variant=minbase``), trimmed and
  ``docker import``-ed with a ``CMD``/``ENV``. Building it takes a minute or more, so it is done once per
  machine: the rootfs tarball is cached under ``$MERIDIAN_NODE_CACHE`` (default
  ``~/.cache/meridian-node``) and the image is tagged with a hash of the recipe, so a changed recipe
  builds a new one and an unchanged one is reused, even by a CI run that starts with an empty engine but
  a warm cache.
* an **engine image** per server program: ``FROM`` the base, ``COPY`` of the server file, tagged by a
  hash of the base image id and the server's bytes (a second build of the same bytes is a cache hit).

Images made here have no registry digest (``RepoDigests`` is empty). ``LocalImage.pinned`` is the form a
policy check can still pin: ``repository@<image id>``; see ``docker.engine.DockerEngine.resolve_image``.

Typical use (the lead registers the fixture in ``tests/conftest.py``)::

    def test_x(docker_client, standin_base_image):
        image = ensure_engine_image(docker_client, standin_base_image, Path("tests/support/standin_server.py"))
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "BASE_REPOSITORY",
    "ENGINE_REPOSITORY",
    "SERVER_PATH_IN_IMAGE",
    "BaseRecipe",
    "LocalImage",
    "StandinImageError",
    "apt_mirror",
    "build_rootfs_tarball",
    "cache_dir",
    "default_recipe",
    "ensure_base_image",
    "ensure_engine_image",
    "standin_base_image",
]

BASE_REPOSITORY = "meridian-node/standin-base"
ENGINE_REPOSITORY = "meridian-node/standin"
SERVER_PATH_IN_IMAGE = "/standin/standin_server.py"
# Bump when the build steps change in a way the recipe fields do not show.
_RECIPE_FORMAT = 1
_DEBOOTSTRAP_TIMEOUT_S = 1800


class StandinImageError(RuntimeError):
    """The stand-in image could not be built; the message says which step failed and how to fix it."""


@dataclass(frozen=True)
class BaseRecipe:
    """Everything that decides the base image's content; its hash is the image tag."""

    mirror: str
    suite: str = "bookworm"
    variant: str = "minbase"
    include: tuple[str, ...] = ("python3",)
    # Paths (relative to the rootfs) deleted before packing: caches, docs and locales are ~50% of the size.
    prune: tuple[str, ...] = (
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "usr/share/doc",
        "usr/share/locale",
        "usr/share/man",
        "usr/share/info",
    )
    changes: tuple[str, ...] = (
        "ENV LANG=C.UTF-8",
        "ENV PYTHONUNBUFFERED=1",
        "ENV PYTHONDONTWRITEBYTECODE=1",
        "WORKDIR /standin",
        f'CMD ["python3", "{SERVER_PATH_IN_IMAGE}"]',
    )
    format: int = field(default=_RECIPE_FORMAT)

    def digest(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def tag(self) -> str:
        return f"{BASE_REPOSITORY}:{self.digest()[:16]}"


@dataclass(frozen=True)
class LocalImage:
    """An image in the local engine: its tag and its content-addressed id (``sha256:<64 hex>``)."""

    tag: str
    id: str

    @property
    def repository(self) -> str:
        return self.tag.rsplit(":", 1)[0]

    @property
    def pinned(self) -> str:
        """``repository@sha256:<image id>``: the digest-pinned reference for a locally built image."""
        return f"{self.repository}@{self.id}"


def cache_dir() -> Path:
    """Where rootfs tarballs are kept between runs: ``$MERIDIAN_NODE_CACHE`` or ``~/.cache/meridian-node``."""
    configured = os.environ.get("MERIDIAN_NODE_CACHE")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "meridian-node"


def apt_mirror(apt_dir: Path = Path("/etc/apt"), suite: str = "bookworm") -> str:
    """The Debian mirror this machine's apt already uses for ``suite`` (``$MERIDIAN_STANDIN_MIRROR`` wins).

    Reads deb822 ``sources.list.d/*.sources`` first, then one-line ``sources.list`` entries; security and
    updates suites are skipped because debootstrap wants the main archive.
    """
    configured = os.environ.get("MERIDIAN_STANDIN_MIRROR")
    if configured:
        return configured
    for source in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", source.read_text(encoding="utf-8")):
            fields = _deb822_fields(stanza)
            if "deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split():
                uris = fields.get("uris", "").split()
                if uris:
                    return uris[0]
    one_line_files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]
    for listing in one_line_files:
        if not listing.is_file():
            continue
        for line in listing.read_text(encoding="utf-8").splitlines():
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                return words[1]
    raise StandinImageError(
        f"no apt source for Debian {suite!r} found under {apt_dir} (sources.list.d/*.sources or sources.list); "
        "set MERIDIAN_STANDIN_MIRROR to a Debian mirror URL, e.g. http://deb.debian.org/debian"
    )


def _deb822_fields(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip() or line[0].isspace():
            continue
        key, _, value = line.partition(":")
        fields[key.strip().lower()] = value.strip()
    return fields


def default_recipe() -> BaseRecipe:
    return BaseRecipe(mirror=apt_mirror())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per machine: parallel sessions wait here instead of bootstrapping twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_rootfs_tarball(recipe: BaseRecipe, destination: Path, *, script: str | None = None) -> None:
    """debootstrap the recipe's rootfs, prune it and pack it into ``destination`` (written atomically).

    ``script`` names the debootstrap script to use when this debootstrap has none for ``recipe.suite`` (a
    Debian release newer than it, such as bookworm's debootstrap and forky: its ``sid`` script works).
    It does not enter the recipe's hash: the suite already decides the content.
    """
    if os.geteuid() != 0:
        raise StandinImageError(
            f"building the stand-in base rootfs needs root (debootstrap); run the tests as root once to "
            f"fill the cache at {destination.parent}, or copy a prebuilt {destination.name} there"
        )
    if shutil.which("debootstrap") is None:
        raise StandinImageError("debootstrap is not installed; install it with: apt-get install -y debootstrap")
    destination.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-build-", dir=destination.parent))
    rootfs = work / "rootfs"
    log = destination.with_suffix(".debootstrap.log")
    try:
        command = [
            "debootstrap",
            f"--variant={recipe.variant}",
            f"--include={','.join(recipe.include)}",
            recipe.suite,
            str(rootfs),
            recipe.mirror,
            *([script] if script is not None else []),
        ]
        with log.open("wb") as output:
            result = subprocess.run(
                command, stdout=output, stderr=subprocess.STDOUT, timeout=_DEBOOTSTRAP_TIMEOUT_S, check=False
            )
        if result.returncode != 0:
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            raise StandinImageError(
                f"debootstrap of {recipe.suite} from {recipe.mirror} failed with exit code {result.returncode} "
                f"(full log: {log}):\n" + "\n".join(tail)
            )
        for relative in recipe.prune:
            target = rootfs / relative
            if target.is_dir():
                # Keep the directory itself: apt and dpkg expect these paths to exist.
                for child in target.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
        partial = work / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], check=True)
        os.replace(partial, destination)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _find_image(client: Any, reference: str) -> LocalImage | None:
    import docker.errors

    try:
        image = client.images.get(reference)
    except docker.errors.ImageNotFound:
        return None
    return LocalImage(tag=reference, id=image.id)


def ensure_base_image(client: Any, recipe: BaseRecipe | None = None, cache: Path | None = None) -> LocalImage:
    """The base image for ``recipe``: reused when tagged already, else imported from the cached tarball,
    else bootstrapped (slow: a minute or more, network to the mirror needed) and cached."""
    recipe = recipe or default_recipe()
    cache = cache or cache_dir()
    found = _find_image(client, recipe.tag)
    if found is not None:
        return found
    tarball = cache / f"standin-base-{recipe.digest()[:16]}.tar"
    with _locked(cache / "standin-base.lock"):
        found = _find_image(client, recipe.tag)  # another session may have finished while we waited
        if found is not None:
            return found
        if not tarball.is_file():
            build_rootfs_tarball(recipe, tarball)
        repository, tag = recipe.tag.rsplit(":", 1)
        client.api.import_image_from_file(str(tarball), repository=repository, tag=tag, changes=list(recipe.changes))
    found = _find_image(client, recipe.tag)
    if found is None:
        raise StandinImageError(f"docker import of {tarball} reported success but {recipe.tag} is not in the engine")
    return found


def ensure_engine_image(client: Any, base: LocalImage, server: Path, engine: str | None = None) -> LocalImage:
    """``base`` plus ``server`` copied to ``SERVER_PATH_IN_IMAGE``; rebuilt only when an input changes.

    With ``engine`` (a driver name) the image stands in for that engine's image: ``STANDIN_ENGINE`` is
    baked in and the server is the ENTRYPOINT, so the command line a driver builds arrives as arguments,
    exactly as it would for the real engine.
    """
    content = server.read_bytes()
    digest = hashlib.sha256(base.id.encode() + b"\0" + content + b"\0" + (engine or "").encode()).hexdigest()
    tag = f"{ENGINE_REPOSITORY}:{digest[:16]}"
    found = _find_image(client, tag)
    if found is not None:
        return found
    # One builder per tag: two builds of the same bytes make two image ids (their creation times differ), and
    # the tag moves to the later one, leaving the first caller pinned to an id that lost its repository.
    with _locked(cache_dir() / "standin-engine.lock"):
        found = _find_image(client, tag)  # another worker or session may have built it while we waited
        if found is not None:
            return found
        return _build_engine_image(client, base, content, engine, tag)


def _build_engine_image(client: Any, base: LocalImage, content: bytes, engine: str | None, tag: str) -> LocalImage:
    # FROM by image id: the tag could be moved by another session, the id cannot.
    lines = [f"FROM {base.id}", f"COPY standin_server.py {SERVER_PATH_IN_IMAGE}"]
    if engine is not None:
        lines += [f"ENV STANDIN_ENGINE={engine}", f'ENTRYPOINT ["python3", "{SERVER_PATH_IN_IMAGE}"]', "CMD []"]
    dockerfile = ("\n".join(lines) + "\n").encode()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as archive:
        for name, data in (("Dockerfile", dockerfile), ("standin_server.py", content)):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            member.mode = 0o644
            archive.addfile(member, io.BytesIO(data))
    context.seek(0)
    image, _logs = client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    return LocalImage(tag=tag, id=image.id)


@pytest.fixture(scope="session")
def standin_base_image(docker_client: Any) -> LocalImage:
    """The cached stand-in base image (Debian minbase + python3) in the real engine."""
    return ensure_base_image(docker_client)

"""A real inference engine for tests: Debian's ``llama.cpp-tools`` (``/usr/bin/llama-server``, CPU backend) in
an image built here, because no registry can be reached from these machines.

The image is made with the stand-in builder (``standin_image.build_rootfs_tarball``: ``debootstrap
--variant=minbase``, pruned, ``docker import``) from the Debian mirror this machine's apt already uses, with
``--include=llama.cpp-tools`` and nothing else. The package is in **forky** (testing) and **sid** only: it
needs a newer libc than trixie's. Bookworm's debootstrap has no forky script, so forky is bootstrapped with
its ``sid`` script. forky is tried first: packages reach it days after sid, so a pinned version lives longer.

Two cached images, each tagged by the recipe's hash (suite, mirror, package, pinned version):

* ``meridian-node/llamacpp-rootfs:SUITE-HASH``: the imported rootfs, ``ENTRYPOINT ["/usr/bin/llama-server"]``;
  its tarball is kept under ``cache_dir()`` (about 125 MB), so an empty Docker Engine with a warm cache only
  re-imports it (seconds) instead of bootstrapping (about a minute, mirror needed);
* ``meridian-node/llamacpp:HASH`` (``ensure_llamacpp_image``): the same with two labels read from the built
  image itself, ``LABEL_SERVER_VERSION`` (what ``llama-server --version`` prints) and ``LABEL_PACKAGE``
  (the installed package version, checked equal to ``PINNED_VERSION``).

**The pin.** debootstrap installs whatever version the suite's index carries, so the builder reads the
mirror's ``Packages`` index first and builds only from a suite that carries ``PINNED_VERSION``. When sid and
forky have both moved on (Debian replaces versions; the old one disappears from the index), a machine with
the image or the rootfs tarball cached keeps working, and a cold build fails with ``LlamaCppImageError``
naming the versions the mirror carries now. To move the pin: set ``PINNED_VERSION`` to one of them, run
``tests/system/e2e/test_real_engine.py`` (it prints the new ``llama-server --version``) and re-check the
driver's facts in docs/ENGINE_DRIVERS.md ("llamacpp") against the new build, the SIGTERM measurement first.

Only an unreachable mirror (no index for either suite) is a reason to skip the tests that need the image
(``LlamaCppUnavailable``); with ``MERIDIAN_REQUIRE_DOCKER=1`` (CI) it fails them instead.

Images made here have no registry digest: ``LocalImage.pinned`` (``repository@<image id>``) is the form the
image policy pins. The repository name holds ``llama`` so that engine discovery guesses the driver.
"""

from __future__ import annotations

import contextlib
import io
import lzma
import os
import platform
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.standin_image import (
    BaseRecipe,
    LocalImage,
    StandinImageError,
    _locked,
    apt_mirror,
    build_rootfs_tarball,
    cache_dir,
)

__all__ = [
    "LABEL_PACKAGE",
    "LABEL_SERVER_VERSION",
    "LLAMACPP_REPOSITORY",
    "PACKAGE",
    "PINNED_VERSION",
    "ROOTFS_REPOSITORY",
    "SERVER",
    "SUITES",
    "LlamaCppImage",
    "LlamaCppImageError",
    "LlamaCppUnavailable",
    "choose_suite",
    "ensure_llamacpp_image",
    "index_version",
    "llamacpp_image",
    "llamacpp_recipe",
    "report",
]

LLAMACPP_REPOSITORY = "meridian-node/llamacpp"
ROOTFS_REPOSITORY = "meridian-node/llamacpp-rootfs"
PACKAGE = "llama.cpp-tools"
# The version the driver's facts were measured on (docs/ENGINE_DRIVERS.md, "llamacpp"); see "The pin" above.
PINNED_VERSION = "1:0.7.0+dfsg-2"
SERVER = "/usr/bin/llama-server"
# Preferred first; each with the debootstrap script that bootstraps it (bookworm's has none named forky).
SUITES: Mapping[str, str] = {"forky": "sid", "sid": "sid"}
LABEL_SERVER_VERSION = "meridian-node.test/llama-server-version"
LABEL_PACKAGE = "meridian-node.test/llama-cpp-tools"
_INDEX_TIMEOUT_S = 60
# Bump when the build steps change in a way the recipe fields do not show.
_FORMAT = 1


class LlamaCppImageError(StandinImageError):
    """The llama.cpp image could not be built; the message says which step failed and what to change."""


class LlamaCppUnavailable(LlamaCppImageError):
    """No Debian suite that carries llama.cpp could be reached: the one reason tests may skip."""


@dataclass(frozen=True)
class LlamaCppImage:
    """The engine image, what it runs, and how it came to be here (for the tests' output)."""

    image: LocalImage
    server_version: str
    package_version: str
    suite: str
    how: str
    seconds: float

    def describe(self) -> str:
        return (
            f"llama.cpp engine image {self.image.tag} ({self.image.id[:19]}), {PACKAGE} {self.package_version} "
            f"from {self.suite}, llama-server --version: {self.server_version!r}; {self.how} in {self.seconds:.1f} s"
        )


def llamacpp_recipe(suite: str, mirror: str) -> BaseRecipe:
    """What decides the rootfs for ``suite``; the pinned version is in it (as a label), so a new pin is a new
    tag and a new tarball."""
    return BaseRecipe(
        mirror=mirror,
        suite=suite,
        include=(PACKAGE,),
        changes=(
            "ENV LANG=C.UTF-8",
            f"LABEL {LABEL_PACKAGE}={PINNED_VERSION}",
            f'ENTRYPOINT ["{SERVER}"]',
            "CMD []",
        ),
        format=_FORMAT,
    )


def _mirror() -> str:
    # Any Debian archive serves every suite: the sources here name bookworm, and the same URL carries sid.
    for suite in (*SUITES, "trixie", "bookworm", "bullseye"):
        with contextlib.suppress(StandinImageError):
            return apt_mirror(suite=suite)
    return apt_mirror(suite="sid")  # raises, with the advice to set MERIDIAN_STANDIN_MIRROR


def _architecture() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def index_version(mirror: str, suite: str, package: str = PACKAGE) -> str | None:
    """The version of ``package`` in the mirror's ``main`` index for ``suite`` (None: not there).

    Raises ``LlamaCppUnavailable`` when the index cannot be fetched, naming the URL.
    """
    url = f"{mirror.rstrip('/')}/dists/{suite}/main/binary-{_architecture()}/Packages.xz"
    try:
        with urllib.request.urlopen(url, timeout=_INDEX_TIMEOUT_S) as answer:
            compressed = answer.read()
        text = lzma.decompress(compressed).decode("utf-8", errors="replace")
    except (OSError, lzma.LZMAError, urllib.error.URLError) as exc:
        raise LlamaCppUnavailable(f"cannot read the package index {url}: {exc}") from exc
    wanted = f"Package: {package}\n"
    for stanza in text.split("\n\n"):
        if stanza.startswith(wanted) or f"\n{wanted}" in stanza:
            for line in stanza.splitlines():
                if line.startswith("Version: "):
                    return line.removeprefix("Version: ").strip()
    return None


def choose_suite(carried: Mapping[str, str | Exception | None], pinned: str = PINNED_VERSION) -> str:
    """The first suite (in ``carried``'s order) whose index carries ``pinned``.

    ``carried`` maps each suite to the version its index carries, None when it has no such package, or the
    error met reading the index. Raises ``LlamaCppUnavailable`` when no index could be read at all, and
    ``LlamaCppImageError`` saying what each suite carries now when none carries the pin.
    """
    for suite, version in carried.items():
        if version == pinned:
            return suite
    if carried and all(isinstance(version, Exception) for version in carried.values()):
        reasons = "; ".join(f"{suite}: {version}" for suite, version in carried.items())
        raise LlamaCppUnavailable(f"no Debian suite that carries {PACKAGE} could be reached ({reasons})")
    now = ", ".join(
        f"{suite} {'unreachable' if isinstance(v, Exception) else (v or 'has no ' + PACKAGE)}"
        for suite, v in carried.items()
    )
    raise LlamaCppImageError(
        f"the pinned {PACKAGE} {pinned} is gone from the mirror ({now}); no cached image or rootfs holds it "
        f"either. Set PINNED_VERSION in tests/support/llamacpp_image.py to a version the mirror carries, run "
        f"tests/system/e2e/test_real_engine.py and re-check the llamacpp facts in docs/ENGINE_DRIVERS.md"
    )


def _find(client: Any, reference: str) -> Any | None:
    import docker.errors

    try:
        return client.images.get(reference)
    except docker.errors.ImageNotFound:
        return None


def _final_tag(recipe: BaseRecipe) -> str:
    return f"{LLAMACPP_REPOSITORY}:{recipe.digest()[:16]}"


def _rootfs_tag(recipe: BaseRecipe) -> str:
    return f"{ROOTFS_REPOSITORY}:{recipe.suite}-{recipe.digest()[:16]}"


def _tarball(cache: Path, recipe: BaseRecipe) -> Path:
    return cache / f"llamacpp-rootfs-{recipe.suite}-{recipe.digest()[:16]}.tar"


def _described(client: Any, recipe: BaseRecipe, how: str, started: float) -> LlamaCppImage:
    tag = _final_tag(recipe)
    image = client.images.get(tag)
    labels = image.labels or {}
    return LlamaCppImage(
        image=LocalImage(tag=tag, id=image.id),
        server_version=labels.get(LABEL_SERVER_VERSION, ""),
        package_version=labels.get(LABEL_PACKAGE, ""),
        suite=recipe.suite,
        how=how,
        seconds=time.monotonic() - started,
    )


def _versions_inside(client: Any, rootfs_id: str) -> tuple[str, str]:
    """(installed package version, first line of ``llama-server --version``) read from the image itself."""
    script = f"dpkg-query -W -f '${{Version}}\\n' {PACKAGE} && {SERVER} --version 2>&1"
    output = client.containers.run(rootfs_id, ["-c", script], entrypoint=["/bin/sh"], remove=True)
    lines = [line.strip() for line in output.decode("utf-8", errors="replace").splitlines() if line.strip()]
    if len(lines) < 2:
        raise LlamaCppImageError(
            f"the built image {rootfs_id} did not report {PACKAGE}'s version and llama-server's: {lines}"
        )
    package, server = lines[0], next((line for line in lines[1:] if line.startswith("version")), lines[1])
    return package, server


def _finish(client: Any, recipe: BaseRecipe, rootfs_id: str, tarball: Path) -> None:
    """Label the rootfs image with what it really holds; refuse one that does not hold the pin."""
    package, server = _versions_inside(client, rootfs_id)
    if package != PINNED_VERSION:
        raise LlamaCppImageError(
            f"the rootfs bootstrapped from {recipe.suite} holds {PACKAGE} {package}, not the pinned "
            f"{PINNED_VERSION} (the mirror moved during the build?); delete {tarball} and run again, or move "
            "the pin (tests/support/llamacpp_image.py)"
        )
    escaped = server.replace("\\", "\\\\").replace('"', '\\"')
    dockerfile = f'FROM {rootfs_id}\nLABEL {LABEL_SERVER_VERSION}="{escaped}"\n'
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as archive:
        member = tarfile.TarInfo("Dockerfile")
        member.size = len(dockerfile.encode())
        archive.addfile(member, io.BytesIO(dockerfile.encode()))
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=_final_tag(recipe), rm=True, pull=False)


def ensure_llamacpp_image(client: Any, cache: Path | None = None) -> LlamaCppImage:
    """The llama.cpp engine image: reused when tagged already, else imported from a cached rootfs tarball,
    else bootstrapped from the first suite whose index carries the pinned version (about a minute)."""
    started = time.monotonic()
    cache = cache or cache_dir()
    mirror = _mirror()
    recipes = [llamacpp_recipe(suite, mirror) for suite in SUITES]
    for recipe in recipes:
        if _find(client, _final_tag(recipe)) is not None:
            return _described(client, recipe, "image cached", started)
    with _locked(cache / "llamacpp.lock"):
        for recipe in recipes:  # another session may have finished while we waited
            if _find(client, _final_tag(recipe)) is not None:
                return _described(client, recipe, "image cached", started)
        cached = [recipe for recipe in recipes if _tarball(cache, recipe).is_file()]
        if cached:
            recipe, how = cached[0], "imported from the cached rootfs tarball"
        else:
            carried: dict[str, str | Exception | None] = {}
            for suite in SUITES:
                try:
                    carried[suite] = index_version(mirror, suite)
                except LlamaCppUnavailable as exc:
                    carried[suite] = exc
                if carried[suite] == PINNED_VERSION:
                    break
            suite = choose_suite(carried)
            recipe = next(r for r in recipes if r.suite == suite)
            how = f"bootstrapped from {mirror} {suite}"
            build_rootfs_tarball(recipe, _tarball(cache, recipe), script=SUITES[suite])
        rootfs = _find(client, _rootfs_tag(recipe))
        if rootfs is None:
            repository, tag = _rootfs_tag(recipe).rsplit(":", 1)
            client.api.import_image_from_file(
                str(_tarball(cache, recipe)), repository=repository, tag=tag, changes=list(recipe.changes)
            )
            rootfs = _find(client, _rootfs_tag(recipe))
        if rootfs is None:
            raise LlamaCppImageError(f"docker import of {_tarball(cache, recipe)} reported success but no image")
        _finish(client, recipe, rootfs.id, _tarball(cache, recipe))
    return _described(client, recipe, how, started)


def _require_docker() -> bool:
    return os.environ.get("MERIDIAN_REQUIRE_DOCKER") == "1"


@pytest.fixture(scope="session")
def llamacpp_image(docker_client: Any, request: pytest.FixtureRequest) -> Iterator[LlamaCppImage]:
    """The llama.cpp engine image in the real Docker Engine (cached per machine); skips only when no suite
    carrying llama.cpp is reachable and ``MERIDIAN_REQUIRE_DOCKER`` is unset."""
    try:
        built = ensure_llamacpp_image(docker_client)
    except LlamaCppUnavailable as exc:
        if _require_docker():
            pytest.fail(f"{exc}; MERIDIAN_REQUIRE_DOCKER=1 forbids skipping", pytrace=False)
        pytest.skip(str(exc))
    report(request, built.describe())
    yield built


def report(request: pytest.FixtureRequest, line: str) -> None:
    """Show ``line`` in the test run's output whether or not output is captured (``-s``): measured figures
    (build and start-up times, versions) belong in every CI log, not only in a failure's."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)

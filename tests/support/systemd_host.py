"""A systemd test host: a Docker container booting systemd as PID 1, with meridian-node installed the way
docs/SECURITY.md ("Installing the units") says a user installs it.

Three cached images, each tagged by a hash of what decides its content (as in ``standin_image``):

* ``meridian-node/systemd-host-rootfs:SUITE-HASH``: ``debootstrap --variant=minbase`` with systemd, dbus and
  python3-venv; the rootfs tarball is kept under ``cache_dir()``, so an empty engine with a warm cache only
  re-imports it (about a second) instead of bootstrapping (about a minute, mirror needed).
* ``meridian-node/systemd-host:SUITE-HASH`` (``ensure_host_image``): the rootfs with the units that cannot
  work in a container masked, so that ``systemctl is-system-running`` says ``running``. For molecule too.
* ``meridian-node/systemd-agent:SUITE-HASH`` (``ensure_agent_image``): the host image plus the venv
  /opt/meridian-node holding the project's runtime dependencies (from the wheelhouse, no index), so a test
  only installs the freshly built project wheel. ``systemd_host()`` boots this one unless told otherwise.

Typical use (the fixture ``installed_host`` below does exactly this)::

    with systemd_host() as host:
        install_meridian_node(host, wheelhouse=ensure_wheelhouse())
        host.put_file("/etc/meridian-node/config.yaml", data, mode=0o640, owner="root:meridian")
        with host.logs_on_failure("meridian-node.service"):
            host.exec(["systemctl", "start", "meridian-node.service"])

The container runs with the recipe measured in /work/shared/MACHINE-NOTES.md (``--privileged`` is refused
on these machines): SYS_ADMIN, seccomp and AppArmor unconfined, the cgroup tree read-only, tmpfs on /run.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet

from ansible_collections.meridian.node.tests.support.standin_image import (
    BaseRecipe,
    StandinImageError,
    _locked,
    apt_mirror,
    build_rootfs_tarball,
    cache_dir,
)

__all__ = [
    "AGENT_REPOSITORY",
    "BROUGHT_PYTHON",
    "CHECKOUT",
    "HOST_REPOSITORY",
    "LABEL",
    "PYTHON_PREFIX",
    "SUITES",
    "VENV",
    "WHEEL_UNIT_DIR",
    "AgentPython",
    "HostCommandError",
    "Suite",
    "SystemdHost",
    "SystemdHostError",
    "agent_python",
    "build_project_wheel",
    "ensure_agent_image",
    "ensure_host_image",
    "ensure_python_image",
    "ensure_wheelhouse",
    "install_meridian_node",
    "installed_host",
    "systemd_host",
]

ROOTFS_REPOSITORY = "meridian-node/systemd-host-rootfs"
HOST_REPOSITORY = "meridian-node/systemd-host"
AGENT_REPOSITORY = "meridian-node/systemd-agent"
LABEL = "meridian-node.systemd-host"  # on every container started here, to find leftovers
VENV = "/opt/meridian-node"
CHECKOUT = Path(__file__).resolve().parents[2]
# Bump when a build step changes in a way the hashed inputs do not show.
_FORMAT = 1

HOST_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "procps")
# Units that need a console, udev or real disks, or that fire on timers. Unmasked, none of them failed on
# bookworm (conditions skip them, or they are not installed); masked so that no suite's boot depends on
# that, and no timer runs apt, fstrim or e2scrub in the middle of a test.
MASKED_UNITS = (
    "getty@.service",
    "serial-getty@.service",
    "console-getty.service",
    "systemd-firstboot.service",
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-pstore.service",
    "systemd-timesyncd.service",
    "e2scrub_reap.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
)


@dataclass(frozen=True)
class Suite:
    """What a Debian release ships that decides which wheels fit it."""

    python: str  # "3.11"
    glibc: tuple[int, int]


SUITES = {
    "bullseye": Suite(python="3.9", glibc=(2, 31)),
    "bookworm": Suite(python="3.11", glibc=(2, 36)),
    "trixie": Suite(python="3.13", glibc=(2, 41)),
}


class SystemdHostError(RuntimeError):
    """Building, booting or driving the systemd test host failed; the message says what and how to fix it."""


class HostCommandError(SystemdHostError):
    """A command inside the host exited non-zero; ``result`` holds its exit status and output."""

    def __init__(self, message: str, result: subprocess.CompletedProcess[str]) -> None:
        super().__init__(message)
        self.result = result


# --- images ---------------------------------------------------------------------------------------------


def _suite(suite: str) -> Suite:
    try:
        return SUITES[suite]
    except KeyError:
        raise SystemdHostError(f"unknown suite {suite!r}: the systemd host is built for {', '.join(SUITES)}") from None


def _mirror(suite: str) -> str:
    # Any Debian archive serves every suite: a machine whose sources name only bookworm can bootstrap trixie.
    for candidate in (suite, *SUITES):
        with contextlib.suppress(StandinImageError):
            return apt_mirror(suite=candidate)
    return apt_mirror(suite=suite)  # raises, with the advice to set MERIDIAN_STANDIN_MIRROR


def _client(client: Any | None) -> Any:
    return client if client is not None else _default_client()


@functools.cache
def _default_client() -> Any:
    import docker

    return docker.from_env(timeout=300)


def _image_exists(client: Any, reference: str) -> str | None:
    import docker.errors

    try:
        return str(client.images.get(reference).id)
    except docker.errors.ImageNotFound:
        return None


def _build(client: Any, tag: str, dockerfile: str, files: dict[str, Path] | None = None) -> str:
    """``docker build`` of ``dockerfile`` with ``files`` (name in context -> file here); returns the image id."""
    import docker.errors

    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as archive:
        data = dockerfile.encode()
        member = tarfile.TarInfo("Dockerfile")
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
        for name, path in (files or {}).items():
            archive.add(str(path), arcname=name)
    context.seek(0)
    try:
        image, _logs = client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    except docker.errors.BuildError as exc:
        log = "".join(str(chunk.get("stream") or chunk.get("error") or "") for chunk in exc.build_log)
        tail = "\n".join(log.splitlines()[-25:])
        raise SystemdHostError(f"docker build of {tag} failed: {exc.msg}\n{tail}") from exc
    return str(image.id)


@contextlib.contextmanager
def _building(tag: str, client: Any) -> Iterator[bool]:
    """Hold the build lock of ``tag``'s repository; yields whether ``tag`` is still missing once it is held.

    Parallel test workers and sessions wait here instead of building the same image twice (a cold agent image
    is minutes of pip, a Python image minutes of compiling). One lock per repository; while one is held, only the
    cache fill beneath it is locked too (the rootfs tarball under the host image's, the CPython source under the
    Python image's), never another image's, so no two builders wait on each other.
    """
    repository = tag.rsplit(":", 1)[0].replace("/", "-")
    with _locked(cache_dir() / f"{repository}.build.lock"):
        yield _image_exists(client, tag) is None


def _rootfs_recipe(suite: str) -> BaseRecipe:
    return BaseRecipe(
        mirror=_mirror(suite),
        suite=suite,
        include=HOST_PACKAGES,
        changes=('CMD ["/sbin/init"]', "ENV container=docker"),
    )


def _rootfs_image(client: Any, recipe: BaseRecipe) -> str:
    tag = f"{ROOTFS_REPOSITORY}:{recipe.suite}-{recipe.digest()[:16]}"
    found = _image_exists(client, tag)
    if found is not None:
        return found
    cache = cache_dir()
    tarball = cache / f"systemd-host-rootfs-{recipe.suite}-{recipe.digest()[:16]}.tar"
    with _locked(cache / "systemd-host.lock"):
        found = _image_exists(client, tag)  # another session may have finished while we waited
        if found is not None:
            return found
        if not tarball.is_file():
            build_rootfs_tarball(recipe, tarball)
        repository, version = tag.rsplit(":", 1)
        client.api.import_image_from_file(
            str(tarball), repository=repository, tag=version, changes=list(recipe.changes)
        )
    found = _image_exists(client, tag)
    if found is None:
        raise SystemdHostError(f"docker import of {tarball} reported success but {tag} is not in the engine")
    return found


def _host_dockerfile(rootfs_id: str) -> str:
    masks = " ".join(MASKED_UNITS)
    # An empty machine-id makes systemd generate one per container: hosts must not share their identity.
    return (
        f"FROM {rootfs_id}\n"
        f"RUN set -e; for unit in {masks}; do ln -sf /dev/null /etc/systemd/system/$unit; done; : > /etc/machine-id\n"
        "ENV container=docker LANG=C.UTF-8\n"
        # SIGTERM makes systemd re-execute itself, not stop: `docker stop` would wait for its timeout.
        "STOPSIGNAL SIGRTMIN+3\n"
        'CMD ["/sbin/init"]\n'
    )


def ensure_host_image(suite: str = "bookworm", *, client: Any | None = None) -> str:
    """The tag of the bare systemd host image for ``suite`` (bullseye, bookworm or trixie), built if missing.

    A cold build bootstraps Debian (about a minute, as root, the mirror reachable); with the rootfs tarball
    cached it is an import and a one-step build.
    """
    _suite(suite)
    client = _client(client)
    recipe = _rootfs_recipe(suite)
    digest = hashlib.sha256(f"{recipe.digest()}\0{_host_dockerfile('')}\0{_FORMAT}".encode()).hexdigest()
    tag = f"{HOST_REPOSITORY}:{suite}-{digest[:16]}"
    if _image_exists(client, tag) is None:
        with _building(tag, client) as missing:
            if missing:
                _build(client, tag, _host_dockerfile(_rootfs_image(client, recipe)))
    return tag


def ensure_agent_image(suite: str = "bookworm", *, client: Any | None = None) -> str:
    """The host image plus /opt/meridian-node, a venv with the project's runtime dependencies installed
    from the wheelhouse: what is left to install per test is the project wheel itself."""
    target = _suite(suite)
    _check_python(suite)
    client = _client(client)
    host = ensure_host_image(suite, client=client)
    deps = _dependency_wheels(suite)
    digest = hashlib.sha256(f"{host}\0{deps.name}\0{_agent_dockerfile('', target)}".encode()).hexdigest()
    tag = f"{AGENT_REPOSITORY}:{suite}-{digest[:16]}"
    if _image_exists(client, tag) is None:
        with _building(tag, client) as missing:
            if missing:
                host_id = _image_exists(client, host)
                assert host_id is not None
                _build(client, tag, _agent_dockerfile(host_id, target), {"deps": deps})
    return tag


def _agent_dockerfile(host_id: str, target: Suite) -> str:
    wanted = tuple(int(part) for part in target.python.split("."))
    check = (
        f"import sys; sys.exit(0 if sys.version_info[:2] == {wanted} "
        f"else 'SUITES says Python {target.python}, found ' + sys.version)"
    )
    return (
        f"FROM {host_id}\n"
        "COPY deps /var/tmp/meridian-node-deps\n"
        f'RUN python3 -c "{check}" \\\n'
        f" && python3 -m venv {VENV} \\\n"
        f" && {VENV}/bin/pip install --quiet --no-cache-dir --disable-pip-version-check --no-index"
        " --find-links /var/tmp/meridian-node-deps -r /var/tmp/meridian-node-deps/requirements.txt \\\n"
        " && rm -rf /var/tmp/meridian-node-deps\n"
    )


# --- a newer Python for Debian 11 --------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentPython:
    """The interpreter the agent runs on in a suite: the system's, or one the operator brought."""

    version: str  # "3.11"
    path: str  # what node_agent_python names


@dataclass(frozen=True)
class PythonSource:
    """CPython's source as Debian ships it (the orig tarball of a Debian source package), with the checksums
    its .dsc lists: the mirror serves it over plain HTTP, so the sums are what makes it the right file."""

    url: str
    dsc: str
    size: int
    md5: str
    sha256: str


# bookworm's python3.11 source package, from the same mirror the images bootstrap from.
PYTHON_SOURCE = PythonSource(
    url="http://deb.debian.org/debian/pool/main/p/python3.11/python3.11_3.11.2.orig.tar.gz",
    dsc="python3.11_3.11.2-6+deb12u6.dsc",
    size=26437858,
    md5="f6b5226ccba5ae1ca9376aaba0b0f673",
    sha256="2411c74bda5bbcfcddaf4531f66d1adc73f247f529aee981b029513aefdbf849",
)
PYTHON_PREFIX = "/opt/python3.11"
PYTHON_REPOSITORY = "meridian-node/systemd-host-python"
# Debian 11 ships Python 3.9 and the agent needs 3.11: there operators bring their own (docs/INSTALL.md).
BROUGHT_PYTHON = {"bullseye": AgentPython(version="3.11", path=f"{PYTHON_PREFIX}/bin/python3.11")}
# What CPython's build needs on bullseye for the modules the agent and its dependencies import (ssl, ctypes
# through cffi, sqlite3, lzma, bz2, zlib); their runtime libraries are in the host image already.
_PYTHON_BUILD_PACKAGES = (
    "gcc", "make", "libc6-dev", "libssl-dev", "zlib1g-dev", "libffi-dev", "libbz2-dev", "liblzma-dev",
    "libsqlite3-dev", "uuid-dev",
)  # fmt: skip


def agent_python(suite: str) -> AgentPython:
    """The Python the agent runs on in ``suite``: a brought one where the system's is too old."""
    return BROUGHT_PYTHON.get(suite) or AgentPython(version=_suite(suite).python, path="/usr/bin/python3")


def _python_tarball() -> Path:
    """The CPython source tarball, downloaded once into ``cache_dir()`` and checked against the .dsc's sums."""
    import urllib.request

    source = PYTHON_SOURCE
    target = cache_dir() / source.url.rsplit("/", 1)[1]
    if target.is_file():
        return target
    with _locked(cache_dir() / "python-source.lock"):
        if target.is_file():
            return target
        partial = target.with_suffix(".partial")
        md5, sha256 = hashlib.md5(usedforsecurity=False), hashlib.sha256()
        try:
            with urllib.request.urlopen(source.url, timeout=60) as response, partial.open("wb") as out:
                while chunk := response.read(1 << 20):
                    md5.update(chunk)
                    sha256.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise SystemdHostError(f"cannot download {source.url}: {exc}; the Debian mirror must be reachable") from exc
        size = partial.stat().st_size
        if (size, md5.hexdigest(), sha256.hexdigest()) != (source.size, source.md5, source.sha256):
            partial.unlink()
            raise SystemdHostError(
                f"{source.url} is not the file {source.dsc} lists: got {size} bytes, md5 {md5.hexdigest()}, "
                f"sha256 {sha256.hexdigest()}; expected {source.size} bytes, md5 {source.md5}, sha256 "
                f"{source.sha256}"
            )
        os.replace(partial, target)
    return target


def _python_dockerfile(host_id: str, tarball: str) -> str:
    version = BROUGHT_PYTHON["bullseye"].version
    check = "import ssl, ctypes, sqlite3, lzma, bz2, zlib, venv, ensurepip; print(ssl.OPENSSL_VERSION)"
    return (
        f"FROM {host_id} AS build\n"
        f"COPY {tarball} /usr/src/python.tar.gz\n"
        "RUN set -e; apt-get update -qq; apt-get install -y -qq --no-install-recommends "
        f"{' '.join(_PYTHON_BUILD_PACKAGES)} >/dev/null; mkdir /usr/src/python; "
        "tar -C /usr/src/python --strip-components=1 -xzf /usr/src/python.tar.gz; cd /usr/src/python; "
        f"./configure --prefix={PYTHON_PREFIX} --with-ensurepip=install >/dev/null; "
        'make -j"$(nproc)" >/dev/null; make install >/dev/null; '
        f"rm -rf {PYTHON_PREFIX}/lib/python{version}/test {PYTHON_PREFIX}/lib/python{version}/*/test\n"
        f"FROM {host_id}\n"
        f"COPY --from=build {PYTHON_PREFIX} {PYTHON_PREFIX}\n"
        f'RUN {PYTHON_PREFIX}/bin/python{version} -c "{check}"\n'
    )


def ensure_python_image(suite: str = "bullseye", *, client: Any | None = None) -> str:
    """The host image for ``suite`` plus CPython built from Debian's source into ``PYTHON_PREFIX``, built if
    missing (a cold build compiles CPython: some minutes on two cores; the mirror must be reachable)."""
    if suite not in BROUGHT_PYTHON:
        raise SystemdHostError(f"{suite} ships a Python the agent runs on: use ensure_host_image({suite!r})")
    client = _client(client)
    host = ensure_host_image(suite, client=client)
    digest = hashlib.sha256(f"{host}\0{PYTHON_SOURCE}\0{_python_dockerfile('', 'x')}".encode()).hexdigest()
    tag = f"{PYTHON_REPOSITORY}:{suite}-{digest[:16]}"
    if _image_exists(client, tag) is None:
        with _building(tag, client) as missing:
            if missing:
                tarball = _python_tarball()
                host_id = _image_exists(client, host)
                assert host_id is not None
                _build(client, tag, _python_dockerfile(host_id, tarball.name), {tarball.name: tarball})
    return tag


# --- wheels ---------------------------------------------------------------------------------------------


def _project() -> dict[str, Any]:
    with (CHECKOUT / "pyproject.toml").open("rb") as handle:
        project: dict[str, Any] = tomllib.load(handle)["project"]
    return project


def _check_python(suite: str, python: str | None = None) -> None:
    required = SpecifierSet(_project().get("requires-python", ""))
    python = python or _suite(suite).python
    if python not in required:
        raise SystemdHostError(
            f"meridian-node requires Python {required} (pyproject.toml) but Debian {suite} has Python {python}: "
            f"the agent cannot be installed there; use ensure_host_image({suite!r}) for what needs no agent"
        )


def _pip(argv: list[str], what: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", *argv], capture_output=True, text=True, timeout=900, check=False
    )
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
        raise SystemdHostError(
            f"{what} failed (pip {' '.join(argv)} exited {result.returncode}); pip needs its index (or "
            f"PIP_FIND_LINKS) reachable from here:\n{tail}"
        )


def _dependency_wheels(suite: str, python: str | None = None) -> Path:
    """The runtime dependencies as wheels for ``suite``'s Python (or ``python``, a version such as "3.11", on
    that suite's glibc), cached by the dependency list (the versions pip picked the first time stay: delete
    ``cache_dir() / "wheels"`` to take newer releases)."""
    target = dataclasses.replace(_suite(suite), python=python) if python else _suite(suite)
    # The metrics extra too: roles/node_agent installs it where the config has a metrics section (molecule's does).
    project = _project()
    dependencies: list[str] = [*project.get("dependencies", []), *project["optional-dependencies"]["metrics"]]
    key = json.dumps([dependencies, target.python, target.glibc, platform.machine(), _FORMAT])
    parent = cache_dir() / "wheels"
    directory = parent / f"{suite}-py{target.python}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (directory / "requirements.txt").is_file():
        return directory
    with _locked(cache_dir() / "wheels.lock"):
        if (directory / "requirements.txt").is_file():
            return directory
        parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix="partial-", dir=parent))
        try:
            libc = platform.libc_ver()[1]
            host_glibc = tuple(int(part) for part in libc.split(".")[:2]) if libc else (0, 0)
            if f"{sys.version_info.major}.{sys.version_info.minor}" == target.python and host_glibc <= target.glibc:
                # Same interpreter as the container's: exactly what pip would pick there, sdists built too.
                _pip(["wheel", "--quiet", "--wheel-dir", str(partial), *dependencies], f"building wheels for {suite}")
            else:
                nodot = target.python.replace(".", "")
                machine = platform.machine()
                platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(17, target.glibc[1] + 1)]
                tags = ["--implementation", "cp", "--python-version", target.python]
                tags += ["--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none"]
                tags += [
                    arg for name in [*platforms, f"manylinux2014_{machine}", "any"] for arg in ("--platform", name)
                ]
                _pip(
                    ["download", "--quiet", "--only-binary=:all:", "--dest", str(partial), *tags, *dependencies],
                    f"downloading wheels for {suite} (Python {target.python})",
                )
            # Written last: its presence marks the directory complete.
            (partial / "requirements.txt").write_text("".join(f"{line}\n" for line in dependencies))
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(partial, directory)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return directory


@functools.cache
def ensure_wheelhouse(suite: str = "bookworm") -> Path:
    """A directory with the project's wheel, built now from this checkout (once per process), and every
    runtime dependency as a wheel for the agent's Python on ``suite`` (``agent_python``): ``pip install
    --no-index --find-links`` needs nothing else. Removed when the process exits."""
    python = agent_python(suite).version
    _check_python(suite, python)
    deps = _dependency_wheels(suite, python)
    wheelhouse = Path(tempfile.mkdtemp(prefix=f"meridian-node-wheelhouse-{suite}-"))
    atexit.register(shutil.rmtree, wheelhouse, True)
    build_project_wheel(wheelhouse)
    for wheel in deps.glob("*.whl"):
        try:
            os.link(wheel, wheelhouse / wheel.name)
        except OSError:  # cache on another filesystem
            shutil.copy2(wheel, wheelhouse / wheel.name)
    return wheelhouse


# Where the wheel carries the units as shared data (pyproject.toml; installed under ``<venv>/share``):
# roles/node_agent installs them from there.
WHEEL_UNIT_DIR = "share/meridian-node/systemd"


def build_project_wheel(directory: Path) -> Path:
    """Build the project's wheel from this checkout into ``directory``; return its path."""
    _pip(["wheel", "--quiet", "--no-deps", "--wheel-dir", str(directory), str(CHECKOUT)], "building the project wheel")
    wheel = _one_wheel(directory)
    if not _carries_units(wheel):
        raise SystemdHostError(
            f"{wheel} does not carry the systemd units under {WHEEL_UNIT_DIR}: pyproject.toml's "
            "[tool.hatch.build.targets.wheel.shared-data] must map systemd/ there"
        )
    return wheel


def _one_wheel(directory: Path) -> Path:
    wheels = sorted(directory.glob("meridian_node-*.whl"))
    if len(wheels) != 1:
        raise SystemdHostError(f"{directory} should hold exactly one meridian_node wheel, found {len(wheels)}")
    return wheels[0]


def _carries_units(wheel: Path) -> bool:
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        return any(name.endswith(f".data/data/{WHEEL_UNIT_DIR}/meridian-node.service") for name in archive.namelist())


# --- the running host -----------------------------------------------------------------------------------


def _docker(
    argv: Sequence[str], *, input: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["docker", *argv], input=input, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        output = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")
        raise SystemdHostError(
            f"docker {' '.join(argv)} did not finish within {timeout:g} s; output:\n{output}"
        ) from exc
    except FileNotFoundError as exc:
        raise SystemdHostError("the docker CLI is not installed: apt-get install -y docker.io") from exc


def _text(result: subprocess.CompletedProcess[bytes]) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    )


@dataclass(frozen=True)
class SystemdHost:
    """A running container with systemd as PID 1; every method runs ``docker exec`` in it (as root unless
    ``user`` is given). An exec runs outside any unit, so without the unit's sandbox: to act from inside
    ``meridian-node.service``'s confinement, start the unit, or ``systemd-run --wait --pipe`` with its
    properties."""

    name: str
    image: str
    suite: str

    def _exec(
        self, argv: Sequence[str], *, user: str | None, input: bytes | None, timeout: float
    ) -> subprocess.CompletedProcess[bytes]:
        options = ["--interactive"] if input is not None else []
        if user is not None:
            options += ["--user", user]
        return _docker(["exec", *options, self.name, *argv], input=input, timeout=timeout)

    def exec(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        check: bool = True,
        timeout: float = 120,
        input: bytes | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the host; with ``check``, a non-zero exit raises ``HostCommandError``."""
        result = _text(self._exec(argv, user=user, input=input, timeout=timeout))
        if check and result.returncode != 0:
            raise HostCommandError(
                f"in {self.name}{' as ' + user if user else ''}: {' '.join(argv)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}",
                result,
            )
        return result

    def sh(
        self, script: str, *, user: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``sh -euc script`` in the host."""
        return self.exec(["sh", "-euc", script], user=user, check=check, timeout=timeout)

    def put_file(self, path: str, data: bytes, *, mode: int, owner: str = "root") -> None:
        """Write ``data`` to ``path`` atomically (a temporary file in the same directory renamed into place, as
        the agent writes its spool), ``chown owner`` (``user`` or ``user:group``; ``user`` alone means the
        user's login group) and ``chmod mode``. Missing parent directories are created root-owned, 0755."""
        owner = owner if ":" in owner else f"{owner}:"
        script = (
            'mkdir -p -- "$(dirname -- "$1")"; tmp=$(mktemp "$1.XXXXXX"); cat > "$tmp"; '
            'chown -- "$3" "$tmp"; chmod -- "$2" "$tmp"; mv -f -- "$tmp" "$1"'
        )
        self.exec(["sh", "-euc", script, "put_file", path, f"{mode:o}", owner], input=data)

    def read_file(self, path: str) -> bytes:
        result = self._exec(["cat", "--", path], user=None, input=None, timeout=60)
        if result.returncode != 0:
            raise SystemdHostError(f"cannot read {path} in {self.name}: {result.stderr.decode(errors='replace')}")
        return result.stdout

    def journal(self, unit: str | None = None) -> str:
        """The journal of ``unit`` (the whole boot without one), flushed first so recent lines are in it."""
        selection = ["-u", unit] if unit else ["-b"]
        script = 'journalctl --sync; exec journalctl --no-pager -o short-precise "$@"'
        return self.exec(["sh", "-c", script, "journal", *selection], check=False).stdout

    def unit_state(self, unit: str) -> str:
        """``ActiveState`` of ``unit``: active, inactive, failed, activating, deactivating or reloading."""
        return self.exec(["systemctl", "show", "--property=ActiveState", "--value", unit]).stdout.strip()

    def wait_unit(self, unit: str, state: str = "active", timeout: float = 60) -> None:
        """Wait until ``unit``'s ``ActiveState`` is ``state``; a unit that fails meanwhile raises at once."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.unit_state(unit)
            if current == state:
                return
            if current == "failed" or time.monotonic() > deadline:
                why = "failed" if current == "failed" else f"is still {current!r} after {timeout:g} s"
                raise SystemdHostError(f"{unit} {why}, waiting for {state!r}:\n{self.diagnostics(unit)}")
            time.sleep(0.2)

    def unit_security_score(self, unit: str) -> float:
        """The "Overall exposure level" ``systemd-analyze security`` gives the loaded ``unit`` (0 best, 10 worst)."""
        result = self.exec(["systemd-analyze", "security", "--no-pager", unit], check=False)
        found = re.search(r"Overall exposure level for \S+: ([0-9]+(?:\.[0-9]+)?)", result.stdout)
        if found is None:
            raise SystemdHostError(
                f"systemd-analyze security {unit} printed no exposure level (exit {result.returncode}):\n"
                f"{result.stdout[-2000:]}\n{result.stderr}"
            )
        return float(found.group(1))

    def diagnostics(self, *units: str) -> str:
        """What to read when something went wrong: failed units, the status and journal of ``units``, or of
        the whole boot without any."""
        parts = [f"--- systemctl --failed in {self.name} ---", self.exec(["systemctl", "--failed"], check=False).stdout]
        for unit in units:
            status = self.exec(["systemctl", "status", "--no-pager", "--full", unit], check=False)
            parts += [f"--- systemctl status {unit} ---", status.stdout + status.stderr]
        selections: tuple[str | None, ...] = units or (None,)
        for selected in selections:
            journal = "\n".join(self.journal(selected).splitlines()[-200:])
            parts += [f"--- journal {selected or '(whole boot)'}, last 200 lines ---", journal]
        return "\n".join(parts)

    @contextlib.contextmanager
    def logs_on_failure(self, *units: str) -> Iterator[None]:
        """Print ``diagnostics(*units)`` if the block raises: pytest shows it with the failure."""
        try:
            yield
        except BaseException:
            print(self.diagnostics(*units))
            raise

    def _wait_booted(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            # Until PID 1 has its private socket up, systemctl cannot connect and prints nothing on stdout.
            remaining = max(deadline - time.monotonic(), 1)
            try:
                result = self.exec(["systemctl", "is-system-running", "--wait"], check=False, timeout=remaining)
            except SystemdHostError as exc:
                raise SystemdHostError(f"{exc}\n{self._console()}") from exc
            gone = "is not running" in result.stderr or "No such container" in result.stderr
            if result.stdout.strip() or gone or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        state = result.stdout.strip()
        if state == "running":
            return
        if not state:  # the container is gone or systemd never answered
            raise SystemdHostError(
                f"systemd did not come up in {self.name} ({self.image}): {result.stderr.strip()}\n{self._console()}"
            )
        raise SystemdHostError(
            f"systemd in {self.name} ({self.image}) booted {state!r}, not 'running': mask what cannot work in a "
            f"container in MASKED_UNITS (tests/support/systemd_host.py).\n{self.diagnostics()}"
        )

    def _console(self) -> str:
        logs = _docker(["logs", "--tail", "60", self.name], timeout=30)
        output = (logs.stdout + logs.stderr).decode(errors="replace")
        return f"--- docker logs {self.name} (systemd's console) ---\n{output}"


def _docker_socket() -> Path:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        raise SystemdHostError(f"docker_socket=True needs a local unix socket, but DOCKER_HOST is {host!r}")
    socket = Path(host.removeprefix("unix://"))
    if not socket.exists():
        raise SystemdHostError(f"docker_socket=True but there is no Docker socket at {socket}: is dockerd running?")
    return socket


@contextlib.contextmanager
def systemd_host(
    suite: str = "bookworm",
    *,
    image: str | None = None,
    network_host: bool = True,
    docker_socket: bool = True,
    same_path_mounts: Sequence[Path] = (),
    boot_timeout: float = 120,
) -> Iterator[SystemdHost]:
    """A booted host (``systemctl is-system-running`` said ``running``), removed when the block ends.

    ``image`` defaults to ``ensure_agent_image(suite)``; pass ``ensure_host_image(suite)`` for a host without
    the dependency venv (bullseye has no Python the agent supports). ``network_host``: the host's network, so
    ports that engines started through the outer Docker Engine publish on 127.0.0.1 are reachable inside
    (and servers started inside must bind 127.0.0.1 only). ``docker_socket``: the outer engine's socket at
    /var/run/docker.sock, so root inside drives it. ``same_path_mounts``: directories bind-mounted at the
    same path, for files that the outer engine must find at the path the host names (engine bind mounts).
    """
    image = image or ensure_agent_image(suite)
    name = f"mn-systemd-host-{secrets.token_hex(4)}"
    argv = ["run", "--detach", "--name", name, "--label", f"{LABEL}={suite}"]
    argv += ["--cap-add", "SYS_ADMIN", "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined"]
    # Root on a real host has CAP_DAC_READ_SEARCH, Docker's default set does not: the apply unit keeps only
    # that one to read the agent's 0600 request, and would fail here for a reason no host has.
    argv += ["--cap-add", "DAC_READ_SEARCH"]
    argv += ["--volume", "/sys/fs/cgroup:/sys/fs/cgroup:ro", "--tmpfs", "/run", "--tmpfs", "/run/lock"]
    argv += ["--env", "container=docker"]
    if network_host:
        argv += ["--network", "host"]
    if docker_socket:
        argv += ["--volume", f"{_docker_socket()}:/var/run/docker.sock"]
    for directory in same_path_mounts:
        resolved = Path(directory).resolve()
        if not resolved.is_dir():
            # The engine would create a missing source as an empty root-owned directory: say so instead.
            raise SystemdHostError(f"same_path_mounts: {directory} is not an existing directory on this machine")
        argv += ["--volume", f"{resolved}:{resolved}"]
    started = _docker([*argv, image], timeout=120)
    try:
        if started.returncode != 0:
            raise SystemdHostError(
                f"docker {' '.join(argv)} {image} failed: {started.stderr.decode(errors='replace').strip()}\n"
                "(the recipe is the one /work/shared/MACHINE-NOTES.md measured: `--privileged` is refused here)"
            )
        host = SystemdHost(name=name, image=image, suite=suite)
        host._wait_booted(boot_timeout)
        yield host
    finally:
        _docker(["rm", "--force", "--volumes", name], timeout=60)


def install_meridian_node(host: SystemdHost, *, wheelhouse: Path) -> None:
    """Install meridian-node in ``host`` the way docs/SECURITY.md tells a user to: the ``meridian`` system user,
    the venv /opt/meridian-node from ``wheelhouse`` (no index), the checkout's units in /etc/systemd/system
    (read now, not when the image was built), ``systemctl daemon-reload``. Writes no config or policy."""
    wheels = sorted(wheelhouse.glob("meridian_node-*.whl"))
    if len(wheels) != 1:
        raise SystemdHostError(f"{wheelhouse} should hold exactly one meridian_node wheel, found {len(wheels)}")
    units = sorted(path for path in (CHECKOUT / "systemd").iterdir() if path.suffix in (".service", ".path", ".timer"))
    stage = "/var/tmp/meridian-node-install"
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for folder, files in (("wheelhouse", sorted(wheelhouse.glob("*.whl"))), ("units", units)):
            entry = tarfile.TarInfo(folder)
            entry.type = tarfile.DIRTYPE
            tar.addfile(_root_owned(entry))
            for path in files:
                tar.add(str(path), arcname=f"{folder}/{path.name}", filter=_root_owned)
    host.exec(["mkdir", "-m", "0700", "-p", stage])
    copied = _docker(["cp", "-", f"{host.name}:{stage}"], input=archive.getvalue(), timeout=120)
    if copied.returncode != 0:
        raise SystemdHostError(f"docker cp of the wheelhouse into {host.name} failed: {copied.stderr.decode().strip()}")
    host.exec(
        ["useradd", "--system", "--home-dir", "/var/lib/meridian-node", "--shell", "/usr/sbin/nologin", "meridian"]
    )
    host.exec(["sh", "-euc", f"test -x {VENV}/bin/python || python3 -m venv {VENV}"])
    host.exec(
        [
            f"{VENV}/bin/pip", "install", "--quiet", "--no-cache-dir", "--disable-pip-version-check", "--no-index",
            "--find-links", f"{stage}/wheelhouse", f"{stage}/wheelhouse/{wheels[0].name}",
        ],
        timeout=600,
    )  # fmt: skip
    host.exec(["install", "-m", "0644", *(f"{stage}/units/{unit.name}" for unit in units), "/etc/systemd/system/"])
    host.exec(["systemctl", "daemon-reload"])
    host.exec(["rm", "-rf", stage])


def _root_owned(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.uid = member.gid = 0
    member.uname = member.gname = "root"
    member.mode = 0o644 if member.isfile() else 0o755
    return member


@pytest.fixture(scope="module")
def installed_host(docker_client: Any) -> Iterator[SystemdHost]:
    """A booted bookworm host with meridian-node installed (no config yet), one per test module."""
    wheelhouse = ensure_wheelhouse()
    with systemd_host(image=ensure_agent_image(client=docker_client)) as host:
        install_meridian_node(host, wheelhouse=wheelhouse)
        yield host

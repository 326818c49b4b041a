"""A real image registry on 127.0.0.1 for the pull tests: Debian's ``docker-registry`` (the CNCF distribution
server, ``/usr/bin/docker-registry serve CONFIG``) on a free port with its storage in a temp directory, started
and stopped by the tests; images pushed to it by the real Docker Engine.

Docker treats registries on 127.0.0.0/8 as insecure by default, so ``docker push 127.0.0.1:PORT/x`` works over
plain HTTP without touching daemon.json. Every repository pushed here lives under the test's own prefix
(``127.0.0.1:PORT/<prefix>/...``), and ``pushed_image`` removes exactly what it made from the local engine,
never a stranger's image.

Pieces:

* ``Registry`` / ``running_registry``: one server process; with ``auth=(user, password)`` it asks for basic
  auth through an htpasswd file (bcrypt, made with the C library's ``crypt``: no extra package).
* ``pushed_image``: a unique image (``FROM`` the stand-in engine, plus a layer of random bytes of the size
  asked for, so a pull really moves bytes) pushed to a registry; the local copy is removed afterwards, unless
  kept, so the engine under test has to pull it.
* ``StallingProxy``: a TCP proxy in front of a registry that, after ``stall_after`` bytes of one answer
  connection, stops forwarding and holds the connection open: a pull stalled mid-layer, deterministically (a
  registry paused with SIGSTOP stalls wherever the pull happens to be at that moment).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "REGISTRY_BINARY",
    "PushedImage",
    "Registry",
    "RegistryUnavailableError",
    "StallingProxy",
    "pushed_image",
    "running_registry",
]

REGISTRY_BINARY = "/usr/bin/docker-registry"
_START_TIMEOUT_S = 20.0


class RegistryUnavailableError(RuntimeError):
    """The registry binary is missing or the server did not come up; the message says how to fix it."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _htpasswd_line(user: str, password: str) -> str:
    # The registry reads only bcrypt entries; glibc's libxcrypt writes them ($2b$). The crypt module is
    # deprecated (gone in 3.13), which is why the warning is silenced here rather than a package added.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        raise RegistryUnavailableError("this C library's crypt() cannot make bcrypt hashes for the registry's htpasswd")
    return f"{user}:{hashed}\n"


@dataclass
class Registry:
    """A running registry: ``host`` is ``127.0.0.1:PORT``, what image references start with."""

    port: int
    root: Path
    process: subprocess.Popen[bytes]
    auth: tuple[str, str] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return (self.root / "registry.log").read_text(errors="replace")

    def auth_config(self) -> dict[str, str] | None:
        """What the Docker SDK's push takes; None for an open registry."""
        if self.auth is None:
            return None
        return {"username": self.auth[0], "password": self.auth[1], "serveraddress": self.host}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def running_registry(auth: tuple[str, str] | None = None) -> Iterator[Registry]:
    """A registry on 127.0.0.1:<free port>, its storage in a temp directory; stopped and deleted afterwards."""
    if not os.access(REGISTRY_BINARY, os.X_OK):
        raise RegistryUnavailableError(
            f"{REGISTRY_BINARY} is missing: install Debian's docker-registry package (apt-get install docker-registry; "
            ".ci/run does)"
        )
    root = Path(tempfile.mkdtemp(prefix="mn-registry-"))
    port = _free_port()
    config: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(root / "data")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(16)},
    }
    if auth is not None:
        (root / "htpasswd").write_text(_htpasswd_line(*auth))
        config["auth"] = {"htpasswd": {"realm": "meridian-test", "path": str(root / "htpasswd")}}
    (root / "config.yml").write_text(json.dumps(config))  # JSON is YAML
    with (root / "registry.log").open("wb") as log:
        process = subprocess.Popen(
            [REGISTRY_BINARY, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT
        )
    registry = Registry(port=port, root=root, process=process, auth=auth)
    try:
        _wait_until_up(registry)
        yield registry
    finally:
        registry.stop()
        shutil.rmtree(root, ignore_errors=True)


def _wait_until_up(registry: Registry) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            raise RegistryUnavailableError(f"the registry exited ({registry.process.returncode}): {registry.log}")
        try:
            with urllib.request.urlopen(f"http://{registry.host}/v2/", timeout=2):
                return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # up, and asking for credentials
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RegistryUnavailableError(
        f"the registry on {registry.host} did not answer in {_START_TIMEOUT_S:g}s: {registry.log}"
    )


@dataclass(frozen=True)
class PushedImage:
    """An image in a registry: ``repository`` (``127.0.0.1:PORT/prefix/name``), its registry ``digest``
    (``sha256:...``) and local image ``id``; ``pinned`` is what an engine spec names."""

    repository: str
    tag: str
    digest: str
    id: str

    @property
    def pinned(self) -> str:
        return f"{self.repository}@{self.digest}"

    def pinned_via(self, host: str) -> str:
        """The same pin through another registry address (a proxy in front of the registry)."""
        return f"{host}/{self.repository.split('/', 1)[1]}@{self.digest}"


def _context(base_id: str, blob_bytes: int) -> io.BytesIO:
    """A build context: FROM the base, plus one layer of random bytes (unique, so it is pulled for real)."""
    dockerfile = f"FROM {base_id}\nCOPY blob /standin/pull-test-blob\n".encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (("Dockerfile", dockerfile), ("blob", os.urandom(blob_bytes))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


def push(client: Any, registry: Registry, base_id: str, repository: str, tag: str, blob_bytes: int) -> PushedImage:
    """Build a unique image on ``base_id`` as ``repository:tag`` and push it; returns it (still local)."""
    image, _logs = client.images.build(
        fileobj=_context(base_id, blob_bytes), custom_context=True, tag=f"{repository}:{tag}", rm=True, pull=False
    )
    for line in client.api.push(repository, tag=tag, stream=True, decode=True, auth_config=registry.auth_config()):
        if "error" in line:
            raise RegistryUnavailableError(f"pushing {repository}:{tag} to {registry.host} failed: {line['error']}")
    image.reload()
    digests = [d for d in image.attrs.get("RepoDigests") or [] if d.startswith(repository + "@")]
    if not digests:
        raise RegistryUnavailableError(f"{repository}:{tag} has no registry digest after the push: {image.attrs}")
    return PushedImage(repository=repository, tag=tag, digest=digests[0].split("@", 1)[1], id=str(image.id))


def forget_local(client: Any, repository: str) -> None:
    """Remove every local image of ``repository`` (a test's own, under its prefix), and first the containers made
    from them: Docker refuses to delete an image a running container uses, even forced. Those containers can
    only be the test's own, since its image is unique to it. Images of other repositories keep shared layers."""
    for image in client.images.list(name=repository):
        for container in client.containers.list(all=True, filters={"ancestor": image.id}):
            with contextlib.suppress(Exception):  # already gone: what was wanted
                container.remove(force=True)
        with contextlib.suppress(Exception):
            client.images.remove(image.id, force=True)
    left = client.images.list(name=repository)
    if left:
        raise RegistryUnavailableError(f"images of {repository} are still in the local engine: {[i.id for i in left]}")


@contextlib.contextmanager
def pushed_image(
    client: Any, registry: Registry, base_id: str, prefix: str, *, tag: str = "v1", blob_bytes: int = 64 * 1024
) -> Iterator[PushedImage]:
    """A unique image pushed to ``registry`` as ``<registry>/<prefix>/standin:<tag>``, gone from the local engine
    (so it must be pulled); every local image of that repository is removed afterwards too."""
    repository = f"{registry.host}/{prefix}/standin"
    pushed = push(client, registry, base_id, repository, tag, blob_bytes)
    forget_local(client, repository)
    try:
        yield pushed
    finally:
        forget_local(client, repository)


class StallingProxy:
    """A TCP proxy on 127.0.0.1:<free port> to ``target_port``; each connection forwards the server's first
    ``stall_after`` bytes, then holds the connection open and forwards nothing more until ``release()`` (or
    the client closes it). ``stalled`` is set once a connection has stalled."""

    def __init__(self, target_port: int, stall_after: int) -> None:
        self.target_port = target_port
        self.stall_after = stall_after
        self.stalled = threading.Event()
        self._released = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> StallingProxy:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._closing = True
        self._released.set()
        self._listener.close()

    def release(self) -> None:
        self._released.set()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _address = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.stall_after), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) > limit and not self._released.is_set():
                    head = max(0, limit - sent)
                    sink.sendall(data[:head])
                    sent += head
                    self.stalled.set()
                    self._released.wait()
                    if self._closing:
                        break
                    data = data[head:]
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

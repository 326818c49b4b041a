"""A second Docker daemon that a test owns, so that it can stop and start a daemon without touching the one
everyone else uses on this machine.

Its own ``--data-root``, ``--exec-root`` (with the containerd it starts), unix socket, pidfile and cgroup
parent under a temporary directory; its own bridge interface, and no iptables rules, no IP forwarding and
no masquerading, so it changes nothing of the host's network but that one interface. Containers still
publish ports on 127.0.0.1 (through Docker's userland proxy). ``close`` removes its containers, stops it,
deletes the bridge and the directory.

Needs root (a daemon, a bridge) and ``dockerd`` and ``ip`` on PATH: ``unavailable()`` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import docker

__all__ = ["OwnDockerd", "unavailable"]

_START_DEADLINE_S = 60.0  # a liveness bound: dockerd answers in about a second here
_STOP_DEADLINE_S = 60.0  # it stops its containers first (their stop timeouts)


def unavailable() -> str | None:
    """Why a second daemon cannot run here, or None."""
    if os.geteuid() != 0:
        return "a second dockerd and its bridge need root"
    missing = [tool for tool in ("dockerd", "ip") if shutil.which(tool) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _free_subnet() -> str:
    """A /24 under 10.231.0.0/16 that no interface of this host has an address in."""
    taken = subprocess.run(["ip", "-4", "-o", "addr"], check=True, capture_output=True, text=True).stdout
    for _ in range(50):
        third = 100 + secrets.randbelow(150)
        if f" 10.231.{third}." not in taken:
            return f"10.231.{third}.1/24"
    raise RuntimeError("no free 10.231.x.0/24 subnet for the test daemon's bridge")


class OwnDockerd:
    def __init__(self) -> None:
        # Short: the socket path must fit a unix socket address (108 bytes).
        self.root = Path(tempfile.mkdtemp(prefix="mn-dd-", dir="/tmp"))
        self.socket = self.root / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.bridge = f"mnbr-{secrets.token_hex(4)}"
        self.process: subprocess.Popen[bytes] | None = None
        self._bridge_made = False

    def __enter__(self) -> OwnDockerd:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", _free_subnet(), "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self) -> Any:
        return docker.DockerClient(base_url=self.host, timeout=60)

    def start(self) -> None:
        """Start the daemon (again) and wait until it answers."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the test daemon is already running")
        log = (self.root / "dockerd.log").open("ab")
        self.process = subprocess.Popen(
            [
                "dockerd",
                "--data-root",
                str(self.root / "data"),
                "--exec-root",
                str(self.root / "exec"),
                "-H",
                self.host,
                "--pidfile",
                str(self.root / "docker.pid"),
                "--bridge",
                self.bridge,
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--cgroup-parent",
                self.root.name,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + _START_DEADLINE_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the test dockerd exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with contextlib.closing(self.client()) as client:
                    client.ping()
                return
            except docker.errors.DockerException as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the test dockerd did not answer in {_START_DEADLINE_S:g} s:\n{self.log_tail()}"
                    ) from exc
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the daemon as an init system would (SIGTERM: it stops its containers, then exits)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            raise RuntimeError(f"the test dockerd did not stop in {_STOP_DEADLINE_S:g} s:\n{self.log_tail()}") from None

    def load(self, main: Any, reference: str) -> None:
        """Copy image ``reference`` from the main daemon (client ``main``) into this one, tags included."""
        with contextlib.closing(self.client()) as client:
            client.images.load(b"".join(main.images.get(reference).save(named=True)))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.root / "dockerd.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        try:
            if self.process is not None and self.process.poll() is None:
                try:
                    with contextlib.closing(self.client()) as client:
                        for container in client.containers.list(all=True):
                            container.remove(force=True)
                except docker.errors.DockerException:
                    pass  # stopping the daemon stops them anyway
                self.stop()
        finally:
            self._unmount_leftovers()
            if self._bridge_made:
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            shutil.rmtree(self.root, ignore_errors=True)

    def _unmount_leftovers(self) -> None:
        """Mounts a daemon that did not stop cleanly left under the directory (its data root, overlays)."""
        try:
            lines = Path("/proc/self/mountinfo").read_text().splitlines()
        except OSError:
            return
        prefix = str(self.root) + "/"
        points = [line.split()[4] for line in lines if len(line.split()) > 4 and line.split()[4].startswith(prefix)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)

"""The shutdown drain against the real systemd-logind: a request in flight survives ``systemctl poweroff``.

One bookworm host booting systemd as PID 1 (tests/support/systemd_host.py), the wheel and the checkout's units
installed, sharing this machine's network and Docker socket. systemd-logind and the system bus run there as on
a server, so ``meridian-node-shutdown-drain.service`` takes a real delay lock and hears the real
``PrepareForShutdown`` that ``systemctl poweroff`` makes logind send. logind's drop-in is the one
roles/node_agent installs (read from the role), re-read on SIGHUP as the role does.

What stands in: the engine is the stand-in vLLM image on this machine's Docker Engine, labelled as reconcile.yml
labels this node's engines; like vLLM it drops what is in flight on SIGTERM. dockerd does not run in the host,
so a ``docker.service`` there stops this node's engines through the socket when it is stopped at shutdown, as
dockerd's own shutdown does (SIGTERM, then the stop timeout). The drain unit is ordered after it, as after the
real one.

What is asserted: the lock is held once the unit is started; a ``PrepareForShutdown`` forged by the agent's user
on the same bus, even one addressed to the unit alone, changes nothing; on poweroff the engine is marked draining
while the host is still up, the request in flight completes with 200, and the engine is stopped only after that;
at the next boot the unit clears its own mark and an operator's stays. The control: with the unit disabled, the
same poweroff cuts the same request, so the harness can tell the difference. And without logind the unit fails
saying so, and its restart policy brings it back, holding a lock, once logind is there again.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_CONFIG_HASH,
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.tests.support.e2e_env import (
    BIND,
    engine_serving,
    free_engine_port,
    remove_containers,
    standin_vllm,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.systemd_host import CHECKOUT, VENV, SystemdHost
from ansible_collections.meridian.node.tests.support.systemd_site import CONFIG, ROOT_DIR, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.slow]

UNIT = "meridian-node-shutdown-drain.service"
DOCKER_STANDIN = "docker.service"
# How long the request in flight runs once the poweroff is asked for: longer than the settle wait (the test
# config's heartbeat of 1 s plus the agent's 5 s), shorter than the bound (60 s).
REQUEST_S = 15.0
# The unit's journal shows how it fares; the host's console and docker's view show the shutdown.
UNITS_TO_SHOW = (UNIT, DOCKER_STANDIN, "systemd-logind.service")

# dockerd's shutdown, for a host without dockerd: stop this node's running engines (SIGTERM, then the stop timeout).
STOP_ENGINES = """\
import sys
import meridian_node_agent  # puts the wheel's private copy of the collection on sys.path
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi
api = DockerApi.from_env()
for container in api.containers({"label": [f"meridian.node/owner={sys.argv[1]}"], "status": ["running"]}):
    print("stopping", container["Names"], flush=True)
    api.stop(container["Id"], 30)
"""
# The agent's user, on the system bus: a broadcast PrepareForShutdown, and one addressed to the drain alone.
FORGE = """\
import sys
from jeepney import DBusAddress, HeaderFields, new_signal
from jeepney.io.blocking import open_dbus_connection
connection = open_dbus_connection(bus="SYSTEM")
manager = DBusAddress("/org/freedesktop/login1", interface="org.freedesktop.login1.Manager")
connection.send(new_signal(manager, "PrepareForShutdown", "b", (True,)))
aimed = new_signal(manager, "PrepareForShutdown", "b", (True,))
aimed.header.fields[HeaderFields.destination] = sys.argv[1]
connection.send(aimed)
print(connection.unique_name)
"""


@dataclass
class Site:
    host: SystemdHost
    docker: Any
    node_id: str
    engine: str
    port: int
    image: LocalImage

    @property
    def mark(self) -> str:
        return f"{ROOT_DIR}/draining/{self.engine}.json"

    def start_engine(self) -> Any:
        """The engine, running (created the first time), as reconcile.yml would label it for this node."""
        found = self.docker.containers.list(all=True, filters={"name": self.engine})
        container = next((c for c in found if c.name == self.engine), None)
        if container is None:
            labels = {
                LABEL_OWNED: "true",
                LABEL_INSTANCE: self.engine,
                LABEL_DRIVER: "vllm",
                LABEL_CONFIG_HASH: "shutdown-drain-test",
                LABEL_OWNER: f"agent:{self.node_id}",
            }
            container = self.docker.containers.run(
                self.image.id,
                ["tiny", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "tiny-chat"],
                name=self.engine,
                detach=True,
                labels=labels,
                ports={"8000/tcp": (BIND, self.port)},
            )
        else:
            container.start()
        wait_until(f"engine {self.engine} serving", lambda: engine_serving(self.port), self.host, UNITS_TO_SHOW)
        return container

    def reboot(self) -> None:
        """Start the powered-off host again and wait until it is up (its drain unit started at boot)."""
        container = self.docker.containers.get(self.host.name)
        container.reload()
        assert container.status == "exited", f"the host is {container.status}, not powered off"
        container.start()
        deadline = time.monotonic() + 120
        while True:
            result = self.host.exec(["systemctl", "is-system-running", "--wait"], check=False, timeout=120)
            if result.stdout.strip() in ("running", "degraded") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert result.stdout.strip() == "running", self.host.diagnostics(*UNITS_TO_SHOW)

    def power_off(self) -> float:
        """``systemctl poweroff`` in the host, as an operator types it; returns when (wall clock) it was asked."""
        asked = time.time()
        result = self.host.exec(["systemctl", "poweroff"], check=False, timeout=60)
        assert result.returncode == 0 or "No such container" in result.stderr, result.stderr
        return asked

    def wait_powered_off(self, timeout: float = 120) -> datetime:
        container = self.docker.containers.get(self.host.name)
        deadline = time.monotonic() + timeout
        while True:
            container.reload()
            if container.status == "exited":
                return _docker_time(container.attrs["State"]["FinishedAt"])
            if time.monotonic() > deadline:  # a liveness bound, not a timing assertion
                raise AssertionError(f"the host did not power off within {timeout:g} s")
            time.sleep(0.2)

    def file_in_stopped_host(self, path: str) -> bytes | None:
        """A file of the powered-off host, read through Docker (nothing runs in it to ask)."""
        import io
        import tarfile

        import docker.errors

        try:
            stream, _stat = self.docker.containers.get(self.host.name).get_archive(path)
        except docker.errors.NotFound:
            return None
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
            member = archive.extractfile(archive.getmembers()[0])
            assert member is not None
            return member.read()


def _docker_time(text: str) -> datetime:
    # Docker writes nanoseconds; Python's fromisoformat takes at most microseconds.
    head, _, rest = text.partition(".")
    fraction = rest.rstrip("Z")[:6]
    return datetime.fromisoformat(f"{head}.{fraction}+00:00")


class Request:
    """One slow completion from this machine to the engine, as a gateway would send it, in its own thread."""

    def __init__(self, port: int, seconds: float) -> None:
        self.port = port
        self.outcome: tuple[Any, float] | None = None
        body = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 4, "standin_seconds": seconds})
        self._request = urllib.request.Request(
            f"http://{BIND}:{port}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()
        wait_in_flight(port)

    def _send(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=120) as response:
                self.outcome = (response.status, time.time())
        except Exception as exc:  # the outcome is what the test asserts on
            self.outcome = (repr(exc), time.time())

    def result(self, timeout: float = 120) -> tuple[Any, float]:
        self.thread.join(timeout)
        assert self.outcome is not None, f"the request did not end within {timeout:g} s"
        return self.outcome


def wait_in_flight(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"http://{BIND}:{port}/standin/in-flight", timeout=5) as answer:
            gauges = json.loads(answer.read())
        if gauges["running"] + gauges["waiting"] >= 1:
            return
        if time.monotonic() > deadline:  # a liveness bound, not a timing assertion
            raise AssertionError("the request never reached the engine")
        time.sleep(0.05)


def _role_logind_dropin() -> tuple[str, bytes]:
    """The logind drop-in roles/node_agent installs: its path and content, read from the role."""
    tasks = yaml.safe_load((CHECKOUT / "roles" / "node_agent" / "tasks" / "main.yml").read_text())
    for task in tasks:
        copy = task.get("ansible.builtin.copy", {})
        if str(copy.get("dest", "")).startswith("/etc/systemd/logind.conf.d/"):
            return copy["dest"], copy["content"].encode()
    raise AssertionError("roles/node_agent installs no logind drop-in")


@pytest.fixture(scope="module")
def site(installed_host: SystemdHost, docker_client: Any, standin_base_image: LocalImage) -> Iterator[Site]:
    host = installed_host
    node_id = f"sd-shutdown-{secrets.token_hex(3)}"
    config = {
        "node_id": node_id,
        "mode": "managed-host",
        # Never reached: no agent runs here. The settle wait is read from it (heartbeat 1 s, which may come 10 % late,
        # + 5 s).
        "control_plane": {"url": "https://127.0.0.1:9", "long_poll_seconds": 0, "heartbeat_seconds": 1},
        "apply": {"via": "systemd"},
        "log": {"format": "json", "level": "info"},
    }
    host.put_file(CONFIG, yaml.safe_dump(config).encode(), mode=0o640, owner="root:meridian")
    dropin, content = _role_logind_dropin()
    host.put_file(dropin, content, mode=0o644)
    host.exec(["systemctl", "kill", "--kill-whom=main", "--signal=SIGHUP", "systemd-logind.service"])
    host.put_file(f"{VENV}/libexec/stop-engines.py", STOP_ENGINES.encode(), mode=0o644)
    docker_unit = (
        "[Unit]\nDescription=stand-in for dockerd's shutdown: stops this node's engines when stopped\n"
        "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/true\n"
        f"ExecStop={VENV}/bin/python {VENV}/libexec/stop-engines.py agent:{node_id}\nTimeoutStopSec=60\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    host.put_file(f"/etc/systemd/system/{DOCKER_STANDIN}", docker_unit.encode(), mode=0o644)
    host.exec(["systemctl", "daemon-reload"])
    host.exec(["systemctl", "enable", "--now", DOCKER_STANDIN])
    # A persistent journal: what the drain logged during a shutdown is read after the reboot.
    host.sh("mkdir -p /var/log/journal && systemd-tmpfiles --create --prefix /var/log/journal && journalctl --flush")
    with standin_vllm(docker_client, standin_base_image) as image:
        site = Site(host, docker_client, node_id, f"mn-sd-shutdown-{secrets.token_hex(3)}", free_engine_port(), image)
        try:
            wait_until(
                "logind's InhibitDelayMaxSec raised by the role's drop-in",
                lambda: "75000000" in _logind_property(host, "InhibitDelayMaxUSec"),
                host,
                UNITS_TO_SHOW,
                timeout=30,
            )
            yield site
        finally:
            remove_containers(docker_client, [site.engine])


def _logind_property(host: SystemdHost, name: str) -> str:
    argv = ["busctl", "get-property", "org.freedesktop.login1", "/org/freedesktop/login1"]
    return host.exec([*argv, "org.freedesktop.login1.Manager", name], check=False).stdout


def _events(host: SystemdHost, unit: str, event: str) -> list[dict[str, Any]]:
    """The unit's JSON log events called ``event``, in every boot the journal holds. (A container's boots share
    the kernel's boot id, so ``journalctl -b -1`` cannot tell them apart here.)"""
    argv = ["journalctl", "--no-pager", "-o", "cat", "-u", unit]
    found = []
    for line in host.exec(argv, check=False).stdout.splitlines():
        if line.startswith("{") and json.loads(line).get("event") == event:
            found.append(json.loads(line))
    return found


def _inhibitors(host: SystemdHost) -> str:
    return host.exec(["systemd-inhibit", "--list", "--no-pager", "--no-legend"], check=False).stdout


def _bus_name_of(host: SystemdHost, unit: str) -> str:
    """The unique bus name the unit's process holds (``busctl list`` names each connection's unit)."""
    for line in host.exec(["busctl", "list", "--no-pager", "--no-legend", "--unique"]).stdout.splitlines():
        if unit in line.split():
            return line.split()[0]
    raise AssertionError(f"{unit} holds no connection to the system bus:\n{host.diagnostics(unit)}")


def test_poweroff_waits_for_the_request_in_flight_and_the_next_boot_clears_the_drain(site: Site) -> None:
    host = site.host
    engine = site.start_engine()
    operators = f"{ROOT_DIR}/draining/mn-sd-operators-engine.json"
    with host.logs_on_failure(*UNITS_TO_SHOW):
        host.exec(["systemctl", "enable", "--now", UNIT])  # Type=notify: returns once the lock is held
        assert "meridian-node" in _inhibitors(host) and "delay" in _inhibitors(host)
        # An operator's drain of an engine the node keeps, which no reboot may undo.
        mark = {"name": "mn-sd-operators-engine", "since": "2030-01-01T00:00:00Z", "reason": "drained by an operator"}
        host.put_file(operators, json.dumps(mark).encode(), mode=0o644)

        # The agent's user forges the signal, broadcast and addressed to the drain alone: nothing happens.
        target = _bus_name_of(host, UNIT)
        forger = host.exec([f"{VENV}/bin/python", "-c", FORGE, target], user="meridian").stdout.strip()
        wait_until(
            "the drain logging the forged signal it was sent",
            lambda: f'"sender": "{forger}"' in host.journal(UNIT),
            host,
            UNITS_TO_SHOW,
            timeout=30,
        )
        assert "shutdown-signal-ignored" in host.journal(UNIT)
        assert host.exec(["test", "-e", site.mark], check=False).returncode == 1
        assert "meridian-node" in _inhibitors(host)

        request = Request(site.port, REQUEST_S)
        asked = site.power_off()
        # Still up, held by the lock: the engine is marked before anything stops.
        wait_until(
            "the engine marked draining while the host is up",
            lambda: host.exec(["test", "-e", site.mark], check=False).returncode == 0,
            host,
            UNITS_TO_SHOW,
            timeout=30,
        )
        assert _logind_property(host, "PreparingForShutdown").strip() == "b true"

    status, finished = request.result()
    powered_off = site.wait_powered_off()
    engine.reload()
    engine_stopped = _docker_time(engine.attrs["State"]["FinishedAt"])
    print(
        f"poweroff asked -> request done {finished - asked:.1f} s -> engine stopped "
        f"{engine_stopped.timestamp() - asked:.1f} s -> host off {powered_off.timestamp() - asked:.1f} s"
    )
    assert status == 200, f"the request in flight was cut: {status}"
    assert engine.status == "exited"  # the shutdown did stop it, as dockerd's does
    assert finished <= engine_stopped.timestamp(), "the engine was stopped before its request completed"
    written = site.file_in_stopped_host(site.mark)
    assert written is not None
    assert json.loads(written)["reason"].startswith("host shutting down: drained by meridian-node-shutdown-drain")

    site.reboot()
    with host.logs_on_failure(*UNITS_TO_SHOW):
        host.wait_unit(UNIT, "active")
        assert host.exec(["test", "-e", site.mark], check=False).returncode == 1  # the drain was boot-scoped
        assert json.loads(host.read_file(operators))["reason"] == "drained by an operator"
        assert "shutdown-marks-cleared" in host.journal(UNIT)
        drained = _events(host, UNIT, "shutdown-drain-done")
        assert len(drained) == 1, host.journal(UNIT)
        (done,) = drained
        assert done["engines"] == [site.engine] and done["marked"] == [site.engine]
        # A heartbeat of 1 s that may come 10 % late (every timer of the agent is jittered) + the agent's 5 s.
        assert done["still_busy"] is None and done["settled_s"] == 6.1
        assert REQUEST_S - 2 < done["waited_s"] < 60
        print(f"the drain, as it logged it: {done}")
        assert "meridian-node" in _inhibitors(host)  # armed again
        print(f"systemd-analyze security {UNIT}: {host.unit_security_score(UNIT)}")
    host.exec(["rm", "-f", operators])


def test_without_the_drain_the_same_poweroff_cuts_the_request(site: Site) -> None:
    # The control: the harness's shutdown really stops the engine under a request; only the drain saves it.
    host = site.host
    site.start_engine()
    host.exec(["systemctl", "disable", "--now", UNIT])
    try:
        assert "meridian-node" not in _inhibitors(host)
        request = Request(site.port, REQUEST_S)
        site.power_off()

        status, _finished = request.result()
        site.wait_powered_off()

        assert status != 200, "the request survived without the drain: the test would not notice a broken drain"
        assert "RemoteDisconnected" in str(status) or "Connection" in str(status)
    finally:
        site.reboot()
        host.exec(["systemctl", "enable", "--now", UNIT])


def test_without_logind_the_unit_fails_saying_why_and_recovers_on_its_own_once_logind_is_back(site: Site) -> None:
    host = site.host
    host.exec(["systemctl", "stop", UNIT])
    host.exec(["systemctl", "reset-failed", UNIT], check=False)
    host.exec(["systemctl", "mask", "--runtime", "--now", "systemd-logind.service"])
    try:
        started = host.exec(["systemctl", "start", UNIT], check=False)

        assert started.returncode != 0  # Type=notify: no lock, no READY=1
        journal = host.journal(UNIT)
        assert "is systemd-logind running" in journal
        print(next(line for line in journal.splitlines() if "error:" in line))
        assert host.exec(["systemctl", "show", "--property=ExecMainStatus", "--value", UNIT]).stdout.strip() == "1"
        assert host.unit_state(UNIT) in ("activating", "failed")  # waiting RestartSec= (10 s) for the next try
    finally:
        host.exec(["systemctl", "unmask", "--runtime", "systemd-logind.service"])
        host.exec(["systemctl", "start", "systemd-logind.service"])
    # Restart=on-failure takes it from there: nobody starts it by hand.
    wait_until("the unit back, holding the lock", lambda: "meridian-node" in _inhibitors(host), host, UNITS_TO_SHOW)
    assert host.unit_state(UNIT) == "active"

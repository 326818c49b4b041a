"""A meridian-node site on a systemd test host (``systemd_host.installed_host``): what the tests under
tests/system/systemd_host/ each set up the same way, as docs/SECURITY.md tells an operator to.

``install_site`` writes the trusted keys, the policy (root's, 0644), the agent's config (root:meridian,
0640), checks it with ``meridian-node check-config`` and makes the agent's directory as the unit's
``StateDirectory=`` would, so that enrolling (``enroll``) can write there before the agent first starts;
``install_managed_site`` does both for a managed-host site of a devserver. ``site_parts`` (``SiteParts``) is what
a module builds its site from: the installed host, the Docker Engine, the stand-in image, a devserver.
``site_policy`` and ``split_config`` are the policy and config those sites share; ``site_engine`` the stand-in
engine their states ask for (cleaned up afterwards); ``SplitSite`` what each test module's site reads of the
host; ``wait_until`` the liveness bound their waits share; ``refused_as_meridian`` the check that the agent's user
is refused what it must not do to root's side.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, running
from ansible_collections.meridian.node.tests.support.e2e_env import (
    engine_serving,
    engine_spec,
    free_engine_port,
    remove_containers,
    standin_policy,
    standin_vllm,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.systemd_host import VENV, SystemdHost

__all__ = [
    "AGENT_DIR",
    "AGENT_UNIT",
    "APPLY_PATH_UNIT",
    "APPLY_UNIT",
    "BIN",
    "CONFIG",
    "POLICY",
    "ROOT_DIR",
    "SiteEngine",
    "SiteParts",
    "SplitSite",
    "agent_oplog",
    "as_meridian",
    "enroll",
    "install_managed_site",
    "install_site",
    "refused_as_meridian",
    "root_generation",
    "root_record",
    "site_engine",
    "site_parts",
    "site_policy",
    "split_config",
    "wait_until",
]

T = TypeVar("T")

BIN = f"{VENV}/bin/meridian-node"
CONFIG = "/etc/meridian-node/config.yaml"
POLICY = "/etc/meridian/policy.yaml"
AGENT_DIR, ROOT_DIR = "/var/lib/meridian-node", "/var/lib/meridian-node-apply"
AGENT_UNIT = "meridian-node.service"
APPLY_PATH_UNIT, APPLY_UNIT = "meridian-node-apply.path", "meridian-node-apply.service"
_CA = "/etc/meridian-node/ca.pem"


def install_site(
    host: SystemdHost,
    *,
    policy: Mapping[str, Any],
    config: Mapping[str, Any],
    keys: Mapping[str, bytes],
    ca_bundle: bytes | None = None,
) -> None:
    """Install ``keys`` (a name under /etc/meridian/keys -> PEM; the policy names them as ``keys/NAME``), the
    policy, the control plane's CA (when the site has one) and the config; ``check-config`` must pass."""
    for name, pem in keys.items():
        host.put_file(f"/etc/meridian/keys/{name}", pem, mode=0o644)
    host.put_file(POLICY, yaml.safe_dump(dict(policy)).encode(), mode=0o644)
    if ca_bundle is not None:
        host.put_file(_CA, ca_bundle, mode=0o644)
    host.put_file(CONFIG, yaml.safe_dump(dict(config)).encode(), mode=0o640, owner="root:meridian")
    host.exec(["install", "-d", "-o", "meridian", "-g", "meridian", "-m", "0750", AGENT_DIR])
    host.exec([BIN, "check-config"])


def enroll(host: SystemdHost, token: str) -> None:
    """``meridian-node enroll`` as the agent's user, with the CA ``install_site`` wrote."""
    host.exec(["runuser", "-u", "meridian", "--", BIN, "enroll", "--token", token, "--ca-bundle", _CA])


def install_managed_site(host: SystemdHost, server: DevServer, config: Mapping[str, Any]) -> None:
    """A managed-host site of ``server`` (a devserver on this machine): ``install_site`` with the server's control
    key trusted, its CA and ``config`` (``split_config``), then the node ``config`` names enrolled with a token
    made for it."""
    node_id = str(config["node_id"])
    install_site(
        host,
        policy=site_policy(trust={"control": "control.pem"}, modes=["managed-host"]),
        config=config,
        keys={"control.pem": server.control_public_key.read_bytes()},
        ca_bundle=server.ca_bundle.read_bytes(),
    )
    enroll(host, server.new_token_for(f"t-{node_id}", node_id))


def as_meridian(host: SystemdHost, script: str, *, check: bool = True, input: bytes | None = None) -> Any:
    """``sh -euc script`` as the agent's user (what an attacker holding that account can do)."""
    return host.exec(["runuser", "-u", "meridian", "--", "sh", "-euc", script], check=check, input=input)


def refused_as_meridian(host: SystemdHost, scripts: Sequence[str], *, reasons: Sequence[str]) -> None:
    """Each of ``scripts``, run as the agent's user (``as_meridian``), fails with one of ``reasons`` on its stderr:
    what that account must not be able to do to root's side."""
    for script in scripts:
        result = as_meridian(host, script, check=False)
        assert result.returncode != 0, f"as meridian, {script!r} succeeded"
        assert any(reason in result.stderr for reason in reasons), result.stderr


def site_policy(*, trust: Mapping[str, str], modes: Sequence[str]) -> dict[str, Any]:
    """The policy of a site that runs the stand-in vLLM engine: ``trust`` maps each role to the one key it
    trusts (a file name under /etc/meridian/keys, threshold 1); the stand-in engine may run (``standin_policy``);
    the agent may run in ``modes``."""
    return {
        "trust": {role: {"threshold": 1, "public_keys": [f"keys/{key}"]} for role, key in trust.items()},
        **standin_policy(),
        "agent": {"allowed_modes": list(modes)},
    }


def split_config(node_id: str, mode: str, *, control_plane: str | None = None, **sections: Any) -> dict[str, Any]:
    """The agent's config for a site under the privilege split: applies go through root's units
    (``apply.via: systemd``, 300 s), logs are JSON at info. ``control_plane``: its URL, polled without a long
    poll and heartbeating every second; ``sections``: more top-level sections (``air_gap``, ``supervision``)."""
    config: dict[str, Any] = {"node_id": node_id, "mode": mode}
    if control_plane is not None:
        config["control_plane"] = {"url": control_plane, "long_poll_seconds": 0, "heartbeat_seconds": 1}
    return {
        **config,
        "apply": {"via": "systemd", "timeout_seconds": 300},
        **sections,
        "log": {"format": "json", "level": "info"},
    }


@dataclass(frozen=True)
class SiteEngine:
    """The stand-in vLLM engine a site's desired state asks for: its name (the container's), port and image."""

    name: str
    port: int
    image: LocalImage

    def spec(self) -> dict[str, Any]:
        """The engine as a desired state lists it (``engine_spec``)."""
        return engine_spec(self.name, self.image, self.port)

    def serving(self) -> bool:
        """Whether the engine answers its health check on this machine now, on the port its container publishes:
        the agent's reconcile replaces beside the old container, and the engine then keeps the free port."""
        container = DockerEngine.from_env().find(self.name)
        ports = [] if container is None else [p.host_port for p in container.ports if p.protocol == "tcp"]
        return bool(ports) and engine_serving(ports[0])


@contextmanager
def site_engine(
    host: SystemdHost, docker_client: Any, base_image: LocalImage, stem: str, *, stop_units: Sequence[str]
) -> Iterator[SiteEngine]:
    """A fresh engine name (``mn-sd-STEM-...``) and free port, and the stand-in vLLM image tagged for it. When the
    block ends, pass or fail, ``stop_units`` are stopped in ``host`` (so that nothing starts the engine again),
    then its container is removed from this machine's Docker Engine, which root inside the host drives."""
    with standin_vllm(docker_client, base_image) as image:
        engine = SiteEngine(f"mn-sd-{stem}-{secrets.token_hex(3)}", free_engine_port(), image)
        try:
            yield engine
        finally:
            host.exec(["systemctl", "stop", *stop_units], check=False)
            remove_containers(docker_client, [engine.name])


@dataclass(frozen=True)
class SiteParts:
    """What a test module builds its site from: the installed systemd host (one per module), this machine's Docker
    Engine (which root inside the host drives), the stand-in's base image and the session's temporary directories."""

    host: SystemdHost
    docker: Any
    base_image: LocalImage
    tmp_path_factory: pytest.TempPathFactory

    def node_id(self, stem: str) -> str:
        """A fresh node id, ``sd-STEM-...``."""
        return f"sd-{stem}-{secrets.token_hex(3)}"

    def engine(self, stem: str, *, stop_units: Sequence[str]) -> AbstractContextManager[SiteEngine]:
        """The site's stand-in engine (``site_engine``)."""
        return site_engine(self.host, self.docker, self.base_image, stem, stop_units=stop_units)

    def devserver(self, stem: str) -> AbstractContextManager[DevServer]:
        """A devserver process on this machine for the site, its data in a directory of its own."""
        return running(self.tmp_path_factory.mktemp(f"sd-{stem}-devserver") / "data")


@pytest.fixture(scope="module")
def site_parts(
    installed_host: SystemdHost,
    docker_client: Any,
    standin_base_image: LocalImage,
    tmp_path_factory: pytest.TempPathFactory,
) -> SiteParts:
    """The module's ``SiteParts``."""
    return SiteParts(installed_host, docker_client, standin_base_image, tmp_path_factory)


@dataclass
class SplitSite:
    """A site under the privilege split, for a test module's tests to read: the systemd host, the node's id, the
    engine its state asks for, and this machine's Docker Engine (which root inside the host drives). A module
    subclasses it with what else its tests look at."""

    host: SystemdHost
    node_id: str
    stand_in: SiteEngine
    docker: Any

    @property
    def engine(self) -> str:
        """The engine's name, which is its container's."""
        return self.stand_in.name

    def serving(self) -> bool:
        """Whether the engine answers its health check now (``SiteEngine.serving``)."""
        return self.stand_in.serving()

    def root_record(self) -> dict[str, Any]:
        """Root's applied-state record in the host (``root_record``)."""
        return root_record(self.host)

    def root_generation(self) -> int:
        """The generation root's record says is applied, 0 before any (``root_generation``)."""
        return root_generation(self.host)

    def oplog(self) -> list[dict[str, Any]]:
        """The agent's operations log in the host (``agent_oplog``)."""
        return agent_oplog(self.host)


def root_record(host: SystemdHost) -> dict[str, Any]:
    """Root's applied-state record (``applied.json`` in root's directory), which must exist."""
    document: dict[str, Any] = json.loads(host.read_file(f"{ROOT_DIR}/applied.json"))
    return document


def agent_oplog(host: SystemdHost) -> list[dict[str, Any]]:
    """The agent's operations log (``oplog.jsonl`` in its directory), one entry a line, oldest first."""
    return [json.loads(line) for line in host.read_file(f"{AGENT_DIR}/oplog.jsonl").splitlines()]


def root_generation(host: SystemdHost) -> int:
    """The generation root's record says is applied; 0 while root has recorded none."""
    result = host.exec(["cat", f"{ROOT_DIR}/applied.json"], check=False)
    return int(json.loads(result.stdout)["generation"]) if result.returncode == 0 else 0


def wait_until(
    what: str, check: Callable[[], T | None], host: SystemdHost, units: Sequence[str], *, timeout: float = 180
) -> T:
    """Poll ``check`` until it returns something true, and return that. Past ``timeout`` (a liveness bound,
    not a timing assertion) fail, saying ``what`` was awaited, with the diagnostics of ``units`` in ``host``."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:g} s:\n{host.diagnostics(*units)}")
        time.sleep(0.3)

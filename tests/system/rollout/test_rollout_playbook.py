"""playbooks/rollout.yml and the engines role, run by ansible-playbook over a fleet of three "hosts".

The hosts are inventory aliases of this machine (local connection, the venv's interpreter), each with its own
policy, artifact store, state dir and engine name and port, all on the real Docker Engine with the stand-in
vLLM image. Every container carries the test's random prefix and is removed afterwards, pass or fail.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    REPO,
    SERVER,
    VENV_BIN,
    Host,
    free_port,
    hold_requests,
    run_playbook,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    artifact_manifest,
    make_key,
    signed,
    write_policy,
)

PLAYBOOK = REPO / "playbooks" / "rollout.yml"
HOSTS = ("h1", "h2", "h3")
# Only used as an env value: it must never reach the output, even with -v.
SECRET = "tok-0b7d2e4c-rollout-secret"
ARTIFACT_KEY = make_key()
RECAP = re.compile(r"^(h\d)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def image(docker_client: Any, standin_base_image: LocalImage) -> LocalImage:
    return ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")


def distinct_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class Fleet:
    """Three hosts on this machine; an inventory gives each its own policy, state dir, engine and port."""

    def __init__(self, root: Path, docker_client: Any, image: LocalImage, prefix: str) -> None:
        self.root = root
        self.client = docker_client
        self.hosts = {alias: Host(root / alias, docker_client) for alias in HOSTS}
        self.names = {alias: f"{prefix}-{alias}" for alias in HOSTS}
        self.ports = dict(zip(HOSTS, distinct_ports(len(HOSTS)), strict=True))
        self.image = image

    def publish_artifact(self, name: str, version: str) -> dict[str, Any]:
        """Trust an artifact key on every host and sign one model; the role's entry for it."""
        weights = secrets.token_bytes(4096)
        source = self.root / "source" / name / version
        source.mkdir(parents=True)
        (source / "weights.bin").write_bytes(weights)
        files = [{"path": "weights.bin", "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}]
        manifest = self.root / "source" / f"{name}-{version}.manifest.json"
        payload = artifact_manifest(name=name, version=version, files=files)
        manifest.write_bytes(signed("artifact-manifest", payload, [ARTIFACT_KEY]))
        for host in self.hosts.values():
            policy = yaml.safe_load(host.policy.read_text())
            sections = {key: value for key, value in policy.items() if key != "trust"}
            write_policy(host.policy.parent, control=[make_key()], artifact=[ARTIFACT_KEY], extra=sections)
        return {"manifest": str(manifest), "source": str(source), "pin": True}

    def spec(self, alias: str, **overrides: Any) -> dict[str, Any]:
        return {
            "name": self.names[alias],
            "driver": "vllm",
            "image": self.image.pinned,
            "model": {"name": "tiny"},
            "served_model_name": "chat-v1",
            "port": self.ports[alias],
            "secret_env": {"API_TOKEN": SECRET},
            **overrides,
        }

    def rollout(
        self,
        specs: Mapping[str, Mapping[str, Any]],
        *,
        artifacts: list[dict[str, Any]] | None = None,
        extra_vars: Mapping[str, Any] | None = None,
        verbose: bool = False,
        check: bool = False,
    ) -> tuple[int, str]:
        """Run rollout.yml with these engine specs per host; (exit status, stdout and stderr)."""
        inventory = {
            "gpu_hosts": {
                "hosts": {
                    alias: {
                        "ansible_connection": "local",
                        "ansible_python_interpreter": str(VENV_BIN / "python"),
                        "engines_policy": str(host.policy),
                        "engines_state_dir": str(host.state_dir),
                        "engines_instances": [dict(specs[alias])],
                        "engines_artifacts": artifacts or [],
                    }
                    for alias, host in self.hosts.items()
                }
            }
        }
        path = self.root / f"inventory-{secrets.token_hex(3)}.yml"
        path.write_text(yaml.safe_dump(inventory))
        # rollout_become=false: the tests already run as the user that owns the Docker socket.
        variables = {"rollout_become": False, **(extra_vars or {})}
        flags = [*(["-v"] if verbose else []), *(["--check"] if check else [])]
        proc = run_playbook(
            PLAYBOOK,
            temp_dir=self.root / "ansible-tmp",
            extra_args=["-i", str(path), "-e", json.dumps(variables), *flags],
        )
        return proc.returncode, proc.stdout + proc.stderr

    def container(self, alias: str) -> Any:
        return self.hosts[alias].container(self.names[alias])


def recap(output: str) -> dict[str, dict[str, int]]:
    return {
        host: {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable), "failed": int(failed)}
        for host, ok, changed, unreachable, failed in RECAP.findall(output)
    }


def models(port: int) -> str:
    with urllib.request.urlopen(f"http://{BIND}:{port}/v1/models", timeout=5) as response:
        return str(response.read().decode())


@pytest.fixture
def fleet(tmp_path: Path, docker_client: Any, image: LocalImage, prefix: str) -> Fleet:
    return Fleet(tmp_path, docker_client, image, prefix)


def test_rollout_converges_every_host_with_its_signed_model_and_a_rerun_changes_nothing(fleet: Fleet) -> None:
    artifacts = [fleet.publish_artifact("tiny-model", "1.0")]
    specs = {alias: fleet.spec(alias, model={"artifact": "tiny-model"}) for alias in HOSTS}

    # A dry run on fresh hosts: the artifact is not in any store yet, and the plan still comes out.
    status, output = fleet.rollout(specs, artifacts=artifacts, check=True)
    assert status == 0, output[-6000:]
    assert {host: (counts["changed"], counts["failed"]) for host, counts in recap(output).items()} == dict.fromkeys(
        HOSTS, (2, 0)
    ), output[-3000:]
    assert "has no promoted version in the store" in output
    assert all(fleet.container(alias) is None for alias in HOSTS)
    assert not any((fleet.hosts[alias].store / "artifacts" / "tiny-model").exists() for alias in HOSTS)

    status, output = fleet.rollout(specs, artifacts=artifacts, verbose=True)

    assert status == 0, output[-6000:]
    assert {host: counts["failed"] for host, counts in recap(output).items()} == dict.fromkeys(HOSTS, 0)
    for alias in HOSTS:
        container = fleet.container(alias)
        assert container is not None and container.status == "running", alias
        assert "chat-v1" in models(fleet.ports[alias])
        assert f"API_TOKEN={SECRET}" in container.attrs["Config"]["Env"]
        version = fleet.hosts[alias].store / "artifacts" / "tiny-model" / "1.0"
        assert [(m["Source"], m["RW"]) for m in container.attrs["Mounts"]] == [(str(version), False)]
    assert SECRET not in output, "an engine's secret_env value reached the playbook output"

    ids = {alias: fleet.container(alias).id for alias in HOSTS}
    status, output = fleet.rollout(specs, artifacts=artifacts, verbose=True)

    assert status == 0, output[-6000:]
    assert {host: (counts["changed"], counts["failed"]) for host, counts in recap(output).items()} == dict.fromkeys(
        HOSTS, (0, 0)
    ), output[-3000:]
    assert {alias: fleet.container(alias).id for alias in HOSTS} == ids
    assert SECRET not in output

    status, output = fleet.rollout(specs, artifacts=artifacts, check=True)
    assert status == 0, output[-6000:]
    assert {host: counts["changed"] for host, counts in recap(output).items()} == dict.fromkeys(HOSTS, 0)


def _watch_replacements(fleet: Fleet, stop: threading.Event, seen: dict[str, str]) -> None:
    """When a host's engine is first marked draining, record what the previous host's engine serves then."""
    while not stop.is_set():
        for index, alias in enumerate(HOSTS):
            mark = fleet.hosts[alias].state_dir / "draining" / f"{fleet.names[alias]}.json"
            if alias not in seen and mark.exists():
                if index == 0:
                    seen[alias] = "first"
                else:
                    try:
                        seen[alias] = models(fleet.ports[HOSTS[index - 1]])
                    except OSError as exc:  # the previous host's engine not answering is the finding
                        seen[alias] = f"no answer: {exc!r}"
        time.sleep(0.02)


def test_spec_change_replaces_host_by_host_each_drained_first(fleet: Fleet) -> None:
    status, output = fleet.rollout({alias: fleet.spec(alias) for alias in HOSTS})
    assert status == 0, output[-6000:]
    old = {alias: fleet.container(alias).id for alias in HOSTS}
    changed = {alias: fleet.spec(alias, served_model_name="chat-v2") for alias in HOSTS}

    # A dry run first: every host reports the replacement, and no engine is touched.
    status, output = fleet.rollout(changed, check=True)
    assert status == 0, output[-6000:]
    assert {host: counts["changed"] for host, counts in recap(output).items()} == dict.fromkeys(HOSTS, 1)
    assert {alias: fleet.container(alias).id for alias in HOSTS} == old

    # vLLM aborts requests on SIGTERM: only a drain lets these finish.
    threads, outcomes = hold_requests(fleet.ports["h1"], 3, seconds=3)
    stop = threading.Event()
    seen: dict[str, str] = {}
    watcher = threading.Thread(target=_watch_replacements, args=(fleet, stop, seen))
    watcher.start()
    try:
        status, output = fleet.rollout(changed, extra_vars={"rollout_batch": 1})
    finally:
        stop.set()
        watcher.join()
        for thread in threads:
            thread.join(timeout=60)

    assert status == 0, output[-6000:]
    assert [outcome for outcome, _at in outcomes] == [200, 200, 200]
    assert set(seen) == set(HOSTS), f"not every engine was drained before its replacement: {seen}"
    # Serial: when h2's engine began draining, h1's replacement was already up with the new spec; same for h3.
    assert "chat-v2" in seen["h2"], seen
    assert "chat-v2" in seen["h3"], seen
    for alias in HOSTS:
        container = fleet.container(alias)
        assert container.id != old[alias], alias
        assert "chat-v2" in models(fleet.ports[alias])
    batches = output.split("PLAY [Roll out the engines in batches]")[1:]
    assert [[alias for alias in HOSTS if f"[{alias}]" in batch] for batch in batches] == [["h1"], ["h2"], ["h3"]]
    assert {host: counts["changed"] for host, counts in recap(output).items()} == dict.fromkeys(HOSTS, 1)


def test_failure_on_the_first_host_stops_the_rollout_and_later_hosts_keep_their_engine(fleet: Fleet) -> None:
    status, output = fleet.rollout({alias: fleet.spec(alias) for alias in HOSTS})
    assert status == 0, output[-6000:]
    before = {alias: (fleet.container(alias).id, fleet.container(alias).attrs["Args"]) for alias in HOSTS}

    taken = free_port()
    with socket.socket() as holder:
        holder.bind((BIND, taken))
        holder.listen()
        specs = {alias: fleet.spec(alias, served_model_name="chat-v2") for alias in HOSTS}
        specs["h1"] = fleet.spec("h1", served_model_name="chat-v2", port=taken)
        status, output = fleet.rollout(specs, extra_vars={"rollout_max_fail_percentage": 0})

    assert status != 0
    assert f"{fleet.names['h1']}: " in output and "placement-port" in output, output[-4000:]
    assert f"port {taken} on {BIND} is already in use" in output
    counts = recap(output)
    assert counts["h1"]["failed"] == 1
    assert "h2" not in counts and "h3" not in counts, "a host after the failed batch was touched"
    for alias in HOSTS:
        container = fleet.container(alias)
        assert (container.id, container.attrs["Args"]) == before[alias], alias
        assert container.status == "running", alias
        assert "chat-v1" in models(fleet.ports[alias])


def test_engine_left_draining_fails_the_readiness_check_and_stops_the_rollout_at_its_host(fleet: Fleet) -> None:
    specs = {alias: fleet.spec(alias) for alias in HOSTS}
    status, output = fleet.rollout(specs)
    assert status == 0, output[-6000:]
    # An operator drained h2's engine earlier and never put it back: it runs, answers, and gets no traffic.
    mark_draining(str(fleet.hosts["h2"].state_dir), fleet.names["h2"], reason="maintenance")

    status, output = fleet.rollout(specs)

    assert status != 0
    assert f"Not ready on h2: {fleet.names['h2']} (state running, ready True, draining True)." in output, output[-4000:]
    assert "drain_state=undrained" in output
    counts = recap(output)
    assert (counts["h1"]["failed"], counts["h2"]["failed"]) == (0, 1)
    assert "h3" not in counts, "the batch after the failed host was started"


@pytest.mark.parametrize(
    ("broken", "words"),
    [
        ({"port": None}, "missing required arguments: port"),
        ({"driver": "triton"}, "value of driver must be one of"),
        ({"replace_strategy": "yolo"}, "value of replace_strategy must be one of"),
    ],
    ids=["engine without a port", "unknown driver", "unknown replace strategy"],
)
def test_role_refuses_bad_engine_variables_by_name_before_touching_a_host(
    fleet: Fleet, broken: dict[str, Any], words: str
) -> None:
    specs = {alias: fleet.spec(alias) for alias in HOSTS}
    specs["h1"] = {key: value for key, value in {**specs["h1"], **broken}.items() if value is not None}
    status, output = fleet.rollout(specs)

    assert status != 0
    assert words in output, output[-4000:]
    assert "engines_instances" in output, "the message does not name the variable"
    assert SECRET not in output
    assert fleet.container("h1") is None
    assert fleet.container("h2") is None, "the rollout went on after the first batch failed"


def test_role_prunes_only_its_owners_dropped_engines_and_only_when_asked(fleet: Fleet) -> None:
    # The "hosts" share one Docker Engine: each gets its own owner, as each real host's engines would be its own.
    owned = {"engines_owner": "ops-{{ inventory_hostname }}"}
    status, output = fleet.rollout({alias: fleet.spec(alias) for alias in HOSTS}, extra_vars=owned)
    assert status == 0, output[-6000:]
    new_ports = dict(zip(HOSTS, distinct_ports(len(HOSTS)), strict=True))
    renamed = {alias: fleet.spec(alias, name=f"{fleet.names[alias]}-b", port=new_ports[alias]) for alias in HOSTS}

    status, output = fleet.rollout(renamed, extra_vars=owned)
    assert status == 0, output[-6000:]
    assert all(fleet.container(alias).status == "running" for alias in HOSTS), "pruned without engines_prune"

    status, output = fleet.rollout(renamed, extra_vars={**owned, "engines_prune": True}, verbose=True)
    assert status == 0, output[-6000:]
    for alias in HOSTS:
        assert fleet.container(alias) is None, f"{alias}: the dropped engine was kept"
        renamed_engine = fleet.hosts[alias].container(renamed[alias]["name"])
        assert renamed_engine is not None and renamed_engine.status == "running", alias
    assert SECRET not in output

"""Shared harness for the engine module tests: a host (policy, store, state dir) that runs playbooks, ports,
and helpers that hold slow requests in flight on a stand-in engine.

Used by tests/collection/modules/test_engine_instance_module.py, test_drain_module.py and test_engine_discovery.py.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.tests.support.ports import reserve_ports
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image
from ansible_collections.meridian.node.tests.support.trust_fixtures import SigningKey, make_key, write_policy

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
SERVER = REPO / "tests" / "support" / "standin_server.py"
BIND = "127.0.0.1"
PORTS = (8100, 8999)


def engine_images(client: Any, base: LocalImage, drivers: Sequence[str]) -> dict[str, LocalImage]:
    """The stand-in image of each driver in ``drivers`` (``ensure_engine_image`` with this harness's SERVER)."""
    return {driver: ensure_engine_image(client, base, SERVER, engine=driver) for driver in drivers}


def issue_25_engine(image: LocalImage, name: str, **extra: Any) -> dict[str, Any]:
    """The engine of issue 25's secret_env tests: the stand-in vLLM with plain ``env`` values (``tgi``, ``1``) that
    a masking of env would star everywhere; the caller adds its ``secret_env`` in ``extra``."""
    return {
        "name": name,
        "driver": "vllm",
        "image": image.pinned,
        "model": {"name": "tiny"},
        "port": free_port(),
        "env": {"MODE": "tgi", "FLAG": "1"},
        **extra,
    }


def standin_policy(
    directory: Path,
    drivers: Sequence[str],
    *,
    control: Sequence[SigningKey] = (),
    artifact: Sequence[SigningKey] = (),
    port_range: Sequence[int] = PORTS,
    store: Mapping[str, Any] | None = None,
    **engines: Any,
) -> Path:
    """Write the policy the stand-in engines run under into ``directory``; its path.

    Images only from the stand-ins' repository; ``drivers`` on BIND in ``port_range``, plus ``engines``, more
    settings of the policy's ``engines`` section (allowed volume sources, host IPC). ``store`` is the ``store``
    section, left out where None. ``control`` and ``artifact`` are the keys trusted (``write_policy``); no
    ``control`` key: one nobody holds, for a host that is given no signed state.
    """
    sections: dict[str, Any] = {
        "images": {"allowed_repositories": ["meridian-node/standin"]},
        "engines": {"allowed_drivers": list(drivers), "bind_address": BIND, "port_range": list(port_range), **engines},
    }
    if store is not None:
        sections["store"] = dict(store)
    return write_policy(directory, control=list(control) or [make_key()], artifact=artifact, extra=sections)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of PORTS that can be bound on BIND now and that no other test picked lately
    (``reserve_ports``: tests side by side would otherwise pick the same)."""
    return reserve_ports(*PORTS, count)


def run_foreign_engine(client: Any, image_id: str, name: str, *, seconds: int) -> Any:
    """Someone else's container, running ``sleep seconds`` in ``image_id``: no labels of ours, but it publishes
    Ollama's port (11434) on BIND, so discovery lists it, as an engine meridian.node does not manage."""
    container = client.containers.run(
        image_id, ["sleep", str(seconds)], name=name, detach=True, init=True, ports={"11434/tcp": (BIND, None)}
    )
    container.reload()
    return container


def run_playbook(
    playbook: Path,
    *,
    temp_dir: Path,
    collections: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    host_vars: str = f"ansible_connection=local ansible_python_interpreter={VENV_BIN / 'python'}",
) -> subprocess.CompletedProcess[str]:
    """``ansible-playbook`` against localhost (local connection, the venv's interpreter), as the tests run it.

    ``host_vars`` go in as extra vars, which nothing in a playbook overrides: a test that sets the interpreter
    per task passes only the connection."""
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": collections or str(REPO / ".build" / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
        "ANSIBLE_LOCAL_TEMP": str(temp_dir),
        **(extra_env or {}),
    }
    return subprocess.run(
        [
            str(VENV_BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-e",
            host_vars,
            *extra_args,
            str(playbook),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


class Host:
    """A policy, an artifact store and a state dir in a temporary directory; runs playbooks against them."""

    # tgi is left out so that a refusal test has a driver the policy does not allow.
    DRIVERS = ("vllm", "llamacpp", "ollama", "openai", "sglang", "lmdeploy")

    def __init__(self, root: Path, docker_client: Any, drivers: Sequence[str] = DRIVERS) -> None:
        self.root = root
        self.client = docker_client
        self.store = root / "store"
        self.state_dir = root / "state"
        version = self.store / "artifacts" / "tiny" / "v1"
        version.mkdir(parents=True)
        (version / "config.json").write_text("{}")
        (version / "tiny-q4.gguf").write_bytes(b"GGUF")
        (self.store / "artifacts" / "tiny" / "current").symlink_to("v1")
        self.state_dir.mkdir()
        self.policy = standin_policy(root / "policy", drivers, store={"path": str(self.store)})

    def params(self, **spec: Any) -> dict[str, Any]:
        return {"policy": str(self.policy), "state_dir": str(self.state_dir), **spec}

    def engine(
        self, images: Mapping[str, LocalImage], name: str, driver: str, port: int | None = None, **spec: Any
    ) -> dict[str, Any]:
        """engine_instance's params for engine ``name``: ``driver``'s stand-in image in ``images``, pinned, on
        ``port`` (a free port when None), with the rest of ``spec``."""
        port = free_port() if port is None else port
        return self.params(name=name, driver=driver, image=images[driver].pinned, port=port, **spec)

    def started(
        self, images: Mapping[str, LocalImage], name: str, driver: str, **spec: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Apply engine ``name`` (``engine``'s params), which must get ready: its params and the applied result."""
        params = self.engine(images, name, driver, **spec)
        applied: dict[str, Any] = self.play([("apply", params, False)])["apply"]
        assert applied.get("ready") is True, applied.get("msg")
        return params, applied

    def play(self, steps: Sequence[tuple[str, Mapping[str, Any], bool]], nvml: str | None = None) -> dict[str, Any]:
        """Run ``(label, module params, check_mode)`` steps in order; every step's registered result by label."""
        return self.play_module("meridian.node.engine_instance", steps, nvml=nvml)[0]

    def play_module(
        self,
        module: str,
        steps: Sequence[tuple[str, Mapping[str, Any], bool]],
        *,
        nvml: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> tuple[dict[str, Any], str]:
        """Run ``module`` once per ``(label, params, check_mode)`` step in one playbook, with ``--diff``.

        Returns every step's registered result by label, and the playbook's output. ``nvml`` names a fake NVML
        scenario (tests/support/fakes/nvml_scenarios) for engines that ask for GPUs.
        """
        each = [(label, module, params, check) for label, params, check in steps]
        return self.play_steps(each, nvml=nvml, extra_args=["--diff", *extra_args])

    def play_steps(
        self,
        steps: Sequence[tuple[str, str, Mapping[str, Any], bool]],
        *,
        nvml: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> tuple[dict[str, Any], str]:
        """Run ``(label, module, params, check_mode)`` steps in order in one playbook, each its own module; as
        ``play_module`` returns, without ``--diff`` unless ``extra_args`` has it."""
        out = self.root / f"results-{secrets.token_hex(4)}.json"
        tasks: list[dict[str, Any]] = [
            {
                "name": label,
                module: dict(params),
                "check_mode": check,
                "register": f"step_{index}",
                "ignore_errors": True,
            }
            for index, (label, module, params, check) in enumerate(steps)
        ]
        collected = ", ".join(f"{json.dumps(label)}: step_{index}" for index, (label, *_rest) in enumerate(steps))
        tasks.append(
            {
                "name": "save the results",
                "ansible.builtin.copy": {"content": "{{ {" + collected + "} | to_json }}", "dest": str(out)},
                "check_mode": False,
            }
        )
        playbook = self.root / "play.yml"
        playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
        extra_env = {}
        if nvml is not None:
            extra_env = {"PYTHONPATH": str(REPO / "tests" / "support" / "fakes"), "MERIDIAN_FAKE_NVML_SCENARIO": nvml}
        proc = run_playbook(playbook, temp_dir=self.root / "ansible-tmp", extra_env=extra_env, extra_args=extra_args)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        results: dict[str, Any] = json.loads(out.read_text())
        return results, proc.stdout + proc.stderr

    def container(self, name: str) -> Any:
        """The container called exactly ``name``, or None."""
        found = [c for c in self.client.containers.list(all=True, filters={"name": name}) if c.name == name]
        return found[0] if found else None


def post_completion(port: int, seconds: float, outcomes: list[Any]) -> None:
    body = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 4, "standin_seconds": seconds}).encode()
    request = urllib.request.Request(
        f"http://{BIND}:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            outcomes.append((response.status, time.monotonic()))
    except Exception as exc:  # the outcome is what the test asserts on
        outcomes.append((repr(exc), time.monotonic()))


def in_flight_total(port: int) -> int:
    with urllib.request.urlopen(f"http://{BIND}:{port}/standin/in-flight", timeout=5) as response:
        gauges = json.loads(response.read())
    return int(gauges["running"]) + int(gauges["waiting"])


def hold_requests(port: int, count: int, seconds: float) -> tuple[list[threading.Thread], list[Any]]:
    outcomes: list[Any] = []
    threads = [threading.Thread(target=post_completion, args=(port, seconds, outcomes)) for _ in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while in_flight_total(port) < count:
        if time.monotonic() > deadline:  # a liveness limit, not a speed target
            raise AssertionError("the requests never reached the engine")
        time.sleep(0.05)
    return threads, outcomes


@contextmanager
def stuck_requests(host: Host, container_id: str, port: int, count: int) -> Iterator[list[Any]]:
    """``count`` requests in flight on the stand-in engine ``container_id`` at ``port`` for as long as the block
    runs: each asks for 300 s, far longer than any drain a test waits for. Leaving, the stand-in is told to finish
    them all (SIGUSR1, where it still runs) and each is waited for. Yields their outcomes, ``(status, when)``,
    filled in as they end."""
    threads, outcomes = hold_requests(port, count, seconds=300)
    try:
        yield outcomes
    finally:
        for running in host.client.containers.list(filters={"id": container_id}):  # a stopped one lost them
            running.kill(signal="SIGUSR1")
        for thread in threads:
            thread.join(timeout=60)


def watch_mark(path: Path, stop: threading.Event, seen: list[float]) -> None:
    while not stop.is_set():
        if path.exists() and not seen:
            seen.append(time.monotonic())
        time.sleep(0.02)

"""The whole loop for ``make demo``: control plane -> signed desired state -> agent -> engine -> serving.

Starts ``meridian-node-devserver`` (SQLite in a temp dir), enrolls an agent over mutual TLS, builds the
stand-in vLLM engine image (no registry here; the first build on a machine takes about 75 s), publishes a
desired state with one engine, lets ``meridian-node run --once`` verify and apply it through ansible-runner,
then shows the status table, the serving projection and the engine answering. Without a Docker Engine the
agent runs observe-only and says why. Everything it started is stopped and removed afterwards.
"""

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from meridian_node_agent.agent_side.control_client import ControlClient
from meridian_node_agent.agent_side.identity import NodeIdentity

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[3]
NODE_ID = "demo-gpu-node"
ENGINE = "meridian-demo-chat"


def banner(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 74 - len(title)))


def show(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    print("$ " + " ".join([Path(argv[0]).name, *argv[1:]]))
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.stdout.strip():
        print(done.stdout.rstrip())
    if done.returncode:
        print(f"(exit {done.returncode}) {done.stderr.strip()[-2000:]}")
    return done


def docker_problem() -> tuple[Any, str | None]:
    """A client for the local Docker Engine, or why there is none."""
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means the same here: no engine to run on
        return None, f"{type(exc).__name__}: {exc}"
    return client, None


@contextmanager
def devserver(data_dir: Path) -> Iterator[dict[str, str]]:
    """``meridian-node-devserver serve`` on a free loopback port; its printed paths, token and URL."""
    process = subprocess.Popen(
        [
            str(BIN / "meridian-node-devserver"),
            "serve",
            "--data-dir",
            str(data_dir),
            "--port",
            "0",
            "--token",
            f"{NODE_ID}@{NODE_ID}:auto",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    info: dict[str, str] = {}
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 60
        while "url" not in info and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError("meridian-node-devserver exited before it was listening")
            key, _, value = line.strip().partition(": ")
            if key == "ca bundle":
                info["ca"] = value
            elif key == "control public key":
                info["control_key"] = value.split(" (")[0]
            elif key == f"token {NODE_ID}":
                info["token"] = value
            elif line.startswith("listening on "):
                info["url"] = line.split("listening on ", 1)[1].strip()
        if "url" not in info:
            raise RuntimeError("meridian-node-devserver did not start listening within 60 s")
        print(f"devserver listening on {info['url']} (CA {info['ca']})")
        yield info
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def write_node(root: Path, server: dict[str, str], mode: str, port: int) -> Path:
    (root / "keys").mkdir(parents=True)
    shutil.copy(server["control_key"], root / "keys" / "control.pem")
    policy = {
        "trust": {"control": {"threshold": 1, "public_keys": ["keys/control.pem"]}},
        "images": {"allowed_repositories": ["meridian-node/standin"], "require_digest": True},
        "engines": {"allowed_drivers": ["vllm"], "bind_address": "127.0.0.1", "port_range": [port, port]},
        "store": {"path": str(root / "store"), "max_bytes": "1G"},
        "agent": {"allowed_modes": ["observe-only", "managed-host"]},
    }
    (root / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False), encoding="utf-8")
    config = {
        "node_id": NODE_ID,
        "mode": mode,
        "policy": "policy.yaml",
        "state_dir": "state",
        "control_plane": {"url": server["url"], "long_poll_seconds": 0},
        "log": {"format": "text", "level": "warning"},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def free_port() -> int:
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import port_bind_problem

    for port in range(8000, 9000):
        if port_bind_problem("127.0.0.1", port) is None:
            return port
    raise RuntimeError("no free port in 8000-8999 on 127.0.0.1")


def engine_image(client: Any) -> str:
    """The stand-in vLLM image, built locally (no registry here) and pinned by image id."""
    from ansible_collections.meridian.node.tests.support.standin_image import ensure_base_image, ensure_engine_image

    print("building the stand-in vLLM engine image (cached; about 75 s the first time on a machine)")
    base = ensure_base_image(client)
    image = ensure_engine_image(client, base, REPO / "tests" / "support" / "standin_server.py", engine="vllm")
    return image.pinned


def remove_demo_engine(client: Any) -> None:
    if client is None:
        return
    for container in client.containers.list(all=True, filters={"name": ENGINE}):
        if container.name == ENGINE and container.labels.get("meridian.node/owned") == "true":
            container.remove(force=True)


def whole_loop(workdir: Path) -> None:
    banner("5. The whole loop: control plane -> signed state -> agent -> engine -> serving")
    client, problem = docker_problem()
    mode = "managed-host" if client is not None else "observe-only"
    if problem:
        print(
            f"No Docker Engine answers here ({problem}): the agent runs observe-only, verifying and "
            "reporting the state without changing anything."
        )
    remove_demo_engine(client)
    port = free_port()
    image = engine_image(client) if client is not None else "meridian-node/standin@sha256:" + "0" * 64
    node = workdir / "node"
    try:
        with devserver(workdir / "control-plane") as server:
            config = write_node(node, server, mode, port)
            agent = [str(BIN / "meridian-node"), "--config", str(config)]
            show([*agent, "enroll", "--token", server["token"], "--ca-bundle", server["ca"]], cwd=node)
            desired = {
                "engines": [
                    {
                        "name": ENGINE,
                        "driver": "vllm",
                        "image": image,
                        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                        "served_model_name": "llama-3.1-8b",
                        "port": port,
                        "env": {"STANDIN_LOAD_SECONDS": "2"},
                    }
                ]
            }
            (node / "desired.yaml").write_text(yaml.safe_dump(desired, sort_keys=False), encoding="utf-8")
            show(
                [
                    str(BIN / "meridian-node-devserver"),
                    "publish",
                    "--data-dir",
                    str(workdir / "control-plane"),
                    NODE_ID,
                    "desired.yaml",
                ],
                cwd=node,
            )
            print(f"(the agent verifies, spools, applies through ansible-runner in {mode} mode, observes, reports)")
            show([*agent, "run", "--once"], cwd=node)
            print("\nA second cycle with nothing new runs no playbook:")
            show([*agent, "run", "--once"], cwd=node)
            show([*agent, "status"], cwd=node)
            identity = NodeIdentity(node / "state" / "identity")
            with ControlClient(server["url"], identity.ca_path, identity.cert_path, identity.key_path) as control:
                projection = control.serving()
            print("\nServing projection (what a gateway routes to):")
            print(json.dumps(projection.model_dump(mode="json")["endpoints"], indent=2))
            if client is not None:
                from ansible_collections.meridian.node.plugins.module_utils.engines.probes import http_get

                answer = http_get("127.0.0.1", port, "/v1/models")
                print(f"\nGET http://127.0.0.1:{port}/v1/models -> {answer.status} {answer.body}")
    finally:
        remove_demo_engine(client)
        print("\ncleaned up: devserver stopped, demo engine container removed")

"""The whole loop for ``make demo``: control plane -> signed desired state -> agent -> engine -> serving.

Starts ``meridian-node-devserver`` (SQLite in a temp dir), enrolls an agent over mutual TLS, publishes a
desired state with one engine, lets ``meridian-node run --once`` verify and apply it through ansible-runner,
then shows the status table, the serving projection and the engine answering at the address the projection
gives.

The engine is a real one where this machine allows: Debian's llama-server (an image built from the Debian
mirror, no registry here: about a minute the first time on a machine, cached after) serving a tiny llama GGUF
written here with random weights, published as a signed artifact that the agent verifies and promotes before
the engine starts; the completion it prints is real, and gibberish. Where that cannot be built (no root for
debootstrap, no mirror that carries llama.cpp, no ``gguf`` package) the demo says why and runs the stand-in
vLLM image instead (tests/support/standin_server.py, the first build about 75 s). Without a Docker Engine the
agent runs observe-only and says why. Everything it started is stopped and removed afterwards.
"""

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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


@dataclass
class DemoEngine:
    """What the demo publishes and how the node's policy must read to allow it."""

    engine: dict[str, Any]
    repository: str
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    artifact_key_pem: bytes | None = None  # the key that signed the artifacts' manifests
    model_sources: list[str] = field(default_factory=list)  # local directories the artifacts come from
    real: bool = False  # a real inference engine (it can complete), not the stand-in


def write_node(root: Path, server: dict[str, str], mode: str, port: int, demo: DemoEngine) -> Path:
    (root / "keys").mkdir(parents=True)
    shutil.copy(server["control_key"], root / "keys" / "control.pem")
    trust: dict[str, Any] = {"control": {"threshold": 1, "public_keys": ["keys/control.pem"]}}
    store: dict[str, Any] = {"path": str(root / "store"), "max_bytes": "1G"}
    if demo.artifact_key_pem is not None:
        (root / "keys" / "artifact.pem").write_bytes(demo.artifact_key_pem)
        trust["artifact"] = {"threshold": 1, "public_keys": ["keys/artifact.pem"]}
        store["local_sources"] = demo.model_sources
    policy = {
        "trust": trust,
        "images": {"allowed_repositories": [demo.repository], "require_digest": True},
        "engines": {
            "allowed_drivers": [demo.engine["driver"]],
            "bind_address": "127.0.0.1",
            "port_range": [port, port],
        },
        "store": store,
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


def standin_engine(image: str, port: int) -> DemoEngine:
    """The stand-in vLLM engine, its model by name (the stand-in loads nothing)."""
    engine = {
        "name": ENGINE,
        "driver": "vllm",
        "image": image,
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "served_model_name": "llama-3.1-8b",
        "port": port,
        "env": {"STANDIN_LOAD_SECONDS": "2"},
    }
    return DemoEngine(engine=engine, repository="meridian-node/standin")


def real_engine(client: Any, workdir: Path, port: int) -> tuple[DemoEngine | None, str | None]:
    """llama-server serving a tiny random-weight GGUF published as a signed artifact, or why it cannot be."""
    try:
        from ansible_collections.meridian.node.tests.support.gguf_models import TINY, artifact_ref, write_model
        from ansible_collections.meridian.node.tests.support.llamacpp_image import ensure_llamacpp_image
        from ansible_collections.meridian.node.tests.support.standin_image import StandinImageError
        from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key
    except ImportError as exc:
        return None, f"{exc} (install the dev extra: pip install -e '.[dev]')"
    print("building the llama.cpp engine image from the Debian mirror (cached; about a minute the first time)")
    try:
        built = ensure_llamacpp_image(client)
    except StandinImageError as exc:
        return None, str(exc)
    print(f"  {built.describe()}")
    model = write_model(workdir / "models" / "tiny-llama", TINY, seed=0)
    print(f"  {model.describe()}: a 2-layer llama with random weights, so what it writes is gibberish")
    key = make_key()
    artifact = artifact_ref(model, key, name="tiny-llama")
    print("  its sha256 is pinned in an ArtifactManifest signed by a demo artifact key the node's policy trusts")
    engine = {
        "name": ENGINE,
        "driver": "llamacpp",
        "image": built.image.pinned,
        "model": {"artifact": "tiny-llama"},
        "served_model_name": "tiny-llama",
        "port": port,
    }
    demo = DemoEngine(
        engine=engine,
        repository=built.image.repository,
        artifacts=[artifact],
        artifact_key_pem=key.public_pem,
        model_sources=[str(model.path.parent)],
        real=True,
    )
    return demo, None


def show_completion(address: str, model: str) -> None:
    """One real completion from the engine at ``address`` (the serving projection's), printed as it came."""
    # Random weights end a text at a random token: ignore_eos (a llama-server option) lets it write all 24.
    body = {"model": model, "prompt": "The whole loop works:", "max_tokens": 24, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://{address}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:  # noqa: S310 - http:// to the projection's address
            completion = json.loads(answer.read())
    except OSError as exc:
        print(f"\nPOST http://{address}/v1/completions failed: {exc}")
        return
    print(f"\nPOST http://{address}/v1/completions (the address from the serving projection) -> {answer.status}")
    print(f"  prompt: {body['prompt']!r}")
    print(f"  completion ({completion['usage']['completion_tokens']} tokens, random weights, so gibberish):")
    print(f"  {completion['choices'][0]['text']!r}")
    print(f"  served by {completion.get('system_fingerprint', '?')} as model {completion.get('model')!r}")


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
    if client is None:
        demo = standin_engine("meridian-node/standin@sha256:" + "0" * 64, port)
    else:
        real, why = real_engine(client, workdir, port)
        if real is None:
            print(f"\nNo real engine here: {why}")
            print("Falling back to the stand-in vLLM engine: it answers like vLLM, but runs no model.")
        demo = real if real is not None else standin_engine(engine_image(client), port)
    node = workdir / "node"
    try:
        with devserver(workdir / "control-plane") as server:
            config = write_node(node, server, mode, port, demo)
            agent = [str(BIN / "meridian-node"), "--config", str(config)]
            show([*agent, "enroll", "--token", server["token"], "--ca-bundle", server["ca"]], cwd=node)
            desired: dict[str, Any] = {"engines": [demo.engine]}
            if demo.artifacts:
                desired["artifacts"] = demo.artifacts
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
            endpoints = projection.model_dump(mode="json")["endpoints"]
            print("\nServing projection (what a gateway routes to):")
            print(json.dumps(endpoints, indent=2))
            served = [e for e in endpoints if e["engine"] == ENGINE]
            if client is not None and demo.real:
                if served:
                    show_completion(served[0]["address"], served[0]["served_model_name"])
                else:
                    print(f"\n{ENGINE} is not in the serving projection: the run above says why")
            elif client is not None:
                from ansible_collections.meridian.node.plugins.module_utils.engines.probes import http_get

                answer = http_get("127.0.0.1", port, "/v1/models")
                print(f"\nGET http://127.0.0.1:{port}/v1/models -> {answer.status} {answer.body}")
    finally:
        remove_demo_engine(client)
        print("\ncleaned up: devserver stopped, demo engine container removed")

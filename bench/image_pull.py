"""Pull-and-start of an engine whose image is only in a registry: our module path beside ``docker pull`` +
``docker run`` of the same image, on the real Docker Engine and a real registry on 127.0.0.1.

    .venv/bin/python bench/image_pull.py [--size-mib 128] [--rounds 3]

Starts Debian's docker-registry on a free port (tests/support/registry.py), pushes one image to it (the
stand-in vLLM engine plus one layer of --size-mib random bytes, so no local Docker has it), then in interleaved
rounds, the image removed from the local engine before each, times:
1. ours: ``engines.instance.converge`` of an engine pinned to the image by digest: the policy and placement
   checks, the pull (``docker.image_pull``: streamed progress, the stall bound, the disk floor, the digest
   verified), the create and start, until the engine's readiness probe passes; what ``engine_instance`` and
   ``engine_set`` do, without Ansible's start-up around it;
2. theirs: ``docker pull REF@DIGEST`` then ``docker run -d`` with the same command, environment and port,
   polled until the same readiness endpoint answers 200.
Also the pull alone, both ways (``ImagePuller.pull`` vs ``docker pull``). Prints each median and the ratios
ours / theirs (target: within 1.1x, since the work is the same). The containers carry one random prefix and
are removed at the end, with the pushed image and the registry.
"""

import argparse
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.docker.image_pull import ImagePuller, PullLimits
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import Options
from ansible_collections.meridian.node.plugins.module_utils.engines.instance import converge
from ansible_collections.meridian.node.tests.support.engine_harness import BIND, PORTS, free_port
from ansible_collections.meridian.node.tests.support.registry import forget_local, push, running_registry
from ansible_collections.meridian.node.tests.support.standin_image import ensure_base_image, ensure_engine_image
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "support" / "standin_server.py"
MIB = 1024 * 1024


def wait_ready(port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    interval = 0.05
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{BIND}:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval)
        interval = min(interval * 2, 0.25)  # the same doubling our readiness wait uses
    raise SystemExit(f"the engine on port {port} was not ready in {timeout_s:g}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    client = docker.from_env(timeout=120)
    prefix = f"mn-bench-pull-{secrets.token_hex(3)}"
    base = ensure_engine_image(client, ensure_base_image(client), SERVER, engine="vllm")
    samples: dict[str, list[float]] = {"ours": [], "theirs": [], "our pull": [], "docker pull": []}
    with running_registry() as registry, tempfile.TemporaryDirectory(prefix="mn-bench-pull-") as scratch:
        repository = f"{registry.host}/{prefix}/standin"
        image = push(client, registry, base.id, repository, "bench", args.size_mib * MIB)
        pinned = f"{repository}@{image.digest}"
        root = Path(scratch)
        (root / "state").mkdir()
        policy = write_policy(
            root / "policy",
            control=[make_key()],
            extra={
                "images": {"allowed_repositories": [f"{registry.host}/{prefix}/*"]},
                "engines": {"allowed_drivers": ["vllm"], "bind_address": BIND, "port_range": list(PORTS)},
                "store": {"path": str(root / "store")},
            },
        )
        options = Options(policy_path=str(policy), state_dir=str(root / "state"))
        engine = DockerEngine.from_env()
        template: dict[str, Any] = {}

        def ours(round_index: int) -> None:
            name = f"{prefix}-ours-{round_index}"
            spec = {
                "name": name,
                "driver": "vllm",
                "image": pinned,
                "model": {"name": "tiny"},
                "served_model_name": "tiny-chat",
                "port": free_port(),
            }
            result = converge(spec, options, check_mode=False, engine=engine)
            if not (result["ready"] and result["image_pull"]["pulled"]):
                raise SystemExit(f"our converge did not pull and start the engine: {result}")
            if not template:
                attrs = client.containers.get(name).attrs
                config, bindings = attrs["Config"], attrs["HostConfig"]["PortBindings"]
                template.update(
                    command=config.get("Cmd") or [],
                    entrypoint=config.get("Entrypoint"),
                    env=config["Env"],
                    port=next(iter(bindings)).split("/")[0],  # the driver's container port
                )

        def theirs(round_index: int) -> None:
            port = free_port()
            subprocess.run(["docker", "pull", "-q", pinned], check=True, capture_output=True)
            command = ["docker", "run", "-d", "--init", "--name", f"{prefix}-theirs-{round_index}"]
            command += [f"--env={entry}" for entry in template["env"]]
            command += ["-p", f"{BIND}:{port}:{template['port']}"]
            entrypoint = list(template["entrypoint"] or [])
            if entrypoint:  # docker run takes the entrypoint's program alone; its arguments go before the command
                command += ["--entrypoint", entrypoint[0]]
            arguments = [*entrypoint[1:], *template["command"]]
            subprocess.run([*command, pinned, *arguments], check=True, capture_output=True)
            wait_ready(port)

        def our_pull(_round: int) -> None:
            ImagePuller(engine.api, PullLimits(min_free_bytes=1024**3), allowed=lambda ref: None).pull(pinned)

        def docker_pull(_round: int) -> None:
            subprocess.run(["docker", "pull", "-q", pinned], check=True, capture_output=True)

        def clean() -> None:
            # Containers first: an image a container uses is only untagged by a forced removal, its layers kept,
            # and the next pull would then move no bytes.
            for container in client.containers.list(all=True, filters={"name": prefix}):
                container.remove(force=True)
            forget_local(client, repository)
            if client.images.list(name=repository):
                raise SystemExit(f"{repository} is still in the local engine: the next pull would not be one")

        def timed(name: str, run: Callable[[int], None], round_index: int) -> None:
            clean()
            start = time.perf_counter()
            run(round_index)
            samples[name].append(time.perf_counter() - start)

        try:
            clean()
            ours(-1)  # warm-up, untimed: the template for docker run, page cache, the registry's own caches
            for index in range(args.rounds):
                timed("ours", ours, index)
                timed("theirs", theirs, index)
                timed("our pull", our_pull, index)
                timed("docker pull", docker_pull, index)
        finally:
            clean()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"image: the stand-in vLLM engine + {args.size_mib} MiB random layer, {args.rounds} interleaved rounds")
    print(f"pull-and-start until ready, ours (engines.instance.converge): {medians['ours']:.3f} s")
    print(f"pull-and-start until ready, docker pull + docker run:        {medians['theirs']:.3f} s")
    print(f"  ratio ours / theirs: {medians['ours'] / medians['theirs']:.2f}x (target <= 1.10x)")
    print(f"pull alone, ours (ImagePuller.pull):  {medians['our pull']:.3f} s")
    print(f"pull alone, docker pull:              {medians['docker pull']:.3f} s")
    print(f"  ratio ours / docker pull: {medians['our pull'] / medians['docker pull']:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

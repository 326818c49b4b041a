"""Engine containers: the no-op converge of 8 running engines, ours vs community.docker, and create-to-ready.

    .venv/bin/python bench/engines.py [--repeat 3] [--count 8]

Prints:
1. the median wall time of one ansible-playbook run that converges --count running stand-in engines that
   are already as specified (a no-op: every item reports ok), through ``meridian.node.engine_instance``
   vs ``community.docker.docker_container`` for the same number of equivalent containers (same image,
   command, environment, published port, init, stop signal), as a ratio (ours / theirs; target <= 0.8, issue 46).
   Both playbooks loop over the items in one task; the time of a playbook whose task loops the same number
   of times over ``ansible.builtin.meta: noop`` is printed too, and the ratio without that start-up cost.
   Our module also probes each engine's readiness once per run; docker_container does not. engine_instance's loop
   runs in Ansible's worker (its action plugin: the task is local, with the controller's interpreter, as the agent's
   apply unit runs it); the same loop run as a module (``meridian_engine_instance_in_worker=false``) is printed too.
   Beside it, the same no-op through one ``meridian.node.engine_set`` task listing the same --count engines
   (the same containers: the same settings hash the same), as a ratio to docker_container (target <= 0.25).
   That task runs in Ansible's worker (local connection, the controller's interpreter: engine_set's action
   plugin), docker_container as a module; the engine_set figure run as a module is printed beside it.
   The six playbooks run in interleaved rounds (baseline, engine_instance both ways, engine_set both ways,
   docker_container, then again), so a machine that slows down or speeds up during the run weighs on all of them alike.
2. create-to-ready seconds for one stand-in engine through ``engines.instance.converge`` (create, start,
   wait until its readiness probe passes), median of --repeat; and for --count new engines through one
   ``engines.set.converge_set`` call (created, started and waited for side by side), as a multiple of the one.

community.docker comes from the ``ansible`` wheel on PyPI (Galaxy is unreachable here): the wheel is
downloaded once with pip into ``.build/bench-wheels`` and only ``community/docker`` is extracted into
``.build/bench-collections``. Every container the bench makes carries one random prefix and is removed at
the end, whatever happens.
"""

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import docker
from timing import median_seconds, run_bench

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import Options
from ansible_collections.meridian.node.plugins.module_utils.engines.instance import converge
from ansible_collections.meridian.node.plugins.module_utils.engines.set import SetOptions, converge_set
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    REPO,
    SERVER,
    VENV_BIN,
    free_ports,
    run_playbook,
    standin_policy,
)
from ansible_collections.meridian.node.tests.support.standin_image import ensure_base_image, ensure_engine_image

BUILD = REPO / ".build"
WHEELS = BUILD / "bench-wheels"
COLLECTIONS = BUILD / "bench-collections"
ANSIBLE_WHEEL = "ansible>=12,<13"  # the Ansible release that goes with ansible-core 2.19


def community_docker() -> Path:
    """The directory holding ``ansible_collections/community/docker``, extracted from the ansible wheel once."""
    target = COLLECTIONS / "ansible_collections" / "community" / "docker"
    if (target / "MANIFEST.json").is_file():
        return COLLECTIONS
    WHEELS.mkdir(parents=True, exist_ok=True)
    wheels = sorted(WHEELS.glob("ansible-*.whl"))
    if not wheels:
        subprocess.run(
            [str(VENV_BIN / "pip"), "download", "--no-deps", "--only-binary=:all:", "-d", str(WHEELS), ANSIBLE_WHEEL],
            check=True,
        )
        wheels = sorted(WHEELS.glob("ansible-*.whl"))
    prefix = "ansible_collections/community/docker/"
    staging = Path(tempfile.mkdtemp(dir=BUILD))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(staging, members=[name for name in wheel.namelist() if name.startswith(prefix)])
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    (staging / prefix).rename(target)
    shutil.rmtree(staging)
    return COLLECTIONS


class Bench:
    def __init__(self, root: Path, client: Any, count: int) -> None:
        self.root = root
        self.client = client
        self.prefix = f"mn-bench-{secrets.token_hex(3)}"
        base = ensure_base_image(client)
        self.image = ensure_engine_image(client, base, SERVER, engine="vllm")
        self.state_dir = root / "state"
        self.state_dir.mkdir()
        self.policy = standin_policy(root / "policy", ["vllm"])
        ports = free_ports(3 * count + 1)
        self.ours = [self._spec(f"{self.prefix}-ours-{i}", ports[i]) for i in range(count)]
        self.theirs_ports = ports[count : 2 * count]
        self.ready_port = ports[-1]
        self.set_ports = ports[2 * count : 3 * count]
        self.collections = f"{community_docker()}:{BUILD / 'collections'}"

    def _spec(self, name: str, port: int) -> dict[str, Any]:
        return {
            "name": name,
            "driver": "vllm",
            "image": self.image.pinned,
            "model": {"name": "tiny"},
            "served_model_name": "tiny-chat",
            "port": port,
            "policy": str(self.policy),
            "state_dir": str(self.state_dir),
        }

    def theirs(self) -> list[dict[str, Any]]:
        """docker_container parameters equivalent to our containers (read back from the first of them)."""
        model = self.client.containers.get(self.ours[0]["name"]).attrs
        image_env = set(self.client.images.get(self.image.id).attrs["Config"].get("Env") or [])
        env = dict(item.split("=", 1) for item in model["Config"]["Env"] if item not in image_env)
        return [
            {
                "name": f"{self.prefix}-theirs-{i}",
                "image": self.image.tag,
                "command": model["Config"]["Cmd"],
                "env": env,
                "published_ports": [f"{BIND}:{port}:8000"],
                "init": True,
                "stop_signal": model["Config"].get("StopSignal") or "SIGTERM",
                "stop_timeout": model["Config"].get("StopTimeout") or 30,
                "state": "started",
                "pull": "never",
            }
            for i, port in enumerate(self.theirs_ports)
        ]

    def playbook(self, module: str, items: list[Any], *, play_vars: dict[str, Any] | None = None) -> Path:
        """One task that loops ``module`` over ``items``; ``play_vars``, the play's variables."""
        stem = module.rsplit(".", 1)[-1] + (
            "-" + "-".join(f"{k}-{v}" for k, v in play_vars.items()) if play_vars else ""
        )
        path = self.root / f"{stem}.yml"
        task: dict[str, Any] = {"name": "converge", module: "{{ item }}", "loop": items, "register": "converged"}
        if module == "ansible.builtin.meta":
            task = {"name": "converge", module: "noop", "loop": items}
        play = {"hosts": "localhost", "gather_facts": False, "tasks": [task], "vars": play_vars or {}}
        path.write_text(json.dumps([play]))
        return path

    def set_playbook(self, *, in_worker: bool = True) -> Path:
        """One engine_set task converging the same engines as the engine_instance loop, in Ansible's worker
        (its action plugin's way here) or, with ``in_worker`` false, as a module."""
        shared = {"policy": str(self.policy), "state_dir": str(self.state_dir)}
        engines = [{k: v for k, v in spec.items() if k not in shared} for spec in self.ours]
        path = self.root / ("engine_set.yml" if in_worker else "engine_set_module.yml")
        task = {"name": "converge", "meridian.node.engine_set": {"engines": engines, **shared}, "register": "converged"}
        play = {"hosts": "localhost", "gather_facts": False, "tasks": [task]}
        play["vars"] = {"meridian_engine_set_in_worker": in_worker}
        path.write_text(json.dumps([play]))
        return path

    def run(self, playbook: Path) -> str:
        proc = run_playbook(playbook, temp_dir=self.root / "ansible-tmp", collections=self.collections)
        if proc.returncode != 0:
            raise SystemExit(f"bench: {playbook.name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return proc.stdout

    def noop_run(self, playbook: Path) -> None:
        recap = self.run(playbook).rsplit("PLAY RECAP", 1)[-1]
        if "changed=0" not in recap:
            raise SystemExit(f"bench: {playbook.name} was not a no-op:\n{recap}")

    def create_to_ready(self, repeat: int) -> float:
        spec = self._spec(f"{self.prefix}-ready", self.ready_port)
        options = Options(state="started", policy_path=str(self.policy), state_dir=str(self.state_dir))
        absent = Options(state="absent", policy_path=str(self.policy), state_dir=str(self.state_dir))
        engine = DockerEngine.from_env()
        try:

            def once() -> None:
                result = converge(spec, options, check_mode=False, engine=engine)
                if result.get("ready") is not True or result["done"] != ["create", "start", "wait-ready"]:
                    raise SystemExit(f"bench: the engine did not go from nothing to ready: {result}")

            samples = []
            for _ in range(repeat):
                samples.append(median_seconds(once, 1))
                converge({"name": spec["name"]}, absent, check_mode=False, engine=engine)
            return sorted(samples)[len(samples) // 2]
        finally:
            engine.close()

    def set_create_to_ready(self, repeat: int) -> float:
        """Create-to-ready of --count new engines through ``engines.set.converge_set`` (one call, in process)."""
        specs = [self._spec(f"{self.prefix}-set-{i}", port) for i, port in enumerate(self.set_ports)]
        options = SetOptions(policy_path=str(self.policy), state_dir=str(self.state_dir))
        gone = [{"name": spec["name"], "state": "absent"} for spec in specs]
        engine = DockerEngine.from_env()
        try:

            def once() -> None:
                result = converge_set(specs, options, check_mode=False, engine=engine)
                if not all(r.get("ready") is True for r in result["engines"].values()):
                    raise SystemExit(f"bench: the set did not go from nothing to ready: {result}")

            samples = []
            for _ in range(repeat):
                samples.append(median_seconds(once, 1))
                converge_set(gone, options, check_mode=False, engine=engine)
            return sorted(samples)[len(samples) // 2]
        finally:
            engine.close()

    def inprocess_noop(self, repeat: int) -> float:
        """The same no-op through ``engines.instance.converge`` in this process: the module without Ansible and
        without its imports."""
        options = Options(state="started", policy_path=str(self.policy), state_dir=str(self.state_dir))
        engine = DockerEngine.from_env()

        def once() -> None:
            for spec in self.ours:
                if converge(spec, options, check_mode=False, engine=engine)["changed"]:
                    raise SystemExit(f"bench: {spec['name']} was not a no-op in process")

        try:
            return median_seconds(once, repeat)
        finally:
            engine.close()

    def cleanup(self) -> None:
        for container in self.client.containers.list(all=True, filters={"name": self.prefix}):
            if container.name.startswith(self.prefix):
                container.remove(force=True)


def interleaved_medians(runs: dict[str, Any], repeat: int) -> dict[str, float]:
    """The median wall time of each of ``runs``, measured in ``repeat`` rounds that run each once, in turn."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def import_seconds(modules: list[str], repeat: int) -> float:
    """What importing ``modules`` costs a fresh interpreter (an Ansible module pays it on every task)."""
    python = str(VENV_BIN / "python")
    code = "import " + ", ".join(modules)
    bare = median_seconds(lambda: subprocess.run([python, "-c", "pass"], check=True), repeat)
    loaded = median_seconds(lambda: subprocess.run([python, "-c", code], check=True), repeat)
    return loaded - bare


OUR_IMPORTS = [
    "ansible.module_utils.basic",
    "ansible_collections.meridian.node.plugins.modules.engine_instance",
]
THEIR_IMPORTS = [
    "ansible.module_utils.basic",
    "ansible_collections.community.docker.plugins.modules.docker_container",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--count", type=int, default=8)
    args = parser.parse_args()
    client = docker.from_env(timeout=60)
    with tempfile.TemporaryDirectory(prefix="mn-bench-") as tmp:
        bench = Bench(Path(tmp), client, args.count)
        try:
            ours = bench.playbook("meridian.node.engine_instance", bench.ours)
            bench.run(ours)  # creates and starts them: not timed
            ours_module = bench.playbook(
                "meridian.node.engine_instance", bench.ours, play_vars={"meridian_engine_instance_in_worker": False}
            )
            theirs = bench.playbook("community.docker.docker_container", bench.theirs())
            bench.run(theirs)
            baseline = bench.playbook("ansible.builtin.meta", list(range(args.count)))
            as_set = bench.set_playbook()
            as_set_module = bench.set_playbook(in_worker=False)
            bench.noop_run(ours)
            bench.noop_run(ours_module)
            bench.noop_run(as_set)
            bench.noop_run(as_set_module)
            bench.noop_run(theirs)
            medians = interleaved_medians(
                {
                    "base": lambda: bench.run(baseline),
                    "ours": lambda: bench.noop_run(ours),
                    "ours-module": lambda: bench.noop_run(ours_module),
                    "set": lambda: bench.noop_run(as_set),
                    "set-module": lambda: bench.noop_run(as_set_module),
                    "theirs": lambda: bench.noop_run(theirs),
                },
                args.repeat,
            )
            t_base, t_ours, t_set, t_theirs = (medians[k] for k in ("base", "ours", "set", "theirs"))
            t_set_module, t_ours_module = medians["set-module"], medians["ours-module"]
            t_inproc = bench.inprocess_noop(args.repeat)
            ready = bench.create_to_ready(args.repeat)
            set_ready = bench.set_create_to_ready(args.repeat)
        finally:
            bench.cleanup()
    print(
        f"no-op converge of {args.count} running engines, one ansible-playbook run, "
        f"median of {args.repeat} interleaved rounds:"
    )
    print(f"  meridian.node.engine_instance      {t_ours:7.2f} s  ({args.count} loop items, in Ansible's worker)")
    print(
        f"  meridian.node.engine_instance as module {t_ours_module:5.2f} s  (meridian_engine_instance_in_worker=false)"
    )
    print(f"  meridian.node.engine_set           {t_set:7.2f} s  (one task, in Ansible's worker)")
    print(f"  meridian.node.engine_set as module {t_set_module:7.2f} s  (meridian_engine_set_in_worker=false)")
    print(f"  community.docker.docker_container  {t_theirs:7.2f} s")
    print(f"  ansible.builtin.meta noop (start-up) {t_base:5.2f} s")
    print(f"  ratio ours/theirs                  {t_ours / t_theirs:7.2f}  (target <= 0.8, issue 46)")
    print(f"  ratio without start-up             {(t_ours - t_base) / max(t_theirs - t_base, 1e-9):7.2f}")
    print(f"  ratio engine_set/theirs            {t_set / t_theirs:7.2f}  (target <= 0.25)")
    print(f"  ratio engine_set/theirs w/o start-up {(t_set - t_base) / max(t_theirs - t_base, 1e-9):5.2f}")
    print(f"  ratio engine_set/engine_instance   {t_set / t_ours:7.2f}")
    print(f"  ratio engine_set module/theirs     {t_set_module / t_theirs:7.2f}")
    print(
        f"  ratio engine_instance module/theirs {t_ours_module / t_theirs:6.2f}  (as the issue measured it until now)"
    )
    print(f"  engine_instance.converge in process, no Ansible  {t_inproc:5.2f} s for all {args.count}")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(COLLECTIONS), os.environ.get("PYTHONPATH", "")])
    ours_import, theirs_import = import_seconds(OUR_IMPORTS, args.repeat), import_seconds(THEIR_IMPORTS, args.repeat)
    print(f"  module imports per task: ours {ours_import:.2f} s, docker_container {theirs_import:.2f} s")
    print(f"create-to-ready of one stand-in engine (converge: create, start, wait-ready): {ready:.2f} s")
    print(
        f"create-to-ready of {args.count} stand-in engines in one engine_set.converge_set call: {set_ready:.2f} s "
        f"({set_ready / ready:.2f}x the one engine)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    run_bench(main)

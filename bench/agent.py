"""The pull agent: CPU per unchanged cycle, publish-to-ready vs ansible-pull, idle RSS, kill-to-ready.

    .venv/bin/python bench/agent.py [--repeat 3] [--cycles 200] [--nvml eight-gpus|none]

Everything runs against a real ``meridian-node-devserver`` process on 127.0.0.1 (real mutual TLS, real
signing) and the local Docker Engine, with the stand-in vLLM engine image (built once, cached). Prints:

1. publish-to-ready of one stand-in engine through ``meridian-node run`` (a real process, long-poll on), from
   the start of ``meridian-node-devserver publish`` until the engine answers ``GET /health`` with 200, against
   the same change applied by ``ansible-pull`` (ansible-core from .venv) from a local git repo
   (``-U file:///...``, ``-C main``) running a playbook with ``meridian.node.engine_instance`` and the same
   spec on localhost, from the start of ``git commit`` (the change reaching the repo) until the engine answers
   ready. Medians, and the ratio agent / ansible-pull (target <= 0.45, issue 46). On both sides readiness is watched
   beside the run the same way (``ReadyWatch``): probing starts at Docker's start event for the container,
   because a probe sent while Docker is still starting it stalls in Docker's port proxy and delays what it
   measures. Where each side's last 1-engine sample went follows: the agent's steps from its oplog, its
   ansible-runner journal and Docker's events; ansible-pull's from Docker's events. The agent's ``engines.set``
   task runs in Ansible's worker here (local, the controller's interpreter: its action plugin), ansible-pull's
   ``engines.instance`` task as a module (``meridian_engine_instance_in_worker=false``: ansible-pull on a host
   discovers the host's interpreter, not the one Ansible runs under, and engine_instance then runs as a module).
2. publish-to-all-ready of a state with 8 stand-in engines through the agent, against the one-engine figure
   of 1. Medians, and the ratio 8 engines / 1 engine (target <= 1.3), with Docker's own share (docker-py
   alone, no agent) and where the last round's 8-engine sample went (the first and last create and start).
   1 and 2 are measured in the same --repeat rounds, the three samples of a round in an order that rotates
   from round to round, each sample starting from no engine at all: before each, the agent is handed a state
   with no engines (it drains and removes its own) and ansible-pull's engine is removed, unmeasured. The
   seconds of each task of the agent's reconcile runs for the 1- and 8-engine states of the last round
   follow, read from its ansible-runner journal.
3. the idle agent's memory: VmRSS and VmHWM of that ``meridian-node run`` process after it applied and
   went back to waiting (target VmRSS <= 80 MiB).
4. CPU milliseconds per unchanged cycle of the agent in this process (``build_agent``, the state with the
   running engine applied), ``time.process_time()`` of this process only (the devserver is another one),
   over --cycles cycles (each one ``Agent.cycle`` plus the status file ``Agent.run`` writes after it), two ways:
   - *as in service*: each cycle stands for one long-poll of ``min(long_poll, heartbeat)`` seconds that
     ended with 304, so the agent's clocks move by that much per cycle: every cycle heartbeats (a
     mutual-TLS POST), the engines are listed and probed every cycle, the unchanged observation is
     re-sent at its refresh interval. This is what a steady agent does, and the target (<= 5 ms) is
     about it.
   - *back to back*: cycles with no wait and real clocks: heartbeats only once per interval.
   - *as in service, with GPUs* (``--nvml SCENARIO``, default ``eight-gpus``): the fake pynvml's GPUs behind the
     NVML seam, so each GPU refresh reads facts, NVLink peers and health through the agent's XID watch as on
     a GPU host (the 10 ms guard holds with health on; our cost per NVML call, not the driver's).
   Each line says how many cycles heartbeated and how many posted an observation. The in-service figure
   is also taken with supervision off (no applied state watched), and with the check for engines changed
   by hand off (``docker.drift`` in the per-cycle inspect), beside it, as ratios.
5. engine killed -> ready again, two ways: its server process SIGKILLed with nothing else running
   (Docker's restart policy, if the engine has one; ``docker kill`` would count as a stop by hand), and
   ``docker stop`` with the in-process agent cycling every 0.5 s (supervision's repair, after
   ``supervision.settle_seconds``).
"""

import argparse
import compileall
import cProfile
import json
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import docker
import yaml
from timing import run_bench

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, Observation
from ansible_collections.meridian.node.plugins.module_utils.docker import engine as docker_engine_module
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import http_get
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node, running
from ansible_collections.meridian.node.tests.support.engine_harness import free_ports
from ansible_collections.meridian.node.tests.support.processes import stop_process
from ansible_collections.meridian.node.tests.support.standin_image import ensure_base_image, ensure_engine_image
from meridian_node_agent.agent_side.control_client import DesiredStateFetch
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.observe import DockerEngines, Observer
from meridian_node_agent.agent_side.status_file import read_status
from meridian_node_agent.cli.agent import build_agent
from meridian_node_agent.config import load_config
from meridian_node_agent.logs import EventLogger

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
COLLECTIONS = REPO / ".build" / "collections"
SERVER = REPO / "tests" / "support" / "standin_server.py"
# Unique per run: the agent prunes every engine owned by "agent:<node id>" on the Docker Engine, so two benches
# sharing one id (side by side, or beside a CI run) would remove each other's engines.
NODE_ID = f"bench-gpu-node-{os.getpid()}"
BIND = "127.0.0.1"
READY_DEADLINE = 180.0
LONG_POLL = 30  # the config defaults: a cycle in service is one long-poll of min(30, 15) seconds
HEARTBEAT = 15
FLEET = 8  # engines in the many-engine state of the publish-to-ready rounds


def fail(message: str) -> NoReturn:
    raise SystemExit(f"bench: {message}")


@dataclass
class Setup:
    root: Path
    server: DevServer
    config_path: Path
    image: str
    port: int
    engine: str
    fleet_ports: tuple[int, ...] = ()  # the many-engine state's ports, one engine each

    def spec(self, name: str | None = None, port: int | None = None) -> dict[str, Any]:
        return {
            "name": name or self.engine,
            "driver": "vllm",
            "image": self.image,
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "served_model_name": "llama-3.1-8b",
            "port": port or self.port,
        }

    def fleet(self) -> list[dict[str, Any]]:
        return [self.spec(f"{self.engine}-{i}", port) for i, port in enumerate(self.fleet_ports, start=1)]


def write_node(root: Path, server: DevServer, ports: Sequence[int]) -> Path:
    (root / "keys").mkdir(parents=True)
    shutil.copy(server.control_public_key, root / "keys" / "control.pem")
    policy = {
        "trust": {"control": {"threshold": 1, "public_keys": ["keys/control.pem"]}},
        "images": {"allowed_repositories": ["meridian-node/standin"], "require_digest": True},
        "engines": {"allowed_drivers": ["vllm"], "bind_address": BIND, "port_range": [min(ports), max(ports)]},
        "store": {"path": str(root / "store"), "max_bytes": "1G"},
        "agent": {"allowed_modes": ["observe-only", "managed-host"]},
    }
    (root / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
    config = {
        "node_id": NODE_ID,
        "mode": "managed-host",
        "policy": "policy.yaml",
        "state_dir": "state",
        "control_plane": {"url": server.base_url, "long_poll_seconds": LONG_POLL, "heartbeat_seconds": HEARTBEAT},
        "log": {"format": "text", "level": "warning"},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def publish(setup: Setup, document: dict[str, Any]) -> int:
    path = setup.root / "desired.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    output = setup.server.cli("publish", NODE_ID, str(path)).stdout
    return int(output.split("generation ")[1].split()[0])


def wait_ready(port: int, deadline: float = READY_DEADLINE) -> float:
    """Poll the engine's health endpoint every 20 ms; the perf_counter time it first answered 200."""
    return wait_all_ready([port], deadline)


def wait_all_ready(ports: Sequence[int], deadline: float = READY_DEADLINE) -> float:
    """Poll each engine's health endpoint every 20 ms; the perf_counter time the last of them first answered
    200 (one that answered is not asked again)."""
    waiting = list(ports)
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        waiting = [port for port in waiting if http_get(BIND, port, "/health", timeout_s=1.0).status != 200]
        if not waiting:
            return time.perf_counter()
        time.sleep(0.02)
    fail(f"the engines on ports {waiting} did not answer ready within {deadline:.0f} s")


class ReadyWatch:
    """When each of the named containers first answers ready, probing only once Docker reported its start.

    A probe that reaches a published port while Docker is still starting the container hangs in Docker's
    port proxy until TCP retries the backend (here ~0.85 s after the start instead of ~0.15 s), so probing
    from the publish onwards would delay the very readiness it measures. Both sides of the comparison are
    watched this way, side by side with the run: one thread follows Docker's start events, another polls the
    health endpoint of each started container every 20 ms.
    """

    def __init__(self, client: Any, engines: Mapping[str, int]) -> None:
        self.engines = dict(engines)
        self.since = time.time()
        self.started: set[str] = set()
        self.ready: dict[str, float] = {}
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self._stream = client.events(
            since=int(self.since) - 1, decode=True, filters={"type": "container", "event": "start"}
        )
        self._threads = [threading.Thread(target=self._follow, daemon=True), threading.Thread(target=self._poll)]
        for thread in self._threads:
            thread.start()

    def _follow(self) -> None:
        try:
            for event in self._stream:
                name = (event.get("Actor") or {}).get("Attributes", {}).get("name")
                if name in self.engines and int(event["timeNano"]) / 1e9 >= self.since:
                    self.started.add(name)
        except Exception as exc:  # noqa: BLE001 - reported by wait(); closing the stream there ends up here too
            if not self.done.is_set():
                self.errors.append(exc)

    def _poll(self) -> None:
        end = time.monotonic() + READY_DEADLINE
        while len(self.ready) < len(self.engines) and time.monotonic() < end and not self.done.is_set():
            for name in [n for n in list(self.started) if n not in self.ready]:
                if http_get(BIND, self.engines[name], "/health", timeout_s=1.0).status == 200:
                    self.ready[name] = time.perf_counter()
            time.sleep(0.02)

    def wait(self, deadline: float = READY_DEADLINE) -> float:
        """The perf_counter time the last of the engines first answered ready."""
        self._threads[1].join(deadline)
        self.done.set()
        self._stream.close()
        if self.errors:
            fail(f"following Docker's events failed: {self.errors[0]!r}")
        missing = sorted(set(self.engines) - set(self.ready))
        if missing:
            fail(f"the engines {missing} did not answer ready within {deadline:.0f} s")
        return max(self.ready.values())


def wait_gone(ports: Sequence[int], deadline: float = 60.0) -> None:
    """Until nothing answers on any of ``ports``."""
    end = time.monotonic() + deadline
    while any(http_get(BIND, port, "/health", timeout_s=0.5).status is not None for port in ports):
        if time.monotonic() > end:
            fail(f"something still answers on one of the ports {list(ports)} after its engine was removed")
        time.sleep(0.05)


def remove_engine(client: Any, name: str, port: int) -> None:
    for container in client.containers.list(all=True, filters={"name": name}):
        if container.name == name:
            container.remove(force=True)
    end = time.monotonic() + 30
    while http_get(BIND, port, "/health", timeout_s=0.5).status is not None:
        if time.monotonic() > end:
            fail(f"something still answers on port {port} after the engine was removed")
        time.sleep(0.05)


@contextmanager
def agent_process(setup: Setup) -> Iterator[subprocess.Popen[bytes]]:
    """``meridian-node run`` as operators run it, stderr (its logs) into a file."""
    with (setup.root / "agent.stderr.log").open("ab") as stderr:
        process = subprocess.Popen(
            [str(VENV_BIN / "meridian-node"), "--config", str(setup.config_path), "run"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            yield process
        finally:
            stop_process(process, sig=signal.SIGINT, grace_s=30)


def wait_applied(setup: Setup, process: subprocess.Popen[bytes], generation: int) -> None:
    state_dir = setup.root / "state"
    end = time.monotonic() + READY_DEADLINE
    while time.monotonic() < end:
        if process.poll() is not None:
            fail(f"meridian-node run exited {process.returncode}:\n{(setup.root / 'agent.stderr.log').read_text()}")
        status = read_status(state_dir) or {}
        if (status.get("applied_generation") or 0) >= generation:
            return
        time.sleep(0.05)
    fail(f"the agent did not record generation {generation} as applied")


def proc_status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    fail(f"/proc/{pid}/status has no {field}")


def reconcile_tasks(state_dir: Path, ident: str | None = None) -> tuple[float, list[tuple[str, float]]]:
    """One journal run (``ident``; by default the latest): (seconds from playbook start to its stats,
    [(task, seconds), ...] in order)."""
    if ident is None:
        ident = sorted((state_dir / "journal").iterdir(), key=lambda path: path.stat().st_mtime)[-1].name
    events = [json.loads(path.read_text()) for path in (state_dir / "journal" / ident / "job_events").glob("*.json")]
    events.sort(key=lambda event: event["counter"])
    stamps = [datetime.fromisoformat(event["created"]) for event in events if "created" in event]
    tasks: dict[str, float] = {}
    for event in events:
        data = event.get("event_data", {})
        if event["event"] in ("runner_on_ok", "runner_on_failed", "runner_on_skipped") and "duration" in data:
            tasks[data["task"]] = tasks.get(data["task"], 0.0) + float(data["duration"])
    return (stamps[-1] - stamps[0]).total_seconds(), list(tasks.items())


def applied_run(setup: Setup) -> str:
    """The ident of the agent's last run, from its status file (right after ``wait_applied``, the run that
    applied that generation)."""
    last = (read_status(setup.root / "state") or {}).get("last_run") or {}
    ident = last.get("ident")
    if not isinstance(ident, str):
        fail("the agent's status names no last run")
    return ident


@dataclass
class PublishFigures:
    one: float  # median publish-to-ready, one engine through the agent
    fleet: float  # median publish-to-all-ready, FLEET engines through the agent
    pull: float  # median commit-to-ready, one engine through ansible-pull
    publish_s: float  # median seconds of the publish command itself
    one_run: str  # the journal runs of the last round's applies
    fleet_run: str
    one_timeline: list[tuple[str, float]]  # the last round's 1-engine sample: (step, seconds from its start)
    fleet_timeline: list[tuple[str, float]]  # its FLEET-engine sample
    pull_timeline: list[tuple[str, float]]  # and ansible-pull's
    rss_kib: int  # the idle agent afterwards
    hwm_kib: int


def container_events(client: Any, names: Sequence[str], since: float) -> dict[str, dict[str, float]]:
    """Per container of ``names``, the wall-clock times of the first create and start Docker reports at or
    after ``since`` (a ``time.time()``), from the daemon's own nanosecond event stamps."""
    seen: dict[str, dict[str, float]] = {name: {} for name in names}
    query = client.events(since=int(since) - 1, until=int(time.time()) + 1, decode=True, filters={"type": "container"})
    for event in query:
        action, at = event.get("Action"), int(event["timeNano"]) / 1e9
        name = (event.get("Actor") or {}).get("Attributes", {}).get("name")
        if name in seen and action in ("create", "start") and at >= since and action not in seen[name]:
            seen[name][str(action)] = at
    return seen


def docker_steps(seen: Mapping[str, Mapping[str, float]]) -> list[tuple[str, float | None]]:
    """The create and start steps of ``container_events``: for one container its own, for several the first
    and the last of each."""
    if len(seen) == 1:
        (only,) = seen.values()
        return [("Docker creates the container", only.get("create")), ("Docker starts it", only.get("start"))]
    steps: list[tuple[str, float | None]] = []
    for action, verb in (("create", "creates"), ("start", "starts")):
        times = sorted(stamps[action] for stamps in seen.values() if action in stamps)
        if len(times) == len(seen):
            steps += [(f"Docker {verb} the first of {len(seen)}", times[0]), (f"Docker {verb} the last", times[-1])]
    return steps


def agent_timeline(
    setup: Setup, client: Any, names: Sequence[str], ident: str, wall0: float, published: float, ready: float
) -> list[tuple[str, float]]:
    """Where one publish-to-ready went: each step's wall-clock time, as seconds after the publish began."""
    oplog = [json.loads(line) for line in (setup.root / "state" / "oplog.jsonl").read_text().splitlines() if line]
    started = [entry["at"] for entry in oplog if entry.get("run_ident") == ident and entry.get("result") == "started"]
    events = [
        json.loads(path.read_text())
        for path in (setup.root / "state" / "journal" / ident / "job_events").glob("*.json")
    ]
    events.sort(key=lambda event: event["counter"])

    def created(kind: str, task_prefix: str = "") -> float | None:
        for event in events:
            task = str((event.get("event_data") or {}).get("task", ""))
            if event["event"] == kind and task.startswith(task_prefix) and "created" in event:
                return datetime.fromisoformat(event["created"]).timestamp()
        return None

    steps = [
        ("the publish command exits", published),
        ("the agent starts the apply (oplog)", datetime.fromisoformat(started[0]).timestamp() if started else None),
        ("ansible-playbook's first event", created("playbook_on_start")),
        ("the engine task starts", created("playbook_on_task_start", "Converge the engines")),
        *docker_steps(container_events(client, names, wall0)),
        ("the engine answers ready" if len(names) == 1 else "the last engine answers ready", ready),
    ]
    return [(step, at - wall0) for step, at in steps if at is not None]


class PullPeer:
    """``ansible-pull`` from a local git repo, one revision per sample (see ansible_pull_sample)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.repo = setup.root / "pull-repo"
        self.state_dir = setup.root / "pull-state"
        self.state_dir.mkdir()
        self.repo.mkdir()
        self.revision = 0
        git(self.repo, "init", "-q", "-b", "main")
        git(self.repo, "config", "user.email", "bench@localhost")
        git(self.repo, "config", "user.name", "bench")
        self.env = {
            **os.environ,
            "ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_DEPRECATION_WARNINGS": "0",
            "ANSIBLE_LOCAL_TEMP": str(setup.root / "ansible-tmp"),
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.command = [
            str(VENV_BIN / "ansible-pull"),
            "-U",
            f"file://{self.repo}",
            "-C",
            "main",
            "-d",
            str(setup.root / "pull-checkout"),
            "-i",
            "localhost,",
            "-e",
            # The venv's interpreter so that the module finds PyYAML; a host's ansible-pull discovers its own
            # (/usr/bin/python3) and runs engine_instance as a module process, which is what this peer stays.
            f"ansible_connection=local ansible_python_interpreter={VENV_BIN / 'python'}",
            "-e",
            "meridian_engine_instance_in_worker=false",
            "site.yml",
        ]

    def sample(self, client: Any) -> float:
        """Seconds from ``git commit`` of a new revision until the engine it converges answers ready (watched
        side by side with ansible-pull, as the agent's engines are)."""
        self.revision += 1
        (self.repo / "site.yml").write_text(pull_playbook(self.setup, self.state_dir, self.revision))
        watch = ReadyWatch(client, {self.setup.engine: self.setup.port})
        start = time.perf_counter()
        git(self.repo, "add", "site.yml")
        git(self.repo, "commit", "-q", "-m", f"revision {self.revision}")
        done = subprocess.run(self.command, env=self.env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            fail(f"ansible-pull exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return watch.wait() - start


def publish_to_ready(setup: Setup, client: Any, repeat: int) -> PublishFigures:
    """The rounds of part 1 of the docstring; the agent ends with the one-engine state applied and its
    engine running (what the unchanged-cycle and kill-to-ready parts start from)."""
    one: list[float] = []
    fleet: list[float] = []
    pull: list[float] = []
    publishes: list[float] = []
    runs = {"one": "", "fleet": ""}
    timelines: dict[str, list[tuple[str, float]]] = {"one": [], "fleet": [], "pull": []}
    peer = PullPeer(setup)
    all_ports = [setup.port, *setup.fleet_ports]

    with agent_process(setup) as process:

        def agent_sample(engines: list[dict[str, Any]], key: str) -> float:
            watch = ReadyWatch(client, {engine["name"]: engine["port"] for engine in engines})
            wall0, start = time.time(), time.perf_counter()
            generation = publish(setup, {"engines": engines, "artifacts": []})
            published = time.perf_counter()
            publishes.append(published - start)
            ready = watch.wait()
            wait_applied(setup, process, generation)
            runs[key] = applied_run(setup)
            names = [engine["name"] for engine in engines]
            timelines[key] = agent_timeline(
                setup, client, names, runs[key], wall0, wall0 + published - start, wall0 + ready - start
            )
            return ready - start

        def pull_sample() -> float:
            wall0 = time.time()
            seconds = peer.sample(client)
            steps = docker_steps(container_events(client, [setup.engine], wall0))
            timelines["pull"] = [(step, at - wall0) for step, at in steps if at is not None]
            timelines["pull"].append(("the engine answers ready", seconds))
            return seconds

        def no_engines() -> None:
            # The agent drains and removes its own engines; the pull peer's (no agent owner) it leaves alone.
            wait_applied(setup, process, publish(setup, {"engines": [], "artifacts": []}))
            remove_engine(client, setup.engine, setup.port)
            wait_gone(all_ports)
            time.sleep(1.0)  # the agent is back in its long-poll

        samples: list[tuple[str, Callable[[], None]]] = [
            ("one", lambda: one.append(agent_sample([setup.spec()], "one"))),
            ("pull", lambda: pull.append(pull_sample())),
            ("fleet", lambda: fleet.append(agent_sample(setup.fleet(), "fleet"))),
        ]
        for round_ in range(repeat):
            shift = round_ % len(samples)
            for _name, take in samples[shift:] + samples[:shift]:
                no_engines()
                take()
        no_engines()
        wait_applied(setup, process, publish(setup, {"engines": [setup.spec()], "artifacts": []}))
        wait_ready(setup.port)
        time.sleep(2.0)  # applied, reported, back in the long-poll: idle
        if process.poll() is not None:
            fail(f"meridian-node run exited {process.returncode}")
        rss, hwm = proc_status_kib(process.pid, "VmRSS"), proc_status_kib(process.pid, "VmHWM")
    return PublishFigures(
        one=statistics.median(one),
        fleet=statistics.median(fleet),
        pull=statistics.median(pull),
        publish_s=statistics.median(publishes),
        one_run=runs["one"],
        fleet_run=runs["fleet"],
        one_timeline=timelines["one"],
        fleet_timeline=timelines["fleet"],
        pull_timeline=timelines["pull"],
        rss_kib=rss,
        hwm_kib=hwm,
    )


# ansible-pull


def pull_playbook(setup: Setup, state_dir: Path, revision: int) -> str:
    spec = setup.spec()
    args = {**spec, "state": "started", "policy": str(setup.root / "policy.yaml"), "state_dir": str(state_dir)}
    play = [
        {
            "name": f"Converge the engines (revision {revision})",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [{"name": "Converge the engine", "meridian.node.engine_instance": args}],
        }
    ]
    return yaml.safe_dump(play, sort_keys=False)


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


# CPU per unchanged cycle


class Counting:
    """The agent's control client, counting the calls that cost a request each."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.heartbeats = 0
        self.fetches = 0
        self.posts = 0

    def heartbeat(self, node_id: str) -> Lease:
        self.heartbeats += 1
        lease: Lease = self.real.heartbeat(node_id)
        return lease

    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait_s: float = 0) -> DesiredStateFetch:
        self.fetches += 1
        fetched: DesiredStateFetch = self.real.fetch_desired_state(node_id, etag=etag, wait_s=wait_s)
        return fetched

    def post_observation(self, observation: Observation) -> None:
        self.posts += 1
        self.real.post_observation(observation)


@dataclass
class CycleFigures:
    cycles: int
    cpu_ms: float
    heartbeats: int
    posts: int
    engines: int  # engines the observation lists: each is probed every cycle it is re-listed


class StepClock:
    """A monotonic clock that moves only when told: one step per cycle, as one long-poll would move it."""

    def __init__(self) -> None:
        # A whole number, so whole-second steps add up exactly: 15 s after a renewal is exactly 15 s.
        self.now = float(int(time.monotonic()))

    def __call__(self) -> float:
        return self.now

    def step(self, seconds: float) -> None:
        self.now += seconds


def in_process_agent(setup: Setup, clock: Callable[[], float] | None) -> tuple[Agent, Counting, DockerEngine]:
    config = load_config(setup.config_path)
    agent: Agent = build_agent(config, log=EventLogger())
    docker_engine = DockerEngine.from_env(timeout_s=5)
    if clock is not None:
        # The same observer build_agent wires, on the stepped clock (engine listing, GPU facts refresh).
        agent.observer = Observer(
            store_path=agent.policy.store.path,
            engines=DockerEngines(
                docker_engine, state_dir=Path(config.state_dir), monotonic=clock, owner=f"agent:{NODE_ID}"
            ),
            monotonic=clock,
            placement=(agent.policy.engines.port_range, agent.policy.engines.bind_address),
        )
        agent.monotonic = clock
    counting = Counting(agent.client)
    agent.client = counting
    return agent, counting, docker_engine


@contextmanager
def settings_check_off() -> Iterator[None]:
    """The per-cycle check for engines changed by hand (engine_drift, in the agent's inspect) switched off."""
    with mock.patch.object(docker_engine_module, "drifted_from_label", lambda document: None):
        yield


@contextmanager
def fake_gpus(scenario: str) -> Iterator[None]:
    """The fake pynvml's ``scenario`` behind the NVML seam, so the agent reads GPUs (and their health, with its XID
    watch) as on a GPU host: the cost measured is ours per NVML call, not the driver's."""
    from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as nvml_seam
    from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml

    fake = load_fake_pynvml()
    fake.use_scenario(scenario)
    try:
        with mock.patch.object(nvml_seam, "_pynvml", fake):
            yield
    finally:
        fake.use_scenario(None)


def unchanged_cycles(
    setup: Setup, cycles: int, *, in_service: bool, supervised: bool = True, profile: bool = False
) -> CycleFigures:
    clock = StepClock() if in_service else None
    agent, counting, docker_engine = in_process_agent(setup, clock)
    if supervised:
        agent.resume_supervision()  # what Agent.run does at start: watch the applied state's engines
        if agent.supervisor.generation is None:
            fail("the applied state was not taken up for supervision")
    try:
        first = agent.cycle(wait_s=0)
        if first.outcome != CycleStatus.UNCHANGED:
            fail(f"the published state was not already applied: the first cycle was {first.outcome}")
        for _ in range(5):  # warm caches and the TLS connection, as a running agent has
            if clock is not None:
                clock.step(agent.lease_keeper.wait_s)
            agent.cycle(wait_s=0)
        counting.heartbeats = counting.posts = 0
        total = 0.0
        profiler = cProfile.Profile(time.process_time) if profile else None  # CPU, not waiting
        for _ in range(cycles):
            if clock is not None:
                clock.step(agent.lease_keeper.wait_s)
            if profiler is not None:
                profiler.enable()
            start = time.process_time()
            outcome = agent.cycle(wait_s=0)
            agent.write_status()  # what Agent.run does after every cycle
            total += time.process_time() - start
            if profiler is not None:
                profiler.disable()
            if outcome.outcome != CycleStatus.UNCHANGED:
                fail(f"a cycle with nothing new was {outcome.outcome}")
        if profiler is not None:
            print(f"where the CPU of {cycles} cycles goes ({'as in service' if in_service else 'back to back'}):")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(45)
        engines = len((read_status(setup.root / "state") or {}).get("engines") or [])
        return CycleFigures(cycles, 1000 * total / cycles, counting.heartbeats, counting.posts, engines)
    finally:
        counting.real.close()
        docker_engine.close()


def crash(container: Any) -> None:
    """SIGKILL the engine's server process from outside, as the OOM killer or a segfault would end it.

    Not ``docker kill``: Docker counts that as stopped by hand and no restart policy applies to it. The
    server is the child of the container's init (``init: true``), which exits with it.
    """
    container.reload()
    init = int(container.attrs["State"]["Pid"])
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    if not children:
        fail(f"the engine container {container.name} has no process under its init to crash")
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)


def docker_floor(client: Any, setup: Setup, rounds: int) -> tuple[float, float]:
    """Docker's own share of the 8-vs-1 ratio: medians over ``rounds`` of the seconds to create, start and see
    ready one stand-in container, and FLEET of them side by side (a thread each), with docker-py alone: no
    agent, no Ansible. Same image, published ports and init as the engines; probed once ``start`` returned. On
    the fleet's ports: the agent's own engine still runs on ``setup.port`` when this runs."""

    image_id = setup.image.split("@", 1)[1]  # pinned by id (standin_image): the id is the image's name here
    errors: list[BaseException] = []

    def one(name: str, port: int) -> None:
        try:
            start_one(name, port)
        except BaseException as exc:  # noqa: BLE001 - the sample fails with it below
            errors.append(exc)

    def start_one(name: str, port: int) -> None:
        container = client.containers.create(
            image_id,
            name=name,
            command=["--port", "8000"],
            environment={"STANDIN_ENGINE": "vllm"},
            ports={"8000/tcp": (BIND, port)},
            init=True,
        )
        container.start()
        end = time.monotonic() + READY_DEADLINE
        while http_get(BIND, port, "/health", timeout_s=1.0).status != 200:
            if time.monotonic() > end:
                fail(f"{name} did not answer ready")
            time.sleep(0.02)

    def sample(count: int) -> float:
        names = [f"{setup.engine}-floor-{i}" for i in range(count)]
        start = time.perf_counter()
        threads = [
            threading.Thread(target=one, args=(name, port))
            for name, port in zip(names, setup.fleet_ports, strict=False)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        for container in client.containers.list(all=True, filters={"name": f"{setup.engine}-floor-"}):
            container.remove(force=True)
        if errors:
            fail(f"Docker alone: {errors[0]!r}")
        wait_gone(setup.fleet_ports)
        return seconds

    singles, fleets = [], []
    for _ in range(rounds):
        singles.append(sample(1))
        fleets.append(sample(FLEET))
    return statistics.median(singles), statistics.median(fleets)


def kill_to_ready(setup: Setup, client: Any, *, by: str) -> tuple[float, str]:
    """Seconds from the engine's death until it answers ready again, and how it came back.

    ``by="docker"``: the server process is killed (``crash``), nothing else runs: Docker's restart policy
    brings it back, or nothing does (then the figure is the wait limit and the note says so).
    ``by="agent"``: ``docker stop`` (which every restart policy respects), and the in-process agent cycles
    every 0.5 s until supervision repaired it.
    """
    container = client.containers.get(setup.engine)
    policy = (container.attrs.get("HostConfig", {}).get("RestartPolicy") or {}).get("Name") or "no"
    agent = counting = docker_engine = None
    if by == "agent":
        agent, counting, docker_engine = in_process_agent(setup, None)
        agent.resume_supervision()
        agent.cycle(wait_s=0)
    try:
        start = time.perf_counter()
        if by == "docker":
            crash(container)
        else:
            container.stop(timeout=10)
        while http_get(BIND, setup.port, "/health", timeout_s=0.5).status == 200:
            time.sleep(0.02)  # dead for sure before the clock for "ready again" runs
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if agent is not None:
                agent.cycle(wait_s=0)
            if http_get(BIND, setup.port, "/health", timeout_s=0.5).status == 200:
                how = f"restart policy {policy}" if by == "docker" else f"agent repair (restart policy {policy})"
                return time.perf_counter() - start, how
            time.sleep(0.5 if agent is not None else 0.05)
        if by == "docker":
            client.containers.get(setup.engine).start()
            wait_ready(setup.port)
        return time.perf_counter() - start, f"not back after 120 s (restart policy {policy})"
    finally:
        if counting is not None:
            counting.real.close()
        if docker_engine is not None:
            docker_engine.close()


def compile_as_installed() -> None:
    """Byte-compile the checkout's collection and agent, as ``pip install`` does for the agent's wheel (and its
    private copy of the collection): the agent, root's apply and the publish command here run from the editable
    checkout, and a machine that sets PYTHONDONTWRITEBYTECODE (this one does) would otherwise have every
    ansible-playbook run compile our module_utils from source again (0.05-0.07 s of the engine task alone).
    ansible-pull's module gains nothing from it: an AnsiballZ payload carries sources, compiled where it runs."""
    repo = Path(__file__).resolve().parents[1]
    for tree in (repo / "plugins", repo / "agent" / "meridian_node_agent"):
        compileall.compile_dir(str(tree), quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="also print cProfile's view of the in-service cycles")
    parser.add_argument(
        "--nvml",
        metavar="SCENARIO",
        default="eight-gpus",
        help="the fake pynvml scenario the unchanged cycle is also measured with (GPU facts and health read as on "
        "a GPU host; default eight-gpus: 8 H100s); 'none' to skip",
    )
    args = parser.parse_args()
    compile_as_installed()
    client = docker.from_env(timeout=60)
    base = ensure_base_image(client)
    image = ensure_engine_image(client, base, SERVER, engine="vllm").pinned
    with tempfile.TemporaryDirectory(prefix="mn-bench-agent-") as tmp:
        root = Path(tmp)
        port, *fleet_ports = free_ports(1 + FLEET)
        engine = f"mn-bench-{os.getpid()}-chat"
        try:
            (root / "control-plane").mkdir()
            with running(root / "control-plane" / "data") as server:
                config_path = write_node(root / "node", server, [port, *fleet_ports])
                setup = Setup(root / "node", server, config_path, image, port, engine, tuple(fleet_ports))
                enroll_node(server, setup.root / "state" / "identity", NODE_ID).close()
                figures = publish_to_ready(setup, client, args.repeat)
                floor_one, floor_fleet = docker_floor(client, setup, args.repeat)
                one_run = reconcile_tasks(setup.root / "state", figures.one_run)
                fleet_run = reconcile_tasks(setup.root / "state", figures.fleet_run)
                service = unchanged_cycles(setup, args.cycles, in_service=True, profile=args.profile)
                unsupervised = unchanged_cycles(setup, args.cycles, in_service=True, supervised=False)
                with settings_check_off():
                    unchecked = unchanged_cycles(setup, args.cycles, in_service=True)
                back_to_back = unchanged_cycles(setup, args.cycles, in_service=False)
                with_gpus = None
                if args.nvml != "none":
                    with fake_gpus(args.nvml):
                        with_gpus = unchanged_cycles(setup, args.cycles, in_service=True)
                docker_back, docker_how = kill_to_ready(setup, client, by="docker")
                agent_back, agent_how = kill_to_ready(setup, client, by="agent")
                settle = load_config(setup.config_path).supervision.settle_seconds
        finally:
            # Docker's name filter matches substrings: the fleet's names all start with the first engine's.
            for container in client.containers.list(all=True, filters={"name": engine}):
                if container.name == engine or container.name.startswith(f"{engine}-"):
                    container.remove(force=True)
    wait = min(LONG_POLL, HEARTBEAT)
    print(f"CPU per unchanged cycle, agent in process, time.process_time() over {args.cycles} cycles:")
    print(
        f"  as in service (each cycle = one {wait} s long-poll)  {service.cpu_ms:6.2f} ms   "
        f"heartbeats {service.heartbeats}/{service.cycles}, observation posts {service.posts}, "
        f"engines on the host {service.engines}  (target <= 5 ms)"
    )
    print(
        f"  as in service, supervision off                 {unsupervised.cpu_ms:6.2f} ms   "
        f"(ratio supervised / not {service.cpu_ms / unsupervised.cpu_ms:.2f})"
    )
    print(
        f"  as in service, no changed-by-hand check      {unchecked.cpu_ms:6.2f} ms   "
        f"(ratio with the check / without {service.cpu_ms / unchecked.cpu_ms:.2f})"
    )
    if with_gpus is not None:
        print(
            f"  as in service, GPUs of fake scenario {args.nvml!r} (facts, health, XIDs) {with_gpus.cpu_ms:6.2f} ms   "
            f"(ratio with GPUs / without {with_gpus.cpu_ms / service.cpu_ms:.2f}; guard <= 10 ms)"
        )
    print(
        f"  back to back (no wait, real clocks)             {back_to_back.cpu_ms:6.2f} ms   "
        f"heartbeats {back_to_back.heartbeats}/{back_to_back.cycles}, observation posts {back_to_back.posts}"
    )
    print(f"publish-to-ready of stand-in vLLM engines, median of {args.repeat} interleaved rounds:")
    print(
        f"  1 engine, meridian-node run (long-poll)   {figures.one:6.2f} s   "
        f"(the publish command itself {figures.publish_s:.2f} s)"
    )
    print(f"  1 engine, ansible-pull (git commit + pull) {figures.pull:5.2f} s")
    print(f"  ratio agent / ansible-pull                {figures.one / figures.pull:6.2f}   (target <= 0.45, issue 46)")
    print(f"  {FLEET} engines, meridian-node run             {figures.fleet:6.2f} s   (until all {FLEET} are ready)")
    print(f"  ratio {FLEET} engines / 1 engine                {figures.fleet / figures.one:6.2f}   (target <= 1.3)")
    print(
        f"  Docker alone (docker-py create + start + ready, no agent): 1 container {floor_one:.2f} s, "
        f"{FLEET} side by side {floor_fleet:.2f} s; the agent's {FLEET}-vs-1 ratio cannot go below "
        f"{(figures.one + floor_fleet - floor_one) / figures.one:.2f} on this machine"
    )
    for label, timeline in (
        ("1-engine sample went, meridian-node run", figures.one_timeline),
        ("1-engine sample went, ansible-pull", figures.pull_timeline),
        (f"{FLEET}-engine sample went, meridian-node run", figures.fleet_timeline),
    ):
        print(f"  where the last round's {label} (seconds after the publish / commit began):")
        for step, seconds in timeline:
            print(f"    {seconds:5.2f} s  {step}")
    for label, (playbook_s, tasks) in (("1 engine", one_run), (f"{FLEET} engines", fleet_run)):
        print(f"  the agent's reconcile run for {label}, last round (ansible-runner journal): {playbook_s:.2f} s")
        for task, seconds in tasks:
            print(f"    {seconds:5.2f} s  {task}")
    print("engine killed -> ready again:")
    print(f"  process crash, nothing else    {docker_back:6.2f} s   ({docker_how})")
    print(f"  docker stop, the agent repairs {agent_back:6.2f} s   ({agent_how}; {settle:g} s of it is settling)")
    print(
        f"idle meridian-node run: VmRSS {figures.rss_kib / 1024:.1f} MiB (target <= 80), "
        f"VmHWM {figures.hwm_kib / 1024:.1f} MiB"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    run_bench(main)

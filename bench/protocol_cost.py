"""What one node costs the control plane per hour: requests and bytes by endpoint, idle and while converging,
beside what the kubelet's and balena-supervisor's published defaults cost.

    .venv/bin/python bench/protocol_cost.py [--hours 1] [--publish-every 10] [--ready-after 120] [--seed 27]

How it is measured. One agent (``Agent`` from ``build_agent``, in this process, the agent's default timers:
heartbeat 15 s, long-poll 30 s, observation refresh 5 min, each ±10 %) talks to a real
``meridian-node-devserver serve`` process on 127.0.0.1 (its default 30 s lease) with the real ``ControlClient`` over
real mutual TLS, through a TCP relay in this process that counts every byte each way: TLS records, handshakes
included, TCP/IP headers not. HTTP bytes (request and answer, head and body) are counted under TLS, on the
client's socket. The node reports 8 H100s (the fake pynvml's ``eight-gpus`` scenario behind the real GPU health
reader) and two ready engines; the apply is instant (``tests/support/instant_apply``): an apply's length changes
what the host does, not what it sends.

The clock is compressed, not extrapolated: the agent's monotonic clock is simulated and moves only by what a
long-poll would have waited, so ``--hours`` of the real loop's timers (jitter, the 5-minute refresh, the
renewal that ends each long-poll) run in seconds. Every request is real and reaches the server; only a
long-poll's wait is not sat out: the fetch goes without ``?wait=`` (the server would hold it) and the bytes of the
query it would have carried are added to its request, in HTTP and on the wire alike (TLS adds no padding). Counting
one cycle and multiplying would miss the refresh and the jitter. A gap between two requests longer than
uvicorn's keep-alive (5 s) closes the connection first, as the server would have: with a long-poll there is
none, so one TLS connection carries the hour. The start-up cycle (first lease, first fetch of the state, its
apply) is not counted. A certificate renewal (one per 20 days of a 30-day certificate) is left out: < 0.01/h.

Scenarios, each a fresh node on the same server:

- idle, quiet GPUs: nothing changes, the GPUs' gauges stand still.
- idle, busy GPUs: nothing changes but the gauges (utilisation, temperature, power, memory in use, clocks), which
  move at every GPU read (every 30 s) as on a host serving traffic. The agent leaves them out of the digest that
  decides whether an observation is new, so this costs what quiet GPUs cost.
- converging: a new desired state every ``--publish-every`` minutes (two engines, its first one's image moves);
  at each, the engine it changes restarts and is ready ``--ready-after`` seconds later; busy GPUs.

The anchors are computed from their published defaults; their byte sizes are assumptions, written here:

- kubelet (Kubernetes, KEP 0009 "Efficient Node Heartbeats", kubernetes/enhancements
  keps/sig-node/589-efficient-node-heartbeats; KubeletConfiguration defaults): the NodeLease is renewed every 10 s
  (a quarter of ``nodeLeaseDurationSeconds`` 40), one PUT of the Lease (the client keeps the last one, no GET);
  NodeStatus is sent when it changed and at least every ``nodeStatusReportFrequency``, 5 min. Sizes assumed:
  a Lease PUT 400 B each way (the protobuf Lease with its managed fields, ~300 B, plus HTTP/2 headers after HPACK,
  ~100 B); a NodeStatus PATCH 1.5 kB up (the conditions' heartbeat times) and 20 kB down (the apiserver answers
  with the whole Node: the KEP's "average node object size 20KB ... in production clusters"). Its desired state
  arrives on a watch it holds open (no request per change): one Pod event, assumed the size of our envelope, per
  change; each status change is a pod status PATCH, assumed 1.5 kB up and 5 kB down (the Pod), counted as often
  as our agent posted an observation per change; one more NodeStatus PATCH per change (the node's image list).
- balena-supervisor (balena-os/balena-supervisor ``src/api-binder/poll.ts``, ``report.ts``, ``lib/constants.ts``,
  ``config/schema-type.ts``): the target state is polled every ``appUpdatePollInterval`` (900,000 ms) plus a random
  jitter up to ``maxApiJitterDelay`` (60 s), with ``If-None-Match`` -> 304; state changes are reported as
  diff-only PATCHes at most every ``maxReportFrequency`` (10 s); metrics (CPU, memory, temperature) alone at most
  every ``maxMetricsFrequency`` (300 s), which on a busy host is every 5 min. Sizes assumed: a poll 350 B up (bearer
  key, ETag) and 300 B down (a 304's headers); a report 500 B up (headers and a small JSON diff) and 250 B down.
  Per change: the poll that sees it answers 200 with the target state, assumed the size of our envelope; the
  diff PATCHes counted as often as our agent posted per change. Its VPN (``instantUpdates``) is left out.

For both anchors only HTTP bytes are modelled, so the ratios compare HTTP bytes; our TLS bytes are printed
beside. Ratios are ours / theirs: below 1 we cost less.
"""

import argparse
import json
import random
import select
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, cast
from unittest import mock

import yaml
from timing import run_bench

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, Observation
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, running
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.instant_apply import instant_success
from ansible_collections.meridian.node.tests.support.node_env import make_node
from meridian_node_agent.agent_side import control_client
from meridian_node_agent.agent_side.control_client import ControlClient, DesiredStateFetch, FetchStatus
from meridian_node_agent.agent_side.control_link import Link, Reply
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.agent_side.reporter import REPORT_REFRESH_S
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.config import TIMER_JITTER

HOUR_S = 3600.0
KEEP_ALIVE_S = 5.0  # uvicorn's timeout_keep_alive: the devserver ends a connection idle this long
IMAGE = "meridian-node/standin@sha256:" + "5" * 64
ENGINES = ("chat", "embed")

# The anchors' published defaults (see the module docstring for where each comes from).
KUBELET_LEASE_RENEW_S = 10.0
KUBELET_STATUS_REPORT_S = 300.0
KUBELET_LEASE_PUT_B = (400, 400)
KUBELET_STATUS_PATCH_B = (1500, 20000)
KUBELET_POD_STATUS_PATCH_B = (1500, 5000)
BALENA_POLL_S = 900.0
BALENA_POLL_JITTER_S = 60.0  # uniform in [0, 60): 30 s on average
BALENA_METRICS_S = 300.0
BALENA_POLL_304_B = (350, 300)
BALENA_REPORT_B = (500, 250)


def fail(message: str) -> NoReturn:
    raise SystemExit(f"bench: {message}")


# --- counting -----------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Bytes up (client -> server) and down, and connections opened."""

    up: int = 0
    down: int = 0
    connections: int = 0

    def copy(self) -> "Tally":
        return Tally(self.up, self.down, self.connections)

    def minus(self, other: "Tally") -> "Tally":
        return Tally(self.up - other.up, self.down - other.down, self.connections - other.connections)


class Relay:
    """A TCP relay on 127.0.0.1 in front of the devserver, counting the bytes of each direction as they pass: what
    the control plane receives and sends on the wire for this node (TLS records, handshakes included)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.tally = Tally()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name="relay", daemon=True)
        self._thread.start()

    def snapshot(self) -> Tally:
        with self._lock:
            return self.tally.copy()

    def close(self) -> None:
        self._stopping = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self.tally.connections += 1
            threading.Thread(target=self._pump, args=(client, server), name="relay-pump", daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        """Both directions in one thread: each chunk is counted before it is passed on, so when the client has the
        answer, every byte of the exchange has been counted."""
        peers = {client: server, server: client}
        try:
            while True:
                readable, _, _ = select.select(list(peers), [], [])
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    with self._lock:
                        if sock is client:
                            self.tally.up += len(data)
                        else:
                            self.tally.down += len(data)
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


HTTP = Tally()  # HTTP bytes on the client's socket, under TLS (one agent, one thread at a time)


class _CountingSocket:
    """The TLS socket as ``Link.exchange`` uses it, with what it sends and receives counted: the HTTP bytes."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def sendall(self, data: bytes) -> None:
        HTTP.up += len(data)
        self._sock.sendall(data)

    def recv(self, size: int) -> bytes:
        data: bytes = self._sock.recv(size)
        HTTP.down += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class CountingLink(Link):
    """The client's ``Link``, its socket wrapped for the length of each exchange (never between: the client's checks
    of an idle connection need the real ``SSLSocket``)."""

    def exchange(self, method: str, target: str, **kwargs: Any) -> Reply:
        real = self.sock
        self.sock = cast(socket.socket, _CountingSocket(real))
        try:
            return super().exchange(method, target, **kwargs)
        finally:
            self.sock = real


# --- the simulated node ---------------------------------------------------------------------------------------------


class Clock:
    """The agent's monotonic clock, moved by what a long-poll would have waited."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Endpoint:
    requests: int = 0
    http: Tally = field(default_factory=Tally)
    wire: Tally = field(default_factory=Tally)


class Metered:
    """The agent's control-plane port: the real client, each call's bytes (HTTP and wire) booked to its endpoint,
    the long-poll's wait moved on the simulated clock, and the scenario's publishes made at their simulated time."""

    def __init__(self, real: ControlClient, clock: Clock, relay: Relay, publish: Callable[[], None]) -> None:
        self.real = real
        self.clock = clock
        self.relay = relay
        self.publish = publish
        self.publish_at: list[float] = []
        self.counting = False
        self.endpoints: dict[str, Endpoint] = {}
        self.last_end = 0.0
        self.said: tuple[Any, ...] | None = None

    def heartbeat(self, node_id: str) -> Lease:
        lease: Lease = self._call("POST heartbeat", lambda: self.real.heartbeat(node_id))
        self.last_end = self.clock.now
        return lease

    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait_s: float = 0) -> DesiredStateFetch:
        answered_at = self.clock.now + wait_s  # nothing new: the server holds it to the end of the wait
        if self.publish_at and self.publish_at[0] <= answered_at:
            # A publish during the long-poll: the server answers it then, with the new state.
            answered_at = max(self.clock.now, self.publish_at.pop(0))
            self.publish()
        query = len(f"?wait={wait_s:g}") if wait_s else 0
        fetched: DesiredStateFetch = self._call(
            "GET desired-state", lambda: self.real.fetch_desired_state(node_id, etag=etag), query=query
        )
        self.clock.now = self.last_end = answered_at
        return fetched

    def post_observation(self, observation: Observation) -> None:
        # What the control plane acts on, to tell a post that says something new from a refresh.
        said = (
            observation.lease_epoch,
            observation.applied_generation,
            tuple((e.name, e.image, e.ready, e.draining) for e in observation.engines),
            observation.last_run.ident if observation.last_run else None,
            tuple((gpu.health.verdict if gpu.health else None) for gpu in observation.gpu.gpus),
        )
        why = "refresh" if said == self.said else "change"
        self.said = said
        self._call(f"POST observations ({why})", lambda: self.real.post_observation(observation))
        self.last_end = self.clock.now

    def _call(self, name: str, call: Callable[[], Any], query: int = 0) -> Any:
        if self.clock.now - self.last_end > KEEP_ALIVE_S:
            self.real.close()  # the server ended the idle connection meanwhile
        wire, http = self.relay.snapshot(), HTTP.copy()
        result = call()
        if isinstance(result, DesiredStateFetch):
            name = f"{name} {({FetchStatus.NEW: 200, FetchStatus.NOT_MODIFIED: 304}).get(result.status, 204)}"
        if self.counting:
            endpoint = self.endpoints.setdefault(name, Endpoint())
            endpoint.requests += 1
            booked = HTTP.minus(http)
            endpoint.http.up += booked.up + query
            endpoint.http.down += booked.down
            spent = self.relay.snapshot().minus(wire)
            endpoint.wire.up += spent.up + query
            endpoint.wire.down += spent.down
            endpoint.wire.connections += spent.connections
        return result


class InstantApply:
    """An apply that succeeds at once; when it happened (simulated) is what the engines' readiness counts from."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.applied: tuple[int, float] | None = None

    def apply(self, envelope: bytes, *, generation: int, **_: Any) -> ApplyResult:
        self.applied = (generation, self.clock.now)
        return instant_success(generation)


class Engines:
    """The node's two engines as the observer lists them: the first restarts with each new generation and is ready
    ``ready_after_s`` later; the second never changes."""

    def __init__(self, clock: Clock, applier: InstantApply, ready_after_s: float) -> None:
        self.clock = clock
        self.applier = applier
        self.ready_after_s = ready_after_s

    def __call__(self) -> list[dict[str, Any]]:
        generation, applied_at = self.applier.applied or (0, -HOUR_S)
        listed = []
        for index, name in enumerate(ENGINES):
            moved = index == 0
            listed.append(
                {
                    "name": name,
                    "managed": True,
                    "driver": "vllm",
                    "image": f"{IMAGE[:-8]}{generation if moved else 1:08d}",
                    "state": "running",
                    "ready": not moved or self.clock.now - applied_at >= self.ready_after_s,
                    "draining": False,
                    "port": 8001 + index,
                    "served_model_name": name,
                    "restarts": 0,
                }
            )
        return listed


class Gpus:
    """The fake pynvml's eight-GPU host behind the real GPU reader; with ``busy`` its gauges move at every read."""

    def __init__(self, busy: bool) -> None:
        self.fake = load_fake_pynvml()
        self.scenario: dict[str, Any] = json.loads(
            (Path(self.fake.SCENARIO_DIR) / "eight-gpus.json").read_text(encoding="utf-8")
        )
        self.fake.use_scenario(self.scenario)
        self.busy = busy
        self.reads = 0
        self.watch = GpuHealthWatch(nvml=self.fake)

    def __call__(self) -> dict[str, Any]:
        self.reads += 1
        if self.busy:
            for index, gpu in enumerate(self.scenario["gpus"]):
                step = self.reads * 7 + index
                gpu["utilization"] = {"gpu": step % 101, "memory": step * 3 % 101}
                gpu["temperature"] = 55 + step % 20
                gpu["power_usage_mw"] = 400000 + step % 97 * 1000
                total = gpu["memory"]["total"]
                used = total // 2 + step % 50 * 1048576
                gpu["memory"] = {"total": total, "used": used, "free": total - used}
            self.fake.change_scenario(self.scenario)
        facts: dict[str, Any] = self.watch()
        return facts


@dataclass
class Result:
    name: str
    hours: float
    endpoints: dict[str, Endpoint]
    changes: int
    posts_per_change: float
    envelope_b: int

    def per_hour(self, value: float) -> float:
        return value / self.hours

    @property
    def requests(self) -> float:
        return self.per_hour(sum(e.requests for e in self.endpoints.values()))

    @property
    def http_b(self) -> float:
        return self.per_hour(sum(e.http.up + e.http.down for e in self.endpoints.values()))

    @property
    def wire_b(self) -> float:
        return self.per_hour(sum(e.wire.up + e.wire.down for e in self.endpoints.values()))


def write_policy(root: Path) -> None:
    """A policy that lets the scenario's states verify: the control key, the engines' image and driver."""
    policy = {
        "trust": {"control": {"threshold": 1, "public_keys": ["keys/control.pem"]}},
        "images": {"allowed_repositories": ["meridian-node/standin"], "require_digest": True},
        "engines": {"allowed_drivers": ["vllm"], "bind_address": "127.0.0.1", "port_range": [8001, 8099]},
        "store": {"path": str(root / "store"), "max_bytes": "1G"},
        "agent": {"allowed_modes": ["observe-only", "managed-host"]},
    }
    (root / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))


def state_document(generation_hint: int) -> dict[str, Any]:
    """Two engines, the first one's image moving with each publish: a state the size of a small real one."""
    return {
        "artifacts": [],
        "engines": [
            {
                "name": name,
                "driver": "vllm",
                "image": f"{IMAGE[:-8]}{generation_hint if index == 0 else 1:08d}",
                "model": {"name": f"meta-llama/Llama-3.1-{8 if index == 0 else 1}B-Instruct"},
                "served_model_name": name,
                "port": 8001 + index,
                "gpus": [str(index * 4 + gpu) for gpu in range(4)],
            }
            for index, name in enumerate(ENGINES)
        ],
    }


def run_scenario(
    server: DevServer,
    root: Path,
    name: str,
    *,
    hours: float,
    busy: bool,
    publish_every_s: float | None,
    ready_after_s: float,
    seed: int,
) -> Result:
    """One fresh node for ``hours`` simulated hours after its start-up cycle; what it cost, by endpoint."""
    node_id = "protocol-cost-" + "".join(c if c.isalnum() else "-" for c in name.lower()).replace("--", "-")
    node = make_node(server, root / node_id, node_id)
    write_policy(node.root)
    relay = Relay(int(server.base_url.rsplit(":", 1)[1]))
    # The agent's defaults (heartbeat 15 s, long-poll 30 s): only the URL is set, the relay's.
    node.configure(control_plane={"url": f"https://127.0.0.1:{relay.port}"})
    documents = root / f"{node_id}-states"
    documents.mkdir()
    published = [0]

    def publish() -> None:
        published[0] += 1
        path = documents / f"{published[0]}.yaml"
        path.write_text(yaml.safe_dump(state_document(published[0])))
        server.cli("publish", node_id, str(path), "--ttl", str(int(hours * HOUR_S) + 7200))

    publish()  # the state the node starts from
    clock = Clock()
    agent: Agent = node.agent()
    applier = InstantApply(clock)
    gpus = Gpus(busy)
    agent.monotonic = clock
    agent.rng = random.Random(seed)
    agent.applier = applier
    agent.observer = Observer(
        store_path=None, gpu_facts=gpus, engines=Engines(clock, applier, ready_after_s), monotonic=clock
    )
    real = agent.client
    if not isinstance(real, ControlClient):
        fail("build_agent did not give the agent a ControlClient")
    metered = Metered(real, clock, relay, publish)
    agent.client = metered
    try:
        first = agent.cycle(wait_s=agent.lease_keeper.long_poll_s)  # start-up: lease, the state, its apply; not counted
        if first.outcome != CycleStatus.APPLIED:
            fail(f"the start-up cycle was {first.outcome}, not an apply")
        start = clock.now
        end = start + hours * HOUR_S
        if publish_every_s:
            metered.publish_at = [
                start + publish_every_s * k for k in range(1, int(hours * HOUR_S / publish_every_s) + 1)
            ]
        metered.counting = True
        changes = 0
        while clock.now < end:
            outcome = agent.cycle(wait_s=agent.lease_keeper.long_poll_s)
            if outcome.outcome == CycleStatus.APPLIED:
                changes += 1
            elif outcome.outcome != CycleStatus.UNCHANGED:
                fail(f"{name}: a cycle was {outcome.outcome}")
            agent.write_status()  # what Agent.run does after each cycle
        span_h = (clock.now - start) / HOUR_S
    finally:
        real.close()
        relay.close()
        agent.close()
    posts = metered.endpoints.get("POST observations (change)", Endpoint()).requests
    new = metered.endpoints.get("GET desired-state 200")
    envelope_b = int(new.http.down / new.requests) if new and new.requests else 0
    return Result(name, span_h, metered.endpoints, changes, posts / changes if changes else 0.0, envelope_b)


# --- the anchors ----------------------------------------------------------------------------------------------------


@dataclass
class Anchor:
    name: str
    requests: float
    http_b: float
    how: str


def kubelet(changes_per_h: float, reports_per_change: float, envelope_b: int) -> Anchor:
    leases = HOUR_S / KUBELET_LEASE_RENEW_S
    statuses = HOUR_S / KUBELET_STATUS_REPORT_S + changes_per_h  # the periodic one, and one per image change
    pod_patches = changes_per_h * reports_per_change
    requests = leases + statuses + pod_patches  # the desired state comes on a held watch: no request
    http_b = (
        leases * sum(KUBELET_LEASE_PUT_B)
        + statuses * sum(KUBELET_STATUS_PATCH_B)
        + pod_patches * sum(KUBELET_POD_STATUS_PATCH_B)
        + changes_per_h * envelope_b
    )
    return Anchor("kubelet", requests, http_b, "Lease PUT /10 s, NodeStatus /5 min; changes: watch event + patches")


def balena(changes_per_h: float, reports_per_change: float, envelope_b: int) -> Anchor:
    polls = HOUR_S / (BALENA_POLL_S + BALENA_POLL_JITTER_S / 2)
    metrics = HOUR_S / BALENA_METRICS_S  # busy host: the metrics' own schedule, every 5 min
    reports = changes_per_h * reports_per_change
    requests = polls + metrics + reports
    http_b = (
        polls * sum(BALENA_POLL_304_B)
        + (metrics + reports) * sum(BALENA_REPORT_B)
        + changes_per_h * (envelope_b - BALENA_POLL_304_B[1])  # the poll that sees a change answers 200
    )
    return Anchor(
        "balena-supervisor", requests, http_b, "poll /15 min + U(0,60 s) -> 304, metrics /5 min, diff PATCHes"
    )


# --- printing -------------------------------------------------------------------------------------------------------


def kb(value: float) -> str:
    return f"{value / 1000:8.1f} kB"


def show(result: Result) -> None:
    print(f"\n{result.name}: {result.hours:.2f} h simulated, {result.changes / result.hours:.1f} applies/h")
    print(
        f"  {'endpoint':28} {'requests/h':>10} {'HTTP up/h':>11} {'HTTP down/h':>11} {'wire (TLS)/h':>12} {'conns':>5}"
    )
    for name in sorted(result.endpoints):
        e = result.endpoints[name]
        print(
            f"  {name:28} {result.per_hour(e.requests):10.1f} {kb(result.per_hour(e.http.up))} "
            f"{kb(result.per_hour(e.http.down))} {kb(result.per_hour(e.wire.up + e.wire.down)):>12} "
            f"{e.wire.connections:5d}"
        )
    print(f"  {'total':28} {result.requests:10.1f} {kb(result.http_b):>23} {kb(result.wire_b):>12}")
    for name, e in sorted(result.endpoints.items()):
        if e.requests:
            print(f"    {name}: {(e.http.up + e.http.down) / e.requests:,.0f} HTTP bytes per request")


def compare(result: Result, anchors: list[Anchor]) -> None:
    print(f"  beside the anchors ({result.name}; ratio = ours / theirs, HTTP bytes):")
    print(f"    {'ours':20} {result.requests:8.1f} req/h {kb(result.http_b)}/h")
    for anchor in anchors:
        print(
            f"    {anchor.name:20} {anchor.requests:8.1f} req/h {kb(anchor.http_b)}/h   "
            f"ratio requests {result.requests / anchor.requests:5.2f}, bytes {result.http_b / anchor.http_b:5.2f}"
            f"   ({anchor.how})"
        )


@contextmanager
def devserver(root: Path) -> Iterator[DevServer]:
    with running(root / "data") as server:
        yield server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours per scenario")
    parser.add_argument("--publish-every", type=float, default=10.0, help="minutes between states while converging")
    parser.add_argument("--ready-after", type=float, default=120.0, help="seconds a restarted engine takes to be ready")
    parser.add_argument("--seed", type=int, default=27, help="the agent's random source (its timers' jitter)")
    args = parser.parse_args()
    print(
        f"one node per hour: agent defaults (heartbeat 15 s, long-poll 30 s, observation refresh "
        f"{REPORT_REFRESH_S:g} s, timers ±{TIMER_JITTER:.0%}), devserver lease 30 s, 8 GPUs, 2 engines; "
        "compressed clock, every request real (mutual TLS, 127.0.0.1)"
    )
    with (
        tempfile.TemporaryDirectory(prefix="meridian-bench-protocol-") as temporary,
        devserver(Path(temporary)) as server,
    ):
        root = Path(temporary)
        # Idle: the engines are ready from the start (the start-up apply restarts nothing that is counted).
        idle = {"hours": args.hours, "ready_after_s": 0.0, "seed": args.seed, "publish_every_s": None}
        quiet = run_scenario(server, root, "idle, quiet GPUs", busy=False, **idle)
        busy = run_scenario(server, root, "idle, busy GPUs", busy=True, **idle)
        converging = run_scenario(
            server,
            root,
            "converging",
            hours=args.hours,
            busy=True,
            publish_every_s=args.publish_every * 60,
            ready_after_s=args.ready_after,
            seed=args.seed,
        )
    for result in (quiet, busy):
        show(result)
    show(converging)
    envelope_b = converging.envelope_b
    print(
        f"\n  per change while converging: {converging.posts_per_change:.1f} observation posts that said something "
        f"new, and one 200 of {envelope_b:,} HTTP bytes down (the signed state and its head)"
    )
    print()
    compare(busy, [kubelet(0, 0, envelope_b), balena(0, 0, envelope_b)])
    changes_per_h = converging.changes / converging.hours
    per_change = converging.posts_per_change
    compare(
        converging,
        [kubelet(changes_per_h, per_change, envelope_b), balena(changes_per_h, per_change, envelope_b)],
    )


if __name__ == "__main__":
    with mock.patch.object(control_client, "Link", CountingLink):
        run_bench(main)

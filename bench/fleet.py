"""A fleet of simulated nodes against a real devserver: where the control plane breaks, and why.

    .venv/bin/python bench/fleet.py [--nodes 100,500,1000,2000,5000,10000] [--step-seconds 180]
        [--server-cpus 0] [--database-url URL] [--replicas 1] [--ramp-seconds S] [--changing 0]
        [--publish-rate 1.0] [--json] [--profile DIR]

Why: issue 27 asks where ``meridian-node-devserver`` stops keeping up with a fleet of agents, and what the
bottleneck is then; nothing had measured it. Each simulated node is what the control plane sees of an agent:

- real mutual TLS, one P-256 key and certificate per node, enrolled through ``POST /v1/enroll`` before any
  timing (bench/fleet_enroll.py);
- one kept-alive HTTP/1.1 connection per node, all of them held by one asyncio event loop, answers read by
  ``h11`` (bench/fleet_client.py);
- the agent's cycle and timers, from the agent's own defaults and constants: a lease renewal every 15 s
  ±10 %, a long-poll with ``If-None-Match`` that ends at the next renewal, the observation posted when its
  content digest changes or every 300 s ±10 %, the agent's ``Backoff`` after a failure (bench/fleet_node.py);
- 8-GPU observation bodies (17 KiB of GPU facts, 23 KiB in all), the agent's own GPU reader on the fake NVML,
  each variant validated as an ``Observation`` (bench/fleet_observation.py). ``--changing`` is the chance that
  a GPU refresh (every 30 s) finds something the digest covers changed (an engine's readiness, a health
  counter); 0, the default, is a steady fleet whose gauges move while its content does not.

Each step (``--nodes``, one step per count) starts a fresh ``serve`` on the enrolled fleet's data dir, pinned
to ``--server-cpus`` (this process takes the other cores), connects its nodes, starts them at random moments
over one heartbeat interval (agents of a fleet start at different times) and waits until every one has made
its first cycle. Then it measures for ``--step-seconds``:

- per endpoint: answers per second, and p50/p99/max latency; for the long-poll's 304 the latency is the time
  past its ``wait`` (how late the server answers a deadline it was given); errors and timeouts over the
  whole step, ramp included (a timeout is the agent's: 10 s per call, plus a long-poll's wait);
- the ramp: p50/p99/max of every answer before the window, the fleet's first cycles (each node's first fetch
  answered in full and its first observation posted within one heartbeat interval: what a server meets when it
  restarts under a connected fleet; ``--ramp-seconds`` spreads them wider, to tell a restart storm from the
  steady state it leads to);
- offered load: what the agent's timers ask for (``AgentTimers.calls_per_node_s``, plus two calls per
  publish), and the ratio of what was answered to it, which falls below 1 where the server stops keeping up;
- read staleness: ``--publish-rate`` times a second a new desired state is published to a random node from
  this process through ``ControlPlane.publish`` on the same database (as the ``publish`` CLI does), and the
  time from the start of that publish until the node's waiting long-poll returns it (an upper bound: it
  includes the signing and the commit);
- server CPU (percent of one core, from /proc/<pid>/stat), its RSS growth per connected node since it
  started, its open descriptors; this process's CPU and its event loop's lag (how late a 100 ms timer fires:
  if that grows, the generator, not the server, would be what is measured);
- database: transactions per second (PostgreSQL ``xact_commit``; SQLite has no counter: n/a) and growth;
- with ``--profile DIR``, where the server's time went, from py-spy (bench/fleet_profile.py).

Output: two Markdown tables (per step; per step and endpoint) to paste into docs/SCALE.md, or ``--json``.

What the generator costs, measured (2-core machine shared with other work, server pinned to CPU 0, this process
on CPU 1, SQLite, 60 s windows): 1.3 % of its core at 100 nodes, 3.2 % at 500, 5 % at 1,000 (about 0.3 ms
per exchange, TLS included), its event loop's lag p99 under 8 ms; 1,000 handshakes in 1.3 to 3.7 s; 1,000
nodes enrolled in 6.5 s (0.2 to 1 s of it the tokens). Extrapolated, 10,000 nodes take about half its core:
read the lag column before trusting a 10,000-node row. The server's RSS grows by about 350 KiB per connected
node, most of it the zero-filled 256 KiB read buffer that asyncio's TLS transport allocates per connection
(``sslproto.SSLProtocol.max_size``), and so does this process's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.bench.fleet_client import Link, TransferFailed
from ansible_collections.meridian.node.bench.fleet_enroll import (
    Enrolled,
    client_context,
    enroll,
    fleet_node_ids,
    make_tokens,
)
from ansible_collections.meridian.node.bench.fleet_node import AgentTimers, SimNode
from ansible_collections.meridian.node.bench.fleet_observation import GPUS, ObservationBodies
from ansible_collections.meridian.node.bench.fleet_profile import record, summarise
from ansible_collections.meridian.node.bench.fleet_server import (
    Replicas,
    ServerProcess,
    open_control,
    serving,
    serving_replicas,
)
from ansible_collections.meridian.node.bench.fleet_stats import ENDPOINTS, Distribution, Recorder
from meridian_node_agent.devserver.control.plane import ControlPlane

__all__ = [
    "DESIRED_STATE",
    "EndpointFigures",
    "Fleet",
    "StepOptions",
    "StepResult",
    "main",
    "prepare_fleet",
    "run_step",
]

# What every node is told to run: one vLLM engine on its eight GPUs.
DESIRED_STATE: dict[str, Any] = {
    "engines": [
        {
            "name": "llm",
            "driver": "vllm",
            "image": "registry.local/vllm-openai@sha256:" + "5" * 64,
            "model": {"name": "llama-3.1-70b-instruct"},
            "served_model_name": "llama-3.1-70b-instruct",
            "gpus": [str(index) for index in range(GPUS)],
            "port": 8000,
            "args": ["--tensor-parallel-size", str(GPUS)],
        }
    ],
    "artifacts": [],
}
CONNECT_CONCURRENCY = 64  # TLS handshakes in flight while a step connects its nodes
SETTLE_S = 2.0  # after the ramp, before the window: the last node's first cycle completes
DELIVERY_GRACE_S = 5.0  # after the window: publishes still on their way get this long to arrive
LAG_TICK_S = 0.1


@dataclass(frozen=True)
class Fleet:
    """Enrolled nodes, each with a published desired state, and what enrolling them took."""

    nodes: list[Enrolled]
    tokens_s: float
    enroll_s: float
    publish_s: float


@dataclass(frozen=True)
class StepOptions:
    nodes: int
    window_s: float
    changing: float = 0.0
    publish_per_s: float = 1.0
    seed: int = 0
    profile: Path | None = None  # py-spy's collapsed stacks of the server during the window go here
    ramp_s: float | None = None  # nodes start at random moments over this long (None: one heartbeat interval)


@dataclass(frozen=True)
class EndpointFigures:
    per_s: float
    latency: Distribution
    errors: int
    timeouts: int


@dataclass
class StepResult:
    backend: str
    nodes: int
    window_s: float
    connect_s: float
    started_at: datetime  # when the first node could start its first cycle (wall clock)
    window_started_at: datetime
    offered_per_s: float
    answered_per_s: float
    endpoints: dict[str, EndpointFigures]
    errors: int
    timeouts: int
    reconnects: int
    server_cpu_percent: float
    client_cpu_percent: float
    client_peak_rss_mib: float
    loop_lag: Distribution
    server_rss_mib: float
    rss_per_node_kib: float
    descriptors: int
    db_transactions_per_s: float | None
    db_bytes: int | None
    db_growth_bytes: int | None
    staleness: Distribution
    ramp: Distribution  # every answer before the window: the fleet's first cycles, as after a server's restart
    published: int
    undelivered: int
    cycles: int
    failures: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["started_at"] = self.started_at.isoformat()
        document["window_started_at"] = self.window_started_at.isoformat()
        return document


async def prepare_fleet(server: ServerProcess, control: ControlPlane, count: int, directory: Path) -> Fleet:
    """Enroll ``count`` nodes through ``server`` (tokens made through ``control``) and publish each one's state."""
    ids = fleet_node_ids(count)
    started = time.perf_counter()
    tokens = make_tokens(control, ids)
    tokens_done = time.perf_counter()
    nodes = await enroll(server.host, server.port, server.ca_pem, tokens, directory)
    enrolled = time.perf_counter()
    for node_id in ids:
        control.publish(node_id, DESIRED_STATE)
    return Fleet(nodes, tokens_done - started, enrolled - tokens_done, time.perf_counter() - enrolled)


async def run_step(
    server: Replicas,
    control: ControlPlane,
    fleet: Fleet,
    options: StepOptions,
    timers: AgentTimers,
    bodies: ObservationBodies,
) -> StepResult:
    """One step: the first ``options.nodes`` nodes of ``fleet`` against ``server``, measured as the docstring says."""
    if options.nodes > len(fleet.nodes):
        raise ValueError(f"the fleet has {len(fleet.nodes)} nodes, the step asks for {options.nodes}")
    rng = random.Random(options.seed)
    recorder = Recorder()
    members = fleet.nodes[: options.nodes]
    baseline = server.sample()
    links = [
        Link(*server.address(index), client_context(server.ca_pem, member.credentials))
        for index, member in enumerate(members)
    ]
    connect_started = time.perf_counter()
    await _connect_all(links, timers.timeout_s)
    connect_s = time.perf_counter() - connect_started
    nodes = [
        SimNode(
            member.node_id, link, timers, bodies, recorder, changing=options.changing, rng=random.Random(rng.random())
        )
        for member, link in zip(members, links, strict=True)
    ]
    started_at = datetime.now(UTC)
    ramp_s = timers.heartbeat_s if options.ramp_s is None else options.ramp_s
    tasks = [asyncio.create_task(node.run(rng.uniform(0, ramp_s))) for node in nodes]
    try:
        await asyncio.sleep(max(ramp_s, timers.heartbeat_s) + SETTLE_S)
        window_started_at = datetime.now(UTC)
        first = server.sample()
        cpu_first = time.process_time()
        db_first, tx_first = server.database_bytes(), server.transactions()
        recorder.window = (first.at, first.at + options.window_s)
        lags: list[float] = []
        helpers = [
            asyncio.create_task(_watch_lag(lags)),
            asyncio.create_task(_publish(control, nodes, recorder, options.publish_per_s, rng)),
        ]
        profiler = (
            None
            if options.profile is None
            else asyncio.create_task(record(server.pid, options.window_s, options.profile))
        )
        await asyncio.sleep(options.window_s)
        last = server.sample()
        cpu_last = time.process_time()
        db_last, tx_last = server.database_bytes(), server.transactions()
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        if profiler is not None:
            await profiler
        deadline = time.perf_counter() + DELIVERY_GRACE_S
        while recorder.pending and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in links:
            link.close()
    elapsed = last.at - first.at
    endpoints = {
        name: EndpointFigures(
            per_s=recorder.answered[name] / options.window_s,
            latency=Distribution.of(recorder.latencies[name]),
            errors=recorder.errors[name],
            timeouts=recorder.timeouts[name],
        )
        for name in (*ENDPOINTS, *sorted(set(recorder.errors) - set(ENDPOINTS)))
    }
    return StepResult(
        backend=_backend(server.database_url) + (f" x{len(server.members)}" if len(server.members) > 1 else ""),
        nodes=options.nodes,
        window_s=options.window_s,
        connect_s=connect_s,
        started_at=started_at,
        window_started_at=window_started_at,
        # Each publish ends a long-poll early (one more fetch) and changes what its node applied (one more post).
        offered_per_s=options.nodes * timers.calls_per_node_s(options.changing) + 2 * options.publish_per_s,
        answered_per_s=sum(recorder.answered.values()) / options.window_s,
        endpoints=endpoints,
        errors=sum(recorder.errors.values()),
        timeouts=sum(recorder.timeouts.values()),
        reconnects=sum(link.connects for link in links) - len(links),
        server_cpu_percent=100 * (last.cpu_s - first.cpu_s) / elapsed,
        client_cpu_percent=100 * (cpu_last - cpu_first) / elapsed,
        client_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        loop_lag=Distribution.of(lags),
        server_rss_mib=last.rss_bytes / 2**20,
        rss_per_node_kib=(last.rss_bytes - baseline.rss_bytes) / 1024 / options.nodes,
        descriptors=last.descriptors,
        db_transactions_per_s=None if tx_first is None or tx_last is None else (tx_last - tx_first) / elapsed,
        db_bytes=db_last,
        db_growth_bytes=None if db_first is None or db_last is None else db_last - db_first,
        staleness=Distribution.of(recorder.staleness),
        ramp=Distribution.of(recorder.ramp_latencies),
        published=recorder.published,
        undelivered=len(recorder.pending),
        cycles=sum(node.cycles for node in nodes),
        failures=recorder.messages,
    )


async def _connect_all(links: list[Link], timeout_s: float) -> None:
    """Open every node's connection, ``CONNECT_CONCURRENCY`` handshakes at a time; a failure ends the step."""
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def connect(link: Link) -> None:
        async with gate:
            await link.connect(timeout_s)

    results = await asyncio.gather(*(connect(link) for link in links), return_exceptions=True)
    failed = [result for result in results if isinstance(result, BaseException)]
    if failed:
        for link in links:
            link.close()
        raise TransferFailed(f"{len(failed)} of {len(links)} nodes could not connect; the first: {failed[0]}")


async def _watch_lag(lags: list[float]) -> None:
    """How late a ``LAG_TICK_S`` timer of this event loop fires: the generator's own saturation."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, time.perf_counter() - before - LAG_TICK_S))


async def _publish(
    control: ControlPlane, nodes: list[SimNode], recorder: Recorder, per_s: float, rng: random.Random
) -> None:
    """A new desired state for a random node ``per_s`` times a second (one at a time, in a thread: a commit
    must not stall the nodes' event loop); ``recorder`` times each until the node has it."""
    if per_s <= 0:
        return
    while True:
        await asyncio.sleep(rng.expovariate(per_s))
        node = rng.choice(nodes)
        if node.etag is None or node.node_id in recorder.pending:
            continue
        recorder.pending[node.node_id] = time.perf_counter()
        await asyncio.to_thread(control.publish, node.node_id, DESIRED_STATE)
        recorder.published += 1


def _backend(database_url: str | None) -> str:
    return "sqlite" if database_url is None else database_url.partition(":")[0].partition("+")[0]


# Output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def step_table(results: list[StepResult]) -> str:
    rows = [
        "| backend | nodes | offered req/s | answered req/s | answered/offered | errors | timeouts | reconnects "
        "| server CPU | generator CPU | generator lag p99 ms | server RSS MiB | RSS/node KiB | fds | DB txn/s "
        "| DB growth KiB | staleness p50/p99/max ms (n) | undelivered | ramp p50/p99/max ms |",
        "|" + "---|" * 19,
    ]
    for r in results:
        tx = "n/a" if r.db_transactions_per_s is None else f"{r.db_transactions_per_s:.0f}"
        growth = "n/a" if r.db_growth_bytes is None else f"{r.db_growth_bytes / 1024:.0f}"
        stale = r.staleness
        rows.append(
            f"| {r.backend} | {r.nodes} | {r.offered_per_s:.1f} | {r.answered_per_s:.1f} "
            f"| {r.answered_per_s / r.offered_per_s:.2f} | {r.errors} | {r.timeouts} | {r.reconnects} "
            f"| {r.server_cpu_percent:.0f} % | {r.client_cpu_percent:.0f} % | {_ms(r.loop_lag.p99_ms)} "
            f"| {r.server_rss_mib:.0f} | {r.rss_per_node_kib:.1f} | {r.descriptors} | {tx} | {growth} "
            f"| {_ms(stale.p50_ms)} / {_ms(stale.p99_ms)} / {_ms(stale.max_ms)} ({stale.count}) | {r.undelivered} "
            f"| {_ms(r.ramp.p50_ms)} / {_ms(r.ramp.p99_ms)} / {_ms(r.ramp.max_ms)} |"
        )
    return "\n".join(rows)


def endpoint_table(results: list[StepResult]) -> str:
    rows = [
        "| backend | nodes | endpoint | req/s | p50 ms | p99 ms | max ms | errors | timeouts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, figures in r.endpoints.items():
            shown = f"{name} (304, past its wait)" if name == "desired-state" else name
            latency = figures.latency
            rows.append(
                f"| {r.backend} | {r.nodes} | {shown} | {figures.per_s:.1f} | {_ms(latency.p50_ms)} "
                f"| {_ms(latency.p99_ms)} | {_ms(latency.max_ms)} | {figures.errors} | {figures.timeouts} |"
            )
    return "\n".join(rows)


# Command line


def _counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--nodes wants counts such as 100,500,1000, got {text!r}")
    return counts


def _cpus(text: str) -> set[int] | None:
    if text in ("", "none"):
        return None
    return {int(part) for part in text.split(",")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=_counts, default=_counts("100,500,1000,2000,5000,10000"))
    parser.add_argument("--step-seconds", type=float, default=180.0, help="the measured window of each step")
    parser.add_argument(
        "--server-cpus", type=_cpus, default=_cpus("0"), help="CPUs the server runs on (e.g. 0 or 0,1; none: unpinned)"
    )
    parser.add_argument("--database-url", help="the server's database (default: its embedded SQLite)")
    parser.add_argument(
        "--ramp-seconds",
        type=float,
        help="start the nodes at random moments over this long (default: one heartbeat interval, as agents that "
        "reconnect to a restarted server do)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="servers on the one database, node i talking to server i modulo their number (more than one: PostgreSQL)",
    )
    parser.add_argument(
        "--changing",
        type=float,
        default=0.0,
        help="chance that a GPU refresh finds the observation's content changed (default 0: a steady fleet)",
    )
    parser.add_argument("--publish-rate", type=float, default=1.0, help="desired states published per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, help="where the data dir and node credentials go (a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample the server with py-spy during each window: DIR/fleet-N.collapsed, and a summary on stderr",
    )
    return parser


def _progress(message: str) -> None:
    print(f"fleet: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.replicas < 1 or (args.replicas > 1 and not (args.database_url or "").startswith("postgresql")):
        raise SystemExit("fleet: --replicas is 1, or more with a PostgreSQL --database-url (SQLite: one server)")
    if not 0 <= args.changing <= 1:
        raise SystemExit("fleet: --changing is a probability, from 0 to 1")
    if args.server_cpus:
        rest = os.sched_getaffinity(0) - args.server_cpus
        if not rest:
            raise SystemExit(f"fleet: --server-cpus {sorted(args.server_cpus)} leaves no CPU for the generator")
        os.sched_setaffinity(0, rest)
    # Every node is a descriptor here and one in the server (which inherits this limit); the limit is per process.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < max(args.nodes) + 256:
        raise SystemExit(f"fleet: {max(args.nodes)} nodes need more descriptors than RLIMIT_NOFILE allows ({hard})")
    timers = AgentTimers.of_agent()
    bodies = ObservationBodies.build(args.seed)
    results: list[StepResult] = []
    with tempfile.TemporaryDirectory(prefix="meridian-fleet-", dir=args.work_dir) as temporary:
        data_dir = Path(temporary) / "data"
        with serving(data_dir, cpus=args.server_cpus, database_url=args.database_url) as server:
            control = open_control(data_dir, args.database_url)
            fleet = asyncio.run(prepare_fleet(server, control, max(args.nodes), Path(temporary) / "nodes"))
        _progress(
            f"{len(fleet.nodes)} nodes: tokens {fleet.tokens_s:.1f} s, enrolled in {fleet.enroll_s:.1f} s, "
            f"states published in {fleet.publish_s:.1f} s"
        )
        try:
            for count in args.nodes:
                with serving_replicas(
                    data_dir, args.replicas, cpus=args.server_cpus, database_url=args.database_url
                ) as server:
                    profile = None if args.profile is None else args.profile / f"fleet-{count}.collapsed"
                    options = StepOptions(
                        count,
                        args.step_seconds,
                        args.changing,
                        args.publish_rate,
                        args.seed,
                        profile,
                        ramp_s=args.ramp_seconds,
                    )
                    result = asyncio.run(run_step(server, control, fleet, options, timers, bodies))
                if profile is not None:
                    _progress(f"{count} nodes, where the server's time went ({profile}):\n{summarise(profile).text()}")
                results.append(result)
                _progress(
                    f"{count} nodes: connected in {result.connect_s:.1f} s; answered {result.answered_per_s:.1f} of "
                    f"{result.offered_per_s:.1f} req/s, server CPU {result.server_cpu_percent:.0f} %, "
                    f"generator CPU {result.client_cpu_percent:.1f} % (peak RSS {result.client_peak_rss_mib:.0f} MiB), "
                    f"{result.errors} errors, {result.timeouts} timeouts"
                    + (f"; first: {result.failures[0]}" if result.failures else "")
                )
        finally:
            control.close()
    if args.json:
        print(json.dumps([result.as_json() for result in results], indent=1))
    else:
        print(step_table(results))
        print()
        print(endpoint_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

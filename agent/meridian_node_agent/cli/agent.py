"""``meridian-node enroll | run | status``: the agent's own verbs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509

from ansible_collections.meridian.node.plugins.module_utils.contracts import EnrollmentResponse, format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import (
    STATE_FILE,
    StateStore,
    StateStoreError,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState
from meridian_node_agent.agent_side.control_client import ControlClient, ControlPlaneError, ControlPlaneUnavailable
from meridian_node_agent.agent_side.identity import CertificateInfo, IdentityError, NodeIdentity, certificate_info
from meridian_node_agent.agent_side.stop import StopSignal
from meridian_node_agent.agent_side.transfer_watch import transfers_path
from meridian_node_agent.apply.oplog import Operation, decode_operation
from meridian_node_agent.boundary.agent_files import STATUS_MAX_BYTES, read_agent_document, read_agent_file
from meridian_node_agent.boundary.directories import BoundaryError
from meridian_node_agent.config import (
    AgentConfig,
    config_for_verb,
    metrics_unavailable,
    policy_for_run,
)
from meridian_node_agent.errors import UsageError
from meridian_node_agent.logs import EventLogger, configure_logging
from meridian_node_agent.terminal_text import escape_text

__all__ = [
    "TOKEN_ENV",
    "add_parsers",
    "build_agent",
    "build_applier",
    "cmd_enroll",
    "cmd_run",
    "cmd_status",
    "format_status",
    "policy_for_run",
    "serve_metrics",
]

TOKEN_ENV = "MERIDIAN_NODE_TOKEN"  # noqa: S105 - the variable's name, not a token
# What `status` reads of the agent's files (boundary.agent_files): far above what the agent writes, far below harm.
MAX_APPLIED_BYTES = 64 * 1024
MAX_CERTIFICATE_BYTES = 64 * 1024
OPLOG_TAIL_BYTES = 256 * 1024  # the operation log only grows: its last entries are read from its end


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    enroll = subparsers.add_parser(
        "enroll",
        help="enroll this node with the control plane",
        description="Create the node key (once), send a CSR with a one-time enrollment token and store the "
        "issued client certificate and the control plane's CA bundle under <state_dir>/identity.",
    )
    enroll.add_argument("--token", help=f"the one-time enrollment token (default: ${TOKEN_ENV})")
    enroll.add_argument(
        "--ca-bundle",
        required=True,
        metavar="PATH",
        help="the control plane's CA certificate, obtained out of band; it authenticates the server",
    )
    enroll.set_defaults(handler=cmd_enroll)

    run = subparsers.add_parser(
        "run",
        help="run the agent loop",
        description="Heartbeat, fetch the signed desired state, verify it, apply it through ansible-runner "
        "(unless the mode is observe-only or kubernetes-integrated), observe and report; repeat. In mode "
        "kubernetes-integrated the report says what the kubelet's PodResources API lists (docs/KUBERNETES.md), "
        "and a published state is verified and refused (exit 1 with --once). In mode air-gapped: take the bundles "
        "in air_gap.inbox, apply them, and write signed observations and journal summaries to air_gap.outbox "
        "(docs/AIR_GAP.md). Exit status with --once: 0 when the cycle succeeded, 1 when the control plane was "
        "unreachable or the state (or a bundle) was rejected or failed. SIGTERM and SIGINT stop it within a few "
        "seconds whatever it is doing (an apply in flight is abandoned and resumed at the next start; "
        "docs/SUPERVISION.md, 'Stopping'): exit status 0 after SIGTERM, 130 after SIGINT.",
    )
    run.add_argument("--once", action="store_true", help="run one cycle (no long-poll) and exit")
    run.set_defaults(handler=cmd_run)

    status = subparsers.add_parser(
        "status",
        help="show the node's lease, applied generation and last run",
        description="Print a table: node, mode, lease epoch and expiry, applied generation, last run ident "
        "and result, the agent's counters, each GPU's health verdict and the cordons in force at the last report, "
        "and the client certificate's expiry and renewal, from the state dir (the agent need not be running; "
        "'meridian-node gpu-health show' reads the GPUs now). In mode kubernetes-integrated also what the kubelet "
        "listed at the last report (which pod holds which GPU) and the desired state last refused. What the agent "
        "wrote is read as root reads the agent's files (no symlink followed, regular files only, capped: exit 1 "
        "naming the file otherwise) and shown escaped (ESC as \\x1b).",
    )
    status.add_argument(
        "--json", action="store_true", help="print one JSON document (for scripts and monitoring) instead of a table"
    )
    status.set_defaults(handler=cmd_status)


def cmd_enroll(args: argparse.Namespace) -> int:
    config = config_for_verb(args.config)
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise UsageError(f"no enrollment token: pass --token or set {TOKEN_ENV}")
    if config.control_plane is None:
        raise UsageError(f"config {args.config}: mode {config.mode} has no control plane to enroll with")
    identity = NodeIdentity(config.identity_dir)
    try:
        csr = identity.csr_pem(config.node_id)
        control = config.control_plane
        with ControlClient(
            str(control.url),
            args.ca_bundle,
            timeout_s=control.timeout_seconds,
            replica_urls=[str(url) for url in control.replica_urls],
        ) as client:
            response = _enroll_at_any_replica(client, config.node_id, token, csr)
        info = identity.store(response)
    except IdentityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ControlPlaneError as exc:
        print(f"error: enrollment of node {config.node_id} failed: {exc}", file=sys.stderr)
        return 1
    print(f"enrolled node {config.node_id}; certificate serial {info.serial:x} in {identity.cert_path}")
    print(identity.describe_expiry(datetime.now(UTC)))
    return 0


def _enroll_at_any_replica(client: ControlClient, node_id: str, token: str, csr_pem: str) -> EnrollmentResponse:
    """Enroll at the client's URLs in turn until one answers; each that cannot be reached is said on stderr.

    Each URL is tried once: the client moves to the next after a transfer failure. A refusal ends it, as every
    replica would refuse the same. The token is single-use: if a replica took it and its answer was lost, the next
    refuses it as used, and the operator makes a new one, as with a single URL.
    """
    for _ in client.base_urls[1:]:
        try:
            return client.enroll(node_id, token, csr_pem)
        except ControlPlaneUnavailable as exc:
            print(f"warning: {exc}; trying the next control plane URL, {client.base_url}", file=sys.stderr)
    return client.enroll(node_id, token, csr_pem)


def build_agent(config: AgentConfig, *, log: EventLogger | None = None, stop: StopSignal | None = None) -> Any:
    """The agent wired with the real client, applier and observer; ``stop`` (``meridian-node run``'s signals) ends
    its waits, its control-plane calls and an apply in flight."""
    from meridian_node_agent.agent_side.cycle import Agent
    from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
    from meridian_node_agent.agent_side.observe import Observer, no_engines

    policy = policy_for_run(config)
    if config.control_plane is None:
        raise UsageError(f"mode {config.mode} is run from bundles, not by 'run'")
    identity = NodeIdentity(config.identity_dir)
    if not identity.enrolled:
        raise UsageError(f"node {config.node_id} is not enrolled ({config.identity_dir}); run 'meridian-node enroll'")
    client = ControlClient(
        str(config.control_plane.url),
        identity.ca_path,
        identity.cert_path,
        identity.key_path,
        timeout_s=config.control_plane.timeout_seconds,
        interrupt=None if stop is None else stop.fileno(),
        replica_urls=[str(url) for url in config.control_plane.replica_urls],
    )
    # Held verdicts are in the directory placement reads them from: root's under the split (root's observe timer
    # writes them there, and root adds the XIDs this watch relays in each apply request), the agent's own
    # in-process (where the agent applies, and so writes them).
    gpu_health = GpuHealthWatch(config.record_dir, writes_holds=config.apply.via == "in-process", log=log)
    applier = build_applier(config, gpu_relay=gpu_health, stop=stop)
    kubernetes = _kubernetes_source(config, log) if config.mode == "kubernetes-integrated" else None
    observer = Observer(
        store_path=policy.store.path,
        gpu_facts=gpu_health,
        # Kubernetes owns a kubernetes-integrated node's containers: the kubelet says what runs, Docker is not asked.
        engines=no_engines if kubernetes is not None else _engine_source(config, log),
        placement=(policy.engines.port_range, policy.engines.bind_address),
        kubernetes=kubernetes,
        cordon_dir=str(config.record_dir),
        policy_cordon=policy.cordon,
        log=log,
    )
    metrics = None if config.metrics is None else serve_metrics(config.metrics.listen)
    if stop is None:
        return Agent(config, policy, client, applier, observer, log=log, metrics=metrics)
    return Agent(config, policy, client, applier, observer, log=log, metrics=metrics, sleep=stop.wait, stop=stop)


def serve_metrics(listen: str) -> Any:
    """The Prometheus endpoint of ``metrics.listen``; prometheus-client is the ``metrics`` extra."""
    missing = metrics_unavailable(listen)
    if missing:
        raise UsageError(missing)
    from meridian_node_agent.agent_side.metrics import Metrics

    try:
        return Metrics.serve(listen)
    except OSError as exc:
        raise UsageError(
            f"metrics.listen is {listen!r} but the agent cannot listen there: {exc.strerror or exc}; choose a free "
            "address and port (docs/METRICS.md) or remove the metrics section from the config"
        ) from exc


def build_applier(config: AgentConfig, *, gpu_relay: Any = None, stop: StopSignal | None = None) -> Any:
    """``apply.via``: ansible-runner in this process, or a request to the root unit through the spool, which
    relays what ``gpu_relay`` (the agent's ``GpuHealthWatch``) holds unhealthy by XID to root. With ``stop`` an
    apply in flight is abandoned when the agent stops (the playbook killed, or root's answer no longer waited for)."""
    if config.apply.via == "systemd":
        from meridian_node_agent.agent_side.systemd_applier import SystemdApplier

        return SystemdApplier(
            state_dir=Path(config.state_dir),
            apply_state_dir=Path(config.apply.state_dir),
            timeout_s=config.apply.timeout_seconds,
            gpu_relay=gpu_relay,
            stop=stop,
        )
    from meridian_node_agent.apply.applier import Applier

    return Applier(
        state_dir=Path(config.state_dir),
        node_id=config.node_id,
        policy_path=config.policy,
        keep_runs=config.journal.keep_runs,
        cancel=None if stop is None else stop.is_stopping,
        progress_file=transfers_path(config),
    )


def _kubernetes_source(config: AgentConfig, log: EventLogger | None) -> Any:
    """Mode kubernetes-integrated: the kubelet's PodResources API, read-only (grpcio is the ``kubernetes`` extra,
    imported only here; ``policy_for_run`` has already said so when it is missing)."""
    from meridian_node_agent.agent_side.kubernetes_observer import KubernetesObserver
    from meridian_node_agent.agent_side.podresources.client import PodResourcesClient

    settings = config.kubernetes
    client = PodResourcesClient(settings.pod_resources_socket, timeout_s=settings.timeout_seconds)
    return KubernetesObserver(client, refresh_s=settings.refresh_seconds, log=log)


def _engine_source(config: AgentConfig, log: EventLogger | None) -> Any:
    """``apply.via: systemd``: the inventory the root apply unit writes (the agent has no Docker access
    there, and must not be given it); in-process: the local Docker Engine, else no engines."""
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
        DockerEngine,
        DockerEngineError,
    )
    from meridian_node_agent.agent_side.observe import DockerEngines, InventoryEngines, no_engines

    if config.apply.via == "systemd":
        return InventoryEngines(root_dir=Path(config.apply.state_dir), node_id=config.node_id, log=log)

    try:
        engine = DockerEngine.from_env(timeout_s=5)
    except DockerEngineError as exc:
        (log or EventLogger()).warning("engines-not-observed", reason=str(exc))
        return no_engines
    return DockerEngines(engine, state_dir=Path(config.state_dir), owner=f"agent:{config.node_id}")


def cmd_run(args: argparse.Namespace) -> int:
    config = config_for_verb(args.config)
    configure_logging(config.log.level, config.log.format)
    # The agent's handlers for the whole run, before anything is built: ansible-runner, given the stop as its cancel
    # callback, installs none of its own (agent_side.stop).
    stop = StopSignal().install()
    try:
        if config.mode == "air-gapped":
            status = _run_air_gapped(config, once=args.once, stop=stop)
        else:
            status = _run_online(config, once=args.once, stop=stop)
    finally:
        stop.close()
    if stop.stopping:
        EventLogger().info("agent-stopped", signal=stop.reason, exit_status=status)
    return status


def _run_online(config: AgentConfig, *, once: bool, stop: StopSignal) -> int:
    agent = build_agent(config, stop=stop)
    try:
        status: int = agent.run(once=once)
    except StateStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        agent.close()
        agent.client.close()
    return status


def _run_air_gapped(config: AgentConfig, *, once: bool, stop: StopSignal) -> int:
    """No control plane: bundles from the inbox, signed records to the outbox (``agent_side.airgap_agent``)."""
    from meridian_node_agent.agent_side.airgap_agent import build_airgap_agent

    agent = build_airgap_agent(config, stop=stop)
    try:
        return agent.run(once=once)
    except StateStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # The GPU reader's XID event set outlives each read: released here, as the online agent's is.
        agent.close()


def cmd_status(args: argparse.Namespace) -> int:
    config = config_for_verb(args.config)
    try:
        seen = _read_state_dir(config)
    except (BoundaryError, StateStoreError) as exc:
        print(f"error: {escape_text(str(exc), one_line=True)}", file=sys.stderr)
        return 1
    applied, last, status, certificate = seen
    if args.json:
        # JSON escapes every control character itself (\u001b): the document is printed as json.dumps makes it.
        print(json.dumps(status_document(config, applied, status, last, certificate), sort_keys=True))
        return 0
    now = datetime.now(UTC)
    print(
        format_status(
            config, applied.generation, applied.epoch, status, last, certificate, now, accepted=applied.accepted
        )
    )
    return 0


def _read_state_dir(
    config: AgentConfig,
) -> tuple[AppliedState, Operation | None, dict[str, Any] | None, CertificateInfo | None]:
    """What ``status`` shows of the agent's directory, each file read as root reads the agent's files
    (``boundary.agent_files``): ``BoundaryError`` for one planted there, ``StateStoreError`` for a damaged record."""
    from meridian_node_agent.boundary.agent_files import STATUS_FILE

    state_dir = Path(config.state_dir)
    raw = read_agent_file(state_dir, STATE_FILE, max_bytes=MAX_APPLIED_BYTES, what="the applied-state file")
    # The record's own decoding (its messages and its checks); reading it is done here, for the reasons above.
    applied = AppliedState() if raw is None else StateStore(state_dir).decode(raw)
    status = read_agent_document(state_dir, STATUS_FILE, max_bytes=STATUS_MAX_BYTES, what="the agent's status file")
    return applied, _last_operation(state_dir), status, _certificate(config)


def _last_operation(state_dir: Path) -> Operation | None:
    raw = read_agent_file(state_dir, "oplog.jsonl", max_bytes=OPLOG_TAIL_BYTES, what="the operation log", tail=True)
    entries = [entry for entry in map(decode_operation, (raw or b"").split(b"\n")) if entry is not None]
    return entries[-1] if entries else None


def _certificate(config: AgentConfig) -> CertificateInfo | None:
    """The node certificate's serial and validity; None before enrollment. ``node.pem`` and ``current`` are
    symlinks after a renewal (``agent_side.identity``): followed down, within the identity directory, only."""
    raw = read_agent_file(
        Path(config.state_dir),
        str(Path(config.identity_dir).relative_to(config.state_dir) / "node.pem"),
        max_bytes=MAX_CERTIFICATE_BYTES,
        what="the node certificate",
        links=True,
    )
    if raw is None:
        return None
    try:
        return certificate_info(x509.load_pem_x509_certificate(raw))
    except ValueError:
        return None  # as before: shown as no certificate


def status_document(
    config: AgentConfig,
    applied: Any,
    status: dict[str, Any] | None,
    last: Operation | None,
    certificate: CertificateInfo | None,
) -> dict[str, Any]:
    """What ``status`` shows, as data: the agent's own status file as it wrote it, plus what is on disk."""
    return {
        "node_id": config.node_id,
        "mode": config.mode,
        "applied": {"generation": applied.generation, "epoch": applied.epoch, "payload_sha256": applied.payload_sha256},
        # A generation accepted (its apply started) and not recorded applied: it failed or was cut short.
        "accepted": None
        if applied.accepted is None
        else {
            "generation": applied.accepted.generation,
            "epoch": applied.accepted.epoch,
            "payload_sha256": applied.accepted.payload_sha256,
        },
        "last_operation": None if last is None else {k: v for k, v in asdict(last).items() if v is not None},
        "agent": status,  # None when the agent has not written one yet
        "certificate": None
        if certificate is None
        else {
            "serial": f"{certificate.serial:x}",
            "not_before": format_rfc3339(certificate.not_before),
            "not_after": format_rfc3339(certificate.not_after),
        },
    }


def format_status(
    config: AgentConfig,
    generation: int,
    epoch: int,
    status: dict[str, Any] | None,
    last: Operation | None,
    certificate: CertificateInfo | None = None,
    now: datetime | None = None,
    accepted: Any = None,
) -> str:
    """The table ``status`` prints; each value escaped (``terminal_text``): the agent wrote most of them."""
    run = (status or {}).get("last_run") or {}
    counters = (status or {}).get("counters") or {}
    rejections = counters.get("rejections") or {}
    rows = [
        ("node", config.node_id),
        ("mode", config.mode),
        ("lease epoch", _text((status or {}).get("lease_epoch"))),
        ("lease expires", _text((status or {}).get("lease_expires_at"))),
        ("applied generation", f"{generation} (epoch {epoch})"),
        *([("accepted generation", _accepted_text(accepted, generation))] if accepted is not None else []),
        ("last run", f"{last.run_ident} {last.result} at {last.at}" if last else "none"),
        ("last run tasks", f"changed {run.get('changed', '-')}, failed {run.get('failed', '-')}" if run else "-"),
        (
            "counters",
            f"cycles {counters.get('cycles', 0)}, applies {counters.get('applies', 0)}, "
            f"apply failures {counters.get('apply_failures', 0)}, unavailable {counters.get('unavailable', 0)}, "
            f"refused {counters.get('refused', 0)}, repairs {counters.get('repairs', 0)}"
            + (f", states refused {counters['states_refused']}" if counters.get("states_refused") else "")
            if counters
            else "-",
        ),
        ("supervision", _supervision_text((status or {}).get("supervision") or {})),
        ("apply retry", _retry_text((status or {}).get("apply_retry"))),
        ("rejections", ", ".join(f"{k} {v}" for k, v in sorted(rejections.items())) or "none"),
        ("engines", _engines_text((status or {}).get("engines") or [])),
        ("transfers", _transfers_text((status or {}).get("transfers") or [])),
        ("gpu health", _gpus_text((status or {}).get("gpus"))),
        ("cordons", _cordons_text((status or {}).get("cordons"))),
        *(
            [
                ("kubernetes", _kubernetes_text((status or {}).get("kubernetes"))),
                ("refused state", _refused_text((status or {}).get("refused_state"))),
            ]
            if config.mode == "kubernetes-integrated"
            else []
        ),
        *([("air gap", _air_gap_text((status or {}).get("air_gap")))] if config.mode == "air-gapped" else []),
        ("certificate", _certificate_text(certificate, now or datetime.now(UTC))),
        ("cert renewal", _renewal_text(config, certificate, (status or {}).get("certificate") or {})),
        ("status updated", _text((status or {}).get("updated_at"))),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {escape_text(value, one_line=True)}" for name, value in rows)


def _transfers_text(transfers: list[dict[str, Any]]) -> str:
    """The pulls and downloads of the apply in flight: ``image r@sha256:...: 1.2 GiB of 4.0 GiB (30.0%)``."""
    if not transfers:
        return "none"
    parts = []
    for transfer in transfers:
        done, total = transfer.get("bytes_done") or 0, transfer.get("bytes_total")
        amount = (
            f"{_bytes_text(done)} of {_bytes_text(total)} ({100 * done / total:.1f}%)" if total else _bytes_text(done)
        )
        parts.append(f"{transfer.get('kind')} {transfer.get('name')}: {amount}, as of {transfer.get('updated_at')}")
    return "; ".join(parts)


def _bytes_text(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _accepted_text(accepted: Any, applied: int) -> str:
    return (
        f"{accepted.generation} (epoch {accepted.epoch}), not applied: its apply failed or was cut short, so "
        f"generation {applied} may not be what runs; nothing below {accepted.generation} is applied any more, "
        f"and generation {accepted.generation} is applied again on retry. To go back, publish a new generation "
        "with the old content"
    )


def _kubernetes_text(view: dict[str, Any] | None) -> str:
    """What the kubelet listed at the last report: who holds which device, and what is allocatable."""
    if not view:
        return "no report yet (the agent has not written status.json)"
    if not view.get("available"):
        return f"unavailable: {view.get('reason')}"
    holders = []
    for allocation in view.get("allocations") or []:
        devices = ", ".join(_device_text(device) for device in allocation.get("devices") or []) or "no devices"
        engine = f" [{allocation['engine_driver']} engine, unmanaged]" if allocation.get("engine_driver") else ""
        holders.append(
            f"{allocation.get('namespace')}/{allocation.get('pod')}/{allocation.get('container')}{engine}: {devices}"
        )
    allocatable = view.get("allocatable")
    free = (
        "allocatable not served by this kubelet" if allocatable is None else f"{len(allocatable)} allocatable device(s)"
    )
    return f"{view.get('socket')}: {'; '.join(holders) or 'no container holds a device'}; {free}"


def _device_text(device: dict[str, Any]) -> str:
    text = str(device.get("device_id"))
    if device.get("gpu_index") is not None:
        text += f" (GPU {device['gpu_index']}"
        text += f", {device['health']})" if device.get("health") else ")"
    elif device.get("uuid") is None:
        text += f" ({device.get('resource')})"
    return text


def _gpus_text(gpus: list[dict[str, Any]] | None) -> str:
    """Each GPU's verdict at the last report: ``GPU 1 GPU-...: unhealthy, held since T: xid-critical 79``."""
    if gpus is None:
        return "no report yet (the agent has not written status.json)"
    if not gpus:
        return "no GPUs read"
    parts = []
    for gpu in gpus:
        text = f"GPU {gpu.get('index')} {gpu.get('uuid')}: {gpu.get('verdict') or 'not judged'}"
        if gpu.get("held"):
            text += f", held since {gpu.get('since')}"
        if gpu.get("reasons"):
            text += f" ({', '.join(gpu['reasons'])})"
        if gpu.get("cordoned"):
            text += " [cordoned]"
        parts.append(text)
    return "; ".join(parts)


def _cordons_text(cordons: list[dict[str, Any]] | None) -> str:
    """The cordons in force at the last report, each with who set it."""
    if not cordons:
        return "none"
    parts = []
    for cordon in cordons:
        what = f"GPUs {', '.join(cordon.get('gpus') or [])}" if cordon.get("gpus") else "the whole node"
        text = f"{what} by {cordon.get('by')}"
        if cordon.get("drain"):
            text += ", drained"
        if cordon.get("reason"):
            text += f" ({cordon['reason']})"
        parts.append(text)
    return "; ".join(parts)


def _refused_text(refused: dict[str, Any] | None) -> str:
    if not refused:
        return "none"
    return f"generation {refused.get('generation')} at {refused.get('refused_at')}: {refused.get('detail')}"


def _air_gap_text(air_gap: dict[str, Any] | None) -> str:
    """The inbox's last bundle, the generation applied from bundles and the outbox's last record number."""
    if not air_gap:
        return "no pass yet (the agent has not written status.json)"
    bundle = air_gap.get("last_bundle") or {}
    last = "no bundle taken yet"
    if bundle:
        last = f"last bundle {bundle.get('name')} {bundle.get('result')}"
        if bundle.get("reason"):
            last += f" ({bundle['reason']}: {bundle.get('message')})"
    sequence = air_gap.get("outbox_sequence")
    return (
        f"inbox {air_gap.get('inbox')} taken by {air_gap.get('taken_by')}; {last}; applied generation "
        f"{air_gap.get('applied_generation')}"
        + (
            f" (generation {air_gap['accepted_generation']} accepted, its apply failed or was cut short: older "
            "bundles are refused)"
            if air_gap.get("accepted_generation")
            else ""
        )
        + f"; outbox {air_gap.get('outbox')} at record "
        f"{'none yet' if sequence is None else sequence}"
    )


def _supervision_text(engines: dict[str, Any]) -> str:
    if not engines:
        return "all engines as applied"
    parts = []
    for name, state in sorted(engines.items()):
        text = f"{name}: {state.get('problem') or 'healthy'}"
        if state.get("for_seconds") is not None:
            text += f" for {state['for_seconds']} s"
        if state.get("state") not in (None, "healthy"):
            text += f" [{state['state']}]"
        if state.get("repairs"):
            text += f", {state['repairs']} repair(s)"
            if state.get("backoff_seconds") is not None:
                text += f", backoff {state['backoff_seconds']:g} s"
            text += f", next in {state.get('next_repair_in_seconds')} s"
            if state.get("next_repair_at"):
                text += f" (at {state['next_repair_at']})"
        parts.append(text)
    return "; ".join(parts)


def _retry_text(retry: dict[str, Any] | None) -> str:
    if not retry:
        return "none"
    return (
        f"generation {retry.get('generation')} failed {retry.get('failures')} time(s) [{retry.get('state')}], "
        f"backoff {retry.get('backoff_seconds'):g} s, next attempt at {retry.get('next_attempt_at')} "
        f"(in {retry.get('next_attempt_in_seconds')} s); last error: {retry.get('error')}"
    )


def _certificate_text(certificate: CertificateInfo | None, now: datetime) -> str:
    if certificate is None:
        return "none (not enrolled)"
    left_s = certificate.remaining(now)
    state = f"{left_s / 86400:.1f} day(s) left" if left_s > 0 else "EXPIRED: enroll again"
    return f"serial {certificate.serial:x}, valid until {format_rfc3339(certificate.not_after)} ({state})"


def _renewal_text(config: AgentConfig, certificate: CertificateInfo | None, renewal: dict[str, Any]) -> str:
    if certificate is None:
        return "-"
    # The running agent's own point (its fraction is jittered at its start) while it is for this certificate; the
    # configured fraction's otherwise (no agent has run with the certificate on disk yet).
    due = renewal.get("renew_after")
    if not due or renewal.get("serial") != f"{certificate.serial:x}":
        due = format_rfc3339(certificate.renew_after(config.certificate_renewal.remaining_fraction))
    parts = [f"due from {due}"]
    if renewal.get("last_renewed_at"):
        parts.append(f"last renewed at {renewal['last_renewed_at']}")
    if renewal.get("failures"):
        parts.append(
            f"last failed at {renewal.get('last_failed_at')} ({renewal['failures']} attempt(s)): "
            f"{renewal.get('last_error')}; next attempt at {renewal.get('next_attempt_at')}"
        )
    return "; ".join(parts)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _engines_text(engines: list[dict[str, Any]]) -> str:
    if not engines:
        return "none"
    parts = []
    for engine in engines:
        flags = [str(engine.get("state", "?"))]
        if engine.get("ready"):
            flags.append("ready")
        if engine.get("draining"):
            flags.append("draining")
        if not engine.get("managed"):
            flags.append("unmanaged")
        if engine.get("ready_since"):
            flags.append(f"ready since {engine['ready_since']}")
        if engine.get("restarts"):
            flags.append(f"{engine['restarts']} restart(s)")
        if engine.get("exit_reason"):
            flags.append(f"last exit: {engine['exit_reason']}")
        if engine.get("drifted"):
            flags.append(f"changed by hand: {', '.join(engine['drifted'])}")
        parts.append(f"{engine.get('name')} ({', '.join(flags)})")
    return "; ".join(parts)

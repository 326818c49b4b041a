"""The agent's cycle: heartbeat → conditional fetch → verify → spool → apply → observe → report.

Runs on: the agent side (``meridian-node run``, unprivileged); it applies through an ``ApplyPort``, in-process
or by spooling a request to root's apply unit.

One ``Agent`` object owns the loop's memory (lease, ETag, counters); everything with a side effect is
injected (control client, applier, observer, clock, sleep, random source), so tests drive the real loop
against a real control plane with a fake clock or sleep where they need one.

Rules the loop keeps:

- An unchanged state (304, or a generation already applied with the same bytes) runs no playbook.
- A rejected state changes nothing on the host: no spool write, no apply, no record. The rejection is
  counted by reason and logged once per distinct envelope.
- Control plane unreachable: back off with jitter, never touching running engines.
- No apply without a live lease: a lapsed lease stops new applies (the control plane may have handed
  this node's work to someone else), never running engines.
- ``observe-only`` verifies and reports but never applies.
- ``kubernetes-integrated`` reports what the kubelet says runs here (``kubernetes_observer``) and never changes the
  host: a published state is verified and refused (``refused``, reason ``read-only-mode``, in the log and
  status), nothing is spooled, no earlier apply is resumed or retried and no engine is supervised. Every apply of
  either read-only mode goes through ``_apply``, which refuses before the applier is reached.
- While an apply runs, what the engines look like is observed each ``APPLY_REPORT_S`` and posted when it
  changed (``_reporting_while_applying``): a replace that starts the new engine beside the old one switches
  the serving projection when the new one is ready and the old one is marked draining, mid-apply, which
  ``reconcile.yml``'s ``meridian_drain_settle`` (5 s) waits for before the old one's gauges are trusted.
- What supervision and a failing apply's retry know (first seen, graces, repair and retry counts, backoff) is
  kept in the agent's own record (``supervision_record``), written when it changes and taken over at start-up:
  ``run --once`` from cron, a restarted agent and a crash-looping one decide as one long-running agent would.
- GPU health (docs/GPU_HEALTH.md "In the agent"): each observation carries every GPU's verdict and the cordons
  in force (``observe``); an engine of the applied state on a GPU whose verdict turned ``unhealthy`` is reported
  by supervision (``engines_on_unhealthy_gpus``), logged once per change (``engine-on-unhealthy-gpu``), and never
  repaired: the signed state pins its GPUs, so a reconcile would change nothing. ``status`` shows each GPU's
  verdict and the cordons.
- SIGTERM and SIGINT stop the loop within a few seconds whatever it is doing (``stop``, ``agent_side.stop``): the
  pause between cycles and a backoff are waits on the stop, the control client gives up its long-poll, and an apply
  in flight is abandoned (in-process: ansible-runner kills the playbook; under the split: the request stays with
  root) with its oplog entry left started, so the next start resumes it as after a crash (``recover``). The log
  says ``agent-stopping`` (the signal, and what the loop was doing) and ``cmd_run`` says ``agent-stopped``.
- What it costs the control plane is kept small (bench/protocol_cost.py measures it per node and hour): the
  heartbeat is a body-less lease renewal; the desired state is fetched with ``If-None-Match`` and answered 304
  while unchanged; an observation is posted when what it says changed (a digest of it, a GPU's gauges of the
  moment left out) or every ``REPORT_REFRESH_S``, never on every cycle.
- Every timer that paces a call to the control plane is drawn within ±``TIMER_JITTER`` (10 %) of its setting,
  each time it is set, from the injected random source: the lease renewal (``heartbeat_seconds``, and the pause
  between cycles without a long-poll), the long-poll (up to 10 % shorter, never longer: the server refuses a
  wait over its limit), the observation refresh and the certificate's renewal point. Nodes started together
  spread out instead of calling in lockstep for ever. Failed calls back off exponentially, with jitter
  (``Backoff``): the loop's, a certificate renewal's and the reports made while an apply runs.
- The client certificate is renewed once less than ``certificate_renewal.remaining_fraction`` (±10 %) of its
  lifetime is left, at the start of a cycle, so the rest of the cycle already uses the new pair. A failed
  renewal is logged and retried after a backoff of its own; it never fails the cycle, because the old
  certificate is still valid (and when it is not, the calls after it say so).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    Lease,
    Observation,
    TransferObservation,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import (
    Rejection,
    VerifiedState,
    verify_desired_state,
)
from meridian_node_agent.agent_side.control_client import (
    ControlCallStopped,
    ControlPlaneError,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    DesiredStateFetch,
    FetchStatus,
)
from meridian_node_agent.agent_side.counters import restore_counters
from meridian_node_agent.agent_side.gpu_health import verdict_summary
from meridian_node_agent.agent_side.identity import CertificateIssuer, CertificateRenewal, IdentityError, NodeIdentity
from meridian_node_agent.agent_side.observe import ObservationSizeGuard
from meridian_node_agent.agent_side.stop import StopSignal
from meridian_node_agent.agent_side.supervise import Supervisor, engines_on_unhealthy_gpus
from meridian_node_agent.agent_side.supervision_record import (
    Remembered,
    RememberedRetry,
    RememberedState,
    SupervisionRecord,
)
from meridian_node_agent.agent_side.transfer_watch import TransferWatch, transfers_path
from meridian_node_agent.apply.applier import ApplyAbandoned, ApplyResult
from meridian_node_agent.apply.oplog import ABANDONED, OpLog
from meridian_node_agent.config import READ_ONLY_MODES, TIMER_JITTER, AgentConfig
from meridian_node_agent.logs import EventLogger

__all__ = [
    "REFUSED_READ_ONLY",
    "REPORT_REFRESH_S",
    "SPOOL_FILE",
    "STATUS_FILE",
    "TIMER_JITTER",
    "Agent",
    "ApplyRetry",
    "Backoff",
    "CycleOutcome",
    "jittered",
    "read_status",
]

SPOOL_FILE = Path("spool") / "desired-state.json"
STATUS_FILE = "status.json"
# An unchanged observation is re-sent this often (±TIMER_JITTER); a changed one at once. The heartbeat already
# proves the node alive, so the refresh only carries the gauges that move on their own (below). Five minutes is
# the kubelet's node status report (KEP 0009, ``nodeStatusReportFrequency``) and balena-supervisor's metrics report.
REPORT_REFRESH_S = 300.0
# A GPU's readings of the moment: they move with load while nothing changed that the control plane acts on, so
# they are left out of the digest that decides whether an observation is new. They ride along with every post
# and the refresh (balena-supervisor holds its metrics back the same way). Everything else (engines, readiness,
# draining, health verdicts with their counters and reasons, MIG layout, processes, cordons, the applied
# generation, the lease epoch) is in the digest, and a change in it is posted in the cycle that sees it.
_GPU_GAUGES: dict[str, Any] = {
    "gpus": {
        "__all__": {
            "memory": {"used_mib", "free_mib"},
            "utilization_gpu_percent": True,
            "utilization_memory_percent": True,
            "temperature_c": True,
            "power_draw_w": True,
            "processes": {"__all__": {"used_memory_mib"}},
            "clocks": {"graphics_mhz", "sm_mhz", "memory_mhz"},
            # The link as trained now: GPUs retrain it down when idle. A downgrade that matters is in the verdict.
            "pcie": {"generation", "width"},
            "health": {"readings": {"clock_event_reasons", "power_violation_ns", "thermal_violation_ns"}},
        }
    }
}
# The observation outside its GPU facts (digested apart, once per GPU refresh): its time and the free VRAM.
_OBSERVATION_GAUGES: dict[str, Any] = {"observed_at": True, "gpu": True, "capacity": {"vram_free_mib"}}
# A long-poll the server ends a little before the renewal it was sized to reach still renews in the cycle after
# it, instead of one more short fetch first (the wait is sent in milliseconds).
_RENEWAL_SLACK_S = 0.1
# How often an apply in progress is observed, so that a replace's switch reaches the serving projection while
# it happens; well inside the reconcile playbook's drain settle (5 s).
APPLY_REPORT_S = 1.0
STATUS_REFRESH_S = 60.0
# Why a verified state is not applied on a node in mode kubernetes-integrated (the cycle's ``rejection``).
REFUSED_READ_ONLY = "read-only-mode"
_REFUSAL_HINTS = {
    "certificate-revoked": "this node's certificate was revoked: enroll again with a new token",
    "certificate-expired": "the node's certificate expired before it was renewed: enroll again with a new token",
    "wrong-node": "the certificate names another node than config node_id: fix node_id or re-enroll",
    "certificate-untrusted": "the certificate is not the control plane's (another CA): re-enroll",
    "certificate-unknown": "the control plane never issued this certificate: re-enroll",
    "unknown-node": "the control plane does not know this node: check node_id and control_plane.url",
}


class CycleStatus(StrEnum):
    APPLIED = "applied"
    APPLY_FAILED = "apply-failed"
    UNCHANGED = "unchanged"
    NONE_PUBLISHED = "none-published"
    REJECTED = "rejected"
    OBSERVED_ONLY = "observe-only"
    LEASE_LAPSED = "lease-lapsed"
    # The state did not change, but engines had drifted from it and were reconciled again.
    REPAIRED = "repaired"
    REPAIR_FAILED = "repair-failed"
    # The state's last apply failed and its retry waits out the crash-loop backoff (``ApplyRetry``).
    APPLY_BACKING_OFF = "apply-backing-off"
    # A verified state this node's mode refuses to apply (kubernetes-integrated: REFUSED_READ_ONLY).
    REFUSED = "refused"


@dataclass(frozen=True)
class CycleOutcome:
    outcome: CycleStatus
    generation: int | None = None
    rejection: str | None = None
    run: ApplyResult | None = None


class ControlPlanePort(Protocol):
    def heartbeat(self, node_id: str) -> Lease: ...
    def fetch_desired_state(self, node_id: str, etag: str | None = None, wait_s: float = 0) -> DesiredStateFetch: ...
    def post_observation(self, observation: Observation) -> None: ...


class ApplyPort(Protocol):
    def apply(
        self,
        envelope: bytes,
        *,
        generation: int,
        epoch: int,
        payload_sha256: str,
        secrets: Any = (),
        reason: str | None = None,
        lists_artifacts: bool = True,
    ) -> ApplyResult: ...


class ObservePort(Protocol):
    def observe(
        self,
        *,
        node_id: str,
        mode: str,
        epoch: int,
        applied_generation: int,
        last_run: dict[str, Any] | None,
        now: datetime,
        cordon: dict[str, Any] | None = None,
        refused_state: dict[str, Any] | None = None,
    ) -> Observation: ...

    def forget(self) -> None: ...


def jittered(seconds: float, rng: random.Random) -> float:
    """``seconds`` ±``TIMER_JITTER``, drawn from ``rng``: each timer of the agent is set through this."""
    return seconds * (1 + rng.uniform(-TIMER_JITTER, TIMER_JITTER))


@dataclass
class Backoff:
    """Exponential backoff with jitter: attempt n waits a random time in [base/2, base], base = initial·2^(n-1)."""

    initial_s: float
    maximum_s: float
    rng: random.Random = field(default_factory=random.Random)

    def base(self, attempt: int) -> float:
        return float(min(self.maximum_s, self.initial_s * 2 ** max(0, attempt - 1)))

    def delay(self, attempt: int) -> float:
        base_s = self.base(attempt)
        # Half fixed, half random: failing agents spread out instead of returning in lockstep, and
        # the wait still grows with every failure.
        return base_s / 2 + self.rng.uniform(0, base_s / 2)


@dataclass
class ApplyRetry:
    """A verified state whose apply failed, retried on supervision's crash-loop backoff.

    An engine whose command exits at once fails every apply at its readiness wait; retrying on every cycle
    would run a playbook (and restart the engine) once per long-poll, for ever. The n-th failure waits
    ``supervisor.backoff(n)`` (10 s doubling to 5 min by default) before the next attempt; a newer state
    published meanwhile is applied at once (the long-poll still waits on it), and the count starts over.

    The count and the next attempt are kept in the agent's record too (``supervision_record``: this less the
    envelope, which the spool holds), with the ETag the agent holds meanwhile. A restarted agent or a ``run
    --once`` from cron asks with that ETag, gets the 304 a long-running agent gets, and waits out the same
    backoff instead of fetching the state afresh and applying it at once.
    """

    envelope: bytes
    generation: int
    payload_sha256: str
    failures: int
    retry_at: float  # on the agent's monotonic clock
    backoff_s: float
    failed_at: datetime
    error: str


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        policy: Policy,
        client: ControlPlanePort,
        applier: ApplyPort,
        observer: ObservePort,
        *,
        log: EventLogger | None = None,
        clock: Callable[[], datetime] | None = None,
        sleep: Callable[[float], object] = time.sleep,
        rng: random.Random | None = None,
        metrics: Any = None,
        monotonic: Callable[[], float] = time.monotonic,
        stop: StopSignal | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.client = client
        self.applier = applier
        self.observer = observer
        self.log = log or EventLogger()
        self.clock = clock or (lambda: datetime.now(UTC))
        # ``meridian-node run`` passes its stop's ``wait`` as the sleep, so a signal ends a pause or a backoff.
        self.sleep = sleep
        self.stop = stop
        self.metrics = metrics
        # Intervals (heartbeat due, observation refresh) run on this clock; a test or a benchmark can
        # stand in a clock that moves as a long-poll of ``wait_s`` seconds would.
        self.monotonic = monotonic
        # Every timer's jitter and every backoff draw from this one source: a test that seeds it replays a run.
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy
        self.backoff = Backoff(config.backoff.initial_seconds, config.backoff.max_seconds, self.rng)
        # The reports made while an apply runs back off on their own count: the loop's is not theirs to move.
        self.report_backoff = Backoff(config.backoff.initial_seconds, config.backoff.max_seconds, self.rng)
        self.state_dir = Path(config.state_dir)
        self.store = StateStore(self.state_dir)
        self.oplog = OpLog(self.state_dir / "oplog.jsonl")
        self.spool = self.state_dir / SPOOL_FILE
        # The pulls and downloads of the apply in flight, as its modules write them (``transfer_watch``).
        self.transfers = TransferWatch(transfers_path(config), self.log, monotonic)
        # Taken back from the status file the last run wrote: ``status`` counts across restarts (``counters``).
        carried = restore_counters(self.state_dir / STATUS_FILE, log=self.log)
        self.counters = carried.counters
        self.last_applied_at = carried.last_applied_at
        self.lease: Lease | None = None
        self.etag: str | None = None
        self.last_run: ApplyResult | None = None
        self._rejected_etag: str | None = None
        # The digest of the observation last posted, and when it is due again unchanged (monotonic).
        self._reported: tuple[bytes, float] | None = None
        self._status_written: tuple[dict[str, Any], float] | None = None
        # When the lease is next renewed (monotonic): set at each renewal, jittered.
        self._renew_at: float | None = None
        self._epoch_ok = True
        self._engines: list[dict[str, Any]] = []
        supervision = config.supervision
        self.supervisor = Supervisor(
            settle_s=supervision.settle_seconds,
            startup_grace_s=supervision.startup_grace_seconds,
            backoff_initial_s=supervision.backoff_initial_seconds,
            backoff_max_s=supervision.backoff_max_seconds,
            healthy_reset_s=supervision.healthy_reset_seconds,
            # The agent's one monotonic clock, read through the attribute: the record's times are on it, and a
            # test that stands in another clock moves supervision and the apply retry together.
            clock=lambda: self.monotonic(),
        )
        # What supervision and the apply retry know, kept in the agent's own directory across its restarts.
        self.record = SupervisionRecord(self.state_dir, log=self.log)
        # The envelope of the state last applied successfully, verified: what supervision repairs towards.
        self._desired: tuple[bytes, VerifiedState] | None = None
        self._retry: ApplyRetry | None = None
        # Mode kubernetes-integrated: the state last refused (for status), and the kubelet's view last observed.
        self.refused: dict[str, Any] | None = None
        self._kubernetes: dict[str, Any] | None = None
        # Every observation is made to fit the control plane's limit before it is posted (kubernetes detail first).
        self.size_guard = ObservationSizeGuard()
        # The GPU facts of the last observation (the object, as a dict, and as JSON without its gauges for the digest:
        # dumped once per GPU refresh), each GPU's verdict for status, the cordons in force, and the engines last
        # reported on an unhealthy GPU.
        self._gpu_seen: tuple[Any, dict[str, Any], bytes] | None = None
        self._gpus: list[dict[str, Any]] = []
        self._cordons: list[dict[str, Any]] = []
        self._gpu_trouble: dict[str, str] = {}
        # Renewal talks to the real control client even when a test wraps ``client`` for the other calls.
        self.issuer: CertificateIssuer | None = client if isinstance(client, CertificateIssuer) else None
        renewal = config.certificate_renewal
        # The renewal point is jittered once per start: a fleet enrolled in one rollout would otherwise renew in
        # one cycle, a burst of CSRs for the control plane's CA to sign.
        self.renewal = CertificateRenewal(
            NodeIdentity(config.identity_dir),
            remaining_fraction=min(0.99, jittered(renewal.remaining_fraction, self.rng)),
        )
        self.renewal_backoff = Backoff(renewal.retry_initial_seconds, renewal.retry_max_seconds, self.rng)
        control = config.control_plane
        # The longest a fetch may wait for a new state; each cycle's wait is jittered below it, and ends at the
        # next renewal when that comes first (``_long_poll_wait``).
        self.long_poll_s = float(control.long_poll_seconds) if control else 0.0
        # A steady cycle's nominal length: its long-poll ends at the next renewal, ``heartbeat_seconds`` ±10 % away.
        self.wait_s = float(min(control.long_poll_seconds, control.heartbeat_seconds)) if control else 0.0
        self.pause_s = float(control.heartbeat_seconds) if control else 30.0

    # The loop

    def run(self, *, once: bool = False, max_cycles: int | None = None) -> int:
        """Cycle until stopped (or once). Returns 0 when the last cycle succeeded, 1 otherwise; after a stop by
        signal, the stop's exit status (0 for SIGTERM, 130 for SIGINT)."""
        # What earlier runs knew first: an interrupted apply that fails again then counts on its backoff.
        self.resume_supervision()
        try:
            self.recover()
        except ApplyAbandoned as exc:
            return self._stopped("resuming-interrupted-apply", exc)
        failures = 0
        attempts = 0
        waiting = "starting"
        while True:
            if self.stop is not None and self.stop.stopping:
                return self._stopped(waiting)
            attempts += 1
            ok = True
            try:
                outcome = self.cycle(wait_s=0 if once else self.long_poll_s)
                # A failed repair is not the control plane's fault: supervision paces its own retries.
                ok = outcome.outcome not in (
                    CycleStatus.APPLY_FAILED,
                    CycleStatus.REJECTED,
                    CycleStatus.LEASE_LAPSED,
                    CycleStatus.REPAIR_FAILED,
                    CycleStatus.APPLY_BACKING_OFF,
                    CycleStatus.REFUSED,
                )
                failed_call = outcome.outcome == CycleStatus.APPLY_FAILED
            except ApplyAbandoned as exc:
                return self._stopped("apply", exc)
            except ControlCallStopped:
                return self._stopped("control-plane-call")
            except ControlPlaneRejected as exc:
                # Not an outage: retrying will not help until an operator acts (re-enroll a revoked node, fix
                # the node id). Keep backing off, so that the agent recovers on its own once they have.
                self.counters.refused += 1
                self.log.error(
                    "control-plane-refused",
                    status=exc.status,
                    reason=exc.reason,
                    detail=exc.detail,
                    attempt=failures + 1,
                    hint=_REFUSAL_HINTS.get(exc.reason, "see docs/PROTOCOL.md for the reason"),
                )
                ok = False
                failed_call = True
            except ControlPlaneError as exc:
                self.counters.unavailable += 1
                # A client with several replicas says which URL failed and where the retry goes.
                moved = (
                    {"url": exc.url, "next_url": exc.next_url}
                    if isinstance(exc, ControlPlaneUnavailable) and exc.next_url
                    else {}
                )
                self.log.warning("control-plane-unavailable", error=str(exc), attempt=failures + 1, **moved)
                ok = False
                failed_call = True
            self.write_status()
            if once or (max_cycles is not None and attempts >= max_cycles):
                return 0 if ok else 1
            if failed_call:
                failures += 1
                delay_s = self.backoff.delay(failures)
                self.log.info("backing-off", seconds=round(delay_s, 3), attempt=failures)
                waiting = "backoff"
                self.sleep(delay_s)
                continue
            failures = 0
            waiting = "between-cycles"
            if self.long_poll_s == 0:
                # Without a long-poll the pause paces the loop: until the lease's next renewal, which is jittered.
                self.sleep(self._until_renewal())

    def _stopped(self, during: str, abandoned: ApplyAbandoned | None = None) -> int:
        """Say that the loop stops, why and what it was doing; the exit status for ``meridian-node run``."""
        reason = self.stop.reason if self.stop is not None else None
        if abandoned is not None:
            self.log.warning(
                "apply-abandoned", run_ident=abandoned.ident, generation=abandoned.generation, detail=str(abandoned)
            )
        self.log.info("agent-stopping", signal=reason, during=during)
        # What supervision and a retry knew is already in the record (``cycle`` keeps it); the status file says
        # where the loop stood, for ``meridian-node status`` while the agent is down.
        with contextlib.suppress(OSError, StateStoreError):
            self.write_status()
        return self.stop.exit_status if self.stop is not None else 1

    def close(self) -> None:
        """The agent stops: give back what the observer holds open (its NVML event set) and the metrics port."""
        close = getattr(self.observer, "close", None)
        if callable(close):
            close()
        if self.metrics is not None and callable(getattr(self.metrics, "close", None)):
            self.metrics.close()

    def cycle(self, *, wait_s: float = 0) -> CycleOutcome:
        """One cycle; its fetch long-polls for up to ``wait_s`` seconds (``_long_poll_wait``), 0: it does not."""
        try:
            return self._cycle(wait_s)
        finally:
            # However the cycle ended (a failed call after an apply included), keep what supervision learned.
            self._remember()

    def _cycle(self, wait_s: float) -> CycleOutcome:
        started = time.monotonic()
        self.counters.cycles += 1
        node = self.config.node_id
        if self.issuer is not None and self.renewal.due(self.clock()):
            self._renew_certificate(self.issuer)
        if self._heartbeat_due():
            asked_at = self.monotonic()
            self.lease = self.client.heartbeat(node)
            self._renewed(self.lease, asked_at)
            self._epoch_ok = self._observe_epoch(self.lease.epoch)
        fetched = self.client.fetch_desired_state(node, etag=self.etag, wait_s=self._long_poll_wait(wait_s))
        if fetched.status == FetchStatus.NOT_MODIFIED:
            outcome = CycleOutcome(CycleStatus.UNCHANGED, fetched.generation)
            if self._retry is not None:
                outcome = self._retry_apply(self._retry)
        elif fetched.status == FetchStatus.NONE_PUBLISHED:
            outcome = CycleOutcome(CycleStatus.NONE_PUBLISHED)
        else:
            assert fetched.envelope is not None  # FetchStatus.NEW always carries one
            outcome = self._handle(fetched.envelope, fetched.etag, epoch_ok=self._epoch_ok)
        self._report()
        repair = self._supervise()
        if repair is not None:
            outcome = repair
            self._report()  # what the repair changed, in the same cycle
        if self.metrics is not None:
            self.metrics.cycle_done(time.monotonic() - started, outcome)
        return outcome

    def recover(self) -> ApplyResult | None:
        """Apply again an operation the oplog shows as started and never finished (a crash mid-apply).

        Never raises for what it finds: an operation it cannot resume (the spool is gone or damaged, the
        state no longer verifies, the apply cannot even be requested) is recorded ``abandoned`` with the
        reason, so the next start does not try it again and crash in the same place.
        """
        pending = self.oplog.pending()
        if pending is None:
            return None
        if self._read_only:
            self.log.warning("interrupted-apply-not-resumed", run_ident=pending.run_ident, reason=self.config.mode)
            return None

        def close(result: str, reason: str | None = None) -> None:
            self.oplog.append(
                op=pending.op,
                generation=pending.generation,
                epoch=pending.epoch,
                payload_sha256=pending.payload_sha256,
                run_ident=pending.run_ident,
                result=result,
                reason=reason,
            )

        try:
            envelope = self.spool.read_bytes()
            verified = self._verify(envelope)
        except (OSError, Rejection, StateStoreError) as exc:
            close(ABANDONED, str(exc))
            self.log.error("interrupted-apply-abandoned", run_ident=pending.run_ident, error=str(exc))
            return None
        if verified.payload_sha256 != pending.payload_sha256:
            reason = f"the spool holds sha256 {verified.payload_sha256}, the operation was {pending.payload_sha256}"
            close(ABANDONED, reason)
            self.log.error("interrupted-apply-abandoned", run_ident=pending.run_ident, error=reason)
            return None
        close("interrupted")
        self.log.info("resuming-interrupted-apply", run_ident=pending.run_ident, generation=pending.generation)
        result = self._apply(envelope, verified)
        # As any apply of this state: a failure counts towards its retry's backoff, a success ends the retry.
        if not result.ok and not verified.already_applied:
            self._apply_failed(envelope, verified, result)
        elif result.ok and self._retry is not None and self._retry.payload_sha256 == verified.payload_sha256:
            self._retry = None
        self._remember()
        return result

    # Steps

    def _handle(self, envelope: bytes, etag: str | None, *, epoch_ok: bool) -> CycleOutcome:
        try:
            verified = self._verify(envelope)
        except Rejection as exc:
            code = exc.code.value
            self.counters.rejections[code] = self.counters.rejections.get(code, 0) + 1
            if self.metrics is not None:
                self.metrics.rejected(code)
            if etag is None or etag != self._rejected_etag:
                self.log.warning("desired-state-rejected", reason=code, detail=exc.message)
            # Remember it so the same rejected bytes are not fetched and verified again every cycle.
            self.etag = self._rejected_etag = etag
            return CycleOutcome(CycleStatus.REJECTED, rejection=code)
        state = verified.state
        if verified.already_applied:
            self.etag = etag
            return CycleOutcome(CycleStatus.UNCHANGED, state.generation)
        if self.config.mode == "kubernetes-integrated":
            return self._refuse_read_only(state.generation, verified.payload_sha256, etag)
        try:
            atomic_write(self.spool_path(), envelope, mode=0o600)
        except OSError as exc:
            # A full disk or a broken state dir: this apply did not happen, and the next cycle tries again.
            self.counters.apply_failures += 1
            if self.metrics is not None:
                self.metrics.apply_not_spooled()
            self.log.error("desired-state-not-spooled", generation=state.generation, error=str(exc))
            return CycleOutcome(CycleStatus.APPLY_FAILED, state.generation)
        if self.config.mode == "observe-only":
            self.log.info("desired-state-verified-not-applied", generation=state.generation, mode=self.config.mode)
            self.etag = etag
            return CycleOutcome(CycleStatus.OBSERVED_ONLY, state.generation)
        if not epoch_ok or self.lease is None or self.lease.expires_at <= self.clock():
            self.log.warning("apply-held-lease-lapsed", generation=state.generation)
            return CycleOutcome(CycleStatus.LEASE_LAPSED, state.generation)
        result = self._apply(envelope, verified)
        # The ETag moves on even when the apply failed: the retry comes from memory, on its backoff, while
        # the long-poll keeps waiting for a newer state.
        self.etag = etag
        if not result.ok:
            self._apply_failed(envelope, verified, result)
            return CycleOutcome(CycleStatus.APPLY_FAILED, state.generation, run=result)
        self._retry = None
        return CycleOutcome(CycleStatus.APPLIED, state.generation, run=result)

    @property
    def _read_only(self) -> bool:
        return self.config.mode in READ_ONLY_MODES

    def _refuse_read_only(self, generation: int, payload_sha256: str, etag: str | None) -> CycleOutcome:
        """A verified state for a node in mode kubernetes-integrated: nothing of it is spooled or applied.

        Said once per state in the log, kept in status until another state comes; the ETag moves on, so the same
        state is not fetched and verified again each cycle (a restarted agent verifies and refuses it once more).
        """
        self.counters.states_refused += 1
        self.etag = etag
        if self.refused is None or self.refused.get("payload_sha256") != payload_sha256:
            detail = (
                f"mode {self.config.mode} is read-only: this node's containers and GPUs belong to Kubernetes, so "
                f"generation {generation} was verified and not applied; publish desired states only to nodes in "
                "mode managed-host (docs/KUBERNETES.md)"
            )
            self.refused = {
                "generation": generation,
                "payload_sha256": payload_sha256,
                "reason": REFUSED_READ_ONLY,
                "detail": detail,
                "refused_at": format_rfc3339(self.clock()),
            }
            self.log.warning(
                "desired-state-refused",
                generation=generation,
                mode=self.config.mode,
                reason=REFUSED_READ_ONLY,
                detail=detail,
            )
        return CycleOutcome(CycleStatus.REFUSED, generation, rejection=REFUSED_READ_ONLY)

    def _apply_failed(self, envelope: bytes, verified: VerifiedState, result: ApplyResult) -> None:
        previous = self._retry
        same = previous is not None and previous.payload_sha256 == verified.payload_sha256
        failures = previous.failures + 1 if same and previous is not None else 1
        delay_s = self.supervisor.backoff(failures)
        error = "; ".join(result.failures) or f"the run ended {result.status}"
        self._retry = ApplyRetry(
            envelope=envelope,
            generation=verified.state.generation,
            payload_sha256=verified.payload_sha256,
            failures=failures,
            retry_at=self.monotonic() + delay_s,
            backoff_s=delay_s,
            failed_at=self.clock(),
            error=error[:500],
        )
        self.log.warning(
            "apply-backing-off", generation=verified.state.generation, failures=failures, seconds=delay_s, error=error
        )

    def _retry_apply(self, retry: ApplyRetry) -> CycleOutcome:
        """Apply the failed state again once its backoff is over; until then, say that it is waiting."""
        if self._read_only:
            # A retry taken over from the record of a run before the mode changed: never in a read-only mode.
            self._retry = None
            self.log.warning("apply-retry-dropped", generation=retry.generation, reason=f"mode {self.config.mode}")
            return CycleOutcome(CycleStatus.UNCHANGED, retry.generation)
        if self.monotonic() < retry.retry_at:
            return CycleOutcome(CycleStatus.APPLY_BACKING_OFF, retry.generation)
        try:
            verified = self._verify(retry.envelope)  # time passed: expired, or overtaken by another apply
        except (Rejection, StateStoreError) as exc:
            # Fetched afresh next cycle, where a rejection is counted and logged the usual way.
            self._retry, self.etag = None, None
            self.log.warning("apply-retry-dropped", generation=retry.generation, reason=str(exc))
            return CycleOutcome(CycleStatus.UNCHANGED, retry.generation)
        if verified.already_applied:
            self._retry = None
            return CycleOutcome(CycleStatus.UNCHANGED, retry.generation)
        if not self._epoch_ok or self.lease is None or self.lease.expires_at <= self.clock():
            self.log.warning("apply-held-lease-lapsed", generation=retry.generation)
            return CycleOutcome(CycleStatus.LEASE_LAPSED, retry.generation)
        result = self._apply(retry.envelope, verified, reason=f"retry after {retry.failures} failed apply(s)")
        if not result.ok:
            self._apply_failed(retry.envelope, verified, result)
            return CycleOutcome(CycleStatus.APPLY_FAILED, retry.generation, run=result)
        self._retry = None
        return CycleOutcome(CycleStatus.APPLIED, retry.generation, run=result)

    def _verify(self, envelope: bytes) -> VerifiedState:
        return verify_desired_state(
            envelope, self.policy, node_id=self.config.node_id, now=self.clock(), applied=self.store.load()
        )

    def _apply(self, envelope: bytes, verified: VerifiedState, *, reason: str | None = None) -> ApplyResult:
        """Apply once; whatever goes wrong (even asking for the apply) is a failed apply, counted, not a crash."""
        state = verified.state
        if self._read_only:
            # The door every apply goes through, shut in a read-only mode whatever led here: the applier is never
            # asked and nothing is recorded. The callers above stop earlier; this holds if one of them does not.
            self.log.error("apply-refused", generation=state.generation, mode=self.config.mode, reason=reason)
            now = self.clock()
            return _not_run(state.generation, now, now, f"mode {self.config.mode} never applies")
        secrets = [value for engine in state.engines for value in engine.secret_env.values()]
        self.log.info("apply-started", generation=state.generation, epoch=state.lease_epoch, reason=reason)
        started_at = self.clock()
        try:
            # The decision, durable before the apply starts: a failed, hung or killed apply of this generation
            # still moves the floor of this record. In-process it is the applier's record; under the split root
            # records its own (the one that decides) and this copy keeps the agent from asking for older states.
            self.store.record_accepted(state.generation, state.lease_epoch, verified.payload_sha256)
            with self._reporting_while_applying():
                result = self.applier.apply(
                    envelope,
                    generation=state.generation,
                    epoch=state.lease_epoch,
                    payload_sha256=verified.payload_sha256,
                    secrets=secrets,
                    reason=reason,
                    lists_artifacts=bool(state.artifacts),
                )
        except ApplyAbandoned:
            raise  # the agent is stopping: not a failed apply, the oplog keeps it for the next start (``recover``)
        except Exception as exc:  # noqa: BLE001 - any failure to apply is reported as one, never a crash loop
            result = _not_run(
                state.generation,
                started_at,
                self.clock(),
                f"the apply could not be run: {type(exc).__name__}: {exc}",
            )
        self.last_run = result
        self.observer.forget()  # the apply changed what there is to observe
        if result.ok:
            self.counters.applies += 1
            self.last_applied_at = result.finished_at
            self._record(state.generation, state.lease_epoch, verified.payload_sha256)
            self._supervise_state(envelope, verified)
        else:
            self.counters.apply_failures += 1
            if state.generation != self.supervisor.generation:
                # A newer generation failed part-way: repairing towards the older one would fight the retries
                # of the newer. Supervision resumes when a generation is applied.
                self.supervisor.forget()
                self._desired = None
        if self.metrics is not None:
            self.metrics.applied(result)
        self.log.info(
            "apply-finished",
            generation=state.generation,
            run_ident=result.ident,
            status=result.status,
            changed=result.changed,
            failed=result.failed,
            seconds=round(result.wall_s, 3),
            failures=result.failures,
        )
        return result

    @contextmanager
    def _reporting_while_applying(self) -> Iterator[None]:
        """Observe each ``APPLY_REPORT_S`` while the apply runs, in a thread, and post what changed.

        ``_report`` posts only a changed observation, so an apply that changes nothing visible posts nothing.
        The cycle's own thread only waits on the apply meanwhile; a failed look is logged once and never
        touches the apply.
        """
        if self.lease is None:
            yield
            return
        stop = threading.Event()

        def report() -> None:
            logged = False
            failures = 0
            pause_s = APPLY_REPORT_S
            while not stop.wait(pause_s):
                try:
                    if self.transfers.poll():
                        # The cycle's own thread only waits on the apply meanwhile: ``status`` shows the pull now.
                        self.write_status()
                    self.observer.forget()
                    self._report()
                except ControlCallStopped:
                    return  # the agent is stopping: the apply is being abandoned, there is nothing to report
                except Exception as exc:  # noqa: BLE001 - reporting mid-apply is a courtesy, the apply is the job
                    if not logged:
                        self.log.warning("apply-report-failed", reason=f"{type(exc).__name__}: {exc}")
                    logged = True
                    # An apply can last an hour (a model download): a control plane that is down is asked less and
                    # less often, not every APPLY_REPORT_S.
                    failures += 1
                    pause_s = max(APPLY_REPORT_S, self.report_backoff.delay(failures))
                else:
                    failures, pause_s = 0, APPLY_REPORT_S

        thread = threading.Thread(target=report, name="report-while-applying", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.transfers.clear()

    def _supervise_state(self, envelope: bytes, verified: VerifiedState) -> None:
        self._desired = (envelope, verified)
        started = [engine.name for engine in verified.state.engines if engine.state == "started"]
        self.supervisor.expect(verified.state.generation, started)

    def resume_supervision(self) -> None:
        """At start-up: supervise the spooled state when it is the one applied (a restart keeps watching), and
        take over what earlier runs knew of it from the record: the engines' tracks when the record is for
        this state (generation and payload digest), the failed apply's count and next attempt when the spool
        holds the state that failed. A part written for another state is not used."""
        remembered = self.record.load(self.monotonic())
        if self.config.mode == "kubernetes-integrated":
            return  # no engine here is ours to watch, and no failed apply is ours to retry
        try:
            envelope = self.spool.read_bytes()
            verified = self._verify(envelope)
        except (OSError, Rejection, StateStoreError):
            return  # nothing applied yet, or not this: the next successful apply sets what to supervise
        if verified.already_applied:
            self._supervise_state(envelope, verified)
        if remembered is not None:
            self._resume_from(remembered, envelope, verified)

    def _resume_from(self, remembered: Remembered, envelope: bytes, verified: VerifiedState) -> None:
        generation, digest = verified.state.generation, verified.payload_sha256
        state, retry = remembered.supervised, remembered.apply_retry
        if state is not None and self.supervisor.generation is not None:
            if (state.generation, state.payload_sha256) == (generation, digest):
                self.supervisor.resume(generation, state.tracks, same_clock=remembered.same_clock)
            else:
                self.log.info(
                    "supervision-record-not-used",
                    part="supervised",
                    recorded_generation=state.generation,
                    supervising_generation=generation,
                    reason="written for another state",
                )
        if retry is None or verified.already_applied:
            return
        if retry.payload_sha256 != digest:
            self.log.info(
                "supervision-record-not-used",
                part="apply_retry",
                recorded_generation=retry.generation,
                spooled_generation=generation,
                reason="written for another state than the spooled one",
            )
            return
        now = self.monotonic()
        # Same boot: the attempt is due when it was, never later than the backoff allows now. Another boot: at once.
        retry_at = min(retry.retry_at, now + self.supervisor.backoff(retry.failures)) if remembered.same_clock else 0.0
        # The fetch goes on from where the run that failed left it: a 304 for the same state keeps the retry on its
        # backoff (``cycle``'s NOT_MODIFIED path), a newer state is fetched and applied at once, as it would be.
        self.etag = retry.etag
        self._retry = ApplyRetry(
            envelope=envelope,
            generation=retry.generation,
            payload_sha256=retry.payload_sha256,
            failures=retry.failures,
            retry_at=retry_at,
            backoff_s=retry.backoff_s,
            failed_at=retry.failed_at,
            error=retry.error,
        )

    def _remember(self) -> None:
        """Keep what supervision and the apply retry know in the record; it writes only what changed."""
        supervised = None
        if self._desired is not None and self.supervisor.generation is not None:
            supervised = RememberedState(
                generation=self.supervisor.generation,
                payload_sha256=self._desired[1].payload_sha256,
                tracks=self.supervisor.tracks,
            )
        retry = self._retry
        self.record.save(
            supervised,
            None
            if retry is None
            else RememberedRetry(
                generation=retry.generation,
                payload_sha256=retry.payload_sha256,
                failures=retry.failures,
                retry_at=retry.retry_at,
                backoff_s=retry.backoff_s,
                failed_at=retry.failed_at,
                error=retry.error,
                etag=self.etag,
            ),
        )

    def _supervise(self) -> CycleOutcome | None:
        """Repair drift from the applied state by reconciling the same generation again, at most as often as
        each drifted engine's backoff allows. Never in observe-only mode, never without a live lease."""
        if self._desired is None or self._read_only:
            return None
        drift = self.supervisor.assess(self._engines, self._engines_on_unhealthy_gpus())
        if drift is None:
            return None
        envelope, verified = self._desired
        if not self._epoch_ok or self.lease is None or self.lease.expires_at <= self.clock():
            self.log.warning("drift-not-repaired-lease-lapsed", generation=drift.generation, engines=drift.describe())
            return None
        self.supervisor.repaired(drift)
        # Record, then act: an agent killed during the repair's apply still finds the repair counted when it
        # starts again, and backs off instead of repairing at once, start after start.
        self._remember()
        self.counters.repairs += 1
        if self.metrics is not None:
            self.metrics.repaired([name for name, _why in drift.engines])
        self.log.warning(
            "engines-drifted", generation=drift.generation, engines=drift.describe(), last_lines=drift.engine_lines()
        )
        try:
            verified = self._verify(envelope)  # time passes: an expired state is not applied again
        except (Rejection, StateStoreError) as exc:
            self.log.error("drift-not-repaired", generation=drift.generation, error=str(exc))
            return CycleOutcome(CycleStatus.REPAIR_FAILED, drift.generation)
        result = self._apply(envelope, verified, reason=f"drift: {drift.describe()}")
        return CycleOutcome(
            CycleStatus.REPAIRED if result.ok else CycleStatus.REPAIR_FAILED, drift.generation, run=result
        )

    def _engines_on_unhealthy_gpus(self) -> dict[str, str]:
        """Per engine of the applied state on a GPU the last observation found unhealthy, why; said once per change."""
        if self._desired is None or self._gpu_seen is None:
            return {}
        engines = [{"name": engine.name, "gpus": engine.gpus} for engine in self._desired[1].state.engines]
        trouble = engines_on_unhealthy_gpus(engines, self._gpu_seen[1])
        if trouble != self._gpu_trouble:
            generation = self._desired[1].state.generation
            for name, why in sorted(trouble.items()):
                if self._gpu_trouble.get(name) != why:
                    # Not repaired here: the state pins the engine to these GPUs. The control plane moves it.
                    self.log.warning("engine-on-unhealthy-gpu", engine=name, generation=generation, problem=why)
            for name in sorted(set(self._gpu_trouble) - set(trouble)):
                self.log.info("engine-off-unhealthy-gpu", engine=name, generation=generation)
            self._gpu_trouble = trouble
        return trouble

    def _record(self, generation: int, epoch: int, payload_sha256: str) -> None:
        """The agent's own record of what was applied, with the epoch the apply was decided under.

        In-process the playbook already wrote it (this is then a no-op); under the split root keeps its own,
        which is the one that decides, and this copy is what the agent shows and skips unchanged states by.
        """
        try:
            self.store.record_applied(generation, epoch, payload_sha256)
        except (StateStoreError, OSError) as exc:
            self.log.error("applied-state-not-recorded", generation=generation, error=str(exc))

    def _renew_certificate(self, issuer: CertificateIssuer) -> None:
        now = self.clock()
        try:
            info = self.renewal.renew(issuer, self.config.node_id, now)
        except ControlCallStopped:
            raise  # the agent is stopping: not a failed renewal, and nothing to retry
        except (ControlPlaneError, IdentityError, OSError) as exc:
            retry_at = self.renewal.failed(now, str(exc), self.renewal_backoff.delay(self.renewal.failures + 1))
            if self.metrics is not None:
                self.metrics.renewal_failed()
            old = self.renewal.info
            self.log.warning(
                "certificate-renewal-failed",
                error=str(exc),
                attempt=self.renewal.failures,
                retry_at=format_rfc3339(retry_at),
                certificate_not_after=format_rfc3339(old.not_after) if old else None,
            )
            return
        if info is not None:
            self.log.info("certificate-renewed", serial=f"{info.serial:x}", not_after=format_rfc3339(info.not_after))

    def _heartbeat_due(self) -> bool:
        """Renew when the renewal set by the last one is due, and always while the lease is unknown.

        Cycles come faster than that only when states change quickly (a long-poll returns early); then
        one renewal per interval is enough, and a fence is still seen within one interval.
        """
        if self.lease is None or self._renew_at is None:
            return True
        return self.monotonic() >= self._renew_at - _RENEWAL_SLACK_S

    def _renewed(self, lease: Lease, asked_at: float) -> None:
        """Set the next renewal: ``heartbeat_seconds`` ±10 % after this one was asked for, and never later than half
        the lease (the control plane's length, from the lease itself), so one failed renewal can still be retried
        before the lease lapses. Timed from the ask, not the answer: the lease began before the answer came."""
        lease_s = (lease.expires_at - lease.renewed_at).total_seconds()
        interval_s = min(self.pause_s, max(1.0, lease_s / 2))
        self._renew_at = asked_at + jittered(interval_s, self.rng)

    def _until_renewal(self) -> float:
        """Seconds until the next renewal is due (the pause between cycles when there is no long-poll)."""
        if self._renew_at is None:
            return jittered(self.pause_s, self.rng)
        return max(0.0, self._renew_at - self.monotonic())

    def _long_poll_wait(self, wait_s: float) -> float:
        """This cycle's long-poll: ``wait_s`` less up to ``TIMER_JITTER`` of it, ending at the next renewal if that
        comes first, in whole milliseconds; 0 when ``wait_s`` is 0.

        Never longer than ``wait_s``: ``long_poll_seconds`` is set within the server's limit on a wait, and a
        longer one is refused. With the defaults (long-poll 30 s, heartbeat 15 s) the renewal ends every wait, so a
        steady cycle is one renewal and one 304, ``heartbeat_seconds`` ±10 % apart.
        """
        if wait_s <= 0:
            return 0.0
        wait = wait_s * (1 - TIMER_JITTER * self.rng.random())
        if self._renew_at is not None:
            wait = min(wait, self._renew_at - self.monotonic())
        return max(0.0, round(wait, 3))

    def _observe_epoch(self, epoch: int) -> bool:
        try:
            self.store.observe_epoch(epoch)
        except StateStoreError as exc:
            # The control plane reported an epoch below one already seen: do not apply under it.
            self.log.error("lease-epoch-went-backwards", epoch=epoch, error=str(exc))
            return False
        return True

    def _report(self) -> None:
        assert self.lease is not None
        observation = self.observer.observe(
            node_id=self.config.node_id,
            mode=self.config.mode,
            epoch=self.lease.epoch,
            applied_generation=self.store.load().generation,
            last_run=_run_summary(self.last_run),
            now=self.clock(),
            cordon=self._applied_cordon(),
            refused_state=self.refused if self.config.mode == "kubernetes-integrated" else None,
        )
        if self.transfers.transfers:
            transfers = [TransferObservation.model_validate(entry) for entry in self.transfers.transfers]
            observation = observation.model_copy(update={"transfers": transfers})
        self._seen_gpus(observation)
        self._kubernetes = None if observation.kubernetes is None else observation.kubernetes.model_dump(mode="json")
        # Not in the observation's contract: the observer keeps it aside for supervision (and status).
        drifted: dict[str, tuple[str, ...]] = getattr(self.observer, "drifted", None) or {}
        self._engines = [
            {
                "name": e.name,
                "managed": e.managed,
                "state": e.state,
                "ready": e.ready,
                "draining": e.draining,
                "restarts": e.restarts,
                "exit_reason": e.exit_reason,
                "last_lines": e.last_lines,
                "ready_since": None if e.ready_since is None else format_rfc3339(e.ready_since),
                "drifted": list(drifted.get(e.name, ())),
            }
            for e in observation.engines
        ]
        assert self._gpu_seen is not None
        # The GPU facts (most of an observation's bytes) digested without their gauges, once per GPU refresh.
        digest = hashlib.sha256(self._gpu_seen[2])
        digest.update(observation.model_dump_json(exclude=_OBSERVATION_GAUGES).encode())
        content = digest.digest()
        now = self.monotonic()
        if self._reported is not None and self._reported[0] == content and now < self._reported[1]:
            return
        try:
            self.client.post_observation(self.size_guard(observation, self.log))
        except ControlPlaneRejected as exc:
            self.log.warning("observation-refused", status=exc.status, reason=exc.reason, detail=exc.detail)
        self._reported = (content, now + jittered(REPORT_REFRESH_S, self.rng))

    def _applied_cordon(self) -> dict[str, Any] | None:
        """The cordon of the state last applied (the one the engines run by), as a dict."""
        if self._desired is None or self._desired[1].state.cordon is None:
            return None
        return self._desired[1].state.cordon.model_dump(mode="json")

    def _seen_gpus(self, observation: Observation) -> None:
        """Keep the observation's GPU verdicts and cordons for supervision and status. The observer hands the same
        facts object until its next GPU refresh: they are turned into dicts once per refresh, not per cycle."""
        gpu = observation.gpu
        if self._gpu_seen is None or self._gpu_seen[0] is not gpu:
            facts = gpu.model_dump(mode="json")
            self._gpu_seen = (gpu, facts, gpu.model_dump_json(exclude=_GPU_GAUGES).encode())
            self._gpus = [verdict_summary(entry) for entry in facts["gpus"]]
        self._cordons = (
            [cordon.model_dump(mode="json") for cordon in observation.cordons] if observation.cordons else []
        )

    def spool_path(self) -> Path:
        self.spool.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.spool

    # Status for ``meridian-node status`` (another process): small, rewritten each cycle, not fsync'd.

    def write_status(self) -> None:
        applied = self.store.load()
        document = {
            "node_id": self.config.node_id,
            "mode": self.config.mode,
            "updated_at": format_rfc3339(self.clock()),
            "lease_epoch": self.lease.epoch if self.lease else None,
            "lease_expires_at": format_rfc3339(self.lease.expires_at) if self.lease else None,
            "applied_generation": applied.generation,
            "applied_epoch": applied.epoch,
            "last_run": _run_summary(self.last_run),
            # Kept with the counters across restarts: a failed apply never moves it.
            "last_applied_at": format_rfc3339(self.last_applied_at) if self.last_applied_at else None,
            "counters": asdict(self.counters),
            "engines": self._engines,
            "supervision": self._supervision_status(),
            "apply_retry": self._retry_status(),
            "certificate": self.renewal.status(),
            # Mode kubernetes-integrated: what the kubelet said at the last report, and the state last refused.
            "kubernetes": self._kubernetes,
            "refused_state": self.refused,
            # Each GPU's verdict at the last report, and the cordons then in force.
            "gpus": self._gpus,
            "cordons": self._cordons,
            # The image pulls and artifact downloads of the apply in flight (``transfer_watch``); [] between applies.
            "transfers": self.transfers.transfers,
        }
        if self.metrics is not None:
            # Its gauges are this document as the cycle composed it: the scrape (another thread) reads no state
            # the cycle may be changing, and the endpoint agrees with ``status``.
            self.metrics.status_written(document)
        # Rewritten when something in it changed, or STATUS_REFRESH_S after the last write so that
        # 'updated_at' still shows a live agent: an unchanged cycle would otherwise cost a file write.
        counters = document["counters"]
        assert isinstance(counters, dict)
        unchanged = {**document, "updated_at": None, "counters": {**counters, "cycles": None}}
        now = self.monotonic()
        last = self._status_written
        if last is not None and last[0] == unchanged and now - last[1] < STATUS_REFRESH_S:
            return
        path = self.state_dir / STATUS_FILE
        temp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
        temp.write_text(json.dumps(document, separators=(",", ":")) + "\n")
        temp.replace(path)
        self._status_written = (unchanged, now)

    def _retry_status(self) -> dict[str, Any] | None:
        retry = self._retry
        if retry is None:
            return None
        left_s = max(0.0, retry.retry_at - self.monotonic())
        return {
            "state": "backing-off" if left_s > 0 else "retry-due",
            "generation": retry.generation,
            "failures": retry.failures,
            "backoff_seconds": retry.backoff_s,
            "last_failed_at": format_rfc3339(retry.failed_at),
            "next_attempt_in_seconds": round(left_s, 1),
            # From the failure, not from now: both clocks were read together when it failed, and a status
            # written later must name the same moment.
            "next_attempt_at": format_rfc3339(retry.failed_at + timedelta(seconds=retry.backoff_s)),
            "error": retry.error,
        }

    def _supervision_status(self) -> dict[str, dict[str, Any]]:
        """Supervision's report with the next repair as a wall-clock time too: status.json is read later, by
        another process, when "in 40 s" no longer says when."""
        report = self.supervisor.status()
        now = self.clock()
        for entry in report.values():
            left_s = entry.get("next_repair_in_seconds")
            entry["next_repair_at"] = None if not left_s else format_rfc3339(now + timedelta(seconds=left_s))
        return report


def read_status(state_dir: Path) -> dict[str, Any] | None:
    try:
        document: Any = json.loads((Path(state_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _run_summary(result: ApplyResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    status = result.status if result.status in ("successful", "failed", "canceled", "timeout") else "failed"
    return {
        "ident": result.ident,
        "generation": result.generation,
        "status": status,
        "changed": result.changed,
        "failed": result.failed,
        "finished_at": format_rfc3339(result.finished_at),
    }


def _not_run(generation: int, started_at: datetime, finished_at: datetime, why: str) -> ApplyResult:
    """A failed apply whose playbook never ran: no journal, nothing changed, ``why`` as its one failure."""
    return ApplyResult(
        ident="",
        generation=generation,
        status="failed",
        rc=None,
        changed=0,
        failed=0,
        journal=Path(),
        started_at=started_at,
        finished_at=finished_at,
        wall_s=0.0,
        failures=[why],
    )

"""The agent's cycle: heartbeat → conditional fetch → verify → spool → apply → observe → report.

Runs on: the agent side (``meridian-node run``, unprivileged); it applies through an ``ApplyPort``, in-process
or by spooling a request to root's apply unit.

One ``Agent`` object owns the loop's memory (ETag, counters, the state applied and a failed one's retry) and puts
its parts in order: the lease and the timers that pace each call (``agent_side.lease``), the observations posted
(``agent_side.reporter``), the status document (``agent_side.status_file``) and supervision (``agent_side.supervise``
with its record). Everything with a side effect is injected (control client, applier, observer, clock, sleep, random
source), so tests drive the real loop against a real control plane with a fake clock or sleep where they need one;
the parts get the agent's clock, random source and log at each call, so one replaced on the agent moves them all.

Rules the loop keeps:

- An unchanged state (304, or a generation already applied with the same bytes) runs no playbook.
- A rejected state changes nothing on the host: no spool write, no apply, no record. The rejection is
  counted by reason and logged once per distinct envelope.
- Control plane unreachable: back off with jitter (``lease.Backoff``), never touching running engines.
- No apply without a live lease (``lease.LeaseKeeper.live``): a lapsed lease stops new applies (the control plane
  may have handed this node's work to someone else), never running engines.
- ``observe-only`` verifies and reports but never applies.
- ``kubernetes-integrated`` reports what the kubelet says runs here (``kubernetes_observer``) and never changes the
  host: a published state is verified and refused (``refused``, reason ``read-only-mode``, in the log and
  status), nothing is spooled, no earlier apply is resumed or retried and no engine is supervised. Every apply of
  either read-only mode goes through ``_apply``, which refuses before the applier is reached.
- While an apply runs, what the engines look like is observed each ``reporter.APPLY_REPORT_S`` and posted when it
  changed (``_reporting_while_applying``), so that a replace's switch reaches the serving projection mid-apply.
- Drift from the applied state is repaired by applying the same generation again (``_supervise``), at most as often
  as supervision's backoff allows; what it knows, and a failed apply's retry (``apply_retry``), is kept across
  restarts, and an engine on a GPU turned unhealthy is reported, never repaired (``supervised_state``).
- SIGTERM and SIGINT stop the loop within a few seconds whatever it is doing (``stop``, ``agent_side.stop``): the
  pause between cycles and a backoff are waits on the stop, the control client gives up its long-poll, and an apply
  in flight is abandoned (in-process: ansible-runner kills the playbook; under the split: the request stays with
  root) with its oplog entry left started, so the next start resumes it as after a crash (``recover``). The log
  says ``agent-stopping`` (the signal, and what the loop was doing) and ``cmd_run`` says ``agent-stopped``.
- What it costs the control plane is kept small (bench/protocol_cost.py measures it per node and hour): the
  heartbeat is a body-less lease renewal, made when ``LeaseKeeper`` says it is due; the desired state is fetched
  with ``If-None-Match`` and answered 304 while unchanged; an observation is posted when what it says changed
  (``reporter``). Every timer is jittered, every failed call backs off, and the client certificate is renewed at
  the start of a cycle when due, a failed renewal never failing the cycle (``lease``).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, Observation, format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import (
    Rejection,
    VerifiedState,
    verify_desired_state,
)
from meridian_node_agent.agent_side.apply_retry import ApplyRetry
from meridian_node_agent.agent_side.control_client import (
    ControlCallStopped,
    ControlPlaneError,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
    DesiredStateFetch,
    FetchStatus,
)
from meridian_node_agent.agent_side.counters import restore_counters
from meridian_node_agent.agent_side.identity import CertificateIssuer, CertificateRenewal, NodeIdentity
from meridian_node_agent.agent_side.lease import Backoff, LeaseKeeper, jittered, renew_certificate
from meridian_node_agent.agent_side.reporter import ObservePort, Reporter, run_summary
from meridian_node_agent.agent_side.status_file import StatusWriter, status_document, supervision_status
from meridian_node_agent.agent_side.stop import StopSignal
from meridian_node_agent.agent_side.supervise import Supervisor
from meridian_node_agent.agent_side.supervised_state import SupervisedState
from meridian_node_agent.agent_side.supervision_record import SupervisionRecord
from meridian_node_agent.agent_side.transfer_watch import TransferWatch, transfers_path
from meridian_node_agent.apply.applier import ApplyAbandoned, ApplyResult
from meridian_node_agent.apply.oplog import ABANDONED, OpLog
from meridian_node_agent.boundary.agent_files import STATUS_FILE
from meridian_node_agent.config import READ_ONLY_MODES, AgentConfig
from meridian_node_agent.logs import EventLogger

__all__ = ["REFUSED_READ_ONLY", "SPOOL_FILE", "Agent", "CycleOutcome", "CycleStatus"]

SPOOL_FILE = Path("spool") / "desired-state.json"
# Why a verified state is not applied on a node in mode kubernetes-integrated (the cycle's ``rejection``).
REFUSED_READ_ONLY = "read-only-mode"


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
        self.reporter = Reporter(Backoff(config.backoff.initial_seconds, config.backoff.max_seconds, self.rng))
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
        self.status_writer = StatusWriter(self.state_dir)
        # The lease, whether its epoch may be applied under, and the timers of the calls (``agent_side.lease``).
        self.lease_keeper = LeaseKeeper(config.control_plane)
        self.etag: str | None = None
        self.last_run: ApplyResult | None = None
        self._rejected_etag: str | None = None
        # The state last applied, what supervision repairs towards; with what supervision and the apply retry know,
        # kept in the agent's own directory across its restarts. On the agent's one monotonic clock, read through the
        # attribute: the record's times are on it, and a test that stands in another clock moves supervision and the
        # apply retry together.
        self.supervised = SupervisedState.configured(
            config.supervision, self.state_dir, clock=lambda: self.monotonic(), log=self.log
        )
        self._retry: ApplyRetry | None = None
        # Mode kubernetes-integrated: the state last refused (for status).
        self.refused: dict[str, Any] | None = None
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

    @property
    def lease(self) -> Lease | None:
        """The lease last renewed (``lease_keeper``); None until the first heartbeat."""
        return self.lease_keeper.lease

    @property
    def supervisor(self) -> Supervisor:
        """What decides on the supervised state's engines (``supervised``)."""
        return self.supervised.supervisor

    @property
    def record(self) -> SupervisionRecord:
        """What supervision and the apply retry keep across restarts (``supervised``)."""
        return self.supervised.record

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
                outcome = self.cycle(wait_s=0 if once else self.lease_keeper.long_poll_s)
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
                    hint=exc.hint,
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
            if self.lease_keeper.long_poll_s == 0:
                # Without a long-poll the pause paces the loop: until the lease's next renewal, which is jittered.
                self.sleep(self.lease_keeper.until_renewal(self.monotonic(), self.rng))

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
        """One cycle; its fetch long-polls for up to ``wait_s`` seconds (``LeaseKeeper.long_poll_wait``), 0: it does
        not."""
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
            renew_certificate(
                self.renewal,
                self.issuer,
                node,
                now=self.clock(),
                backoff=self.renewal_backoff,
                log=self.log,
                metrics=self.metrics,
            )
        if self.lease_keeper.due(self.monotonic()):
            asked_at = self.monotonic()
            lease = self.client.heartbeat(node)
            self.lease_keeper.renewed(lease, asked_at, self.rng, epoch_ok=self._observe_epoch(lease.epoch))
        long_poll_s = self.lease_keeper.long_poll_wait(wait_s, self.monotonic(), self.rng)
        fetched = self.client.fetch_desired_state(node, etag=self.etag, wait_s=long_poll_s)
        if fetched.status == FetchStatus.NOT_MODIFIED:
            outcome = CycleOutcome(CycleStatus.UNCHANGED, fetched.generation)
            if self._retry is not None:
                outcome = self._retry_apply(self._retry)
        elif fetched.status == FetchStatus.NONE_PUBLISHED:
            outcome = CycleOutcome(CycleStatus.NONE_PUBLISHED)
        else:
            assert fetched.envelope is not None  # FetchStatus.NEW always carries one
            outcome = self._handle(fetched.envelope, fetched.etag)
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

        try:
            envelope = self.spool.read_bytes()
            verified = self._verify(envelope)
        except (OSError, Rejection, StateStoreError) as exc:
            self.oplog.finish(pending, ABANDONED, reason=str(exc))
            self.log.error("interrupted-apply-abandoned", run_ident=pending.run_ident, error=str(exc))
            return None
        if verified.payload_sha256 != pending.payload_sha256:
            reason = f"the spool holds sha256 {verified.payload_sha256}, the operation was {pending.payload_sha256}"
            self.oplog.finish(pending, ABANDONED, reason=reason)
            self.log.error("interrupted-apply-abandoned", run_ident=pending.run_ident, error=reason)
            return None
        self.oplog.finish(pending, "interrupted")
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

    def _handle(self, envelope: bytes, etag: str | None) -> CycleOutcome:
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
        if not self.lease_keeper.live(self.clock()):
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
        error = "; ".join(result.failures) or f"the run ended {result.status}"
        self._retry = retry = ApplyRetry.after_failure(
            self._retry,
            envelope,
            verified,
            error,
            backoff=self.supervisor.backoff,
            now=self.monotonic(),
            at=self.clock(),
        )
        self.log.warning(
            "apply-backing-off",
            generation=retry.generation,
            failures=retry.failures,
            seconds=retry.backoff_s,
            error=error,
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
        if not self.lease_keeper.live(self.clock()):
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
            return ApplyResult.not_run(state.generation, now, now, f"mode {self.config.mode} never applies")
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
            result = ApplyResult.not_run(
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
            self.supervised.applied(envelope, verified)
        else:
            self.counters.apply_failures += 1
            self.supervised.applied_failed(state.generation)
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
        """Observe each ``APPLY_REPORT_S`` while the apply runs, in a thread, and post what changed
        (``Reporter.while_applying``); ``status`` shows the pulls and downloads in flight as they move."""
        if self.lease is None:
            yield
            return

        def look() -> None:
            if self.transfers.poll():
                # The cycle's own thread only waits on the apply meanwhile: ``status`` shows the pull now.
                self.write_status()
            self.observer.forget()
            self._report()

        try:
            with self.reporter.while_applying(look, self.log):
                yield
        finally:
            self.transfers.clear()

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
            self.supervised.applied(envelope, verified)
        retry = None if remembered is None else self.supervised.take_over(remembered, verified, self.log)
        if retry is not None:
            assert remembered is not None
            # The fetch goes on from where the run that failed left it: a 304 for the same state keeps the retry on
            # its backoff (``cycle``'s NOT_MODIFIED path), a newer state is fetched and applied at once, as it would be.
            self.etag = retry.etag
            self._retry = ApplyRetry.resumed(
                retry, envelope, same_clock=remembered.same_clock, now=self.monotonic(), backoff=self.supervisor.backoff
            )

    def _remember(self) -> None:
        """Keep what supervision and the apply retry know in the record; it writes only what changed."""
        self.supervised.remember(None if self._retry is None else self._retry.remembered(self.etag))

    def _supervise(self) -> CycleOutcome | None:
        """Repair drift from the applied state by reconciling the same generation again, at most as often as
        each drifted engine's backoff allows. Never in observe-only mode, never without a live lease."""
        desired = self.supervised.desired
        if desired is None or self._read_only:
            return None
        unhealthy = self.supervised.on_unhealthy_gpus(self.reporter.gpu_facts, self.log)
        drift = self.supervisor.assess(self.reporter.engines, unhealthy)
        if drift is None:
            return None
        envelope, verified = desired
        if not self.lease_keeper.live(self.clock()):
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

    def _record(self, generation: int, epoch: int, payload_sha256: str) -> None:
        """The agent's own record of what was applied, with the epoch the apply was decided under.

        In-process the playbook already wrote it (this is then a no-op); under the split root keeps its own,
        which is the one that decides, and this copy is what the agent shows and skips unchanged states by.
        """
        try:
            self.store.record_applied(generation, epoch, payload_sha256)
        except (StateStoreError, OSError) as exc:
            self.log.error("applied-state-not-recorded", generation=generation, error=str(exc))

    def _observe_epoch(self, epoch: int) -> bool:
        try:
            self.store.observe_epoch(epoch)
        except StateStoreError as exc:
            # The control plane reported an epoch below one already seen: do not apply under it.
            self.log.error("lease-epoch-went-backwards", epoch=epoch, error=str(exc))
            return False
        return True

    def _report(self) -> None:
        """Observe, and hand the observation to the reporter: kept for supervision and status, posted if it changed."""
        assert self.lease is not None
        observation = self.observer.observe(
            node_id=self.config.node_id,
            mode=self.config.mode,
            epoch=self.lease.epoch,
            applied_generation=self.store.load().generation,
            last_run=run_summary(self.last_run),
            now=self.clock(),
            cordon=self.supervised.cordon(),
            refused_state=self.refused if self.config.mode == "kubernetes-integrated" else None,
        )
        self.reporter.report(
            observation,
            transfers=self.transfers.transfers,
            # Not in the observation's contract: the observer keeps it aside for supervision (and status).
            drifted=getattr(self.observer, "drifted", None) or {},
            post=self.client.post_observation,
            log=self.log,
            now=self.monotonic(),
            rng=self.rng,
        )

    def spool_path(self) -> Path:
        self.spool.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.spool

    def write_status(self) -> None:
        """Compose the status document (``status_file``), hand it to the metrics endpoint, write it if it changed."""
        now = self.clock()
        document = status_document(
            self.config,
            now=now,
            lease=self.lease,
            applied=self.store.load(),
            last_run=self.last_run,
            last_applied_at=self.last_applied_at,
            counters=self.counters,
            seen=self.reporter,
            supervision=supervision_status(self.supervisor.status(), now),
            apply_retry=None if self._retry is None else self._retry.status(self.monotonic()),
            certificate=self.renewal.status(),
            refused=self.refused,
            transfers=self.transfers.transfers,
        )
        if self.metrics is not None:
            # Its gauges are this document as the cycle composed it: the scrape (another thread) reads no state
            # the cycle may be changing, and the endpoint agrees with ``status``.
            self.metrics.status_written(document)
        self.status_writer.write(document, self.monotonic())

"""The agent's lease and the timers that pace its calls to the control plane: jitter, renewal, long-poll, backoff;
and the client certificate's renewal, paced the same way.

Runs on: the agent side (``meridian-node run``); the cycle (``agent_side.cycle``) asks these when to call and how
long to wait, and makes the calls itself.

- No apply without a live lease: a lapsed lease (or an epoch below one already seen) stops new applies, because
  the control plane may have handed this node's work to someone else; running engines are never touched
  (``LeaseKeeper.live``).
- Every timer that paces a call to the control plane is drawn within ±``TIMER_JITTER`` (10 %) of its setting,
  each time it is set, from the injected random source (``jittered``): the lease renewal (``heartbeat_seconds``,
  and the pause between cycles without a long-poll), the long-poll (up to 10 % shorter, never longer: the server
  refuses a wait over its limit), the observation refresh (``agent_side.reporter``) and the certificate's renewal
  point. Nodes started together spread out instead of calling in lockstep for ever.
- Failed calls back off exponentially, with jitter (``Backoff``): the loop's, a certificate renewal's and the
  reports made while an apply runs, each on a count of its own.
- The client certificate is renewed once less than ``certificate_renewal.remaining_fraction`` (±10 %) of its
  lifetime is left, at the start of a cycle, so the rest of the cycle already uses the new pair
  (``renew_certificate``). A failed renewal is logged and retried after a backoff of its own; it never fails the
  cycle, because the old certificate is still valid (and when it is not, the calls after it say so).

``LeaseKeeper`` does no I/O and reads no clock: the cycle hands it the monotonic time and the random source at
each call, so a test that stands in another clock or a seeded source moves every timer with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import Lease, format_rfc3339
from meridian_node_agent.agent_side.control_client import ControlCallStopped, ControlPlaneError
from meridian_node_agent.agent_side.identity import CertificateIssuer, CertificateRenewal, IdentityError
from meridian_node_agent.config import TIMER_JITTER, ControlPlaneConfig
from meridian_node_agent.logs import EventLogger

__all__ = ["Backoff", "LeaseKeeper", "jittered", "renew_certificate"]

# A long-poll the server ends a little before the renewal it was sized to reach still renews in the cycle after
# it, instead of one more short fetch first (the wait is sent in milliseconds).
_RENEWAL_SLACK_S = 0.1


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


class LeaseKeeper:
    """The lease this node holds, whether its epoch may be applied under, and when it is renewed next.

    ``renew_at`` is on the agent's monotonic clock, set at each renewal and jittered. ``long_poll_s`` is the longest
    a fetch may wait for a new state (each cycle's wait is jittered below it and ends at the next renewal when that
    comes first); ``wait_s`` a steady cycle's nominal length (its long-poll ends at the next renewal,
    ``heartbeat_seconds`` ±10 % away); ``pause_s`` the renewal interval, which also paces a loop without a long-poll.
    """

    def __init__(self, control: ControlPlaneConfig | None) -> None:
        self.lease: Lease | None = None
        self.epoch_ok = True
        self.renew_at: float | None = None
        self.long_poll_s = float(control.long_poll_seconds) if control else 0.0
        self.wait_s = float(min(control.long_poll_seconds, control.heartbeat_seconds)) if control else 0.0
        self.pause_s = float(control.heartbeat_seconds) if control else 30.0

    def due(self, now: float) -> bool:
        """Renew when the renewal set by the last one is due, and always while the lease is unknown.

        Cycles come faster than that only when states change quickly (a long-poll returns early); then
        one renewal per interval is enough, and a fence is still seen within one interval.
        """
        if self.lease is None or self.renew_at is None:
            return True
        return now >= self.renew_at - _RENEWAL_SLACK_S

    def renewed(self, lease: Lease, asked_at: float, rng: random.Random, *, epoch_ok: bool) -> None:
        """Hold ``lease`` and set the next renewal: ``heartbeat_seconds`` ±10 % after this one was asked for, and never
        later than half the lease (the control plane's length, from the lease itself), so one failed renewal can still
        be retried before the lease lapses. Timed from the ask, not the answer: the lease began before the answer came.
        ``epoch_ok``: the agent's record took the lease's epoch (it never goes back)."""
        self.lease, self.epoch_ok = lease, epoch_ok
        lease_s = (lease.expires_at - lease.renewed_at).total_seconds()
        interval_s = min(self.pause_s, max(1.0, lease_s / 2))
        self.renew_at = asked_at + jittered(interval_s, rng)

    def live(self, now: datetime) -> bool:
        """Whether an apply may be decided now: a lease is held, unexpired, with an epoch the record took."""
        return self.epoch_ok and self.lease is not None and self.lease.expires_at > now

    def until_renewal(self, now: float, rng: random.Random) -> float:
        """Seconds until the next renewal is due (the pause between cycles when there is no long-poll)."""
        if self.renew_at is None:
            return jittered(self.pause_s, rng)
        return max(0.0, self.renew_at - now)

    def long_poll_wait(self, wait_s: float, now: float, rng: random.Random) -> float:
        """This cycle's long-poll: ``wait_s`` less up to ``TIMER_JITTER`` of it, ending at the next renewal if that
        comes first, in whole milliseconds; 0 when ``wait_s`` is 0.

        Never longer than ``wait_s``: ``long_poll_seconds`` is set within the server's limit on a wait, and a
        longer one is refused. With the defaults (long-poll 30 s, heartbeat 15 s) the renewal ends every wait, so a
        steady cycle is one renewal and one 304, ``heartbeat_seconds`` ±10 % apart.
        """
        if wait_s <= 0:
            return 0.0
        wait = wait_s * (1 - TIMER_JITTER * rng.random())
        if self.renew_at is not None:
            wait = min(wait, self.renew_at - now)
        return max(0.0, round(wait, 3))


def renew_certificate(
    renewal: CertificateRenewal,
    issuer: CertificateIssuer,
    node_id: str,
    *,
    now: datetime,
    backoff: Backoff,
    log: EventLogger,
    metrics: Any,
) -> None:
    """Renew the client certificate, which ``renewal.due`` says is due. A failure is logged, counted in ``metrics``
    and retried after ``backoff`` (on the renewal's own count); it never raises, but for a stop."""
    try:
        info = renewal.renew(issuer, node_id, now)
    except ControlCallStopped:
        raise  # the agent is stopping: not a failed renewal, and nothing to retry
    except (ControlPlaneError, IdentityError, OSError) as exc:
        retry_at = renewal.failed(now, str(exc), backoff.delay(renewal.failures + 1))
        if metrics is not None:
            metrics.renewal_failed()
        old = renewal.info
        log.warning(
            "certificate-renewal-failed",
            error=str(exc),
            attempt=renewal.failures,
            retry_at=format_rfc3339(retry_at),
            certificate_not_after=format_rfc3339(old.not_after) if old else None,
        )
        return
    if info is not None:
        log.info("certificate-renewed", serial=f"{info.serial:x}", not_after=format_rfc3339(info.not_after))

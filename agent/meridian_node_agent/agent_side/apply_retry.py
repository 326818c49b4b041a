"""A verified state whose apply failed, retried on supervision's crash-loop backoff.

Runs on: the agent side (``meridian-node run``); the cycle (``agent_side.cycle``) makes one when an apply fails,
retries it when it is due, and keeps it in the agent's record (``agent_side.supervision_record``).

An engine whose command exits at once fails every apply at its readiness wait; retrying on every cycle would run a
playbook (and restart the engine) once per long-poll, for ever. The n-th failure waits ``supervisor.backoff(n)``
(10 s doubling to 5 min by default) before the next attempt; a newer state published meanwhile is applied at once
(the long-poll still waits on it), and the count starts over.

The count and the next attempt are kept in the agent's record too (``RememberedRetry``: this less the envelope,
which the spool holds), with the ETag the agent holds meanwhile. A restarted agent or a ``run --once`` from cron
asks with that ETag, gets the 304 a long-running agent gets, and waits out the same backoff instead of fetching
the state afresh and applying it at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import VerifiedState
from meridian_node_agent.agent_side.supervision_record import RememberedRetry

__all__ = ["ApplyRetry"]

# What of a failure's text status.json and the record keep (the log line has it whole).
_ERROR_CHARS = 500


@dataclass
class ApplyRetry:
    """The failed state (its envelope, verified when it failed), its failures, and when the next attempt is due:
    ``retry_at`` on the agent's monotonic clock, ``failed_at`` on the wall clock, read together."""

    envelope: bytes
    generation: int
    payload_sha256: str
    failures: int
    retry_at: float  # on the agent's monotonic clock
    backoff_s: float
    failed_at: datetime
    error: str

    @classmethod
    def after_failure(
        cls,
        previous: ApplyRetry | None,
        envelope: bytes,
        verified: VerifiedState,
        error: str,
        *,
        backoff: Callable[[int], float],
        now: float,
        at: datetime,
    ) -> ApplyRetry:
        """The retry after an apply of ``verified`` failed with ``error``: one more failure when ``previous`` was
        the same state's, the first of a new count otherwise; due ``backoff(failures)`` seconds after ``now``."""
        same = previous is not None and previous.payload_sha256 == verified.payload_sha256
        failures = previous.failures + 1 if same and previous is not None else 1
        delay_s = backoff(failures)
        return cls(
            envelope=envelope,
            generation=verified.state.generation,
            payload_sha256=verified.payload_sha256,
            failures=failures,
            retry_at=now + delay_s,
            backoff_s=delay_s,
            failed_at=at,
            error=error[:_ERROR_CHARS],
        )

    @classmethod
    def resumed(
        cls,
        remembered: RememberedRetry,
        envelope: bytes,
        *,
        same_clock: bool,
        now: float,
        backoff: Callable[[int], float],
    ) -> ApplyRetry:
        """The retry an earlier run recorded, for the spooled ``envelope`` (the caller checked it is that state's).
        Same boot (``same_clock``): the attempt is due when it was, never later than the backoff allows now. Another
        boot: at once."""
        retry_at = min(remembered.retry_at, now + backoff(remembered.failures)) if same_clock else 0.0
        return replace(cls(envelope=envelope, **_shared(remembered)), retry_at=retry_at)

    def remembered(self, etag: str | None) -> RememberedRetry:
        """For the agent's record: this less the envelope, with the ETag the agent holds meanwhile."""
        return RememberedRetry(**_shared(self), etag=etag)

    def status(self, now: float) -> dict[str, Any]:
        """For status.json, ``now`` on the agent's monotonic clock: where the retry stands and when it comes."""
        left_s = max(0.0, self.retry_at - now)
        return {
            "state": "backing-off" if left_s > 0 else "retry-due",
            "generation": self.generation,
            "failures": self.failures,
            "backoff_seconds": self.backoff_s,
            "last_failed_at": format_rfc3339(self.failed_at),
            "next_attempt_in_seconds": round(left_s, 1),
            # From the failure, not from now: both clocks were read together when it failed, and a status
            # written later must name the same moment.
            "next_attempt_at": format_rfc3339(self.failed_at + timedelta(seconds=self.backoff_s)),
            "error": self.error,
        }


def _shared(retry: ApplyRetry | RememberedRetry) -> dict[str, Any]:
    """What an ``ApplyRetry`` and its ``RememberedRetry`` both hold, by field name: all but the envelope (the spool
    keeps it) and the ETag (the record's alone). Named once here, so a field added to both is carried both ways."""
    return {field.name: getattr(retry, field.name) for field in fields(ApplyRetry) if field.name != "envelope"}

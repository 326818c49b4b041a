"""The host side of applying a desired state: verify it again, then (at the end) record it as applied.

The agent already verified the envelope, but the apply side may run with more privilege than the agent
and must not trust it: every reconcile run starts by verifying the exact bytes it was handed against the
root-owned policy and the durable applied state, and finishes by recording the generation. Recording is
idempotent (the same generation with the same bytes is a no-op) and never moves backwards.

What this returns is split so no secret reaches a run's journal: the summary (``engines`` with ``env``
whole and only the *names* of ``secret_env``) is safe to print; ``secret_env`` values are only returned
when asked for (``secrets=True``), by a task the playbook runs with ``no_log``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import VerifiedState, verify_desired_state

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "DesiredStateOutcome",
    "EnvelopeInputError",
    "read_envelope",
    "reconcile_desired_state",
]

MAX_ENVELOPE_BYTES = 16 * 1024 * 1024


class EnvelopeInputError(MeridianError, ValueError):
    """The envelope file is missing, unreadable or too large."""


@dataclass(frozen=True)
class DesiredStateOutcome:
    changed: bool
    result: dict[str, Any]


def read_envelope(path: str) -> bytes:
    """The envelope bytes, exactly as stored (verification must see what was signed).

    ``path`` is the playbook's ``envelope`` option, so a symlink is followed; what it holds is verified.
    """
    try:
        return read_capped(path, MAX_ENVELOPE_BYTES, what="the desired-state envelope", nofollow=False)
    except CappedReadError as exc:
        raise EnvelopeInputError(str(exc)) from exc


def reconcile_desired_state(
    envelope: bytes,
    *,
    policy_path: str,
    node_id: str,
    state_dir: str | os.PathLike[str],
    record: bool,
    check_mode: bool,
    secrets: bool = False,
    now: datetime | None = None,
) -> DesiredStateOutcome:
    """Verify ``envelope`` for ``node_id``; with ``record``, record its generation as applied.

    Raises ``trust.Rejection`` (with its code) when the state must not be applied, ``PolicyError`` for a
    bad policy and ``StateStoreError`` for a damaged applied-state file. ``changed`` is true only when
    recording moved the applied generation (or would, in check mode).
    """
    policy = load_policy(policy_path)
    store = StateStore(state_dir)
    applied = store.load()
    verified = verify_desired_state(envelope, policy, node_id=node_id, now=now or datetime.now(UTC), applied=applied)
    changed = record and not verified.already_applied
    if changed and not check_mode:
        state = verified.state
        store.record_applied(state.generation, state.lease_epoch, verified.payload_sha256)
    result = summarize(verified, applied_before=applied.generation)
    result["recorded"] = changed and not check_mode
    if secrets:
        result["engine_secret_env"] = {engine.name: dict(engine.secret_env) for engine in verified.state.engines}
    return DesiredStateOutcome(changed=changed, result=result)


def summarize(verified: VerifiedState, *, applied_before: int) -> dict[str, Any]:
    """What the playbook needs from the verified state, without any secret_env value (env is shown whole)."""
    state = verified.state
    artifacts = []
    for artifact in state.artifacts:
        entry: dict[str, Any] = {
            "name": artifact.name,
            "version": artifact.version,
            "manifest": artifact.manifest.model_dump(mode="json"),
            "pin": artifact.pin,
        }
        if artifact.source is not None:
            entry["source"] = artifact.source
        artifacts.append(entry)
    engines = []
    for engine in state.engines:
        spec = engine.model_dump(mode="json", exclude={"secret_env"}, exclude_none=True)
        spec["secret_env_keys"] = sorted(engine.secret_env)
        engines.append(spec)
    in_use = sorted({engine.model.artifact for engine in state.engines if engine.model.artifact})
    return {
        "node_id": state.node_id,
        "generation": state.generation,
        "lease_epoch": state.lease_epoch,
        "expires_at": contracts.format_rfc3339(state.expires_at),
        "payload_sha256": verified.payload_sha256,
        "signers": list(verified.signers),
        "already_applied": verified.already_applied,
        "applied_generation_before": applied_before,
        "artifacts": artifacts,
        "engines": engines,
        "in_use": in_use,
        "cordon": None if state.cordon is None else state.cordon.model_dump(mode="json"),
    }

"""``meridian.node.engine_set``'s whole run from its parameters, around the set that ``engines.set`` converges.

The engines come as a list, or as a signed desired state (``envelope``). A state is verified here, once, with
``trust.desired_state.reconcile_desired_state`` (this side never trusts the agent); every artifact it lists
must already be in the store as signed (``_check_artifacts``, with the store's own check handed in:
``artifacts.held``); with ``record`` its generation is recorded as accepted before any engine changes and as
applied once every engine converged, as that verification accepted it.

``secret_env`` values never leave: nothing puts one in a result (diffs show ``<secret>``, the config hash
covers a digest of each), and a value long enough to tell apart is masked in every string of the result as
a second line, for text from outside such as Docker's error messages. ``env`` values are shown whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_POLICY, DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import MIN_SCRUBBED_CHARS
from ansible_collections.meridian.node.plugins.module_utils.engines.set import EngineSetError, SetOptions, converge_set

__all__ = ["MASK", "HeldCheck", "run_engine_set"]

MASK = "********"


class HeldCheck(Protocol):
    """``artifacts.held.held_problems``, handed in by the module's outcome: engines/ never reaches into the store
    (docs/ARCHITECTURE.md, the import rules)."""

    def __call__(
        self, artifacts: Sequence[Mapping[str, Any]], *, policy_path: str, store_path: str | None
    ) -> list[str]:
        """The problems with the store's copy of a state's artifacts; empty when it holds them all."""


def run_engine_set(
    params: Mapping[str, Any],
    *,
    check_mode: bool,
    held_artifacts: HeldCheck,
    engine: DockerEngine | None = None,
    gpu_facts: Callable[[], Mapping[str, Any]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """The module's whole run from its parameters; raises ``EngineSetError`` with the module's failure.
    ``wall`` is the clock the image prune's grace counts on (it spans runs: seconds since the epoch)."""
    envelope_path = params.get("envelope")
    if params.get("record") and not envelope_path:
        raise EngineSetError("record: true needs envelope (and node_id): only a signed desired state is recorded")
    parallel = int(params.get("parallel") or 0)
    if parallel < 1:
        raise EngineSetError(f"parallel must be at least 1, got {params.get('parallel')!r}")
    owner = params.get("owner") or None
    prune = params.get("prune")
    verified: dict[str, Any] | None = None
    envelope: bytes | None = None
    if envelope_path:
        envelope, verified = _verify(params, check_mode=check_mode)
        store_warnings = _check_artifacts(verified, params, held_artifacts, check_mode=check_mode)
        if params.get("record") and not check_mode and not verified["already_applied"]:
            # Accepted before any engine changes: an apply cut short from here on still moves the floor.
            _record(verified, params, accepted=True)
        owner = owner or f"agent:{params['node_id']}"
        prune = True if prune is None else prune
        specs = _envelope_engines(verified)
        reason = f"generation {verified['generation']} no longer lists it"
    else:
        store_warnings = []
        specs = [dict(spec) for spec in params.get("engines") or []]
        reason = f"the engine set of owner {owner!r} no longer lists it"
    if prune and not owner:
        raise EngineSetError("prune: true needs owner: only the engines of one owner are ever pruned")
    options = SetOptions(
        owner=owner,
        prune=bool(prune),
        wait_ready=bool(params.get("wait_ready", True)),
        parallel=parallel,
        ready_timeout_s=_number(params.get("ready_timeout"), 600),
        drain_timeout_s=_number(params.get("drain_timeout"), 300),
        drain_grace_s=_number(params.get("drain_grace"), 10),
        drain_settle_s=_number(params.get("drain_settle"), 0),
        replace_beside=bool(params.get("replace_beside", False)),
        policy_path=str(params.get("policy") or DEFAULT_POLICY),
        state_dir=str(params.get("state_dir") or DEFAULT_STATE_DIR),
        store_path=params.get("store_path"),
        progress_file=params.get("progress_file"),
        pull=str(params.get("pull") or "missing"),
        prune_reason=reason,
        prune_loaded=verified is not None,
        cordon=verified.get("cordon") if verified is not None else params.get("cordon"),
    )
    secrets = [
        str(value)
        for spec in specs
        for value in (spec.get("secret_env") or {}).values()
        # Shorter ones are not masked by content: replacing "1" or "t" in every string would mangle engine names,
        # hashes and digests. A readiness failure's log tail has them taken out after their NAME= already.
        if len(str(value)) >= MIN_SCRUBBED_CHARS
    ]
    own_engine = engine is None
    try:
        if engine is None:
            try:
                engine = DockerEngine.from_env()
            except DockerEngineError as exc:
                raise EngineSetError(str(exc), result={"check": "docker"}) from exc
        try:
            result = converge_set(
                specs,
                options,
                check_mode=check_mode,
                engine=engine,
                gpu_facts=gpu_facts,
                sleep=sleep,
                clock=clock,
                wall=wall,
            )
        except EngineSetError as exc:
            if verified is not None:
                exc.result.update(generation=verified["generation"], recorded=False)
            raise _masked_error(exc, secrets) from None
        if verified is not None and envelope is not None:
            result["generation"] = verified["generation"]
            result["recorded"] = False
            if params.get("record") and not verified["already_applied"]:
                if check_mode:
                    result["changed"] = True  # it would record
                else:
                    try:
                        result["recorded"] = _record(verified, params)
                    except EngineSetError as exc:
                        exc.result.update(result, generation=verified["generation"], recorded=False)
                        raise _masked_error(exc, secrets) from None
                    result["changed"] = result["changed"] or result["recorded"]
        if store_warnings:
            result["warnings"] = [*store_warnings, *result.get("warnings", [])]
        masked: dict[str, Any] = _mask(result, secrets)
        return masked
    finally:
        if own_engine and engine is not None:
            engine.close()


def _number(value: Any, default: float) -> float:
    return default if value is None else float(value)


def _verify(params: Mapping[str, Any], *, check_mode: bool) -> tuple[bytes, dict[str, Any]]:
    """The envelope's bytes and its verified summary with the engines' secret_env values.

    Imported here: pydantic and cryptography are needed only for an envelope, never for a list of engines.
    """
    from ansible_collections.meridian.node.plugins.module_utils.trust.verify import missing_libraries

    for package, error in missing_libraries():
        raise EngineSetError(f"{package} is needed to verify an envelope", missing_library=(package, error))
    from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStoreError
    from ansible_collections.meridian.node.plugins.module_utils.trust.desired_state import (
        EnvelopeInputError,
        read_envelope,
        reconcile_desired_state,
    )
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError
    from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection

    path = str(params["envelope"])
    try:
        data = read_envelope(path)
        outcome = reconcile_desired_state(
            data,
            policy_path=str(params.get("policy") or DEFAULT_POLICY),
            node_id=str(params["node_id"]),
            state_dir=str(params.get("state_dir") or DEFAULT_STATE_DIR),
            record=False,
            check_mode=check_mode,
            secrets=True,
        )
    except Rejection as exc:
        raise EngineSetError(
            f"Error verifying desired state {path}: {exc}",
            result={"rejection": exc.code.value, "check": "envelope"},
        ) from None
    except (PolicyError, StateStoreError, EnvelopeInputError) as exc:
        raise EngineSetError(f"Error verifying desired state {path}: {exc}", result={"check": "envelope"}) from None
    return data, outcome.result


def _record(verified: Mapping[str, Any], params: Mapping[str, Any], *, accepted: bool = False) -> bool:
    """Record the generation as applied (or, with ``accepted``, as accepted before its engines change), as the
    verification at the start of this run accepted it.

    Not verified a second time: that verification decides (a state that expires, or whose epoch is overtaken,
    while its engines converge was still the state to apply when the run began), and verifying again cost as
    much as the first time. ``StateStore`` still refuses, under its lock, a generation below the recorded or
    accepted one or either with other bytes, so a newer apply that recorded meanwhile is never undone.
    """
    from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError

    store = StateStore(str(params.get("state_dir") or DEFAULT_STATE_DIR))
    record = store.record_accepted if accepted else store.record_applied
    try:
        record(int(verified["generation"]), int(verified["lease_epoch"]), str(verified["payload_sha256"]))
    except (StateStoreError, ValueError) as exc:
        if accepted:
            raise EngineSetError(
                f"recording desired state {params['envelope']} as accepted failed, so nothing was changed: {exc}",
                result={"check": "record", "generation": verified["generation"], "recorded": False},
            ) from None
        raise EngineSetError(
            f"every engine converged, but recording desired state {params['envelope']} failed: {exc}",
            result={"check": "record"},
        ) from None
    return True


def _check_artifacts(
    verified: Mapping[str, Any], params: Mapping[str, Any], held: HeldCheck, *, check_mode: bool
) -> list[str]:
    """Refuse a state that lists an artifact the store does not hold as its signed manifest says; the warnings.

    The reconcile playbook makes the artifacts present in a step before this one, and skips that step when its
    caller says the state lists none (``meridian_state_artifacts``). The caller is not trusted: ``held``
    (``artifacts.held.held_problems``) checks each listed artifact is recorded in the store with the manifest's
    files, intact, and is the promoted version, or nothing changes. In check mode the artifact step only
    planned, so a missing artifact is a warning.
    """
    artifacts = verified.get("artifacts") or []
    if not artifacts:
        return []
    generation = verified["generation"]
    problems = held(
        artifacts, policy_path=str(params.get("policy") or DEFAULT_POLICY), store_path=params.get("store_path")
    )
    if not problems:
        return []
    why = (
        f"generation {generation} lists artifacts the store does not hold as signed: {'; '.join(problems)}. "
        "The reconcile playbook's artifact step (meridian.node.verified_artifact) makes them present, and is "
        "skipped when the caller says the state lists none (meridian_state_artifacts: false)"
    )
    if check_mode:
        return [f"{why}; a real run would fail here"]
    raise EngineSetError(
        f"nothing was changed: {why}; run the apply again with that step (meridian_state_artifacts unset or true)",
        result={"check": "artifact", "generation": generation, "recorded": False, "engines": {}, "pruned": []},
    )


def _envelope_engines(verified: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The verified state's engines as engine parameters, secret_env values put back in."""
    secret_env = verified.get("engine_secret_env") or {}
    specs = []
    for summary in verified.get("engines") or []:
        spec = {key: value for key, value in summary.items() if key != "secret_env_keys"}
        spec["secret_env"] = dict(secret_env.get(summary["name"]) or {})
        specs.append(spec)
    return specs


def _mask(value: Any, secrets: Sequence[str]) -> Any:
    """``value`` with every secret replaced by ``MASK`` wherever it appears in a string (keys included)."""
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in sorted(secrets, key=len, reverse=True):
            value = value.replace(secret, MASK)
        return value
    if isinstance(value, Mapping):
        return {_mask(key, secrets): _mask(item, secrets) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask(item, secrets) for item in value]
    return value


def _masked_error(exc: EngineSetError, secrets: Sequence[str]) -> EngineSetError:
    return EngineSetError(_mask(str(exc), secrets), result=_mask(exc.result, secrets))

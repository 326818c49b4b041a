"""``meridian-node apply-spooled``: the root side of the privilege split, run by ``meridian-node-apply.service``.

It reads the request the unprivileged agent spooled (see ``apply_unit``) and trusts it only as input:
the node id, policy, state dir and mode come from the root-owned config, the envelope is verified again
against the root-owned policy before ansible-runner starts, and the playbook verifies it once more. Then
it runs the same ``Applier`` the agent runs in-process (same journal, same playbook), without touching the
agent's oplog, and writes the answer where the agent waits for it.

Before each answer (and when it starts with nothing to answer) it rewrites ``<state_dir>/engines.json``
(``engine_inventory``): the agent has no Docker access, and observes its engines from that file.

systemd's ``PathChanged=`` does not queue: a request written while this runs starts nothing. So after each
answer the spool is read again, and a newer request is answered in the same run.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.policy import PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.state_store import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust import Rejection, verify_desired_state
from meridian_node_agent.apply import Applier
from meridian_node_agent.apply_unit import (
    SPOOL_DIR,
    ApplyAnswer,
    ApplyRequest,
    SpoolError,
    read_answer,
    read_request,
    write_answer,
)
from meridian_node_agent.config import AgentConfig, ConfigError, load_config
from meridian_node_agent.engine_inventory import collect_inventory, write_inventory
from meridian_node_agent.usage import UsageError

__all__ = ["VERB", "add_parsers", "answer_one", "answer_requests", "cmd_apply_spooled", "refresh_inventory"]

VERB = "apply-spooled"
_GENERATION = re.compile(r"^gen-([0-9]+)-")


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        VERB,
        help="(root) apply the request the agent spooled; run by meridian-node-apply.service",
        description="Read <state_dir>/spool/apply-request.json, verify its envelope again against the policy "
        "named in --config, run the reconcile playbook through ansible-runner and write "
        "<state_dir>/spool/apply-result.json for the agent, after <state_dir>/engines.json (the engines the "
        "agent observes without Docker access). Exit 0 when every request answered was applied "
        "(or there was none), 1 when one was refused or failed.",
    )
    verb.set_defaults(handler=cmd_apply_spooled)


def cmd_apply_spooled(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    try:
        answers = answer_requests(config)
    except SpoolError as exc:
        print(f"error: {exc}; nothing was applied", file=sys.stderr)
        _report_inventory(refresh_inventory(config, clock=lambda: datetime.now(UTC)))
        return 1
    if not answers:
        print(f"no new request in {Path(config.state_dir) / SPOOL_DIR}; nothing to apply")
    for answer in answers:
        tail = f"; {'; '.join(answer.failures)}" if answer.failures else ""
        print(
            f"request {answer.request}: generation {answer.generation} {answer.status} "
            f"(changed {answer.changed}, failed {answer.failed}) in {answer.wall_seconds:.2f} s{tail}"
        )
    return 0 if all(answer.status == "successful" for answer in answers) else 1


def answer_requests(config: AgentConfig, *, clock: Callable[[], datetime] | None = None) -> list[ApplyAnswer]:
    """Answer the spooled request, and any newer one written meanwhile; each request at most once."""
    spool = Path(config.state_dir) / SPOOL_DIR
    answered: list[ApplyAnswer] = []
    now = clock or (lambda: datetime.now(UTC))
    while True:
        request = read_request(spool)
        if request is None or any(a.request == request.request for a in answered):
            break
        try:
            previous = read_answer(spool)
        except SpoolError:
            previous = None  # ours to overwrite; the agent skips a damaged answer too
        if previous is not None and previous.request == request.request:
            break
        try:
            answer = answer_one(config, request, clock=now)
        except Exception as exc:  # answered as failed, then raised: the agent must not wait its whole timeout
            answer = _failed(config, request.request, now(), now, f"the root apply unit failed: {exc!r}")
            _report_inventory(refresh_inventory(config, clock=now))
            write_answer(spool, answer)
            raise
        # Before the answer: the agent observes right after it, and must see what this run changed. Also
        # after a failed run, which may have created or removed containers.
        _report_inventory(refresh_inventory(config, clock=now))
        write_answer(spool, answer)
        answered.append(answer)
    if not answered:  # started with nothing to apply: the engines may have changed since the last run
        _report_inventory(refresh_inventory(config, clock=now))
    return answered


def refresh_inventory(
    config: AgentConfig, *, clock: Callable[[], datetime], connect: Callable[[], Any] | None = None
) -> str | None:
    """Rewrite ``<state_dir>/engines.json`` from what Docker lists now; None, or why it could not. The
    previous file then stays: the agent still probes each engine in it, so one that is gone is not ready."""
    from ansible_collections.meridian.node.plugins.module_utils.docker_engine import DockerEngine, DockerEngineError

    if connect is None:

        def connect() -> Any:
            return DockerEngine.from_env(timeout=30)

    state_dir = Path(config.state_dir)
    try:
        inventory = collect_inventory(
            connect,
            node_id=config.node_id,
            policy_path=config.policy,
            state_dir=str(state_dir),
            written_at=format_rfc3339(clock()),
        )
        write_inventory(state_dir, inventory)
    # PolicyError and DrainStateError are ValueErrors. The answer matters more than the inventory: none of
    # these may keep the answer from the agent.
    except (DockerEngineError, OSError, ValueError) as exc:
        return f"could not write {state_dir / 'engines.json'}: {exc}; the agent keeps observing the previous one"
    return None


def _report_inventory(problem: str | None) -> None:
    if problem is not None:
        print(f"warning: {problem}", file=sys.stderr)


def answer_one(config: AgentConfig, request: ApplyRequest, *, clock: Callable[[], datetime]) -> ApplyAnswer:
    """Verify the request's envelope as root sees it, then run the reconcile playbook for it."""
    state_dir = Path(config.state_dir)
    ident = request.request
    started = clock()

    def refuse(reason: str) -> ApplyAnswer:
        return _failed(
            config, ident, started, clock, f"the root apply unit refused request {ident}: {reason}; nothing was applied"
        )

    if config.mode == "observe-only":
        return refuse("config mode is observe-only, which never applies")
    if config.apply.via != "systemd":
        return refuse(f"the config says apply.via: {config.apply.via}; the apply unit only serves apply.via: systemd")
    if (state_dir / "journal" / ident).exists() or (state_dir / "runs" / ident).exists():
        return refuse("an earlier attempt at it was interrupted (its journal exists); the agent applies it again")
    try:
        envelope = request.envelope_bytes()
        policy = load_policy(config.policy)
        refusal = policy.mode_allowed(config.mode)
        if refusal:
            return refuse(f"mode: {refusal}")
        verified = verify_desired_state(
            envelope, policy, node_id=config.node_id, now=clock(), applied=StateStore(state_dir).load()
        )
    except Rejection as exc:
        return refuse(f"the envelope is rejected ({exc.code.value}): {exc.message}")
    except (SpoolError, PolicyError, StateStoreError) as exc:
        return refuse(str(exc))
    state = verified.state
    if not ident.startswith(f"gen-{state.generation}-"):
        return refuse(f"the request names a run of another generation than the envelope's {state.generation}")
    applier = Applier(
        state_dir=state_dir,
        node_id=config.node_id,
        policy_path=config.policy,
        keep_runs=config.journal.keep_runs,
        clock=clock,
        write_oplog=False,
    )
    result = applier.apply(
        envelope,
        generation=state.generation,
        epoch=state.lease_epoch,
        payload_sha256=verified.payload_sha256,
        secrets=[value for engine in state.engines for value in engine.env.values()],
        ident=ident,
    )
    return ApplyAnswer.from_result(result, verified.payload_sha256)


def _failed(
    config: AgentConfig, ident: str, started: datetime, clock: Callable[[], datetime], message: str
) -> ApplyAnswer:
    match = _GENERATION.match(ident)
    return ApplyAnswer(
        request=ident,
        payload_sha256="",
        generation=int(match.group(1)) if match else 0,
        status="failed",
        rc=None,
        changed=0,
        failed=0,
        failures=[message],
        journal=str(Path(config.state_dir) / "journal" / ident),
        started_at=format_rfc3339(started),
        finished_at=format_rfc3339(clock()),
        wall_seconds=0.0,
    )

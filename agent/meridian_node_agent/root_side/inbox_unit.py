"""``meridian-node airgap-inbox``: the air-gapped inbox under the privilege split, run by root's
``meridian-node-airgap.service`` (started by ``meridian-node-airgap.path``), and the one file it hands the agent.

Runs on: the root side (``cmd_airgap_inbox``, ``check_root_inbox``, ``publish_outcomes``); the agent side
reads what root published (``read_outcomes``). docs/AIR_GAP.md, "The inbox: who reads it under the privilege
split", is the design.

Root takes the bundles with the same loop code as in-process (``apply.inbox.InboxProcessor``), with its own
record (``apply.state_dir/applied.json``) deciding replay, under ``apply.lock`` (the observe unit does not
rewrite ``engines.json`` meanwhile) and only after checking the inbox and every directory above it: real
(no symlink on the way), root's, writable by no user but root and an operators' group that is not the
agent's, and outside the agent's directory. The agent's user can then neither write, rename nor substitute
anything there; its own files in the inbox are refused (``apply.inbox.untrusted_entry``).

Each bundle's outcome crosses back as ``<apply.state_dir>/public/airgap-outcomes.json`` (0640, the agent's
group), the last ``MAX_OUTCOMES`` with a sequence number root advances, plus root's record. The agent parses
it strictly (``parse_outcomes``: unknown fields, wrong types, another node, oversize: the whole file is
refused) and turns each new outcome with a run into the outbox's journal record, as in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils._lockfile import LOCK_WAIT_S, LockTimeout
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError, load_policy
from meridian_node_agent.boundary.directories import BoundaryError, check_root_inbox
from meridian_node_agent.boundary.outcomes import (
    MAX_OUTCOMES,
    OUTCOMES_FILE,
    OUTCOMES_MODE,
    OutcomesError,
    RootAccepted,
    RootApplied,
    RootOutcome,
    RootOutcomes,
    RootRun,
    read_outcomes,
)
from meridian_node_agent.root_side.root_dir import RootDir, apply_lock

__all__ = [
    "VERB",
    "add_parsers",
    "cmd_airgap_inbox",
    "publish_outcomes",
    "take_bundles",
]

VERB = "airgap-inbox"
# Passes per run: each takes what arrived meanwhile (PathExistsGlob= does not fire again while this runs).
# A bundle still being written under its final name is waited for between passes (``wait``), so the unit
# does not end and get started again at once, re-reading the growing file in a tight loop; after this many
# passes the run ends anyway, and the path unit starts the next one while the file is still there.
_MAX_PASSES = 20


def publish_outcomes(root: RootDir, *, node_id: str, outcomes: Sequence[Any], now: datetime) -> RootOutcomes:
    """Append ``outcomes`` (``apply.inbox.BundleOutcome``, none still in the inbox) to root's file, each with
    the next sequence number, keeping the last ``MAX_OUTCOMES``; rewritten atomically with root's record."""
    previous = read_outcomes(root.public, node_id=node_id)
    kept = list(previous.outcomes) if previous is not None else []
    sequence = kept[-1].sequence if kept else 0
    for outcome in outcomes:
        sequence += 1
        kept.append(_outcome(sequence, outcome, now))
    applied = StateStore(root.path).load()
    document = RootOutcomes(
        format=1,
        node_id=node_id,
        written_at=format_rfc3339(now),
        applied=RootApplied(
            generation=applied.generation,
            epoch=applied.epoch,
            accepted=None
            if applied.accepted is None
            else RootAccepted(generation=applied.accepted.generation, epoch=applied.accepted.epoch),
        ),
        outcomes=kept[-MAX_OUTCOMES:],
    )
    data = document.model_dump_json(indent=1).encode("utf-8") + b"\n"
    atomic_write(root.public / OUTCOMES_FILE, data, mode=OUTCOMES_MODE, group=root.group)
    return document


def _outcome(sequence: int, outcome: Any, now: datetime) -> RootOutcome:
    run = outcome.run
    return RootOutcome(
        sequence=sequence,
        name=outcome.name[:255],
        result=outcome.result.value,
        reason=None if outcome.reason is None else outcome.reason[:64],
        message=None if outcome.message is None else outcome.message[:4096],
        member=None if outcome.member is None else outcome.member[:4096],
        bundle_id=outcome.bundle_id,
        generation=outcome.generation,
        at=format_rfc3339(now),
        run=None
        if run is None
        else RootRun(
            ident=run.ident,
            generation=run.generation,
            status=run.status if run.status in ("successful", "failed", "canceled", "timeout") else "failed",
            changed=run.changed,
            failed=run.failed,
            failures=[failure[:4096] for failure in run.failures[:5]],
            started_at=format_rfc3339(run.started_at),
            finished_at=format_rfc3339(run.finished_at),
        ),
    )


# --- the verb ----------------------------------------------------------------------------------------------


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        VERB,
        help="(root) take the bundles in the air-gap inbox; run by meridian-node-airgap.service",
        description="Under apply.via: systemd in mode air-gapped: check air_gap.inbox and every directory above "
        "it, take each complete bundle there (verify, stage its artifacts, apply it with root's record in "
        "<apply.state_dir> deciding replay), file it in processed/ or rejected/ with a reason file, and publish "
        "each outcome in <apply.state_dir>/public/airgap-outcomes.json for the agent, after "
        "public/engines.json. Exit 0 when every bundle taken was applied or already applied (or there was "
        "none), 1 when one was rejected or failed, or when nothing could be taken.",
    )
    verb.add_argument(
        "--once",
        action="store_true",
        help="take what is in the inbox now and exit (what the unit runs; the only mode there is)",
    )
    verb.set_defaults(handler=cmd_airgap_inbox)


def cmd_airgap_inbox(args: argparse.Namespace) -> int:
    from meridian_node_agent.root_side.apply_unit import open_root_side

    nothing = "no bundle was taken"
    opened = open_root_side(args.config, unit="air-gap inbox unit", nothing_done=nothing)
    if opened is None:
        return 1
    config, root = opened
    if config.mode != "air-gapped" or config.air_gap is None:
        why = f"config {args.config} says mode {config.mode}; the inbox unit serves mode air-gapped"
        print(f"error: {why}; {nothing}", file=sys.stderr)
        return 1
    try:
        policy = load_policy(config.policy)
    except PolicyError as exc:
        print(f"error: {exc}; {nothing}", file=sys.stderr)
        return 1
    refusal = policy.mode_allowed(config.mode)
    if refusal:
        print(f"error: mode: {refusal}; {nothing}", file=sys.stderr)
        return 1
    agent_dir = Path(config.state_dir)
    agent = _owner(agent_dir)
    try:
        inbox = check_root_inbox(Path(config.air_gap.inbox), agent_dir=agent_dir, agent_gid=agent[1])
    except BoundaryError as exc:
        print(f"error: {exc}; {nothing}", file=sys.stderr)
        return 1
    from meridian_node_agent.boundary.watch import watch_directory

    try:
        with apply_lock(root, wait=True), watch_directory(Path(config.air_gap.inbox)) as watch:
            outcomes = take_bundles(
                config,
                root,
                policy,
                untrusted_uid=agent[0],
                file_group=inbox.st_gid,
                wait=watch.wait,
                lock_wait_s=LOCK_WAIT_S,
            )
    except LockTimeout as exc:
        # Busy is not "empty": a bundle may be waiting, and the run must fail so that someone looks.
        print(f"error: inbox-busy: {exc}; bundles stay in {config.air_gap.inbox} for the next run", file=sys.stderr)
        return 1
    except (OSError, StateStoreError, OutcomesError) as exc:
        # Bundles filed before the error keep their reason files in processed/ or rejected/.
        print(
            f"error: {type(exc).__name__}: {exc}; bundles not yet filed stay in the inbox for the next run "
            f"(a damaged {OUTCOMES_FILE} is never rewritten over: move it aside and it is written afresh)",
            file=sys.stderr,
        )
        return 1
    if not outcomes:
        print(f"no bundle in {config.air_gap.inbox}; nothing to take")
    for outcome in outcomes:
        why = f" ({outcome.reason}: {outcome.message})" if outcome.reason else ""
        print(f"bundle {outcome.name}: {outcome.result.value}{why}")
    return 0 if all(o.result.value in ("applied", "already-applied", "left-in-inbox") for o in outcomes) else 1


def _owner(agent_dir: Path) -> tuple[int | None, int | None]:
    """(uid, gid) of the agent's directory: whose files the inbox refuses, and the group that may not write it.
    Both None while it does not exist (the agent never started); the inbox checks still refuse an inbox that
    others may write."""
    with contextlib.suppress(FileNotFoundError):
        info = agent_dir.lstat()
        return info.st_uid, info.st_gid
    return None, None


def take_bundles(
    config: Any,
    root: RootDir,
    policy: Any,
    *,
    untrusted_uid: int | None,
    file_group: int = -1,
    clock: Callable[[], datetime] | None = None,
    applier: Callable[..., Any] | None = None,
    wait: Callable[[float], None] | None = None,
    lock_wait_s: float = LOCK_WAIT_S,
) -> list[Any]:
    """Passes over the inbox with root's record until one takes nothing new; after each that took a bundle,
    ``engines.json`` then the outcomes are published (the agent observes right after it reads an outcome).
    A pass that only left a bundle still being written waits (``wait``: inotify on the inbox, at most
    ``air_gap.poll_seconds``) and looks again; without ``wait`` the run ends there. The inbox lock held by
    another process for longer than ``lock_wait_s`` seconds raises ``_lockfile.LockTimeout`` (``inbox-busy``)."""
    from meridian_node_agent.apply.inbox import BundleResult, InboxProcessor, close_interrupted
    from meridian_node_agent.logs import EventLogger
    from meridian_node_agent.root_side.apply_unit import refresh_inventory

    now = clock or (lambda: datetime.now(UTC))
    log = EventLogger()
    close_interrupted(root.path, log)
    processor = InboxProcessor(
        inbox=Path(config.air_gap.inbox),
        policy=policy,
        node_id=config.node_id,
        record_dir=root.path,
        keep_runs=config.journal.keep_runs,
        clock=now,
        log=log,
        applier=applier,
        untrusted_uid=untrusted_uid,
        file_group=file_group,
    )
    taken: list[Any] = []
    for _ in range(_MAX_PASSES):
        outcomes = processor.process_once(lock_wait_s=lock_wait_s)
        taken.extend(outcomes)
        filed = [outcome for outcome in outcomes if outcome.result != BundleResult.LEFT]
        if not filed:
            if not outcomes or wait is None:
                break
            wait(config.air_gap.poll_seconds)  # only bundles still being written: give the writer time
            continue
        problem = refresh_inventory(config, root, clock=now)
        if problem is not None:
            print(f"warning: {problem}", file=sys.stderr)
        publish_outcomes(root, node_id=config.node_id, outcomes=filed, now=now())
    if (
        not any(outcome.result != BundleResult.LEFT for outcome in taken)
        and read_outcomes(root.public, node_id=config.node_id) is None
    ):
        # The agent waits for this file to learn root's record: write it once even with nothing taken.
        publish_outcomes(root, node_id=config.node_id, outcomes=[], now=now())
    return taken

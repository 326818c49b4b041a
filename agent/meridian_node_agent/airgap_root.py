"""``meridian-node airgap-inbox``: the air-gapped inbox under the privilege split, run by root's
``meridian-node-airgap.service`` (started by ``meridian-node-airgap.path``), and the one file it hands the agent.

Runs on: the root side (``cmd_airgap_inbox``, ``check_root_inbox``, ``publish_outcomes``); the agent side
reads what root published (``read_outcomes``). docs/AIR_GAP.md, "The inbox: who reads it under the privilege
split", is the design.

Root takes the bundles with the same loop code as in-process (``airgap_inbox.InboxProcessor``), with its own
record (``apply.state_dir/applied.json``) deciding replay, under ``apply.lock`` (the observe unit does not
rewrite ``engines.json`` meanwhile) and only after checking the inbox and every directory above it: real
(no symlink on the way), root's, writable by no user but root and an operators' group that is not the
agent's, and outside the agent's directory. The agent's user can then neither write, rename nor substitute
anything there; its own files in the inbox are refused (``airgap_inbox.untrusted_entry``).

Each bundle's outcome crosses back as ``<apply.state_dir>/public/airgap-outcomes.json`` (0640, the agent's
group), the last ``MAX_OUTCOMES`` with a sequence number root advances, plus root's record. The agent parses
it strictly (``parse_outcomes``: unknown fields, wrong types, another node, oversize: the whole file is
refused) and turns each new outcome with a run into the outbox's journal record, as in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    NodeId,
    describe_validation_error,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.lockfile import LOCK_WAIT_SECONDS, LockTimeout
from ansible_collections.meridian.node.plugins.module_utils.policy import PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.state_store import StateStore, StateStoreError
from meridian_node_agent.apply_root import BoundaryError, RootDir, apply_lock

__all__ = [
    "MAX_OUTCOMES",
    "MAX_OUTCOMES_BYTES",
    "OUTCOMES_FILE",
    "VERB",
    "OutcomesError",
    "RootAccepted",
    "RootOutcome",
    "RootOutcomes",
    "add_parsers",
    "check_root_inbox",
    "cmd_airgap_inbox",
    "parse_outcomes",
    "publish_outcomes",
    "read_outcomes",
    "take_bundles",
]

VERB = "airgap-inbox"
OUTCOMES_FILE = "airgap-outcomes.json"
OUTCOMES_MODE = 0o640
# The agent journals each outcome once it has read it; a file of the last hundred covers a long absence
# of the agent (it was stopped while many bundles arrived) and stays a few hundred kilobytes at most.
MAX_OUTCOMES = 100
MAX_OUTCOMES_BYTES = 1024 * 1024
# Passes per run: each takes what arrived meanwhile (PathExistsGlob= does not fire again while this runs).
# A bundle still being written under its final name is waited for between passes (``wait``), so the unit
# does not end and get started again at once, re-reading the growing file in a tight loop; after this many
# passes the run ends anyway, and the path unit starts the next one while the file is still there.
_MAX_PASSES = 20

_Text = Annotated[str, Field(max_length=4096)]


class OutcomesError(ValueError):
    """``airgap-outcomes.json`` is unusable; the message names the file, the field and what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RootRun(_Strict):
    ident: Annotated[str, Field(pattern=r"^gen-[0-9]{1,19}-[0-9]{8}T[0-9]{6}\.[0-9]{6}Z$")]
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)]
    status: Literal["successful", "failed", "canceled", "timeout"]
    changed: Annotated[int, Field(ge=0)]
    failed: Annotated[int, Field(ge=0)]
    failures: Annotated[list[_Text], Field(max_length=5)]
    started_at: Annotated[str, Field(max_length=64)]
    finished_at: Annotated[str, Field(max_length=64)]


class RootOutcome(_Strict):
    sequence: Annotated[int, Field(ge=1, le=2**63 - 1)]
    name: Annotated[str, Field(min_length=1, max_length=255)]
    result: Literal["applied", "already-applied", "apply-failed", "rejected"]
    reason: Annotated[str, Field(max_length=64)] | None
    message: _Text | None
    member: _Text | None
    bundle_id: Annotated[str, Field(max_length=255)] | None
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)] | None
    at: Annotated[str, Field(max_length=64)]
    run: RootRun | None


class RootAccepted(_Strict):
    """The generation root accepted (its apply started) and has not recorded applied: failed, cut short or
    still running. Nothing below it is applied any more."""

    generation: Annotated[int, Field(ge=1, le=2**63 - 1)]
    epoch: Annotated[int, Field(ge=0, le=2**63 - 1)]


class RootApplied(_Strict):
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)]
    epoch: Annotated[int, Field(ge=0, le=2**63 - 1)]
    # Absent in files written before root recorded its decisions.
    accepted: RootAccepted | None = None


class RootOutcomes(_Strict):
    format: Literal[1]
    node_id: NodeId
    written_at: Annotated[str, Field(max_length=64)]
    applied: RootApplied
    outcomes: Annotated[list[RootOutcome], Field(max_length=MAX_OUTCOMES)]


def parse_outcomes(raw: bytes, *, path: Path, node_id: str) -> RootOutcomes:
    """The document in ``raw`` (read from ``path``), for ``node_id``; ``OutcomesError`` naming what is wrong."""
    try:
        document = RootOutcomes.model_validate_json(raw)
    except ValidationError as exc:
        raise OutcomesError(f"{path}: {describe_validation_error(exc)}") from exc
    if document.node_id != node_id:
        raise OutcomesError(f"{path} was written for node {document.node_id!r}, not this node {node_id!r}")
    accepted = document.applied.accepted
    if accepted is not None and accepted.generation <= document.applied.generation:
        raise OutcomesError(
            f"{path}: applied.accepted.generation {accepted.generation} must be above applied.generation "
            f"{document.applied.generation} (root lists only a generation accepted and not yet applied)"
        )
    sequences = [outcome.sequence for outcome in document.outcomes]
    if sequences != sorted(set(sequences)):
        raise OutcomesError(f"{path}: the outcomes' sequence numbers must increase strictly, got {sequences}")
    return document


def read_outcomes(public: Path, *, node_id: str) -> RootOutcomes | None:
    """``public/airgap-outcomes.json`` (agent side, and root reading its own), or None when there is none yet."""
    path = Path(public) / OUTCOMES_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutcomesError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OutcomesError(f"{path} is not a regular file")
        raw = handle.read(MAX_OUTCOMES_BYTES + 1)
    if len(raw) > MAX_OUTCOMES_BYTES:
        raise OutcomesError(f"{path} is larger than {MAX_OUTCOMES_BYTES} bytes; root never writes one that big")
    return parse_outcomes(raw, path=path, node_id=node_id)


def publish_outcomes(root: RootDir, *, node_id: str, outcomes: Sequence[Any], now: datetime) -> RootOutcomes:
    """Append ``outcomes`` (``airgap_inbox.BundleOutcome``, none still in the inbox) to root's file, each with
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


# --- root: the inbox and the directories above it ---------------------------------------------------------


def check_root_inbox(inbox: Path, *, agent_dir: Path, agent_gid: int | None) -> os.stat_result:
    """Check the inbox as root would use it; its ``lstat``, or ``BoundaryError`` naming the path and the fix.

    Every directory from ``/`` down must be a real directory owned by root (or the euid), writable by no one
    else (a sticky world-writable directory such as /tmp is allowed above the inbox: no one else can rename
    what root put there). The inbox itself may be group-writable for an operators' group, never for the
    agent's group, and it must not lie inside the agent's directory, whose owner can rename anything there.
    """
    inbox = Path(inbox).absolute()
    real = Path(os.path.realpath(inbox))
    if real != inbox:
        raise BoundaryError(f"refusing air_gap.inbox {inbox}: it resolves to {real}; name the real directory")
    agent_real = os.path.realpath(agent_dir)
    if os.path.commonpath([agent_real, str(real)]) in (agent_real, str(real)):
        raise BoundaryError(
            f"refusing air_gap.inbox {inbox}: it overlaps the agent's directory {agent_real}, whose owner can "
            "rename anything in it; give the inbox a root-owned directory of its own (default "
            "/var/lib/meridian-node-inbox)"
        )
    euid = os.geteuid()
    for ancestor in reversed(inbox.parents):
        _check_directory(ancestor, euid, group_ok=None, sticky_ok=True)
    return _check_directory(inbox, euid, group_ok=agent_gid, sticky_ok=False)


def _check_directory(path: Path, euid: int, *, group_ok: int | None, sticky_ok: bool) -> os.stat_result:
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise BoundaryError(
            f"refusing {path}: it does not exist; create the inbox as root (install -d -o root -g root -m 0700 "
            f"{path}, or -m 0770 with an operators' group that is not the agent's)"
        ) from None
    except OSError as exc:
        raise BoundaryError(f"cannot check {path}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise BoundaryError(f"refusing {path}: it is not a directory (symlinks are never followed here)")
    if info.st_uid not in (0, euid):
        raise BoundaryError(
            f"refusing {path}: it is owned by uid {info.st_uid}, who could swap the inbox's bundles; chown root {path}"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o002 and not (sticky_ok and mode & stat.S_ISVTX):
        raise BoundaryError(f"refusing {path}: mode {mode:04o} lets every user write in it; chmod o-w {path}")
    if mode & 0o020:
        if group_ok is None and not (sticky_ok and mode & stat.S_ISVTX):
            raise BoundaryError(
                f"refusing {path}: mode {mode:04o} lets group {info.st_gid} write above the inbox; chmod g-w {path}"
            )
        if group_ok is not None and info.st_gid == group_ok:
            raise BoundaryError(
                f"refusing {path}: it is writable by group {info.st_gid}, the agent's group, so the agent could "
                f"drop or replace bundles; chgrp it to an operators' group the agent's user is not in, or chmod g-w"
            )
    return info


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
    from meridian_node_agent.apply_cli import open_root_side

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
    from meridian_node_agent.apply_unit import watch_directory

    try:
        with apply_lock(root, wait=True), watch_directory(Path(config.air_gap.inbox)) as watch:
            outcomes = take_bundles(
                config,
                root,
                policy,
                untrusted_uid=agent[0],
                file_group=inbox.st_gid,
                wait=watch.wait,
                lock_wait=LOCK_WAIT_SECONDS,
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
    lock_wait: float = LOCK_WAIT_SECONDS,
) -> list[Any]:
    """Passes over the inbox with root's record until one takes nothing new; after each that took a bundle,
    ``engines.json`` then the outcomes are published (the agent observes right after it reads an outcome).
    A pass that only left a bundle still being written waits (``wait``: inotify on the inbox, at most
    ``air_gap.poll_seconds``) and looks again; without ``wait`` the run ends there. The inbox lock held by
    another process for longer than ``lock_wait`` seconds raises ``lockfile.LockTimeout`` (``inbox-busy``)."""
    from meridian_node_agent.airgap_inbox import BundleResult, InboxProcessor, close_interrupted
    from meridian_node_agent.apply_cli import refresh_inventory
    from meridian_node_agent.logs import EventLogger

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
        outcomes = processor.process_once(lock_wait=lock_wait)
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

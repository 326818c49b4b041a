"""``meridian-node apply-spooled``: the root side of the privilege split, run by ``meridian-node-apply.service``.

Runs on: the root side only.

It reads the one request the unprivileged agent spooled (``root_side.root_dir.read_request``) and trusts it only as
input: the node id, policy, directories and mode come from the root-owned config; the envelope is verified
again against the root-owned policy and **root's own record** (``<apply.state_dir>/applied.json``: highest
generation applied, highest epoch, payload sha) before ansible-runner starts, and the playbook verifies it
once more. Whatever the agent's files say, a generation below root's, the applied generation with other
bytes, or an epoch below root's highest is refused; the same generation with the same bytes is applied
again (that is how drift is repaired). Everything root writes stays in its own directory: the runs, the
journal, its own oplog, the record, the draining marks, the GPU health holds the request's ``gpu_reports`` add to
(``root_side.gpu_reports``: only ever added, after the envelope verified), and in ``public/`` the answer and
``engines.json`` (``boundary.engines_file``: the agent has no Docker access, and observes its engines from it).

systemd's ``PathChanged=`` does not queue: a request written while this runs starts nothing. So after each
answer the spool is read again, and a newer request is answered in the same run. The whole run holds
``root_side.root_dir.apply_lock``, so root's observe unit (``root_side.observe_unit``) does not rewrite
``engines.json`` under it: this run does, every ``LIVE_INVENTORY_S`` while an apply runs (``LiveInventory``),
so that the agent sees a replace as it happens (the new engine ready beside the old, then the old draining)
and the serving projection switches mid-apply, not only once the whole apply is over.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TRANSFERS_FILE
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError, load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection, verify_desired_state
from meridian_node_agent.apply.applier import Applier
from meridian_node_agent.boundary.directories import BoundaryError
from meridian_node_agent.boundary.engines_file import write_inventory
from meridian_node_agent.boundary.spool import (
    ANSWER_MODE,
    RESULT_FILE,
    ApplyAnswer,
    ApplyRequest,
    SpoolError,
    read_answer_file,
)
from meridian_node_agent.config import AgentConfig, config_for_verb, mode_unavailable
from meridian_node_agent.root_side.engine_inventory import collect_inventory
from meridian_node_agent.root_side.gpu_reports import relay_gpu_reports
from meridian_node_agent.root_side.read_only_docker import connect_read_only
from meridian_node_agent.root_side.root_dir import RootDir, apply_lock, prepare_root_dir, read_request

__all__ = [
    "LIVE_INVENTORY_S",
    "VERB",
    "LiveInventory",
    "add_parsers",
    "answer_one",
    "answer_requests",
    "cmd_apply_spooled",
    "refresh_inventory",
]

VERB = "apply-spooled"
# How often engines.json is rewritten while an apply runs: the agent re-reads it each second during an apply,
# and a replace's settle (reconcile.yml's meridian_drain_settle, 5 s) must cover both.
LIVE_INVENTORY_S = 1.0
_GENERATION = re.compile(r"^gen-([0-9]+)-")


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        VERB,
        help="(root) apply the request the agent spooled; run by meridian-node-apply.service",
        description="Read <state_dir>/spool/apply-request.json, verify its envelope again against the policy "
        "named in --config and the record in <apply.state_dir>, run the reconcile playbook through "
        "ansible-runner and write <apply.state_dir>/public/apply-result.json for the agent, after "
        "<apply.state_dir>/public/engines.json (the engines the agent observes without Docker access). "
        "Exit 0 when every request answered was applied (or there was none), 1 when one was refused or failed.",
    )
    verb.set_defaults(handler=cmd_apply_spooled)


def open_root_side(config_path: str, *, unit: str, nothing_done: str) -> tuple[AgentConfig, RootDir] | None:
    """The config and root's checked directory for a root unit (``unit`` names it in messages), or None
    after printing why this node is not one the unit serves or its directory is unsafe."""
    config = config_for_verb(config_path)
    if config.apply.via != "systemd":
        # Not a root unit's node: no agent waits for an answer, and there is no directory of root's to use.
        print(
            f"error: config {config_path} says apply.via: {config.apply.via}; the {unit} only serves "
            f"apply.via: systemd; {nothing_done}",
            file=sys.stderr,
        )
        return None
    try:
        root = prepare_root_dir(Path(config.apply.state_dir), agent_dir=Path(config.state_dir))
    except (BoundaryError, OSError) as exc:
        print(f"error: {exc}; {nothing_done}", file=sys.stderr)
        return None
    return config, root


def cmd_apply_spooled(args: argparse.Namespace) -> int:
    opened = open_root_side(args.config, unit="apply unit", nothing_done="nothing was applied")
    if opened is None:
        return 1
    config, root = opened
    try:
        # Held for the whole run: the observe unit leaves engines.json alone until this run has answered.
        with apply_lock(root, wait=True):
            answers = answer_requests(config, root)
    except SpoolError as exc:
        print(f"error: {exc}; nothing was applied", file=sys.stderr)
        _report_inventory(refresh_inventory(config, root, clock=lambda: datetime.now(UTC)))
        return 1
    if not answers:
        print(f"no new request in {Path(config.state_dir) / 'spool'}; nothing to apply")
    for answer in answers:
        tail = f"; {'; '.join(answer.failures)}" if answer.failures else ""
        print(
            f"request {answer.request}: generation {answer.generation} {answer.status} "
            f"(changed {answer.changed}, failed {answer.failed}) in {answer.wall_seconds:.2f} s{tail}"
        )
    return 0 if all(answer.status == "successful" for answer in answers) else 1


def answer_requests(
    config: AgentConfig, root: RootDir, *, clock: Callable[[], datetime] | None = None
) -> list[ApplyAnswer]:
    """Answer the spooled request, and any newer one written meanwhile; each request at most once."""
    answered: list[ApplyAnswer] = []
    now = clock or (lambda: datetime.now(UTC))
    while True:
        request = read_request(Path(config.state_dir))
        if request is None or any(a.request == request.request for a in answered):
            break
        try:
            previous = read_answer_file(root.public)
        except SpoolError:
            previous = None  # ours to overwrite; the agent skips a damaged answer too
        if previous is not None and previous.request == request.request:
            break
        try:
            with LiveInventory(config, root, clock=now):
                answer = answer_one(config, root, request, clock=now)
        except Exception as exc:  # noqa: BLE001 - answered as failed: the agent must not wait its whole timeout
            traceback.print_exc(file=sys.stderr)  # a bug, not a verdict on the request: keep the whole story
            answer = _failed(root, request.request, now(), now, f"the root apply unit failed: {exc!r}")
            _report_inventory(refresh_inventory(config, root, clock=now))
            write_answer(root, answer)
            answered.append(answer)
            break
        # Before the answer: the agent observes right after it, and must see what this run changed. Also
        # after a failed run, which may have created or removed containers.
        _report_inventory(refresh_inventory(config, root, clock=now))
        write_answer(root, answer)
        answered.append(answer)
    if not answered:  # started with nothing to apply: the engines may have changed since the last run
        _report_inventory(refresh_inventory(config, root, clock=now))
    return answered


def write_answer(root: RootDir, answer: ApplyAnswer) -> Path:
    path = root.public / RESULT_FILE
    atomic_write(path, answer.model_dump_json().encode("utf-8"), mode=ANSWER_MODE, group=root.group)
    return path


def refresh_inventory(
    config: AgentConfig, root: RootDir, *, clock: Callable[[], datetime], connect: Callable[[], Any] | None = None
) -> str | None:
    """Rewrite ``public/engines.json`` from what Docker lists now; None, or why it could not. The previous
    file then stays: the agent still probes each engine in it, so one that is gone is not ready."""
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerEngineError

    if connect is None:

        def connect() -> Any:
            return DockerEngine.from_env(timeout_s=30)

    try:
        inventory = collect_inventory(
            connect,
            node_id=config.node_id,
            policy_path=config.policy,
            state_dir=str(root.path),
            written_at=format_rfc3339(clock()),
        )
        write_inventory(root.public, inventory, group=root.group)
    # PolicyError and DrainStateError are ValueErrors. The answer matters more than the inventory: none of
    # these may keep the answer from the agent.
    except (DockerEngineError, OSError, ValueError) as exc:
        return f"could not write {root.public / 'engines.json'}: {exc}; the agent keeps observing the previous one"
    return None


class LiveInventory:
    """Rewrites ``engines.json`` every ``interval_s`` in a thread while an apply runs (a context manager).

    Only reads Docker (``refresh_inventory`` through ``read_only_docker``); a failed rewrite is said once and
    the previous file stays. Stopped before the final rewrite, so the answer always follows a whole listing.
    """

    def __init__(
        self,
        config: AgentConfig,
        root: RootDir,
        *,
        clock: Callable[[], datetime],
        interval_s: float = LIVE_INVENTORY_S,
        refresh: Callable[..., str | None] | None = None,
    ) -> None:
        self._args = (config, root)
        self._clock = clock
        self._interval_s = interval_s
        self._refresh = refresh or refresh_inventory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-inventory", daemon=True)
        self.rewrites = 0

    def __enter__(self) -> LiveInventory:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self._interval_s):
            problem = self._refresh(*self._args, clock=self._clock, connect=connect_read_only)
            if problem is None:
                self.rewrites += 1
            elif not warned:
                _report_inventory(problem)
                warned = True


def _report_inventory(problem: str | None) -> None:
    if problem is not None:
        print(f"warning: {problem}", file=sys.stderr)


def answer_one(
    config: AgentConfig, root: RootDir, request: ApplyRequest, *, clock: Callable[[], datetime], nvml: Any = None
) -> ApplyAnswer:
    """Verify the request's envelope as root sees it, against root's record, hold the GPUs the agent reports
    unhealthy by XID, then run the reconcile playbook. ``nvml``: a pynvml module (the seam's by default), read
    only when the request reports a GPU."""
    ident = request.request
    started = clock()

    def refuse(reason: str) -> ApplyAnswer:
        return _failed(
            root, ident, started, clock, f"the root apply unit refused request {ident}: {reason}; nothing was applied"
        )

    if config.mode == "observe-only":
        return refuse("config mode is observe-only, which never applies")
    if config.mode == "kubernetes-integrated":
        # Root's own reading of its own config decides: whatever the agent spooled, this node is Kubernetes'.
        return refuse(
            "config mode is kubernetes-integrated, which is read-only: this node's containers and GPUs belong to "
            "Kubernetes, and nothing is applied here"
        )
    unavailable = mode_unavailable(config.mode)
    if unavailable:
        return refuse(unavailable)
    if config.apply.via != "systemd":  # cmd_apply_spooled stops before; a caller of this function must too
        return refuse(f"the config says apply.via: {config.apply.via}; the apply unit only serves apply.via: systemd")
    if (root.journal / ident).exists() or (root.runs / ident).exists():
        return refuse("an earlier attempt at it was interrupted (its journal exists); the agent applies it again")
    try:
        envelope = request.envelope_bytes()
        policy = load_policy(config.policy)
        refusal = policy.mode_allowed(config.mode)
        if refusal:
            return refuse(f"mode: {refusal}")
        # Root's record decides, read once: the epoch and generation checked here are the ones recorded.
        record = StateStore(root.path)
        verified = verify_desired_state(envelope, policy, node_id=config.node_id, now=clock(), applied=record.load())
    except Rejection as exc:
        return refuse(f"the envelope is rejected ({exc.code.value}): {exc.message}")
    except (SpoolError, PolicyError, StateStoreError) as exc:
        return refuse(str(exc))
    state = verified.state
    if not ident.startswith(f"gen-{state.generation}-"):
        return refuse(f"the request names a run of another generation than the envelope's {state.generation}")
    try:
        # The decision is durable before anything runs: killed, hung or failed, this apply still moved the
        # floor, so nothing below this generation is applied after it; these bytes may run again.
        record.record_accepted(state.generation, state.lease_epoch, verified.payload_sha256)
    except StateStoreError as exc:
        return refuse(f"generation {state.generation} could not be recorded as accepted before its apply: {exc}")
    # Before the playbook, whose placement reads the holds: the GPUs the agent's XID watch found unhealthy, which
    # root's own fresh processes cannot see (root_side.gpu_reports). A problem here is said, never a refusal.
    relayed = relay_gpu_reports(root.path, request.gpu_reports, now=clock(), nvml=nvml)
    for line in relayed.lines():
        print(line)
    if relayed.problem is not None:
        print(f"warning: {relayed.problem}", file=sys.stderr)
    applier = Applier(
        state_dir=root.path,
        node_id=config.node_id,
        policy_path=config.policy,
        keep_runs=config.journal.keep_runs,
        clock=clock,
        progress_file=root.public / TRANSFERS_FILE,
    )
    result = applier.apply(
        envelope,
        generation=state.generation,
        epoch=state.lease_epoch,
        payload_sha256=verified.payload_sha256,
        secrets=[value for engine in state.engines for value in engine.secret_env.values()],
        ident=ident,
        # From root's verification above, never from the request: the agent's word skips nothing here.
        lists_artifacts=bool(state.artifacts),
    )
    return ApplyAnswer.from_result(result, verified.payload_sha256, state.lease_epoch)


def _failed(root: RootDir, ident: str, started: datetime, clock: Callable[[], datetime], message: str) -> ApplyAnswer:
    match = _GENERATION.match(ident)
    generation = int(match.group(1)) if match else 0
    return ApplyAnswer(
        request=ident,
        payload_sha256="",
        generation=generation if generation <= 2**63 - 1 else 0,
        status="failed",
        rc=None,
        changed=0,
        failed=0,
        failures=[message],
        journal=str(root.journal / ident),
        started_at=format_rfc3339(started),
        finished_at=format_rfc3339(clock()),
        wall_seconds=0.0,
    )

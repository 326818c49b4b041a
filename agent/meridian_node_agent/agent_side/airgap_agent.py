"""``meridian-node run`` in ``mode: air-gapped``: the inbox loop and the outbox, with no control plane.

Runs on: the agent side. With ``apply.via: in-process`` the agent takes the inbox itself; under the split
(``apply.via: systemd``) root's inbox unit takes it (``root_side.inbox_unit``, docs/AIR_GAP.md) and the agent reads
the outcomes root publishes in ``public/``, observes (engines from root's ``engines.json``, as online) and
writes the outbox: it never reads the inbox.

A pass: take every complete bundle in the inbox (``apply.inbox``; under the split: read root's new
outcomes), write each run's journal summary to the outbox, then observe and write an observation when it
differs from the last one written, or when ``OBSERVATION_REFRESH_S`` after the last one (the far side
then still sees a live node, without an unchanged record every few seconds piling up between two trips of
the removable media).
Between passes the loop sleeps on inotify on the inbox (under the split: on root's ``public/``), at most
``air_gap.poll_seconds``, or until the agent stops (``stop``: SIGTERM or SIGINT). A stop in the middle of an
in-process bundle's run kills the playbook and leaves the bundle in the inbox, unfiled, with its oplog entry started:
the next start closes that entry as interrupted and takes the bundle again (``inbox.close_interrupted``). Under the
split root's inbox unit runs on by itself. Each pass rewrites ``status.json`` (the inbox's last bundle, root's
record, the outbox's sequence) for ``meridian-node status``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils._lockfile import LockTimeout
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import DEFAULT_BUNDLE_SCRATCH, Policy
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.agent_side.stop import StopSignal
from meridian_node_agent.apply.applier import Applier, ApplyAbandoned
from meridian_node_agent.apply.inbox import BundleResult, InboxProcessor, close_interrupted
from meridian_node_agent.boundary.agent_files import STATUS_FILE
from meridian_node_agent.boundary.outbox import JournalSummary, Outbox, keyid_of
from meridian_node_agent.boundary.outcomes import OutcomesError, read_outcomes
from meridian_node_agent.boundary.spool import PUBLIC_DIR
from meridian_node_agent.config import AgentConfig, config_for_verb
from meridian_node_agent.errors import UsageError
from meridian_node_agent.logs import EventLogger

if TYPE_CHECKING:
    from meridian_node_agent.agent_side.reporter import ObservePort

__all__ = [
    "OBSERVATION_REFRESH_S",
    "ROOT_SEEN_FILE",
    "AirGapAgent",
    "PassResult",
    "add_parsers",
    "build_airgap_agent",
    "check_airgap_config",
    "cmd_outbox_key",
    "node_signing_key",
    "root_inbox_problems",
]

OBSERVATION_REFRESH_S = 3600.0
# Under the split: the last outcome of root's the agent journaled, and root's record as root published it.
ROOT_SEEN_FILE = "airgap-root-seen.json"


class PassResult:
    def __init__(self, bundles: list[Any], written: list[Path], *, failed: bool = False) -> None:
        self.bundles = bundles  # BundleOutcome in-process, airgap_root.RootOutcome under the split
        self.written = written
        self.failed = failed

    @property
    def ok(self) -> bool:
        return not self.failed and all(
            b.result in (BundleResult.APPLIED, BundleResult.ALREADY_APPLIED, BundleResult.LEFT) for b in self.bundles
        )


class AirGapAgent:
    """The air-gapped loop. In-process it takes the inbox itself; under the split (``apply.via: systemd``)
    root's inbox unit takes it and the agent only reads root's outcomes (``root_side.inbox_unit``), observes and writes
    the outbox: it cannot read the inbox, and nothing it writes reaches root."""

    def __init__(
        self,
        config: AgentConfig,
        policy: Policy,
        observer: ObservePort,
        outbox: Outbox,
        *,
        log: EventLogger | None = None,
        clock: Callable[[], datetime] | None = None,
        sleep: Callable[[float], None] | None = None,
        applier: Callable[..., Any] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        stop: StopSignal | None = None,
    ) -> None:
        assert config.air_gap is not None  # the config's validator requires it in this mode
        self.stop = stop
        self.config = config
        self.air_gap = config.air_gap
        self.log = log or EventLogger()
        self.clock = clock or (lambda: datetime.now(UTC))
        self.sleep = sleep
        self.monotonic = monotonic
        self.observer = observer
        self.outbox = outbox
        self.state_dir = Path(config.state_dir)
        self.split = config.apply.via == "systemd"
        self.record = StateStore(self.state_dir)
        self.root_public = Path(config.apply.state_dir) / PUBLIC_DIR
        self.seen_path = self.state_dir / ROOT_SEEN_FILE
        self.processor: InboxProcessor | None = None
        if not self.split:
            self.processor = InboxProcessor(
                inbox=Path(self.air_gap.inbox),
                policy=policy,
                node_id=config.node_id,
                record_dir=self.state_dir,
                keep_runs=config.journal.keep_runs,
                clock=self.clock,
                log=self.log,
                applier=applier,
            )
        self.last_run: dict[str, Any] | None = None
        self.last_bundle: dict[str, Any] | None = None
        self._observed: str | None = None
        self._observed_at: float | None = None

    def run(self, *, once: bool = False, max_passes: int | None = None) -> int:
        """Pass until stopped (or once). 0 when the last pass took every bundle cleanly, 1 otherwise."""
        from meridian_node_agent.boundary.watch import watch_directory

        if not self.split:
            close_interrupted(self.state_dir, self.log)
        passes = 0
        # Under the split the inbox is root's and unreadable here: root's outcomes arrive by rename in public/.
        watched = self.root_public if self.split else Path(self.air_gap.inbox)
        with watch_directory(watched) as watch:
            while True:
                if self.stop is not None and self.stop.stopping:
                    return self._stopped("between-passes")
                try:
                    result = self.run_pass()
                except ApplyAbandoned as exc:
                    self.log.warning("apply-abandoned", run_ident=exc.ident, generation=exc.generation, detail=str(exc))
                    return self._stopped("apply")
                except LockTimeout as exc:
                    # Another process (a second ``run``) holds the inbox: busy, said as such, and a failed pass.
                    self.log.error("inbox-busy", error=str(exc))
                    result = PassResult([], [], failed=True)
                except OSError as exc:
                    # The inbox or outbox went away (media unmounted) or a disk filled: say so and try
                    # again next pass; the engines keep running meanwhile.
                    self.log.error("air-gap-pass-failed", error=f"{type(exc).__name__}: {exc}")
                    result = PassResult([], [], failed=True)
                passes += 1
                if once or (max_passes is not None and passes >= max_passes):
                    return 0 if result.ok else 1
                if self.sleep is not None:
                    self.sleep(self.air_gap.poll_seconds)
                else:
                    # Wakes on a rename into the inbox (or a stop); the poll interval is the backstop for a lost event.
                    watch.wait(self.air_gap.poll_seconds, interrupt=None if self.stop is None else self.stop.fileno())

    def _stopped(self, during: str) -> int:
        """Say that the loop stops, why and what it was doing; the exit status for ``meridian-node run``."""
        assert self.stop is not None
        self.log.info("agent-stopping", signal=self.stop.reason, during=during)
        return self.stop.exit_status

    def close(self) -> None:
        """The agent stops: give back what the observer holds open (its NVML event set)."""
        close = getattr(self.observer, "close", None)
        if callable(close):
            close()

    def close_interrupted(self) -> None:
        """In-process: close an apply the agent's oplog shows started and never finished (``apply.inbox``)."""
        close_interrupted(self.state_dir, self.log)

    def run_pass(self) -> PassResult:
        if self.processor is None:
            return self._root_pass()
        outcomes = self.processor.process_once()
        written: list[Path] = []
        for outcome in outcomes:
            if outcome.result == BundleResult.LEFT:
                continue
            self.last_bundle = _bundle_status(
                outcome.name, outcome.result.value, outcome.reason, outcome.message, outcome.generation
            )
            if outcome.run is None:
                continue
            run = outcome.run
            summary = {
                "ident": run.ident,
                "generation": run.generation,
                "status": run.status if run.status in ("successful", "failed", "canceled", "timeout") else "failed",
                "changed": run.changed,
                "failed": run.failed,
                "failures": run.failures[:5],
                "started_at": format_rfc3339(run.started_at),
                "finished_at": format_rfc3339(run.finished_at),
            }
            written.append(self._journal(summary, outcome.bundle_id, self.record.load().epoch))
        applied = self.record.load()
        written.extend(self._observe(applied.generation, applied.epoch))
        self._write_status(
            applied.generation, applied.epoch, None if applied.accepted is None else applied.accepted.generation
        )
        return PassResult(outcomes, written)

    def _root_pass(self) -> PassResult:
        """Under the split: journal each outcome root published since the last one seen, then observe."""
        seen = self._seen()
        try:
            document = read_outcomes(self.root_public, node_id=self.config.node_id)
        except OutcomesError as exc:
            # Refused whole: nothing in it is journaled, and the observation carries the last record known.
            self.log.error("root-outcomes-refused", reason=str(exc))
            observed = self._observe(seen["generation"], seen["epoch"])
            self._write_status(seen["generation"], seen["epoch"])
            return PassResult([], observed, failed=True)
        if document is None:
            observed = self._observe(seen["generation"], seen["epoch"])
            self._write_status(seen["generation"], seen["epoch"])
            return PassResult([], observed)
        last = seen["sequence"]
        if document.outcomes and document.outcomes[-1].sequence < last:
            # Root's file started over (its directory was rebuilt): journal what it lists now.
            self.log.warning("root-outcomes-restarted", seen=last, highest=document.outcomes[-1].sequence)
            last = 0
        fresh = [outcome for outcome in document.outcomes if outcome.sequence > last]
        written: list[Path] = []
        for outcome in fresh:
            self.last_bundle = _bundle_status(
                outcome.name, outcome.result, outcome.reason, outcome.message, outcome.generation
            )
            if outcome.run is not None:
                summary = outcome.run.model_dump()
                written.append(self._journal(summary, outcome.bundle_id, document.applied.epoch))
        generation, epoch = document.applied.generation, document.applied.epoch
        # Recorded after the journal files: a crash in between writes a run's journal twice (harmless to the
        # importer, which keeps journals per run), never loses one.
        newest = fresh[-1].sequence if fresh else (document.outcomes[-1].sequence if document.outcomes else last)
        if (newest, generation, epoch) != (seen["sequence"], seen["generation"], seen["epoch"]) or fresh:
            bundle = self.last_bundle if fresh else seen.get("last_bundle")
            record = {"sequence": newest, "generation": generation, "epoch": epoch, "last_bundle": bundle}
            atomic_write(self.seen_path, json.dumps(record).encode() + b"\n", mode=0o600)
        if self.last_bundle is None:
            self.last_bundle = seen.get("last_bundle")
        written.extend(self._observe(generation, epoch))
        accepted = document.applied.accepted
        self._write_status(generation, epoch, None if accepted is None else accepted.generation)
        return PassResult(fresh, written)

    def _seen(self) -> dict[str, Any]:
        """What the agent last took from root's outcomes (its own file: a damaged one is an error, no reset)."""
        try:
            raw = self.seen_path.read_bytes()
        except FileNotFoundError:
            return {"sequence": 0, "generation": 0, "epoch": 0, "last_bundle": None}
        try:
            record = json.loads(raw)
            if not (
                isinstance(record, dict)
                and all(isinstance(record.get(k), int) and record[k] >= 0 for k in ("sequence", "generation", "epoch"))
            ):
                raise ValueError("fields sequence, generation, epoch must be integers >= 0")
        except ValueError as exc:
            raise UsageError(
                f"{self.seen_path} is damaged ({exc}); remove it and every outcome root still lists is journaled again"
            ) from exc
        return record

    def _journal(self, summary: dict[str, Any], bundle_id: str | None, epoch: int) -> Path:
        self.observer.forget()  # the apply changed what there is to observe
        self.last_run = {
            key: summary[key] for key in ("ident", "generation", "status", "changed", "failed", "finished_at")
        }
        journal = JournalSummary.model_validate({**summary, "bundle_id": bundle_id})
        return self.outbox.write("journal", journal, epoch=epoch, now=self.clock())

    def _observe(self, generation: int, epoch: int) -> list[Path]:
        observation = self.observer.observe(
            node_id=self.config.node_id,
            mode=self.config.mode,
            epoch=epoch,
            applied_generation=generation,
            last_run=self.last_run,
            now=self.clock(),
        )
        fingerprint = observation.model_dump_json(exclude={"observed_at"})
        now = self.monotonic()
        fresh = self._observed_at is not None and now - self._observed_at < OBSERVATION_REFRESH_S
        if fingerprint == self._observed and fresh:
            return []
        path = self.outbox.write("observation", observation, epoch=epoch, now=self.clock())
        self._observed = fingerprint
        self._observed_at = now
        return [path]

    def _write_status(self, generation: int, epoch: int, accepted: int | None = None) -> None:
        """``status.json`` in air-gapped mode: what ``meridian-node status`` shows of the inbox and outbox;
        ``accepted``, a generation the applier accepted and has not recorded applied (its apply failed or
        was cut short)."""
        document = {
            "mode": self.config.mode,
            "applied_generation": generation,
            "lease_epoch": epoch,
            "last_run": self.last_run,
            "updated_at": format_rfc3339(self.clock()),
            "air_gap": {
                "inbox": self.air_gap.inbox,
                "taken_by": "root (meridian-node-airgap.service)" if self.split else "the agent",
                "last_bundle": self.last_bundle,
                "applied_generation": generation,
                "accepted_generation": accepted,
                "outbox": self.air_gap.outbox,
                "outbox_sequence": self.outbox.last_sequence(),
            },
        }
        atomic_write(self.state_dir / STATUS_FILE, json.dumps(document, sort_keys=True).encode() + b"\n", mode=0o640)


def _bundle_status(
    name: str, result: str, reason: str | None, message: str | None, generation: int | None
) -> dict[str, Any]:
    return {"name": name, "result": result, "reason": reason, "message": message, "generation": generation}


def check_airgap_config(config: AgentConfig, policy: Policy) -> list[str]:
    """Problems with an air-gapped config's paths (inbox, outbox, the policy's scratch), each naming the
    path, what is wrong and the fix. Under the split the inbox and scratch are root's (``root_inbox_problems``)."""
    if config.air_gap is None:
        return ["mode air-gapped needs an 'air_gap' section"]
    problems = []
    euid = os.geteuid()
    inbox, outbox = Path(config.air_gap.inbox), Path(config.air_gap.outbox)
    scratch = Path(policy.air_gap.scratch_dir)
    if config.apply.via == "systemd":
        problems.extend(root_inbox_problems(config, scratch))
        # The agent's own outbox: owned by the agent's user (the owner of its directory; check-config may run
        # as root, before or after the agent's first start).
        agent_uid = _owner_uid(Path(config.state_dir), euid)
        problems.extend(_directory_problems("air_gap.outbox", outbox, agent_uid, may_be_missing=True))
    else:
        problems.extend(_directory_problems("air_gap.inbox", inbox, euid))
        problems.extend(_directory_problems("air_gap.outbox", outbox, euid, may_be_missing=True))
        problems.extend(
            _directory_problems("policy air_gap.scratch_dir", scratch, euid, may_be_missing=True, private=True)
        )
    state = os.path.normpath(config.state_dir)
    for name, path in (("air_gap.inbox", inbox), ("air_gap.outbox", outbox)):
        if os.path.normpath(path) == state:
            problems.append(f"{name} ({path}) is the state dir itself: give it a directory of its own")
    if os.path.normpath(inbox) == os.path.normpath(outbox):
        problems.append(
            f"air_gap.inbox and air_gap.outbox are one directory ({inbox}): bundles and records must not mix"
        )
    return problems


def root_inbox_problems(config: AgentConfig, scratch: Path) -> list[str]:
    """Under the split: the inbox checked as root's inbox unit checks it (``root_side.inbox_unit.check_root_inbox``:
    root's, every directory above it too, not writable by the agent's group, outside the agent's directory),
    and the scratch directory root's and outside the agent's directory. Only ``lstat`` is needed: the agent
    can run it without reading the inbox."""
    from meridian_node_agent.boundary.directories import BoundaryError, check_root_inbox

    assert config.air_gap is not None
    problems = []
    agent_dir = Path(config.state_dir)
    try:
        agent_gid: int | None = agent_dir.lstat().st_gid
    except FileNotFoundError:
        agent_gid = None if os.geteuid() == 0 else os.getegid()
    try:
        check_root_inbox(Path(config.air_gap.inbox), agent_dir=agent_dir, agent_gid=agent_gid)
    except BoundaryError as exc:
        problems.append(f"air_gap.inbox (read by root's meridian-node-airgap.service): {exc}")
    agent_real = os.path.realpath(agent_dir)
    scratch_real = os.path.realpath(scratch)
    if os.path.commonpath([agent_real, scratch_real]) in (agent_real, scratch_real):
        problems.append(
            f"policy air_gap.scratch_dir {scratch} overlaps the agent's directory {agent_real}: under the split "
            f"root unpacks bundles there, so it must be root's (default {DEFAULT_BUNDLE_SCRATCH})"
        )
    else:
        with contextlib.suppress(FileNotFoundError):  # made by root's reader on first use
            info = scratch.lstat()
            if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
                problems.append(
                    f"policy air_gap.scratch_dir {scratch} is not a directory of root's: root's reader refuses it; "
                    "remove it and root makes it (0700) on first use"
                )
    return problems


def _owner_uid(directory: Path, default: int) -> int:
    try:
        return directory.lstat().st_uid
    except FileNotFoundError:
        return default


def _directory_problems(
    name: str, path: Path, euid: int, *, may_be_missing: bool = False, private: bool = False
) -> list[str]:
    try:
        info = path.lstat()
    except FileNotFoundError:
        if may_be_missing and path.parent.is_dir():
            return []  # created on the first write
        return [f"{name} {path} does not exist: create it (owned by uid {euid}, mode 0750)"]
    except OSError as exc:
        return [f"{name} {path} cannot be examined: {exc.strerror}"]
    if stat.S_ISLNK(info.st_mode):
        return [f"{name} {path} is a symbolic link: name the real directory"]
    if not stat.S_ISDIR(info.st_mode):
        return [f"{name} {path} is not a directory"]
    problems = []
    if info.st_uid != euid:
        problems.append(f"{name} {path} is owned by uid {info.st_uid}, not by the agent (uid {euid}): chown it")
    if private and info.st_mode & 0o022:
        problems.append(
            f"{name} {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}): chmod 0700; "
            "the bundle reader refuses it, because another user could change verified files there"
        )
    elif info.st_mode & 0o002:
        problems.append(
            f"{name} {path} is writable by everyone (mode {stat.S_IMODE(info.st_mode):04o}): chmod o-w; "
            "anyone could drop or replace files there"
        )
    return problems


def node_signing_key(config: AgentConfig) -> ec.EllipticCurvePrivateKey:
    """The node key (``identity/node.key.pem``), created when the node has none: the key enrollment would
    use, so an air-gapped node enrolled later keeps the key its outbox records were signed with."""
    identity = NodeIdentity(config.identity_dir)
    try:
        identity.ensure_key()
        key = serialization.load_pem_private_key(identity.key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"the node key {identity.key_path} cannot be used: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UsageError(f"the node key {identity.key_path} is a {type(key).__name__}, not EC P-256")
    return key


def build_airgap_agent(
    config: AgentConfig, *, log: EventLogger | None = None, stop: StopSignal | None = None
) -> AirGapAgent:
    """The air-gapped agent as ``meridian-node run`` builds it: refused with every problem named first. ``stop``
    ends its waits and kills an in-process bundle's playbook (``Applier``'s cancel callback)."""
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerEngineError
    from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
    from meridian_node_agent.agent_side.observe import DockerEngines, InventoryEngines, Observer, no_engines
    from meridian_node_agent.config import policy_for_run

    policy = policy_for_run(config)
    problems = check_airgap_config(config, policy)
    if problems:
        raise UsageError("; ".join(problems))
    assert config.air_gap is not None
    engines: Any = no_engines
    if config.apply.via == "systemd":
        # No Docker access under the split: the engines root lists for this node, probed by the agent.
        engines = InventoryEngines(root_dir=Path(config.apply.state_dir), node_id=config.node_id, log=log)
    else:
        try:
            engines = DockerEngines(
                DockerEngine.from_env(timeout_s=5), state_dir=Path(config.state_dir), owner=f"agent:{config.node_id}"
            )
        except DockerEngineError as exc:
            (log or EventLogger()).warning("engines-not-observed", reason=str(exc))
    observer = Observer(
        store_path=policy.store.path,
        # As ``run`` builds it online: held verdicts and cordons where placement reads them (root's directory
        # under the split, the agent's own in-process, where it applies and so writes the holds).
        gpu_facts=GpuHealthWatch(config.record_dir, writes_holds=config.apply.via == "in-process", log=log),
        engines=engines,
        placement=(policy.engines.port_range, policy.engines.bind_address),
        cordon_dir=str(config.record_dir),
        policy_cordon=policy.cordon,
        log=log,
    )
    Path(config.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    outbox = Outbox(Path(config.air_gap.outbox), Path(config.state_dir), config.node_id, node_signing_key(config))
    if stop is None:
        return AirGapAgent(config, policy, observer, outbox, log=log)
    cancel = stop.is_stopping

    def applier(**options: Any) -> Applier:
        return Applier(**options, cancel=cancel)

    return AirGapAgent(config, policy, observer, outbox, log=log, applier=applier, stop=stop)


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    key = subparsers.add_parser(
        "outbox-key",
        help="print the public key the outbox records are signed with",
        description="Print the node key's public half (PEM) and its keyid, creating the key when the node has "
        "none. Register it with the control plane: meridian-node-devserver import-outbox --node-key NODE=PEM.",
    )
    key.set_defaults(handler=cmd_outbox_key)


def cmd_outbox_key(args: argparse.Namespace) -> int:
    config = config_for_verb(args.config)
    public = node_signing_key(config).public_key()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    sys.stdout.write(pem.decode("ascii"))
    print(f"# keyid {keyid_of(public)} node {config.node_id}", file=sys.stderr)
    return 0

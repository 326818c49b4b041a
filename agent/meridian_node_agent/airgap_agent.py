"""``meridian-node run`` in ``mode: air-gapped``: the inbox loop and the outbox, with no control plane.

Runs on: the agent side, with ``apply.via: in-process`` (docs/AIR_GAP.md: under the split, root's inbox unit
takes the bundles; that unit is not built yet, and ``config.mode_unavailable`` refuses the combination).

A pass: take every complete bundle in the inbox (``airgap_inbox``), write each run's journal summary to the
outbox, then observe and write an observation when it differs from the last one written, or when
``OBSERVATION_REFRESH_SECONDS`` after the last one (the far side then still sees a live node, without an
unchanged record every few seconds piling up between two trips of the removable media).
Between passes the loop sleeps on inotify on the inbox, at most ``air_gap.poll_seconds``.
"""

from __future__ import annotations

import argparse
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

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.policy import Policy
from ansible_collections.meridian.node.plugins.module_utils.state_store import StateStore
from meridian_node_agent.airgap_inbox import BundleOutcome, BundleResult, InboxProcessor
from meridian_node_agent.airgap_outbox import JournalSummary, Outbox, keyid_of
from meridian_node_agent.config import AgentConfig, ConfigError, load_config
from meridian_node_agent.identity import NodeIdentity
from meridian_node_agent.logs import EventLogger
from meridian_node_agent.oplog import OpLog
from meridian_node_agent.usage import UsageError

if TYPE_CHECKING:
    from meridian_node_agent.cycle import ObservePort

__all__ = [
    "OBSERVATION_REFRESH_SECONDS",
    "AirGapAgent",
    "PassResult",
    "add_parsers",
    "build_airgap_agent",
    "check_airgap_config",
    "cmd_outbox_key",
    "node_signing_key",
]

OBSERVATION_REFRESH_SECONDS = 3600.0


class PassResult:
    def __init__(self, bundles: list[BundleOutcome], written: list[Path], *, failed: bool = False) -> None:
        self.bundles = bundles
        self.written = written
        self.failed = failed

    @property
    def ok(self) -> bool:
        return not self.failed and all(
            b.result in (BundleResult.APPLIED, BundleResult.ALREADY_APPLIED, BundleResult.LEFT) for b in self.bundles
        )


class AirGapAgent:
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
    ) -> None:
        assert config.air_gap is not None  # the config's validator requires it in this mode
        self.config = config
        self.air_gap = config.air_gap
        self.log = log or EventLogger()
        self.clock = clock or (lambda: datetime.now(UTC))
        self.sleep = sleep
        self.monotonic = monotonic
        self.observer = observer
        self.outbox = outbox
        self.record = StateStore(Path(config.state_dir))
        self.processor = InboxProcessor(
            inbox=Path(self.air_gap.inbox),
            policy=policy,
            node_id=config.node_id,
            record_dir=Path(config.state_dir),
            keep_runs=config.journal.keep_runs,
            clock=self.clock,
            log=self.log,
            applier=applier,
        )
        self.last_run: dict[str, Any] | None = None
        self._observed: str | None = None
        self._observed_at: float | None = None

    def run(self, *, once: bool = False, max_passes: int | None = None) -> int:
        """Pass until stopped (or once). 0 when the last pass took every bundle cleanly, 1 otherwise."""
        from meridian_node_agent.apply_unit import watch_directory

        self.close_interrupted()
        passes = 0
        with watch_directory(Path(self.air_gap.inbox)) as watch:
            while True:
                try:
                    result = self.run_pass()
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
                    # Wakes on a rename into the inbox; the poll interval is the backstop for a lost event.
                    watch.wait(self.air_gap.poll_seconds)

    def close_interrupted(self) -> None:
        """An apply the oplog shows started and never finished (a crash mid-bundle) is closed as
        interrupted: its bundle is still in the inbox (it is filed only after the run), so the next pass
        takes it again, and the record decides afresh whether it still applies."""
        oplog = OpLog(Path(self.config.state_dir) / "oplog.jsonl")
        pending = oplog.pending()
        if pending is None:
            return
        oplog.append(
            op=pending.op,
            generation=pending.generation,
            epoch=pending.epoch,
            payload_sha256=pending.payload_sha256,
            run_ident=pending.run_ident,
            result="interrupted",
            reason="the agent stopped during the run; the bundle stays in the inbox and is taken again",
        )
        self.log.warning("interrupted-apply-closed", run_ident=pending.run_ident, generation=pending.generation)

    def run_pass(self) -> PassResult:
        outcomes = self.processor.process_once()
        written: list[Path] = []
        for outcome in outcomes:
            if outcome.run is None:
                continue
            run = outcome.run
            self.observer.forget()  # the apply changed what there is to observe
            self.last_run = {
                "ident": run.ident,
                "generation": run.generation,
                "status": run.status if run.status in ("successful", "failed", "canceled", "timeout") else "failed",
                "changed": run.changed,
                "failed": run.failed,
                "finished_at": format_rfc3339(run.finished_at),
            }
            summary = JournalSummary.model_validate(
                {
                    **self.last_run,
                    "bundle_id": outcome.bundle_id,
                    "failures": run.failures[:5],
                    "started_at": format_rfc3339(run.started_at),
                }
            )
            written.append(self.outbox.write("journal", summary, epoch=self.record.load().epoch, now=self.clock()))
        written.extend(self._observe())
        return PassResult(outcomes, written)

    def _observe(self) -> list[Path]:
        applied = self.record.load()
        observation = self.observer.observe(
            node_id=self.config.node_id,
            mode=self.config.mode,
            epoch=applied.epoch,
            applied_generation=applied.generation,
            last_run=self.last_run,
            now=self.clock(),
        )
        fingerprint = observation.model_dump_json(exclude={"observed_at"})
        now = self.monotonic()
        fresh = self._observed_at is not None and now - self._observed_at < OBSERVATION_REFRESH_SECONDS
        if fingerprint == self._observed and fresh:
            return []
        path = self.outbox.write("observation", observation, epoch=applied.epoch, now=self.clock())
        self._observed = fingerprint
        self._observed_at = now
        return [path]


def check_airgap_config(config: AgentConfig, policy: Policy) -> list[str]:
    """Problems with an air-gapped config's paths (inbox, outbox, the policy's scratch), each naming the
    path, what is wrong and the fix."""
    if config.air_gap is None:
        return ["mode air-gapped needs an 'air_gap' section"]
    problems = []
    euid = os.geteuid()
    inbox, outbox = Path(config.air_gap.inbox), Path(config.air_gap.outbox)
    problems.extend(_directory_problems("air_gap.inbox", inbox, euid))
    problems.extend(_directory_problems("air_gap.outbox", outbox, euid, may_be_missing=True))
    scratch = Path(policy.air_gap.scratch_dir)
    problems.extend(_directory_problems("policy air_gap.scratch_dir", scratch, euid, may_be_missing=True, private=True))
    state = os.path.normpath(config.state_dir)
    for name, path in (("air_gap.inbox", inbox), ("air_gap.outbox", outbox)):
        if os.path.normpath(path) == state:
            problems.append(f"{name} ({path}) is the state dir itself: give it a directory of its own")
    if os.path.normpath(inbox) == os.path.normpath(outbox):
        problems.append(
            f"air_gap.inbox and air_gap.outbox are one directory ({inbox}): bundles and records must not mix"
        )
    return problems


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


def build_airgap_agent(config: AgentConfig, *, log: EventLogger | None = None) -> AirGapAgent:
    """The air-gapped agent as ``meridian-node run`` builds it: refused with every problem named first."""
    from ansible_collections.meridian.node.plugins.module_utils.docker_engine import DockerEngine, DockerEngineError
    from meridian_node_agent.agent_cli import policy_for_run
    from meridian_node_agent.observe import DockerEngines, Observer, no_engines

    policy = policy_for_run(config)
    problems = check_airgap_config(config, policy)
    if problems:
        raise UsageError("; ".join(problems))
    assert config.air_gap is not None
    engines: Any = no_engines
    try:
        engines = DockerEngines(
            DockerEngine.from_env(timeout=5), state_dir=Path(config.state_dir), owner=f"agent:{config.node_id}"
        )
    except DockerEngineError as exc:
        (log or EventLogger()).warning("engines-not-observed", reason=str(exc))
    observer = Observer(
        store_path=policy.store.path,
        engines=engines,
        placement=(policy.engines.port_range, policy.engines.bind_address),
    )
    Path(config.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    outbox = Outbox(Path(config.air_gap.outbox), Path(config.state_dir), config.node_id, node_signing_key(config))
    return AirGapAgent(config, policy, observer, outbox, log=log)


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    key = subparsers.add_parser(
        "outbox-key",
        help="print the public key the outbox records are signed with",
        description="Print the node key's public half (PEM) and its keyid, creating the key when the node has "
        "none. Register it with the control plane: meridian-node-devserver import-outbox --node-key NODE=PEM.",
    )
    key.set_defaults(handler=cmd_outbox_key)


def cmd_outbox_key(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    public = node_signing_key(config).public_key()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    sys.stdout.write(pem.decode("ascii"))
    print(f"# keyid {keyid_of(public)} node {config.node_id}", file=sys.stderr)
    return 0

"""The air-gapped inbox: take complete bundles, verify and unpack them, stage artifacts, apply, file them.

Runs on: whichever side applies (docs/AIR_GAP.md, "The inbox: who reads it under the privilege split"):
the agent with ``apply.via: in-process``; root's inbox unit under the split. It keeps no record of its
own: replay is decided by the applier's record (``StateStore`` in ``record_dir``), exactly as online.

One pass (``InboxProcessor.process_once``) lists the inbox once, classifies every entry
(``classify_entry``: in progress, refused, or a bundle to take) and handles the bundles in name order.
Every bundle taken leaves the inbox, to ``processed/`` or ``rejected/`` with a reason file beside it;
only a bundle still being written (``changed-while-read``) stays for a later pass.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils._lockfile import LOCK_WAIT_S, hold_lock
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_reader import (
    BundleProblem,
    BundleRefused,
    UnpackedBundle,
    unpack_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_stage import (
    load_bundle_images,
    stage_artifacts,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_load import ImageLoadError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import ArtifactError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactStoreError
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy
from meridian_node_agent.apply.applier import Applier, ApplyAbandoned, ApplyResult
from meridian_node_agent.apply.oplog import OpLog
from meridian_node_agent.logs import EventLogger

__all__ = [
    "BUNDLE_PLAYBOOK",
    "LOCK_FILE",
    "PROCESSED_DIR",
    "REJECTED_DIR",
    "BundleOutcome",
    "BundleResult",
    "EntryKind",
    "InboxEntry",
    "InboxProcessor",
    "classify_entry",
    "close_interrupted",
    "scan_inbox",
]

LOCK_FILE = "airgap-inbox.lock"
PROCESSED_DIR = "processed"
REJECTED_DIR = "rejected"
# The entry point of a bundle's own playbooks: the same name as the collection's, with the same extra vars.
BUNDLE_PLAYBOOK = "reconcile.yml"
_IN_PROGRESS_SUFFIXES = (".part", ".partial")
_COLLECTION_INSTALL_S = 300.0
_MANIFEST_SEARCH_MEMBERS = 64
_MAX_COLLECTION_MANIFEST_BYTES = 1024 * 1024


class EntryKind(StrEnum):
    BUNDLE = "bundle"
    IN_PROGRESS = "in-progress"
    REFUSED = "refused"
    OURS = "ours"  # processed/ and rejected/


class BundleResult(StrEnum):
    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    APPLY_FAILED = "apply-failed"
    REJECTED = "rejected"
    LEFT = "left-in-inbox"  # still being written: taken on a later pass


@dataclass(frozen=True)
class InboxEntry:
    name: str
    kind: EntryKind
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class BundleOutcome:
    name: str
    result: BundleResult
    reason: str | None = None
    message: str | None = None
    member: str | None = None
    bundle_id: str | None = None
    generation: int | None = None
    run: ApplyResult | None = None
    filed_as: Path | None = None


def classify_entry(name: str, mode: int) -> InboxEntry:
    """What one inbox entry is, from its name and its ``lstat`` mode (a symlink is never followed)."""
    if name in (PROCESSED_DIR, REJECTED_DIR) and stat.S_ISDIR(mode):
        return InboxEntry(name, EntryKind.OURS)
    # Writers copy under a temporary name and rename when complete (docs/AIR_GAP.md): these are not done.
    if name.startswith(".") or name.endswith(_IN_PROGRESS_SUFFIXES):
        return InboxEntry(name, EntryKind.IN_PROGRESS)
    if stat.S_ISLNK(mode):
        return InboxEntry(
            name,
            EntryKind.REFUSED,
            BundleProblem.NOT_A_FILE.value,
            f"inbox entry {name!r} is a symbolic link, which is never followed: copy the bundle file itself in",
        )
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        return InboxEntry(
            name,
            EntryKind.REFUSED,
            BundleProblem.NOT_A_FILE.value,
            f"inbox entry {name!r} is {kind}: a bundle is one plain tar file (make-bundle's output)",
        )
    if not name.endswith(".tar"):
        return InboxEntry(
            name,
            EntryKind.REFUSED,
            "not-a-bundle-name",
            f"inbox entry {name!r} does not end in .tar: bundles are taken only as NAME.tar, written as "
            ".NAME.tar.part and renamed when complete",
        )
    return InboxEntry(name, EntryKind.BUNDLE)


def scan_inbox(inbox: Path) -> list[InboxEntry]:
    """Every entry of ``inbox`` classified, in name order (one ``scandir``; nothing followed)."""
    found = []
    with os.scandir(inbox) as listing:
        for entry in listing:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue  # gone since the listing: an operator took it back
            found.append(classify_entry(entry.name, mode))
    return sorted(found, key=lambda entry: entry.name)


def untrusted_entry(name: str, info: os.stat_result, untrusted_uid: int) -> InboxEntry | None:
    """Why root must not take the regular file ``name`` (its ``lstat``), or None: under the split an entry
    the agent's user owns, or one with another hard link, is bytes the agent may change while root reads
    them (through its own link, or as the file's owner), so it is refused however well it is signed."""
    if info.st_uid == untrusted_uid:
        return InboxEntry(
            name,
            EntryKind.REFUSED,
            "untrusted-entry",
            f"inbox entry {name!r} is owned by uid {info.st_uid}, the agent's user, who must not hand root a "
            "bundle: copy it in as root or as an operator",
        )
    if info.st_nlink != 1:
        return InboxEntry(
            name,
            EntryKind.REFUSED,
            "untrusted-entry",
            f"inbox entry {name!r} has {info.st_nlink} hard links, so its bytes can be changed through another "
            "name: copy the bundle in (cp, then mv into place) rather than linking it",
        )
    return None


def close_interrupted(record_dir: Path, log: EventLogger) -> None:
    """An apply the oplog in ``record_dir`` shows started and never finished (a crash mid-bundle) is closed
    as interrupted: its bundle is still in the inbox (it is filed only after the run), so the next pass takes
    it again, and the record decides afresh whether it still applies."""
    oplog = OpLog(Path(record_dir) / "oplog.jsonl")
    pending = oplog.pending()
    if pending is None:
        return
    oplog.finish(
        pending,
        "interrupted",
        reason="the applier stopped during the run; the bundle stays in the inbox and is taken again",
    )
    log.warning("interrupted-apply-closed", run_ident=pending.run_ident, generation=pending.generation)


class InboxProcessor:
    """Takes the inbox's bundles, one pass at a time. ``record_dir`` holds the applier's record (and its
    journal and oplog); ``applier`` makes the ``Applier`` for one bundle (tests pass their own).

    Under the split (root's inbox unit): ``untrusted_uid`` is the agent's user, whose files are refused
    (``untrusted_entry``), and ``file_group`` the group ``processed/``, ``rejected/`` and the reason files get
    (the inbox's, so the operators who copy bundles in can read the outcome).
    """

    def __init__(
        self,
        *,
        inbox: Path,
        policy: Policy,
        node_id: str,
        record_dir: Path,
        keep_runs: int = 20,
        clock: Callable[[], datetime] | None = None,
        log: EventLogger | None = None,
        applier: Callable[..., Any] | None = None,
        untrusted_uid: int | None = None,
        file_group: int = -1,
    ) -> None:
        self.inbox = Path(inbox)
        self.untrusted_uid = untrusted_uid
        self.file_group = file_group
        self.policy = policy
        self.node_id = node_id
        self.record_dir = Path(record_dir)
        self.keep_runs = keep_runs
        self.clock = clock or (lambda: datetime.now(UTC))
        self.log = log or EventLogger()
        self.record = StateStore(self.record_dir)
        self.make_applier = applier or Applier

    def process_once(self, *, lock_wait_s: float = LOCK_WAIT_S) -> list[BundleOutcome]:
        """One pass under the inbox lock, so a bundle is never taken twice at once. The lock is the applier's
        own (``_lockfile``: 0600, a file an older release left open to others is replaced); held by another
        process (a second ``run``, root's unit) for longer than ``lock_wait_s`` seconds, it raises
        ``_lockfile.LockTimeout``: the caller reports the inbox busy, never "no bundle"."""
        self.record_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with hold_lock(self.record_dir / LOCK_FILE, wait_s=lock_wait_s, what="the air-gap inbox lock"):
            return self._pass()

    def _pass(self) -> list[BundleOutcome]:
        outcomes = []
        for entry in scan_inbox(self.inbox):
            if entry.kind in (EntryKind.OURS, EntryKind.IN_PROGRESS):
                continue
            if entry.kind == EntryKind.BUNDLE and self.untrusted_uid is not None:
                try:
                    info = (self.inbox / entry.name).lstat()
                except FileNotFoundError:
                    continue
                entry = untrusted_entry(entry.name, info, self.untrusted_uid) or entry
            if entry.kind == EntryKind.REFUSED:
                outcome = BundleOutcome(entry.name, BundleResult.REJECTED, entry.reason, entry.message)
            else:
                outcome = self._take(entry.name)
            if outcome.result != BundleResult.LEFT:
                try:
                    outcome = self._file(outcome)
                except FileNotFoundError:
                    # Removed from the inbox while it was read: nothing left to file, the outcome stands.
                    self.log.warning("bundle-vanished", bundle=entry.name, result=outcome.result.value)
            self.log.info(
                "bundle-" + outcome.result.value,
                bundle=entry.name,
                reason=outcome.reason,
                detail=outcome.message,
                generation=outcome.generation,
                filed_as=None if outcome.filed_as is None else str(outcome.filed_as),
            )
            outcomes.append(outcome)
        return outcomes

    def _take(self, name: str) -> BundleOutcome:
        path = self.inbox / name
        before = _fingerprint(path)
        try:
            unpacked = unpack_bundle(
                str(path), self.policy, node_id=self.node_id, now=self.clock(), applied=self.record.load()
            )
        except BundleRefused as exc:
            # A writer that skipped the temporary name may still be copying: a file that changed since the
            # pass began (it looked truncated, or grew while read) is left for a later pass, not rejected.
            if exc.reason == BundleProblem.CHANGED or _fingerprint(path) != before:
                message = f"{name} changed while it was read ({exc}): still being written, taken later"
                return BundleOutcome(name, BundleResult.LEFT, BundleProblem.CHANGED.value, message)
            return BundleOutcome(name, BundleResult.REJECTED, exc.reason.value, exc.message, exc.member)
        try:
            shadow = _shadowing_collection(unpacked)
            if shadow is not None:
                bundle = unpacked.verified.bundle
                return BundleOutcome(
                    name,
                    BundleResult.REJECTED,
                    BundleProblem.CODE_REFUSED.value,
                    shadow,
                    bundle_id=bundle.bundle_id,
                    generation=bundle.generation,
                )
            return self._apply(name, unpacked)
        finally:
            unpacked.discard()

    def _apply(self, name: str, unpacked: UnpackedBundle) -> BundleOutcome:
        bundle = unpacked.verified.bundle
        desired = unpacked.verified.desired
        state = desired.state

        def outcome(
            result: BundleResult, reason: str | None, message: str, run: ApplyResult | None = None
        ) -> BundleOutcome:
            return BundleOutcome(
                name, result, reason, message, bundle_id=bundle.bundle_id, generation=state.generation, run=run
            )

        if desired.already_applied:
            message = f"generation {state.generation} is the one applied: nothing to do"
            return outcome(BundleResult.ALREADY_APPLIED, "already-applied", message)
        try:
            # Durable before anything is staged or run: whatever becomes of this apply (failed, hung, killed),
            # nothing below this generation is applied after it; this bundle's own bytes may run again.
            self.record.record_accepted(state.generation, state.lease_epoch, desired.payload_sha256)
        except StateStoreError as exc:
            return outcome(BundleResult.APPLY_FAILED, "not-accepted", f"nothing was applied: {exc}")
        tree = Path(unpacked.directory) / "tree"
        try:
            self._stage_artifacts(unpacked)
            # Images after the whole bundle verified (unpack_bundle) and from the copies in scratch.
            for loaded in load_bundle_images(unpacked):
                self.log.info("image-loaded" if loaded["loaded"] else "image-present", **loaded)
            applier = self._applier(unpacked, tree)
        except ImageLoadError as exc:
            return outcome(BundleResult.APPLY_FAILED, "image-load-failed", str(exc))
        except (
            ArtifactError,
            ArtifactStoreError,
            OSError,
            ValueError,
            RuntimeError,
            subprocess.SubprocessError,
        ) as exc:
            return outcome(BundleResult.APPLY_FAILED, "staging-failed", f"{type(exc).__name__}: {exc}")
        # The envelope as control signed it: the same payload (canonical base64) and signatures, which is
        # all the playbook verifies again.
        envelope = json.dumps(bundle.desired_state.model_dump(mode="json"), separators=(",", ":")).encode()
        try:
            result: ApplyResult = applier.apply(
                envelope,
                generation=state.generation,
                epoch=state.lease_epoch,
                payload_sha256=desired.payload_sha256,
                secrets=[value for engine in state.engines for value in engine.secret_env.values()],
                reason=f"bundle {bundle.bundle_id}",
            )
        except ApplyAbandoned:
            raise  # the agent is stopping: the bundle stays in the inbox, unfiled, and is taken again at start-up
        except Exception as exc:  # noqa: BLE001 - a run that cannot even start is a failed apply, as online
            return outcome(BundleResult.APPLY_FAILED, "apply-failed", f"the run could not be started: {exc}")
        if not result.ok:
            message = "; ".join(result.failures) or f"the run ended {result.status}"
            return outcome(BundleResult.APPLY_FAILED, "apply-failed", message, result)
        return outcome(BundleResult.APPLIED, None, f"generation {state.generation} applied", result)

    def _stage_artifacts(self, unpacked: UnpackedBundle) -> None:
        def warn(message: str) -> None:
            self.log.warning("artifact-store-warning", detail=message)

        for staged in stage_artifacts(unpacked, self.policy, warn):
            self.log.info("artifact-staged", **staged)

    def _applier(self, unpacked: UnpackedBundle, tree: Path) -> Any:
        options: dict[str, Any] = {
            "state_dir": self.record_dir,
            "node_id": self.node_id,
            "policy_path": self.policy.source,
            "keep_runs": self.keep_runs,
            "extravars": {"meridian_bundle_dir": str(tree)},
        }
        collections = [path for path in unpacked.files if path.startswith("collection/")]
        if collections:
            playbook = tree / "playbooks" / BUNDLE_PLAYBOOK
            if not playbook.is_file():
                raise ValueError(
                    f"bundle {unpacked.verified.bundle.bundle_id} ships playbooks/ without "
                    f"playbooks/{BUNDLE_PLAYBOOK}, the entry point a bundle's playbooks must have"
                )
            options["playbook"] = playbook
            options["collections_path"] = _install_collection(tree / collections[0], Path(unpacked.directory))
        return self.make_applier(**options)

    def _file(self, outcome: BundleOutcome) -> BundleOutcome:
        """Move the entry to processed/ or rejected/ and write its reason file beside it; never overwrite."""
        folder = self.inbox / (REJECTED_DIR if outcome.result == BundleResult.REJECTED else PROCESSED_DIR)
        try:
            folder.mkdir(mode=0o750)
            if self.file_group != -1:
                os.chown(folder, -1, self.file_group, follow_symlinks=False)
        except FileExistsError:
            if not folder.is_dir() or folder.is_symlink():
                raise NotADirectoryError(
                    f"{folder} is not a directory: remove it, the inbox files bundles there"
                ) from None
        now = self.clock()
        target = folder / outcome.name
        if os.path.lexists(target) or os.path.lexists(f"{target}.reason.json"):
            target = folder / f"{outcome.name}-{now.strftime('%Y%m%dT%H%M%S.%fZ')}"
        (self.inbox / outcome.name).rename(target)
        reason = {
            "result": outcome.result.value,
            "reason": outcome.reason,
            "message": outcome.message,
            "member": outcome.member,
            "bundle_id": outcome.bundle_id,
            "generation": outcome.generation,
            "run_ident": None if outcome.run is None else outcome.run.ident,
            "at": format_rfc3339(now),
        }
        atomic_write(
            Path(f"{target}.reason.json"),
            json.dumps(reason, indent=2).encode() + b"\n",
            mode=0o640,
            group=self.file_group,
        )
        return replace(outcome, filed_as=target)


def _fingerprint(path: Path) -> tuple[int, int, int] | None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def _shadowing_collection(unpacked: UnpackedBundle) -> str | None:
    """Why the bundle's collection may not run, or None: it must not be ``meridian.node`` itself.

    The host's own meridian.node verifies the state and records what was applied; a shipped copy would
    replace that code for those steps. The host's collection comes first on the collections path anyway
    (``Applier``), so a shipped meridian.node would be dead weight that operators believe runs: it is
    refused, and a new meridian.node reaches air-gapped hosts as the host's package, as everywhere else.
    """
    tarballs = [path for path in unpacked.files if path.startswith("collection/")]
    if not tarballs:
        return None
    try:
        namespace, name = _collection_identity(Path(unpacked.files[tarballs[0]]))
    except (OSError, ValueError, tarfile.TarError) as exc:
        return f"the bundle's {tarballs[0]} is not a collection tarball ansible-galaxy builds: {exc}"
    if (namespace, name) == ("meridian", "node"):
        return (
            f"the bundle's {tarballs[0]} is the meridian.node collection itself, which would replace the host's "
            "own verifier and record keeping: ship site additions as a collection of their own, and upgrade "
            "meridian.node as the host's package"
        )
    return None


def _collection_identity(tarball: Path) -> tuple[str, str]:
    """``(namespace, name)`` from the tarball's MANIFEST.json (``ansible-galaxy collection build`` writes it
    first); at most a few members are looked at and 1 MiB of the manifest read."""
    with tarfile.open(tarball, mode="r:gz") as tar:
        for _ in range(_MANIFEST_SEARCH_MEMBERS):
            member = tar.next()
            if member is None:
                break
            if member.name.removeprefix("./") != "MANIFEST.json" or not member.isfile():
                continue
            handle = tar.extractfile(member)
            if handle is None or member.size > _MAX_COLLECTION_MANIFEST_BYTES:
                raise ValueError(f"MANIFEST.json is larger than {_MAX_COLLECTION_MANIFEST_BYTES} bytes")
            document = json.loads(handle.read())
            info = document.get("collection_info") if isinstance(document, dict) else None
            namespace = info.get("namespace") if isinstance(info, dict) else None
            name = info.get("name") if isinstance(info, dict) else None
            if not isinstance(namespace, str) or not isinstance(name, str):
                raise ValueError("MANIFEST.json names no collection_info.namespace and name")
            return namespace, name
    raise ValueError(f"no MANIFEST.json among its first {_MANIFEST_SEARCH_MEMBERS} members")


def _install_collection(tarball: Path, work: Path) -> Path:
    """``ansible-galaxy collection install`` of the bundle's tarball into a private directory in scratch,
    offline: it checks the tarball's own FILES.json digests, and never touches the host's collections."""
    target = work / "collections"
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    command = [str(galaxy) if galaxy.exists() else "ansible-galaxy", "collection", "install", "--offline"]
    completed = subprocess.run(
        [*command, "--no-deps", "-p", str(target), str(tarball)],
        capture_output=True,
        text=True,
        timeout=_COLLECTION_INSTALL_S,
        check=False,
        env={**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(target), "ANSIBLE_NOCOLOR": "1"},
    )
    if completed.returncode != 0:
        detail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
        raise ValueError(f"the bundle's collection {tarball.name} does not install: {' '.join(detail)}")
    return target

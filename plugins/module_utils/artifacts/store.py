"""The content-addressed artifact store under the policy's ``store.path``: plan first, then apply.

Layout (``root`` is ``store.path``)::

    blobs/sha256/<hex>            verified content, read-only, one file per distinct sha256
    staging/<hex>.partial         downloads in progress (kept after a failed transfer, for resume)
    artifacts/<name>/<version>/   the manifest's tree, every file a hard link to its blob
    artifacts/<name>/current      symlink to <version>, switched atomically (new link + rename)
    index.json                    what was verified: versions (files, size, pinned, last_used) and the
                                  stat (size, inode, mtime) of every verified blob; written 0600
    .lock                         flock'd for the whole plan+apply of one run

How it fits together:
- ``Store.observe(name, version)`` reads the disk into a ``StoreState`` (I/O, no hashing).
- ``plan_artifact(manifest, ...)`` / ``plan_removal(...)`` (in ``artifacts.plan``, re-exported here) are
  pure: state in, ``ArtifactPlan`` out (what to fetch, re-hash, assemble, promote, evict). check_mode and
  diff report the plan without applying it.
- ``Store.apply(plan)`` performs it. ``ensure_artifact`` / ``remove_artifact`` wrap lock, observe, plan,
  apply for callers that just want it done.

Choices worth knowing:
- The lock is ``fcntl.flock`` on ``.lock``: the kernel drops it when the holder dies, so a killed run
  leaves nothing a restart must clear. The pid written into the file is for messages only.
- "Quick" verification (the default) trusts the index: a version is intact when every file is a hard
  link to its blob (same inode) and the blob still has the size, inode and mtime recorded when it was
  hashed. Nothing is re-read, so a re-run over 100 GB costs a few ``lstat`` calls. ``verify="full"``
  re-hashes every blob of the version; a bad blob is deleted, fetched again and the version re-linked.
- Quick verification is only sound if nobody but the store's writer can have changed what it trusts, so
  the store refuses to work (``StoreTrustError``, naming the path) unless: every directory looked up on
  the way to the root, symlinks followed, is owned by root or the effective uid and not writable by group
  or others unless sticky (sshd's StrictModes rule); the root, ``blobs/``, ``blobs/sha256``, ``staging/``,
  ``artifacts/`` and every ``artifacts/<name>/`` are owned by root or the effective uid and writable by
  nobody else; ``index.json`` and ``.lock`` likewise, and no more than 0644. Root is accepted beside the
  effective uid because root can change anything anyway: in production the writer is root, and an
  unprivileged reader (``artifact list``) gets past these checks and then a clear error for the 0600 index.
  ``check_trust`` runs on every observe and apply (a few ``lstat`` calls); ``relocate_to`` is the one
  exception, for a store left at the old default inside the agent's directory (see ``policy``): that
  directory is warned about, not refused, until the store moves.
- A blob another user owns, that its group or others can write, or that has more hard links than the
  store made is never taken as verified: it is re-ingested (see ``artifacts.plan``). A version directory
  another user owns or can write is not intact and is assembled again.
- ``artifacts/<name>/current`` is read through ``artifacts.layout.current_version``, the rule engines mount
  by too, which checks the link on its resolved path: anything but a version directory right beside it is
  refused, naming the link and its target.
- A blob present on disk but not in the index (a crash between rename and index write) is re-hashed
  and adopted rather than downloaded again.
- Paths are validated again here even though the contracts already did: ``model_construct`` and
  future callers can skip validation, and the check is cheap. The store also refuses to work through a
  symlink it did not make (an ``artifacts/<name>`` that is a symlink, a symlink where a manifest file or
  directory would go): someone put it there, and following it could write outside the store.
- A version is assembled in a fresh temporary directory beside its final place and renamed in, so a
  reader never sees half a version. Replacing an existing (damaged) version swaps it out by two renames.
- Eviction happens before fetching, so the budget holds while downloading. It never touches pinned
  versions, the current version of any name, names in ``in_use``, or the version being installed. It
  deletes version directories and then every blob no version references any more.
- A version may not be called ``current``: that name is the switch.
- Partial downloads count against ``max_bytes``. A partial the plan resumes is never deleted; any
  other partial nobody has written to for ``PARTIAL_MAX_AGE`` (7 days: it outlives a long weekend's
  outage) is deleted by the next run of any artifact, and when the budget cannot be met after evicting
  every evictable version, the remaining foreign partials go (oldest first) before the run fails. Both
  are in the plan (``drop_partials``) and the diff, so check mode shows them and deletes nothing.
- Redirects are followed with a bound, never from https to http, and a resume's Range goes to the
  server that answers (see ``artifacts.fetch``).
- A local path that the signed manifest names (its ``url`` or ``base_url``, when no ``source`` is given)
  is read only inside the policy's ``store.local_sources`` (``Store.local_sources``; empty by default,
  so none), checked after ``realpath`` before anything changes, in check mode too
  (``check_locations``). A ``source`` the caller gives is its own instruction and is read as given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import pwd
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write, fsync_directory
from ansible_collections.meridian.node.plugins.module_utils._lockfile import open_private_lock
from ansible_collections.meridian.node.plugins.module_utils.artifacts import layout
from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import (
    ArtifactIntegrityError,
    ArtifactTransferError,
    DiskFullError,
    FetchConfig,
    FetchResult,
    check_manifest_location,
    fetch_file,
    hash_file,
    resolve_location,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import (
    CURRENT,
    SHA256,
    ArtifactPathError,
    ArtifactStoreError,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.plan import (
    _BLOB_MODE,
    _DIR_MODE,
    _FORMAT,
    INDEX_FILE,
    LOCK_FILE,
    PARTIAL_MAX_AGE,
    ArtifactPlan,
    BlobRecord,
    Eviction,
    FetchStep,
    PartialDrop,
    PartialFile,
    Reingest,
    StoreLockedError,
    StoreState,
    StoreTrustError,
    VersionRecord,
    _check_relative,
    check_manifest_paths,
    plan_artifact,
    plan_removal,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import ArtifactManifest, format_rfc3339

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.trust.policy import StorePolicy

__all__ = [
    "CURRENT",
    "INDEX_FILE",
    "PARTIAL_MAX_AGE",
    "ArtifactIntegrityError",
    "ArtifactPathError",
    "ArtifactPlan",
    "ArtifactStoreError",
    "ArtifactTransferError",
    "BlobRecord",
    "DiskFullError",
    "Eviction",
    "FetchStep",
    "PartialDrop",
    "PartialFile",
    "Reingest",
    "Store",
    "StoreApplyResult",
    "StoreLockedError",
    "StoreOutcome",
    "StoreState",
    "StoreTrustError",
    "VersionRecord",
    "check_manifest_paths",
    "ensure_artifact",
    "plan_artifact",
    "plan_removal",
    "remove_artifact",
]

# --- the store (I/O) -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreApplyResult:
    changed: bool
    fetched: tuple[FetchResult, ...] = ()
    rehashed: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()  # blobs that failed a re-hash and were fetched again
    evicted: tuple[str, ...] = ()
    removed_blobs: tuple[str, ...] = ()
    dropped_partials: tuple[str, ...] = ()  # sha256 of the partial downloads deleted
    reingested: tuple[str, ...] = ()  # untrusted blobs copied into a fresh, verified inode
    promoted: bool = False


@dataclass
class Store:
    """The store at ``root``. ``clock`` is read once per apply, for ``last_used``/``verified_at``.

    ``relocate_to`` is set (by ``for_policy``) only for a store left at the old default path inside the
    agent's directory: that one directory is then warned about rather than refused, and the warning says
    how to move the store there.

    ``local_sources`` are the directories (the policy's ``store.local_sources``) inside which a signed
    manifest may name local files; empty, it may name none.
    """

    root: str
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    relocate_to: str | None = None
    local_sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.root = os.path.abspath(os.fspath(self.root))

    @classmethod
    def for_policy(cls, policy: StorePolicy) -> Store:
        """The store a policy's ``store`` section names (``policy.store``)."""
        return cls(policy.path, relocate_to=policy.relocate_to, local_sources=policy.local_sources)

    # paths
    @property
    def blobs_dir(self) -> str:
        return os.path.join(self.root, "blobs", "sha256")

    @property
    def staging_dir(self) -> str:
        return os.path.join(self.root, "staging")

    @property
    def artifacts_dir(self) -> str:
        return layout.artifacts_dir(self.root)

    def blob_path(self, sha: str) -> str:
        if not SHA256.match(sha):
            raise ArtifactPathError(f"sha256 {sha!r} is not 64 lowercase hex digits")
        return os.path.join(self.blobs_dir, sha)

    def staging_path(self, sha: str) -> str:
        self.blob_path(sha)  # validates the digest before it becomes part of a path
        return os.path.join(self.staging_dir, f"{sha}.partial")

    def version_dir(self, name: str, version: str) -> str:
        return layout.version_dir(self.root, name, version)

    # locking
    @contextlib.contextmanager
    def lock(self, timeout_s: float | None = None, poll_s: float = 0.05) -> Iterator[None]:
        """Hold the store's flock. ``timeout_s`` None waits as long as it takes."""
        self.check_trust()  # before creating anything: the path to the root must be ours to create in
        _makedirs(self.root)
        path = os.path.join(self.root, LOCK_FILE)
        # 0600 and the writer's own (an older one left open to others is replaced): the store's root is 0711,
        # so anyone could open a readable lock file by name and hold it.
        fd = open_private_lock(path)
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        holder = _read_small(path)
                        raise StoreLockedError(
                            f"the artifact store {self.root} is locked by another run ({holder or 'pid unknown'}) "
                            f"and it did not finish within {timeout_s} s; try again later"
                        ) from None
                    time.sleep(poll_s)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    # trust
    def check_trust(self) -> tuple[str, ...]:
        """Refuse a store that anyone but its user or root could have changed; return the warnings to show.

        Raises ``StoreTrustError`` (an owner or mode) or ``ArtifactPathError`` (a symlink in the store's
        own layout), naming the path. Parts that do not exist yet are skipped: the store creates them.
        """
        euid = os.geteuid()
        warnings: list[str] = []
        legacy_parent = os.path.realpath(os.path.dirname(self.root)) if self.relocate_to else None
        parent_problem = None
        for directory in _lookup_dirs(self.root):
            problem = _dir_problem(os.lstat(directory), euid, sticky_ok=True)
            if problem is None:
                continue
            if directory == legacy_parent:
                parent_problem = f"{directory} {problem}"
                continue
            raise StoreTrustError(
                f"refusing the artifact store {self.root}: {directory}, a directory on the way to it, {problem}, "
                "so whoever controls it can replace the store and swap the model files engines mount. Keep the "
                f"store under directories that only root can change, or fix {directory} "
                f"(chown root:root, chmod go-w) if that is safe"
            )
        if self.relocate_to is not None:
            warnings.append(_relocation_warning(self.root, self.relocate_to, parent_problem))
        for path in self._layout_dirs():
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(info.st_mode):
                raise ArtifactPathError(
                    f"{path} is a symlink; the store does not follow symlinks in its own layout. Remove it and "
                    "run again"
                )
            problem = _dir_problem(info, euid, sticky_ok=False)
            if problem is not None:
                raise StoreTrustError(self._tampered(path, problem, euid, "chmod 0755"))
        for name in (INDEX_FILE, LOCK_FILE):
            path = os.path.join(self.root, name)
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            problem = _file_problem(info, euid, limit=0o644)
            if problem is not None:
                raise StoreTrustError(self._tampered(path, problem, euid, "chmod 0600"))
        return tuple(warnings)

    def _layout_dirs(self) -> list[str]:
        fixed = [self.root, os.path.dirname(self.blobs_dir), self.blobs_dir, self.staging_dir, self.artifacts_dir]
        names = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(self.artifacts_dir):
                if entry.is_dir(follow_symlinks=False) or entry.is_symlink():
                    names.append(entry.path)
        return fixed + sorted(names)

    def _tampered(self, path: str, problem: str, euid: int, mode_fix: str) -> str:
        owner = "root:root" if euid == 0 else str(euid)
        return (
            f"refusing the artifact store {self.root}: {path} {problem}; only {_who(euid)} may change the "
            "store, or another user could swap the model files engines mount. Find out how it changed, then "
            f"fix it (chown {owner} {path}; {mode_fix} {path}) and run again"
        )

    # reading
    def observe(self, name: str | None = None, version: str | None = None) -> StoreState:
        """Read index and disk; with ``name``/``version``, also check that version's directory."""
        observed_at = self.clock()
        self.check_trust()
        index = self._load_index()
        versions = index["versions"]
        blobs = index["blobs"]
        present: dict[str, BlobRecord] = {}
        stats: dict[str, os.stat_result] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.blobs_dir):
                if SHA256.match(entry.name) and entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    present[entry.name] = BlobRecord(info.st_size, info.st_ino, info.st_mtime_ns)
                    stats[entry.name] = info
        links = _links_under(self.artifacts_dir) if stats else {}
        euid = os.geteuid()
        untrusted = {sha: why for sha, info in stats.items() if (why := _blob_problem(info, euid, links)) is not None}
        partial: dict[str, PartialFile] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.staging_dir):
                sha = entry.name.removesuffix(".partial")
                if sha != entry.name and SHA256.match(sha) and entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    partial[sha] = PartialFile(info.st_size, datetime.fromtimestamp(info.st_mtime_ns / 1e9, UTC))
        current: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.artifacts_dir):
                if entry.is_dir(follow_symlinks=False):
                    points_at = layout.current_version(self.root, entry.name)
                    if points_at is not None:
                        current[entry.name] = points_at
        state = StoreState(
            root=self.root,
            versions=versions,
            blobs=blobs,
            present=present,
            current=current,
            partial=partial,
            observed_at=observed_at,
            untrusted=untrusted,
        )
        if name is None or version is None:
            return state
        intact, exists, conflicts = self._inspect_version(state, name, version)
        return dataclasses.replace(state, intact=intact, version_dir_exists=exists, conflicts=conflicts)

    def list_versions(self) -> list[dict[str, Any]]:
        """Every recorded version (for ``artifact list``): name, version, size, pinned, last_used, current."""
        state = self.observe()
        rows = []
        for (name, version), record in sorted(state.versions.items()):
            rows.append(
                {
                    "name": name,
                    "version": version,
                    "size": record.size,
                    "pinned": record.pinned,
                    "last_used": format_rfc3339(record.last_used),
                    "current": state.current.get(name) == version,
                }
            )
        return rows

    def _inspect_version(self, state: StoreState, name: str, version: str) -> tuple[bool, bool, tuple[str, ...]]:
        name_dir = os.path.join(self.artifacts_dir, name)
        if os.path.islink(name_dir):
            return False, False, (name_dir,)
        base = self.version_dir(name, version)
        if os.path.islink(base):
            return False, True, (base,)
        if not os.path.isdir(base):
            return False, False, ()
        record = state.versions.get((name, version))
        files = record.files if record else ()
        conflicts: list[str] = []
        # A directory someone else can write may hold anything by now: assemble the version afresh.
        intact = record is not None and _dirs_are_ours(base, os.geteuid())
        for path, sha, size in files:
            target = base
            for part in path.split("/"):
                target = os.path.join(target, part)
                if os.path.islink(target):
                    conflicts.append(target)
                    break
            try:
                info = os.lstat(target)
            except OSError:
                intact = False
                continue
            blob = state.present.get(sha)
            if (
                blob is None
                or sha in state.untrusted
                or state.blobs.get(sha) != blob
                or info.st_ino != blob.ino
                or info.st_size != size
            ):
                intact = False
        if record is None:
            conflicts.extend(_symlinks_under(base))
        return intact and not conflicts, True, tuple(conflicts)

    def _load_index(self) -> dict[str, Any]:
        path = os.path.join(self.root, INDEX_FILE)
        try:
            with open(path, "rb") as handle:
                raw = json.load(handle)
        except FileNotFoundError:
            return {"versions": {}, "blobs": {}}
        except PermissionError as exc:
            # Still an OSError, so callers that skip an unreadable store (the agent's observer) keep doing so.
            raise PermissionError(
                exc.errno,
                f"the store index {path} is readable by root only (the store writes it 0600); run this as root "
                "(for example sudo meridian-node artifact list)",
            ) from exc
        except (OSError, ValueError) as exc:
            raise ArtifactStoreError(
                f"the store index {path} cannot be read ({exc}); move it aside and run again: blobs on disk are "
                "re-hashed and adopted, nothing is downloaded twice"
            ) from exc
        try:
            if raw.get("format") != _FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {_FORMAT}")
            blobs = {
                sha: BlobRecord(int(b["size"]), int(b["ino"]), int(b["mtime_ns"])) for sha, b in raw["blobs"].items()
            }
            versions = {}
            for name, by_version in raw["versions"].items():
                for version, v in by_version.items():
                    versions[(name, version)] = VersionRecord(
                        name=name,
                        version=version,
                        manifest_sha256=str(v["manifest_sha256"]),
                        files=tuple((str(p), str(s), int(n)) for p, s, n in v["files"]),
                        size=int(v["size"]),
                        pinned=bool(v["pinned"]),
                        last_used=datetime.fromisoformat(v["last_used"]),
                        verified_at=datetime.fromisoformat(v["verified_at"]),
                    )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactStoreError(
                f"the store index {path} is damaged ({type(exc).__name__}: {exc}); move it aside and run again"
            ) from exc
        return {"versions": versions, "blobs": blobs}

    def _write_index(self, versions: Mapping[tuple[str, str], VersionRecord], blobs: Mapping[str, BlobRecord]) -> None:
        document: dict[str, Any] = {"format": _FORMAT, "blobs": {}, "versions": {}}
        for sha, blob in sorted(blobs.items()):
            document["blobs"][sha] = {"size": blob.size, "ino": blob.ino, "mtime_ns": blob.mtime_ns}
        for (name, version), record in sorted(versions.items()):
            document["versions"].setdefault(name, {})[version] = {
                "manifest_sha256": record.manifest_sha256,
                "files": [list(item) for item in record.files],
                "size": record.size,
                "pinned": record.pinned,
                "last_used": format_rfc3339(record.last_used),
                "verified_at": format_rfc3339(record.verified_at),
            }
        # Root-only: nothing in it is secret, but no one else has any business with what the store trusts.
        atomic_write(os.path.join(self.root, INDEX_FILE), json.dumps(document, indent=1).encode(), mode=0o600)

    # applying
    def apply(self, plan: ArtifactPlan, config: FetchConfig | None = None) -> StoreApplyResult:
        """Carry out ``plan``. Call it under ``lock()`` with a plan made from a state observed under it."""
        try:
            return self._apply(plan, config or FetchConfig())
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    plan.name,
                    f"the disk is full: no space left under the artifact store {self.root} ({exc}); free space "
                    "there (or lower store.max_bytes) and run again",
                ) from exc
            if exc.errno == errno.EROFS:
                hint = (
                    f"; it is still at the old default path, which the apply unit may not write: move it to "
                    f"{self.relocate_to} (see the warning)"
                    if self.relocate_to
                    else "; give the apply unit write access to it (ReadWritePaths=) or set store.path"
                )
                raise ArtifactStoreError(f"the artifact store {self.root} is read-only here ({exc}){hint}") from exc
            raise

    def check_locations(self, plan: ArtifactPlan) -> dict[str, str]:
        """sha256 -> where to read it, for every file ``plan`` fetches; ``ArtifactSourceError`` for one that
        may not be read (a local path from the manifest outside ``local_sources``). Reads no file content."""
        return {step.sha256: self._readable(plan, step.location, step.path) for step in plan.fetch}

    def _readable(self, plan: ArtifactPlan, location: str, path: str) -> str:
        if plan.source:
            return location  # the caller's own source: read as given
        return check_manifest_location(location, path, self.local_sources)

    def _apply(self, plan: ArtifactPlan, config: FetchConfig) -> StoreApplyResult:
        """The plan's steps in order; the index is written after each step that changed what it records, so a
        run cut short leaves an index that describes the disk."""
        now = self.clock()
        # Before anything changes: a refused location must not cost an eviction.
        locations = self.check_locations(plan)
        for directory in (
            self.root,
            os.path.dirname(self.blobs_dir),
            self.blobs_dir,
            self.staging_dir,
            self.artifacts_dir,
        ):
            _makedirs(directory)
        self.check_trust()
        index = _IndexInProgress(self, self._load_index())
        evicted, removed_blobs, dropped = self._make_room(plan, index)
        if plan.state == "absent" or plan.manifest is None:
            return StoreApplyResult(
                changed=plan.changed,
                evicted=tuple(evicted),
                removed_blobs=tuple(removed_blobs),
                dropped_partials=dropped,
            )
        manifest = plan.manifest
        check_manifest_paths(manifest)
        sources = _Sources.of(manifest)
        repairs = self._repair_blobs(plan, sources, index, config)
        fetched = self._fetch_blobs([*plan.fetch, *repairs.refetch], locations, index, config)
        if plan.assemble or repairs.repaired or not self.observe(manifest.name, manifest.version).intact:
            self._assemble(manifest)
        changed_record, swept = self._record_version(
            plan, manifest, sources, index, now, bool(fetched or repairs.rehashed)
        )
        removed_blobs += swept
        promoted = False
        if plan.promote:
            self._switch_current(manifest.name, manifest.version)
            promoted = True
        changed = bool(
            fetched
            or repairs.repaired
            or repairs.reingested
            or evicted
            or removed_blobs
            or dropped
            or promoted
            or changed_record
            or plan.assemble
        )
        return StoreApplyResult(
            changed=changed,
            fetched=tuple(fetched),
            rehashed=tuple(repairs.rehashed),
            repaired=tuple(repairs.repaired),
            evicted=tuple(evicted),
            removed_blobs=tuple(removed_blobs),
            dropped_partials=dropped,
            reingested=tuple(repairs.reingested),
            promoted=promoted,
        )

    def _make_room(self, plan: ArtifactPlan, index: _IndexInProgress) -> tuple[list[str], list[str], tuple[str, ...]]:
        """Evictions, the removal the plan asks for, stale partials, then the blobs nothing uses any more:
        before any fetch, so the budget holds while downloading. (evicted, removed blobs, dropped partials)."""
        evicted: list[str] = []
        for eviction in plan.evict:
            index.versions.pop((eviction.name, eviction.version), None)
            index.write()
            self._remove_version_dir(eviction.name, eviction.version)
            evicted.append(f"{eviction.name}/{eviction.version}")
        if plan.remove:
            link = os.path.join(self.artifacts_dir, plan.name, CURRENT)
            if os.path.islink(link) and os.readlink(link) == plan.version:
                _remove_link(link)
                fsync_directory(os.path.dirname(link))
            index.versions.pop((plan.name, plan.version), None)
            index.write()
            self._remove_version_dir(plan.name, plan.version)
        dropped = self._drop_partials(plan)
        keep = index.referenced()
        if plan.manifest is not None:
            keep.update(entry.sha256 for entry in plan.manifest.files)
        removed_blobs = self._sweep_blobs(keep, index.blobs) if (plan.evict or plan.remove) else []
        if removed_blobs:
            index.write()
        return evicted, removed_blobs, dropped

    def _repair_blobs(
        self, plan: ArtifactPlan, sources: _Sources, index: _IndexInProgress, config: FetchConfig
    ) -> _Repairs:
        """Re-hash what the plan distrusts and re-ingest untrusted blobs; what fails either is deleted and
        fetched again like a missing blob (``_Repairs.refetch``)."""
        repairs = _Repairs()
        for sha in plan.rehash:
            blob = self.blob_path(sha)
            digest, size = hash_file(blob, config.chunk_size)
            repairs.rehashed.append(sha)
            if digest == sha and size == sources.size(sha):
                index.blobs[sha] = _stat_blob(blob)
                continue
            _unlink(blob)
            index.blobs.pop(sha, None)
            repairs.repaired.append(sha)
            repairs.refetch.append(self._refetch_step(plan, sources, sha))
        if plan.rehash:
            index.write()
        for item in plan.reingest:
            _size, path, _url = sources.first[item.sha256]
            if self._reingest(item.sha256, sources.size(item.sha256), path, config):
                index.blobs[item.sha256] = _stat_blob(self.blob_path(item.sha256))
                repairs.reingested.append(item.sha256)
                continue
            index.blobs.pop(item.sha256, None)
            repairs.repaired.append(item.sha256)
            repairs.refetch.append(self._refetch_step(plan, sources, item.sha256))
        if plan.reingest:
            index.write()
        return repairs

    def _refetch_step(self, plan: ArtifactPlan, sources: _Sources, sha: str) -> FetchStep:
        size, path, url = sources.first[sha]
        location = resolve_location(plan.source, path, file_url=url, base_url=sources.base_url)
        return FetchStep(sha, size, path, self._readable(plan, location, path), 0)

    def _fetch_blobs(
        self, steps: Sequence[FetchStep], locations: Mapping[str, str], index: _IndexInProgress, config: FetchConfig
    ) -> list[FetchResult]:
        """Each blob through the verifying fetcher into staging, then renamed into ``blobs/`` read-only."""
        fetched: list[FetchResult] = []
        for step in steps:
            staging = self.staging_path(step.sha256)
            result = fetch_file(
                locations.get(step.sha256, step.location),
                path=step.path,
                size=step.size,
                sha256=step.sha256,
                staging_path=staging,
                config=config,
            )
            blob = self.blob_path(step.sha256)
            os.chmod(staging, _BLOB_MODE)
            os.replace(staging, blob)
            fsync_directory(self.blobs_dir)
            index.blobs[step.sha256] = _stat_blob(blob)
            index.write()
            fetched.append(result)
        return fetched

    def _record_version(
        self,
        plan: ArtifactPlan,
        manifest: ArtifactManifest,
        sources: _Sources,
        index: _IndexInProgress,
        now: datetime,
        verified_now: bool,
    ) -> tuple[bool, list[str]]:
        """The version's index record (files, size, pin, last used, verified at); (record changed, blobs swept
        because the version's content changed under the same name)."""
        name, version = manifest.name, manifest.version
        previous = index.versions.get((name, version))
        files = tuple((entry.path, entry.sha256, entry.size) for entry in manifest.files)
        changed_record = previous is None or previous.files != files or previous.pinned != plan.pin
        verified_at = now if (previous is None or verified_now or previous.files != files) else previous.verified_at
        index.versions[(name, version)] = VersionRecord(
            name=name,
            version=version,
            manifest_sha256=plan.manifest_sha256 or "",
            files=files,
            size=sources.total_size(),
            pinned=plan.pin,
            last_used=now,
            verified_at=verified_at,
        )
        index.write()
        swept: list[str] = []
        if previous is not None and previous.files != files:
            swept = self._sweep_blobs(index.referenced(), index.blobs)
            index.write()
        return changed_record, swept

    def _reingest(self, sha: str, size: int, path: str, config: FetchConfig) -> bool:
        """Copy an untrusted blob through the verifying fetcher into a fresh inode; False if it is bad.

        The copy is hashed as it is read, so a writer changing the blob meanwhile only makes it fail; the
        new inode has no link the store did not make, and is the store's own, 0444. A bad blob is deleted.
        """
        blob, staging = self.blob_path(sha), self.staging_path(sha)
        _unlink(staging)  # a partial of a blob already held resumes nothing: copy from byte 0
        try:
            fetch_file(
                blob,
                path=path,
                size=size,
                sha256=sha,
                staging_path=staging,
                config=dataclasses.replace(config, progress=None, attempts=1),
            )
        except (ArtifactIntegrityError, ArtifactTransferError):
            _unlink(staging)
            _unlink(blob)
            fsync_directory(self.blobs_dir)
            return False
        os.chmod(staging, _BLOB_MODE)
        os.replace(staging, blob)
        fsync_directory(self.blobs_dir)
        return True

    def _drop_partials(self, plan: ArtifactPlan) -> tuple[str, ...]:
        """Delete the partial downloads the plan gave up on (before fetching, so the budget holds meanwhile)."""
        resumed = {step.sha256 for step in plan.fetch}
        if plan.manifest is not None:
            resumed.update(entry.sha256 for entry in plan.manifest.files)
        dropped = []
        for drop in plan.drop_partials:
            if drop.sha256 in resumed:
                raise RuntimeError(f"plan drops the partial download {drop.sha256} it also needs; this is a bug")
            _unlink(self.staging_path(drop.sha256))
            dropped.append(drop.sha256)
        if dropped:
            fsync_directory(self.staging_dir)
        return tuple(dropped)

    def _assemble(self, manifest: ArtifactManifest) -> None:
        name_dir = os.path.join(self.artifacts_dir, manifest.name)
        if os.path.islink(name_dir):
            raise ArtifactPathError(f"{name_dir} is a symlink the store did not create; remove it and run again")
        _makedirs(name_dir)
        _clear_leftovers(name_dir)
        final = self.version_dir(manifest.name, manifest.version)
        build = tempfile.mkdtemp(prefix=f".{manifest.version}.build-", dir=name_dir)
        try:
            os.chmod(build, _DIR_MODE)
            for entry in manifest.files:
                target = _safe_target(build, entry.path)
                os.link(self.blob_path(entry.sha256), target, follow_symlinks=False)
            for directory, _dirs, _files in os.walk(build):
                fsync_directory(directory)
            if os.path.lexists(final):
                if os.path.islink(final):
                    raise ArtifactPathError(f"{final} is a symlink the store did not create; remove it and run again")
                trash = tempfile.mkdtemp(prefix=f".{manifest.version}.old-", dir=name_dir)
                os.rename(final, os.path.join(trash, "v"))
                os.rename(build, final)
                shutil.rmtree(trash)
            else:
                os.rename(build, final)
            fsync_directory(name_dir)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise

    def _switch_current(self, name: str, version: str) -> None:
        name_dir = os.path.join(self.artifacts_dir, name)
        link = os.path.join(name_dir, CURRENT)
        if os.path.lexists(link) and not os.path.islink(link):
            raise ArtifactPathError(f"{link} is not a symlink; the store only replaces its own switch")
        temp = os.path.join(name_dir, f".{CURRENT}.{os.getpid()}.tmp")
        _remove_link(temp)
        os.symlink(version, temp)
        os.replace(temp, link)
        fsync_directory(name_dir)

    def _remove_version_dir(self, name: str, version: str) -> None:
        final = self.version_dir(name, version)
        if os.path.islink(final):
            _unlink(final)
        elif os.path.isdir(final):
            name_dir = os.path.dirname(final)
            trash = tempfile.mkdtemp(prefix=f".{version}.evict-", dir=name_dir)
            os.rename(final, os.path.join(trash, "v"))
            fsync_directory(name_dir)
            shutil.rmtree(trash)
        name_dir = os.path.join(self.artifacts_dir, name)
        with contextlib.suppress(OSError):
            os.rmdir(name_dir)  # only succeeds once nothing (no current link, no version) is left

    def _sweep_blobs(self, keep: set[str], blobs: dict[str, BlobRecord]) -> list[str]:
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.blobs_dir):
                if entry.name not in keep:
                    _unlink(entry.path)
                    blobs.pop(entry.name, None)
                    removed.append(entry.name)
        for sha in [sha for sha in blobs if sha not in keep]:
            blobs.pop(sha)
        if removed:
            fsync_directory(self.blobs_dir)
        return sorted(removed)


# --- one-call helpers ----------------------------------------------------------------------------------


@dataclass
class _IndexInProgress:
    """The index as one apply changes it: its versions and blobs, written back after each step."""

    store: Store
    document: dict[str, Any]
    versions: dict[tuple[str, str], VersionRecord] = field(init=False)
    blobs: dict[str, BlobRecord] = field(init=False)

    def __post_init__(self) -> None:
        self.versions = dict(self.document["versions"])
        self.blobs = dict(self.document["blobs"])

    def write(self) -> None:
        self.store._write_index(self.versions, self.blobs)

    def referenced(self) -> set[str]:
        return {sha for record in self.versions.values() for sha in record.digests}


@dataclass(frozen=True)
class _Sources:
    """Per distinct sha256 of a manifest, its first file: (size, path, url), where a repair fetches it from."""

    first: Mapping[str, tuple[int, str, str | None]]
    base_url: str | None

    @classmethod
    def of(cls, manifest: ArtifactManifest) -> _Sources:
        first: dict[str, tuple[int, str, str | None]] = {}
        for entry in manifest.files:
            first.setdefault(entry.sha256, (entry.size, entry.path, entry.url))
        return cls(first, manifest.base_url)

    def size(self, sha: str) -> int:
        return self.first[sha][0]

    def total_size(self) -> int:
        """The bytes the version holds on disk: each distinct blob once."""
        return sum(size for size, _path, _url in self.first.values())


@dataclass
class _Repairs:
    rehashed: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # failed a re-hash or a re-ingest: fetched again
    reingested: list[str] = field(default_factory=list)
    refetch: list[FetchStep] = field(default_factory=list)


@dataclass(frozen=True)
class StoreOutcome:
    plan: ArtifactPlan
    result: StoreApplyResult | None  # None in check mode

    @property
    def changed(self) -> bool:
        return self.result.changed if self.result is not None else self.plan.changed


def ensure_artifact(
    store: Store,
    manifest: ArtifactManifest,
    *,
    manifest_sha256: str,
    source: str | None = None,
    pin: bool = False,
    promote: bool = True,
    verify: str = "quick",
    max_bytes: int | None = None,
    in_use: Sequence[str] = (),
    config: FetchConfig | None = None,
    check_mode: bool = False,
    lock_timeout_s: float | None = None,
) -> StoreOutcome:
    """Lock, observe, plan and (unless ``check_mode``) apply: the whole ``state: present`` run."""
    options: dict[str, Any] = {
        "manifest_sha256": manifest_sha256,
        "source": source,
        "pin": pin,
        "promote": promote,
        "verify": verify,
        "max_bytes": max_bytes,
        "in_use": frozenset(in_use),
    }
    if check_mode:
        # The index is replaced atomically, so an unlocked read sees a consistent (if soon stale) store.
        state = store.observe(manifest.name, manifest.version)
        plan = plan_artifact(manifest, state, **options)
        store.check_locations(plan)  # check mode fails where the real run would refuse a location
        return StoreOutcome(plan, None)
    with store.lock(lock_timeout_s):
        state = store.observe(manifest.name, manifest.version)
        plan = plan_artifact(manifest, state, **options)
        return StoreOutcome(plan, store.apply(plan, config))


def remove_artifact(
    store: Store,
    name: str,
    version: str,
    *,
    in_use: Sequence[str] = (),
    check_mode: bool = False,
    lock_timeout_s: float | None = None,
) -> StoreOutcome:
    """Lock, observe, plan and apply ``state: absent`` for one version."""
    if check_mode:
        return StoreOutcome(plan_removal(name, version, store.observe(name, version), in_use=frozenset(in_use)), None)
    with store.lock(lock_timeout_s):
        plan = plan_removal(name, version, store.observe(name, version), in_use=frozenset(in_use))
        return StoreOutcome(plan, store.apply(plan))


# --- small helpers -------------------------------------------------------------------------------------


def _safe_target(base: str, path: str) -> str:
    """Where ``path`` goes under ``base``, creating parents; refuses symlinks and anything outside."""
    _check_relative(path)
    parts = path.split("/")
    current = base
    for part in parts[:-1]:
        current = os.path.join(current, part)
        try:
            os.mkdir(current, _DIR_MODE)
        except FileExistsError:
            if os.path.islink(current) or not os.path.isdir(current):
                raise ArtifactPathError(f"{current} is a symlink or a file where a directory should be") from None
    target = os.path.join(current, parts[-1])
    if os.path.lexists(target):
        raise ArtifactPathError(f"{target} already exists (a symlink or a colliding path); refusing to overwrite it")
    real_base = os.path.realpath(base)
    if os.path.commonpath([real_base, os.path.realpath(target)]) != real_base:
        raise ArtifactPathError(f"path {path!r} resolves outside its version directory {base}")
    return target


def _clear_leftovers(name_dir: str) -> None:
    """Remove build, swap and link temporaries a killed run left behind (we hold the lock: none is live)."""
    for entry in os.scandir(name_dir):
        if entry.name.startswith(".") and any(mark in entry.name for mark in (".build-", ".old-", ".evict-")):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                _unlink(entry.path)
        elif entry.name.startswith(f".{CURRENT}.") and entry.name.endswith(".tmp"):
            _unlink(entry.path)


def _symlinks_under(base: str) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(base):
        for entry in dirs + files:
            full = os.path.join(directory, entry)
            if os.path.islink(full):
                found.append(full)
    return sorted(found)


def _stat_blob(path: str) -> BlobRecord:
    info = os.lstat(path)
    return BlobRecord(info.st_size, info.st_ino, info.st_mtime_ns)


# The kernel's own bound on symlinks followed in one lookup (ELOOP).
_MAX_SYMLINKS = 40


def _lookup_dirs(path: str) -> list[str]:
    """Every directory a name is looked up in while resolving ``path`` the kernel's way, in order.

    Checking only the ancestors of ``realpath(path)`` would miss a directory that holds a symlink on the
    way, and whoever can write that directory can re-point the link. Resolution stops at the first
    missing component: the store creates the rest itself, in the last directory listed.
    """
    pending = list(reversed(path.split("/")))
    current = "/"
    looked_in: list[str] = []
    hops = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        if current not in looked_in:
            looked_in.append(current)
        candidate = os.path.join(current, part)
        try:
            mode = os.lstat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break
        if not stat.S_ISLNK(mode):
            current = candidate
            continue
        hops += 1
        if hops > _MAX_SYMLINKS:
            raise ArtifactPathError(f"resolving {path} follows more than {_MAX_SYMLINKS} symlinks (a loop?)")
        target = os.readlink(candidate)
        if target.startswith("/"):
            current = "/"
        pending.extend(reversed(target.split("/")))
    return looked_in


def _dir_problem(info: os.stat_result, euid: int, *, sticky_ok: bool) -> str | None:
    """Why another user could change entries in this directory; None when only root or ``euid`` can."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (0, euid):
        return f"is owned by {_who(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not (sticky_ok and mode & stat.S_ISVTX):
        return f"is writable by {_writers(mode)} (mode {mode:04o})"
    return None


def _file_problem(info: os.stat_result, euid: int, *, limit: int) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid not in (0, euid):
        return f"is owned by {_who(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & ~limit:
        return f"has mode {mode:04o}, more than the {limit:04o} the store allows"
    return None


def _blob_problem(info: os.stat_result, euid: int, links: Mapping[tuple[int, int], int]) -> str | None:
    """Why a blob's bytes may have changed behind its recorded stat; None when only root or ``euid`` could."""
    if info.st_uid not in (0, euid):
        return f"it is owned by {_who(info.st_uid)}"
    mode = stat.S_IMODE(info.st_mode)
    # The owner's write bit is left alone: the owner is root or the store's own user, who could write anyway.
    if mode & 0o022:
        return f"it is writable by {_writers(mode)} (mode {mode:04o}; the store makes blobs {_BLOB_MODE:04o})"
    ours = 1 + links.get((info.st_dev, info.st_ino), 0)
    if info.st_nlink > ours:
        return f"it has {info.st_nlink} hard links and only {ours} are the store's: another name for it exists"
    return None


def _links_under(directory: str) -> dict[tuple[int, int], int]:
    """How many names each file (device, inode) has under ``directory``, symlinks not followed."""
    counts: dict[tuple[int, int], int] = {}
    for base, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(base, name))
                if stat.S_ISREG(info.st_mode):
                    key = (info.st_dev, info.st_ino)
                    counts[key] = counts.get(key, 0) + 1
    return counts


def _dirs_are_ours(base: str, euid: int) -> bool:
    for directory, _dirs, _files in os.walk(base):
        with contextlib.suppress(OSError):
            if _dir_problem(os.lstat(directory), euid, sticky_ok=False) is not None:
                return False
    return True


def _who(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _relocation_warning(root: str, new: str, parent_problem: str | None) -> str:
    exposure = (
        f"{parent_problem}, so that user can swap the model files engines mount until the store moves"
        if parent_problem
        else "inside the agent's directory"
    )
    return (
        f"the artifact store is still at the old default {root}: the policy sets no store.path, and the "
        f"default moved to {new}, a directory of root's own, because {exposure}. To move it: stop the units "
        "(systemctl stop meridian-node.service meridian-node-apply.path meridian-node-apply.service); run "
        f"mv -T {root} {new} (it replaces the empty directory the apply unit creates there), "
        f"chown -R root:root {new} and chmod go-w {new}; start the units again. Engines mount the resolved "
        "version directory, so every engine that uses an artifact changes its mount source and is "
        "re-created, by its replace strategy, on its next converge"
    )


def _makedirs(path: str) -> None:
    if os.path.islink(path):
        raise ArtifactPathError(f"{path} is a symlink; the store does not follow symlinks in its own layout")
    os.makedirs(path, mode=_DIR_MODE, exist_ok=True)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_link(path: str) -> None:
    if os.path.islink(path):
        os.unlink(path)


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(100).strip()
    except OSError:
        return ""

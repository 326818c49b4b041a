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
- Quick verification is only sound if nobody but the store's writer can have changed what it trusts: the
  checks of who may change the store (its directories, index and lock, every directory on the way to it,
  each blob's owner, mode and links) are ``artifacts.store_trust``'s, run on every observe and apply.
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
  reader never sees half a version (``artifacts.version_tree``, which also switches ``current``).
- The index is read and written whole, atomically, 0600 (``artifacts.store_index``).
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
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._fileutil import fsync_directory
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
    check_manifest_paths,
    plan_artifact,
    plan_removal,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store_index import IndexInProgress, load_index
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store_trust import (
    check_store_trust,
    dirs_are_ours,
    untrusted_blobs,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.version_tree import (
    assemble_version,
    make_dir,
    remove_link,
    remove_version_dir,
    switch_current,
    symlinks_under,
    unlink_if_present,
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
        make_dir(self.root)
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
        """Refuse a store that anyone but its user or root could have changed; return the warnings to show
        (``store_trust.check_store_trust``, over this store's own directories)."""
        return check_store_trust(self.root, self._layout_dirs(), self.relocate_to)

    def _layout_dirs(self) -> list[str]:
        fixed = [self.root, os.path.dirname(self.blobs_dir), self.blobs_dir, self.staging_dir, self.artifacts_dir]
        names = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(self.artifacts_dir):
                if entry.is_dir(follow_symlinks=False) or entry.is_symlink():
                    names.append(entry.path)
        return fixed + sorted(names)

    # reading
    def observe(self, name: str | None = None, version: str | None = None) -> StoreState:
        """Read index and disk; with ``name``/``version``, also check that version's directory."""
        observed_at = self.clock()
        self.check_trust()
        index = load_index(self.root)
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
        untrusted = untrusted_blobs(stats, self.artifacts_dir)
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
        intact = record is not None and dirs_are_ours(base, os.geteuid())
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
            conflicts.extend(symlinks_under(base))
        return intact and not conflicts, True, tuple(conflicts)

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
            make_dir(directory)
        self.check_trust()
        index = IndexInProgress(self.root, load_index(self.root))
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
            switch_current(self.root, manifest.name, manifest.version)
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

    def _make_room(self, plan: ArtifactPlan, index: IndexInProgress) -> tuple[list[str], list[str], tuple[str, ...]]:
        """Evictions, the removal the plan asks for, stale partials, then the blobs nothing uses any more:
        before any fetch, so the budget holds while downloading. (evicted, removed blobs, dropped partials)."""
        evicted: list[str] = []
        for eviction in plan.evict:
            index.versions.pop((eviction.name, eviction.version), None)
            index.write()
            remove_version_dir(self.root, eviction.name, eviction.version)
            evicted.append(f"{eviction.name}/{eviction.version}")
        if plan.remove:
            link = os.path.join(self.artifacts_dir, plan.name, CURRENT)
            if os.path.islink(link) and os.readlink(link) == plan.version:
                remove_link(link)
                fsync_directory(os.path.dirname(link))
            index.versions.pop((plan.name, plan.version), None)
            index.write()
            remove_version_dir(self.root, plan.name, plan.version)
        dropped = self._drop_partials(plan)
        keep = index.referenced()
        if plan.manifest is not None:
            keep.update(entry.sha256 for entry in plan.manifest.files)
        removed_blobs = self._sweep_blobs(keep, index.blobs) if (plan.evict or plan.remove) else []
        if removed_blobs:
            index.write()
        return evicted, removed_blobs, dropped

    def _repair_blobs(
        self, plan: ArtifactPlan, sources: _Sources, index: IndexInProgress, config: FetchConfig
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
            unlink_if_present(blob)
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
        self, steps: Sequence[FetchStep], locations: Mapping[str, str], index: IndexInProgress, config: FetchConfig
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
        index: IndexInProgress,
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
        unlink_if_present(staging)  # a partial of a blob already held resumes nothing: copy from byte 0
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
            unlink_if_present(staging)
            unlink_if_present(blob)
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
            unlink_if_present(self.staging_path(drop.sha256))
            dropped.append(drop.sha256)
        if dropped:
            fsync_directory(self.staging_dir)
        return tuple(dropped)

    def _assemble(self, manifest: ArtifactManifest) -> None:
        links = [(entry.path, self.blob_path(entry.sha256)) for entry in manifest.files]
        assemble_version(self.root, manifest.name, manifest.version, links)

    def _sweep_blobs(self, keep: set[str], blobs: dict[str, BlobRecord]) -> list[str]:
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.blobs_dir):
                if entry.name not in keep:
                    unlink_if_present(entry.path)
                    blobs.pop(entry.name, None)
                    removed.append(entry.name)
        for sha in [sha for sha in blobs if sha not in keep]:
            blobs.pop(sha)
        if removed:
            fsync_directory(self.blobs_dir)
        return sorted(removed)


# --- one-call helpers ----------------------------------------------------------------------------------


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


def _stat_blob(path: str) -> BlobRecord:
    info = os.lstat(path)
    return BlobRecord(info.st_size, info.st_ino, info.st_mtime_ns)


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(100).strip()
    except OSError:
        return ""

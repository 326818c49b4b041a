"""Planning for the artifact store: what a run must fetch, re-hash, assemble, promote and evict.

Pure: a ``StoreState`` (what ``Store.observe`` read from disk) and a verified manifest in, an
``ArtifactPlan`` out. check_mode and diff report the plan; ``artifacts.store.Store.apply`` performs it.
The records and errors here are shared by both halves.

Partial downloads (``staging/<sha>.partial``) are part of the store's bytes. One the plan fetches is
resumed and never deleted; any other is deleted once it has not been written to for ``PARTIAL_MAX_AGE``
(reason ``stale``), and, when the budget cannot be met even after evicting every evictable version, the
remaining ones go oldest first before the plan gives up (reason ``budget``). Versions go before young
partials because an evicted version is a rollback target lost, while a young partial is only a resume
point; both cost a download to get back.

A blob that another user owns, that its group or others can write, or that has a hard link outside the
store is *untrusted* (``StoreState.untrusted``, with the reason): whoever has or had write access to it
could change its bytes behind the size, inode and mtime the index recorded. Quick verification never
takes it as verified. The plan re-ingests it (``reingest``): the store copies it through the verifying
fetcher into a fresh inode of its own, and fetches it from the source when the copy does not match.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import resolve_location
from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import (
    CURRENT,
    NAME,
    SHA256,
    VERSION,
    ArtifactPathError,
    ArtifactStoreError,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import ArtifactManifest, format_rfc3339

INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
_FORMAT = 1
# Engines in containers read model files under other uids; content is public to the host, not secret.
_DIR_MODE = 0o755
_BLOB_MODE = 0o444
# How long a partial download nobody resumes may stay. A week outlives a long weekend's outage (a transfer
# that failed on Friday evening and is retried on Tuesday still resumes) and a mirror that is down for
# days, and still bounds how long an abandoned download holds disk outside every version.
PARTIAL_MAX_AGE = timedelta(days=7)


class StoreLockedError(ArtifactStoreError):
    """Another run held the store lock for longer than the caller was willing to wait."""


class StoreTrustError(ArtifactStoreError):
    """A store directory or file is owned or writable by someone other than the store's user (or root)."""


# --- records -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlobRecord:
    """The stat of a blob at the moment it was hashed; a change means it must be hashed again."""

    size: int
    ino: int
    mtime_ns: int


@dataclass(frozen=True)
class VersionRecord:
    name: str
    version: str
    manifest_sha256: str
    files: tuple[tuple[str, str, int], ...]  # (path, sha256, size), manifest order
    size: int  # bytes of the distinct blobs this version uses
    pinned: bool
    last_used: datetime
    verified_at: datetime

    @property
    def digests(self) -> frozenset[str]:
        return frozenset(sha for _path, sha, _size in self.files)


@dataclass(frozen=True)
class PartialFile:
    """A ``staging/<sha>.partial`` file: its size and when it was last written to."""

    size: int
    modified: datetime


@dataclass(frozen=True)
class StoreState:
    """What ``Store.observe`` saw. ``intact``/``conflicts`` are about the one version observed."""

    root: str
    versions: Mapping[tuple[str, str], VersionRecord]
    blobs: Mapping[str, BlobRecord]  # recorded (verified) blobs
    present: Mapping[str, BlobRecord]  # blobs on disk now, recorded or not
    current: Mapping[str, str]  # name -> version the 'current' link points at
    partial: Mapping[str, PartialFile]  # sha256 -> the partial download in staging
    intact: bool = False  # the observed version's directory matches its record, links and blobs
    version_dir_exists: bool = False
    conflicts: tuple[str, ...] = ()  # symlinks found where the observed version's files would go
    observed_at: datetime | None = None  # the store's clock when observed; partial ages count from it
    untrusted: Mapping[str, str] = field(default_factory=dict)  # sha256 -> why its blob is not trusted


# --- the plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FetchStep:
    sha256: str
    size: int
    path: str  # first manifest path with this content (for messages)
    location: str
    resume_from: int


@dataclass(frozen=True)
class Reingest:
    """A blob on disk the store does not trust (``reason``), copied into a fresh inode and re-verified."""

    sha256: str
    reason: str


@dataclass(frozen=True)
class Eviction:
    name: str
    version: str
    size: int
    last_used: datetime


@dataclass(frozen=True)
class PartialDrop:
    """A partial download the plan deletes: ``reason`` is ``stale`` or ``budget`` (see the module docstring)."""

    sha256: str
    size: int
    modified: datetime
    reason: str


@dataclass(frozen=True)
class ArtifactPlan:
    """Everything one run will do, decided before anything is done."""

    state: str  # "present" or "absent"
    name: str
    version: str
    manifest: ArtifactManifest | None = None
    manifest_sha256: str | None = None
    source: str | None = None
    verify: str = "quick"
    fetch: tuple[FetchStep, ...] = ()
    rehash: tuple[str, ...] = ()
    reingest: tuple[Reingest, ...] = ()
    assemble: bool = False
    record: bool = False
    pin: bool = False
    pin_changed: bool = False
    promote: bool = False
    previous_current: str | None = None
    evict: tuple[Eviction, ...] = ()
    drop_partials: tuple[PartialDrop, ...] = ()
    remove: bool = False
    store_bytes_before: int = 0
    store_bytes_after: int = 0
    max_bytes: int | None = None

    @property
    def changed(self) -> bool:
        adopt = self.verify == "quick" and bool(self.rehash)
        return bool(
            self.fetch
            or adopt
            or self.reingest
            or self.assemble
            or self.record
            or self.pin_changed
            or self.promote
            or self.evict
            or self.drop_partials
            or self.remove
        )

    def summary(self) -> dict[str, Any]:
        """What the plan does, as plain data (module results, CLI output)."""
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state,
            "changed": self.changed,
            "fetch": [
                {"path": s.path, "sha256": s.sha256, "size": s.size, "resume_from": s.resume_from} for s in self.fetch
            ],
            "fetch_bytes": sum(s.size - s.resume_from for s in self.fetch),
            "rehash": list(self.rehash),
            "reingest": [{"sha256": r.sha256, "reason": r.reason} for r in self.reingest],
            "assemble": self.assemble,
            "promote": self.promote,
            "previous_current": self.previous_current,
            "pinned": self.pin,
            "evict": [{"name": e.name, "version": e.version, "size": e.size} for e in self.evict],
            "drop_partials": [
                {"sha256": d.sha256, "size": d.size, "modified": format_rfc3339(d.modified), "reason": d.reason}
                for d in self.drop_partials
            ],
            "remove": self.remove,
            "store_bytes_before": self.store_bytes_before,
            "store_bytes_after": self.store_bytes_after,
            "max_bytes": self.max_bytes,
        }

    def diff(self) -> dict[str, str]:
        """Ansible's diff: the store's view of this name before and after, one line per fact."""
        before = [f"current: {self.previous_current or '(none)'}"]
        after_current = self.version if self.promote else self.previous_current
        if self.remove and self.previous_current == self.version:
            after_current = None
        after = [f"current: {after_current or '(none)'}"]
        for step in self.fetch:
            after.append(f"fetch {step.path} ({step.size} bytes, sha256 {step.sha256[:12]}...)")
        for item in self.reingest:
            before.append(f"untrusted blob {item.sha256[:12]}...: {item.reason}")
            after.append(f"re-verified copy of blob {item.sha256[:12]}...")
        for eviction in self.evict:
            before.append(f"version {eviction.name}/{eviction.version} ({eviction.size} bytes)")
            after.append(f"evicted {eviction.name}/{eviction.version}")
        for drop in self.drop_partials:
            before.append(
                f"partial download {drop.sha256[:12]}... ({drop.size} bytes, modified {format_rfc3339(drop.modified)})"
            )
            after.append(f"removed partial download {drop.sha256[:12]}... ({drop.reason})")
        if self.remove:
            before.append(f"version {self.name}/{self.version}")
        elif self.state == "present":
            after.append(f"version {self.name}/{self.version} pinned={self.pin}")
        return {
            "before_header": f"artifact {self.name}",
            "after_header": f"artifact {self.name}",
            "before": "\n".join(before) + "\n",
            "after": "\n".join(after) + "\n",
        }


def check_manifest_paths(manifest: ArtifactManifest) -> None:
    """The store's own re-check of names, digests and paths (the contract checked them once already)."""
    if not NAME.match(str(manifest.name)):
        raise ArtifactPathError(f"artifact name {manifest.name!r} is not a valid store name")
    if not VERSION.match(str(manifest.version)) or manifest.version == CURRENT:
        raise ArtifactPathError(
            f"artifact version {manifest.version!r} cannot be a directory in the store "
            f"(it must match {VERSION.pattern} and must not be {CURRENT!r}, the name of the switch)"
        )
    seen: dict[str, str] = {}
    for entry in manifest.files:
        _check_relative(entry.path)
        if not SHA256.match(str(entry.sha256)):
            raise ArtifactPathError(f"file {entry.path!r}: sha256 {entry.sha256!r} is not 64 lowercase hex digits")
        if not isinstance(entry.size, int) or entry.size < 0:
            raise ArtifactPathError(f"file {entry.path!r}: size {entry.size!r} is not a byte count")
        key = entry.path.casefold()
        if key in seen:
            raise ArtifactPathError(f"paths {seen[key]!r} and {entry.path!r} collide in the version directory")
        seen[key] = entry.path
    for key, original in seen.items():
        parts = key.split("/")
        for depth in range(1, len(parts)):
            prefix = "/".join(parts[:depth])
            if prefix in seen:
                raise ArtifactPathError(f"path {seen[prefix]!r} is both a file and the directory of {original!r}")


def _check_relative(path: str) -> None:
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path or "\x00" in path:
        raise ArtifactPathError(f"path {path!r} must be relative, use '/' separators and contain no NUL")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ArtifactPathError(f"path {path!r} must not contain empty, '.' or '..' components")


def plan_artifact(
    manifest: ArtifactManifest,
    state: StoreState,
    *,
    manifest_sha256: str,
    source: str | None = None,
    pin: bool = False,
    promote: bool = True,
    verify: str = "quick",
    max_bytes: int | None = None,
    in_use: frozenset[str] | set[str] = frozenset(),
) -> ArtifactPlan:
    """Decide what makes ``manifest`` present (and optionally current) in the store. No I/O."""
    if verify not in ("quick", "full"):
        raise RuntimeError(f"verify must be 'quick' or 'full' (got {verify!r})")
    check_manifest_paths(manifest)
    if state.conflicts:
        raise ArtifactPathError(
            f"refusing to assemble {manifest.name}/{manifest.version}: "
            + ", ".join(state.conflicts)
            + " is a symlink the store did not create; remove it and run again"
        )
    name, version = manifest.name, manifest.version
    files = tuple((entry.path, entry.sha256, entry.size) for entry in manifest.files)
    needed: dict[str, tuple[int, str, str | None]] = {}
    for entry in manifest.files:
        needed.setdefault(entry.sha256, (entry.size, entry.path, entry.url))

    fetch: list[FetchStep] = []
    rehash: list[str] = []
    reingest: list[Reingest] = []
    for sha, (size, path, url) in needed.items():
        on_disk = state.present.get(sha)
        recorded = state.blobs.get(sha)
        if on_disk is None:
            location = resolve_location(source, path, file_url=url, base_url=manifest.base_url)
            partial = state.partial.get(sha)
            fetch.append(FetchStep(sha, size, path, location, min(partial.size if partial else 0, size)))
        elif sha in state.untrusted:
            # Hashing it in place would prove nothing: whoever can write it can change it after the hash.
            reingest.append(Reingest(sha, state.untrusted[sha]))
        elif recorded != on_disk or on_disk.size != size or verify == "full":
            rehash.append(sha)

    record = state.versions.get((name, version))
    same_files = record is not None and record.files == files
    assemble = not (same_files and state.intact) or bool(fetch) or bool(reingest)
    current = state.current.get(name)

    before_bytes = _referenced_bytes(state.versions.values(), state) + _partial_bytes(state.partial)
    stale = _stale_partials(state, needed)
    foreign = {sha: p for sha, p in state.partial.items() if sha not in needed and sha not in stale}
    evict, budget_drops, after_bytes = _plan_evictions(
        state,
        target=(name, version),
        extra=needed,
        max_bytes=max_bytes,
        in_use=frozenset(in_use),
        partials=foreign,
    )
    return ArtifactPlan(
        state="present",
        name=name,
        version=version,
        manifest=manifest,
        manifest_sha256=manifest_sha256,
        source=source,
        verify=verify,
        fetch=tuple(fetch),
        rehash=tuple(rehash),
        reingest=tuple(reingest),
        assemble=assemble,
        record=not same_files,
        pin=pin,
        pin_changed=record is not None and same_files and record.pinned != pin,
        promote=promote and current != version,
        previous_current=current,
        evict=tuple(evict),
        drop_partials=tuple(stale.values()) + tuple(budget_drops),
        store_bytes_before=before_bytes,
        store_bytes_after=after_bytes,
        max_bytes=max_bytes,
    )


def plan_removal(
    name: str, version: str, state: StoreState, *, in_use: frozenset[str] | set[str] = frozenset()
) -> ArtifactPlan:
    """Decide what removes ``name``/``version`` (and its current link, if it is current). No I/O."""
    current = state.current.get(name)
    present = (name, version) in state.versions or state.version_dir_exists
    if present and name in in_use:
        raise ArtifactStoreError(
            f"refusing to remove {name}/{version}: an engine uses artifact {name!r}; stop or re-point the engine first"
        )
    before = _referenced_bytes(state.versions.values(), state) + _partial_bytes(state.partial)
    remaining = [record for key, record in state.versions.items() if key != (name, version)]
    stale = _stale_partials(state, {})
    kept = {sha: p for sha, p in state.partial.items() if sha not in stale}
    return ArtifactPlan(
        state="absent",
        name=name,
        version=version,
        remove=present,
        previous_current=current,
        drop_partials=tuple(stale.values()),
        store_bytes_before=before,
        store_bytes_after=_referenced_bytes(remaining, state) + _partial_bytes(kept),
    )


def _partial_bytes(partials: Mapping[str, PartialFile]) -> int:
    return sum(partial.size for partial in partials.values())


def _stale_partials(state: StoreState, needed: Mapping[str, Any]) -> dict[str, PartialDrop]:
    """Partials this plan does not resume that nobody has written to for ``PARTIAL_MAX_AGE``, oldest first."""
    if state.observed_at is None:
        return {}  # no clock reading: no age can be judged, so nothing is old
    stale = {
        sha: PartialDrop(sha, partial.size, partial.modified, "stale")
        for sha, partial in state.partial.items()
        if sha not in needed and state.observed_at - partial.modified > PARTIAL_MAX_AGE
    }
    return dict(sorted(stale.items(), key=lambda item: (item[1].modified, item[0])))


def _blob_size(sha: str, state: StoreState, extra: Mapping[str, tuple[int, str, str | None]]) -> int:
    if sha in extra:
        return extra[sha][0]
    blob = state.blobs.get(sha) or state.present.get(sha)
    return blob.size if blob else 0


def _referenced_bytes(
    records: Any, state: StoreState, extra: Mapping[str, tuple[int, str, str | None]] | None = None
) -> int:
    digests: set[str] = set(extra or {})
    for record in records:
        digests.update(record.digests)
    return sum(_blob_size(sha, state, extra or {}) for sha in digests)


def _plan_evictions(
    state: StoreState,
    *,
    target: tuple[str, str],
    extra: Mapping[str, tuple[int, str, str | None]],
    max_bytes: int | None,
    in_use: frozenset[str],
    partials: Mapping[str, PartialFile],
) -> tuple[list[Eviction], list[PartialDrop], int]:
    """Versions to evict, then partials to drop, to fit ``max_bytes``; and the store's bytes afterwards.

    ``partials`` are the partial downloads the plan keeps otherwise (not resumed, not stale): their bytes
    count like any others.
    """
    kept = {key: record for key, record in state.versions.items() if key != target}
    partial_total = _partial_bytes(partials)
    total = _referenced_bytes(kept.values(), state, extra) + partial_total
    if max_bytes is None or total <= max_bytes:
        return [], [], total
    protected: dict[tuple[str, str], str] = {}
    for key, record in kept.items():
        if record.pinned:
            protected[key] = "pinned"
        elif state.current.get(key[0]) == key[1]:
            protected[key] = "current"
        elif key[0] in in_use:
            protected[key] = "in use by an engine"
    candidates = sorted(
        (record for key, record in kept.items() if key not in protected),
        key=lambda record: (record.last_used, record.name, record.version),
    )
    evicted: list[Eviction] = []
    for record in candidates:
        if total <= max_bytes:
            break
        del kept[(record.name, record.version)]
        after = _referenced_bytes(kept.values(), state, extra) + partial_total
        evicted.append(Eviction(record.name, record.version, total - after, record.last_used))
        total = after
    dropped: list[PartialDrop] = []
    for sha, partial in sorted(partials.items(), key=lambda item: (item[1].modified, item[0])):
        if total <= max_bytes:
            break
        dropped.append(PartialDrop(sha, partial.size, partial.modified, "budget"))
        total -= partial.size
    if total > max_bytes:
        held = ", ".join(f"{n}/{v} ({why})" for (n, v), why in sorted(protected.items())) or "none"
        raise ArtifactStoreError(
            f"{target[0]}/{target[1]} does not fit the store budget: max_bytes is {max_bytes}, and after evicting "
            f"everything that may be evicted the store would still hold {total} bytes. Protected versions: {held}. "
            "Unpin or remove versions, or raise store.max_bytes in the policy"
        )
    return evicted, dropped, total

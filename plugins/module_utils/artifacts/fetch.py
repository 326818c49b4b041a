"""The artifact transport: one manifest file from an http(s) URL or a local directory into a staging file.

I/O lives here and only here; the store decides what to fetch and where the result goes. One call,
``fetch_file``, turns "a URL or path, an expected size and sha256, a staging path" into a complete,
fsync'd, verified staging file, or into one of three errors:

- ``ArtifactIntegrityError``: the other side sent bad data (digest mismatch, more bytes than the manifest
  says, fewer). The staging file is deleted: its bytes are wrong, and resuming from them would only
  repeat the mismatch. Never retried: a server that lies once will lie again.
- ``ArtifactTransferError``: the transfer failed (connection refused or dropped, timeout, an HTTP
  error status). Connection errors, timeouts and 5xx/408/429 are retried with exponential backoff and
  jitter; after the last attempt the partial staging file is KEPT, so the next run resumes from it.
- ``DiskFullError``: the local disk filled up (ENOSPC/EDQUOT). The staging file is deleted, so a full
  disk does not stay full because of us.

Choices worth knowing:
- Transport is Ansible's ``open_url`` (``urllib.request`` underneath, with Ansible's certificate and
  proxy handling), not ``requests``: it needs no guarded import for the module sanity checks (which
  also want every HTTP request to go through it), ``HTTPResponse.readinto`` fills our own 1 MiB buffers without a copy
  per chunk (the hash-while-streaming loop is the hot path a benchmark holds against
  ``openssl dgst``), and Range/Content-Range handling is a few header reads we want to see anyway.
- Hashing happens while streaming, in one pass, on a second thread: hashlib, socket reads and file
  writes release the GIL for large buffers, so hashing chunk n overlaps receiving and writing chunk
  n+1 (a download costs about max(hash, I/O), not their sum). A ring of four buffers bounds memory.
- On resume the sha256 state of the earlier run is gone (hashlib objects cannot be saved portably),
  so the bytes already in the partial file are re-hashed once, from local disk, before the download
  continues. That costs one local read of the prefix, not a
  second download, and it means a resumed file is verified over all of its bytes.
- Resume: a request carries ``Range: bytes=<have>-`` when a partial file exists. 206 with a
  ``Content-Range`` starting where we asked continues the file; 200 means the server ignored the Range,
  so the partial file is truncated and the download restarts cleanly from byte 0; a 206 starting
  anywhere else, or 416, also restarts from byte 0 (on the next attempt, without a Range).
- The size cap is the manifest's size: we never write past it. A server that has more to send is
  detected by reading one byte beyond the cap, then rejected.
- A body that ends cleanly (per HTTP framing) before the manifest size is "too short" (bad data). A
  connection that drops mid-body (``IncompleteRead``, reset) is a transfer failure, retried with Range.
- Redirects (301/302/303/307/308) are followed by our own small loop, not by urllib (``open_url`` runs
  with ``follow_redirects="none"``): model mirrors and object stores routinely answer with a redirect to
  a signed URL, and we want three things urllib does not give. (1) A bound we choose
  (``FetchConfig.max_redirects``, 10 by default) and a loop reported as a loop. (2) No https -> http
  downgrade: the content is hash-checked anyway, but a downgrade sends the request (and the signed URL's
  query, which is a credential) in clear text and is almost always a misconfigured mirror, so it is
  refused, naming both URLs. (3) Every hop carries the same headers, so a resume's ``Range`` reaches the
  server that finally answers. Each attempt starts again from the manifest's URL (signed URLs expire);
  redirect errors are configuration errors and are not retried. URLs in messages lose their query
  string and credentials (``?...``): a signed URL should not end up in logs.
- A transfer that fails before a single byte arrived leaves no empty ``.partial`` behind.
- A location is an http(s) URL or a local path; ``file://`` URLs (no host, or ``localhost``) are local
  paths. Where a location came from decides whether a local one may be read: the caller's ``source`` is
  its own instruction and is read as given, but a local path that the signed manifest names (its ``url``
  or ``base_url``) is read only inside a directory the host's policy lists under ``store.local_sources``
  (``check_manifest_location``). The manifest is signed by the artifact key, yet whoever holds that key
  is not the host: without the check, a manifest could point root at any file or device on it (a FIFO
  that never ends, a size oracle on files it cannot read otherwise). The path is compared after
  ``os.path.realpath``, so neither ``..`` nor a symlink inside an allowed directory leads out of it, and
  the resolved path is what is then read. Other URL schemes are refused, naming the location.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import queue
import random
import re
import stat
import string
import threading
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ansible.module_utils.urls import ConnectionError as UrlsConnectionError
from ansible.module_utils.urls import SSLValidationError, open_url

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ArtifactError",
    "ArtifactIntegrityError",
    "ArtifactSourceError",
    "ArtifactTransferError",
    "DiskFullError",
    "FetchConfig",
    "FetchProgress",
    "FetchResult",
    "check_manifest_location",
    "fetch_file",
    "hash_file",
    "new_sha256",
    "resolve_location",
]

# Large reads keep per-call overhead (Python loop, syscalls) small next to the hashing itself.
DEFAULT_CHUNK_SIZE = 1024 * 1024
_RETRYABLE_STATUS = frozenset({408, 429})
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")


class ArtifactError(MeridianError):
    """Base of everything the transport raises; ``path`` is the manifest path of the file concerned."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


class ArtifactIntegrityError(ArtifactError):
    """The other side sent bad data. ``reason`` is ``digest-mismatch``, ``too-long`` or ``too-short``."""

    def __init__(self, path: str, reason: str, message: str) -> None:
        super().__init__(path, message)
        self.reason = reason


class ArtifactTransferError(ArtifactError):
    """The transfer failed after ``attempts`` tries; ``partial_bytes`` stay in staging for a resume."""

    def __init__(self, path: str, message: str, *, attempts: int, partial_bytes: int) -> None:
        super().__init__(path, message)
        self.attempts = attempts
        self.partial_bytes = partial_bytes


class DiskFullError(ArtifactError):
    """The disk holding the staging file filled up; the staging file was removed."""


class ArtifactSourceError(ArtifactError):
    """A location that may not be read: a local path the signed manifest names outside the policy's
    ``store.local_sources``, or a location that is neither http(s) nor a local path. Nothing was read."""


def new_sha256() -> Any:
    """The one place a hasher is made: tests count calls here to prove a re-run does not re-hash."""
    return hashlib.sha256()


@dataclass(frozen=True)
class FetchProgress:
    """Where one file's download stands, reported after every chunk written (``FetchConfig.progress``).

    ``done`` counts the bytes of the file now in staging, a resumed download's earlier bytes included, so
    ``done <= size`` always; ``received`` counts only what this ``fetch_file`` call read from the source (all
    its attempts), which is what a transfer rate is made of. A download the server made start over (it
    ignored the Range) reports ``done`` from 0 again; ``received`` only grows.
    """

    path: str  # the manifest path
    size: int  # the whole file's size, as the manifest says
    done: int
    received: int


@dataclass(frozen=True)
class FetchConfig:
    """How hard to try. ``sleep`` and ``jitter`` are injectable so tests do not wait and stay repeatable.

    ``timeout_s`` bounds connecting and every single read (seconds of silence), not the whole download:
    a 100 GB file legitimately takes hours. ``attempts`` counts the first try. The delay before retry
    ``n`` (1-based) is ``min(backoff_max_s, backoff_base_s * 2**(n-1))``, scaled by ``0.5 + jitter()/2`` so
    that many hosts retrying one mirror do not retry in lockstep.
    """

    timeout_s: float = 30.0
    attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    jitter: Callable[[], float] = field(default=random.random, repr=False)
    progress: Callable[[FetchProgress], None] | None = field(default=None, repr=False)
    user_agent: str = "meridian-node"
    # A mirror needs one or two hops (mirror -> object store -> signed URL); 10 is urllib's own bound.
    max_redirects: int = 10
    ca_path: str | None = None  # a CA bundle to verify https servers with, instead of the system's

    def __post_init__(self) -> None:
        if (
            self.attempts < 1
            or self.timeout_s <= 0
            or self.chunk_size < 1
            or self.backoff_base_s < 0
            or self.max_redirects < 0
        ):
            raise RuntimeError(
                "FetchConfig needs attempts >= 1, timeout_s > 0, chunk_size >= 1, backoff_base_s >= 0, "
                f"max_redirects >= 0 (got {self!r})"
            )

    def delay(self, retry: int) -> float:
        base_s = min(self.backoff_max_s, self.backoff_base_s * (2 ** (retry - 1)))
        return float(base_s * (0.5 + self.jitter() / 2))


@dataclass(frozen=True)
class FetchResult:
    """A verified staging file. ``resumed_from`` is the byte offset the download continued from."""

    staging_path: str
    sha256: str
    size: int
    attempts: int
    resumed_from: int
    bytes_received: int


def resolve_location(source: str | None, path: str, *, file_url: str | None, base_url: str | None) -> str:
    """Where to read one manifest file: an http(s) URL or a local file path (``file://`` URLs become paths).

    The operator's ``source`` (a mirror or an air-gap inbox) wins over the manifest's own URLs: the
    content is pinned by sha256, so where the bytes come from does not affect trust. Without a source,
    a per-file ``url`` wins over ``base_url`` + path. A local path from the manifest still has to pass
    ``check_manifest_location`` before it is read. No I/O here.
    """
    if source:
        return _under(source, path, "the source")
    if file_url:
        return _file_url_path(file_url, path, "the manifest's url") if file_url.startswith("file:") else file_url
    if base_url:
        return _under(base_url, path, "the manifest's base_url")
    raise ArtifactTransferError(
        path,
        f"no location for {path!r}: the manifest has neither a url for it nor a base_url, and no source was "
        "given; pass a source (an http(s) base URL or a local directory)",
        attempts=0,
        partial_bytes=0,
    )


def check_manifest_location(location: str, path: str, local_sources: Sequence[str]) -> str:
    """The location to read for manifest file ``path`` when ``location`` came from the signed manifest itself.

    An http(s) URL is returned as it is. A local path is returned resolved (``os.path.realpath``) when
    it lies inside one of ``local_sources`` (each resolved the same way): the host's policy, not the
    manifest's signer, decides which local files a manifest may name. Anything else raises
    ``ArtifactSourceError`` naming the location; an empty ``local_sources`` allows no local path at all.
    """
    if _is_http(location):
        return location
    if not os.path.isabs(location):
        raise ArtifactSourceError(
            path,
            f"the signed manifest's location for {path!r} is {location!r}, which is neither an http(s) URL nor "
            "an absolute local path; nothing was read. Fix the manifest, or give a source (an http(s) mirror or "
            "a directory) for this artifact",
        )
    resolved = os.path.realpath(location)
    for directory in local_sources:
        root = os.path.realpath(directory)
        if resolved != root and os.path.commonpath([root, resolved]) == root:
            return resolved
    shown = location if resolved == location else f"{location} (resolved: {resolved})"
    allowed = ", ".join(local_sources) if local_sources else "none"
    raise ArtifactSourceError(
        path,
        f"the signed manifest names the local path {shown} for {path!r}, outside the directories the policy's "
        f"store.local_sources allows manifests to name (allowed: {allowed}); nothing was read. Add the "
        "directory to store.local_sources in the policy if this host should read it, or give a source (an "
        "http(s) mirror or a directory) for this artifact",
    )


def _under(base: str, path: str, what: str) -> str:
    """Manifest ``path`` below ``base``: an http(s) base URL, a local directory or a ``file://`` URL of one."""
    if _is_http(base):
        return base.rstrip("/") + "/" + urllib.parse.quote(path)
    if base.startswith("file:"):
        base = _file_url_path(base, path, what)
    return os.path.join(base, *path.split("/"))


def _file_url_path(url: str, path: str, what: str) -> str:
    """The local path a ``file:`` URL names; one for another host cannot be read here."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise ArtifactSourceError(
            path,
            f"{what} for {path!r} is {url!r}: a file: URL must name a local path (file:///dir/file), without "
            "another host, a query or a fragment",
        )
    return urllib.parse.unquote(parts.path)


def hash_file(path: str, chunk_size: int = DEFAULT_CHUNK_SIZE, limit: int | None = None) -> tuple[str, int]:
    """sha256 hex and byte count of a local file (of its first ``limit`` bytes when given)."""
    hasher = new_sha256()
    with open(path, "rb", buffering=0) as handle:
        total = _hash_stream(handle, hasher, chunk_size, limit)
    return hasher.hexdigest(), total


def fetch_file(
    location: str,
    *,
    path: str,
    size: int,
    sha256: str,
    staging_path: str,
    config: FetchConfig | None = None,
) -> FetchResult:
    """Fetch ``location`` into ``staging_path`` and verify it is exactly ``size`` bytes with ``sha256``.

    ``path`` is the manifest path, used in messages. An existing ``staging_path`` is a partial file
    from an earlier run and is resumed. On success the staging file is complete and fsync'd; moving it
    into place is the caller's job. See the module docstring for what each error leaves behind.
    """
    config = config or FetchConfig()
    job = _Job(location, path, size, sha256.lower(), staging_path, config)
    return job.run()


def _is_http(location: str) -> bool:
    return location.startswith(("http://", "https://"))


def _hash_stream(handle: Any, hasher: Any, chunk_size: int, limit: int | None) -> int:
    """Hash a local file in one thread: reading from the page cache costs a tenth of hashing, so a second
    thread buys little here and measured slower on a busy two-core host."""
    view = memoryview(bytearray(chunk_size))
    total = 0
    while limit is None or total < limit:
        want = chunk_size if limit is None else min(chunk_size, limit - total)
        count = handle.readinto(view[:want])
        if not count:
            break
        hasher.update(view[:count])
        total += count
    return total


def _pump(
    source: Any,
    hasher: Any,
    chunk_size: int,
    limit: int | None,
    sink: BinaryIO | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Read ``source`` (up to ``limit`` bytes) into ``sink`` while a second thread hashes the same chunks.

    hashlib, socket reads and file writes all release the GIL on large buffers, so hashing chunk n
    overlaps reading and writing chunk n+1: the copy costs about max(hash, I/O) instead of their sum.
    Chunks reach the hasher in order through one queue; a small ring of buffers bounds memory.
    """
    worker = _HashWorker(hasher, chunk_size)
    total = 0
    try:
        while limit is None or total < limit:
            buffer = worker.take()
            want = chunk_size if limit is None else min(chunk_size, limit - total)
            view = memoryview(buffer)[:want]
            count = source.readinto(view)
            if not count:
                worker.give_back(buffer)
                break
            if sink is not None:
                written = 0
                while written < count:
                    written += sink.write(view[written:count]) or 0
            worker.submit(buffer, count)
            total += count
            if progress is not None:
                progress(total)
    finally:
        worker.close()
    return total


class _HashWorker:
    """The hashing thread of ``_pump``: hashes submitted buffers in order and hands them back."""

    def __init__(self, hasher: Any, chunk_size: int, depth: int = 4) -> None:
        self.hasher = hasher
        self.free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self.full: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        for _slot in range(depth):
            self.free.put(bytearray(chunk_size))
        self.thread = threading.Thread(target=self._run, name="meridian-sha256", daemon=True)
        self.thread.start()

    def take(self) -> bytearray:
        return self.free.get()

    def give_back(self, buffer: bytearray) -> None:
        self.free.put(buffer)

    def submit(self, buffer: bytearray, count: int) -> None:
        self.full.put((buffer, count))

    def close(self) -> None:
        """Wait until every submitted chunk is hashed; afterwards the hasher is safe to read."""
        self.full.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            item = self.full.get()
            if item is None:
                return
            buffer, count = item
            self.hasher.update(memoryview(buffer)[:count])
            self.free.put(buffer)


class _Restart(MeridianError):
    """The server's answer cannot continue our partial file; start again from byte 0 at once."""


class _Retryable(MeridianError):
    """A transfer failure worth another attempt (after a backoff)."""


@dataclass(eq=False)
class _Job:
    """One file's download: where from, where to, what it must be; and how far it got."""

    location: str
    path: str
    size: int
    sha256: str
    staging: str
    config: FetchConfig
    received: int = field(default=0, init=False)
    resumed_from: int = field(default=0, init=False)
    allow_range: bool = field(default=True, init=False)
    final_url: str = field(init=False)  # where the last request ended up after redirects (for messages)

    def __post_init__(self) -> None:
        self.final_url = self.location

    def run(self) -> FetchResult:
        try:
            return self._run()
        except ArtifactTransferError:
            # Nothing arrived: an empty partial file would only sit in staging.
            if _size_of(self.staging) == 0:
                _remove(self.staging)
            raise

    def _run(self) -> FetchResult:
        attempt = 0
        restarts = 0
        last_error = ""
        while True:
            attempt += 1
            try:
                return self._attempt(attempt)
            except _Restart:
                # One free immediate retry from byte 0: the server just told us it cannot resume.
                self.allow_range = False
                restarts += 1
                attempt -= 1
                if restarts > 1:
                    raise self._transfer_failed(attempt + 1, "the server kept refusing to resume or restart") from None
            except _Retryable as exc:
                last_error = str(exc)
                if attempt >= self.config.attempts:
                    raise self._transfer_failed(attempt, last_error) from exc
                self.config.sleep(self.config.delay(attempt))

    def _transfer_failed(self, attempts: int, reason: str) -> ArtifactTransferError:
        partial = _size_of(self.staging)
        kept = (
            f"{partial} of {self.size} bytes are kept in {self.staging} and the next run resumes from there"
            if partial
            else "nothing arrived, so the next run starts from byte 0"
        )
        return ArtifactTransferError(
            self.path,
            f"could not fetch {self.path!r} from {self._where()} after {attempts} attempt(s): {reason}; {kept}",
            attempts=attempts,
            partial_bytes=partial,
        )

    # -- one attempt -------------------------------------------------------------------------------------

    def _attempt(self, attempt: int) -> FetchResult:
        handle = self._open_staging()
        try:
            have = os.fstat(handle.fileno()).st_size
            if have > self.size:
                # Longer than the file can be: not a prefix of it. Start over.
                handle.truncate(0)
                have = 0
            hasher = new_sha256()
            if have:
                handle.seek(0)
                if _hash_stream(handle, hasher, self.config.chunk_size, have) != have:
                    raise RuntimeError(f"staging file {self.staging} shrank while it was being read")
            if have == self.size:
                return self._finish(handle, hasher, attempt, have)
            if _is_http(self.location):
                offset, hasher = self._download(handle, hasher, have)
            else:
                offset, hasher = self._copy_local(handle, hasher, have)
            return self._finish(handle, hasher, attempt, offset)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                handle.close()
                _remove(self.staging)
                raise DiskFullError(
                    self.path,
                    f"the disk is full: no space left on the filesystem holding {self.staging} while writing "
                    f"{self.path!r} ({self.size} bytes expected); the staging file was removed. Free space "
                    "there (or lower store.max_bytes so eviction makes room) and run again",
                ) from exc
            raise
        finally:
            handle.close()

    def _open_staging(self) -> BinaryIO:
        os.makedirs(os.path.dirname(os.path.abspath(self.staging)), exist_ok=True)
        fd = os.open(self.staging, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return os.fdopen(fd, "r+b", buffering=0)

    def _finish(self, handle: BinaryIO, hasher: Any, attempt: int, total: int) -> FetchResult:
        digest = hasher.hexdigest()
        if total < self.size:
            self._reject(handle, "too-short", f"the source ended after {total} of {self.size} bytes")
        if digest != self.sha256:
            self._reject(handle, "digest-mismatch", f"sha256 is {digest}, the signed manifest says {self.sha256}")
        os.fsync(handle.fileno())
        return FetchResult(
            staging_path=self.staging,
            sha256=digest,
            size=total,
            attempts=attempt,
            resumed_from=self.resumed_from,
            bytes_received=self.received,
        )

    def _reject(self, handle: BinaryIO, reason: str, detail: str) -> None:
        handle.close()
        _remove(self.staging)
        raise ArtifactIntegrityError(
            self.path,
            reason,
            f"{self.path!r} from {self._where()} does not match the signed manifest: {detail}; "
            "the downloaded bytes were deleted and nothing was promoted",
        )

    def _write_stream(self, handle: BinaryIO, hasher: Any, source: Any, offset: int) -> int:
        """Copy ``source`` to the end of ``handle`` up to the size cap; the new offset."""
        start, received = offset, self.received
        progress = self.config.progress
        report = (
            None
            if progress is None
            else (lambda done: progress(FetchProgress(self.path, self.size, start + done, received + done)))
        )
        copied = _pump(source, hasher, self.config.chunk_size, self.size - offset, sink=handle, progress=report)
        offset += copied
        self.received += copied
        if offset < self.size:
            return offset
        # At the cap: anything more means the source is not the file the manifest describes.
        if source.read(1):
            self._reject(handle, "too-long", f"the source sent more than the {self.size} bytes the manifest says")
        return offset

    def _copy_local(self, handle: BinaryIO, hasher: Any, have: int) -> tuple[int, Any]:
        try:
            # O_NONBLOCK: a FIFO planted where a model file should be would otherwise block the run forever.
            fd = os.open(self.location, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError as exc:
            raise ArtifactTransferError(
                self.path,
                f"{self.path!r} is not in the source directory: {self.location} does not exist",
                attempts=1,
                partial_bytes=have,
            ) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ArtifactTransferError(
                self.path,
                f"{self.location} is not a regular file (a FIFO, device or directory); put the file itself there",
                attempts=1,
                partial_bytes=have,
            )
        source = os.fdopen(fd, "rb", buffering=0)
        with source:
            if have:
                source.seek(have)
                self.resumed_from = have
            handle.seek(have)
            return self._write_stream(handle, hasher, source, have), hasher

    def _download(self, handle: BinaryIO, hasher: Any, have: int) -> tuple[int, Any]:
        headers = {"Accept-Encoding": "identity"}
        ranged = bool(have) and self.allow_range
        if ranged:
            headers["Range"] = f"bytes={have}-"
        try:
            response = self._open(headers, have)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 416 and ranged:
                handle.truncate(0)
                raise _Restart from exc
            if exc.code >= 500 or exc.code in _RETRYABLE_STATUS:
                raise _Retryable(f"HTTP {exc.code} {exc.reason}") from exc
            raise ArtifactTransferError(
                self.path,
                f"could not fetch {self.path!r}: {self._where()} answered HTTP {exc.code} {exc.reason}",
                attempts=1,
                partial_bytes=have,
            ) from exc
        except SSLValidationError as exc:
            raise ArtifactTransferError(
                self.path,
                f"could not fetch {self.path!r}: the TLS certificate of {self._where()} did not verify: {exc}",
                attempts=1,
                partial_bytes=have,
            ) from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException, UrlsConnectionError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise _Retryable(_describe(exc)) from exc
        with response:
            status = response.status
            if status == 206 and ranged:
                start = _range_start(response.headers.get("Content-Range"), self.size)
                if start != have:
                    handle.truncate(0)
                    raise _Restart
                self.resumed_from = have
                offset = have
            elif status == 200:
                if have:
                    # The server ignored our Range: its body starts at byte 0, and so does the hash.
                    handle.truncate(0)
                    hasher = new_sha256()
                offset = 0
            else:
                raise _Retryable(f"unexpected HTTP {status} for a {'ranged ' if ranged else ''}GET")
            handle.seek(offset)
            try:
                offset = self._write_stream(handle, hasher, response, offset)
            except (TimeoutError, http.client.HTTPException, ConnectionError) as exc:
                raise _Retryable(_describe(exc)) from exc
            # http.client reports a body cut short of its Content-Length as a plain end of data; what it
            # still expected is in ``length``. That is a dropped connection (retry), not a short file.
            missing = response.length
            if offset < self.size and missing:
                raise _Retryable(f"the connection closed mid-body, {missing} announced bytes never arrived")
            return offset, hasher

    # -- redirects ----------------------------------------------------------------------------------------

    def _open(self, headers: dict[str, str], have: int) -> Any:
        """GET ``self.location`` and follow redirects ourselves (why: module docstring); the final response.

        Every hop gets the same ``headers``, so a ``Range`` reaches the server that finally answers.
        """
        chain = [self.location]
        while True:
            self.final_url = chain[-1]
            try:
                return open_url(
                    chain[-1],
                    headers=headers,
                    method="GET",
                    timeout=self.config.timeout_s,
                    http_agent=self.config.user_agent,
                    decompress=False,
                    use_netrc=False,
                    follow_redirects="none",
                    ca_path=self.config.ca_path,
                )
            except urllib.error.HTTPError as exc:
                if exc.code not in _REDIRECT_STATUS:
                    raise
                location = exc.headers.get("Location") if exc.headers is not None else None
                exc.close()
                chain.append(self._next_hop(chain, location, exc.code, have))

    def _next_hop(self, chain: list[str], location: str | None, code: int, have: int) -> str:
        """Where a redirect from ``chain[-1]`` leads, or the error that explains why we will not go there."""
        here = chain[-1]
        if not location or not location.strip():
            raise self._redirect_error(
                f"{_display(here)} answered HTTP {code} (a redirect) without a Location header; "
                "fix the mirror or point source at the file's real location",
                have,
            )
        # As urllib does: http.client decoded the header as latin-1; re-encode what is not plain ASCII.
        quoted = urllib.parse.quote(location.strip(), encoding="iso-8859-1", safe=string.punctuation)
        target = urllib.parse.urljoin(here, quoted)
        scheme = urllib.parse.urlsplit(target).scheme.lower()
        if scheme not in ("http", "https"):
            raise self._redirect_error(
                f"{_display(here)} redirected to {_display(target)}; only http and https redirects are followed. "
                "Point source at an http(s) mirror or a local directory",
                have,
            )
        if urllib.parse.urlsplit(here).scheme.lower() == "https" and scheme == "http":
            raise self._redirect_error(
                f"refusing the redirect from {_display(here)} to {_display(target)}: it downgrades https to plain "
                "http, which would send the request (a signed URL's query included) unencrypted. The bytes would "
                "still be hash-checked, but this is almost always a misconfigured mirror: make it redirect to an "
                "https URL, or point source at an https location that does not redirect to http",
                have,
            )
        if target in chain:
            hops = " -> ".join(_display(url) for url in [*chain, target])
            raise self._redirect_error(f"the redirects loop: {hops}; fix the mirror's redirect rules", have)
        if len(chain) > self.config.max_redirects:
            raise self._redirect_error(
                f"{_display(self.location)} redirected more than {self.config.max_redirects} times (the last hop "
                f"went from {_display(here)} to {_display(target)}); a mirror needs one or two. Fix the mirror's "
                "redirect rules, or point source at the file's final location",
                have,
            )
        return target

    def _redirect_error(self, detail: str, have: int) -> ArtifactTransferError:
        # A redirect that is refused is configuration, not a passing fault: retrying would only repeat it.
        return ArtifactTransferError(
            self.path, f"could not fetch {self.path!r}: {detail}", attempts=1, partial_bytes=have
        )

    def _where(self) -> str:
        if self.final_url == self.location:
            return _display(self.location)
        return f"{_display(self.final_url)} (redirected from {_display(self.location)})"


def _display(url: str) -> str:
    """``url`` for a message: no user:password, and no query (a signed URL's query is a credential)."""
    if not _is_http(url):
        return url
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "..." if parts.query else "", ""))


def _range_start(header: str | None, size: int) -> int | None:
    """The first byte of a ``Content-Range: bytes a-b/total`` answer; None when it cannot continue us."""
    match = _CONTENT_RANGE.match(header or "")
    if not match:
        return None
    total = match.group(3)
    if total != "*" and int(total) != size:
        # The server's file has another size: whatever it is, it is not a continuation of ours.
        return None
    return int(match.group(1))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return f"connection failed: {exc.reason}"
    if isinstance(exc, TimeoutError):
        return "timed out waiting for the server"
    if isinstance(exc, http.client.IncompleteRead):
        return f"the connection closed mid-body ({len(exc.partial)} bytes of the last read arrived)"
    return f"{type(exc).__name__}: {exc}"


def _size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

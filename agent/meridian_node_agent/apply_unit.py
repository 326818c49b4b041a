"""Apply through the root apply unit: the agent's side of the privilege split.

The agent runs unprivileged; what it may ask of root crosses the boundary as two files in its spool:

    spool/apply-request.json   written by the agent (atomically): the run ident it chose and the envelope,
                               byte for byte as it verified it. ``meridian-node-apply.path`` watches this
                               file (``PathChanged=``) and starts ``meridian-node-apply.service``.
    spool/apply-result.json    written by the root unit (atomically): the answer to one request.

The root side (``apply_cli``) trusts the request only as input: it re-verifies the envelope against the
root-owned policy and config, and the playbook verifies it once more. The agent takes an answer only
when it names its own request (an old or foreign answer is waited past), and counts it as failed when
root ran an envelope with another payload hash than the one the agent spooled. The agent does not poll
blindly: it sleeps on inotify on the spool directory, with a slow re-check in case an event is lost.

The oplog stays the agent's: ``started`` before the request is written, the result when the answer
arrives. No answer within the timeout leaves the operation unfinished in the oplog, so start-up
re-applies it, exactly like a crash in the middle of an in-process apply.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import select
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    describe_validation_error,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.fileutil import atomic_write
from meridian_node_agent.apply import APPLY_OP, RUN_IDENT_PATTERN, ApplyResult, run_ident
from meridian_node_agent.oplog import STARTED, Operation, OpLog

__all__ = [
    "REQUEST_FILE",
    "RESULT_FILE",
    "SPOOL_DIR",
    "ApplyAnswer",
    "ApplyRequest",
    "SpoolError",
    "SystemdApplier",
    "read_answer",
    "read_request",
    "watch_directory",
    "write_answer",
    "write_request",
]

SPOOL_DIR = "spool"
REQUEST_FILE = "apply-request.json"
RESULT_FILE = "apply-result.json"
# A desired state is kilobytes; anything near this is not one, and root does not read unbounded input.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Requests are private to the agent (and root); answers carry only counts and messages the agent shows.
REQUEST_MODE = 0o600
ANSWER_MODE = 0o644
# Even with inotify, look again this often: an event lost to a replaced directory must not cost a timeout.
_BACKSTOP_SECONDS = 5.0
# Without inotify (not Linux) this is the re-check interval.
_FALLBACK_SECONDS = 0.5


class SpoolError(ValueError):
    """A request or answer file is unreadable or malformed; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ApplyRequest(_Strict):
    format: Literal[1] = 1
    request: Annotated[str, Field(pattern=RUN_IDENT_PATTERN)]
    envelope: str  # base64 of the envelope bytes: the signature covers exact bytes, JSON re-encoding would not

    def envelope_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.envelope, validate=True)
        except ValueError as exc:
            raise SpoolError(f"request {self.request}: envelope is not valid base64: {exc}") from exc


class ApplyAnswer(_Strict):
    format: Literal[1] = 1
    request: Annotated[str, Field(pattern=RUN_IDENT_PATTERN)]
    payload_sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")]  # empty when the envelope was refused
    generation: Annotated[int, Field(ge=0)]
    status: Literal["successful", "failed", "canceled", "timeout"]
    rc: int | None
    changed: Annotated[int, Field(ge=0)]
    failed: Annotated[int, Field(ge=0)]
    failures: list[str]
    journal: str
    started_at: str
    finished_at: str
    wall_seconds: Annotated[float, Field(ge=0)]

    def to_result(self) -> ApplyResult:
        return ApplyResult(
            ident=self.request,
            generation=self.generation,
            status=self.status,
            rc=self.rc,
            changed=self.changed,
            failed=self.failed,
            journal=Path(self.journal),
            started_at=datetime.fromisoformat(self.started_at),
            finished_at=datetime.fromisoformat(self.finished_at),
            wall_seconds=self.wall_seconds,
            failures=list(self.failures),
        )

    @classmethod
    def from_result(cls, result: ApplyResult, payload_sha256: str) -> ApplyAnswer:
        return cls(
            request=result.ident,
            payload_sha256=payload_sha256,
            generation=result.generation,
            status=_STATUSES.get(result.status, "failed"),
            rc=result.rc,
            changed=result.changed,
            failed=result.failed,
            failures=list(result.failures),
            journal=str(result.journal),
            started_at=format_rfc3339(result.started_at),
            finished_at=format_rfc3339(result.finished_at),
            wall_seconds=result.wall_seconds,
        )


_STATUSES: dict[str, Literal["successful", "failed", "canceled", "timeout"]] = {
    "successful": "successful",
    "canceled": "canceled",
    "timeout": "timeout",
}


_Model = TypeVar("_Model", ApplyRequest, ApplyAnswer)


def write_request(spool: Path, ident: str, envelope: bytes) -> Path:
    spool.mkdir(parents=True, exist_ok=True, mode=0o700)
    request = ApplyRequest(request=ident, envelope=base64.b64encode(envelope).decode("ascii"))
    path = spool / REQUEST_FILE
    atomic_write(path, request.model_dump_json().encode("utf-8"), mode=REQUEST_MODE)
    return path


def read_request(spool: Path) -> ApplyRequest | None:
    """The pending request, or None when there is none; a malformed one raises ``SpoolError``."""
    raw = _read_capped(spool / REQUEST_FILE)
    if raw is None:
        return None
    return _parse(ApplyRequest, raw, spool / REQUEST_FILE)


def write_answer(spool: Path, answer: ApplyAnswer) -> Path:
    path = spool / RESULT_FILE
    atomic_write(path, answer.model_dump_json().encode("utf-8"), mode=ANSWER_MODE)
    return path


def read_answer(spool: Path) -> ApplyAnswer | None:
    raw = _read_capped(spool / RESULT_FILE)
    if raw is None:
        return None
    return _parse(ApplyAnswer, raw, spool / RESULT_FILE)


def _read_capped(path: Path) -> bytes | None:
    try:
        # O_NOFOLLOW: root reads this file from a directory the agent owns; a symlink there is refused.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SpoolError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(MAX_REQUEST_BYTES + 1)
    if len(raw) > MAX_REQUEST_BYTES:
        raise SpoolError(f"{path} is larger than {MAX_REQUEST_BYTES} bytes; a desired state is never that big")
    return raw


def _parse(model: type[_Model], raw: bytes, path: Path) -> _Model:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise SpoolError(f"{path}: {describe_validation_error(exc)}") from exc


# Waiting for the answer: inotify on the spool directory, through libc (no third-party package).

# Answers arrive by rename (IN_MOVED_TO); IN_CLOSE_WRITE covers a hand-written file.
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080


class _Watch:
    """Wakes ``wait`` when something is written or renamed into a directory; falls back to a short sleep."""

    def __init__(self, directory: Path) -> None:
        self.fd: int | None = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        mask = _IN_CLOSE_WRITE | _IN_MOVED_TO
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
            os.close(fd)
            return
        self.fd = fd

    def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.fd is None:
            time.sleep(min(seconds, _FALLBACK_SECONDS))
            return
        ready, _, _ = select.select([self.fd], [], [], min(seconds, _BACKSTOP_SECONDS))
        if ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.fd, 65536):
                    pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def watch_directory(directory: Path) -> Iterator[_Watch]:
    """Watch ``directory`` for files written or renamed into it; start watching *before* looking."""
    watch = _Watch(directory)
    try:
        yield watch
    finally:
        watch.close()


class SystemdApplier:
    """``ApplyPort`` for the split: spool a request, let systemd start the root unit, wait for its answer."""

    def __init__(
        self,
        *,
        state_dir: Path,
        timeout_seconds: float,
        clock: Callable[[], datetime] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.spool = self.state_dir / SPOOL_DIR
        self.timeout_seconds = timeout_seconds
        self.clock = clock or (lambda: datetime.now(UTC))
        self.monotonic = monotonic
        self.oplog = OpLog(self.state_dir / "oplog.jsonl")
        self.journal_dir = self.state_dir / "journal"

    def apply(
        self,
        envelope: bytes,
        *,
        generation: int,
        epoch: int,
        payload_sha256: str,
        secrets: Iterable[str] = (),  # the root side finds them itself, in the envelope it verified
    ) -> ApplyResult:
        self.record_late_answer()
        started_at = self.clock()
        ident = run_ident(generation, started_at)
        common: dict[str, Any] = {
            "op": APPLY_OP,
            "generation": generation,
            "epoch": epoch,
            "payload_sha256": payload_sha256,
            "run_ident": ident,
        }
        self.oplog.append(result=STARTED, at=started_at, **common)
        self.spool.mkdir(parents=True, exist_ok=True, mode=0o700)
        begin = self.monotonic()
        with watch_directory(self.spool) as watch:
            write_request(self.spool, ident, envelope)
            answer = self._await(watch, ident, begin + self.timeout_seconds)
        if answer is None:
            # No result line: the oplog keeps the operation unfinished, so start-up applies it again.
            return ApplyResult(
                ident=ident,
                generation=generation,
                status="timeout",
                rc=None,
                changed=0,
                failed=0,
                journal=self.journal_dir / ident,
                started_at=started_at,
                finished_at=self.clock(),
                wall_seconds=self.monotonic() - begin,
                failures=[
                    f"the root apply unit did not answer request {ident} within {self.timeout_seconds:g} s "
                    f"(apply.timeout_seconds); see 'systemctl status meridian-node-apply.path "
                    f"meridian-node-apply.service' and 'journalctl -u meridian-node-apply.service'"
                ],
            )
        result = answer.to_result()
        if answer.payload_sha256 and answer.payload_sha256 != payload_sha256:
            # The spool changed between our write and root's read. Root verified what it ran, so nothing
            # unsigned ran; but it was not this state, and this apply did not happen.
            result.status = "failed"
            result.failures.insert(
                0,
                f"the root apply unit ran request {ident} with an envelope of sha256 {answer.payload_sha256}, "
                f"not the {payload_sha256} the agent spooled: something else wrote {self.spool / REQUEST_FILE}",
            )
        self.oplog.append(result=result.status, at=result.finished_at, **common)
        return result

    def record_late_answer(self) -> Operation | None:
        """Record the result of a request this agent stopped waiting for, if root has answered it since.

        Without this the oplog would show that operation unfinished forever, and every start-up would
        apply it again although root did run it.
        """
        pending = self.oplog.pending()
        if pending is None:
            return None
        try:
            answer = read_answer(self.spool)
        except SpoolError:
            return None
        if answer is None or answer.request != pending.run_ident:
            return None
        return self.oplog.append(
            op=pending.op,
            generation=pending.generation,
            epoch=pending.epoch,
            payload_sha256=pending.payload_sha256,
            run_ident=pending.run_ident,
            result=answer.status,
            at=datetime.fromisoformat(answer.finished_at),
        )

    def _await(self, watch: _Watch, ident: str, deadline: float) -> ApplyAnswer | None:
        while True:
            try:
                answer = read_answer(self.spool)
            except SpoolError:
                answer = None  # a damaged answer is nobody's answer; the right one replaces it
            if answer is not None and answer.request == ident:
                return answer
            remaining = deadline - self.monotonic()
            if remaining <= 0:
                return None
            watch.wait(remaining)

"""Apply through the root apply unit: the agent's side of the privilege split.

Runs on: the agent side (the unprivileged ``meridian-node run``).

The agent writes ``<state_dir>/spool/apply-request.json`` (atomically): the run ident it chose and the
envelope, byte for byte as it verified it. ``meridian-node-apply.path`` watches that file
(``PathChanged=``) and starts ``meridian-node-apply.service``, which answers in
``<apply.state_dir>/public/apply-result.json``, in root's own directory (see ``apply_spool``).

The root side (``apply_cli``) trusts the request only as input: it re-verifies the envelope against the
root-owned policy and its own record of what was applied, and the playbook verifies it once more. The
agent takes an answer only when it names its own request (an old or foreign answer is waited past), and
counts it as failed when root ran an envelope with another payload hash than the one the agent spooled.
The agent does not poll blindly: it sleeps on inotify on root's ``public/`` directory, with a slow re-check
in case an event is lost (or the directory does not exist yet, before root's first run).

The oplog here is the agent's: ``started`` before the request is written, the result when the answer
arrives. No answer within the timeout leaves the operation unfinished in the oplog, so start-up
re-applies it, exactly like a crash in the middle of an in-process apply. Root keeps its own oplog.
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
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.fileutil import atomic_write
from meridian_node_agent.apply import APPLY_OP, ApplyResult, run_ident
from meridian_node_agent.apply_spool import (
    PUBLIC_DIR,
    REQUEST_FILE,
    REQUEST_MODE,
    SPOOL_DIR,
    ApplyAnswer,
    ApplyRequest,
    SpoolError,
    read_answer_file,
)
from meridian_node_agent.oplog import STARTED, Operation, OpLog

__all__ = ["SystemdApplier", "watch_directory", "write_request"]

# Even with inotify, look again this often: an event lost to a replaced directory must not cost a timeout.
_BACKSTOP_SECONDS = 5.0
# Without inotify (not Linux), or before root's public directory exists, this is the re-check interval.
_FALLBACK_SECONDS = 0.5


def write_request(spool: Path, ident: str, envelope: bytes) -> Path:
    spool.mkdir(parents=True, exist_ok=True, mode=0o700)
    request = ApplyRequest(request=ident, envelope=base64.b64encode(envelope).decode("ascii"))
    path = spool / REQUEST_FILE
    atomic_write(path, request.model_dump_json().encode("utf-8"), mode=REQUEST_MODE)
    return path


# Waiting for the answer: inotify on root's public directory, through libc (no third-party package).

# Answers arrive by rename (IN_MOVED_TO); IN_CLOSE_WRITE covers a hand-written file.
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080


class _Watch:
    """Wakes ``wait`` when something is written or renamed into a directory; falls back to a short sleep.

    A directory that does not exist yet (root's ``public/`` before its first run) is watched as soon as
    it appears: each fallback sleep tries again.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fd: int | None = None
        self._start()

    def _start(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        mask = _IN_CLOSE_WRITE | _IN_MOVED_TO
        if libc.inotify_add_watch(fd, os.fsencode(self.directory), mask) < 0:
            os.close(fd)
            return
        self.fd = fd

    def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.fd is None:
            time.sleep(min(seconds, _FALLBACK_SECONDS))
            self._start()
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
        apply_state_dir: Path,
        timeout_seconds: float,
        clock: Callable[[], datetime] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.spool = self.state_dir / SPOOL_DIR
        self.public = Path(apply_state_dir) / PUBLIC_DIR
        self.timeout_seconds = timeout_seconds
        self.clock = clock or (lambda: datetime.now(UTC))
        self.monotonic = monotonic
        self.oplog = OpLog(self.state_dir / "oplog.jsonl")
        # Root's journal; the agent cannot read it, but the path in a message tells an operator where to look.
        self.journal_dir = Path(apply_state_dir) / "journal"

    def apply(
        self,
        envelope: bytes,
        *,
        generation: int,
        epoch: int,
        payload_sha256: str,
        secrets: Iterable[str] = (),  # the root side finds them itself, in the envelope it verified
        reason: str | None = None,
        lists_artifacts: bool = True,  # not sent: root decides it from its own verification of the envelope
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
        self.oplog.append(result=STARTED, at=started_at, reason=reason, **common)
        self.spool.mkdir(parents=True, exist_ok=True, mode=0o700)
        begin = self.monotonic()
        with watch_directory(self.public) as watch:
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
            answer = read_answer_file(self.public)
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
                answer = read_answer_file(self.public)
            except SpoolError:
                answer = None  # a damaged answer is nobody's answer; the right one replaces it
            if answer is not None and answer.request == ident:
                return answer
            remaining = deadline - self.monotonic()
            if remaining <= 0:
                return None
            watch.wait(remaining)

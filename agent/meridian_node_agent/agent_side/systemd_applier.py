"""Apply through the root apply unit: the agent's side of the privilege split.

Runs on: the agent side (the unprivileged ``meridian-node run``).

The agent writes ``<state_dir>/spool/apply-request.json`` (atomically): the run ident it chose and the
envelope, byte for byte as it verified it. ``meridian-node-apply.path`` watches that file
(``PathChanged=``) and starts ``meridian-node-apply.service``, which answers in
``<apply.state_dir>/public/apply-result.json``, in root's own directory (see ``boundary.spool``).

The root side (``root_side.apply_unit``) trusts the request only as input: it re-verifies the envelope against the
root-owned policy and its own record of what was applied, and the playbook verifies it once more. The
agent takes an answer only when it names its own request (an old or foreign answer is waited past), and
counts it as failed when root ran an envelope with another payload hash than the one the agent spooled.
The agent does not poll blindly: it sleeps on inotify on root's ``public/`` directory, with a slow re-check
in case an event is lost (or the directory does not exist yet, before root's first run).

systemd's ``PathChanged=`` drops a change made while the service it starts is still active, and nothing looks
again when the service ends. Root's run reads the spool again after each answer, but a request written after that
last read and before the service is marked inactive (a window of tens of milliseconds, wider on a loaded host)
starts nothing: root never sees it, and the agent would wait its whole ``apply.timeout_seconds``. So while no answer
has come the agent writes the same request again (the same ident and bytes, a new file: ``PathChanged=`` fires),
after ``respool_s`` and then at doubling intervals up to ``RESPOOL_MAX_S``. Writing it again is safe: root answers
each request at most once (a run that finds the request already answered applies nothing), and while root is
working on it the write starts nothing.

The request also relays the GPUs the agent's XID watch holds unhealthy by a critical XID (``gpu_relay``, the
agent's ``GpuHealthWatch``; ``boundary.spool.GpuReport``): under the split no process of root's sees an XID, and
root holds them before its playbook places anything (``root_side.gpu_reports``). After the answer the watch reads
root's hold file again, so it knows what root holds now.

The oplog here is the agent's: ``started`` before the request is written, the result when the answer
arrives. No answer within the timeout leaves the operation unfinished in the oplog, so start-up
re-applies it, exactly like a crash in the middle of an in-process apply. Root keeps its own oplog.

A stop (``stop``, the agent's ``StopSignal``) ends the wait at once: the request stays in the spool for root, whose
apply unit systemd has already started and which finishes it whatever the agent does; the agent's oplog keeps the
operation unfinished and ``ApplyAbandoned`` is raised. The next start asks for the same envelope again, which root
answers from its own record (an equal generation with the same bytes changes nothing).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from meridian_node_agent.agent_side.stop import StopSignal
from meridian_node_agent.apply.applier import APPLY_OP, ApplyAbandoned, ApplyResult, run_ident
from meridian_node_agent.apply.oplog import STARTED, Operation, OpLog
from meridian_node_agent.boundary.spool import (
    PUBLIC_DIR,
    REQUEST_FILE,
    REQUEST_MODE,
    SPOOL_DIR,
    ApplyAnswer,
    ApplyRequest,
    GpuReport,
    SpoolError,
    read_answer_file,
)
from meridian_node_agent.boundary.watch import DirectoryWatch, watch_directory

__all__ = ["GpuRelay", "SystemdApplier", "watch_directory", "write_request"]


class GpuRelay(Protocol):
    """What the applier asks of the agent's GPU health watch (``agent_side.gpu_health.GpuHealthWatch``)."""

    def xid_reports(self) -> list[GpuReport]: ...

    def note_holds(self) -> None: ...


def write_request(spool: Path, ident: str, envelope: bytes, gpu_reports: Sequence[GpuReport] = ()) -> Path:
    spool.mkdir(parents=True, exist_ok=True, mode=0o700)
    request = ApplyRequest(
        request=ident, envelope=base64.b64encode(envelope).decode("ascii"), gpu_reports=list(gpu_reports)
    )
    path = spool / REQUEST_FILE
    # Without reports the request is the bytes it always was: a root side from before the relay still reads it.
    data = request.model_dump_json(exclude=None if gpu_reports else {"gpu_reports"})
    atomic_write(path, data.encode("utf-8"), mode=REQUEST_MODE)
    return path


# The first write of a request again, when no answer has come (see the module's docstring), and the longest
# interval between two: a lost trigger costs at most these seconds, a long apply one small write a minute.
RESPOOL_S = 5.0
RESPOOL_MAX_S = 60.0


class SystemdApplier:
    """``ApplyPort`` for the split: spool a request, let systemd start the root unit, wait for its answer."""

    def __init__(
        self,
        *,
        state_dir: Path,
        apply_state_dir: Path,
        timeout_s: float,
        clock: Callable[[], datetime] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        gpu_relay: GpuRelay | None = None,
        stop: StopSignal | None = None,
        respool_s: float = RESPOOL_S,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.stop = stop
        self.spool = self.state_dir / SPOOL_DIR
        self.public = Path(apply_state_dir) / PUBLIC_DIR
        self.timeout_s = timeout_s
        self.clock = clock or (lambda: datetime.now(UTC))
        self.monotonic = monotonic
        self.oplog = OpLog(self.state_dir / "oplog.jsonl")
        # Root's journal; the agent cannot read it, but the path in a message tells an operator where to look.
        self.journal_dir = Path(apply_state_dir) / "journal"
        self.gpu_relay = gpu_relay
        self.respool_s = respool_s

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
        reports = self.gpu_relay.xid_reports() if self.gpu_relay is not None else []
        with watch_directory(self.public) as watch:
            answer = self._await(
                watch, ident, begin + self.timeout_s, lambda: write_request(self.spool, ident, envelope, reports)
            )
        if reports and self.gpu_relay is not None:
            self.gpu_relay.note_holds()
        if answer is None and self.stop is not None and self.stop.stopping:
            raise ApplyAbandoned(
                f"the agent stopped waiting for root's answer to request {ident} (generation {generation}); the "
                f"request stays in {self.spool / REQUEST_FILE} for root, and the next start asks again",
                ident=ident,
                generation=generation,
            )
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
                wall_s=self.monotonic() - begin,
                failures=[
                    f"the root apply unit did not answer request {ident} within {self.timeout_s:g} s "
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
        return self.oplog.finish(pending, answer.status, at=datetime.fromisoformat(answer.finished_at))

    def _await(
        self, watch: DirectoryWatch, ident: str, deadline: float, spool: Callable[[], Path]
    ) -> ApplyAnswer | None:
        """``spool()`` the request, then wait for root's answer to ``ident`` until ``deadline``, spooling it again
        at growing intervals while none has come (a trigger systemd dropped: see the module's docstring)."""
        spool()
        interval_s = self.respool_s
        respool_at = self.monotonic() + interval_s
        while True:
            try:
                answer = read_answer_file(self.public)
            except SpoolError:
                answer = None  # a damaged answer is nobody's answer; the right one replaces it
            if answer is not None and answer.request == ident:
                return answer
            now = self.monotonic()
            if deadline - now <= 0 or (self.stop is not None and self.stop.stopping):
                return None
            if now >= respool_at:
                spool()
                interval_s = min(interval_s * 2, RESPOOL_MAX_S)
                respool_at = now + interval_s
            watch.wait(min(deadline, respool_at) - now, interrupt=None if self.stop is None else self.stop.fileno())

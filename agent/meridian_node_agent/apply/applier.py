"""Apply a verified desired state: run the collection's ``reconcile.yml`` through ansible-runner.

Runs on: whichever side applies. In-process (``apply.via: in-process``, development) inside the agent, in
its state dir; under the privilege split inside the root apply unit (``root_side.apply_unit``), in root's own
``apply.state_dir``, where the agent can rename nothing.

Layout under that directory::

    runs/<ident>/       the run's private_data_dir (inventory, project link, the envelope); removed after
                        the run, because the envelope's payload carries engines' secret_env values
    journal/<ident>/    the run's ansible-runner artifacts (events, stdout, status, rc, command): the
                        journal, the last ``keep_runs`` kept, secrets scrubbed
    oplog.jsonl         generation → run ident → result (see ``oplog``)

The playbook verifies the envelope again itself; the agent's verification only decides whether to run.

A ``cancel`` callback (the agent's ``StopSignal.stopping``, in-process) is handed to ansible-runner, which then
installs no signal handlers of its own and kills the playbook's process group once the callback says so. Such a
run is abandoned, not finished: its ``started`` line stays the last word in the oplog and ``ApplyAbandoned`` is
raised, so the next start applies it again exactly as after a crash mid-apply (``Agent.recover``,
``inbox.close_interrupted``). Without a callback (root's apply unit) ansible-runner's own handlers stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as _trust_module
from meridian_node_agent.apply.oplog import STARTED, OpLog
from meridian_node_agent.boundary.spool import RUN_IDENT_PATTERN, ApplyResult

__all__ = [
    "APPLY_OP",
    "RUN_IDENT_PATTERN",
    "SCRUBBED",
    "Applier",
    "ApplyAbandoned",
    "ApplyResult",
    "collection_paths",
    "latest_run",
    "rotate_journal",
    "run_ident",
    "scrub_journal",
]

APPLY_OP = "apply"
SCRUBBED = "********"
# Environment variables whose values may stay in the journal: Ansible's own settings and the basics
# needed to read a run. Everything else in the ``command`` artifact is replaced by SCRUBBED.
_KEEP_ENV = re.compile(r"^(ANSIBLE_[A-Z0-9_]+|PATH|HOME|LANG|LC_ALL|PWD|USER|SHELL|PYTHONPATH)$")
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH)", re.IGNORECASE)
# Shorter values are not scrubbed by content: replacing "1" or "true" everywhere would wreck the journal.
_MIN_SECRET_LENGTH = 6
# How often ansible-runner asks ``cancel`` while the playbook is quiet (its default is 5 s): a stop within a second.
_CANCEL_CHECK_S = 1


class ApplyAbandoned(MeridianError):
    """The apply was given up because the agent is stopping; the oplog keeps it started, so start-up resumes it."""

    def __init__(self, message: str, *, ident: str, generation: int) -> None:
        super().__init__(message)
        self.ident = ident
        self.generation = generation


def collection_paths() -> tuple[Path, Path]:
    """(the directory holding ``ansible_collections/``, the collection's ``playbooks/``), as imported.

    Taken from where this code was imported from without resolving symlinks, so the editable checkout
    (``.build/collections``) and an installed wheel (its private copy, ``meridian_node_agent/collection``)
    both work.
    """
    # <root>/ansible_collections/meridian/node/plugins/module_utils/trust/verify.py
    module = Path(_trust_module.__file__)
    collection = module.parents[3]
    return collection.parents[2], collection / "playbooks"


def run_ident(generation: int, now: datetime) -> str:
    """``gen-<N>-<UTC timestamp>``: sortable by time within a generation, unique per run."""
    return f"gen-{generation}-{now.astimezone(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}"


class _Counter:
    """ansible-runner event handler: changed/failed task results, the first failure messages, the bytes
    verified_artifact brought into the store (the agent's meridian_node_artifact_fetched_bytes_total) and the
    bytes of engine images the engine modules pulled (meridian_node_image_fetched_bytes_total)."""

    def __init__(self) -> None:
        self.changed = 0
        self.failed = 0
        self.failures: list[str] = []
        self.fetched_bytes = 0
        self.image_bytes = 0

    def __call__(self, event: dict[str, Any]) -> bool:
        kind = event.get("event")
        data = event.get("event_data") or {}
        res = data.get("res")
        result: dict[str, Any] = res if isinstance(res, dict) else {}
        if kind == "runner_on_ok" and str(data.get("task_action", "")).endswith("verified_artifact"):
            self.fetched_bytes += _fetched_bytes(result)
        if kind in ("runner_on_ok", "runner_on_failed") and str(data.get("task_action", "")).endswith(_PULLING):
            # A failed run's pulls happened too (a later engine failing does not give the bytes back).
            self.image_bytes += _pulled_bytes(result)
        if kind in ("runner_on_ok", "runner_item_on_ok") and result.get("changed"):
            # Loop tasks report per item and once for the whole task; count the task, not the items.
            if kind == "runner_on_ok":
                self.changed += 1
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            self.failed += 1
            if len(self.failures) < 5:
                message = _failure_message(result)
                self.failures.append(f"{data.get('task', '?')}: {message}")
        return True  # keep every event in the journal


def _fetched_bytes(result: dict[str, Any]) -> int:
    """What one verified_artifact task added to the store: each fetched file's size less the offset its download
    resumed from. A loop task's result lists its items' results (the per-item events carry the same ones again,
    so only the task's own event is counted)."""
    items = result.get("results")
    total = 0
    for item in items if isinstance(items, list) else [result]:
        fetched = item.get("fetched") if isinstance(item, dict) else None
        for entry in fetched if isinstance(fetched, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("size"), int):
                total += max(0, entry["size"] - int(entry.get("resumed_from") or 0))
    return total


_PULLING = ("engine_set", "engine_instance")


def _pulled_bytes(result: dict[str, Any]) -> int:
    """The image bytes one engine_set (per engine) or engine_instance result says it pulled (``image_pull``). Each
    image is pulled once, and every engine that uses it carries the same summary: counted once per image."""
    engines = result.get("engines")
    runs = list(engines.values()) if isinstance(engines, dict) else [result]
    pulled: dict[str, int] = {}
    for run in runs:
        summary = run.get("image_pull") if isinstance(run, dict) else None
        if isinstance(summary, dict) and summary.get("pulled") is True and isinstance(summary.get("bytes"), int):
            pulled[str(summary.get("image"))] = max(0, summary["bytes"])
    return sum(pulled.values())


def _failure_message(result: dict[str, Any]) -> str:
    """A failed task's reason; for a loop task, its failed items' own (the task's is only "One or more items
    failed"), each labelled with its item."""
    items = result.get("results")
    if isinstance(items, list):
        reasons = [
            f"{item.get('_ansible_item_label', item.get('item', '?'))}: {item.get('msg') or 'no message'}"
            for item in items
            if isinstance(item, dict) and item.get("failed")
        ]
        if reasons:
            return "; ".join(reasons)
    return str(result.get("msg") or "no message")


class Applier:
    """Runs ``reconcile.yml`` for verified envelopes and keeps the journal and the operation log."""

    def __init__(
        self,
        *,
        state_dir: Path,
        node_id: str,
        policy_path: str,
        keep_runs: int = 20,
        clock: Callable[[], datetime] | None = None,
        python: str = sys.executable,
        playbook: Path | None = None,
        collections_path: Path | None = None,
        extravars: dict[str, str] | None = None,
        cancel: Callable[[], bool] | None = None,
        progress_file: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.cancel = cancel
        self.node_id = node_id
        self.policy_path = policy_path
        self.keep_runs = keep_runs
        self.clock = clock or (lambda: datetime.now(UTC))
        self.python = python
        collections, playbooks = collection_paths()
        # The host's own collection comes first: meridian.node, which verifies and records, is always the
        # host's copy (the inbox also refuses a bundle shipping one); an air-gap bundle's collection, pinned
        # by control, comes after it for what it adds.
        self.collections_path = str(collections)
        if collections_path is not None:
            self.collections_path = f"{collections}{os.pathsep}{collections_path}"
        self.playbook = playbook or playbooks / "reconcile.yml"
        self.extravars = dict(extravars or {})
        if progress_file is not None:
            # Where the playbook's pulls and downloads say how far they got, for the agent to show while it runs.
            self.extravars["meridian_progress_file"] = str(progress_file)
        self.runs_dir = self.state_dir / "runs"
        self.journal_dir = self.state_dir / "journal"
        # In-process this is the agent's oplog; in the root apply unit, root's own (in root's directory): the
        # agent keeps a separate one of what it asked for (apply_unit).
        self.oplog = OpLog(self.state_dir / "oplog.jsonl")

    def apply(
        self,
        envelope: bytes,
        *,
        generation: int,
        epoch: int,
        payload_sha256: str,
        secrets: Iterable[str] = (),
        ident: str | None = None,
        reason: str | None = None,
        lists_artifacts: bool = True,
    ) -> ApplyResult:
        """Run the playbook once for this envelope; the oplog records the start before anything runs.

        ``ident`` names the run (and its journal directory); by default a new one from the clock. The root
        apply unit passes the ident the agent chose, so the journal and the agent's oplog agree.

        ``lists_artifacts`` is whether the caller's own verification of this envelope found artifacts in it
        (``meridian_state_artifacts``): false skips the playbook's verify-and-artifacts steps, which then
        have nothing to do, and saves their module calls. It is only a shortcut: ``engines.set`` refuses a
        state whose artifacts are not in the store, so a wrong false fails the apply and changes nothing.
        """
        import ansible_runner  # imported here: it costs ~100 ms and unchanged cycles never need it

        started_at = self.clock()
        ident = ident or run_ident(generation, started_at)

        def record(result: str, at: datetime) -> None:
            self.oplog.append(
                op=APPLY_OP,
                generation=generation,
                epoch=epoch,
                payload_sha256=payload_sha256,
                run_ident=ident,
                result=result,
                at=at,
                reason=reason if result == STARTED else None,
            )

        record(STARTED, started_at)
        private = self.runs_dir / ident
        private.mkdir(parents=True, mode=0o700)
        self.journal_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        envelope_path = private / "desired-state.json"
        atomic_write(envelope_path, envelope, mode=0o600)
        runner_options: dict[str, Any] = {}
        if self.cancel is not None:
            runner_options["cancel_callback"] = self.cancel
            # ansible-runner reads its settings from this file only (a ``settings`` argument is dropped without it).
            (private / "env").mkdir(mode=0o700)
            atomic_write(private / "env" / "settings", json.dumps({"pexpect_timeout": _CANCEL_CHECK_S}).encode())
        counter = _Counter()
        begin = time.monotonic()
        status, rc = "failed", None
        try:
            runner = ansible_runner.run(
                private_data_dir=str(private),
                artifact_dir=str(self.journal_dir),
                ident=ident,
                project_dir=str(self.playbook.parent),
                playbook=self.playbook.name,
                inventory={
                    "all": {
                        "hosts": {
                            "localhost": {
                                "ansible_connection": "local",
                                "ansible_python_interpreter": self.python,
                            }
                        }
                    }
                },
                extravars={
                    "meridian_envelope": str(envelope_path),
                    "meridian_node_id": self.node_id,
                    "meridian_policy": self.policy_path,
                    "meridian_state_dir": str(self.state_dir),
                    "meridian_state_artifacts": bool(lists_artifacts),
                    **self.extravars,
                },
                envvars={
                    "ANSIBLE_COLLECTIONS_PATH": str(self.collections_path),
                    "ANSIBLE_NOCOLOR": "1",
                    "PATH": _search_path(),
                    "ANSIBLE_RETRY_FILES_ENABLED": "0",
                    "ANSIBLE_LOCAL_TEMP": str(private / "tmp"),
                    "ANSIBLE_REMOTE_TEMP": str(private / "tmp"),
                },
                event_handler=counter,
                quiet=True,
                suppress_env_files=True,
                **runner_options,
            )
            status, rc = str(runner.status), runner.rc
        finally:
            wall_s = time.monotonic() - begin
            journal = self.journal_dir / ident
            with contextlib.suppress(OSError):
                scrub_journal(journal, secrets)
            shutil.rmtree(private, ignore_errors=True)
            finished_at = self.clock()
            abandoned = status == "canceled" and self.cancel is not None and self.cancel()
            if not abandoned:
                record(status, finished_at)
            rotate_journal(self.journal_dir, self.keep_runs)
        if abandoned:
            raise ApplyAbandoned(
                f"run {ident} of generation {generation} was stopped with the agent; the oplog keeps it started, "
                "so the next start applies it again",
                ident=ident,
                generation=generation,
            )
        return ApplyResult(
            ident=ident,
            generation=generation,
            status=status,
            rc=rc,
            changed=counter.changed,
            failed=counter.failed,
            journal=journal,
            started_at=started_at,
            finished_at=finished_at,
            wall_s=wall_s,
            failures=counter.failures,
            fetched_bytes=counter.fetched_bytes,
            image_bytes=counter.image_bytes,
        )


def scrub_journal(journal: Path, secrets: Iterable[str] = ()) -> None:
    """Remove secrets from one run's artifacts.

    ansible-runner records the whole process environment, values included, in ``command``: every value
    not on a short allow-list (or whose name looks secret) is replaced. Then any file still holding one
    of ``secrets`` (engines' secret_env values) verbatim has it replaced, as a second line of defence
    behind ``no_log``.
    """
    command = journal / "command"
    if command.is_file():
        document = json.loads(command.read_text())
        env = document.get("env")
        if isinstance(env, dict):
            document["env"] = {
                name: value if _KEEP_ENV.match(name) and not _SECRET_NAME.search(name) else SCRUBBED
                for name, value in env.items()
            }
            atomic_write(command, json.dumps(document).encode("utf-8"), mode=0o600)
    needles = sorted({s for s in secrets if len(s) >= _MIN_SECRET_LENGTH}, key=len, reverse=True)
    if not needles:
        return
    encoded = [(n.encode("utf-8"), json.dumps(n)[1:-1].encode("utf-8")) for n in needles]
    for path in journal.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        scrubbed = data
        for raw, escaped in encoded:
            scrubbed = scrubbed.replace(raw, SCRUBBED.encode()).replace(escaped, SCRUBBED.encode())
        if scrubbed != data:
            atomic_write(path, scrubbed, mode=0o600)


def rotate_journal(journal_dir: Path, keep: int) -> list[Path]:
    """Keep the ``keep`` most recent run directories (by modification time); return the removed ones."""
    try:
        runs = [path for path in journal_dir.iterdir() if path.is_dir()]
    except FileNotFoundError:
        return []
    runs.sort(key=lambda path: (path.stat().st_mtime, path.name))
    removed = runs[: max(0, len(runs) - keep)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _search_path() -> str:
    # The agent's own environment's ansible-playbook first: PATH under systemd may not include the venv.
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])


def latest_run(journal_dir: Path) -> Path | None:
    """The most recent run directory in the journal."""
    try:
        runs = [path for path in journal_dir.iterdir() if path.is_dir()]
    except FileNotFoundError:
        return None
    return max(runs, key=lambda path: (path.stat().st_mtime, path.name), default=None)

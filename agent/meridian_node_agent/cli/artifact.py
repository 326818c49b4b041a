"""``meridian-node artifact pull | list``: pre-stage models into the host's store, and show what it holds.

``pull`` does exactly what ``meridian.node.verified_artifact`` does (same verifier, same store code), so an
operator can stage a 100 GB model before the desired state that names it arrives; progress goes to stderr as
a bar on a terminal and as plain lines otherwise, the result to stdout as one JSON line.
"""

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import (
    ArtifactError,
    FetchConfig,
    FetchProgress,
)
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import (
    ArtifactStoreError,
    Store,
    ensure_artifact,
)
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import (
    DEFAULT_POLICY_PATH,
    Policy,
    PolicyError,
    load_policy,
)
from meridian_node_agent.errors import UsageError


def add_parsers(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    artifact = subparsers.add_parser("artifact", help="pre-stage and list model artifacts in the store")
    verbs = artifact.add_subparsers(dest="artifact_verb", required=True, metavar="VERB")

    pull = verbs.add_parser(
        "pull",
        help="verify a signed manifest and fetch its files into the store",
        description="Verify MANIFEST (a DSSE envelope signed by the policy's artifact keys), fetch its "
        "files from --source (http(s) base URL or a directory) with resume, check every size and sha256, "
        "and promote the version. Prints one JSON line; exit 0 done, 1 refused or failed, 2 usage.",
    )
    pull.add_argument("--policy", type=Path, default=Path(DEFAULT_POLICY_PATH))
    pull.add_argument("--manifest", type=Path, required=True, metavar="MANIFEST.json")
    pull.add_argument("--source", default=None, help="overrides the manifest's base_url")
    pull.add_argument("--store", type=Path, default=None, help="store root (default: the policy's store.path)")
    pull.add_argument("--pin", action="store_true", help="never evict this version")
    pull.add_argument("--no-promote", dest="promote", action="store_false", help="stage without switching current")
    pull.add_argument("--verify", choices=("quick", "full"), default="quick")
    pull.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    pull.set_defaults(handler=cmd_pull)

    listing = verbs.add_parser("list", help="show the store: name, version, size, pinned, last used")
    listing.add_argument("--policy", type=Path, default=Path(DEFAULT_POLICY_PATH))
    listing.add_argument("--store", type=Path, default=None, help="store root (default: the policy's store.path)")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    listing.set_defaults(handler=cmd_list)


def _store(args: argparse.Namespace) -> tuple[Store, Policy]:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        raise UsageError(str(exc)) from None
    if args.store:
        return Store(str(args.store), local_sources=policy.store.local_sources), policy
    return Store.for_policy(policy.store), policy


def _checked(store: Store) -> None:
    """Refuse an untrusted store before anything else, and put its warnings where an operator sees them."""
    for warning in store.check_trust():
        print(f"meridian-node artifact: warning: {warning}", file=sys.stderr)


def cmd_pull(args: argparse.Namespace) -> int:
    store, policy = _store(args)
    try:
        data = args.manifest.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read manifest {args.manifest}: {exc.strerror}") from None
    try:
        verified = trust.verify_artifact_manifest(data, policy)
    except trust.Rejection as rejection:
        print(json.dumps({"ok": False, "reason": rejection.code.value, "message": rejection.message}))
        return 1
    manifest = verified.manifest
    options: dict[str, Any] = {
        "manifest_sha256": verified.payload_sha256,
        "source": args.source,
        "pin": args.pin,
        "promote": args.promote,
        "verify": args.verify,
        "max_bytes": policy.store.max_bytes,
    }
    try:
        _checked(store)
        planned = ensure_artifact(store, manifest, check_mode=True, **options).plan
        reporter = Progress(
            f"{manifest.name} {manifest.version}",
            {step.path: step.size for step in planned.fetch},
            sys.stderr,
            resumed={step.path: step.resume_from for step in planned.fetch},
        )
        outcome = ensure_artifact(
            store, manifest, config=FetchConfig(timeout_s=args.timeout, progress=reporter), **options
        )
    except (ArtifactError, ArtifactStoreError, OSError) as exc:
        print(json.dumps({"ok": False, "reason": type(exc).__name__, "message": str(exc)}))
        return 1
    reporter.finish()
    summary = outcome.plan.summary()
    print(
        json.dumps(
            {
                "ok": True,
                "name": manifest.name,
                "version": manifest.version,
                "changed": outcome.plan.changed,
                "path": store.version_dir(manifest.name, manifest.version),
                "fetched_bytes": summary["fetch_bytes"],
                "evicted": summary["evict"],
                "dropped_partials": summary["drop_partials"],
                "signers": list(verified.signers),
            },
            sort_keys=True,
        )
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    store, _ = _store(args)
    try:
        _checked(store)
        rows = store.list_versions()
    except (ArtifactStoreError, OSError) as exc:
        # The index is root's (0600): run unprivileged, this is where it says so.
        print(f"meridian-node artifact list: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("NAME", "VERSION", "SIZE", "PINNED", "CURRENT", "LAST USED")
    table = [header] + [
        (
            r["name"],
            r["version"],
            human_bytes(r["size"]),
            "yes" if r["pinned"] else "no",
            "*" if r["current"] else "",
            r["last_used"],
        )
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print(f"(the store at {store.root} holds no artifacts)")
    return 0


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Bytes, rate and ETA across every file of one pull: a redrawn bar on a terminal, a plain line every
    ``LINE_INTERVAL_S`` otherwise (a log or a pipe keeps lines, not a bar redrawn with carriage returns).

    ``sizes`` are the whole sizes of the files the pull fetches and ``resumed`` what of each was already in
    staging (the partial downloads it continues), so a resumed pull starts at those bytes, ``done`` never
    passes ``total``, and ``total`` is the files' size, not what remained (issue 25 showed ``381.5 MiB /
    303.5 MiB, ETA --:--``). The rate counts only the bytes this pull received (``FetchProgress.received``):
    the resumed ones arrived in an earlier run, and counting them would make the ETA short.

    Not tqdm or rich, though both fit on their own: measured on this project's dev host (12 runs, best),
    ``import tqdm`` adds 47 ms and ``import rich.progress`` 42 ms (plus markdown-it-py and pygments) to the
    335 ms importing the verb costs, and either would join the agent's runtime dependencies for this one bar. What
    broke here was the accounting (which bytes were there before), which tqdm leaves to its caller too
    (``initial=``), and neither writes the line-per-interval form a non-terminal wants, so that would stay
    ours anyway. The fetcher's events carry the file's path, so files are told apart by name, not guessed from
    the numbers.
    """

    LINE_INTERVAL_S = 5.0
    BAR_INTERVAL_S = 0.2

    def __init__(
        self,
        label: str,
        sizes: Mapping[str, int],
        stream: TextIO,
        *,
        resumed: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.sizes = dict(sizes)
        self.stream = stream
        self.clock = clock
        self.tty = stream.isatty()
        self.started = clock()
        self.done_by_path = {path: min((resumed or {}).get(path, 0), size) for path, size in self.sizes.items()}
        self.received_by_path: dict[str, int] = {}
        self.last_shown = -1e9

    def __call__(self, event: FetchProgress) -> None:
        # A file the check-mode plan did not list (the store changed in between) still counts, whole.
        self.sizes.setdefault(event.path, event.size)
        self.done_by_path[event.path] = event.done
        self.received_by_path[event.path] = event.received
        now = self.clock()
        if now - self.last_shown >= (self.BAR_INTERVAL_S if self.tty else self.LINE_INTERVAL_S):
            self.last_shown = now
            self._show(now)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    @property
    def done(self) -> int:
        return sum(self.done_by_path.values())

    @property
    def received(self) -> int:
        return sum(self.received_by_path.values())

    def line(self, now: float) -> str:
        elapsed_s = now - self.started
        rate = self.received / elapsed_s if elapsed_s > 0 else 0.0
        left = self.total - self.done
        eta_text = "0:00:00" if left <= 0 else "--:--" if rate <= 0 else _clock_text(left / rate)
        return (
            f"{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} "
            f"at {human_bytes(rate)}/s, ETA {eta_text}"
        )

    def _show(self, now: float) -> None:
        if self.tty:
            fraction = min(self.done / self.total, 1.0) if self.total else 1.0
            bar = "#" * int(fraction * 30)
            self.stream.write(f"\r[{bar:<30}] {fraction:6.1%} {self.line(now)}\x1b[K")
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.total == 0:
            return
        self._show(self.clock())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock_text(seconds: float) -> str:
    """H:MM:SS, hours unbounded: a 100 GB model on a slow link takes more than a day."""
    whole = int(seconds + 0.5)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"

# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""meridian-node-pull: converge this host from a git repo of playbooks, only at a commit signed by a trusted key.

One run: fetch the branch into a local bare mirror, resolve it to one commit id, and accept that commit only if
its SSH signature verifies against the allowed signers file, its signed message names this host's target (the
repository and branch, in a Meridian-Pull-Target trailer), and it descends from the last commit applied here
(or carries a signed Meridian-Pull-Rollback-From trailer naming that commit). Then record it, extract exactly
that commit's tree (from the mirror, by id: no second fetch) and run the playbook in it. A refused commit leaves
the current checkout and the last-run record untouched. Stdlib only; the unit runs it with the host's python3
(no shebang: it is never executed directly, so it cannot pick up another interpreter from PATH). It must run on
Python 3.9: no match statements, no `X | Y` outside annotations.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = "/etc/meridian-node/pull.json"
# 2 means the host itself needs an operator: a bad configuration or a damaged record.
EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_CONFIG = 0, 1, 3, 2

# The trailers a signer puts in the commit message; the commit signature covers them like every other byte.
TARGET_TRAILER = "Meridian-Pull-Target"
ROLLBACK_TRAILER = "Meridian-Pull-Rollback-From"
# Full ids only: a prefix could be matched by a commit someone with push access made to fit it.
OBJECT_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
# Keeps the last applied commit's history in the mirror after the branch moves away from it, so the
# descent checks of later runs still have the objects to look at.
APPLIED_REF = "refs/meridian-pull/applied"

# git's %G? letters (git-log(1) "PRETTY FORMATS") as reasons an operator can act on.
SIGNATURE_REASONS = {
    "N": "it is not signed",
    "B": "its signature does not verify: the commit or its signature was altered (bad signature)",
    "U": "it is signed by a key that is not in the allowed signers file",
    "E": "its signature cannot be checked (unknown signature format or ssh-keygen failed)",
    "X": "it is signed with a signature that has expired",
    "Y": "it is signed by a key that has expired",
    "R": "it is signed by a key that has been revoked",
}


class Refusal(enum.Enum):
    """Which rule refused a commit: the journal line's machine key (refusal=...), for alerting."""

    SIGNATURE = "signature"
    TARGET = "target"
    ROLLBACK = "rollback"


class Refused(Exception):
    """The fetched commit must not be applied; nothing was changed."""

    def __init__(self, rule: Refusal, reason: str) -> None:
        super().__init__(reason)
        self.rule = rule


class ConfigError(Exception):
    """The configuration file is missing or wrong."""


class StateError(Exception):
    """The wrapper's own record is damaged; guessing would forget which commits are rollbacks."""


@dataclass(frozen=True)
class Config:
    repo_url: str
    branch: str
    repo_id: str
    playbook: str
    state_dir: Path
    checkout_dir: Path
    allowed_signers: Path
    ansible_playbook: str
    inventory: str
    extra_vars: dict[str, Any]
    only_if_changed: bool
    keep_checkouts: int

    @property
    def target(self) -> str:
        """What a commit's Meridian-Pull-Target trailer must say for this host to apply it."""
        return f"{self.repo_id} {self.branch}"


@dataclass(frozen=True)
class Signed:
    """What one read of the verified commit object gave: who signed it and the trailers of its signed message."""

    principal: str
    targets: tuple[str, ...]
    rollback_from: tuple[str, ...]


def repo_identity(url: str) -> str:
    """host/path of a git URL, without scheme, user, port or a trailing .git, so the same repository reached
    over https or ssh has one identity. Local paths and file:// URLs give the path."""
    if "://" in url:
        parts = urllib.parse.urlsplit(url)
        host, path = (parts.hostname or ""), parts.path
    elif re.match(r"[^/:]+:", url):
        # git's scp-like syntax, [user@]host:path: a colon before any slash (git-clone(1) "GIT URLS").
        login, _colon, path = url.partition(":")
        host = login.rpartition("@")[2].lower()
    else:
        host, path = "", url
    path = path.rstrip("/")
    if path.endswith(".git"):
        path = path[: -len(".git")].rstrip("/")
    return f"{host}/{path.lstrip('/')}" if host else path


def load_config(path: Path) -> Config:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    required = ("repo_url", "branch", "playbook", "state_dir", "checkout_dir", "allowed_signers", "ansible_playbook")
    missing = [key for key in required if not isinstance(raw.get(key), str) or not raw[key]]
    if missing:
        raise ConfigError(f"{path} lacks a non-empty string for: {', '.join(missing)}")
    playbook = Path(raw["playbook"])
    if playbook.is_absolute() or ".." in playbook.parts:
        raise ConfigError(f"playbook {raw['playbook']!r} must be a path inside the repository (relative, no '..')")
    extra_vars = raw.get("extra_vars", {})
    if not isinstance(extra_vars, dict):
        raise ConfigError(f"extra_vars in {path} must be an object, not {type(extra_vars).__name__}")
    repo_id = raw.get("repo_id") or repo_identity(raw["repo_url"])
    # The target trailer is "<repo_id> <branch>": whitespace inside either would make it ambiguous.
    for name, value in (("repo_id", repo_id), ("branch", raw["branch"])):
        if not isinstance(value, str) or not value or re.search(r"\s", value):
            raise ConfigError(
                f"{name} {value!r} in {path} must be a non-empty string without whitespace"
                + ("; set repo_id (ansible_pull_repo_id) explicitly" if name == "repo_id" else "")
            )
    return Config(
        repo_url=raw["repo_url"],
        branch=raw["branch"],
        repo_id=repo_id,
        playbook=raw["playbook"],
        state_dir=Path(raw["state_dir"]),
        checkout_dir=Path(raw["checkout_dir"]),
        allowed_signers=Path(raw["allowed_signers"]),
        ansible_playbook=raw["ansible_playbook"],
        inventory=str(raw.get("inventory", "localhost,")),
        extra_vars=extra_vars,
        only_if_changed=bool(raw.get("only_if_changed", True)),
        keep_checkouts=max(1, int(raw.get("keep_checkouts", 2))),
    )


def log(message: str) -> None:
    # stdout goes to the journal under the unit's name; one line per event.
    print(f"meridian-node-pull: {message}", flush=True)


def git_env() -> dict[str, str]:
    # The mirror is ours; the system's and the user's git config play no part, and git never prompts.
    # Replace refs would let a fetched ref rewrite what a commit's parents are, and so what descends from what.
    return {
        **os.environ,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_NO_REPLACE_OBJECTS": "1",
    }


def git(mirror: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["git", f"--git-dir={mirror}", "-c", "core.hooksPath=/dev/null", *args],
        capture_output=True,
        text=True,
        env=git_env(),
        check=False,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def fetch(cfg: Config) -> tuple[Path, str]:
    """Update the bare mirror from the remote; return it and the commit id the branch points at."""
    mirror = cfg.state_dir / "mirror.git"
    if not (mirror / "HEAD").exists():
        mirror.mkdir(parents=True, exist_ok=True)
        git(mirror, "init", "--quiet", "--bare")
    ref = f"refs/remotes/origin/{cfg.branch}"
    # Fetch by URL, not a configured remote, so a changed repo_url takes effect on the next run.
    git(mirror, "fetch", "--quiet", "--no-tags", "--force", cfg.repo_url, f"+refs/heads/{cfg.branch}:{ref}")
    commit = git(mirror, "rev-parse", "--verify", f"{ref}^{{commit}}").stdout.strip()
    return mirror, commit


def verify(cfg: Config, mirror: Path, commit: str) -> Signed:
    """Return the signer and the signed trailers, or raise Refused naming the reason."""
    if not cfg.allowed_signers.is_file():
        raise Refused(Refusal.SIGNATURE, f"the allowed signers file {cfg.allowed_signers} is missing")
    trust = ("-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={cfg.allowed_signers}")
    # The signature status and the trailers come from one read of the object, parsed by git itself: the same
    # parser the signer's `git interpret-trailers` uses. Keys match case-insensitively, as in git.
    fields = "%x00".join(
        ["%G?", "%GK", "%GS"]
        + [f"%(trailers:key={key},valueonly,unfold,separator=%x1f)" for key in (TARGET_TRAILER, ROLLBACK_TRAILER)]
    )
    shown = git(mirror, *trust, "log", "-1", "--no-show-signature", f"--format={fields}", commit).stdout
    status, key, principal, targets, rollback_from = [*shown.rstrip("\n").split("\x00"), "", "", "", "", ""][:5]
    checked = git(mirror, *trust, "verify-commit", commit, check=False)
    # Both must agree: verify-commit's exit status and git's "good and trusted" letter.
    if checked.returncode == 0 and status == "G" and principal:
        return Signed(
            principal=principal,
            targets=tuple(value.strip() for value in targets.split("\x1f") if value.strip()),
            rollback_from=tuple(value.strip() for value in rollback_from.split("\x1f") if value.strip()),
        )
    reason = SIGNATURE_REASONS.get(status, f"git reports signature status {status or '?'}")
    detail = f" (key {key})" if key else ""
    # One journal line: git's own words, joined.
    said = " / ".join(line.strip() for line in checked.stderr.splitlines() if line.strip()) or "nothing"
    raise Refused(Refusal.SIGNATURE, f"{reason}{detail}; git verify-commit said: {said}")


def check_target(cfg: Config, signed: Signed) -> None:
    """Refuse a commit whose signed message does not name this repository and branch.

    The same key may sign for several repositories and branches; git signs every commit in the one namespace
    "git", so only the signed message can say which repository and branch a signature was meant for."""
    wanted = cfg.target.split()
    if any(value.split() == wanted for value in signed.targets):
        return
    fix = f'the commits this host applies must carry the signed trailer "{TARGET_TRAILER}: {cfg.target}"'
    if not signed.targets:
        raise Refused(Refusal.TARGET, f"its signed message names no target repository and branch; {fix}")
    named = ", ".join(json.dumps(value) for value in signed.targets)
    raise Refused(Refusal.TARGET, f"it is signed for another repository or branch ({TARGET_TRAILER}: {named}); {fix}")


def check_lineage(mirror: Path, previous: str | None, commit: str, signed: Signed) -> str:
    """Return a journal note if commit is applied by a rule worth logging; raise Refused if it moves this host
    back, or onto a history that does not continue the one it runs.

    A rollback marker names the commit(s) it replaces; it lets a host move here only from one of those or
    from an ancestor of one. Naming what it replaces is what makes it single use: once a host has applied a
    commit after the marked one, that commit descends from the marker, and the marker (written before it)
    cannot name it, so pushing the marked commit again is refused like any other rollback."""
    if previous is None:
        return "no last-run record: a first run, so any signed commit for this target is accepted"
    if commit == previous or is_ancestor(mirror, previous, commit):
        return ""
    malformed = [value for value in signed.rollback_from if not OBJECT_ID.fullmatch(value)]
    if malformed:
        raise Refused(
            Refusal.ROLLBACK,
            f"it does not descend from the last applied commit {previous}, and its {ROLLBACK_TRAILER} trailer"
            f" {json.dumps(malformed[0])} is not a full commit id (40 or 64 lowercase hex digits); sign a commit"
            f' with "{ROLLBACK_TRAILER}: {previous}" to move this host to it',
        )
    if not signed.rollback_from:
        raise Refused(
            Refusal.ROLLBACK,
            f"it does not descend from the last applied commit {previous} (a rollback, or rewritten or"
            f" unrelated history) and carries no signed rollback marker; if the rewrite is deliberate, sign it"
            f' (or a commit on top of it) with the trailer "{ROLLBACK_TRAILER}: {previous}"',
        )
    for replaced in signed.rollback_from:
        if replaced == previous or is_ancestor(mirror, previous, replaced):
            return (
                f"it does not descend from the last applied {previous}; its signed {ROLLBACK_TRAILER}"
                f" trailer names {replaced}, so the rollback is deliberate (history rewritten)"
            )
    unknown = [value for value in signed.rollback_from if not has_commit(mirror, value)]
    why = f" (this host has never fetched {', '.join(unknown)}, so cannot tell what it replaced)" if unknown else ""
    raise Refused(
        Refusal.ROLLBACK,
        f"it does not descend from the last applied commit {previous}, and its signed {ROLLBACK_TRAILER}"
        f" trailer names {', '.join(signed.rollback_from)}, which is neither that commit nor a descendant of it"
        f'{why}; sign a commit with "{ROLLBACK_TRAILER}: {previous}" to move this host to it',
    )


def extract(mirror: Path, commit: str, checkout_dir: Path) -> Path:
    """Write exactly this commit's tree to checkout_dir/<commit>, from the mirror's objects."""
    target = checkout_dir / commit
    if target.is_dir():
        return target
    checkout_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}.", dir=checkout_dir))
    try:
        archive = subprocess.run(
            ["git", f"--git-dir={mirror}", "archive", "--format=tar", commit],
            capture_output=True,
            env=git_env(),
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "--no-same-owner", "-C", str(staging)], input=archive, check=True)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def point_current(checkout_dir: Path, target: Path) -> None:
    link = checkout_dir / "current"
    temporary = checkout_dir / ".current.new"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(target.name)
    temporary.replace(link)


def prune(checkout_dir: Path, keep: Sequence[str]) -> None:
    for entry in checkout_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink() and entry.name not in keep and len(entry.name) >= 40:
            shutil.rmtree(entry, ignore_errors=True)


def read_last(cfg: Config) -> dict[str, Any] | None:
    """The last-run record, or None when there is none (a first run). A record that exists but cannot be
    read is an error: treating it as a first run would accept any signed commit, old ones included."""
    path = cfg.state_dir / "last-run.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc}") from exc
    try:
        last = json.loads(text)
    except ValueError as exc:
        raise StateError(damaged(cfg, path, f"it is not JSON: {exc}")) from exc
    if not isinstance(last, dict):
        raise StateError(damaged(cfg, path, f"it holds a JSON {type(last).__name__}, not an object"))
    commit = last.get("commit")
    if not isinstance(commit, str) or not OBJECT_ID.fullmatch(commit):
        raise StateError(damaged(cfg, path, f"its commit is {json.dumps(commit)}, not a full commit id"))
    return last


def damaged(cfg: Config, path: Path, what: str) -> str:
    return (
        f"{path} is damaged ({what}). It records the last applied commit, which every new commit must descend"
        f" from, so this run stops rather than forget it. Restore it (`git --git-dir={cfg.state_dir}/mirror.git"
        f' rev-parse {APPLIED_REF}` prints the last applied commit; write {{"commit": "<that id>"}}), or remove'
        f" it to accept any signed commit for {cfg.target} on the next run, as on a first install"
    )


def write_last(state_dir: Path, record: dict[str, Any]) -> None:
    # Durable before anything runs: after a crash or power loss the record is the old one or the new one,
    # never a torn file (which the next run would refuse to guess about).
    path = state_dir / "last-run.json"
    temporary = path.with_name(".last-run.json.new")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(json.dumps(record, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(path)
    directory = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def play_digest(cfg: Config) -> str:
    """What, besides the commit, decides what a run does: a change re-runs an unchanged commit."""
    inputs = {"playbook": cfg.playbook, "inventory": cfg.inventory, "extra_vars": cfg.extra_vars}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def is_ancestor(mirror: Path, older: str, newer: str) -> bool:
    # A commit the mirror does not have (never fetched, or pruned after a rewrite) cannot be an ancestor either.
    return git(mirror, "merge-base", "--is-ancestor", older, newer, check=False).returncode == 0


def has_commit(mirror: Path, commit: str) -> bool:
    return git(mirror, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode == 0


def run_playbook(cfg: Config, tree: Path, commit: str) -> int:
    extra = {**cfg.extra_vars, "meridian_pull_commit": commit}
    argv = [cfg.ansible_playbook, "-i", cfg.inventory, "-c", "local", "-e", json.dumps(extra), str(tree / cfg.playbook)]
    return subprocess.run(argv, cwd=tree, check=False).returncode


@contextlib.contextmanager
def locked(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / "lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RuntimeError(f"another run holds {state_dir / 'lock'}; this one does nothing") from exc
        yield


def converge(cfg: Config) -> int:
    with locked(cfg.state_dir):
        # Read before fetching: a damaged record stops the run before anything, the mirror included, changes.
        last = read_last(cfg) or {}
        previous: str | None = last.get("commit")
        mirror, commit = fetch(cfg)
        where = f"commit {commit} ({cfg.branch} of {cfg.repo_url})"
        try:
            signed = verify(cfg, mirror, commit)
            check_target(cfg, signed)
            note = check_lineage(mirror, previous, commit, signed)
        except Refused as exc:
            log(
                f"REFUSED commit {commit}: {exc}. Nothing was applied; the current checkout is unchanged"
                f" ({cfg.branch} of {cfg.repo_url}; refusal={exc.rule.value})."
            )
            return EXIT_REFUSED
        if note:
            log(f"note: {commit}: {note}")
        unchanged = previous == commit and last.get("play") == play_digest(cfg)
        if cfg.only_if_changed and unchanged and last.get("result") == "ok":
            log(f"{where} is verified (signed by {signed.principal}) and already applied; nothing to do")
            return EXIT_OK
        log(f"{where} is signed by {signed.principal} for {cfg.target}; applying {cfg.playbook}")
        record = {"commit": commit, "play": play_digest(cfg), "signer": signed.principal}
        # Record, then act: a run killed mid-play has still changed the host, so from here on this commit is
        # the one later commits must descend from. "started" also makes the next run play it again.
        write_last(cfg.state_dir, {**record, "result": "started", "rc": None, "started": int(time.time())})
        git(mirror, "update-ref", APPLIED_REF, commit)
        tree = extract(mirror, commit, cfg.checkout_dir)
        point_current(cfg.checkout_dir, tree)
        started = time.time()
        rc = run_playbook(cfg, tree, commit)
        result = "ok" if rc == 0 else "failed"
        write_last(
            cfg.state_dir,
            {
                **record,
                "result": result,
                "rc": rc,
                "finished": int(time.time()),
                "seconds": round(time.time() - started, 1),
            },
        )
        prune(cfg.checkout_dir, keep=[commit, previous] if previous is not None else [commit])
        log(f"{where}: playbook {cfg.playbook} {'succeeded' if rc == 0 else f'failed with exit status {rc}'}")
        return EXIT_OK if rc == 0 else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="meridian-node-pull", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--config", type=Path, default=Path(DEFAULT_CONFIG), help=f"JSON configuration (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--show-target",
        action="store_true",
        help=f"print the {TARGET_TRAILER} trailer this host's commits must carry, and exit",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.show_target:
            print(f"{TARGET_TRAILER}: {cfg.target}")
            return EXIT_OK
        return converge(cfg)
    except (ConfigError, StateError) as exc:
        log(f"{'configuration' if isinstance(exc, ConfigError) else 'state'} error: {exc}")
        return EXIT_CONFIG
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        log(f"run failed: {exc}. The next run tries again.")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

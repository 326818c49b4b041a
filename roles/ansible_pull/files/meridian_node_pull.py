# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""meridian-node-pull: converge this host from a git repo of playbooks, only at a commit signed by a trusted key.

One run: fetch the branch into a local bare mirror, resolve it to one commit id, verify that commit's SSH
signature against the allowed signers file, extract exactly that commit's tree (from the mirror, by id: no
second fetch), and run the playbook in it. Anything that fails before the playbook runs leaves the current
checkout and the last-run record untouched. Stdlib only; the unit runs it with the host's python3 (no shebang:
it is never executed directly, so it cannot pick up another interpreter from PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = "/etc/meridian-node/pull.json"
EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_CONFIG = 0, 1, 3, 2

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


class Refused(Exception):
    """The fetched commit must not be applied; nothing was changed."""


class ConfigError(Exception):
    """The configuration file is missing or wrong."""


@dataclass(frozen=True)
class Config:
    repo_url: str
    branch: str
    playbook: str
    state_dir: Path
    checkout_dir: Path
    allowed_signers: Path
    ansible_playbook: str
    inventory: str
    extra_vars: dict[str, Any]
    only_if_changed: bool
    keep_checkouts: int


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
    return Config(
        repo_url=raw["repo_url"],
        branch=raw["branch"],
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
    return {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}


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


def verify(cfg: Config, mirror: Path, commit: str) -> str:
    """Return the signer's principal, or raise Refused naming the reason."""
    if not cfg.allowed_signers.is_file():
        raise Refused(f"the allowed signers file {cfg.allowed_signers} is missing")
    trust = ("-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={cfg.allowed_signers}")
    shown = git(mirror, *trust, "log", "-1", "--no-show-signature", "--format=%G?%n%GK%n%GS", commit).stdout
    status, key, principal = [*shown.splitlines(), "", "", ""][:3]
    checked = git(mirror, *trust, "verify-commit", commit, check=False)
    # Both must agree: verify-commit's exit status and git's "good and trusted" letter.
    if checked.returncode == 0 and status == "G" and principal:
        return principal
    reason = SIGNATURE_REASONS.get(status, f"git reports signature status {status or '?'}")
    detail = f" (key {key})" if key else ""
    # One journal line: git's own words, joined.
    said = " / ".join(line.strip() for line in checked.stderr.splitlines() if line.strip()) or "nothing"
    raise Refused(f"{reason}{detail}; git verify-commit said: {said}")


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


def read_last(state_dir: Path) -> dict[str, Any]:
    try:
        last = json.loads((state_dir / "last-run.json").read_text())
    except (OSError, ValueError):
        return {}
    return last if isinstance(last, dict) else {}


def write_last(state_dir: Path, record: dict[str, Any]) -> None:
    path = state_dir / "last-run.json"
    temporary = path.with_name(".last-run.json.new")
    temporary.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    temporary.replace(path)


def play_digest(cfg: Config) -> str:
    """What, besides the commit, decides what a run does: a change re-runs an unchanged commit."""
    inputs = {"playbook": cfg.playbook, "inventory": cfg.inventory, "extra_vars": cfg.extra_vars}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def is_ancestor(mirror: Path, older: str, newer: str) -> bool:
    # A commit the mirror no longer has (pruned after a rewrite) cannot be an ancestor either.
    return git(mirror, "merge-base", "--is-ancestor", older, newer, check=False).returncode == 0


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
        mirror, commit = fetch(cfg)
        where = f"commit {commit} ({cfg.branch} of {cfg.repo_url})"
        try:
            principal = verify(cfg, mirror, commit)
        except Refused as exc:
            log(f"REFUSED {where}: {exc}. Nothing was applied; the current checkout is unchanged.")
            return EXIT_REFUSED
        last = read_last(cfg.state_dir)
        previous = last.get("commit")
        rewritten = isinstance(previous, str) and previous != commit and not is_ancestor(mirror, previous, commit)
        if rewritten:
            # Signers may roll back or rewrite on purpose; a signed commit is applied like any other.
            log(
                f"note: {commit} does not descend from the last applied {previous} (history rewritten);"
                " it is signed, so it is applied like any other signed commit"
            )
        unchanged = previous == commit and last.get("play") == play_digest(cfg)
        if cfg.only_if_changed and unchanged and last.get("result") == "ok":
            log(f"{where} is verified (signed by {principal}) and already applied; nothing to do")
            return EXIT_OK
        log(f"{where} is signed by {principal}; applying {cfg.playbook}")
        tree = extract(mirror, commit, cfg.checkout_dir)
        point_current(cfg.checkout_dir, tree)
        started = time.time()
        rc = run_playbook(cfg, tree, commit)
        result = "ok" if rc == 0 else "failed"
        write_last(
            cfg.state_dir,
            {
                "commit": commit,
                "play": play_digest(cfg),
                "signer": principal,
                "result": result,
                "rc": rc,
                "finished": int(time.time()),
                "seconds": round(time.time() - started, 1),
            },
        )
        prune(cfg.checkout_dir, keep=[commit, previous] if isinstance(previous, str) else [commit])
        log(f"{where}: playbook {cfg.playbook} {'succeeded' if rc == 0 else f'failed with exit status {rc}'}")
        return EXIT_OK if rc == 0 else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="meridian-node-pull", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--config", type=Path, default=Path(DEFAULT_CONFIG), help=f"JSON configuration (default {DEFAULT_CONFIG})"
    )
    args = parser.parse_args(argv)
    try:
        return converge(load_config(args.config))
    except ConfigError as exc:
        log(f"configuration error: {exc}")
        return EXIT_CONFIG
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        log(f"run failed before anything was applied or recorded: {exc}")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

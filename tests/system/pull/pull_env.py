"""A real git repo of playbooks with SSH-signed commits, and the ansible_pull role rendered into a temp dir.

Keys come from ssh-keygen, signatures from git (gpg.format=ssh), the role from ansible-playbook running
playbooks/ansible_pull.yml with only its documented install paths pointed into the test's directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.meridian.node.tests.support.engine_harness import REPO, VENV_BIN, run_playbook

PLAYBOOK = REPO / "playbooks" / "ansible_pull.yml"
TARGET_TRAILER = "Meridian-Pull-Target"
ROLLBACK_TRAILER = "Meridian-Pull-Rollback-From"
# What systemd gives a root system service that sets no User=: PATH and the unit's Environment= lines.
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "Signer",
    "GIT_AUTHOR_EMAIL": "signer@example.test",
    "GIT_COMMITTER_NAME": "Signer",
    "GIT_COMMITTER_EMAIL": "signer@example.test",
}

LOCAL_YML = """\
- name: Converge from the pull repo
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Record the applied commit
      ansible.builtin.copy:
        dest: "{{{{ marker }}}}"
        content: "{{{{ meridian_pull_commit }}}} {revision}\\n"
        mode: "0644"
{extra}"""
FAILING_TASK = """\
    - name: Fail on purpose
      ansible.builtin.fail:
        msg: this revision fails
"""


def make_ssh_key(directory: Path, name: str) -> Path:
    """A fresh ed25519 key pair; returns the private key's path (the public key is beside it, .pub)."""
    key = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def public_key(key: Path) -> str:
    return key.with_suffix(".pub").read_text().strip()


def git(cwd: Path, *args: str, input_text: str | None = None) -> str:
    done = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **GIT_ENV},
        input=input_text,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"git {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done.stdout.strip()


class PlaybookRepo:
    """A bare 'origin' on disk (what hosts fetch) and a work clone that commits and pushes to it."""

    def __init__(self, root: Path) -> None:
        self.origin = root / "origin.git"
        self.work = root / "work"
        root.mkdir(parents=True, exist_ok=True)
        git(root, "init", "--quiet", "--bare", "--initial-branch=main", str(self.origin))
        git(root, "clone", "--quiet", str(self.origin), str(self.work))
        git(self.work, "checkout", "--quiet", "-B", "main")

    @property
    def url(self) -> str:
        return f"file://{self.origin}"

    @property
    def repo_id(self) -> str:
        """The wrapper's default identity for a file:// URL (the role's README): the path without .git."""
        return str(self.origin.with_suffix(""))

    def trailers(self, *more: str, branch: str = "main") -> list[str]:
        """The target trailer that hosts following this repo's branch require, then more."""
        return [f"{TARGET_TRAILER}: {self.repo_id} {branch}", *more]

    def commit(
        self,
        revision: str,
        *,
        key: Path | None,
        failing: bool = False,
        trailers: Sequence[str] | None = None,
        extra_tasks: str = "",
    ) -> str:
        """Commit local.yml for this revision (signed with key, or unsigned) and push it to main. Its message
        ends with trailers (default: the target trailer of this repo's main)."""
        extra = (FAILING_TASK if failing else "") + extra_tasks
        (self.work / "local.yml").write_text(LOCAL_YML.format(revision=revision, extra=extra))
        git(self.work, "add", "local.yml")
        signing = ["-c", "gpg.format=ssh", "-c", f"user.signingkey={key}"] if key else []
        paragraphs = ["-m", revision]
        lines = self.trailers() if trailers is None else list(trailers)
        if lines:
            paragraphs += ["-m", "\n".join(lines)]
        git(self.work, *signing, "commit", "--quiet", *(["-S"] if key else ["--no-gpg-sign"]), *paragraphs)
        sha = git(self.work, "rev-parse", "HEAD")
        self.push(sha)
        return sha

    def push(self, sha: str) -> None:
        """Point origin's main at sha, forcing it (a rewrite) when it does not descend from the old tip."""
        git(self.work, "push", "--quiet", "--force", str(self.origin), f"{sha}:refs/heads/main")

    def tamper(self, signed_sha: str, revision: str) -> str:
        """A commit that carries signed_sha's signature over different content (a new tree), as an attacker
        with push access but no key would forge one. Returns its id; it is not pushed."""
        (self.work / "local.yml").write_text(LOCAL_YML.format(revision=revision, extra=""))
        git(self.work, "add", "local.yml")
        tree = git(self.work, "write-tree")
        body = git(self.work, "cat-file", "commit", signed_sha)
        forged, count = re.subn(r"^tree [0-9a-f]{40}$", f"tree {tree}", body, count=1, flags=re.MULTILINE)
        assert count == 1 and "gpgsig -----BEGIN SSH SIGNATURE-----" in forged
        return git(self.work, "hash-object", "-t", "commit", "-w", "--stdin", input_text=forged + "\n")

    def tamper_signature(self, signed_sha: str) -> str:
        """signed_sha with one byte of its signature's final (signature) part changed: same content, broken
        signature. Returns the new commit's id; it is not pushed."""
        lines = git(self.work, "cat-file", "commit", signed_sha).split("\n")
        end = lines.index(" -----END SSH SIGNATURE-----")
        target = end - 2  # a full base64 line inside the signature blob's last part
        middle = len(lines[target]) // 2
        flipped = "A" if lines[target][middle] != "A" else "B"
        lines[target] = lines[target][:middle] + flipped + lines[target][middle + 1 :]
        return git(self.work, "hash-object", "-t", "commit", "-w", "--stdin", input_text="\n".join(lines) + "\n")


@dataclass(frozen=True)
class Installed:
    root: Path
    unit_dir: Path
    config_dir: Path
    state_dir: Path
    checkout_dir: Path
    libexec_dir: Path

    @property
    def service(self) -> Path:
        return self.unit_dir / "meridian-node-pull.service"

    @property
    def timer(self) -> Path:
        return self.unit_dir / "meridian-node-pull.timer"


def install_paths(root: Path) -> Installed:
    return Installed(
        root=root,
        unit_dir=root / "etc" / "systemd" / "system",
        config_dir=root / "etc" / "meridian-node",
        state_dir=root / "var" / "lib" / "meridian-node-pull",
        checkout_dir=root / "var" / "lib" / "meridian-node-pull" / "checkouts",
        libexec_dir=root / "usr" / "local" / "libexec" / "meridian-node",
    )


def role_vars(installed: Installed, repo_url: str, signers: list[dict[str, str]], **extra: object) -> dict[str, object]:
    """The role's variables for a test: the documented install paths moved under installed.root, the venv's
    ansible-playbook, no packages and no systemd (PID 1 here is not systemd); all else at its defaults."""
    return {
        "ansible_pull_hosts": "localhost",
        "ansible_become": False,
        "ansible_pull_repo_url": repo_url,
        "ansible_pull_signers": signers,
        "ansible_pull_ansible_playbook": str(VENV_BIN / "ansible-playbook"),
        "ansible_pull_packages": [],
        "ansible_pull_manage_service": False,
        "ansible_pull_unit_dir": str(installed.unit_dir),
        "ansible_pull_config_dir": str(installed.config_dir),
        "ansible_pull_state_dir": str(installed.state_dir),
        "ansible_pull_checkout_dir": str(installed.checkout_dir),
        "ansible_pull_libexec_dir": str(installed.libexec_dir),
        **extra,
    }


def apply_role(
    installed: Installed, variables: dict[str, object], *extra_args: str
) -> subprocess.CompletedProcess[str]:
    temp = installed.root / "ansible-tmp"
    temp.mkdir(parents=True, exist_ok=True)
    vars_file = installed.root / "role-vars.json"
    vars_file.write_text(json.dumps(variables))
    return run_playbook(PLAYBOOK, temp_dir=temp, extra_args=["-e", f"@{vars_file}", *extra_args])


def unit_values(unit: Path, key: str) -> list[str]:
    return [
        line.partition("=")[2].strip()
        for line in unit.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#") and line.partition("=")[0].strip() == key
    ]


def run_service(installed: Installed, home: Path) -> subprocess.CompletedProcess[str]:
    """Run the rendered service's ExecStart with the environment systemd would give it."""
    (exec_start,) = unit_values(installed.service, "ExecStart")
    env = {"PATH": SYSTEMD_PATH, "HOME": str(home), "LANG": "C.UTF-8"}
    for assignment in unit_values(installed.service, "Environment"):
        name, _equals, value = assignment.partition("=")
        env[name] = value
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        shlex.split(exec_start), env=env, capture_output=True, text=True, timeout=300, check=False, cwd="/"
    )

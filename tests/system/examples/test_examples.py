"""examples/ never rots: every agent config passes the real ``meridian-node check-config`` under the example
policy, the example desired state is published (signed and stored) by the real devserver and verifies under that
policy, and the example playbook and inventory pass ``ansible-playbook --syntax-check`` and ``ansible-lint``.

The examples name the host's real paths (``/etc/meridian``, ``/var/lib/meridian-node``...), as an operator
installs them. check-config reads the policy there and checks the air-gap directories' owners and modes, so each
file is copied under a temporary root with only those two prefixes moved (``rooted``), like a chroot; nothing
else in a file changes. The trusted keys the policy names are made there with ``meridian-node keygen``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent
CONFIGS = sorted((EXAMPLES / "agent").glob("*.yaml"))
NODE_ID = "gpu-node-01"
# The host paths an example may name: the rest of each file is used as it is.
HOST_PREFIX = re.compile(r"(?<![\w.~-])/(etc|var/lib)/")
# The policy's optional roles, commented out with the condition to uncomment them under.
COMMENTED_FIELD = re.compile(r"^  # ((?:  )?[a-z_]+:)", re.MULTILINE)


def rooted(text: str, root: Path) -> str:
    """``text`` with every host path moved under ``root`` (``/etc/x`` -> ``ROOT/etc/x``)."""
    return HOST_PREFIX.sub(lambda match: f"{root}/{match.group(1)}/", text)


def run(argv: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False, timeout=300, **kwargs)  # type: ignore[call-overload, no-any-return]


def install_policy(root: Path, *, uncommented: bool = False) -> Path:
    """The example policy at ROOT/etc/meridian/policy.yaml (``uncommented``: its optional roles too), with a fresh
    key pair for each key it names."""
    text = rooted((EXAMPLES / "policy.yaml").read_text(encoding="utf-8"), root)
    if uncommented:
        text = COMMENTED_FIELD.sub(r"  \1", text)
    for role in yaml.safe_load(text)["trust"].values():
        for public in map(Path, role["public_keys"]):
            public.parent.mkdir(parents=True, exist_ok=True)
            private = public.with_name(public.name.replace(".pub.pem", ".pem"))
            done = run([BIN / "meridian-node", "keygen", "--out", private])
            assert done.returncode == 0, done.stderr
            assert public.is_file(), f"keygen --out {private} did not write {public}"
    policy = root / "etc" / "meridian" / "policy.yaml"
    policy.write_text(text, encoding="utf-8")
    return policy


def make_host_dirs(root: Path, config: dict[str, Any]) -> None:
    """The directories the role and the units make before the agent starts (check-config checks their modes)."""
    air_gap = config.get("air_gap")
    if isinstance(air_gap, dict):
        inbox = Path(str(air_gap["inbox"]))
        inbox.mkdir(parents=True)
        inbox.chmod(0o700)
    Path(str(config["state_dir"])).mkdir(parents=True, exist_ok=True)


def test_the_examples_name_every_mode_and_both_ways_of_applying() -> None:
    seen = {(c["mode"], c.get("apply", {}).get("via", "in-process")) for c in map(_load, CONFIGS)}
    modes = {mode for mode, _ in seen}
    assert modes >= {"managed-host", "air-gapped", "kubernetes-integrated"}, seen
    assert ("managed-host", "in-process") in seen and ("managed-host", "systemd") in seen, seen


def test_the_policys_commented_roles_are_valid_once_uncommented(tmp_path: Path) -> None:
    policy = install_policy(tmp_path / "root", uncommented=True)
    trust = yaml.safe_load(policy.read_text(encoding="utf-8"))["trust"]
    assert set(trust) == {"control", "artifact", "air_gap_authority"}
    loaded = load_policy(policy)
    assert all(loaded.trusted_keys(role) for role in trust)


def test_every_host_path_in_the_examples_is_one_the_rewrite_moves() -> None:
    for path in [*CONFIGS, EXAMPLES / "policy.yaml"]:
        for value in _strings(yaml.safe_load(path.read_text(encoding="utf-8"))):
            if value.startswith("/"):
                assert HOST_PREFIX.match(value), f"{path.name}: {value} is outside /etc and /var/lib"


@pytest.mark.parametrize("example", CONFIGS, ids=[c.name for c in CONFIGS])
def test_check_config_accepts_the_example(example: Path, tmp_path: Path) -> None:
    air_gapped = _load(example)["mode"] == "air-gapped"
    if air_gapped and os.geteuid() != 0:
        pytest.skip("the air-gapped example's inbox is root's: check-config checks that only as root")
    root = tmp_path / "root"
    # As the policy's comments say: an air-gapped host trusts an air-gap authority.
    install_policy(root, uncommented=air_gapped)
    config = root / "etc" / "meridian-node" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(rooted(example.read_text(encoding="utf-8"), root), encoding="utf-8")
    make_host_dirs(root, yaml.safe_load(config.read_text(encoding="utf-8")))

    done = run([BIN / "meridian-node", "--config", config, "check-config"])

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "ok", done.stdout
    assert f"node {NODE_ID}, mode {_load(example)['mode']}" in done.stdout


def test_the_example_state_is_published_signed_and_verifies(tmp_path: Path) -> None:
    data_dir = tmp_path / "control-plane"
    envelope = tmp_path / "state.env.json"

    published = run(
        [
            BIN / "meridian-node-devserver",
            "publish",
            "--data-dir",
            data_dir,
            NODE_ID,
            EXAMPLES / "desired-state.yaml",
            "--out",
            envelope,
        ]
    )
    assert published.returncode == 0, published.stderr
    assert published.stdout.strip() == f"node {NODE_ID}: generation 1 (lease epoch 1)"

    # Stored: the devserver's own table lists the node at generation 1.
    nodes = run([BIN / "meridian-node-devserver", "nodes", "--data-dir", data_dir])
    assert nodes.returncode == 0 and NODE_ID in nodes.stdout, nodes.stdout + nodes.stderr
    # Signed by the devserver's control key, and acceptable to a host running the example policy.
    root = tmp_path / "root"
    policy = install_policy(root)
    (root / "etc" / "meridian" / "keys" / "control.pub.pem").write_bytes(
        (data_dir / "control" / "control.pub.pem").read_bytes()
    )
    verified = run(
        [
            BIN / "meridian-node",
            "verify",
            "--policy",
            policy,
            "--kind",
            "desired-state",
            "--node-id",
            NODE_ID,
            "--state-dir",
            tmp_path / "record",
            envelope,
        ]
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_the_example_playbook_passes_syntax_check_and_ansible_lint(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".build" / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    ansible = EXAMPLES / "ansible"
    syntax = run(
        [BIN / "ansible-playbook", "--syntax-check", "-i", ansible / "inventory.ini", ansible / "site.yml"], env=env
    )
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    # The inventory parses into the group the playbook targets.
    hosts = run([BIN / "ansible-inventory", "-i", ansible / "inventory.ini", "--list"], env=env)
    assert hosts.returncode == 0, hosts.stderr
    assert "gpu-node-01" in hosts.stdout and "gpu_hosts" in hosts.stdout

    # A copy, linted where it lies: ansible-lint keeps its cache (.ansible/) in the project it lints.
    copy = tmp_path / "examples"
    shutil.copytree(EXAMPLES, copy)
    lint = run([BIN / "ansible-lint", "--offline", "--nocolor", "--profile", "production", "."], env=env, cwd=copy)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "0 failure(s), 0 warning(s)" in lint.stdout + lint.stderr, lint.stdout + lint.stderr


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict), path
    return document


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def test_the_examples_ship_in_the_collection(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    done = run([BIN / "ansible-galaxy", "collection", "build", "--output-path", tmp_path, REPO], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (tarball,) = tmp_path.glob("meridian-node-*.tar.gz")
    with tarfile.open(tarball) as archive:
        shipped = {name for name in archive.getnames() if name.startswith("examples/")}
    expected = {str(path.relative_to(REPO)) for path in EXAMPLES.rglob("*") if path.is_file()}
    assert expected <= shipped, f"{sorted(expected - shipped)} not in the collection (galaxy.yml's manifest)"

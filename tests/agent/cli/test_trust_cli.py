"""``meridian-node keygen | sign | verify``: the fixed forms other tools script against.

Every rejection code is produced here through the CLI from a real signed envelope, with ``--record`` on,
and the state directory is compared byte for byte before and after: a rejection changes nothing.
"""

import base64
import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    NOW,
    SigningKey,
    desired_state,
    envelope,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent import cli

AT = format_rfc3339(NOW)
MERIDIAN_NODE = Path(sys.executable).parent / "meridian-node"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


class Host:
    """A policy, a state dir and a control key in a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.control = make_key()
        self.policy = write_policy(root, control=[self.control])
        self.state_dir = root / "state"

    def write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        return path

    def envelope(self, name: str, keys: list[SigningKey] | None = None, **overrides: Any) -> Path:
        payload = desired_state(**overrides)
        return self.write(name, signed("desired-state", payload, keys or [self.control]))

    def verify(self, capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
        status, out, err = run_cli(
            capsys,
            "verify",
            "--policy",
            self.policy,
            "--kind",
            "desired-state",
            "--node-id",
            NODE_ID,
            "--state-dir",
            self.state_dir,
            "--at",
            AT,
            *extra,
            path,
        )
        lines = out.splitlines()
        assert len(lines) == 1, f"verify must print exactly one JSON line, got {out!r} (stderr {err!r})"
        return status, json.loads(lines[0])

    def state_snapshot(self) -> dict[str, bytes]:
        if not self.state_dir.exists():
            return {}
        return {p.name: p.read_bytes() for p in sorted(self.state_dir.iterdir())}


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def _tampered(host: Host) -> Path:
    document = envelope("desired-state", desired_state(generation=9), [host.control])
    document["payload"] = dsse_b64(json.dumps(desired_state(generation=10)).encode())
    return host.write("tampered.json", json.dumps(document).encode())


def dsse_b64(body: bytes) -> str:
    return base64.b64encode(body).decode()


# Each attack, as the envelope file it arrives in. Applied state before each: generation 5, epoch 2.
ATTACKS: dict[str, Callable[[Host], Path]] = {
    "malformed": lambda h: h.write("garbage.json", b'{"payloadType": "application/vnd.meridian.desired'),
    "wrong-payload-type": lambda h: h.write(
        "manifest-type.json", signed("artifact-manifest", desired_state(generation=9), [h.control])
    ),
    "threshold-not-met": lambda h: h.envelope("intruder.json", keys=[make_key()], generation=9, lease_epoch=2),
    "schema": lambda h: h.envelope("unknown-field.json", generation=9, lease_epoch=2, run_as_root=True),
    "wrong-node": lambda h: h.envelope("other-node.json", generation=9, lease_epoch=2, node_id="gpu-node-2"),
    "expired": lambda h: h.envelope(
        "expired.json",
        generation=9,
        lease_epoch=2,
        issued_at=format_rfc3339(NOW - timedelta(hours=2)),
        expires_at=format_rfc3339(NOW - timedelta(seconds=1)),
    ),
    "not-yet-valid": lambda h: h.envelope(
        "future.json",
        generation=9,
        lease_epoch=2,
        issued_at=format_rfc3339(NOW + timedelta(minutes=6)),
        expires_at=format_rfc3339(NOW + timedelta(hours=2)),
    ),
    "replayed": lambda h: h.envelope("older.json", generation=4, lease_epoch=2),
    "stale-epoch": lambda h: h.envelope("fenced.json", generation=9, lease_epoch=1),
}


def test_every_rejection_code_has_an_attack() -> None:
    from ansible_collections.meridian.node.plugins.module_utils.trust.verify import RejectionCode

    assert set(ATTACKS) == {code.value for code in RejectionCode}


@pytest.mark.parametrize("code", sorted(ATTACKS))
def test_rejection_exits_1_with_its_code_and_changes_nothing(
    host: Host, capsys: pytest.CaptureFixture[str], code: str
) -> None:
    applied = host.envelope("applied.json", generation=5, lease_epoch=2)
    assert host.verify(capsys, applied, "--record")[1]["recorded"] is True
    before = host.state_snapshot()
    assert before, "the applied state should be on disk before the attack"

    status, result = host.verify(capsys, ATTACKS[code](host), "--record")

    assert status == 1
    assert result["accepted"] is False
    assert result["reason"] == code
    assert result["message"]
    assert host.state_snapshot() == before


def test_a_tampered_payload_is_not_signed_by_anyone(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    status, result = host.verify(capsys, _tampered(host))
    assert (status, result["reason"]) == (1, "threshold-not-met")


def test_accept_record_then_same_envelope_is_already_applied(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    path = host.envelope("gen3.json", generation=3, lease_epoch=1)

    status, first = host.verify(capsys, path, "--record")
    assert status == 0
    assert first == {
        "accepted": True,
        "kind": "desired-state",
        "signers": [host.control.keyid],
        "node_id": NODE_ID,
        "generation": 3,
        "lease_epoch": 1,
        "expires_at": format_rfc3339(NOW + timedelta(hours=1)),
        "already_applied": False,
        "recorded": True,
    }
    recorded = json.loads((host.state_dir / "applied.json").read_text())
    assert (recorded["generation"], recorded["epoch"]) == (3, 1)

    status, again = host.verify(capsys, path, "--record")
    assert status == 0
    assert (again["already_applied"], again["recorded"]) == (True, False)


def test_verify_without_record_leaves_the_state_dir_alone(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    status, result = host.verify(capsys, host.envelope("gen3.json", generation=3))
    assert (status, result["recorded"]) == (0, False)
    assert not host.state_dir.exists()


def test_at_verifies_as_of_another_time(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    path = host.envelope("gen3.json", generation=3)
    later = format_rfc3339(NOW + timedelta(hours=2))
    status, out, _ = run_cli(
        capsys,
        "verify",
        "--policy",
        host.policy,
        "--kind",
        "desired-state",
        "--node-id",
        NODE_ID,
        "--state-dir",
        host.state_dir,
        "--at",
        later,
        path,
    )
    assert status == 1
    assert json.loads(out)["reason"] == "expired"


@pytest.mark.parametrize(
    ("problem", "argv_tail", "expected"),
    [
        ("policy file missing", ["--policy", "{root}/absent.yaml"], "absent.yaml"),
        ("policy malformed", ["--policy", "{root}/bad-policy.yaml"], "trust.control.threshold"),
        ("envelope file missing", ["{root}/nope.json"], "nope.json"),
    ],
)
def test_usage_and_policy_errors_exit_2_naming_the_problem(
    host: Host, capsys: pytest.CaptureFixture[str], problem: str, argv_tail: list[str], expected: str
) -> None:
    (host.root / "bad-policy.yaml").write_text("trust:\n  control: {threshold: 0, public_keys: [keys/control-0.pem]}\n")
    envelope_path = host.envelope("gen3.json", generation=3)
    argv = [
        "verify",
        "--policy",
        str(host.policy),
        "--kind",
        "desired-state",
        "--node-id",
        NODE_ID,
        "--state-dir",
        str(host.state_dir),
    ]
    tail = [part.format(root=host.root) for part in argv_tail]
    if tail[0].startswith("--"):
        argv += [*tail, str(envelope_path)]
    else:
        argv += tail

    status, out, err = run_cli(capsys, *argv)

    assert status == 2, problem
    assert out == ""
    assert expected in err


def test_bad_at_is_a_usage_error(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(
            [
                "verify",
                "--policy",
                str(host.policy),
                "--kind",
                "desired-state",
                "--at",
                "yesterday",
                str(host.envelope("gen3.json")),
            ]
        )
    assert exited.value.code == 2
    assert "RFC 3339" in capsys.readouterr().err


def test_keygen_writes_a_private_key_0600_and_prints_its_keyid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path = tmp_path / "control.pem"
    status, out, _ = run_cli(capsys, "keygen", "--out", key_path)

    assert status == 0
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    private = dsse.load_private_key_pem(key_path.read_bytes())
    assert out.strip() == dsse.keyid_for(private.public_key())
    public = dsse.load_public_key_pem((tmp_path / "control.pub.pem").read_bytes())
    assert dsse.keyid_for(public) == out.strip()

    # A second keygen must not destroy the first key.
    status, _, err = run_cli(capsys, "keygen", "--out", key_path)
    assert status == 2
    assert "--force" in err
    assert dsse.keyid_for(dsse.load_private_key_pem(key_path.read_bytes()).public_key()) == out.strip()


def test_sign_with_several_keys_meets_a_threshold_of_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = []
    for name in ("a", "b"):
        run_cli(capsys, "keygen", "--out", tmp_path / f"{name}.pem")
        keys.append(key_from_file(tmp_path / f"{name}.pem"))
    payload = tmp_path / "state.json"
    payload.write_text(json.dumps(desired_state(generation=2)))

    status, out, _ = run_cli(
        capsys, "sign", "--key", tmp_path / "a.pem", "--key", tmp_path / "b.pem", "--type", "desired-state", payload
    )
    assert status == 0
    document = json.loads(out)
    assert document["payloadType"] == dsse.PAYLOAD_TYPES["desired-state"]
    assert {s["keyid"] for s in document["signatures"]} == {k.keyid for k in keys}

    policy = write_policy(tmp_path / "p", control=keys, control_threshold=2)
    (tmp_path / "env.json").write_text(out)
    status, out, _ = run_cli(
        capsys,
        "verify",
        "--policy",
        policy,
        "--kind",
        "desired-state",
        "--node-id",
        NODE_ID,
        "--state-dir",
        tmp_path / "state",
        "--at",
        AT,
        tmp_path / "env.json",
    )
    assert status == 0, out
    assert sorted(json.loads(out)["signers"]) == sorted(k.keyid for k in keys)


def key_from_file(path: Path) -> SigningKey:
    """The key ``keygen`` wrote, in the form the test helpers take."""
    private_pem = path.read_bytes()
    private = dsse.load_private_key_pem(private_pem)
    return SigningKey(
        private=private,
        keyid=dsse.keyid_for(private.public_key()),
        public_pem=dsse.public_key_pem(private.public_key()),
        private_pem=private_pem,
    )


def test_sign_refuses_a_document_hosts_would_reject(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(capsys, "keygen", "--out", tmp_path / "k.pem")
    payload = tmp_path / "state.json"
    payload.write_text(json.dumps(desired_state(generation=0)))

    status, out, err = run_cli(capsys, "sign", "--key", tmp_path / "k.pem", "--type", "desired-state", payload)

    assert status == 2
    assert out == ""
    assert "generation" in err and "refusing to sign" in err


def test_console_script_round_trip(tmp_path: Path) -> None:
    """The installed ``meridian-node`` entry point, as other tools call it."""

    def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(MERIDIAN_NODE), *map(str, argv)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=dict(os.environ),
            check=False,
        )

    def verify(kind: str) -> subprocess.CompletedProcess[str]:
        options = ["--policy", "policy.yaml", "--kind", kind, "--node-id", NODE_ID, "--state-dir", "state"]
        return run("verify", *options, "--at", AT, "env.json")

    keyid = run("keygen", "--out", "control.pem").stdout.strip()
    (tmp_path / "policy.yaml").write_text("trust:\n  control: {threshold: 1, public_keys: [control.pub.pem]}\n")
    (tmp_path / "state.json").write_text(json.dumps(desired_state(generation=1)))
    signed_run = run("sign", "--key", "control.pem", "--type", "desired-state", "--out", "env.json", "state.json")
    assert signed_run.returncode == 0, signed_run.stderr

    accepted = verify("desired-state")
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout)["signers"] == [keyid]

    wrong_kind = verify("bundle")
    assert wrong_kind.returncode == 1
    assert json.loads(wrong_kind.stdout)["reason"] == "wrong-payload-type"

    assert run("verify", "--kind", "nonsense", "env.json").returncode == 2
    for verb in ("keygen", "sign", "verify"):
        helped = run(verb, "--help")
        assert helped.returncode == 0 and "usage: meridian-node " + verb in helped.stdout

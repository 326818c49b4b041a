"""``meridian-node make-bundle`` and ``verify --kind bundle FILE.tar``: real keys made by ``keygen``, real
files, the one-JSON-line output other tools script against, and a refused input that writes nothing."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.trust_fixtures import NODE_ID, artifact_manifest, current_state
from meridian_node_agent import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def site(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """Keys for every role, a policy trusting them with scratch under ``tmp_path``, a state valid now
    (the CLI reads the clock), a signed manifest with its file, a playbook and a collection tarball."""
    for role in ("control", "artifact", "authority"):
        assert run(capsys, "keygen", "--out", tmp_path / f"{role}.pem")[0] == 0
    (tmp_path / "policy.yaml").write_text(
        "trust:\n"
        "  control: {public_keys: [control.pub.pem]}\n"
        "  artifact: {public_keys: [artifact.pub.pem]}\n"
        "  air_gap_authority: {public_keys: [authority.pub.pem]}\n"
        f"air_gap: {{scratch_dir: {tmp_path / 'scratch'}}}\n"
    )
    model = tmp_path / "model"
    model.mkdir()
    weights = b"weights" * 1000
    (model / "weights.bin").write_bytes(weights)
    entry = {"path": "weights.bin", "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}
    (tmp_path / "manifest-body.json").write_text(json.dumps(artifact_manifest(name="m", version="1", files=[entry])))
    signing = run(
        capsys,
        "sign",
        "--key",
        tmp_path / "artifact.pem",
        "--type",
        "artifact-manifest",
        "--out",
        tmp_path / "manifest.json",
        tmp_path / "manifest-body.json",
    )
    assert signing[0] == 0, signing[2]
    # The state pins the manifest the bundle carries: the host refuses an artifact the state does not name.
    pinned = {"name": "m", "version": "1", "manifest": json.loads((tmp_path / "manifest.json").read_text())}
    state = current_state(5, artifacts=[pinned])
    (tmp_path / "state.json").write_text(json.dumps(state))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "apply.yml").write_text("- hosts: localhost\n  tasks: []\n")
    (tmp_path / "meridian-node-1.0.0.tar.gz").write_bytes(b"collection")
    return tmp_path


def make(capsys: pytest.CaptureFixture[str], site: Path, *extra: str | Path) -> tuple[int, str, str]:
    return run(
        capsys,
        "make-bundle",
        "--node",
        NODE_ID,
        "--key",
        site / "authority.pem",
        "--expires",
        "7d",
        "--artifact",
        f"{site / 'manifest.json'}:{site / 'model'}",
        "--playbooks",
        site / "site",
        "--collection",
        site / "meridian-node-1.0.0.tar.gz",
        "--out",
        site / "b.tar",
        *extra,
    )


def verify(capsys: pytest.CaptureFixture[str], site: Path, path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    status, out, _ = run(
        capsys,
        "verify",
        "--policy",
        site / "policy.yaml",
        "--kind",
        "bundle",
        "--node-id",
        NODE_ID,
        "--state-dir",
        site / "record",
        *extra,
        path,
    )
    assert out.count("\n") == 1, out
    return status, json.loads(out)


def test_made_bundle_verifies_as_one_json_line(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = make(capsys, site, "--desired", site / "state.json", "--control-key", site / "control.pem")
    assert status == 0, err
    assert json.loads(out)["members"] == 4
    status, result = verify(capsys, site, site / "b.tar")
    assert status == 0, result
    assert result["accepted"] is True and result["generation"] == 5 and result["members"] == 4
    assert result["artifacts"] == ["m/1"] and result["recorded"] is False
    assert not (site / "scratch").exists()  # verify keeps nothing
    assert [path.name for path in site.iterdir() if path.name.endswith(".part")] == []


def _pin_state(site: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """What control does before it signs a state whose bundle ships code: add ``runbook-pin``'s output."""
    status, out, err = run(
        capsys, "runbook-pin", "--playbooks", site / "site", "--collection", site / "meridian-node-1.0.0.tar.gz"
    )
    assert status == 0, err
    pin: dict[str, Any] = json.loads(out)["runbook"]
    state = json.loads((site / "state.json").read_text())
    (site / "state.json").write_text(json.dumps({**state, "runbook": pin}))
    return pin


def test_bundle_from_an_envelope_control_signed_elsewhere_verifies_and_records(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _pin_state(site, capsys)
    signing = run(
        capsys,
        "sign",
        "--key",
        site / "control.pem",
        "--type",
        "desired-state",
        "--out",
        site / "state-envelope.json",
        site / "state.json",
    )
    assert signing[0] == 0, signing[2]
    assert make(capsys, site, "--desired", site / "state-envelope.json")[0] == 0
    status, result = verify(capsys, site, site / "b.tar", "--record")
    assert (status, result["recorded"]) == (0, True)
    # The same bundle again is a re-delivery of the applied generation: accepted, nothing to record.
    status, again = verify(capsys, site, site / "b.tar", "--record")
    assert (status, again["already_applied"], again["recorded"]) == (0, True, False)


def test_tampered_bundle_is_refused_with_its_reason(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make(capsys, site, "--desired", site / "state.json", "--control-key", site / "control.pem")[0] == 0
    data = bytearray((site / "b.tar").read_bytes())
    offset = data.index(b"weights" * 10)
    data[offset] ^= 0x01
    (site / "bad.tar").write_bytes(bytes(data))
    status, result = verify(capsys, site, site / "bad.tar")
    assert status == 1
    assert result["reason"] == "digest-mismatch"
    assert result["member"] == "artifacts/m/1/files/weights.bin"


def test_state_signed_only_by_the_authority_is_refused(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make(capsys, site, "--desired", site / "state.json", "--control-key", site / "authority.pem")[0] == 0
    status, result = verify(capsys, site, site / "b.tar")
    assert (status, result["reason"]) == (1, "threshold-not-met")
    assert "the desired state inside" in result["message"]


def test_files_that_do_not_match_their_manifest_make_no_bundle(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (site / "model" / "weights.bin").write_bytes(b"other weights")
    status, _, err = make(capsys, site, "--desired", site / "state.json", "--control-key", site / "control.pem")
    assert status == 2
    assert "hosts would refuse it" in err and "weights.bin" in err
    assert not (site / "b.tar").exists()
    assert [path.name for path in site.iterdir() if path.name.endswith(".part")] == []


def test_state_for_another_node_makes_no_bundle(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(
        capsys,
        "make-bundle",
        "--node",
        "gpu-node-9",
        "--key",
        site / "authority.pem",
        "--expires",
        "1d",
        "--desired",
        site / "state.json",
        "--control-key",
        site / "control.pem",
        "--out",
        site / "b.tar",
    )
    assert status == 2
    assert f"a state for node {NODE_ID!r}, not for --node 'gpu-node-9'" in err
    assert not (site / "b.tar").exists()


def test_make_bundle_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["make-bundle", "--help"])
    assert exited.value.code == 0
    assert "usage: meridian-node make-bundle" in capsys.readouterr().out


def test_playbook_directory_holding_a_symlink_makes_no_bundle(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (site / "site" / "secrets.yml").symlink_to("/etc/shadow")
    status, _, err = make(capsys, site, "--desired", site / "state.json", "--control-key", site / "control.pem")
    assert status == 2
    assert "secrets.yml is a symbolic link or special file" in err
    assert not (site / "b.tar").exists()


def test_state_in_yaml_is_signed_with_the_control_key(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = json.loads((site / "state.json").read_text())
    (site / "state.yaml").write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in state.items()))
    assert make(capsys, site, "--desired", site / "state.yaml", "--control-key", site / "control.pem")[0] == 0
    status, result = verify(capsys, site, site / "b.tar")
    assert (status, result["generation"]) == (0, 5)


def test_an_artifact_the_state_does_not_pin_makes_no_bundle(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = json.loads((site / "state.json").read_text())
    (site / "unpinned.json").write_text(json.dumps({**state, "artifacts": []}))

    status, _, err = make(capsys, site, "--desired", site / "unpinned.json", "--control-key", site / "control.pem")

    assert status == 2
    assert "the desired state names no artifact m 1" in err
    assert not (site / "b.tar").exists()


def _sign_state(site: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    out = site / "state-envelope.json"
    signing = run(
        capsys, "sign", "--key", site / "control.pem", "--type", "desired-state", "--out", out, site / "state.json"
    )
    assert signing[0] == 0, signing[2]
    return out


def test_make_bundle_refuses_shipped_code_the_signed_state_does_not_pin(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = make(capsys, site, "--desired", _sign_state(site, capsys))
    assert (status, out) == (2, "")
    assert "does not pin the code that --playbooks and --collection ship" in err
    assert "runbook-pin" in err and not (site / "b.tar").exists()


def test_make_bundle_refuses_playbooks_other_than_the_pinned_ones(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pin = _pin_state(site, capsys)
    envelope = _sign_state(site, capsys)
    (site / "site" / "apply.yml").write_text("- hosts: localhost\n  tasks: [] \n")  # one byte more
    status, _, err = make(capsys, site, "--desired", envelope)
    assert status == 2 and "are not the code --desired pins" in err and pin["playbooks_sha256"] in err
    assert not (site / "b.tar").exists()


def test_make_bundle_refuses_a_pin_whose_code_is_not_given(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _pin_state(site, capsys)
    envelope = _sign_state(site, capsys)
    status, _, err = run(
        capsys,
        "make-bundle",
        *("--node", NODE_ID, "--key", site / "authority.pem", "--expires", "7d", "--out", site / "b.tar"),
        *("--artifact", f"{site / 'manifest.json'}:{site / 'model'}", "--desired", envelope),
    )
    assert status == 2 and "pins shipped code" in err and not (site / "b.tar").exists()


def test_runbook_pin_is_what_coreutils_compute(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The documented sha256sum pipeline and the host's digest agree (docs/AIR_GAP.md, "Shipped code")."""
    (site / "site" / "roles" / "x" / "tasks").mkdir(parents=True)
    (site / "site" / "roles" / "x" / "tasks" / "main.yml").write_text("- ansible.builtin.debug: {msg: hi}\n")
    (site / "site" / "Zeta.yml").write_text("[]\n")
    (site / "site" / "caf\u00e9.yml").write_text("[]\n")
    pin = _pin_state(site, capsys)
    pipeline = "(cd site && find . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum) | sha256sum"
    shell = subprocess.run(["bash", "-c", pipeline], cwd=site, capture_output=True, text=True, check=True)
    assert pin["playbooks_sha256"] == shell.stdout.split()[0]
    tarball = hashlib.sha256((site / "meridian-node-1.0.0.tar.gz").read_bytes()).hexdigest()
    assert pin == {"format": 1, "playbooks_sha256": shell.stdout.split()[0], "collection_sha256": tarball}

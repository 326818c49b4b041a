"""The outbox and ``import-outbox``: signed records that survive being copied in any order, twice, or in part.

The importer is the real devserver command (its own process) on a real data dir; the records are written by
the agent's ``Outbox`` with a real node key and a real observation (``Observer``, no engines, no NVML here).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ansible_collections.meridian.node.tests.devserver.devserver_process import cli as devserver
from ansible_collections.meridian.node.tests.support.airgap_env import make_airgap_node
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.boundary.outbox import (
    MAX_RECORD_BYTES,
    JournalSummary,
    Outbox,
    OutboxRefused,
    keyid_of,
    verify_outbox_record,
)
from meridian_node_agent.cli import main as cli_main

NODE = "outbox-node"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _outbox(root: Path, key: ec.EllipticCurvePrivateKey | None = None) -> Outbox:
    return Outbox(root / "outbox", root / "state", NODE, key or ec.generate_private_key(ec.SECP256R1()))


def _observe(outbox: Outbox, epoch: int, generation: int = 1) -> Path:
    observation = Observer(store_path=None).observe(
        node_id=NODE, mode="air-gapped", epoch=epoch, applied_generation=generation, last_run=None, now=NOW
    )
    return outbox.write("observation", observation, epoch=epoch, now=NOW)


def _journal(outbox: Outbox, epoch: int) -> Path:
    summary = JournalSummary(
        ident="gen-1-20261201T120000.000000Z",
        generation=1,
        bundle_id="g1",
        status="successful",
        changed=2,
        failed=0,
        started_at=NOW,
        finished_at=NOW,
    )
    return outbox.write("journal", summary, epoch=epoch, now=NOW)


def _public_pem(outbox: Outbox, directory: Path) -> Path:
    path = directory / f"{NODE}.pub.pem"
    path.write_bytes(
        outbox.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


def _import(data_dir: Path, directory: Path, key: Path, *, check: bool = True) -> tuple[int, list[dict[str, Any]]]:
    run = devserver(data_dir, "import-outbox", str(directory), "--node-key", f"{NODE}={key}", check=check)
    return run.returncode, [json.loads(line) for line in run.stdout.splitlines()]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A devserver that knows the node at epoch 1 (publishing creates it)."""
    data = tmp_path / "devserver"
    document = tmp_path / "desired.yaml"
    document.write_text("apiVersion: meridian.node/v1\nkind: DesiredState\nartifacts: []\nengines: []\n")
    devserver(data, "publish", NODE, str(document))
    return data


def test_records_are_named_by_node_sequence_and_kind_and_the_counter_survives_a_restart(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    first = _observe(_outbox(tmp_path, key), 1)
    second = _journal(_outbox(tmp_path, key), 1)  # a new process: the counter is on disk

    assert [first.name, second.name] == [f"{NODE}-000000000001-observation.json", f"{NODE}-000000000002-journal.json"]
    keys = {NODE: key.public_key()}
    assert verify_outbox_record(first.name, first.read_bytes(), keys).observation is not None
    journal = verify_outbox_record(second.name, second.read_bytes(), keys).journal
    assert journal is not None and journal.changed == 2
    assert sorted(p.name for p in (tmp_path / "outbox").iterdir()) == [first.name, second.name]  # no temp files


def _tampered(path: Path) -> bytes:
    document = json.loads(path.read_bytes())
    body = json.loads(base64.b64decode(document["payload"]))
    body["observation"]["applied_generation"] = 99
    document["payload"] = base64.b64encode(json.dumps(body).encode()).decode()
    return json.dumps(document).encode()


def _with_unknown_field(path: Path, key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import hashes

    from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
    from meridian_node_agent.boundary.outbox import OUTBOX_PAYLOAD_TYPE

    body = json.loads(base64.b64decode(json.loads(path.read_bytes())["payload"]))
    data = json.dumps({**body, "note": "extra"}).encode()
    sig = key.sign(dsse.pae(OUTBOX_PAYLOAD_TYPE, data), ec.ECDSA(hashes.SHA256()))
    return json.dumps(
        {
            "payloadType": OUTBOX_PAYLOAD_TYPE,
            "payload": base64.b64encode(data).decode(),
            "signatures": [{"keyid": keyid_of(key.public_key()), "sig": base64.b64encode(sig).decode()}],
        }
    ).encode()


def test_altered_renamed_foreign_or_loose_records_are_refused_with_the_reason(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    path = _observe(_outbox(tmp_path, key), 1)
    keys = {NODE: key.public_key()}
    data = path.read_bytes()
    stranger = {NODE: ec.generate_private_key(ec.SECP256R1()).public_key()}
    cases = [
        ("altered body", path.name, _tampered(path), keys, "bad-signature"),
        ("renamed to another sequence", f"{NODE}-000000000007-observation.json", data, keys, "name-mismatch"),
        ("renamed to another kind", f"{NODE}-000000000001-journal.json", data, keys, "name-mismatch"),
        ("signed by a key not the node's", path.name, data, stranger, "bad-signature"),
        ("no key for the node", path.name, data, {}, "unknown-node-key"),
        ("unknown field, signed", path.name, _with_unknown_field(path, key), keys, "schema"),
        ("not a record name", "observation.json", data, keys, "bad-name"),
        ("not JSON", path.name, b"\x00garbage", keys, "malformed"),
    ]
    for what, name, data, trusted, reason in cases:
        with pytest.raises(OutboxRefused) as refused:
            verify_outbox_record(name, data, trusted)
        assert refused.value.reason == reason, what


def test_import_outbox_copied_in_part_out_of_order_then_twice_loses_and_duplicates_nothing(
    tmp_path: Path, data_dir: Path
) -> None:
    outbox = _outbox(tmp_path)
    older, journal, newer = _observe(outbox, 1, generation=1), _journal(outbox, 1), _observe(outbox, 1, generation=2)
    key = _public_pem(outbox, tmp_path)
    partial = tmp_path / "first-trip"
    partial.mkdir()
    for path in (newer, journal):
        shutil.copy(path, partial / path.name)
    (partial / f".{older.name}.part").write_bytes(older.read_bytes()[:100])  # a copy cut short

    status, first = _import(data_dir, partial, key)
    status_again, second = _import(data_dir, tmp_path / "outbox", key)

    assert status == status_again == 0
    assert {r["sequence"]: r["result"] for r in first} == {2: "imported", 3: "imported"}
    assert {r["sequence"]: r["result"] for r in second} == {1: "superseded", 2: "duplicate", 3: "duplicate"}
    # The node's latest observation is the newest record's, whatever order the files came in.
    from meridian_node_agent.devserver.control.plane import open_control_plane

    control = open_control_plane(data_dir)
    try:
        [record] = [r for r in control.store.serving_observations() if r.node_id == NODE]
    finally:
        control.close()
    assert json.loads(record.body)["applied_generation"] == 2  # the older one did not replace it


def test_import_outbox_refuses_a_record_of_a_fenced_epoch_and_a_reused_sequence(tmp_path: Path, data_dir: Path) -> None:
    outbox = _outbox(tmp_path)
    _observe(outbox, 1)  # sequence 1, under epoch 1
    key = _public_pem(outbox, tmp_path)
    devserver(data_dir, "fence", NODE)  # a control-plane failover: epoch 2

    status, [result] = _import(data_dir, tmp_path / "outbox", key, check=False)

    assert status == 1
    assert (result["result"], result["reason"]) == ("refused", "stale-epoch")
    assert "epoch 1" in result["message"]

    # A refusal is not recorded, so sequence 1 is still free for the node's next record under epoch 2.
    fresh = _observe(_outbox(tmp_path / "after-fence", outbox.key), 2)
    status, [result] = _import(data_dir, fresh.parent, key)
    assert (status, result["sequence"], result["result"]) == (0, 1, "imported")

    # A node whose counter started over writes sequence 1 again, with other bytes: refused, not overwritten.
    reset = _journal(_outbox(tmp_path / "counter-reset", outbox.key), 2)
    status, [result] = _import(data_dir, reset.parent, key, check=False)
    assert (status, result["result"], result["reason"]) == (1, "refused", "sequence-reused")


def test_import_outbox_says_an_epoch_0_observation_predates_the_first_bundle(tmp_path: Path, data_dir: Path) -> None:
    # What a fresh air-gapped node writes before any bundle: it knows no lease epoch yet.
    outbox = _outbox(tmp_path)
    _observe(outbox, 0, generation=0)
    key = _public_pem(outbox, tmp_path)

    status, [result] = _import(data_dir, tmp_path / "outbox", key, check=False)

    assert status == 1
    assert (result["result"], result["reason"]) == ("refused", "stale-epoch")
    assert "lease epoch 0, before the node applied any bundle" in result["message"]
    assert "heartbeat" not in result["message"]


def test_import_outbox_refuses_what_is_not_a_readable_record_before_verifying_it(
    tmp_path: Path, data_dir: Path
) -> None:
    # What a careless copy or a hostile USB stick leaves: an oversized record (and one not even named like a
    # record), a FIFO that would hang a plain read, a symlink to a file of the importer's host.
    outbox = _outbox(tmp_path)
    key = _public_pem(outbox, tmp_path)
    carried = tmp_path / "carried"
    carried.mkdir()
    for name in (f"{NODE}-000000000009-observation.json", "huge.json"):
        with (carried / name).open("wb") as handle:
            handle.truncate(MAX_RECORD_BYTES + 1)
    os.mkfifo(carried / f"{NODE}-000000000010-journal.json")
    (carried / f"{NODE}-000000000011-journal.json").symlink_to(key)

    status, results = _import(data_dir, carried, key, check=False)

    assert status == 1
    assert {r["file"]: (r["result"], r["reason"]) for r in results} == {
        f"{NODE}-000000000009-observation.json": ("refused", "too-large"),
        "huge.json": ("refused", "bad-name"),  # the name is checked first, as for any record
        f"{NODE}-000000000010-journal.json": ("refused", "not-a-file"),
        f"{NODE}-000000000011-journal.json": ("refused", "unreadable"),
    }
    messages = {r["file"]: r["message"] for r in results}
    assert f"larger than {MAX_RECORD_BYTES} bytes" in messages[f"{NODE}-000000000009-observation.json"]
    assert "it is a FIFO, not a regular file" in messages[f"{NODE}-000000000010-journal.json"]
    assert "it is a symlink" in messages[f"{NODE}-000000000011-journal.json"]


def test_outbox_key_prints_the_node_key_creating_it_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = make_airgap_node(tmp_path)

    assert cli_main(["--config", str(node.config_path), "outbox-key"]) == 0
    first = capsys.readouterr().out
    assert cli_main(["--config", str(node.config_path), "outbox-key"]) == 0

    assert capsys.readouterr().out == first
    private = serialization.load_pem_private_key((node.state_dir / "identity" / "node.key.pem").read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert serialization.load_pem_public_key(first.encode()) == private.public_key()


def test_an_observation_with_nullable_fields_survives_the_round_trip(tmp_path: Path) -> None:
    # Found on a shared Docker Engine: a container in state Created has no published port, and 'port' is a
    # required field that may be null; dropping nulls made the record fail the importer's strict parse.
    key = ec.generate_private_key(ec.SECP256R1())
    observation = Observer(store_path=None).observe(
        node_id=NODE, mode="air-gapped", epoch=1, applied_generation=1, last_run=None, now=NOW
    )
    unready = {"name": "created-only", "managed": False, "driver": None, "image": None, "state": "created"}
    engine = {**unready, "ready": False, "draining": False, "port": None}
    with_engine = observation.model_validate({**observation.model_dump(mode="json"), "engines": [engine]})
    path = _outbox(tmp_path, key).write("observation", with_engine, epoch=1, now=NOW)

    record = verify_outbox_record(path.name, path.read_bytes(), {NODE: key.public_key()})

    assert record.observation == with_engine

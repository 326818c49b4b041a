"""engines.json, the root apply unit's list of this node's engines, and the agent's source that reads it.

The root side is exercised here only where it needs no Docker Engine (tests/agent/root_side/test_split_observations.py
runs it with one).

The readiness probes go to a real stand-in engine process on 127.0.0.1 (tests/support/standin_server.py):
no Docker is involved, which is the point of the inventory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import mark_draining
from ansible_collections.meridian.node.tests.support.engine_harness import BIND, SERVER, free_port
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from ansible_collections.meridian.node.tests.support.recorded_events import SeenEvents
from meridian_node_agent.agent_side.observe import InventoryEngines, Observer
from meridian_node_agent.agent_side.supervise import Drift, Supervisor
from meridian_node_agent.agent_side.systemd_applier import write_request
from meridian_node_agent.boundary.engines_file import (
    INVENTORY_FILE,
    MAX_DRIFTED,
    MAX_ENGINES,
    MAX_INVENTORY_BYTES,
    Inventory,
    InventoryEngine,
    InventoryError,
    read_inventory,
    write_inventory,
)
from meridian_node_agent.boundary.spool import PUBLIC_DIR, SPOOL_DIR, read_answer_file
from meridian_node_agent.config import AgentConfig, load_config
from meridian_node_agent.root_side.apply_unit import answer_requests
from meridian_node_agent.root_side.root_dir import RootDir, prepare_root_dir

NODE = "gpu-node-7"


def _engine(name: str = "chat", port: int | None = 8123, **overrides: Any) -> InventoryEngine:
    fields: dict[str, Any] = {
        "name": name,
        "driver": "vllm",
        "served_model_name": "tiny-chat",
        "image": "meridian-node/standin@sha256:" + "a" * 64,
        "host": BIND if port is not None else None,
        "port": port,
        "probe_driver": "vllm",
        "health_path": "/health",
        "gpus": ["0"],
        "min_vram_mib": 1000,
        "state": "running",
        **overrides,
    }
    return InventoryEngine(**{**fields, "gpus": tuple(fields["gpus"])})


def _write(state_dir: Path, *engines: InventoryEngine, node_id: str = NODE) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    return write_inventory(state_dir, Inventory(node_id=node_id, written_at="2026-11-30T00:00:00Z", engines=engines))


def _document(state_dir: Path) -> dict[str, Any]:
    path = _write(state_dir, _engine())
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def test_inventory_round_trips_and_is_written_world_readable(tmp_path: Path) -> None:
    path = _write(tmp_path, _engine(), _engine("embed", port=None, state="exited"))

    assert path == tmp_path / INVENTORY_FILE
    assert path.stat().st_mode & 0o777 == 0o644  # root writes it, the unprivileged agent must read it
    inventory = read_inventory(path, node_id=NODE)
    assert [e.as_dict() for e in inventory.engines] == [
        _engine().as_dict(),
        _engine("embed", None, state="exited").as_dict(),
    ]
    assert [p.name for p in tmp_path.iterdir()] == [INVENTORY_FILE]  # no temporary file left


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d.update(format=2), "format must be 1 (got 2)"),
        (lambda d: d.update(extra=1), "unknown fields ['extra']"),
        (lambda d: d.update(node_id=7), "node_id must be a string"),
        (lambda d: d.update(written_at=None), "written_at must be a string"),
        (lambda d: d.update(engines={"chat": {}}), "engines must be a list"),
        (lambda d: d["engines"].append("chat"), "engines[1]: must be an object"),
        (lambda d: d["engines"][0].update(port="8123"), "engines[0]: port must be 1-65535 or null ('8123')"),
        (lambda d: d["engines"][0].update(port=True), "port must be 1-65535 or null (True)"),
        (lambda d: d["engines"][0].update(port=70000), "port must be 1-65535 or null (70000)"),
        (lambda d: d["engines"][0].update(host=None), "a port needs a host"),
        (lambda d: d["engines"][0].update(name=""), "name must be a non-empty string"),
        (lambda d: d["engines"][0].update(driver=["vllm"]), "driver must be a string or null"),
        (lambda d: d["engines"][0].update(gpus="0"), "gpus must be a list of strings"),
        (lambda d: d["engines"][0].update(min_vram_mib=-1), "min_vram_mib must be an integer >= 0 (-1)"),
        (lambda d: d["engines"][0].update(health_path="health"), "health_path must start with '/'"),
        (lambda d: d["engines"][0].pop("state"), "must have exactly the fields"),
        (lambda d: d["engines"].append(dict(d["engines"][0])), "an engine is listed twice on one port"),
        (
            lambda d: d["engines"].extend({**d["engines"][0], "port": 9000 + i} for i in range(2)),
            "is listed more than twice",
        ),
        (lambda d: d.update(engines=[d["engines"][0]] * (MAX_ENGINES + 1)), f"more than {MAX_ENGINES} engines"),
        # drifted: root's reading of the settings changed by hand, which makes the agent replace an engine.
        (lambda d: d["engines"][0].update(drifted="cpus"), "drifted must be a list of setting names or null"),
        (lambda d: d["engines"][0].update(drifted={"cpus": 1}), "drifted must be a list of setting names or null"),
        (lambda d: d["engines"][0].update(drifted=[1]), "drifted: 1 is not a setting name"),
        (lambda d: d["engines"][0].update(drifted=[None]), "drifted: None is not a setting name"),
        (lambda d: d["engines"][0].update(drifted=[""]), "drifted: '' is not a setting name"),
        (lambda d: d["engines"][0].update(drifted=["Restart Policy"]), "drifted: 'Restart Policy' is not a setting"),
        (lambda d: d["engines"][0].update(drifted=["cpus\n"]), "is not a setting name"),
        (lambda d: d["engines"][0].update(drifted=["cpus; rm -rf /"]), "is not a setting name"),
        (lambda d: d["engines"][0].update(drifted=["x" * 41]), "is not a setting name"),
        (lambda d: d["engines"][0].update(drifted=["cpus", "cpus"]), "drifted names a setting twice"),
        (
            lambda d: d["engines"][0].update(drifted=[f"s{i}" for i in range(MAX_DRIFTED + 1)]),
            f"more than {MAX_DRIFTED} settings",
        ),
    ],
)
def test_malformed_inventory_is_refused_with_the_field_named(tmp_path: Path, change: Any, reason: str) -> None:
    document = _document(tmp_path)
    change(document)
    path = tmp_path / INVENTORY_FILE
    path.write_text(json.dumps(document))

    with pytest.raises(InventoryError) as caught:
        read_inventory(path, node_id=NODE)

    assert str(path) in str(caught.value) and reason in str(caught.value)


def test_drifted_round_trips_and_a_file_from_an_older_root_unit_without_it_reads_as_unknown(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _engine("chat", drifted=("restart_policy", "cpus")),
        _engine("embed", port=None, drifted=()),
        _engine("old", port=None),
    )
    assert [e.drifted for e in read_inventory(path, node_id=NODE).engines] == [("restart_policy", "cpus"), (), None]

    document = json.loads(path.read_text())
    for entry in document["engines"]:
        del entry["drifted"]
    path.write_text(json.dumps(document))
    assert [e.drifted for e in read_inventory(path, node_id=NODE).engines] == [None, None, None]


def test_a_hand_change_root_saw_reaches_the_agents_supervisor_as_drift(tmp_path: Path, standin: int) -> None:
    # Under the split this is the whole path from root's engines.json to the repair decision: the engine
    # still answers its probe (ready), and only root's reading says it was changed by hand.
    _write(tmp_path / PUBLIC_DIR, _engine("chat", port=standin, drifted=("restart_policy", "cpus")))
    observer = Observer(
        store_path=None,
        gpu_facts=lambda: {"nvml_available": False},
        engines=InventoryEngines(root_dir=tmp_path, node_id=NODE, refresh_s=0),
    )
    clock = [0.0]
    supervisor = Supervisor(settle_s=10, clock=lambda: clock[0])
    supervisor.expect(3, ["chat"])

    def assess() -> Drift | None:
        observation = observer.observe(
            node_id=NODE, mode="managed-host", epoch=1, applied_generation=3, last_run=None, now=datetime.now(UTC)
        )
        assert [(e.name, e.ready) for e in observation.engines] == [("chat", True)]
        # What the cycle hands supervision: the observation's engines with the observer's drifted beside them.
        return supervisor.assess(
            [{**e.model_dump(), "drifted": list(observer.drifted.get(e.name, ()))} for e in observation.engines]
        )

    assert assess() is None  # settling: a replace in progress is not a hand change
    clock[0] += 10
    drift = assess()
    assert drift is not None and drift.engines == (("chat", "changed by hand: restart_policy, cpus"),)

    # Root's next look shows it repaired: no drift, nothing due.
    _write(tmp_path / PUBLIC_DIR, _engine("chat", port=standin, drifted=()))
    clock[0] += 600
    assert assess() is None


def test_inventory_written_for_another_node_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, _engine(), node_id="gpu-node-8")

    with pytest.raises(InventoryError, match="written for node 'gpu-node-8', not this node 'gpu-node-7'"):
        read_inventory(path, node_id=NODE)


def test_oversized_not_json_missing_and_symlinked_inventories_are_refused(tmp_path: Path) -> None:
    path = tmp_path / INVENTORY_FILE
    with pytest.raises(InventoryError, match=r"does not exist yet.*apply-spooled"):
        read_inventory(path, node_id=NODE)
    path.write_bytes(b" " * (MAX_INVENTORY_BYTES + 1))
    with pytest.raises(InventoryError, match=f"larger than {MAX_INVENTORY_BYTES} bytes"):
        read_inventory(path, node_id=NODE)
    path.write_bytes(b'{"format": 1,')
    with pytest.raises(InventoryError, match="is not JSON"):
        read_inventory(path, node_id=NODE)
    path.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(_document(tmp_path / "other")))
    path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(InventoryError, match="cannot read"):
        read_inventory(path, node_id=NODE)
    path.unlink()
    os.mkfifo(path)  # would block a plain open-and-read forever
    with pytest.raises(InventoryError, match="not a regular file"):
        read_inventory(path, node_id=NODE)


def test_source_reports_no_engines_and_logs_once_for_a_missing_or_broken_inventory(tmp_path: Path) -> None:
    events = SeenEvents()
    source = InventoryEngines(root_dir=tmp_path, node_id=NODE, refresh_s=0, log=events)

    assert source() == [] and source() == []
    (tmp_path / PUBLIC_DIR).mkdir()
    (tmp_path / PUBLIC_DIR / INVENTORY_FILE).write_text("[]")
    assert source() == [] and source() == []

    assert [(event, "does not exist yet" in f["reason"]) for event, f in events.seen] == [
        ("engines-not-observed", True),
        ("engines-not-observed", False),
    ]
    assert "the document must be an object" in events.seen[1][1]["reason"]


def test_root_rewriting_the_same_engines_every_interval_is_read_quietly(tmp_path: Path) -> None:
    # Root's observe timer replaces the file every 30 s: the agent re-reads it (a new inode) and logs only a change.
    events = SeenEvents()
    source = InventoryEngines(root_dir=tmp_path, node_id=NODE, refresh_s=0, log=events)
    for engine in (_engine(), _engine(), _engine(drifted=("cpus",)), _engine(drifted=("cpus",))):
        _write(tmp_path / PUBLIC_DIR, engine)
        source()

    assert [event for event, _ in events.seen] == ["engine-inventory-read", "engine-inventory-read"]
    assert source()[0]["drifted"] == ["cpus"]


@pytest.fixture
def standin() -> Iterator[int]:
    """A stand-in vLLM engine process on 127.0.0.1, ready when yielded; its port."""
    port = free_port()
    env = {**os.environ, "STANDIN_ENGINE": "vllm", "STANDIN_PORT": str(port), "STANDIN_HOST": BIND}
    process = subprocess.Popen([sys.executable, str(SERVER)], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # a liveness bound, not a timing assertion
        while True:
            try:
                with urllib.request.urlopen(f"http://{BIND}:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_source_probes_each_engine_reads_draining_marks_and_rereads_only_a_changed_file(
    tmp_path: Path, standin: int
) -> None:
    path = _write(tmp_path / PUBLIC_DIR, _engine("chat", port=standin), _engine("idle", port=free_port()))
    clock = [100.0]
    source = InventoryEngines(root_dir=tmp_path, node_id=NODE, refresh_s=5.0, monotonic=lambda: clock[0])

    first = {e["name"]: e for e in source()}

    assert first["chat"] == {
        "name": "chat",
        "managed": True,
        "driver": "vllm",
        "image": "meridian-node/standin@sha256:" + "a" * 64,
        "state": "running",
        "ready": True,
        "draining": False,
        "port": standin,
        "served_model_name": "tiny-chat",
        "restarts": None,
        "exit_code": None,
        "exit_reason": None,
        "drifted": None,
    }
    assert (first["idle"]["ready"], first["idle"]["state"]) == (False, "running")  # nothing answers there

    mark_draining(str(tmp_path), "chat", reason="test")
    assert source()[0]["draining"] is False  # within refresh_s: the cached list
    clock[0] += 5
    assert source()[0]["draining"] is True

    # Same identity, different bytes: not re-read (the file is only ever replaced, never edited in place).
    stat = path.stat()
    path.write_text(path.read_text().replace('"tiny-chat"', '"tiny-chaz"'))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    source.forget()
    assert source()[0]["served_model_name"] == "tiny-chat"
    # A rewrite (new inode) is re-read: the engine root no longer lists is gone.
    _write(tmp_path / PUBLIC_DIR, _engine("idle", port=None, state="exited"))
    source.forget()
    assert source() == [
        {
            "name": "idle",
            "managed": True,
            "driver": "vllm",
            "image": "meridian-node/standin@sha256:" + "a" * 64,
            "state": "exited",
            "ready": False,
            "draining": False,
            "port": None,
            "served_model_name": "tiny-chat",
            "restarts": None,
            "exit_code": None,
            "exit_reason": None,
            "drifted": None,
        }
    ]


def test_unreadable_draining_marks_make_no_engine_ready(tmp_path: Path, standin: int) -> None:
    _write(tmp_path / PUBLIC_DIR, _engine("chat", port=standin))
    (tmp_path / "draining").mkdir()
    (tmp_path / "draining" / "chat.json").write_text("not json")
    events = SeenEvents()
    source = InventoryEngines(root_dir=tmp_path, node_id=NODE, refresh_s=0, log=events)

    assert [(e["name"], e["ready"]) for e in source()] == [("chat", False)]
    assert ("draining-marks-unreadable" in [event for event, _ in events.seen]) is True


def _root_config(root: Path, *, images: list[str]) -> AgentConfig:
    extra = {"images": {"allowed_repositories": images, "require_digest": True}} if images else {}
    # observe-only: root refuses every request, the quickest 'failed' apply there is
    return load_config(write_node_config(root, node_id=NODE, mode="observe-only", policy_extra=extra))


def _root(config: AgentConfig) -> RootDir:
    return prepare_root_dir(Path(config.apply.state_dir), agent_dir=Path(config.state_dir))


def test_root_side_writes_the_inventory_after_a_refused_request_without_docker_when_no_image_is_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
    config = _root_config(tmp_path, images=[])
    spool = Path(config.state_dir) / SPOOL_DIR
    write_request(spool, "gen-1-20261129T120000.000000Z", b"{}")

    root = _root(config)
    answers = answer_requests(config, root)

    assert [a.status for a in answers] == ["failed"]
    inventory = read_inventory(root.public / INVENTORY_FILE, node_id=NODE)
    assert inventory.engines == ()


def test_root_side_that_cannot_reach_docker_keeps_the_previous_inventory_and_still_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
    config = _root_config(tmp_path, images=["meridian-node/standin"])
    root = _root(config)
    previous = _write(root.public, _engine()).read_bytes()
    write_request(Path(config.state_dir) / SPOOL_DIR, "gen-1-20261129T120000.000000Z", b"{}")

    answers = answer_requests(config, root)

    assert [a.status for a in answers] == ["failed"]
    assert read_answer_file(root.public) == answers[0]
    assert (root.public / INVENTORY_FILE).read_bytes() == previous
    warning = capsys.readouterr().err
    assert f"could not write {root.public / INVENTORY_FILE}" in warning
    assert "Docker Engine" in warning and "keeps observing the previous one" in warning


def test_a_split_agents_capacity_counts_what_the_engines_root_listed_reserve_and_publish(tmp_path: Path) -> None:
    # Under the split the agent has no Docker: the reservations and ports come from root's engines.json.
    port = free_port()
    _write(tmp_path / PUBLIC_DIR, _engine("chat", port=port, gpus=("GPU-a",), min_vram_mib=3000))
    source = InventoryEngines(root_dir=tmp_path, node_id=NODE, refresh_s=0)
    gpus = {
        "nvml_available": True,
        "gpus": [
            {"index": 0, "uuid": "GPU-a", "memory": {"total_mib": 8000, "free_mib": 7000}},
            {"index": 1, "uuid": "GPU-b", "memory": {"total_mib": 8000, "free_mib": 8000}},
        ],
    }

    room = source.capacity(gpus, (port, port + 3), BIND)

    assert room["vram_free_mib"] == {"GPU-a": 5000, "GPU-b": 8000}  # min(free, total - reserved)
    assert port not in room["free_ports"] and set(room["free_ports"]) <= {port + 1, port + 2, port + 3}
    assert source.capacity({"nvml_available": False}, (port, port), BIND) == {"vram_free_mib": {}, "free_ports": []}

"""GPU health and cordons in the running agent, against the real devserver on 127.0.0.1 and the fake pynvml.

The agent is built as ``meridian-node run`` builds it (``build_agent``), with the observer's GPU reader on the fake
pynvml, the engines it observes and the applies' results scripted (the applier stands in for ansible-runner: what
is under test is what the agent observes, reports and repairs, not the apply). A GPU goes bad while the agent
cycles: the engine on it is reported and never repaired, the observation the control plane keeps shows the GPU
unhealthy with its reason, and the verdict holds after the XID has left the window.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import (
    CORDON_FILE,
    HostCordon,
    write_cordon,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_hold import HealthHolds
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import E2E_REPOSITORY, engine_spec, make_e2e_node
from ansible_collections.meridian.node.tests.support.e2e_env import last_observation as kept_observation
from ansible_collections.meridian.node.tests.support.instant_apply import instant_success
from ansible_collections.meridian.node.tests.support.node_env import Node, publish
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.wall_clock import MonotonicClock
from meridian_node_agent.agent_side.cycle import Agent, CycleStatus
from meridian_node_agent.agent_side.gpu_health import GpuHealthWatch
from meridian_node_agent.agent_side.observe import Observer
from meridian_node_agent.apply.applier import ApplyResult
from meridian_node_agent.cli import main as cli_main

IMAGE = LocalImage(tag=f"{E2E_REPOSITORY}:gpu-health", id="sha256:" + "6a" * 32)
SUPERVISION = {"settle_seconds": 10, "startup_grace_seconds": 60, "backoff_initial_seconds": 10}


class Wall:
    """The GPU reader's wall clock: real time plus what the test moved it by (the XID window is 10 minutes)."""

    def __init__(self) -> None:
        self.offset = timedelta()

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.offset


class Host:
    """The applier: every apply succeeds at once; ``asked`` keeps each apply's reason (None: a new state)."""

    def __init__(self) -> None:
        self.asked: list[str | None] = []

    def apply(self, envelope: bytes, *, generation: int, reason: str | None = None, **_: Any) -> ApplyResult:
        self.asked.append(reason)
        return instant_success(generation)


def _up(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "managed": True,
        "driver": "vllm",
        "image": IMAGE.pinned,
        "state": "running",
        "ready": True,
        "draining": False,
        "port": None,
    }


class Running:
    """An agent as ``run`` builds it, cycling on the test's clocks, with what it logged."""

    def __init__(self, node: Node, fake: ModuleType) -> None:
        self.node = node
        self.host = Host()
        self.monotonic = MonotonicClock(5000.0)
        self.wall = Wall()
        self.log, self.events = recording_logger(f"agent-gpu-health-{node.node_id}")
        policy = load_policy(node.config.policy)
        self.watch = GpuHealthWatch(node.config.record_dir, writes_holds=True, nvml=fake, clock=self.wall, log=self.log)
        observer = Observer(
            store_path=None,
            gpu_facts=self.watch,
            engines=lambda: [dict(engine) for engine in self.engines],
            monotonic=self.monotonic,
            cordon_dir=str(node.config.record_dir),
            policy_cordon=policy.cordon,
            log=self.log,
        )
        self.engines: list[dict[str, Any]] = []
        self.agent: Agent = node.agent(observer=observer, applier=self.host, monotonic=self.monotonic, log=self.log)

    def cycle(self, seconds: float = 30.0) -> CycleStatus:
        """One cycle ``seconds`` after the last: one GPU refresh (gpu_refresh_s is 30 s), status written."""
        self.monotonic.now += seconds
        outcome = self.agent.cycle().outcome
        self.agent.write_status()
        return outcome


def _node(server: DevServer, root: Path, node_id: str, *, policy_cordon: dict[str, Any] | None = None) -> Node:
    node = make_e2e_node(server, root, node_id).node
    node.configure(supervision=SUPERVISION)
    if policy_cordon is not None:
        path = Path(node.config.policy)
        document = yaml.safe_load(path.read_text())
        document["cordon"] = policy_cordon
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    return node


def last_observation(server: DevServer, node_id: str) -> dict[str, Any]:
    """The observation the devserver keeps for the node (its latest)."""
    document = kept_observation(server, node_id)
    assert document is not None, f"the devserver has no observation of {node_id}"
    return document


def _goes_bad_by_xid(fake: ModuleType) -> None:
    assert fake.raise_xid(1, 79) == 1  # into the agent's XID watch, registered at its first GPU read


def _goes_bad_by_ecc(fake: ModuleType) -> None:
    scenario = json.loads((fake.SCENARIO_DIR / "volatile-dbe.json").read_text())
    fake.change_scenario(scenario)  # GPU 1: 2 volatile double-bit errors, XIDs 48 and 63


@pytest.mark.parametrize(
    ("goes_bad", "reason"),
    [(_goes_bad_by_xid, ("xid-critical", 79)), (_goes_bad_by_ecc, ("ecc-volatile-dbe", 2))],
    ids=["xid-79-raised", "scenario-changes-to-volatile-dbe"],
)
def test_an_engine_on_a_gpu_that_goes_bad_mid_run_is_reported_never_repaired(
    server: DevServer,
    tmp_path: Path,
    node_id: str,
    fake: ModuleType,
    capsys: pytest.CaptureFixture[str],
    goes_bad: Callable[[ModuleType], None],
    reason: tuple[str, Any],
) -> None:
    node = _node(server, tmp_path / "node", node_id)
    generation = publish(
        server,
        node_id,
        document={
            "engines": [engine_spec("chat", IMAGE, 9451, gpus=["1"]), engine_spec("embed", IMAGE, 9452, gpus=["0"])]
        },
    )
    running = Running(node, fake)
    running.engines = [_up("chat"), _up("embed")]

    assert running.cycle() == CycleStatus.APPLIED
    assert running.cycle() == CycleStatus.UNCHANGED
    uuid = str(last_observation(server, node_id)["gpu"]["gpus"][1]["uuid"])
    goes_bad(fake)
    outcomes = [running.cycle() for _ in range(3)]
    running.wall.offset = timedelta(minutes=11)  # past the XID window
    outcomes += [running.cycle() for _ in range(2)]

    assert set(outcomes) == {CycleStatus.UNCHANGED}
    assert running.host.asked == [None]  # the first apply and nothing since: no repair was tried
    said = running.events.named("engine-on-unhealthy-gpu")
    # Once per change of what is wrong (the XID variant: one; the ECC one: again when its warning XID 63 expires).
    assert said and {(e["engine"], e["generation"]) for e in said} == {("chat", generation)}
    assert all(uuid in e["problem"] for e in said)
    assert len({e["problem"] for e in said}) == len(said)
    report = running.agent.supervisor.status()
    assert set(report) == {"chat"} and report["chat"]["state"] == "reported" and report["chat"]["repairs"] == 0

    observed = last_observation(server, node_id)["gpu"]["gpus"]
    bad = observed[1]["health"]
    assert (observed[1]["uuid"], bad["verdict"], bad["held"]) == (uuid, "unhealthy", True)
    assert reason in [(r["code"], r["value"]) for r in bad["reasons"]]
    assert observed[0]["health"]["verdict"] == "healthy"
    # NVLink peers are in the agent's observations too, not only in the ad-hoc module's facts.
    assert [peer["peer_pci_bus_id"] for peer in observed[0]["nvlink_peers"]][:6] == ["00000000:05:00.0"] * 5 + [
        "00000000:06:00.0"
    ]
    assert HealthHolds(node.config.record_dir).held(uuid) is not None  # in-process: held where placement reads

    status = json.loads((node.state_dir / "status.json").read_text())
    assert [(g["index"], g["verdict"], g["held"]) for g in status["gpus"]] == [
        (0, "healthy", False),
        (1, "unhealthy", True),
    ]
    assert cli_main(["--config", str(node.config_path), "status"]) == 0
    shown = {line.split("  ", 1)[0]: line for line in capsys.readouterr().out.splitlines()}
    assert f"GPU 1 {uuid}: unhealthy, held since " in shown["gpu health"]
    assert " ".join(str(part) for part in reason) in shown["gpu health"]
    assert f"chat: on unhealthy GPU {uuid}" in shown["supervision"] and "[reported]" in shown["supervision"]


def test_a_stopped_engine_on_an_unhealthy_gpu_is_still_repaired(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType
) -> None:
    node = _node(server, tmp_path / "node", node_id)
    publish(server, node_id, document={"engines": [engine_spec("chat", IMAGE, 9453, gpus=["1"])]})
    running = Running(node, fake)
    running.engines = [_up("chat")]
    running.cycle()
    _goes_bad_by_xid(fake)
    running.cycle()

    running.engines = [{**_up("chat"), "state": "exited", "ready": False}]
    outcomes = [running.cycle(seconds=6) for _ in range(3)]

    assert CycleStatus.REPAIRED in outcomes  # a problem a reconcile can mend is mended, GPU or not
    assert [reason for reason in running.host.asked if reason is not None] == ["drift: chat: not running (exited)"]


def test_observations_list_the_cordons_in_force_and_mark_the_gpus_they_cover(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    node = _node(server, tmp_path / "node", node_id, policy_cordon={"gpus": ["0"], "reason": "kept for tests"})
    running = Running(node, fake)

    running.cycle()
    policy_only = last_observation(server, node_id)
    uuid1 = policy_only["gpu"]["gpus"][1]["uuid"]
    write_cordon(str(node.config.record_dir), HostCordon(gpus=(uuid1,), reason="reseat the card"))
    running.cycle()
    with_file = last_observation(server, node_id)
    publish(server, node_id, document={"engines": [], "cordon": {"drain": True, "reason": "driver upgrade"}})
    running.cycle()
    with_state = last_observation(server, node_id)
    running.agent.write_status()

    assert [g["cordoned"] for g in policy_only["gpu"]["gpus"]] == [True, False]
    assert policy_only["cordons"] == [{"by": "policy", "gpus": ["0"], "drain": False, "reason": "kept for tests"}]
    assert [g["cordoned"] for g in with_file["gpu"]["gpus"]] == [True, True]
    assert [(c["by"], c["gpus"]) for c in with_file["cordons"]] == [("policy", [uuid1]), ("policy", ["0"])]
    assert with_state["cordons"][-1] == {"by": "desired-state", "gpus": [], "drain": True, "reason": "driver upgrade"}
    assert cli_main(["--config", str(node.config_path), "status"]) == 0
    shown = {line.split("  ", 1)[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "the whole node by desired-state, drained (driver upgrade)" in shown["cordons"]
    assert f"GPUs {uuid1} by policy (reseat the card)" in shown["cordons"]
    assert "[cordoned]" in shown["gpu health"]


def test_a_damaged_cordon_file_is_said_once_and_the_other_cordons_still_show(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType
) -> None:
    node = _node(server, tmp_path / "node", node_id, policy_cordon={"gpus": ["1"]})
    (Path(node.config.record_dir) / CORDON_FILE).write_text("{")
    running = Running(node, fake)

    running.cycle()
    running.cycle()

    [said] = running.events.named("cordon-file-unreadable")
    assert CORDON_FILE in said["error"]
    observed = last_observation(server, node_id)
    assert [c["gpus"] for c in observed["cordons"]] == [["1"]]
    assert [g["cordoned"] for g in observed["gpu"]["gpus"]] == [False, True]


def test_run_closes_the_xid_watch_when_the_agent_stops(
    server: DevServer, tmp_path: Path, node_id: str, fake: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as nvml_seam

    monkeypatch.setattr(nvml_seam, "_pynvml", fake)  # build_agent's reader uses the seam's pynvml
    node = _node(server, tmp_path / "node", node_id)
    publish(server, node_id)

    assert cli_main(["--config", str(node.config_path), "run", "--once"]) == 0

    assert fake.calls["nvmlEventSetCreate"] == 1 and fake.calls["nvmlDeviceRegisterEvents"] == 2
    assert fake.open_event_sets() == 0 and fake.init_count() == 0
    status = json.loads((node.state_dir / "status.json").read_text())
    assert [g["verdict"] for g in status["gpus"]] == ["healthy", "healthy"]

"""Mode kubernetes-integrated, whole: the agent built as ``run`` builds it, against the real devserver, a real
gRPC stand-in kubelet and the fake pynvml, with every door to a change counted.

Read-only is proved by counting, not by reading the code: every Docker Engine API request the process makes
(``DockerApi._request``), every NVML function asked for (allowed: the read-only list in
tests/support/counting_seams.py), every applier run (``Applier.apply``, ``SystemdApplier.apply``) and every
ansible-runner run. The node's containers belong to Kubernetes, so the agent does not ask Docker at all here.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.gpu import nvml as nvml_seam
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.counting_seams import (
    DOCKER_READS,
    NVML_CHANGES,
    count_docker_requests,
    counting_nvml,
    outside_reads,
)
from ansible_collections.meridian.node.tests.support.e2e_env import last_observation
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml
from ansible_collections.meridian.node.tests.support.node_env import (
    Node,
    RecordingClient,
    make_kubernetes_node,
    publish,
)
from ansible_collections.meridian.node.tests.support.path_unit import apply_spooled, write_split_config
from ansible_collections.meridian.node.tests.support.podresources_server import (
    KubeletStandIn,
    StandInContainer,
    serving,
)
from ansible_collections.meridian.node.tests.support.recorded_events import recording_logger
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    make_key,
    signed,
    write_policy,
)
from meridian_node_agent.agent_side.apply_retry import ApplyRetry
from meridian_node_agent.agent_side.cycle import SPOOL_FILE, CycleStatus
from meridian_node_agent.agent_side.systemd_applier import SystemdApplier, write_request
from meridian_node_agent.apply.applier import Applier
from meridian_node_agent.boundary.spool import PUBLIC_DIR, REQUEST_FILE, SPOOL_DIR, read_answer_file
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.config import ConfigError, load_config

MODE = "kubernetes-integrated"


class _Counted:
    """What a run asked of the host: Docker requests, NVML names, applier and ansible-runner runs."""

    def __init__(self, docker: Counter[tuple[str, str]], nvml: Counter[str], fake: ModuleType) -> None:
        self.docker = docker
        self.nvml = nvml
        self.fake = fake
        self.applies: Counter[str] = Counter()

    def assert_nothing_changed(self) -> None:
        assert [request for request in self.docker if request[0] not in DOCKER_READS] == []
        assert self.docker == Counter()  # and not even a read: Docker is not this node's container runtime
        assert outside_reads(self.nvml) == [], self.nvml
        assert [name for name in self.nvml if name.startswith(NVML_CHANGES)] == []
        assert self.applies == Counter()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counted]:
    fake = load_fake_pynvml()
    fake.use_scenario("h100-mig")
    module, asked = counting_nvml(fake)
    monkeypatch.setattr(nvml_seam, "_pynvml", module)  # where the agent's NVML seam finds pynvml
    seen = _Counted(count_docker_requests(monkeypatch), asked, fake)
    for owner, name, label in (
        (Applier, "apply", "Applier.apply"),
        (SystemdApplier, "apply", "SystemdApplier.apply"),
    ):
        monkeypatch.setattr(owner, name, _counting(getattr(owner, name), label, seen.applies))
    import ansible_runner

    for name in ("run", "run_async"):
        monkeypatch.setattr(ansible_runner, name, _counting(getattr(ansible_runner, name), name, seen.applies))
    yield seen
    fake.use_scenario(None)


def _counting(function: Callable[..., Any], label: str, counter: Counter[str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        counter[label] += 1
        return function(*args, **kwargs)

    return call


@pytest.fixture
def kubelet(counted: _Counted) -> Iterator[tuple[Path, KubeletStandIn]]:
    """A stand-in kubelet for the h100-mig host: vLLM on the 3g.40gb instance, a time-sliced 1g.10gb, an FPGA."""
    counted.fake.use_scenario("h100-mig")
    facts = counted.fake
    facts.nvmlInit()
    try:
        handle = facts.nvmlDeviceGetHandleByIndex(0)
        mig = [facts.nvmlDeviceGetUUID(facts.nvmlDeviceGetMigDeviceHandleByIndex(handle, n)) for n in range(4)]
    finally:
        facts.nvmlShutdown()
    stand_in = KubeletStandIn(
        [
            StandInContainer("llm", "vllm-llama-0", "vllm", {"nvidia.com/mig-3g.40gb": [mig[0]]}),
            StandInContainer("batch", "embed-2", "main", {"nvidia.com/mig-1g.10gb": [f"{mig[1]}::1"]}),
            StandInContainer("edge", "fpga-job", "worker", {"example.com/fpga": ["fpga-0"]}),
        ],
        {"nvidia.com/mig-3g.40gb": [mig[0]], "nvidia.com/mig-1g.10gb": mig[1:], "example.com/fpga": ["fpga-0"]},
    )
    with tempfile.TemporaryDirectory(prefix="k8s-mode-") as directory:
        sock = Path(directory) / "kubelet.sock"
        with serving(sock, stand_in):
            yield sock, stand_in


@pytest.fixture
def node(server: DevServer, tmp_path: Path, node_id: str, kubelet: tuple[Path, KubeletStandIn]) -> Node:
    """A node enrolled with ``server`` in this mode, reading the stand-in ``kubelet``."""
    return make_kubernetes_node(server, tmp_path / "node", node_id, kubelet[0])


def _assert_host_untouched(node: Node) -> None:
    assert StateStore(node.state_dir).load().generation == 0
    assert not (node.state_dir / SPOOL_FILE).exists()
    assert not (node.state_dir / SPOOL_DIR / REQUEST_FILE).exists()
    assert node.journal_runs() == []


def test_observe_cycles_and_a_published_state_change_nothing_and_report_the_kubelets_view(
    server: DevServer,
    node: Node,
    node_id: str,
    counted: _Counted,
    kubelet: tuple[Path, KubeletStandIn],
    capsys: pytest.CaptureFixture[str],
) -> None:
    stand_in = kubelet[1]
    log, events = recording_logger(node_id)
    agent = node.agent(log=log)
    agent.client = recording = RecordingClient(agent.client)

    quiet = agent.cycle()
    generation = publish(server, node.node_id)
    refused = agent.cycle()
    again = agent.cycle()
    agent.write_status()

    assert quiet.outcome == CycleStatus.NONE_PUBLISHED
    assert (refused.outcome, refused.generation, refused.rejection) == (
        CycleStatus.REFUSED,
        generation,
        "read-only-mode",
    )
    assert again.outcome == CycleStatus.UNCHANGED
    counted.assert_nothing_changed()
    assert counted.nvml["nvmlDeviceGetMigDeviceHandleByIndex"] > 0  # the GPUs were read, through the seam
    assert stand_in.calls["List"] == 3  # refresh_seconds 0: each report asked the kubelet
    _assert_host_untouched(node)
    assert node.oplog_lines() == []
    assert [(e["generation"], e["reason"]) for e in events.named("desired-state-refused")] == [
        (generation, "read-only-mode")
    ]

    reported = recording.posted[-1]
    assert reported.mode == MODE and reported.applied_generation == 0
    # The control plane sees the refusal in the observation it keeps, not only the node's own status.
    assert recording.posted[0].refused_state is None
    assert reported.refused_state is not None
    assert (reported.refused_state.generation, reported.refused_state.reason) == (generation, "read-only-mode")
    kept = last_observation(server, node_id)
    assert kept is not None and kept["refused_state"]["generation"] == generation
    assert kept["refused_state"]["payload_sha256"] == reported.refused_state.payload_sha256
    assert reported.kubernetes is not None and reported.kubernetes.available
    holders = {a.pod: a for a in reported.kubernetes.allocations}
    assert sorted(holders) == ["embed-2", "vllm-llama-0"]
    gpu = reported.gpu.gpus[0]
    assert [(d.uuid, d.gpu_index) for d in holders["vllm-llama-0"].devices] == [(gpu.mig_instances[0].uuid, gpu.index)]
    assert [(d.uuid, d.gpu_index) for d in holders["embed-2"].devices] == [(gpu.mig_instances[1].uuid, gpu.index)]
    # The FPGA job holds no GPU: counted, with its FPGA and the allocatable one.
    assert [(e.reason, e.containers, e.devices) for e in reported.kubernetes.left_out] == [("not-a-gpu", 1, 2)]
    assert kept["kubernetes"]["left_out"] == [{"reason": "not-a-gpu", "containers": 1, "devices": 2}]
    assert [(e.name, e.managed, e.driver, e.ready) for e in reported.engines] == [
        ("k8s/llm/vllm-llama-0/vllm", False, "vllm", False)
    ]

    status = json.loads((node.state_dir / "status.json").read_text())
    assert status["refused_state"]["generation"] == generation
    assert status["kubernetes"]["available"] is True
    assert status["counters"]["states_refused"] == 1
    assert cli_main(["--config", str(node.config_path), "status"]) == 0
    shown = {line.split("  ", 1)[0]: line for line in capsys.readouterr().out.splitlines()}
    assert f"generation {generation} at " in shown["refused state"] and "read-only" in shown["refused state"]
    assert "llm/vllm-llama-0/vllm [vllm engine, unmanaged]" in shown["kubernetes"]
    joined = f"(GPU {gpu.index}" + (f", {gpu.health.verdict})" if gpu.health else ")")
    assert joined in shown["kubernetes"] and "4 allocatable device(s)" in shown["kubernetes"]


def test_a_restarted_agent_resumes_no_apply_an_earlier_mode_left_unfinished(
    server: DevServer, node: Node, node_id: str, counted: _Counted
) -> None:
    # What a managed-host agent killed in the middle of an apply leaves: the spooled envelope, a started run.
    generation, _envelope = node.leave_interrupted_apply(server, "gen-{generation}-20261201T120000.000000Z")
    log, events = recording_logger(node_id)
    agent = node.agent(log=log)

    exit_status = agent.run(once=True)

    assert exit_status == 1  # a refused state fails run --once, as a rejected one does
    assert [e["reason"] for e in events.named("interrupted-apply-not-resumed")] == [MODE]
    assert [e["generation"] for e in events.named("desired-state-refused")] == [generation]
    counted.assert_nothing_changed()
    assert StateStore(node.state_dir).load().generation == 0
    assert node.journal_runs() == []


def test_every_door_to_an_apply_stays_shut(server: DevServer, node: Node, node_id: str, counted: _Counted) -> None:
    generation = publish(server, node.node_id)
    log, events = recording_logger(node_id)
    agent = node.agent(log=log)
    assert agent.cycle().outcome == CycleStatus.REFUSED
    envelope = node.fetch_envelope(server)
    verified = node.verify(envelope)
    # A failed apply's retry, as one taken over from the record of a run before the mode changed.
    agent._retry = ApplyRetry(
        envelope=envelope,
        generation=generation,
        payload_sha256=verified.payload_sha256,
        failures=1,
        retry_at=0.0,
        backoff_s=10.0,
        failed_at=datetime.now(UTC),
        error="exit 1",
    )

    retried = agent.cycle()  # 304: the retry is due
    direct = agent._apply(envelope, verified, reason="drift")  # the door itself

    assert retried.outcome == CycleStatus.UNCHANGED and agent._retry is None
    assert [e["reason"] for e in events.named("apply-retry-dropped")] == [f"mode {MODE}"]
    assert (direct.ok, direct.failures) == (False, [f"mode {MODE} never applies"])
    assert [e["generation"] for e in events.named("apply-refused")] == [generation]
    counted.assert_nothing_changed()
    _assert_host_untouched(node)


def test_check_config_accepts_the_mode_and_asks_the_kubelet_once(
    node: Node, tmp_path: Path, kubelet: tuple[Path, KubeletStandIn], capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in = kubelet[1]

    answered = cli_main(["--config", str(node.config_path), "check-config"])
    out = capsys.readouterr().out
    node.configure(kubernetes={"pod_resources_socket": str(tmp_path / "nowhere.sock")})
    missing = cli_main(["--config", str(node.config_path), "check-config"])
    missing_out = capsys.readouterr().out

    assert answered == 0 and out.endswith("ok\n")
    assert f"mode {MODE}" in out and "apply: never" in out
    # What the read kept: the GPU holders and the GPUs allocatable (the FPGA job and the FPGA are counted).
    assert (
        "the kubelet answers: 3 pod(s), 3 container(s); 2 holding a GPU; 1 container(s) and 2 device(s) counted, "
        "not listed (not-a-gpu); 4 allocatable GPU device(s)"
    ) in out
    assert stand_in.calls == {"List": 1, "GetAllocatableResources": 1}
    # The kubelet may come up after the agent is installed: a warning, not an error.
    assert missing == 0 and missing_out.endswith("ok\n")
    assert "warning: kubernetes.pod_resources_socket:" in missing_out and "(no-socket)" in missing_out


def test_the_kubernetes_section_has_defaults_resolves_a_relative_socket_and_refuses_a_misspelt_field(
    tmp_path: Path,
) -> None:
    document = {"node_id": NODE_ID, "mode": MODE, "control_plane": {"url": "https://127.0.0.1:9"}}
    plain, relative, misspelt = (tmp_path / name for name in ("plain.yaml", "relative.yaml", "misspelt.yaml"))
    plain.write_text(yaml.safe_dump(document))
    relative.write_text(yaml.safe_dump({**document, "kubernetes": {"pod_resources_socket": "run/kubelet.sock"}}))
    misspelt.write_text(yaml.safe_dump({**document, "kubernetes": {"pod_resource_socket": "/run/kubelet.sock"}}))

    defaults = load_config(plain).kubernetes

    assert (defaults.pod_resources_socket, defaults.timeout_seconds, defaults.refresh_seconds) == (
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        2.0,
        10.0,
    )
    assert load_config(relative).kubernetes.pod_resources_socket == str(tmp_path / "run" / "kubelet.sock")
    with pytest.raises(ConfigError, match="pod_resource_socket"):
        load_config(misspelt)


class _NoGrpc:
    """A finder that says grpc is not installed, as on a host without the ``kubernetes`` extra."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "grpc" or name.startswith("grpc."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_check_config_without_the_kubernetes_extra_names_it(
    server: DevServer,
    tmp_path: Path,
    node_id: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = make_kubernetes_node(server, tmp_path / "node", node_id, tmp_path / "kubelet.sock")
    for name in [name for name in sys.modules if name == "grpc" or name.startswith("grpc.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoGrpc(), *sys.meta_path])

    status = cli_main(["--config", str(node.config_path), "check-config"])

    assert status == 1
    err = capsys.readouterr().err
    assert "the Python package(s) grpcio are not installed" in err and "meridian-node[kubernetes]" in err


def test_the_root_apply_unit_refuses_a_request_from_a_node_in_this_mode(tmp_path: Path) -> None:
    control = make_key()
    policy = write_policy(tmp_path / "etc", control=[control], extra={"agent": {"allowed_modes": [MODE]}})
    apply = {"via": "systemd", "state_dir": str(tmp_path / "apply")}
    config = write_split_config(
        tmp_path / "config.yaml", node_id=NODE_ID, policy=policy, state_dir=tmp_path / "agent", apply=apply, mode=MODE
    )
    # A request the agent of this node would never write (or one written by whoever took its user): well signed.
    ident = "gen-1-20261201T120000.000000Z"
    write_request(tmp_path / "agent" / SPOOL_DIR, ident, signed("desired-state", current_state(1), [control]))

    run = apply_spooled(config)

    assert run.returncode == 1
    answer = read_answer_file(tmp_path / "apply" / PUBLIC_DIR)
    assert answer is not None and answer.request == ident and answer.status == "failed"
    assert f"config mode is {MODE}, which is read-only" in answer.failures[0]
    assert list((tmp_path / "apply" / "journal").iterdir()) == []  # no playbook ran

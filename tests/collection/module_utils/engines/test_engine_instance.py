"""engine_instance's decisions without Docker: placement as tables, reservations, policy, spec, drain marks."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any, cast

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_INSTANCE,
    LABEL_OWNED,
    ContainerInfo,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import Options
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import (
    engine_settings,
    mounted_artifact,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import (
    DrainStateError,
    clear_draining,
    list_draining,
    mark_draining,
    read_mark,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.instance import converge
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import (
    LABEL_MIN_VRAM,
    LABEL_OWNER,
    LABEL_SPEC,
    public_spec,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import (
    Reservation,
    placement_problem,
    reservations_from,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import (
    EngineInstanceError,
    ParsedVolume,
    build_spec,
    check_policy,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.volumes import VolumeRefusedError, resolve_volumes
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import EnginesPolicy, PolicyError, load_policy
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

DIGEST = "sha256:" + "ab" * 32
MIG_40 = "MIG-4c7a1e92-0b3d-5f6e-8a21-9d0c3b7e5f41"
MIG_10 = "MIG-8e2b5d03-7c1a-5e49-b6f0-2a8d4c1e9b52"


def gpu(index: int, uuid: str, total: int, free: int, mig: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "memory": {"total_mib": total, "used_mib": total - free, "free_mib": free},
        "mig_mode": mig is not None,
        "mig_instances": [{"uuid": u, "memory_mib": m} for u, m in mig or []],
    }


FACTS = {
    "nvml_available": True,
    "reason": None,
    "gpus": [
        gpu(0, "GPU-aaaa", 81559, 6837),
        gpu(1, "GPU-bbbb", 81559, 80000),
        gpu(2, "GPU-cccc", 81559, 40000, mig=[(MIG_40, 40192), (MIG_10, 9856)]),
    ],
}
NO_NVML = {"nvml_available": False, "reason": "libnvidia-ml.so.1 could not be loaded", "gpus": []}


def other(gpus: tuple[str, ...], vram: int, name: str = "other") -> Reservation:
    return Reservation(name=name, gpus=gpus, min_vram_mib=vram)


# (case, gpus, min_vram_mib, facts, others, replaced, expected check or None, words in the message)
PLACEMENT = [
    ("no GPUs, no VRAM asked", [], 0, None, [], None, None, ""),
    ("VRAM asked without GPUs", [], 1000, None, [], None, "placement-vram", "but no gpus"),
    ("GPUs asked, NVML unreadable", ["0"], 0, NO_NVML, [], None, "placement-gpus", "libnvidia-ml.so.1"),
    ("unknown GPU uuid", ["GPU-zzzz"], 0, FACTS, [], None, "placement-gpus", "['GPU-zzzz']"),
    ("unknown GPU index", ["9"], 0, FACTS, [], None, "placement-gpus", "1=GPU-bbbb"),
    ("GPU by index with room", ["1"], 50000, FACTS, [], None, None, ""),
    ("GPU by uuid with room", ["GPU-bbbb"], 50000, FACTS, [], None, None, ""),
    ("busy GPU short of free VRAM", ["0"], 7000, FACTS, [], None, "placement-vram", "only 6837 MiB"),
    (
        "room taken by another engine's reservation",
        ["1"],
        50000,
        FACTS,
        [other(("GPU-bbbb",), 40000)],
        None,
        "placement-vram",
        "only 41559 MiB is available: 80000 MiB free of 81559 MiB, 40000 MiB reserved",
    ),
    (
        "reservation named by index counts too",
        ["GPU-bbbb"],
        50000,
        FACTS,
        [other(("1",), 40000)],
        None,
        "placement-vram",
        "41559",
    ),
    ("reservation on another GPU does not count", ["1"], 50000, FACTS, [other(("0",), 40000)], None, None, ""),
    (
        "the replaced container's reservation is credited",
        ["0"],
        7000,
        FACTS,
        [],
        other(("0",), 8000, name="self"),
        None,
        "",
    ),
    (
        "credit never exceeds the GPU's size",
        ["1"],
        81560,
        FACTS,
        [],
        other(("1",), 40000, name="self"),
        "placement-vram",
        "only 81559 MiB",
    ),
    (
        "whole GPU in MIG mode",
        ["2"],
        0,
        FACTS,
        [],
        None,
        "placement-gpus",
        f"MIG mode; ask for one of its MIG instances instead: {MIG_40}",
    ),
    ("MIG instance with room", [MIG_10], 9000, FACTS, [], None, None, ""),
    ("MIG instance too small", [MIG_10], 10000, FACTS, [], None, "placement-vram", "only 9856 MiB"),
    (
        "MIG instance reserved by another engine",
        [MIG_40],
        20000,
        FACTS,
        [other((MIG_40,), 30000)],
        None,
        "placement-vram",
        "only 10192 MiB",
    ),
    (
        "reservation on a sibling MIG instance does not count",
        [MIG_40],
        20000,
        FACTS,
        [other((MIG_10,), 9000)],
        None,
        None,
        "",
    ),
    ("every requested GPU must have the room", ["1", "0"], 7000, FACTS, [], None, "placement-vram", "GPU '0'"),
]


@pytest.mark.parametrize(
    ("gpus", "vram", "facts", "others", "replaced", "check", "words"),
    [row[1:] for row in PLACEMENT],
    ids=[row[0] for row in PLACEMENT],
)
def test_placement_decision(
    gpus: list[str],
    vram: int,
    facts: dict[str, Any] | None,
    others: list[Reservation],
    replaced: Reservation | None,
    check: str | None,
    words: str,
) -> None:
    problem = placement_problem(
        name="eng", gpus=gpus, min_vram_mib=vram, gpu_facts=facts, others=others, replaced=replaced
    )
    if check is None:
        assert problem is None
    else:
        assert problem is not None
        assert problem[0] == check
        assert words in problem[1]
        assert "'eng'" in problem[1]


def container(name: str, labels: dict[str, str], owned: bool = True) -> ContainerInfo:
    return ContainerInfo(
        id="c" * 64,
        name=name,
        image="img",
        image_id="sha256:" + "0" * 64,
        state="running",
        status="Up",
        labels=labels,
        ports=(),
        owned=owned,
    )


def owned_labels(name: str, gpus: list[str], vram: str) -> dict[str, str]:
    return {
        LABEL_OWNED: "true",
        LABEL_INSTANCE: name,
        LABEL_SPEC: json.dumps({"gpus": gpus}),
        LABEL_MIN_VRAM: vram,
    }


def test_reservations_come_from_owned_containers_but_not_the_engine_itself_nor_strangers() -> None:
    found = reservations_from(
        [
            container("a", owned_labels("a", ["0"], "1000")),
            container("self", owned_labels("self", ["0"], "5000")),
            container("stranger", owned_labels("stranger", ["0"], "7000"), owned=False),
            container("no-vram", owned_labels("no-vram", ["0"], "0")),
            container("garbled", {**owned_labels("garbled", ["0"], "lots"), LABEL_SPEC: "{not json"}),
        ],
        exclude="self",
    )

    assert found == [Reservation(name="a", gpus=("0",), min_vram_mib=1000)]


def spec_params(**overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "name": "eng",
        "driver": "vllm",
        "image": f"meridian-node/standin@{DIGEST}",
        "model": {"artifact": None, "name": "tiny"},
        "port": 8100,
        "env": {"HF_TOKEN": "hf_secret_value"},
        "gpus": [],
        "args": [],
        "served_model_name": None,
    }
    params.update(overrides)
    return params


def test_no_env_value_reaches_the_public_spec() -> None:
    spec = build_spec(spec_params(env={"MODE": "plain-value"}, secret_env={"HF_TOKEN": "hf_secret_value"}))
    public = public_spec(spec)

    assert "hf_secret_value" not in json.dumps(public) and "plain-value" not in json.dumps(public)
    assert public["env_keys"] == ["MODE"]
    assert public["secret_env_keys"] == ["HF_TOKEN"]
    assert public["model"] == {"name": "tiny"}


def test_invalid_spec_is_refused_naming_the_field() -> None:
    with pytest.raises(EngineInstanceError) as caught:
        build_spec(spec_params(name="Bad Name!"))

    assert caught.value.check == "spec"
    assert "name" in str(caught.value)


@pytest.fixture
def policy(tmp_path: Path) -> Any:
    path = write_policy(
        tmp_path,
        control=[make_key()],
        extra={
            "images": {"allowed_repositories": ["meridian-node/standin", "ghcr.io/org/*"]},
            "engines": {"allowed_drivers": ["vllm", "llamacpp"], "port_range": [8100, 8199]},
        },
    )
    return load_policy(path)


POLICY = [
    ("allowed", {}, None, ""),
    ("allowed under a prefix", {"image": f"ghcr.io/org/vllm@{DIGEST}"}, None, ""),
    ("unpinned image", {"image": "meridian-node/standin:latest"}, "policy-image", "unpinned"),
    ("repository not allowed", {"image": f"docker.io/evil/vllm@{DIGEST}"}, "policy-image", "'docker.io/evil/vllm'"),
    ("driver not allowed", {"driver": "ollama"}, "policy-driver", "'ollama' is not allowed"),
    ("port below the range", {"port": 8099}, "policy-port", "port 8099 is outside"),
    ("port above the range", {"port": 8200}, "policy-port", "8100-8199"),
    ("host IPC the policy does not allow", {"ipc_mode": "host"}, "policy-ipc", "engines.allow_host_ipc is false"),
    (
        "a volume where the policy allows none",
        {"volumes": [{"source": "/srv/models", "target": "/m"}]},
        "policy-volume",
        "none: engines.allowed_volume_sources is empty",
    ),
]


@pytest.mark.parametrize(("overrides", "check", "words"), [r[1:] for r in POLICY], ids=[r[0] for r in POLICY])
def test_policy_decision(policy: Any, overrides: dict[str, Any], check: str | None, words: str) -> None:
    spec = build_spec(spec_params(**overrides))
    if check is None:
        check_policy(policy, spec)
        return
    with pytest.raises(EngineInstanceError) as caught:
        check_policy(policy, spec)
    assert caught.value.check == check
    assert words in str(caught.value)


def test_unpromoted_artifact_is_refused_with_the_path(tmp_path: Path) -> None:
    (tmp_path / "artifacts" / "tiny" / "v1").mkdir(parents=True)

    with pytest.raises(EngineInstanceError) as caught:
        mounted_artifact(str(tmp_path), "tiny")

    assert caught.value.check == "artifact"
    assert str(tmp_path / "artifacts" / "tiny" / "current") in str(caught.value)


def test_a_current_link_to_a_version_that_is_gone_is_not_promoted(tmp_path: Path) -> None:
    # The store keeps such a link (the next promote replaces it); an engine must not mount through it.
    (tmp_path / "artifacts" / "tiny").mkdir(parents=True)
    (tmp_path / "artifacts" / "tiny" / "current").symlink_to("v3")

    with pytest.raises(EngineInstanceError) as caught:
        mounted_artifact(str(tmp_path), "tiny")

    assert caught.value.check == "artifact"
    assert "points at 'v3', which is missing" in str(caught.value)
    assert "meridian.node.verified_artifact (promote: true)" in str(caught.value)


def test_promoted_artifact_resolves_to_its_version_directory(tmp_path: Path) -> None:
    (tmp_path / "artifacts" / "tiny" / "v2").mkdir(parents=True)
    (tmp_path / "artifacts" / "tiny" / "current").symlink_to("v2")

    assert mounted_artifact(str(tmp_path), "tiny") == os.path.realpath(tmp_path / "artifacts" / "tiny" / "v2")


# --- draining marks ---------------------------------------------------------------------------------------


def test_draining_mark_is_durable_listed_and_cleared(tmp_path: Path) -> None:
    mark, new = mark_draining(str(tmp_path), "eng-a", reason="replacing", now="2026-01-01T00:00:00Z")
    assert new is True
    mark_draining(str(tmp_path), "eng-b", reason="drain")

    assert read_mark(str(tmp_path), "eng-a") == mark
    assert [m.name for m in list_draining(str(tmp_path))] == ["eng-a", "eng-b"]
    assert clear_draining(str(tmp_path), "eng-a") is True
    assert clear_draining(str(tmp_path), "eng-a") is False
    assert read_mark(str(tmp_path), "eng-a") is None
    assert [m.name for m in list_draining(str(tmp_path))] == ["eng-b"]


def test_marking_again_keeps_when_the_drain_began(tmp_path: Path) -> None:
    first, _ = mark_draining(str(tmp_path), "eng", reason="one", now="2026-01-01T00:00:00Z")
    again, new = mark_draining(str(tmp_path), "eng", reason="two", now="2026-01-02T00:00:00Z")

    assert new is False
    assert again == first


def test_a_mark_may_name_one_container_of_the_engine_by_its_port(tmp_path: Path) -> None:
    # A replace beside the old container drains only the old one; the new one, same engine, serves on.
    mark, new = mark_draining(str(tmp_path), "eng", reason="replacing", port=8101)
    assert new is True and read_mark(str(tmp_path), "eng") == mark
    assert (mark.applies_to(8101), mark.applies_to(8102), mark.applies_to(None)) == (True, False, False)
    assert json.loads((tmp_path / "draining" / "eng.json").read_text())["port"] == 8101
    # A mark for the whole engine (an operator's drain) covers every container and is not narrowed.
    whole, _ = mark_draining(str(tmp_path), "all", reason="drain")
    assert mark_draining(str(tmp_path), "all", reason="replacing", port=8101) == (whole, False)
    assert whole.applies_to(8101) and whole.applies_to(None)


@pytest.mark.parametrize("port", ["8101", 0, 65536, True, 8101.0])
def test_a_mark_with_a_port_that_is_not_one_is_an_error(tmp_path: Path, port: Any) -> None:
    (tmp_path / "draining").mkdir()
    document = {"name": "eng", "since": "2026-01-01T00:00:00Z", "reason": "x", "port": port}
    (tmp_path / "draining" / "eng.json").write_text(json.dumps(document))
    with pytest.raises(DrainStateError, match=r"optionally a port, 1-65535"):
        read_mark(str(tmp_path), "eng")


def test_path_traversal_name_cannot_become_a_mark_file(tmp_path: Path) -> None:
    with pytest.raises(DrainStateError, match="cannot name a draining mark"):
        mark_draining(str(tmp_path / "state"), "../../etc/passwd", reason="x")
    assert not (tmp_path / "state").exists()


def test_corrupt_mark_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "draining").mkdir()
    (tmp_path / "draining" / "eng.json").write_text("{half")

    with pytest.raises(DrainStateError, match=r"draining/eng\.json is not JSON"):
        read_mark(str(tmp_path), "eng")


def test_mark_of_another_engine_under_this_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "draining").mkdir()
    (tmp_path / "draining" / "eng.json").write_text(json.dumps({"name": "other", "since": "x", "reason": "y"}))

    with pytest.raises(DrainStateError, match="must be an object with name 'eng'"):
        read_mark(str(tmp_path), "eng")


def test_interrupted_write_leftovers_are_not_marks(tmp_path: Path) -> None:
    (tmp_path / "draining").mkdir()
    (tmp_path / "draining" / ".eng.json.x1y2.tmp").write_text("{")
    (tmp_path / "draining" / "notes.txt").write_text("hello")

    assert list_draining(str(tmp_path)) == []


class _NoDocker:
    """Any attribute access fails the test: the refusal must come before Docker is asked anything."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"Docker was called ({name}) before the policy check refused the engine")


def test_missing_policy_file_refuses_before_docker_is_asked_anything(tmp_path: Path) -> None:
    options = Options(policy_path=str(tmp_path / "nope.yaml"), state_dir=str(tmp_path))

    with pytest.raises(EngineInstanceError) as caught:
        converge(spec_params(), options, check_mode=False, engine=DockerEngine(cast(DockerApi, _NoDocker())))

    assert caught.value.check == "policy"
    assert "nope.yaml" in str(caught.value)


def test_policy_refusal_comes_before_docker_is_asked_anything(tmp_path: Path, policy: Any) -> None:
    options = Options(policy_path=policy.source, state_dir=str(tmp_path))

    with pytest.raises(EngineInstanceError) as caught:
        converge(spec_params(port=9000), options, check_mode=True, engine=DockerEngine(cast(DockerApi, _NoDocker())))

    assert caught.value.check == "policy-port"


def test_volume_refusal_comes_before_docker_is_asked_anything(tmp_path: Path, policy: Any) -> None:
    options = Options(policy_path=policy.source, state_dir=str(tmp_path))
    params = spec_params(volumes=[{"source": "/srv/models", "target": "/m"}])

    with pytest.raises(EngineInstanceError) as caught:
        converge(params, options, check_mode=True, engine=DockerEngine(cast(DockerApi, _NoDocker())))

    assert caught.value.check == "policy-volume"
    assert "'/srv/models'" in str(caught.value)


# --- the host settings: what the container carries -------------------------------------------------------


def test_host_settings_reach_the_public_spec_with_one_form_per_limit() -> None:
    spec = build_spec(
        spec_params(
            restart_policy="on-failure",
            shm_size_mib=2048,
            ulimits={"stack": 8388608, "nofile": {"soft": 1024, "hard": 4096}},
            volumes=[{"source": "/srv/tok", "target": "/tok"}],
            labels={"com.example.team": "search"},
        )
    )
    public = public_spec(spec)

    assert public["restart_policy"] == "on-failure"
    assert (public["shm_size_mib"], public["ipc_mode"]) == (2048, "private")
    assert public["ulimits"] == {"nofile": {"soft": 1024, "hard": 4096}, "stack": {"soft": 8388608, "hard": 8388608}}
    assert public["volumes"] == [{"source": "/srv/tok", "target": "/tok"}]
    assert public["labels"] == {"com.example.team": "search"}


def test_spec_labels_sit_beside_ours_on_the_container() -> None:
    spec = build_spec(spec_params(labels={"com.example.team": "search"}))
    launch = get_driver("vllm").container_settings(spec)
    settings = engine_settings(spec, launch, bind_address="127.0.0.1", owner="agent:n1")

    assert settings.labels["com.example.team"] == "search"
    assert settings.labels[LABEL_OWNER] == "agent:n1"
    assert json.loads(settings.labels[LABEL_SPEC])["labels"] == {"com.example.team": "search"}
    assert (settings.restart_policy, settings.ipc_mode, settings.shm_size_mib) == ("unless-stopped", "private", 10240)


@pytest.mark.parametrize("label", ["meridian.node/owner", "meridian.node/config-hash", "meridian.node/owned"])
def test_a_spec_label_cannot_pass_for_one_of_ours(label: str) -> None:
    with pytest.raises(EngineInstanceError) as caught:
        build_spec(spec_params(labels={label: "x"}))
    assert caught.value.check == "spec"
    assert "is reserved" in str(caught.value)


# --- the policy's engine section: volumes and host IPC --------------------------------------------------


def engines_policy(tmp_path: Path, **engines: Any) -> Any:
    return load_policy(write_policy(tmp_path / "policy", control=[make_key()], extra={"engines": engines}), keys=False)


def test_policy_lets_volumes_and_host_ipc_only_when_it_says_so(tmp_path: Path) -> None:
    default = engines_policy(tmp_path / "default")
    assert (default.engines.allowed_volume_sources, default.engines.allow_host_ipc) == ((), False)

    widened = engines_policy(tmp_path / "wide", allowed_volume_sources=["/srv/models"], allow_host_ipc=True)
    assert widened.engines.volume_source_problem("/srv/models/tok") is None
    assert widened.engines.volume_source_problem("/srv/models") is None
    assert "not at or below" in str(widened.engines.volume_source_problem("/srv/models2"))
    assert widened.engines.host_ipc_problem("host") is None


@pytest.mark.parametrize(
    ("sources", "words"),
    [
        (["/"], "name the directories they may read"),
        (["/etc/models"], "is inside /etc"),
        (["/run/user/0"], "is inside /run"),
        (["/var/lib/meridian-node/models"], "is inside /var/lib/meridian-node"),
        (["srv/models"], "must be an absolute path"),
        (["/srv/models/"], "must be an absolute path"),
        (["/srv/../etc"], "must be an absolute path"),
        ("/srv/models", "valid list"),
    ],
)
def test_policy_refuses_volume_sources_no_engine_may_have(tmp_path: Path, sources: Any, words: str) -> None:
    with pytest.raises(PolicyError) as caught:
        engines_policy(tmp_path, allowed_volume_sources=sources)
    assert "engines.allowed_volume_sources" in str(caught.value)
    assert words in str(caught.value)


def test_policy_host_ipc_switch_is_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"engines\.allow_host_ipc: input should be a valid boolean"):
        engines_policy(tmp_path, allow_host_ipc="yes")


# --- volumes resolved on the host --------------------------------------------------------------------------


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "tok").mkdir(parents=True)
    (root / "template.jinja").write_text("{{ messages }}")
    return root


def allowing(*sources: Path) -> EnginesPolicy:
    return EnginesPolicy(("vllm",), "127.0.0.1", (8000, 8999), allowed_volume_sources=tuple(map(str, sources)))


def refusal(volume: ParsedVolume, policy: EnginesPolicy, **kwargs: Any) -> VolumeRefusedError:
    with pytest.raises(VolumeRefusedError) as caught:
        resolve_volumes([volume], policy, **kwargs)
    return caught.value


def test_allowed_directories_and_files_are_mounted_as_they_are(data: Path) -> None:
    volumes = [ParsedVolume(str(data / "tok"), "/tok"), ParsedVolume(str(data / "template.jinja"), "/t.jinja")]
    assert resolve_volumes(volumes, allowing(data)) == tuple(volumes)


def test_a_symlink_inside_the_allowed_directory_is_mounted_where_it_leads(data: Path) -> None:
    (data / "latest").symlink_to(data / "tok")
    resolved = resolve_volumes([ParsedVolume(str(data / "latest"), "/tok")], allowing(data))
    assert resolved == (ParsedVolume(str(data / "tok"), "/tok"),)


def test_an_allowed_directory_that_is_a_symlink_allows_where_it_leads(tmp_path: Path, data: Path) -> None:
    (tmp_path / "models").symlink_to(data)
    resolved = resolve_volumes([ParsedVolume(str(tmp_path / "models" / "tok"), "/tok")], allowing(tmp_path / "models"))
    assert resolved == (ParsedVolume(str(data / "tok"), "/tok"),)


def test_a_symlink_planted_in_an_allowed_directory_cannot_reach_host_configuration(data: Path) -> None:
    (data / "innocent").symlink_to("/etc")
    refused = refusal(ParsedVolume(str(data / "innocent"), "/cfg"), allowing(data))
    assert refused.check == "volume"
    assert "resolves to '/etc'" in str(refused) and "overlaps /etc" in str(refused)


def test_a_symlink_cannot_lead_out_of_the_allowed_directories(tmp_path: Path, data: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (data / "out").symlink_to(elsewhere)
    refused = refusal(ParsedVolume(str(data / "out"), "/o"), allowing(data))
    assert refused.check == "volume"
    assert f"resolves to {str(elsewhere)!r}" in str(refused) and "not at or below" in str(refused)


def test_a_path_the_policy_does_not_list_is_refused_by_policy(tmp_path: Path, data: Path) -> None:
    refused = refusal(ParsedVolume(str(tmp_path), "/t"), allowing(data))
    assert refused.check == "policy-volume"
    assert str(data) in str(refused)


def test_a_missing_source_is_refused_before_docker_would_create_it(data: Path) -> None:
    refused = refusal(ParsedVolume(str(data / "nope"), "/n"), allowing(data))
    assert refused.check == "volume"
    assert "cannot be read on this host" in str(refused)


def test_a_socket_is_refused_even_read_only(data: Path) -> None:
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(data / "engine.sock"))
        refused = refusal(ParsedVolume(str(data / "engine.sock"), "/s"), allowing(data))
    assert refused.check == "volume"
    assert "is a socket" in str(refused) and "connect" in str(refused)


def test_a_fifo_is_refused(data: Path) -> None:
    os.mkfifo(data / "pipe")
    assert "is a FIFO" in str(refusal(ParsedVolume(str(data / "pipe"), "/p"), allowing(data)))


@pytest.mark.parametrize("which", ["store", "state"])
def test_this_hosts_own_directories_are_refused_inside_an_allowed_one(data: Path, which: str) -> None:
    own = data / which
    own.mkdir()
    # Given in another spelling: the host's directories are compared resolved.
    refused = refusal(ParsedVolume(str(data), "/all"), allowing(data), host_dirs=[str(own) + "/", ""])
    assert refused.check == "volume"
    assert f"overlaps {own}" in str(refused)


# --- a container that took over from a replace beside its old one -------------------------------------------


def _settings_and_container(label: str | None) -> tuple[Any, ContainerInfo]:
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import LABEL_HOST_PORT, PortBinding

    spec = build_spec(
        {"name": "chat", "driver": "vllm", "image": f"r/vllm@{DIGEST}", "model": {"name": "m"}, "port": 8100}
    )
    settings = engine_settings(spec, get_driver("vllm").container_settings(spec), bind_address="127.0.0.1")
    assert settings.port == PortBinding(container_port=8000, host_port=8100, host_ip="127.0.0.1")
    labels = {} if label is None else {LABEL_HOST_PORT: label}
    container = ContainerInfo("c1", "chat", "img", "sha256:x", "exited", "Exited (0)", labels, (), True)
    return settings, container


@pytest.mark.parametrize(
    ("label", "host_port"),
    [
        (None, 8100),  # created in its place: the spec's port
        ("8101", 8101),  # took over beside the old one: its free port, stopped or not (a stopped one lists no ports)
        ("8101x", 8100),  # not a port: read as the spec's, so a forged label shows as drift
        ("9000", 8100),  # outside the policy's range: the same
    ],
)
def test_the_settings_a_container_was_created_from_follow_its_placed_port_label(
    label: str | None, host_port: int
) -> None:
    from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import _as_placed

    settings, container = _settings_and_container(label)
    placed = _as_placed(settings, container, (8100, 8199))
    assert placed.published is not None and placed.published.host_port == host_port
    assert placed.config_hash() == settings.config_hash()  # where it runs is never part of what it is

"""engine_instance's decisions without Docker: placement as tables, reservations, policy, spec, drain marks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker_api import DockerApi
from ansible_collections.meridian.node.plugins.module_utils.docker_engine import (
    LABEL_INSTANCE,
    LABEL_OWNED,
    ContainerInfo,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.drain_state import (
    DrainStateError,
    clear_draining,
    list_draining,
    mark_draining,
    read_mark,
)
from ansible_collections.meridian.node.plugins.module_utils.engine_instance import (
    LABEL_MIN_VRAM,
    LABEL_SPEC,
    EngineInstanceError,
    Options,
    Reservation,
    artifact_dir,
    build_spec,
    check_policy,
    converge,
    placement_problem,
    public_spec,
    reservations_from,
)
from ansible_collections.meridian.node.plugins.module_utils.policy import load_policy
from ansible_collections.meridian.node.tests.helpers.trust_fixtures import make_key, write_policy

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


def test_env_values_never_reach_the_public_spec() -> None:
    spec = build_spec(spec_params())
    public = public_spec(spec)

    assert "hf_secret_value" not in json.dumps(public)
    assert public["env_keys"] == ["HF_TOKEN"]
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
        artifact_dir(str(tmp_path), "tiny")

    assert caught.value.check == "artifact"
    assert str(tmp_path / "artifacts" / "tiny" / "current") in str(caught.value)


def test_promoted_artifact_resolves_to_its_version_directory(tmp_path: Path) -> None:
    (tmp_path / "artifacts" / "tiny" / "v2").mkdir(parents=True)
    (tmp_path / "artifacts" / "tiny" / "current").symlink_to("v2")

    assert artifact_dir(str(tmp_path), "tiny") == os.path.realpath(tmp_path / "artifacts" / "tiny" / "v2")


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

"""The engine modules' spec check (no pydantic) against the ``ParsedEngineSpec`` contract (pydantic).

Both must accept and refuse the same documents; a table of good and bad specs runs through each.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import check_mapping
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import (
    FieldError,
    ParsedEngineSpec,
    ParsedModelRef,
    parse_engine_spec,
)

DIGEST = "sha256:" + "a" * 64
BASE: dict[str, Any] = {
    "name": "chat-small",
    "driver": "vllm",
    "image": f"ghcr.io/org/vllm:0.6@{DIGEST}",
    "model": {"artifact": "llama-3"},
    "port": 9001,
}


_DROP = object()  # spec(field=_DROP) leaves the field out


def spec(**changes: Any) -> dict[str, Any]:
    document = {**BASE, **changes}
    return {key: value for key, value in document.items() if value is not _DROP}


GOOD = [
    pytest.param(spec(), id="minimal"),
    pytest.param(spec(model={"name": "llama3:8b"}, driver="ollama"), id="model-by-name"),
    pytest.param(spec(image="vllm/vllm-openai"), id="unpinned-is-policys-call"),
    pytest.param(spec(ready_timeout_seconds=30), id="ready-timeout"),
    pytest.param(spec(image=f"registry.local:5000/a/b@{DIGEST}"), id="registry-with-port"),
    pytest.param(
        spec(
            served_model_name="chat",
            gpus=["0", "GPU-1", "MIG-2"],
            min_vram_mib=0,
            args=["--max-model-len", "4096"],
            env={"VLLM_LOGGING_LEVEL": "1"},
            secret_env={"HF_TOKEN": "x"},
            state="stopped",
            replace_strategy="stop-then-start",
        ),
        id="every-field",
    ),
    pytest.param(spec(served_model_name=None), id="served-name-null"),
    pytest.param(spec(port=1), id="lowest-port"),
    pytest.param(spec(port=65535), id="highest-port"),
    pytest.param(spec(name="a"), id="one-letter-name"),
    pytest.param(spec(name="a" * 63), id="longest-name"),
    pytest.param(
        spec(
            restart_policy="on-failure",
            shm_size_mib=65536,
            ulimits={"memlock": -1, "stack": 67108864, "nofile": {"soft": 65536, "hard": 1048576}},
            volumes=[{"source": "/srv/models/tok", "target": "/data/tok"}, {"source": "/srv/x.jinja", "target": "/x"}],
            labels={"com.example.team": "search", "team": "a" * 1024},
        ),
        id="every-host-setting",
    ),
    pytest.param(spec(restart_policy="no"), id="restart-never"),
    pytest.param(spec(ipc_mode="host"), id="host-ipc-is-policys-call"),
    pytest.param(spec(ulimits={"core": 0, "nproc": -1}), id="ulimit-zero-and-unlimited"),
    pytest.param(spec(ulimits={"stack": {"soft": 8388608, "hard": -1}}), id="ulimit-soft-under-unlimited"),
    pytest.param(spec(volumes=[{"source": "/var/lib/models", "target": "/models"}]), id="volume-beside-reserved"),
    pytest.param(spec(volumes=[{"source": "/etcetera", "target": "/data"}]), id="volume-prefix-is-not-a-parent"),
    pytest.param(
        spec(volumes=[{"source": "/srv/a", "target": "/data"}, {"source": "/srv/b", "target": "/data2"}]),
        id="volume-targets-side-by-side",
    ),
    pytest.param(spec(volumes=[{"source": f"/srv/m{i}", "target": f"/m{i}"} for i in range(16)]), id="most-volumes"),
    pytest.param(spec(labels={f"com.example.l{i}": "v" for i in range(32)}), id="most-labels"),
]

BAD = [
    pytest.param(spec(name="Bad Name!"), "name", id="bad-name"),
    pytest.param(spec(name="a" * 64), "name", id="name-too-long"),
    pytest.param(spec(name="-lead"), "name", id="name-leading-dash"),
    pytest.param(spec(name=_DROP), "name", id="no-name"),
    pytest.param(spec(driver="docker-run"), "driver", id="unknown-driver"),
    pytest.param(spec(image="Upper/Case"), "image", id="uppercase-image"),
    pytest.param(spec(image="vllm@sha256:abc"), "image", id="short-digest"),
    pytest.param(spec(image=7), "image", id="image-not-a-string"),
    pytest.param(spec(model={}), "model", id="model-empty"),
    pytest.param(spec(model={"artifact": "a", "name": "b"}), "model", id="model-both"),
    pytest.param(spec(model={"artifact": "../etc"}), "model.artifact", id="artifact-escapes"),
    pytest.param(spec(model={"path": "/x"}), "model.path", id="model-unknown-key"),
    pytest.param(spec(model="llama"), "model", id="model-not-a-mapping"),
    pytest.param(spec(port=0), "port", id="port-zero"),
    pytest.param(spec(port=65536), "port", id="port-too-high"),
    pytest.param(spec(port=_DROP), "port", id="no-port"),
    pytest.param(spec(port=None), "port", id="port-null"),
    pytest.param(spec(min_vram_mib=-1), "min_vram_mib", id="negative-vram"),
    pytest.param(spec(gpus="0"), "gpus", id="gpus-not-a-list"),
    pytest.param(spec(gpus=[0]), "gpus[0]", id="gpu-not-a-string"),
    pytest.param(spec(args=[1]), "args[0]", id="arg-not-a-string"),
    pytest.param(spec(env={"A": 1}), "env.A", id="env-value-not-a-string"),
    pytest.param(spec(env=["A=1"]), "env", id="env-not-a-mapping"),
    pytest.param(spec(secret_env={"A": 1}), "secret_env.A", id="secret-value-not-a-string"),
    pytest.param(spec(secret_env="A=1"), "secret_env", id="secret-env-not-a-mapping"),
    pytest.param(spec(env={"A": "1"}, secret_env={"A": "2"}), "secret_env", id="a-name-in-env-and-secret-env"),
    pytest.param(spec(state="running"), "state", id="unknown-state"),
    pytest.param(spec(replace_strategy="yolo"), "replace_strategy", id="unknown-strategy"),
    pytest.param(spec(privileged=True), "privileged", id="unknown-field"),
    pytest.param(spec(served_model_name=3), "served_model_name", id="served-name-not-a-string"),
    # restart policy, IPC and /dev/shm
    pytest.param(spec(restart_policy="always"), "restart_policy", id="restart-always-undoes-a-drain"),
    pytest.param(spec(restart_policy=False), "restart_policy", id="restart-no-unquoted"),
    pytest.param(spec(ipc_mode="shareable"), "ipc_mode", id="ipc-shareable"),
    pytest.param(spec(ipc_mode="container:other"), "ipc_mode", id="ipc-joins-another-container"),
    pytest.param(spec(ipc_mode="host", shm_size_mib=1024), "shm_size_mib", id="shm-ignored-with-host-ipc"),
    pytest.param(spec(shm_size_mib=0), "shm_size_mib", id="shm-zero"),
    pytest.param(spec(shm_size_mib=16 * 1024 * 1024 + 1), "shm_size_mib", id="shm-beyond-int64-bytes"),
    # ulimits
    pytest.param(spec(ulimits={"rtprio": 99}), "ulimits.rtprio", id="ulimit-raises-scheduling-priority"),
    pytest.param(spec(ulimits={"nofile": -1}), "ulimits.nofile", id="ulimit-nofile-unlimited"),
    pytest.param(spec(ulimits={"memlock": -2}), "ulimits.memlock", id="ulimit-below-unlimited"),
    pytest.param(spec(ulimits={"stack": {"soft": 9, "hard": 8}}), "ulimits.stack", id="ulimit-soft-above-hard"),
    pytest.param(spec(ulimits={"stack": {"soft": -1, "hard": 8}}), "ulimits.stack", id="ulimit-soft-unlimited-only"),
    pytest.param(spec(ulimits={"stack": {"soft": 8}}), "ulimits.stack.hard", id="ulimit-without-hard"),
    pytest.param(spec(ulimits={"stack": "64m"}), "ulimits.stack", id="ulimit-as-a-size-string"),
    pytest.param(spec(ulimits=["memlock=-1"]), "ulimits", id="ulimits-not-a-mapping"),
    # volumes: what a signed but mistaken state could use to take the host
    pytest.param(spec(volumes=[{"source": "/etc", "target": "/e"}]), "volumes[0]", id="volume-host-etc"),
    pytest.param(
        spec(volumes=[{"source": "/var/run/docker.sock", "target": "/s"}]), "volumes[0]", id="volume-docker-socket"
    ),
    pytest.param(spec(volumes=[{"source": "/run", "target": "/r"}]), "volumes[0]", id="volume-every-socket"),
    pytest.param(spec(volumes=[{"source": "/", "target": "/host"}]), "volumes[0]", id="volume-whole-host"),
    pytest.param(spec(volumes=[{"source": "/var", "target": "/v"}]), "volumes[0]", id="volume-above-reserved"),
    pytest.param(
        spec(volumes=[{"source": "/var/lib/meridian-node-apply/draining", "target": "/d"}]),
        "volumes[0]",
        id="volume-apply-state",
    ),
    pytest.param(
        spec(volumes=[{"source": "/var/lib/meridian-node", "target": "/d"}]), "volumes[0]", id="volume-agent-dir"
    ),
    pytest.param(spec(volumes=[{"source": "/var/lib/docker", "target": "/d"}]), "volumes[0]", id="volume-docker-state"),
    pytest.param(spec(volumes=[{"source": "/srv/../etc", "target": "/d"}]), "volumes[0]", id="volume-dot-dot"),
    pytest.param(spec(volumes=[{"source": "srv/models", "target": "/d"}]), "volumes[0]", id="volume-relative"),
    pytest.param(spec(volumes=[{"source": "//etc", "target": "/d"}]), "volumes[0]", id="volume-double-slash"),
    pytest.param(spec(volumes=[{"source": "/srv/m/", "target": "/d"}]), "volumes[0]", id="volume-trailing-slash"),
    pytest.param(spec(volumes=[{"source": "/srv/m", "target": "d"}]), "volumes[0]", id="volume-relative-target"),
    pytest.param(spec(volumes=[{"source": "/srv/m", "target": "/"}]), "volumes[0]", id="volume-over-the-root"),
    pytest.param(
        spec(volumes=[{"source": "/srv/m", "target": "/meridian/model"}]), "volumes[0]", id="volume-over-the-model"
    ),
    pytest.param(spec(volumes=[{"source": "/srv/m", "target": "/proc/x"}]), "volumes[0]", id="volume-into-proc"),
    pytest.param(
        spec(volumes=[{"source": "/srv/a", "target": "/d"}, {"source": "/srv/b", "target": "/d/b"}]),
        "volumes",
        id="volume-targets-overlap",
    ),
    pytest.param(
        spec(volumes=[{"source": "/srv/m", "target": "/d", "read_only": False}]),
        "volumes[0].read_only",
        id="volume-writable",
    ),
    pytest.param(spec(volumes=[{"source": "/srv/m"}]), "volumes[0].target", id="volume-without-target"),
    pytest.param(spec(volumes=["/srv/m:/d"]), "volumes[0]", id="volume-as-docker-cli-string"),
    pytest.param(
        spec(volumes=[{"source": f"/srv/m{i}", "target": f"/m{i}"} for i in range(17)]), "volumes", id="volumes-17"
    ),
    # labels
    pytest.param(spec(labels={"meridian.node/owner": "agent:x"}), "labels.meridian.node/owner", id="label-ours"),
    pytest.param(spec(labels={"meridian.node.x": "1"}), "labels.meridian.node.x", id="label-our-prefix"),
    pytest.param(
        spec(labels={"com.docker.compose.project": "x"}), "labels.com.docker.compose.project", id="label-docker"
    ),
    pytest.param(spec(labels={"Team Name": "x"}), "labels.Team Name", id="label-key-malformed"),
    pytest.param(spec(labels={"team": 1}), "labels.team", id="label-value-not-a-string"),
    pytest.param(spec(labels={"team": "a" * 1025}), "labels.team", id="label-value-too-long"),
    pytest.param(spec(labels={f"com.example.l{i}": "v" for i in range(33)}), "labels", id="labels-33"),
    # the readiness wait a state may set
    pytest.param(spec(ready_timeout_seconds=0), "ready_timeout_seconds", id="ready-timeout-zero"),
    pytest.param(spec(ready_timeout_seconds=86401), "ready_timeout_seconds", id="ready-timeout-over-a-day"),
    pytest.param(spec(ready_timeout_seconds="30"), "ready_timeout_seconds", id="ready-timeout-a-string"),
]


@pytest.mark.parametrize("document", GOOD)
def test_good_specs_parse_to_what_the_contract_parses(document: dict[str, Any]) -> None:
    ours = parse_engine_spec(document)
    theirs = contracts.EngineSpec.model_validate(document).model_dump()
    mine = dataclasses.asdict(ours)
    assert {**mine, "gpus": list(mine["gpus"]), "args": list(mine["args"]), "volumes": list(mine["volumes"])} == theirs


@pytest.mark.parametrize(("document", "field"), BAD)
def test_bad_specs_are_refused_by_both_naming_the_field(document: dict[str, Any], field: str) -> None:
    with pytest.raises(contracts.ValidationError):
        contracts.EngineSpec.model_validate(document)
    with pytest.raises(FieldError) as caught:
        parse_engine_spec(document)
    assert caught.value.where == field
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        pytest.param(True, "port", id="bool-port"),
        pytest.param("8000", "port", id="string-port"),
        pytest.param(8000.0, "port", id="float-port"),
    ],
)
def test_ours_is_strict_where_the_contract_coerces(value: Any, field: str) -> None:
    # Module parameters arrive typed by Ansible's argument spec, so strictness costs nothing there and
    # catches a caller that builds specs by hand.
    with pytest.raises(FieldError, match=f"^{field}: input should be a valid integer"):
        parse_engine_spec(spec(**{field: value}))


def test_messages_carry_the_value_but_never_env_values() -> None:
    with pytest.raises(FieldError) as caught:
        parse_engine_spec(spec(port=70000))
    assert str(caught.value) == "port: must be <= 65535 (got 70000)"
    with pytest.raises(FieldError) as secret:
        parse_engine_spec(spec(env={"HF_TOKEN": ["hf_secret"]}))
    assert "hf_secret" not in str(secret.value)
    with pytest.raises(FieldError) as both:
        parse_engine_spec(spec(env={"TOKEN": "plain-value"}, secret_env={"TOKEN": "hidden-value"}))
    assert "'TOKEN'" in str(both.value)
    assert "plain-value" not in str(both.value) and "hidden-value" not in str(both.value)


def test_where_prefixes_every_path() -> None:
    with pytest.raises(FieldError, match=r"^engines\[2\]\.model: model needs exactly one"):
        parse_engine_spec(spec(model={}), where="engines[2]")


def test_parsed_spec_is_frozen_and_model_dict_drops_nulls() -> None:
    parsed = parse_engine_spec(spec(model={"name": "m"}))
    assert parsed.model == ParsedModelRef(name="m") and parsed.model.as_dict() == {"name": "m"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.port = 1  # type: ignore[misc]
    assert isinstance(parsed, ParsedEngineSpec)


def test_missing_and_unknown_keys_are_named_together() -> None:
    with pytest.raises(FieldError) as caught:
        check_mapping({"controll": {}}, "trust", required=("control",))
    assert str(caught.value) == "trust.control: a required field is missing; trust.controll: unknown field (got {})"


def test_engine_modules_need_no_pydantic() -> None:
    # An Ansible task is a fresh process: pydantic would be most of each engine task's start-up. This
    # runs the modules' import and their whole validation path with pydantic made unimportable.
    script = textwrap.dedent(
        """
        import sys, tempfile, pathlib
        sys.modules["pydantic"] = None
        import ansible_collections.meridian.node.plugins.modules.engine_instance
        import ansible_collections.meridian.node.plugins.modules.engine_info
        import ansible_collections.meridian.node.plugins.modules.drain
        from ansible_collections.meridian.node.plugins.module_utils.engines.spec import build_spec
        from ansible_collections.meridian.node.plugins.module_utils.trust.policy import parse_policy
        policy = parse_policy("trust: {control: {public_keys: [k.pem]}}", pathlib.Path("/"), keys=False)
        spec = build_spec({"name": "e", "driver": "vllm", "image": "r/i", "model": {"name": "m"}, "port": 8000})
        assert policy.port_allowed(spec.port) is None
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

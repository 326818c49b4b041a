"""``secret_env`` beside ``env`` (issue 25): both reach the container, only env's values are ever shown.

A one-character secret is the hard case - Ansible's no_log stars every occurrence of such a value - so the
secret here is one character that no other text in a spec, label, diff or hash can contain.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.container_settings import (
    ContainerSettings,
    create_body,
    our_labels,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.drift import (
    LABEL_SETTINGS,
    compare_settings,
    describe_drift,
    drifted_from_label,
    expected_settings,
    read_settings,
    settings_label,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.prepare import engine_settings
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import DriverError, get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import public_spec, shown_spec
from ansible_collections.meridian.node.plugins.module_utils.engines.set_run import _envelope_engines
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedEngineSpec, parse_engine_spec
from ansible_collections.meridian.node.tests.support.trust_fixtures import vllm_engine

SECRET = "\u01c2"  # one character, and one that nothing else here prints
CHANGED = "\u01c3"
IMAGE_ID = "sha256:" + "2" * 64
ENGINE: dict[str, Any] = vllm_engine(name="aud-tgi")


def parsed(**changes: Any) -> ParsedEngineSpec:
    return parse_engine_spec({**ENGINE, **changes})


def settings_of(spec: ParsedEngineSpec, owner: str | None = None) -> ContainerSettings:
    launch = get_driver(spec.driver).container_settings(spec)
    return engine_settings(spec, launch, bind_address="127.0.0.1", owner=owner)


def printed(value: Any) -> str:
    """Every way a value is written out: JSON as Ansible writes it (escaped) and as it is (raw)."""
    return json.dumps(value, sort_keys=True) + json.dumps(value, sort_keys=True, ensure_ascii=False)


def test_a_one_character_secret_reaches_the_container_and_nothing_else() -> None:
    spec = parsed(env={"MODE": "tgi", "FLAG": "1"}, secret_env={"HF_TOKEN": SECRET})
    settings = settings_of(spec)
    labels = our_labels(settings)
    body = create_body(settings, "sha256:" + "2" * 64, labels)
    expected = expected_settings(body, {"Config": {}})

    assert f"HF_TOKEN={SECRET}" in body["Env"]
    assert {"MODE=tgi", "FLAG=1"} <= set(body["Env"])
    for shown in (public_spec(spec), shown_spec(spec), labels, settings.canonical(), settings_label(expected)):
        assert SECRET not in printed(shown) and "\\u01c2" not in printed(shown), shown
    assert shown_spec(spec)["secret_env"] == {"HF_TOKEN": "<secret>"}
    assert json.loads(labels["meridian.node/spec"])["secret_env_keys"] == ["HF_TOKEN"]


def test_env_values_are_shown_whole_beside_the_secret_names() -> None:
    shown = shown_spec(parsed(env={"MODE": "tgi", "FLAG": "1"}, secret_env={"HF_TOKEN": SECRET}))

    assert shown["name"] == "aud-tgi"
    assert shown["env"] == {"MODE": "tgi", "FLAG": "1"}
    assert shown["secret_env"] == {"HF_TOKEN": "<secret>"}


def test_an_engine_without_secrets_keeps_the_config_hash_v0_1_0_gave_it() -> None:
    # Both computed with v0.1.0's code (git archive of that commit): the spec label is hashed, so a new label
    # form would replace every running engine on upgrade.
    assert settings_of(parse_engine_spec(dict(ENGINE, name="chat")), "agent:n1").config_hash() == (
        "sha256:c6d7f70fb47821c028a73dc4294e2b656e70b1763897c7315427df3f9c0a9442"
    )
    with_env = parse_engine_spec(dict(ENGINE, name="chat", env={"MODE": "tgi", "FLAG": "1"}))
    assert settings_of(with_env, "agent:n1").config_hash() == (
        "sha256:dd18f33459a74dae5bf978cd3a3494cb1dc34c36759a0dfdd1e613cd1b80d08d"
    )


def test_a_secret_that_overrides_a_driver_default_is_in_the_environment_once() -> None:
    spec = parse_engine_spec(
        dict(ENGINE, driver="ollama", model={"name": "llama3:8b"}, secret_env={"OLLAMA_NOPRUNE": SECRET})
    )
    body = create_body(settings_of(spec), "sha256:" + "2" * 64, {})

    assert [entry for entry in body["Env"] if entry.startswith("OLLAMA_NOPRUNE=")] == [f"OLLAMA_NOPRUNE={SECRET}"]


@pytest.mark.parametrize("option", ["env", "secret_env"])
def test_neither_env_may_set_what_the_driver_owns(option: str) -> None:
    with pytest.raises(DriverError, match=f"{option} sets NVIDIA_VISIBLE_DEVICES.*remove it from {option}"):
        get_driver("vllm").container_settings(parsed(**{option: {"NVIDIA_VISIBLE_DEVICES": "all"}}))


def test_settings_refuse_a_name_in_env_and_secret_env() -> None:
    with pytest.raises(ValueError, match=r"\['TOKEN'\] are in both env and secret_env"):
        ContainerSettings(
            name="a", instance="a", driver="vllm", image="i", env={"TOKEN": "a"}, secret_env={"TOKEN": "b"}
        )


def test_a_signed_states_secrets_go_back_into_the_engines_it_converges() -> None:
    verified = {
        "engines": [{**ENGINE, "env": {"MODE": "tgi"}, "secret_env_keys": ["HF_TOKEN"]}],
        "engine_secret_env": {"aud-tgi": {"HF_TOKEN": SECRET}},
    }

    [engine] = _envelope_engines(verified)

    assert engine["env"] == {"MODE": "tgi"}
    assert engine["secret_env"] == {"HF_TOKEN": SECRET}
    assert "secret_env_keys" not in engine


def inspected(settings: ContainerSettings, labels: dict[str, str]) -> dict[str, Any]:
    """What Docker's inspect shows of a container created from ``settings`` with ``labels``, image defaults none."""
    body = create_body(settings, IMAGE_ID, labels)
    config = {key: body.get(key) for key in ("Env", "Labels", "Cmd", "Entrypoint", "StopSignal", "StopTimeout")}
    return {"Image": IMAGE_ID, "Config": config, "HostConfig": body["HostConfig"]}


@pytest.mark.parametrize(("live_secret", "drifted"), [(SECRET, ()), (CHANGED, ("env",))], ids=["same", "changed"])
def test_a_secret_changed_behind_our_back_is_drift_named_without_its_value(
    live_secret: str, drifted: tuple[str, ...]
) -> None:
    # A container recreated by hand with our labels but another secret: the config hash label still matches, so
    # only the live settings tell. The agent compares them with the digests in LABEL_SETTINGS, the module with
    # the settings themselves; the diff names the variable, never a value.
    settings = settings_of(parsed(env={"MODE": "tgi"}, secret_env={"HF_TOKEN": SECRET}))
    labels = our_labels(settings)
    expected = expected_settings(create_body(settings, IMAGE_ID, labels), {"Config": {}})
    labels[LABEL_SETTINGS] = settings_label(expected)
    live = inspected(dataclasses.replace(settings, secret_env={"HF_TOKEN": live_secret}), labels)

    assert drifted_from_label(live) == drifted
    assert tuple(compare_settings(expected, read_settings(live))) == drifted
    if drifted:
        shown = describe_drift("env", read_settings(live)["env"], expected["env"])
        assert shown == (["HF_TOKEN"], ["HF_TOKEN"])

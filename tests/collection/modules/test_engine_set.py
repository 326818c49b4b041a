"""meridian.node.engine_set run by ansible-playbook on the real Docker Engine, with the stand-in engines.

Each test drives one playbook (or a few) and reads back the registered results from a JSON file, and what
Docker shows: the containers, and for ordering the daemon's own event stream (create / destroy times).
Every container carries the test's random prefix and is removed afterwards, pass or fail.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils.artifacts.store import Store, ensure_artifact
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import verify_artifact_manifest
from ansible_collections.meridian.node.tests.support.e2e_env import engine_spec
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    Host,
    free_ports,
    hold_requests,
    standin_policy,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    artifact_manifest,
    desired_state,
    envelope,
    make_key,
    signed,
    write_policy,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# Only ever a secret_env value: it must appear nowhere in results or output.
SECRET = "tok-93b1e6d2-engine-set-secret"
# An engine kept loading (a plain env value: shown whole, never masked).
LOADING_FOREVER = {"STANDIN_LOAD_SECONDS": "86400"}


def play(
    host: Host,
    steps: Sequence[tuple[str, Mapping[str, Any], bool]],
    *,
    verbose: bool = False,
    nvml: str | None = None,
) -> tuple[dict[str, Any], str]:
    """Run ``(label, engine_set params, check_mode)`` steps in one playbook; (results by label, the output).

    ``nvml`` names a fake NVML scenario (tests/support/fakes/nvml_scenarios) for engines that ask for GPUs.
    """
    with_paths = [
        (label, {"policy": str(host.policy), "state_dir": str(host.state_dir), **params}, check)
        for label, params, check in steps
    ]
    return host.play_module("meridian.node.engine_set", with_paths, nvml=nvml, extra_args=["-vvv"] if verbose else [])


_ACTIONS = ("create", "start", "destroy", "rename")


def events(client: Any, since: datetime, names: Sequence[str]) -> list[tuple[int, str, str]]:
    """(time in ns, action, container name) of Docker's create/start/destroy/rename events for ``names`` at or
    after ``since``, in order (a rename's name is the new one).

    The API's ``since`` is whole seconds (docker-py truncates), so the query starts a second early and the
    daemon's own nanosecond times cut the window: an event of the play before ``since`` must not count.
    """
    since_ns = int(since.timestamp() * 1_000_000_000)
    until = datetime.now(UTC) + timedelta(seconds=1)
    seen = []
    query = client.events(since=since - timedelta(seconds=1), until=until, decode=True, filters={"type": "container"})
    for event in query:
        name = (event.get("Actor") or {}).get("Attributes", {}).get("name")
        if name in names and event.get("Action") in _ACTIONS and event["timeNano"] >= since_ns:
            seen.append((int(event["timeNano"]), str(event["Action"]), str(name)))
    return sorted(seen)


def at(seen: Sequence[tuple[int, str, str]], action: str, name: str) -> int:
    found = [time for time, what, who in seen if (what, who) == (action, name)]
    assert len(found) == 1, (action, name, seen)
    return found[0]


# --- a set converges, is a no-op the second time, and check mode changes nothing --------------------------


def test_three_engines_created_in_one_run_all_ready_then_no_op(host: Host, vllm: LocalImage, prefix: str) -> None:
    ports = free_ports(3)
    names = [f"{prefix}-{i}" for i in range(3)]
    params = {
        "engines": [
            engine_spec(name, vllm, port, secret_env={"API_TOKEN": SECRET})
            for name, port in zip(names, ports, strict=True)
        ]
    }

    checked, _ = play(host, [("check", params, True)])
    assert checked["check"]["changed"] is True
    assert all(checked["check"]["engines"][n]["actions"] == ["create", "start", "wait-ready"] for n in names)
    assert all(checked["check"]["engines"][n]["done"] == [] for n in names)
    assert [host.container(n) for n in names] == [None, None, None], "check mode created a container"

    results, output = play(
        host, [("apply", params, False), ("again", params, False), ("again-check", params, True)], verbose=True
    )
    apply = results["apply"]
    assert not apply.get("failed"), apply.get("msg")
    assert apply["changed"] is True
    for name in names:
        assert apply["engines"][name]["done"] == ["create", "start", "wait-ready"]
        assert apply["engines"][name]["ready"] is True
        assert host.container(name).status == "running"
        assert apply["diff"]["after"][name]["spec"]["secret_env"] == {"API_TOKEN": "<secret>"}
    for label in ("again", "again-check"):
        assert results[label]["changed"] is False, results[label]
        assert all(results[label]["engines"][n]["actions"] == [] for n in names)
    assert all(results["again"]["engines"][n]["ready"] is True for n in names), "the no-op run did not probe"
    assert apply["pruned"] == []
    assert SECRET not in json.dumps(results) and SECRET not in output


def test_changed_spec_replaces_drain_first_and_the_unchanged_engine_is_kept(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    ports = free_ports(2)
    changing, kept = engine_spec(f"{prefix}-a", vllm, ports[0]), engine_spec(f"{prefix}-b", vllm, ports[1])
    first, _ = play(host, [("apply", {"engines": [changing, kept]}, False)])
    kept_id = first["apply"]["engines"][kept["name"]]["container"]["id"]
    # vLLM aborts requests in flight on SIGTERM: only the drain keeps these alive through the replacement.
    threads, outcomes = hold_requests(ports[0], 4, seconds=3)
    try:
        changed = {**changing, "served_model_name": "renamed", "drain_timeout": 60}
        results, _ = play(host, [("apply", {"engines": [changed, kept]}, False)])
    finally:
        for thread in threads:
            thread.join(timeout=60)

    apply = results["apply"]
    assert not apply.get("failed"), apply.get("msg")
    # Drained, stopped and set aside until the new one is ready (replace_beside is off by default).
    assert apply["engines"][changing["name"]]["done"] == [
        "drain",
        "stop",
        "set-aside",
        "create",
        "start",
        "wait-ready",
        "remove-old",
    ]
    assert apply["engines"][kept["name"]]["done"] == []
    assert apply["engines"][kept["name"]]["container"]["id"] == kept_id
    assert [status for status, _at in outcomes] == [200] * 4, "requests in flight were cut off"
    assert apply["diff"]["before"][changing["name"]]["spec"]["served_model_name"] == "tiny-chat"
    assert apply["diff"]["after"][changing["name"]]["spec"]["served_model_name"] == "renamed"
    assert not (host.state_dir / "draining" / f"{changing['name']}.json").exists()


def test_two_engines_swapping_ports_retire_together_then_start_on_each_others_port(
    host: Host, vllm: LocalImage, prefix: str, docker_client: Any
) -> None:
    ports = free_ports(2)
    a, b = f"{prefix}-a", f"{prefix}-b"
    play(host, [("apply", {"engines": [engine_spec(a, vllm, ports[0]), engine_spec(b, vllm, ports[1])]}, False)])

    since = datetime.now(UTC)
    swapped = {"engines": [engine_spec(a, vllm, ports[1]), engine_spec(b, vllm, ports[0])]}
    results, _ = play(host, [("apply", swapped, False), ("again", swapped, False)])
    seen = events(docker_client, since, [a, b, f"{a}.OLD", f"{b}.OLD"])

    apply = results["apply"]
    assert not apply.get("failed"), apply.get("msg")
    assert all(apply["engines"][name]["ready"] is True for name in (a, b))
    # Each old container is stopped and set aside (renamed <name>.OLD) until its successor is ready, then removed.
    assert sorted((action, name) for _time, action, name in seen if action != "start") == sorted(
        [
            *[("rename", f"{a}.OLD"), ("rename", f"{b}.OLD"), ("create", a), ("create", b)],
            *[("destroy", f"{a}.OLD"), ("destroy", f"{b}.OLD")],
        ]
    ), seen
    last_aside = max(time for time, action, _name in seen if action == "rename")
    first_create = min(time for time, action, _name in seen if action == "create")
    assert last_aside < first_create, "a new engine was created while the other still held its port"
    assert host.container(a).ports == {"8000/tcp": [{"HostIp": BIND, "HostPort": str(ports[1])}]}
    assert host.container(b).ports == {"8000/tcp": [{"HostIp": BIND, "HostPort": str(ports[0])}]}
    assert results["again"]["changed"] is False


# --- pruning ----------------------------------------------------------------------------------------------


def test_dropped_engine_holding_a_wanted_port_is_pruned_before_the_new_one_starts(
    host: Host, vllm: LocalImage, prefix: str, docker_client: Any
) -> None:
    ports = free_ports(3)
    old, spare, kept = f"{prefix}-old", f"{prefix}-spare", f"{prefix}-kept"
    new = f"{prefix}-new"
    owned = {"owner": "ops", "prune": True}
    before = [engine_spec(old, vllm, ports[0]), engine_spec(spare, vllm, ports[1]), engine_spec(kept, vllm, ports[2])]
    play(host, [("apply", {"engines": before, **owned}, False)])
    # Another owner's engine and an engine of ours without an owner: never pruned.
    stranger = f"{prefix}-theirs"
    play(
        host, [("apply", {"engines": [engine_spec(stranger, vllm, free_ports(1)[0])], "owner": "someone-else"}, False)]
    )

    since = datetime.now(UTC)
    after = [engine_spec(new, vllm, ports[0]), engine_spec(kept, vllm, ports[2])]
    results, _ = play(
        host, [("check", {"engines": after, **owned}, True), ("apply", {"engines": after, **owned}, False)]
    )
    seen = events(docker_client, since, [old, spare, new, kept])

    assert results["check"]["pruned"] == [{"name": old, "reason": "first"}, {"name": spare, "reason": "later"}]
    apply = results["apply"]
    assert not apply.get("failed"), apply.get("msg")
    assert apply["pruned"] == [{"name": old, "reason": "first"}, {"name": spare, "reason": "later"}]
    assert apply["engines"][new]["ready"] is True
    assert at(seen, "destroy", old) < at(seen, "create", new), "the new engine was created before the old one left"
    assert at(seen, "start", new) < at(seen, "destroy", spare), "the spare was pruned before the new one served"
    assert host.container(old) is None and host.container(spare) is None
    assert host.container(stranger).status == "running"
    assert host.container(new).labels[LABEL_OWNER] == "ops"
    assert apply["diff"]["after"][old] == {} and apply["diff"]["before"][old]["state"] == "started"


def test_prune_needs_an_owner(host: Host, vllm: LocalImage, prefix: str) -> None:
    results, _ = play(
        host, [("apply", {"engines": [engine_spec(f"{prefix}-x", vllm, free_ports(1)[0])], "prune": True}, False)]
    )
    assert results["apply"]["failed"] is True
    assert "prune: true needs owner" in results["apply"]["msg"]
    assert host.container(f"{prefix}-x") is None


# --- failures ---------------------------------------------------------------------------------------------


def test_engine_that_never_gets_ready_fails_the_module_naming_it_while_the_others_are_ready(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    ports = free_ports(3)
    never = f"{prefix}-never"
    good = [f"{prefix}-good-{i}" for i in range(2)]
    specs = [engine_spec(name, vllm, port) for name, port in zip(good, ports[:2], strict=True)]
    specs.append(engine_spec(never, vllm, ports[2], env=LOADING_FOREVER, ready_timeout=3))
    results, _ = play(host, [("apply", {"engines": specs}, False)])

    apply = results["apply"]
    assert apply["failed"] is True
    assert apply["check"] == "readiness"
    assert f"engine {never!r} (check readiness)" in apply["msg"]
    assert "did not become ready within 3s" in apply["msg"]
    assert all(name not in apply["msg"] for name in good)
    assert apply["engines"][never]["check"] == "readiness"
    assert apply["engines"][never]["done"] == ["create", "start"]
    assert host.container(never).status == "exited", "the unready engine was left half-running"
    for name in good:
        assert apply["engines"][name]["ready"] is True
        assert host.container(name).status == "running"


def test_foreign_container_with_a_listed_name_fails_before_any_change(
    host: Host, vllm: LocalImage, prefix: str, docker_client: Any
) -> None:
    foreign = f"{prefix}-foreign"
    docker_client.containers.create(vllm.id, name=foreign, command=["sleep", "60"])
    ports = free_ports(2)
    other = f"{prefix}-other"
    results, _ = play(
        host,
        [("apply", {"engines": [engine_spec(other, vllm, ports[0]), engine_spec(foreign, vllm, ports[1])]}, False)],
    )

    apply = results["apply"]
    assert apply["failed"] is True
    assert apply["check"] == "ownership"
    assert apply["msg"].startswith("nothing was changed")
    assert f"engine {foreign!r} (check ownership)" in apply["msg"]
    assert host.container(other) is None, "an engine was created although the set was refused"
    assert host.container(foreign).status == "created"


def test_two_new_engines_asking_for_one_port_are_refused_before_any_change(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    port = free_ports(1)[0]
    results, _ = play(
        host,
        [
            (
                "apply",
                {"engines": [engine_spec(f"{prefix}-a", vllm, port), engine_spec(f"{prefix}-b", vllm, port)]},
                False,
            )
        ],
    )
    assert results["apply"]["failed"] is True
    assert results["apply"]["check"] == "placement-port"
    assert f"all ask for port {port}" in results["apply"]["msg"]
    assert host.container(f"{prefix}-a") is None and host.container(f"{prefix}-b") is None


def test_two_new_engines_that_do_not_fit_one_gpu_together_are_both_refused_before_any_change(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    # GPU 7 of the scenario has 81559 MiB free: either engine alone fits, both together do not.
    ports = free_ports(2)
    names = [f"{prefix}-a", f"{prefix}-b"]
    specs = [
        engine_spec(name, vllm, port, gpus=["7"], min_vram_mib=50000) for name, port in zip(names, ports, strict=True)
    ]
    results, _ = play(
        host, [("check", {"engines": specs}, True), ("apply", {"engines": specs}, False)], nvml="eight-gpus"
    )

    for label in ("check", "apply"):
        result = results[label]
        assert result["failed"] is True and result["check"] == "engines", result["msg"]
        for name in names:
            assert result["engines"][name]["check"] == "placement-vram"
            assert f"engine {name!r} (check placement-vram)" in result["msg"]
        assert "-50000 MiB for the other engines created with it" in result["msg"]
    assert [host.container(name) for name in names] == [None, None]

    # Alone, the same engine passes the VRAM check and meets the next one: this host has no NVIDIA runtime.
    alone, _ = play(host, [("apply", {"engines": specs[:1]}, False)], nvml="eight-gpus")
    assert alone["apply"]["check"] == "placement-runtime", alone["apply"]["msg"]
    assert host.container(names[0]) is None


# --- the signed desired state -----------------------------------------------------------------------------


def signed_state(path: Path, key: Any, generation: int, engines: list[dict[str, Any]]) -> Path:
    now = datetime.now(UTC)
    payload = desired_state(
        generation=generation,
        issued_at=format_rfc3339(now - timedelta(minutes=1)),
        expires_at=format_rfc3339(now + timedelta(hours=1)),
        engines=engines,
    )
    path.write_bytes(signed("desired-state", payload, [key]))
    return path


def signed_policy_host(tmp_path: Path, docker_client: Any, key: Any, **store: Any) -> Host:
    """A host whose policy takes desired states signed by ``key``: vllm stand-ins only; ``store`` joins the
    store's settings."""
    host = Host(tmp_path, docker_client)
    host.policy = standin_policy(
        tmp_path / "signed-policy", ["vllm"], control=[key], store={"path": str(host.store), **store}
    )
    return host


def failing_then_good(
    tmp_path: Path, docker_client: Any, vllm: LocalImage, prefix: str
) -> tuple[Host, str, str, Path, Path]:
    """A host whose policy takes desired states signed by a fresh key, and two generations signed by it: 1 lists an
    engine that serves and one that never gets ready, both with SECRET in their secret_env; 2 lists only the one
    that serves. (the host, served, never, generation 1's file, generation 2's file)."""
    key = make_key()
    host = signed_policy_host(tmp_path, docker_client, key)
    ports = free_ports(2)
    served, never = f"{prefix}-served", f"{prefix}-never"
    wanted = engine_spec(served, vllm, ports[0], secret_env={"HF_TOKEN": SECRET})
    failing = signed_state(
        tmp_path / "gen1.json",
        key,
        1,
        # The signed state itself shortens the wait for an engine that never gets ready (600 s by default).
        [
            wanted,
            {
                **engine_spec(never, vllm, ports[1], env=LOADING_FOREVER, secret_env={"OTHER": SECRET}),
                "ready_timeout_seconds": 3,
            },
        ],
    )
    return host, served, never, failing, signed_state(tmp_path / "gen2.json", key, 2, [wanted])


def test_envelope_with_a_secret_env_value_never_shows_it_and_records_only_on_success(
    tmp_path: Path, docker_client: Any, vllm: LocalImage, prefix: str
) -> None:
    host, served, never, failing, good = failing_then_good(tmp_path, docker_client, vllm, prefix)
    envelope = {"envelope": str(failing), "node_id": NODE_ID, "record": True}
    results, output = play(host, [("apply", envelope, False)], verbose=True)

    apply = results["apply"]
    assert apply["failed"] is True and f"engine {never!r} (check readiness)" in apply["msg"]
    assert (apply["generation"], apply["recorded"]) == (1, False)
    assert StateStore(host.state_dir).load().generation == 0, "a failed apply was recorded"
    assert host.container(served).labels[LABEL_OWNER] == f"agent:{NODE_ID}", apply

    envelope = {"envelope": str(good), "node_id": NODE_ID, "record": True}
    second, more = play(host, [("apply", envelope, False), ("again", envelope, False)], verbose=True)

    apply = second["apply"]
    assert not apply.get("failed"), apply.get("msg")
    assert (apply["generation"], apply["recorded"], apply["changed"]) == (2, True, True)
    assert apply["pruned"] == [{"name": never, "reason": "later"}], "the dropped engine of the agent stayed"
    assert StateStore(host.state_dir).load().generation == 2
    assert (second["again"]["recorded"], second["again"]["changed"]) == (False, False)
    assert second["again"]["engines"][served]["ready"] is True
    env = host.client.containers.get(served).attrs["Config"]["Env"]
    assert f"HF_TOKEN={SECRET}" in env, "the secret did not reach the engine"
    for text in (json.dumps(results), output, json.dumps(second), more):
        assert SECRET not in text
    assert "ESTABLISH LOCAL CONNECTION" in more, "not -vvv output"


def test_envelope_whose_artifact_is_not_promoted_is_refused_before_any_change_and_only_warned_in_check_mode(
    tmp_path: Path, docker_client: Any, vllm: LocalImage, prefix: str
) -> None:
    # The reconcile playbook skips its artifact step when its caller says the state lists no artifacts; engine_set
    # itself must then find each listed artifact in the store as signed, or change nothing.
    key, artifact_key = make_key(), make_key()
    host = Host(tmp_path, docker_client)
    models = tmp_path / "models"
    host.policy = standin_policy(
        tmp_path / "signed-policy",
        ["vllm"],
        control=[key],
        artifact=[artifact_key],
        store={"path": str(host.store), "local_sources": [str(models)]},
    )
    weights = b"engine-set weights\n" * 16
    (models / "m").mkdir(parents=True)
    (models / "m" / "weights.bin").write_bytes(weights)
    manifest = artifact_manifest(
        name="m", files=[{"path": "weights.bin", "size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}]
    )
    manifest_envelope = envelope("artifact-manifest", manifest, [artifact_key])
    store = Store.for_policy(load_policy(host.policy).store)
    verified = verify_artifact_manifest(json.dumps(manifest_envelope).encode(), load_policy(host.policy))
    # In the store, intact, but not the promoted version.
    ensure_artifact(
        store, verified.manifest, manifest_sha256=verified.payload_sha256, source=str(models / "m"), promote=False
    )
    name = f"{prefix}-x"
    now = datetime.now(UTC)
    payload = desired_state(
        generation=1,
        issued_at=format_rfc3339(now - timedelta(minutes=1)),
        expires_at=format_rfc3339(now + timedelta(hours=1)),
        artifacts=[{"name": "m", "version": "1.0.0", "manifest": manifest_envelope}],
        engines=[engine_spec(name, vllm, free_ports(1)[0])],
    )
    path = tmp_path / "state.json"
    path.write_bytes(signed("desired-state", payload, [key]))
    params = {"envelope": str(path), "node_id": NODE_ID, "record": True}

    results, output = play(host, [("check", params, True), ("apply", params, False)])

    assert not results["check"].get("failed"), results["check"].get("msg")
    assert "artifact 'm' version '1.0.0' is not the promoted version" in output
    apply = results["apply"]
    assert apply["failed"] is True and apply["check"] == "artifact", apply
    assert "artifact 'm' version '1.0.0' is not the promoted version" in apply["msg"]
    assert "meridian_state_artifacts" in apply["msg"]
    assert (apply["generation"], apply["recorded"]) == (1, False)
    assert host.container(name) is None
    assert StateStore(host.state_dir).load().generation == 0


def test_refused_envelope_changes_nothing(tmp_path: Path, docker_client: Any, vllm: LocalImage, prefix: str) -> None:
    key, stranger = make_key(), make_key()
    host = Host(tmp_path, docker_client)
    host.policy = write_policy(tmp_path / "signed-policy", control=[key], extra={"store": {"path": str(host.store)}})
    path = signed_state(tmp_path / "state.json", stranger, 1, [engine_spec(f"{prefix}-x", vllm, free_ports(1)[0])])
    results, _ = play(host, [("apply", {"envelope": str(path), "node_id": NODE_ID, "record": True}, False)])
    assert results["apply"]["failed"] is True
    assert results["apply"]["rejection"]
    assert host.container(f"{prefix}-x") is None


def test_parallel_one_still_converges_every_engine(host: Host, vllm: LocalImage, prefix: str) -> None:
    ports = free_ports(2)
    specs = [engine_spec(f"{prefix}-{i}", vllm, port) for i, port in enumerate(ports)]
    results, _ = play(host, [("apply", {"engines": specs, "parallel": 1}, False)])
    assert not results["apply"].get("failed"), results["apply"].get("msg")
    assert all(results["apply"]["engines"][spec["name"]]["ready"] is True for spec in specs)

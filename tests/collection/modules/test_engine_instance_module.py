"""meridian.node.engine_instance run by ansible-playbook on the real Docker Engine.

Each state is driven in the four steps (check, apply, idempotent, idempotent-check) in one playbook; the
registered results are written to a JSON file the test reads. Engines are the stand-in images
(tests/support/standin_server.py playing each engine); NVML is faked at the pynvml seam only where a test
asks for GPUs. Every container carries the test's random prefix and is removed afterwards, pass or fail.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import LABEL_CONFIG_HASH
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_MIN_VRAM, LABEL_SPEC
from ansible_collections.meridian.node.tests.support.engine_harness import (
    BIND,
    Host,
    engine_images,
    free_port,
    free_ports,
    hold_requests,
    standin_policy,
    stuck_requests,
    watch_mark,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

# Only used as a secret_env value: no_log masks every occurrence of it in the output, so it must be unusual.
SECRET = "tok-5e3c7a9f-not-for-labels"

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def images(docker_client: Any, standin_base_image: LocalImage) -> dict[str, LocalImage]:
    return engine_images(
        docker_client, standin_base_image, ("vllm", "llamacpp", "tgi", "sglang", "ollama", "lmdeploy", "openai")
    )


# A running engine's replace with replace_beside and room on the host: the new one beside the old, which drains
# once it is ready. Without: the old one drained, stopped and set aside until the new one is ready.
BESIDE = ["create-beside", "start", "wait-ready", "drain-old", "stop-old", "remove-old", "promote"]
IN_PLACE = ["drain", "stop", "set-aside", "create", "start", "wait-ready", "remove-old"]


def four_steps(params: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bool]]:
    return [
        ("check", params, True),
        ("apply", params, False),
        ("idempotent", params, False),
        ("idem-check", params, True),
    ]


def assert_four_steps(results: Mapping[str, Any], actions: list[str]) -> None:
    for label in results:
        assert not results[label].get("failed"), (label, results[label].get("msg"))
    assert results["check"]["changed"] is True
    assert results["check"]["actions"] == actions
    assert results["check"]["done"] == []
    assert results["apply"]["changed"] is True
    assert results["apply"]["done"] == actions
    for label in ("idempotent", "idem-check"):
        assert results[label]["changed"] is False, results[label]
        assert results[label]["actions"] == []


def test_vllm_engine_started_ready_idempotent_then_absent(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-vllm"
    started = host.engine(
        images,
        name,
        "vllm",
        model={"artifact": "tiny"},
        served_model_name="tiny-chat",
        secret_env={"API_TOKEN": SECRET},
    )
    results = host.play(four_steps(started))

    assert_four_steps(results, ["create", "start", "wait-ready"])
    assert results["apply"]["ready"] is True
    assert results["idempotent"]["ready"] is True
    assert results["check"]["diff"]["after"]["spec"]["secret_env"] == {"API_TOKEN": "<secret>"}
    container = host.container(name)
    assert container is not None and container.status == "running"
    assert container.id == results["apply"]["container"]["id"] == results["idempotent"]["container"]["id"]
    labels = container.labels
    assert labels[LABEL_CONFIG_HASH] == results["apply"]["config_hash"]
    assert labels[LABEL_MIN_VRAM] == "0"
    # The secret is in the container's environment, and nowhere in its labels.
    assert SECRET not in json.dumps(labels)
    assert json.loads(labels[LABEL_SPEC])["secret_env_keys"] == ["API_TOKEN"]
    assert f"API_TOKEN={SECRET}" in container.attrs["Config"]["Env"]
    mounts = container.attrs["Mounts"]
    assert [(m["Source"], m["RW"]) for m in mounts] == [(str(host.store / "artifacts" / "tiny" / "v1"), False)]

    absent = host.params(name=name, state="absent")
    results = host.play(four_steps(absent))

    assert_four_steps(results, ["stop", "remove"])
    assert results["apply"]["container"] is None
    assert host.container(name) is None


def test_llamacpp_engine_started_and_ready(host: Host, images: dict[str, LocalImage], prefix: str) -> None:
    name = f"{prefix}-llama"
    params = host.engine(images, name, "llamacpp", model={"artifact": "tiny"}, env={"STANDIN_LOAD_SECONDS": "2.5"})
    results = host.play(four_steps(params))

    assert_four_steps(results, ["create", "start", "wait-ready"])
    assert results["apply"]["ready"] is True
    assert results["apply"]["probe"] == "GET /health answered 200"
    container = host.container(name)
    assert container is not None and container.status == "running"
    assert "/meridian/model/tiny-q4.gguf" in container.attrs["Args"]


def test_tgi_sglang_ollama_lmdeploy_and_generic_engines_start_and_become_ready(
    tmp_path: Path, docker_client: Any, images: dict[str, LocalImage], prefix: str
) -> None:
    host = Host(tmp_path, docker_client, drivers=[*Host.DRIVERS, "tgi"])
    specs: dict[str, dict[str, Any]] = {
        "tgi": {"model": {"name": "tiny"}},
        "sglang": {"model": {"artifact": "tiny"}},
        "ollama": {"model": {"name": "tiny"}},
        "lmdeploy": {"model": {"artifact": "tiny"}},
        # The generic driver's probe path is configurable; the stand-in serves its model list there.
        "openai": {"model": {"name": "tiny"}, "health_path": "/v1/models"},
    }
    steps: list[tuple[str, Mapping[str, Any], bool]] = []
    for (driver, extra), port in zip(specs.items(), free_ports(len(specs)), strict=True):
        params = host.engine(images, f"{prefix}-{driver}", driver, port, **extra)
        steps += [(f"{driver} apply", params, False), (f"{driver} idempotent", params, False)]
    results = host.play(steps)

    for driver in specs:
        applied, again = results[f"{driver} apply"], results[f"{driver} idempotent"]
        assert not applied.get("failed"), (driver, applied.get("msg"))
        assert applied["done"] == ["create", "start", "wait-ready"], driver
        assert applied["ready"] is True, (driver, applied["probe"])
        assert again["changed"] is False, (driver, again)
        assert again["ready"] is True, driver
        assert host.container(f"{prefix}-{driver}").status == "running"


def test_stopped_then_started_in_four_steps_each(host: Host, images: dict[str, LocalImage], prefix: str) -> None:
    name = f"{prefix}-stop"
    params = host.engine(images, name, "vllm", model={"name": "tiny"})
    results = host.play(four_steps({**params, "state": "stopped"}))
    assert_four_steps(results, ["create"])
    assert results["apply"]["container"]["status"] == "created"
    assert results["apply"]["ready"] is None

    results = host.play(four_steps({**params, "state": "started"}))
    assert_four_steps(results, ["start", "wait-ready"])
    assert results["apply"]["ready"] is True

    results = host.play(four_steps({**params, "state": "stopped"}))
    assert_four_steps(results, ["stop"])
    container = host.container(name)
    assert container is not None and container.status == "exited"


def test_config_change_drains_and_replaces_and_the_old_container_is_gone(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-repl"
    params, first = host.started(images, name, "vllm", model={"artifact": "tiny"}, served_model_name="first")
    changed = {**params, "served_model_name": "second", "replace_beside": True}
    results = host.play(four_steps(changed))

    assert_four_steps(results, BESIDE)
    diff = results["check"]["diff"]
    assert diff["before"]["spec"]["served_model_name"] == "first"
    assert diff["after"]["spec"]["served_model_name"] == "second"
    new_id = results["apply"]["container"]["id"]
    assert new_id != first["container"]["id"]
    assert [c.id for c in host.client.containers.list(all=True, filters={"name": name})] == [new_id]
    assert "second" in host.container(name).attrs["Args"]
    # The draining mark lived only until the replacement was ready.
    assert list((host.state_dir / "draining").iterdir()) == []


def test_check_mode_plans_an_engine_whose_artifact_is_not_in_the_store_yet(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    # A rollout's check run: verified_artifact would fetch the artifact first, but check mode did not run it.
    name = f"{prefix}-pend"
    pending = host.engine(images, name, "vllm", model={"artifact": "not-yet"})
    results = host.play([("check", pending, True), ("apply", pending, False)])

    check = results["check"]
    assert not check.get("failed"), check.get("msg")
    assert check["changed"] is True and check["done"] == []
    assert check["actions"] == ["create", "start", "wait-ready"]
    assert "artifact 'not-yet' has no promoted version" in check["pending"]
    assert "placement was not checked" in check["pending"]
    assert any("not-yet" in warning for warning in check["warnings"])
    # Outside check mode the missing artifact is still a failure, and nothing was created by either step.
    assert results["apply"]["failed"] is True and results["apply"]["check"] == "artifact"
    assert host.container(name) is None

    # A running engine whose spec moves to an artifact not yet present would be replaced.
    _params, running = host.started(images, name, "vllm", model={"artifact": "tiny"}, port=pending["port"])
    replace = host.play([("check", pending, True)])["check"]
    assert replace["actions"] == IN_PLACE
    assert replace["diff"]["after"]["spec"]["model"] == {"artifact": "not-yet"}
    assert host.container(name).id == running["container"]["id"]


def test_foreign_container_with_our_name_is_left_untouched(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-foreign"
    foreign = host.client.containers.run(
        images["vllm"].id,
        entrypoint=["python3", "-c", "import time; time.sleep(600)"],
        name=name,
        detach=True,
        init=True,
    )
    params = host.engine(images, name, "vllm", model={"name": "m"})
    results = host.play([("check", params, True), ("apply", params, False)])

    for label in ("check", "apply"):
        assert results[label]["failed"] is True
        assert results[label]["check"] == "ownership"
        assert "not created by meridian.node" in results[label]["msg"]
    foreign.reload()
    assert foreign.status == "running"
    assert host.container(name).id == foreign.id


def _refusal_cases(images: dict[str, LocalImage], port: int) -> dict[str, tuple[dict[str, Any], str, str]]:
    pinned = images["vllm"].pinned
    return {
        "unpinned image": ({"image": images["vllm"].tag}, "policy-image", "unpinned"),
        "disallowed repository": (
            {"image": "meridian-node/other@" + images["vllm"].id},
            "policy-image",
            "is not allowed by policy",
        ),
        "disallowed driver": (
            {"driver": "tgi", "image": images["tgi"].pinned},
            "policy-driver",
            "'tgi' is not allowed",
        ),
        "port out of range": ({"port": 9500}, "policy-port", "port 9500 is outside"),
        "unknown GPU": ({"image": pinned, "gpus": ["GPU-00000000-dead-beef"]}, "placement-gpus", "does not have"),
        "VRAM short": ({"gpus": ["0"], "min_vram_mib": 20000}, "placement-vram", "only 6837 MiB is available"),
        "no NVIDIA runtime": ({"gpus": ["7"], "min_vram_mib": 1000}, "placement-runtime", "no NVIDIA runtime"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unpinned image",
        "disallowed repository",
        "disallowed driver",
        "port out of range",
        "port taken",
        "unknown GPU",
        "VRAM short",
        "no NVIDIA runtime",
    ],
)
def test_refused_engine_creates_nothing(host: Host, images: dict[str, LocalImage], prefix: str, case: str) -> None:
    name = f"{prefix}-refused"
    port = free_port()
    params = host.engine(images, name, "vllm", port, model={"name": "m"})
    with socket.socket() as holder:
        if case == "port taken":
            holder.bind((BIND, port))
            holder.listen()
            overrides: dict[str, Any] = {}
            check, words = "placement-port", f"port {port} on {BIND} is already in use"
        else:
            overrides, check, words = _refusal_cases(images, port)[case]
        params.update(overrides)
        results = host.play([("check", params, True), ("apply", params, False)], nvml="eight-gpus")

    for label in ("check", "apply"):
        assert results[label]["failed"] is True, results[label]
        assert results[label]["check"] == check, results[label]["msg"]
        assert words in results[label]["msg"]
    assert host.container(name) is None


def never_ready(host: Host, images: dict[str, LocalImage], name: str, **spec: Any) -> dict[str, Any]:
    """The result of applying a stand-in llama.cpp engine ``name`` that never gets ready (3 s allowed)."""
    params = host.engine(
        images, name, "llamacpp", model={"name": "m"}, env={"STANDIN_NEVER_READY": "1"}, ready_timeout=3, **spec
    )
    result: dict[str, Any] = host.play([("apply", params, False)])["apply"]
    return result


def test_engine_that_never_becomes_ready_fails_with_its_log_tail_and_is_left_stopped(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-never"
    result = never_ready(host, images, name)

    assert result["failed"] is True
    assert result["check"] == "readiness"
    assert "did not become ready" in result["msg"]
    assert "503 Loading model" in result["msg"], "the last probe verdict is missing"
    assert "GET /health -> 503" in result["msg"], "the container's log tail is missing from the message"
    assert result["done"] == ["create", "start"]
    container = host.container(name)
    assert container is not None
    assert container.status == "exited", "left half-running"


def test_a_secret_the_engine_prints_is_redacted_from_the_log_tail_of_its_failure(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    # The stand-in logs the model it serves ("... serving 'NAME'"), taken from STANDIN_MODEL: here a secret.
    # Ansible would star it too (a task argument), as ********; <redacted> says the module took it out itself,
    # as it must for a signed state's secrets, which are no task argument.
    name = f"{prefix}-prints"
    result = never_ready(host, images, name, secret_env={"STANDIN_MODEL": SECRET})

    assert result["failed"] is True and result["check"] == "readiness"
    assert "serving '<redacted>'" in result["msg"], result["msg"]
    assert SECRET not in json.dumps(result)


# --- drain-then-replace -------------------------------------------------------------------------------------


def test_drain_then_replace_lets_eight_slow_requests_finish_before_the_aborting_engine_stops(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-drain"
    first, _applied = host.started(images, name, "vllm", model={"name": "tiny"}, served_model_name="tiny-chat")
    # vLLM aborts requests in flight on SIGTERM: only the drain keeps these 8 (4 running, 4 queued) alive. They
    # last long enough for the start of the apply run to come first on a loaded 2-core machine (3 s did not).
    threads, outcomes = hold_requests(first["port"], 8, seconds=12)
    stop = threading.Event()
    seen: list[float] = []
    watcher = threading.Thread(target=watch_mark, args=(host.state_dir / "draining" / f"{name}.json", stop, seen))
    watcher.start()
    try:
        result = host.play([("apply", {**first, "served_model_name": "renamed", "drain_timeout": 60}, False)])["apply"]
    finally:
        stop.set()
        watcher.join()
        for thread in threads:
            thread.join(timeout=60)

    assert not result.get("failed"), result.get("msg")
    assert result["done"] == IN_PLACE
    assert [status for status, _at in outcomes] == [200] * 8
    assert seen, "the engine was never marked draining"
    assert seen[0] < max(at for _status, at in outcomes), "marked draining only after the requests finished"
    assert not (host.state_dir / "draining" / f"{name}.json").exists()
    assert "renamed" in host.container(name).attrs["Args"]


def test_drain_timeout_fails_and_leaves_the_old_engine_running_and_serving(
    host: Host, images: dict[str, LocalImage], prefix: str
) -> None:
    name = f"{prefix}-stuck"
    first, applied = host.started(images, name, "vllm", model={"name": "tiny"}, served_model_name="tiny-chat")
    with stuck_requests(host, applied["container"]["id"], first["port"], 2) as outcomes:
        result = host.play([("apply", {**first, "served_model_name": "renamed", "drain_timeout": 2}, False)])["apply"]
        container = host.container(name)
        assert container.id == applied["container"]["id"]
        assert container.status == "running"

    assert result["failed"] is True
    assert result["check"] == "drain"
    assert "drain timed out after 2s" in result["msg"]
    assert "left running" in result["msg"]
    assert result["done"] == []
    assert [c.name for c in host.client.containers.list(all=True, filters={"name": name})] == [name]
    assert [status for status, _at in outcomes] == [200, 200]
    assert not (host.state_dir / "draining" / f"{name}.json").exists(), "a still-serving engine stayed marked"


# --- host settings: restart policy, /dev/shm, IPC, ulimits, read-only volumes, labels ------------------------

MIB = 1024 * 1024


def widen_policy(host: Host, **engines: Any) -> None:
    """Give ``host`` the harness's policy plus ``engines`` settings (allowed volume sources, host IPC)."""
    host.policy = standin_policy(
        host.root / f"policy-{secrets.token_hex(3)}", Host.DRIVERS, store={"path": str(host.store)}, **engines
    )


def wait_for(container: Any, what: str, done: Any, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        container.reload()
        if done(container):
            return
        time.sleep(0.2)
    pytest.fail(f"container {container.name}: {what} did not happen within {deadline_s:g}s ({container.status})")


def in_container(container: Any, code: str) -> str:
    exit_code, output = container.exec_run(["python3", "-c", code])
    return f"{exit_code}:{output.decode().strip()}"


def test_host_settings_reach_the_container_and_docker_restarts_a_crashed_engine_by_itself(
    host: Host, images: dict[str, LocalImage], prefix: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    (data / "tok").mkdir(parents=True)
    (data / "tok" / "vocab.txt").write_text("hello")
    widen_policy(host, allowed_volume_sources=[str(data)])
    name = f"{prefix}-host"
    spec = host.engine(
        images,
        name,
        "sglang",
        model={"artifact": "tiny"},
        # memlock -1 as NVIDIA recommends needs CAP_SYS_RESOURCE, which this test host's dockerd lacks
        ulimits={"stack": 67108864, "nofile": {"soft": 4096, "hard": 8192}},
        volumes=[{"source": str(data / "tok"), "target": "/data/tok"}],
        labels={"com.example.team": "search"},
    )
    results = host.play(four_steps(spec))

    assert_four_steps(results, ["create", "start", "wait-ready"])
    after = results["check"]["diff"]["after"]["spec"]
    assert (after["restart_policy"], after["ipc_mode"], after["labels"]) == (
        "unless-stopped",
        "private",
        {"com.example.team": "search"},
    )
    container = host.container(name)
    config = container.attrs["HostConfig"]
    assert config["RestartPolicy"]["Name"] == "unless-stopped"
    assert (config["IpcMode"], config["ShmSize"]) == ("private", 32768 * MIB), "the sglang driver's /dev/shm"
    assert config["Ulimits"] == [
        {"Name": "nofile", "Soft": 4096, "Hard": 8192},
        {"Name": "stack", "Soft": 67108864, "Hard": 67108864},
    ]
    assert {"Type": "bind", "Source": str(data / "tok"), "Target": "/data/tok", "ReadOnly": True} in config["Mounts"]
    assert container.labels["com.example.team"] == "search"
    # What the engine sees: the limits, the /dev/shm size, a volume it can read and cannot write. The limits are
    # read off PID 1, the container's own process: a `docker exec`'d one gets its RLIMIT_NOFILE from runc exec,
    # which now and then raises the soft limit to the hard one (runc built with Go 1.19+: opencontainers/runc#4195,
    # fixed in 1.1.13; Debian 12 ships 1.1.5), a runc race and not what the engine runs with.
    limits = "import resource as r; print(r.prlimit(1, r.RLIMIT_NOFILE), r.prlimit(1, r.RLIMIT_STACK))"
    assert in_container(container, limits) == "0:(4096, 8192) (67108864, 67108864)"
    shm = "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)"
    assert in_container(container, shm) == f"0:{32768 * MIB}"
    assert in_container(container, "print(open('/data/tok/vocab.txt').read())") == "0:hello"
    assert in_container(container, "open('/data/tok/x', 'w')").startswith("1:")
    assert not (data / "tok" / "x").exists()

    # The engine crashes: Docker starts it again by itself, and the next converge finds nothing to do.
    container.exec_run(["sh", "-c", "kill -9 -1"])
    wait_for(container, "a restart", lambda c: c.attrs["RestartCount"] >= 1 and c.status == "running")
    again = host.play([("apply", spec, False)])["apply"]
    assert again["changed"] is False and again["container"]["id"] == container.id, again

    # A changed restart policy replaces the engine, drained first; the same spec again changes nothing.
    results = host.play(four_steps({**spec, "restart_policy": "on-failure"}))
    assert_four_steps(results, IN_PLACE)
    replaced = host.container(name)
    assert replaced.id != container.id
    assert replaced.attrs["HostConfig"]["RestartPolicy"]["Name"] == "on-failure"

    # Stopped on purpose (as a drain stops it), it stays stopped: the restart policy respects it.
    stopped = host.play([("stop", {**spec, "restart_policy": "on-failure", "state": "stopped"}, False)])["stop"]
    assert stopped["done"] == ["stop"], stopped
    time.sleep(3)
    replaced.reload()
    assert replaced.status == "exited" and replaced.attrs["RestartCount"] == 0


def test_host_ipc_runs_only_where_the_policy_allows_it(host: Host, images: dict[str, LocalImage], prefix: str) -> None:
    name = f"{prefix}-ipc"
    spec = host.engine(images, name, "vllm", model={"name": "m"})
    refused = host.play([("check", {**spec, "ipc_mode": "host"}, True), ("apply", {**spec, "ipc_mode": "host"}, False)])
    for label in ("check", "apply"):
        assert refused[label]["failed"] is True and refused[label]["check"] == "policy-ipc", refused[label]
        assert "engines.allow_host_ipc is false" in refused[label]["msg"]
    assert host.container(name) is None

    widen_policy(host, allow_host_ipc=True)
    results = host.play(four_steps({**spec, "policy": str(host.policy), "ipc_mode": "host"}))
    assert_four_steps(results, ["create", "start", "wait-ready"])
    assert host.container(name).attrs["HostConfig"]["IpcMode"] == "host"


def test_volumes_outside_the_policy_or_leading_out_of_it_create_nothing(
    host: Host, images: dict[str, LocalImage], prefix: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "innocent").symlink_to("/etc")
    name = f"{prefix}-vol"
    spec = host.engine(images, name, "vllm", model={"name": "m"})
    cases = {
        "no sources allowed": ({"source": str(data), "target": "/d"}, "policy-volume", "sources is empty"),
        "the docker socket": ({"source": "/var/run/docker.sock", "target": "/s"}, "spec", "overlaps /var/run"),
        "a symlink to /etc": ({"source": str(data / "innocent"), "target": "/e"}, "volume", "resolves to '/etc'"),
    }
    for case, (volume, check, words) in cases.items():
        if check == "volume":
            widen_policy(host, allowed_volume_sources=[str(data)])
        asked = {**spec, "policy": str(host.policy), "volumes": [volume]}
        results = host.play([("check", asked, True), ("apply", asked, False)])
        for label in ("check", "apply"):
            assert results[label]["failed"] is True, (case, results[label])
            assert results[label]["check"] == check, (case, results[label]["msg"])
            assert words in results[label]["msg"], case
    assert host.container(name) is None

"""The whole loop with a real inference engine: Debian's llama-server (tests/support/llamacpp_image.py) serving
random-weight GGUF models written here (tests/support/gguf_models.py), published as signed artifacts through
the devserver process, verified and promoted by the agent's real ansible-runner run, and started by
``engine_set`` with the unchanged ``llamacpp`` driver.

- A published model is verified, promoted, served, and answers real completions and chat completions at the
  address the serving projection gives.
- A replace while real generations are in flight: the drain waits on llama-server's own gauges, every request
  ends with 200, and the old engine is sent SIGTERM only after the last one ended.
- A model whose bytes are not the signed ones (corrupt, truncated) is refused by the artifact chain and nothing
  is promoted or started; a model that is signed but is no model gets as far as the engine, which exits, and
  the readiness failure says why in llama-server's own words.
- SIGTERM with requests in flight, no drain: what llama-server does is measured and must be what the driver
  declares (``EngineFacts.sigterm``, ``stop_timeout_s``); the readiness and gauge facts are checked on the way.

The image (about 125 MB, cached per machine) and the models are shared by the whole session; only the drain
and stop tests use the slow model. The session prints how the image was built and ``llama-server --version``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    ProbeVerdict,
    SigtermBehaviour,
    get_driver,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import (
    container_settings,
    probe_readiness,
    read_in_flight,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import parse_engine_spec
from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer
from ansible_collections.meridian.node.tests.support.e2e_env import (
    BIND,
    E2ENode,
    applied,
    container_named,
    free_engine_port,
    last_observation,
    serving,
)
from ansible_collections.meridian.node.tests.support.gguf_models import (
    GgufModel,
    artifact_ref,
    write_not_a_model,
)
from ansible_collections.meridian.node.tests.support.llamacpp_image import (
    LABEL_SERVER_VERSION,
    PINNED_VERSION,
    LlamaCppImage,
    LlamaCppImageError,
    LlamaCppUnavailable,
    choose_suite,
    report,
)
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import SigningKey, make_key
from meridian_node_agent.agent_side.cycle import CycleOutcome, CycleStatus
from meridian_node_agent.apply.applier import ApplyResult

# The engine image under a repository of its own, as e2e_env does for the stand-in: the policy allows only it,
# so the reconcile playbook's pruning never reaches another suite's engines on a shared Docker Engine.
LLAMA_REPOSITORY = "meridian-node/e2e-llamacpp"
SLOTS = 4  # llama-server's default --parallel: requests beyond it wait (llamacpp:requests_deferred)
REQUEST_TIMEOUT_S = 300
# How long the drain test's requests should run: long enough that the agent's cycle reaches the drain while
# they are in flight, on a fast machine and on a busy one. The token count is scaled to this machine's measured
# speed, and the time to how long the first apply took here (measured on two busy cores: the second cycle marks
# the old engine draining 5-10 s after the requests start, about 1.3 times the first apply).
IN_FLIGHT_MIN_S = 10
IN_FLIGHT_PER_APPLY_S = 2.5
LIVENESS_S = 60

# -- the pin (no Docker, no network) ------------------------------------------------------------------------


def test_the_first_suite_that_carries_the_pin_is_chosen() -> None:
    carried = {"forky": "1:0.6.0-1", "sid": PINNED_VERSION}
    assert choose_suite(carried) == "sid"
    assert choose_suite({"forky": PINNED_VERSION, "sid": PINNED_VERSION}) == "forky"


def test_a_pin_gone_from_the_mirror_fails_naming_what_the_mirror_carries_and_what_to_change() -> None:
    carried: dict[str, str | Exception | None] = {"forky": "1:0.8.0-1", "sid": None}
    with pytest.raises(LlamaCppImageError) as gone:
        choose_suite(carried)
    assert not isinstance(gone.value, LlamaCppUnavailable), "a moved pin must fail, never skip"
    message = str(gone.value)
    assert PINNED_VERSION in message and "forky 1:0.8.0-1" in message and "sid has no llama.cpp-tools" in message
    assert "PINNED_VERSION in tests/support/llamacpp_image.py" in message


def test_an_unreachable_mirror_is_the_one_reason_to_skip() -> None:
    down = LlamaCppUnavailable("cannot read the package index: timed out")
    with pytest.raises(LlamaCppUnavailable, match="no Debian suite"):
        choose_suite({"forky": down, "sid": down})


# -- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(docker_client: Any, llamacpp_image: LlamaCppImage) -> Iterator[LocalImage]:
    """The llama.cpp image under ``LLAMA_REPOSITORY`` with a tag of this module's own (removed afterwards:
    a concurrent session's engines keep theirs)."""
    tag = f"{llamacpp_image.image.tag.rsplit(':', 1)[1]}-{secrets.token_hex(4)}"
    docker_client.images.get(llamacpp_image.image.id).tag(LLAMA_REPOSITORY, tag=tag)
    tagged = LocalImage(tag=f"{LLAMA_REPOSITORY}:{tag}", id=llamacpp_image.image.id)
    try:
        yield tagged
    finally:
        docker_client.images.remove(tagged.tag)


@dataclass(frozen=True)
class LlamaNode:
    """The test's node (``node``), let run the llama.cpp image with the llamacpp driver and trust ``key`` for artifact
    manifests; its desired states are published through the module's devserver, its engine is called ``name``."""

    server: DevServer
    node_id: str
    node: E2ENode
    image: LocalImage
    key: SigningKey
    name: str

    def allow(self, sources: list[Path]) -> None:
        """Let the node run the llama.cpp image with the llamacpp driver, trust ``key`` for artifact manifests and
        fetch artifacts from ``sources``; the stand-in's bind address and port range stay."""
        root = self.node.node.root
        path = root / "policy.yaml"
        policy = yaml.safe_load(path.read_text())
        (root / "keys" / "artifact.pem").write_bytes(self.key.public_pem)
        policy["trust"]["artifact"] = {"threshold": 1, "public_keys": ["keys/artifact.pem"]}
        policy["store"]["local_sources"] = [str(source) for source in sources]
        policy["images"] = {"allowed_repositories": [LLAMA_REPOSITORY], "require_digest": True}
        policy["engines"]["allowed_drivers"] = ["llamacpp"]
        path.write_text(yaml.safe_dump(policy, sort_keys=False))

    def engine(self, port: int, artifact: str, **overrides: Any) -> dict[str, Any]:
        """The engine ``name`` as a desired state lists it: llama-server on ``port`` serving ``artifact``."""
        return {
            "name": self.name,
            "driver": "llamacpp",
            "image": self.image.pinned,
            "model": {"artifact": artifact},
            "served_model_name": artifact,
            "port": port,
            **overrides,
        }

    def publish(self, artifacts: list[dict[str, Any]], engine: dict[str, Any]) -> int:
        """Publish a state of ``artifacts`` and the one ``engine`` to the node; its generation."""
        return publish(self.server, self.node_id, document={"artifacts": artifacts, "engines": [engine]})


@pytest.fixture
def llama_node(server: DevServer, node_id: str, node: E2ENode, llama: LocalImage, prefix: str) -> LlamaNode:
    return LlamaNode(server, node_id, node, llama, make_key(), f"{prefix}-llama")


def _apply_failed(outcome: CycleOutcome, generation: int) -> ApplyResult:
    """The run of a cycle that must have failed to apply ``generation``."""
    assert (outcome.outcome, outcome.generation) == (CycleStatus.APPLY_FAILED, generation)
    assert outcome.run is not None
    return outcome.run


def _post(address: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{address}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        document: dict[str, Any] = json.loads(answer.read())
        return int(answer.status), document


def _generate(address: str, model: str, tokens: int, outcomes: list[Any]) -> None:
    """One completion of exactly ``tokens`` tokens (EOS ignored); appends (status, tokens, end time) or the
    error, with the time it came."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True}
    try:
        status, document = _post(address, "/v1/completions", body)
        outcomes.append((status, document["usage"]["completion_tokens"], time.time()))
    except Exception as exc:  # the outcome is what the test asserts on
        outcomes.append((repr(exc), None, time.time()))


def _in_threads(count: int, address: str, model: str, tokens: int) -> tuple[list[threading.Thread], list[Any]]:
    outcomes: list[Any] = []
    threads = [threading.Thread(target=_generate, args=(address, model, tokens, outcomes)) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, outcomes


def _wait_in_flight(address: str, count: int) -> tuple[float, float]:
    """Wait until llama-server's own gauges count ``count`` requests; returns (running, waiting)."""
    driver, (host, port) = get_driver("llamacpp"), _split(address)
    deadline = time.monotonic() + LIVENESS_S  # a liveness limit, not a speed target
    while time.monotonic() < deadline:
        gauges = read_in_flight(driver, host, port)
        if gauges is not None and gauges.total == count:
            return gauges.running or 0.0, gauges.waiting or 0.0
        time.sleep(0.05)
    raise AssertionError(f"llama-server never counted {count} requests in flight (last: {gauges})")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _calibrated_tokens(address: str, model: str, target_s: float) -> int:
    """Tokens per request that keep ``SLOTS`` requests busy for about ``target_s`` here, from a short batch of
    the same shape (a machine twice as fast gets twice the tokens)."""
    sample = 32
    started = time.monotonic()
    threads, outcomes = _in_threads(SLOTS, address, model, sample)
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert [o[0] for o in outcomes] == [200] * SLOTS, outcomes
    per_second = SLOTS * sample / (time.monotonic() - started)
    # The shared KV cache holds the model's context (8192) for all slots together.
    return max(128, min(1800, int(target_s * per_second / SLOTS)))


def _docker_events(client: Any, container_id: str, since: float) -> list[dict[str, Any]]:
    """Docker's own record of what happened to the container since ``since`` (kill signals, die exit codes)."""
    events = client.events(
        since=int(since), until=int(time.time()) + 1, filters={"container": container_id}, decode=True
    )
    return list(events)


# -- the whole loop -----------------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.slow
def test_published_gguf_is_verified_promoted_served_and_answers_through_the_serving_address(
    server: DevServer,
    node_id: str,
    node: E2ENode,
    llama_node: LlamaNode,
    docker_client: Any,
    llamacpp_image: LlamaCppImage,
    tiny_gguf: GgufModel,
    prefix: str,
    request: pytest.FixtureRequest,
) -> None:
    llama_node.allow([tiny_gguf.path.parent])
    name, port = llama_node.name, free_engine_port()
    ref = artifact_ref(tiny_gguf, llama_node.key, name="tiny-llama")
    started = time.monotonic()
    generation = llama_node.publish([ref], llama_node.engine(port, "tiny-llama"))
    agent = node.agent()

    outcome = applied(agent)
    ready_s = time.monotonic() - started

    report(request, f"publish -> verified, promoted, llama-server ready: {ready_s:.1f} s (tiny model, one cycle)")
    assert outcome.generation == generation
    promoted = node.node.root / "store" / "artifacts" / "tiny-llama" / "1.0.0" / tiny_gguf.path.name
    assert hashlib.sha256(promoted.read_bytes()).hexdigest() == tiny_gguf.sha256
    container = container_named(docker_client, name)
    assert container is not None and container.status == "running"
    assert container.labels[LABEL_SERVER_VERSION] == llamacpp_image.server_version
    assert container.attrs["Config"]["Entrypoint"] == ["/usr/bin/llama-server"]
    [endpoint] = serving(node, prefix)
    assert endpoint == {
        "node_id": node_id,
        "engine": name,
        "driver": "llamacpp",
        "served_model_name": "tiny-llama",
        "address": f"{BIND}:{port}",
    }
    address = endpoint["address"]

    status, completion = _post(
        address, "/v1/completions", {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    )
    assert status == 200
    assert completion["model"] == "tiny-llama" and completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == 8
    assert isinstance(completion["choices"][0]["text"], str)
    status, chat = _post(
        address,
        "/v1/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "ignore_eos": True},
    )
    assert status == 200
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 8
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as answer:
        assert [m["id"] for m in json.loads(answer.read())["data"]] == ["tiny-llama"]
    observed = last_observation(server, node_id)
    assert observed is not None
    engines = {e["name"]: e for e in observed["engines"]}
    assert (engines[name]["driver"], engines[name]["ready"], engines[name]["managed"]) == ("llamacpp", True, True)


@pytest.mark.docker
@pytest.mark.slow
def test_replace_while_real_generations_are_in_flight_drains_on_the_engines_own_gauges(
    node: E2ENode,
    llama_node: LlamaNode,
    docker_client: Any,
    slow_gguf: GgufModel,
    prefix: str,
    request: pytest.FixtureRequest,
) -> None:
    llama_node.allow([slow_gguf.path.parent])
    name, port = llama_node.name, free_engine_port()
    ref = artifact_ref(slow_gguf, llama_node.key, name="slow-llama")
    # One thread: slower tokens, and no contention with whatever else this machine runs.
    first = llama_node.engine(port, "slow-llama", args=["--threads", "1"])
    llama_node.publish([ref], first)
    agent = node.agent()
    started = time.monotonic()
    applied(agent)
    target_s = max(IN_FLIGHT_MIN_S, IN_FLIGHT_PER_APPLY_S * (time.monotonic() - started))
    old = container_named(docker_client, name)
    address = f"{BIND}:{port}"
    tokens = _calibrated_tokens(address, "slow-llama", target_s)
    changed = {**first, "args": ["--threads", "2"], "replace_strategy": "drain-then-replace"}
    generation = llama_node.publish([ref], changed)

    since = time.time()
    threads, outcomes = _in_threads(SLOTS, address, "slow-llama", tokens)
    _wait_in_flight(address, SLOTS)
    marked: list[tuple[float, float | None]] = []  # (when the draining mark appeared, the gauges then)
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_mark, args=(node.state_dir / "draining" / f"{name}.json", address, stop, marked)
    )
    watcher.start()
    try:
        outcome = applied(agent)
    finally:
        stop.set()
        watcher.join(timeout=30)
        for thread in threads:
            thread.join(timeout=REQUEST_TIMEOUT_S)

    ended = [at for _status, _tokens, at in outcomes]
    report(
        request,
        f"drain under load: {SLOTS} requests of {tokens} tokens (aiming at {target_s:.0f} s), in flight when marked: "
        f"{marked[0][1] if marked else None} (marked {marked[0][0] - since if marked else float('nan'):.1f} s after "
        f"they started), all ended {max(ended) - since:.1f} s after they started",
    )
    assert outcome.generation == generation
    assert [(status, got) for status, got, _at in outcomes] == [(200, tokens)] * SLOTS, outcomes
    assert marked, "the old engine was never marked draining"
    assert marked[0][1] is not None and marked[0][1] > 0, "nothing was in flight when the drain began"
    assert all(at > marked[0][0] for at in ended), "a request ended before the drain began"
    # Docker's record: SIGTERM only after the last request ended, and the idle server then exited by itself.
    events = _docker_events(docker_client, old.id, since)
    kills = [e for e in events if e["Action"] == "kill"]
    assert kills, events
    assert kills[0]["timeNano"] / 1e9 >= max(ended) - 0.05, "the old engine was stopped with work in flight"
    assert [e["Actor"]["Attributes"]["signal"] for e in kills] == ["15"], "it needed more than SIGTERM"
    [died] = [e for e in events if e["Action"] == "die"]
    assert died["Actor"]["Attributes"]["exitCode"] == "0"
    new = container_named(docker_client, name)
    assert new is not None and new.id != old.id and new.status == "running"
    assert "--threads" in new.attrs["Args"] and new.attrs["Args"][new.attrs["Args"].index("--threads") + 1] == "2"
    assert not (node.state_dir / "draining" / f"{name}.json").exists()
    assert [e["engine"] for e in serving(node, prefix)] == [name]


def _watch_mark(mark: Path, address: str, stop: threading.Event, marked: list[tuple[float, float | None]]) -> None:
    driver, (host, port) = get_driver("llamacpp"), _split(address)
    while not stop.is_set() and not marked:
        if mark.exists():
            gauges = read_in_flight(driver, host, port)
            marked.append((time.time(), None if gauges is None else gauges.total))
            return
        time.sleep(0.02)


# -- models the chain or the engine refuses -----------------------------------------------------------------


def _failed_items(journal: Path) -> list[str]:
    """The messages of the loop items that failed in one run, from its ansible-runner journal."""
    events = [json.loads(path.read_text()) for path in (journal / "job_events").glob("*.json")]
    return [
        str((event["event_data"].get("res") or {}).get("msg"))
        for event in sorted(events, key=lambda event: int(event["counter"]))
        if event["event"] == "runner_item_on_failed"
    ]


def _damage(model: GgufModel, destination: Path, how: str) -> Path:
    destination.mkdir(parents=True)
    target = destination / model.path.name
    shutil.copyfile(model.path, target)
    data = bytearray(target.read_bytes())
    if how == "corrupt":
        data[len(data) // 2] ^= 0xFF  # one bit pattern changed, the size kept
    else:
        del data[len(data) // 2 :]
    target.write_bytes(bytes(data))
    return destination


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "reason"),
    [
        pytest.param("corrupt", "sha256 is ", id="corrupt"),
        pytest.param("truncated", "the source ended after ", id="truncated"),
    ],
)
def test_a_gguf_that_is_not_the_signed_bytes_is_refused_and_nothing_is_promoted_or_started(
    tmp_path: Path,
    node: E2ENode,
    llama_node: LlamaNode,
    docker_client: Any,
    tiny_gguf: GgufModel,
    prefix: str,
    how: str,
    reason: str,
) -> None:
    source = _damage(tiny_gguf, tmp_path / "models" / how, how)
    llama_node.allow([source])
    # The manifest is the real model's, signed: only the bytes at the source are wrong.
    ref = artifact_ref(tiny_gguf, llama_node.key, name="tiny-llama", source=source)
    generation = llama_node.publish([ref], llama_node.engine(free_engine_port(), "tiny-llama"))

    run = _apply_failed(node.agent().cycle(), generation)

    # verified_artifact runs in a loop: its reason is the failed item's message (the run's summary says only
    # "One or more items failed").
    [failure] = _failed_items(run.journal)
    assert f"{tiny_gguf.path.name!r} from {source / tiny_gguf.path.name} does not match the signed manifest" in failure
    assert reason in failure and "nothing was promoted" in failure, failure
    artifacts = node.node.root / "store" / "artifacts"
    assert not (artifacts / "tiny-llama").exists() or not any((artifacts / "tiny-llama").iterdir())
    assert container_named(docker_client, llama_node.name) is None
    assert serving(node, prefix) == []


@pytest.mark.docker
@pytest.mark.slow
def test_a_signed_file_that_is_no_model_exits_the_engine_and_the_readiness_failure_quotes_llama_server(
    tmp_path: Path, node: E2ENode, llama_node: LlamaNode, docker_client: Any, prefix: str
) -> None:
    garbage = write_not_a_model(tmp_path / "models" / "garbage", seed=1)
    llama_node.allow([garbage.path.parent])
    ref = artifact_ref(garbage, llama_node.key, name="garbage-llama")
    generation = llama_node.publish([ref], llama_node.engine(free_engine_port(), "garbage-llama"))

    run = _apply_failed(node.agent().cycle(), generation)

    failure = "\n".join(run.failures)
    # The chain accepted it (signed, the right bytes): the engine is what refused it, in its own words.
    promoted = node.node.root / "store" / "artifacts" / "garbage-llama" / "1.0.0" / garbage.path.name
    assert promoted.read_bytes() == garbage.path.read_bytes()
    assert "exited" in failure and "before it became ready" in failure, failure
    assert "failed to load model" in failure, failure
    assert "exiting due to model loading error" in failure, failure
    container = container_named(docker_client, llama_node.name)
    assert container is not None and container.status != "running"
    assert serving(node, prefix) == []


@pytest.mark.docker
@pytest.mark.slow
def test_a_replace_onto_a_signed_file_that_is_no_model_rolls_back_and_the_engine_that_served_keeps_serving(
    tmp_path: Path, node: E2ENode, llama_node: LlamaNode, docker_client: Any, tiny_gguf: GgufModel, prefix: str
) -> None:
    garbage = write_not_a_model(tmp_path / "models" / "garbage", seed=2)
    llama_node.allow([tiny_gguf.path.parent, garbage.path.parent])
    name, port, key = llama_node.name, free_engine_port(), llama_node.key
    good, bad = artifact_ref(tiny_gguf, key, name="tiny-llama"), artifact_ref(garbage, key, name="garbage-llama")
    llama_node.publish([good], llama_node.engine(port, "tiny-llama"))
    agent = node.agent()
    applied(agent)
    before = container_named(docker_client, name)
    [endpoint] = serving(node, prefix)

    generation = llama_node.publish(
        [good, bad], llama_node.engine(port, "garbage-llama", served_model_name="tiny-llama")
    )
    run = _apply_failed(agent.cycle(), generation)

    failure = "\n".join(run.failures)
    assert "failed to load model" in failure and "Rolled back" in failure, failure
    # The engine that served before serves on, as it was: same container, same address, real answers.
    after = container_named(docker_client, name)
    assert after is not None and before is not None and after.id == before.id and after.status == "running"
    assert [c.name for c in docker_client.containers.list(all=True, filters={"name": prefix})] == [name]
    assert serving(node, prefix) == [endpoint]
    status, completion = _post(
        endpoint["address"], "/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4}
    )
    assert status == 200 and completion["model"] == "tiny-llama"


# -- SIGTERM: measured, then held against the driver's declared facts ---------------------------------------


def _observed_sigterm(outcomes: list[Any], exit_code: int, stop_s: float, timeout_s: int) -> SigtermBehaviour:
    """What the engine did with the requests in flight when stopped, in the driver's terms."""
    if all(status == 200 for status, _tokens, _at in outcomes):
        return SigtermBehaviour.FINISHES_IN_FLIGHT
    if exit_code == 137 and stop_s >= timeout_s - 0.5:
        return SigtermBehaviour.HANGS_UNTIL_KILLED
    return SigtermBehaviour.ABORTS_IN_FLIGHT


def _start_and_probe(engine: DockerEngine, container: Any, port: int) -> list[tuple[float, ProbeVerdict]]:
    """Start the container and probe it every 20 ms until ready: (seconds since start, verdict) of each probe."""
    driver = get_driver("llamacpp")
    started = time.monotonic()
    engine.start(container)
    verdicts: list[tuple[float, ProbeVerdict]] = []
    while time.monotonic() < started + LIVENESS_S:
        verdicts.append((time.monotonic() - started, probe_readiness(driver, BIND, port)))
        if verdicts[-1][1].ready:
            return verdicts
        time.sleep(0.02)
    raise AssertionError(f"never ready: {verdicts[-3:]}\n{engine.logs_tail(container)}")


@pytest.mark.docker
@pytest.mark.slow
def test_sigterm_with_requests_in_flight_does_what_the_llamacpp_driver_declares(
    docker_client: Any, llama: LocalImage, slow_gguf: GgufModel, prefix: str, request: pytest.FixtureRequest
) -> None:
    driver = get_driver("llamacpp")
    facts = driver.facts
    engine = DockerEngine.from_env()
    spec = parse_engine_spec(
        {
            "name": f"{prefix}-stop",
            "driver": "llamacpp",
            "image": llama.pinned,
            "model": {"artifact": "slow"},
            "served_model_name": "slow",
            "port": free_engine_port(),
        }
    )
    # The container engine_set would create, without the agent: this test is about the engine, not the loop.
    launch = driver.container_settings(spec, model_dir=str(slow_gguf.path.parent), model_files=[slow_gguf.path.name])
    container = engine.create(container_settings(name=spec.name, driver="llamacpp", launch=launch, bind_address=BIND))
    verdicts = _start_and_probe(engine, container, spec.port)
    ready_s = verdicts[-1][0]
    assert all(v.loading for _at, v in verdicts[:-1]), "not ready for a reason other than loading"
    loading_503 = [at for at, v in verdicts if "503 Loading model" in v.detail]
    address = f"{BIND}:{spec.port}"

    # More requests than slots, far longer than the stop timeout: the gauges count them running and waiting.
    threads, outcomes = _in_threads(SLOTS + 2, address, "slow", 1800)
    running, waiting = _wait_in_flight(address, SLOTS + 2)
    stopping = time.monotonic()
    engine.stop(container, timeout_s=launch.stop_timeout_s)
    stop_s = time.monotonic() - stopping
    exit_code = int(docker_client.api.inspect_container(container.id)["State"]["ExitCode"])
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    observed = _observed_sigterm(outcomes, exit_code, stop_s, launch.stop_timeout_s)

    # Idle, the same engine (started again) exits by itself at once.
    _start_and_probe(engine, container, spec.port)
    assert _post(address, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})[0] == 200
    idle = time.monotonic()
    engine.stop(container, timeout_s=launch.stop_timeout_s)
    idle_stop_s = time.monotonic() - idle
    idle_exit = int(docker_client.api.inspect_container(container.id)["State"]["ExitCode"])

    report(
        request,
        f"llama-server: ready {ready_s:.2f} s after start (503 Loading model seen at "
        f"{', '.join(f'{at:.2f}' for at in loading_503) or 'no probe'} s); gauges {running:g} running + "
        f"{waiting:g} waiting; SIGTERM with {SLOTS + 2} in flight: stop took {stop_s:.1f} s "
        f"(timeout {launch.stop_timeout_s} s), exit {exit_code}, clients got "
        f"{sorted({str(o[0]).split('(')[0] for o in outcomes})}; idle: exit {idle_exit} in {idle_stop_s:.2f} s",
    )
    assert (running, waiting) == (SLOTS, 2)
    assert observed is facts.sigterm, (observed, facts.sigterm_detail)
    assert not any(status == 200 for status, _tokens, _at in outcomes), outcomes
    assert (idle_exit, idle_stop_s < 2) == (0, True)
    assert launch.stop_timeout_s == facts.stop_timeout_s

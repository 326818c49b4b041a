"""Engine drivers: spec -> container settings, the engines' facts, probe reading and the metrics parser."""

from __future__ import annotations

from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils.engines import drivers as engine_drivers
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    DRIVERS,
    MODEL_MOUNT_PATH,
    DriverError,
    InFlight,
    Mount,
    OpenAIDriver,
    SigtermBehaviour,
    get_driver,
    in_flight,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.prometheus_text import MetricsFormatError
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedEngineSpec, parse_engine_spec
from ansible_collections.meridian.node.tests.support.public_api import assert_all_is_the_public_api

IMAGE = "registry.example/engines/x@sha256:" + "a" * 64
MODEL_DIR = "/var/lib/meridian/store/artifacts/llama/1.0.0"
GPU_A = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
GPU_B = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"


def spec(driver: str, **fields: Any) -> ParsedEngineSpec:
    document: dict[str, Any] = {
        "name": "chat-small",
        "driver": driver,
        "image": IMAGE,
        "model": {"artifact": "llama"},
        "port": 9001,
    }
    document.update(fields)
    return parse_engine_spec(document)


def settings(driver: str, model_files: tuple[str, ...] = ("model.gguf",), **fields: Any) -> Any:
    engine = spec(driver, **fields)
    model_dir = MODEL_DIR if engine.model.artifact is not None else None
    return get_driver(driver).container_settings(engine, model_dir=model_dir, model_files=model_files)


# -- the registry ---------------------------------------------------------------------------------------


def test_registry_has_a_driver_for_every_driver_the_contract_allows() -> None:
    assert set(DRIVERS) == set(contracts.DRIVERS)
    for name, driver_class in DRIVERS.items():
        assert driver_class.name == name


def test_each_engine_is_recognised_by_its_name_and_hints_and_no_words_name_two() -> None:
    """The Kubernetes observer's ENGINE_WORDS come from these hints: within a name the first words that match win,
    so no run of words may belong to two drivers, nor start another driver's run (then order would decide)."""
    owner: dict[tuple[str, ...], str] = {}
    for name, driver_class in DRIVERS.items():
        hints = driver_class.recognized_by()
        assert ((name,) in hints) == (name != "openai"), name
        for words in hints:
            assert owner.setdefault(words, name) == name, words
    for words, name in owner.items():
        for other, other_name in owner.items():
            if other_name != name and len(other) > len(words):
                assert other[: len(words)] != words, (words, other)


def test_unknown_driver_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(DriverError) as raised:
        get_driver("tensorrt")
    message = str(raised.value)
    assert "'tensorrt'" in message
    for name in contracts.DRIVERS:
        assert name in message


def test_all_is_the_public_api() -> None:
    assert_all_is_the_public_api(engine_drivers)


# -- the engines' facts (docs/ENGINE_DRIVERS.md says where each comes from) ------------------------------

FACTS = [
    # driver, port, health, models, running, waiting, metrics flag, sigterm
    (
        "vllm",
        8000,
        "/health",
        "/v1/models",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        None,
        SigtermBehaviour.ABORTS_IN_FLIGHT,
    ),
    (
        "tgi",
        80,
        "/health",
        "/v1/models",
        "tgi_batch_current_size",
        "tgi_queue_size",
        None,
        SigtermBehaviour.FINISHES_IN_FLIGHT,
    ),
    (
        "sglang",
        30000,
        "/health",
        "/v1/models",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "--enable-metrics",
        SigtermBehaviour.FINISHES_IN_FLIGHT,
    ),
    ("ollama", 11434, "/", "/api/tags", None, None, None, SigtermBehaviour.ABORTS_IN_FLIGHT),
    (
        "llamacpp",
        8080,
        "/health",
        "/v1/models",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "--metrics",
        SigtermBehaviour.HANGS_UNTIL_KILLED,  # measured: tests/system/e2e/test_real_engine.py
    ),
    (
        "lmdeploy",
        23333,
        "/health",
        "/v1/models",
        "lmdeploy:num_requests_running",
        "lmdeploy:num_requests_waiting",
        None,
        SigtermBehaviour.FINISHES_IN_FLIGHT,
    ),
    ("openai", 8000, "/v1/models", "/v1/models", None, None, None, SigtermBehaviour.ABORTS_IN_FLIGHT),
]


@pytest.mark.parametrize(("driver", "port", "health", "models", "running", "waiting", "flag", "sigterm"), FACTS)
def test_engine_facts_match_the_engines_documentation(
    driver: str,
    port: int,
    health: str,
    models: str,
    running: str | None,
    waiting: str | None,
    flag: str | None,
    sigterm: SigtermBehaviour,
) -> None:
    facts = get_driver(driver).facts
    assert (facts.container_port, facts.health_path, facts.model_list_path) == (port, health, models)
    assert (facts.running_metric, facts.waiting_metric, facts.metrics_flag) == (running, waiting, flag)
    assert facts.sigterm is sigterm
    assert facts.has_metrics is (running is not None)
    assert facts.stop_signal == "SIGTERM"
    if sigterm is SigtermBehaviour.HANGS_UNTIL_KILLED:
        # Nothing in flight ever finishes after SIGTERM: a long timeout would only hold the clients longer.
        assert facts.stop_timeout_s < 10, "shorter than Docker's 10 s default: waiting finishes nothing"
    else:
        assert facts.stop_timeout_s > 10, "longer than Docker's 10 s default, so the engine's own shutdown can run"


def test_tgi_stop_timeout_outlasts_its_launchers_graceful_termination_timeout() -> None:
    # text-generation-launcher waits --graceful-termination-timeout (default 90 s) for the router.
    assert get_driver("tgi").facts.stop_timeout_s > 90


# -- spec -> command line ---------------------------------------------------------------------------------

ARTIFACT_COMMANDS = [
    (
        "vllm",
        None,
        (MODEL_MOUNT_PATH, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "chat-small"),
    ),
    ("tgi", None, ("--model-id", MODEL_MOUNT_PATH, "--hostname", "0.0.0.0", "--port", "80")),
    (
        "sglang",
        None,
        (
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            MODEL_MOUNT_PATH,
            "--host",
            "0.0.0.0",
            "--port",
            "30000",
            "--served-model-name",
            "chat-small",
            "--enable-metrics",
        ),
    ),
    ("ollama", None, ("serve",)),
    (
        "llamacpp",
        None,
        (
            "-m",
            f"{MODEL_MOUNT_PATH}/model.gguf",
            "--host",
            "0.0.0.0",
            "--port",
            "8080",
            "--alias",
            "chat-small",
            "--metrics",
        ),
    ),
    (
        "lmdeploy",
        None,
        (
            "lmdeploy",
            "serve",
            "api_server",
            MODEL_MOUNT_PATH,
            "--server-name",
            "0.0.0.0",
            "--server-port",
            "23333",
            "--model-name",
            "chat-small",
        ),
    ),
    ("openai", None, ()),
]


@pytest.mark.parametrize(("driver", "entrypoint", "command"), ARTIFACT_COMMANDS)
def test_artifact_spec_becomes_the_engines_command_line(
    driver: str, entrypoint: tuple[str, ...] | None, command: tuple[str, ...]
) -> None:
    result = settings(driver)
    assert result.image == IMAGE
    assert result.entrypoint == entrypoint, "the image's own entrypoint is kept"
    assert result.command == command


NAMED_COMMANDS = [
    ("vllm", ("Qwen/Qwen3-0.6B", "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "Qwen/Qwen3-0.6B")),
    ("tgi", ("--model-id", "Qwen/Qwen3-0.6B", "--hostname", "0.0.0.0", "--port", "80")),
    ("llamacpp", ("-hf", "Qwen/Qwen3-0.6B", "--host", "0.0.0.0", "--port", "8080", "--alias", "Qwen/Qwen3-0.6B")),
    ("ollama", ("serve",)),
]


@pytest.mark.parametrize(("driver", "prefix"), NAMED_COMMANDS)
def test_model_name_spec_is_passed_by_name_and_mounts_nothing(driver: str, prefix: tuple[str, ...]) -> None:
    result = settings(driver, model={"name": "Qwen/Qwen3-0.6B"})
    assert result.command[: len(prefix)] == prefix
    assert result.mounts == ()
    assert "OLLAMA_MODELS" not in result.environment


def test_served_model_name_wins_over_model_and_engine_names() -> None:
    result = settings("vllm", model={"name": "Qwen/Qwen3-0.6B"}, served_model_name="chat")
    assert result.command[result.command.index("--served-model-name") + 1] == "chat"


@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_artifact_is_mounted_read_only_at_the_fixed_path(driver: str) -> None:
    result = settings(driver)
    assert result.mounts == (Mount(source=MODEL_DIR, target=MODEL_MOUNT_PATH, read_only=True),)


def test_ollama_serves_an_artifact_from_its_read_only_mount_without_pruning_it() -> None:
    result = settings("ollama")
    assert result.environment["OLLAMA_MODELS"] == MODEL_MOUNT_PATH
    assert result.environment["OLLAMA_NOPRUNE"] == "1"
    assert result.environment["OLLAMA_HOST"] == "0.0.0.0:11434"


@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_ports_stop_signal_and_timeout_come_from_the_driver(driver: str) -> None:
    result = settings(driver)
    facts = get_driver(driver).facts
    assert (result.container_port, result.host_port) == (facts.container_port, 9001)
    assert (result.stop_signal, result.stop_timeout_s) == (facts.stop_signal, facts.stop_timeout_s)


def test_generic_driver_runs_the_spec_args_as_the_whole_command() -> None:
    result = settings("openai", args=["--model", MODEL_MOUNT_PATH, "--port", "8000"])
    assert result.command == ("--model", MODEL_MOUNT_PATH, "--port", "8000")


def test_extra_args_follow_the_drivers_own_flags() -> None:
    result = settings("vllm", args=["--max-model-len", "4096"])
    assert result.command[-2:] == ("--max-model-len", "4096")


@pytest.mark.parametrize(("driver", "flag"), [("llamacpp", "--metrics"), ("sglang", "--enable-metrics")])
def test_metrics_flag_is_switched_on_once(driver: str, flag: str) -> None:
    assert settings(driver).command.count(flag) == 1
    assert settings(driver, args=[flag]).command.count(flag) == 1


# -- GPU selection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [[GPU_A], ["0"], [MIG], [GPU_A, GPU_B], ["0", "3"]])
@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_gpus_are_requested_by_the_ids_the_spec_names(driver: str, gpus: list[str]) -> None:
    result = settings(driver, gpus=gpus)
    assert result.gpu_device_ids == tuple(gpus)
    assert result.environment["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpus)


@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_engine_without_gpus_sees_none_even_if_its_image_says_all(driver: str) -> None:
    result = settings(driver)
    assert result.gpu_device_ids == ()
    assert result.environment["NVIDIA_VISIBLE_DEVICES"] == "void"


@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_spec_env_cannot_widen_gpu_visibility(driver: str) -> None:
    with pytest.raises(DriverError, match="NVIDIA_VISIBLE_DEVICES"):
        settings(driver, gpus=["0"], env={"NVIDIA_VISIBLE_DEVICES": "all"})


TENSOR_PARALLEL = [
    ("vllm", ("--tensor-parallel-size", "2")),
    ("tgi", ("--num-shard", "2")),
    ("sglang", ("--tp-size", "2")),
    ("lmdeploy", ("--tp", "2")),
]


@pytest.mark.parametrize(("driver", "flag"), TENSOR_PARALLEL)
def test_two_whole_gpus_split_the_model_across_both(driver: str, flag: tuple[str, ...]) -> None:
    command = settings(driver, gpus=[GPU_A, GPU_B]).command
    index = command.index(flag[0])
    assert command[index : index + 2] == flag


@pytest.mark.parametrize(("driver", "flag"), TENSOR_PARALLEL)
def test_tensor_parallel_is_not_added_for_one_gpu_mig_devices_or_when_args_set_it(
    driver: str, flag: tuple[str, ...]
) -> None:
    assert flag[0] not in settings(driver, gpus=[GPU_A]).command
    assert flag[0] not in settings(driver, gpus=[MIG, MIG.replace("5c", "6d")]).command
    chosen = settings(driver, gpus=[GPU_A, GPU_B], args=[f"{flag[0]}=1"]).command
    assert chosen.count(f"{flag[0]}=1") == 1
    assert flag[0] not in chosen


# -- host settings: restart policy, /dev/shm, IPC, ulimits, volumes --------------------------------------

# driver, /dev/shm MiB when the spec sets none (sources: docs/ENGINE_DRIVERS.md)
SHM_DEFAULTS: list[tuple[str, int | None]] = [("vllm", 10240), ("sglang", 32768), ("tgi", 1024), ("lmdeploy", 10240)]
SHM_DEFAULTS += [(driver, None) for driver in ("llamacpp", "ollama", "openai")]


@pytest.mark.parametrize(("driver", "shm"), SHM_DEFAULTS)
def test_drivers_give_the_shared_memory_their_engines_docs_call_for(driver: str, shm: int | None) -> None:
    result = settings(driver)
    assert result.shm_size_mib == shm
    # No driver raises a limit: a Docker Engine without CAP_SYS_RESOURCE could not start the engine.
    assert (result.restart_policy, result.ipc_mode, result.ulimits) == ("unless-stopped", "private", ())


@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_the_specs_host_settings_win_over_the_drivers(driver: str) -> None:
    limits_asked = {"stack": 8388608, "nofile": {"soft": 1, "hard": 2}}
    result = settings(driver, restart_policy="on-failure", shm_size_mib=2048, ulimits=limits_asked)
    assert (result.restart_policy, result.shm_size_mib) == ("on-failure", 2048)
    limits = {name: (soft, hard) for name, soft, hard in result.ulimits}
    assert limits["stack"] == (8388608, 8388608) and limits["nofile"] == (1, 2)
    assert [name for name, _soft, _hard in result.ulimits] == sorted(limits), "sorted by name: a stable hash"


def test_nvidias_recommended_limits_pass_through_as_soft_and_hard() -> None:
    result = settings("sglang", ulimits={"stack": 67108864, "memlock": -1})
    assert result.ulimits == (("memlock", -1, -1), ("stack", 67108864, 67108864))


@pytest.mark.parametrize("driver", ["vllm", "sglang", "tgi", "lmdeploy"])
def test_host_ipc_uses_the_hosts_dev_shm_so_no_size_is_set(driver: str) -> None:
    result = settings(driver, ipc_mode="host")
    assert (result.ipc_mode, result.shm_size_mib) == ("host", None)


@pytest.mark.parametrize("driver", sorted(contracts.DRIVERS))
def test_volumes_are_mounted_read_only_after_the_model(driver: str) -> None:
    result = settings(
        driver, volumes=[{"source": "/srv/tok", "target": "/data/tok"}, {"source": "/srv/t.jinja", "target": "/t"}]
    )
    assert result.mounts == (
        Mount(source=MODEL_DIR, target=MODEL_MOUNT_PATH, read_only=True),
        Mount(source="/srv/tok", target="/data/tok", read_only=True),
        Mount(source="/srv/t.jinja", target="/t", read_only=True),
    )


# -- refusals ---------------------------------------------------------------------------------------------

OWNED = [
    ("vllm", ["--port", "9999"], "--port"),
    ("vllm", ["--served-model-name=other"], "--served-model-name"),
    ("tgi", ["--model-id", "gpt2"], "--model-id"),
    ("sglang", ["--host=127.0.0.1"], "--host"),
    ("llamacpp", ["-m", "/tmp/other.gguf"], "-m"),
    ("lmdeploy", ["--server-port", "1"], "--server-port"),
]


@pytest.mark.parametrize(("driver", "args", "flag"), OWNED)
def test_args_that_would_move_the_engine_off_its_published_port_or_model_are_refused(
    driver: str, args: list[str], flag: str
) -> None:
    with pytest.raises(DriverError) as raised:
        settings(driver, args=args)
    assert flag in str(raised.value)
    assert "chat-small" in str(raised.value)


@pytest.mark.parametrize("variable", ["OLLAMA_HOST", "OLLAMA_MODELS"])
def test_ollama_env_cannot_move_its_listener_or_model_store(variable: str) -> None:
    with pytest.raises(DriverError, match=variable):
        settings("ollama", env={variable: "x"})


def test_spec_env_reaches_the_engine_unchanged() -> None:
    result = settings("vllm", env={"HF_TOKEN": "hf_secret", "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert result.environment["HF_TOKEN"] == "hf_secret"
    assert result.environment["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_artifact_without_its_store_directory_is_refused() -> None:
    with pytest.raises(DriverError, match="model_dir"):
        get_driver("vllm").container_settings(spec("vllm"))


def test_spec_for_another_driver_is_refused() -> None:
    with pytest.raises(DriverError, match="'tgi'"):
        get_driver("vllm").container_settings(spec("tgi"), model_dir=MODEL_DIR)


LLAMACPP_FILES = [
    (("model-q4_k_m.gguf", "README.md"), "model-q4_k_m.gguf"),
    (("m-00002-of-00003.gguf", "m-00001-of-00003.gguf", "m-00003-of-00003.gguf"), "m-00001-of-00003.gguf"),
    (("sub/dir/model.gguf",), "sub/dir/model.gguf"),
]


@pytest.mark.parametrize(("files", "chosen"), LLAMACPP_FILES)
def test_llamacpp_loads_the_artifacts_one_gguf_file(files: tuple[str, ...], chosen: str) -> None:
    command = settings("llamacpp", model_files=files).command
    assert command[:2] == ("-m", f"{MODEL_MOUNT_PATH}/{chosen}")


@pytest.mark.parametrize("files", [("a.gguf", "b.gguf"), ("config.json", "model.safetensors"), ()])
def test_llamacpp_refuses_an_artifact_without_exactly_one_model_file(files: tuple[str, ...]) -> None:
    with pytest.raises(DriverError, match=r"one \.gguf file"):
        settings("llamacpp", model_files=files)


# -- the generic driver -------------------------------------------------------------------------------------


def test_generic_driver_probes_v1_models_unless_told_otherwise() -> None:
    assert get_driver("openai").facts.health_path == "/v1/models"
    assert get_driver("openai", health_path="/healthz").facts.health_path == "/healthz"


def test_generic_driver_refuses_a_relative_health_path() -> None:
    with pytest.raises(DriverError, match="absolute path"):
        get_driver("openai", health_path="healthz")


def test_health_path_is_refused_for_drivers_that_know_their_probe() -> None:
    with pytest.raises(DriverError, match="only for the generic 'openai' driver"):
        get_driver("vllm", health_path="/healthz")


def test_generic_driver_can_be_told_its_gauges() -> None:
    driver = OpenAIDriver(running_metric="x_running", waiting_metric="x_waiting", container_port=9000)
    assert driver.facts.has_metrics
    assert driver.facts.container_port == 9000
    assert in_flight("x_running 2\nx_waiting 1\n", driver.facts).total == 3


# -- readiness probe answers ----------------------------------------------------------------------------------

PROBES = [
    # driver, status, body, ready, loading
    ("vllm", None, "", False, True),
    ("vllm", 200, "", True, False),
    ("vllm", 503, "", False, False),
    ("tgi", None, "", False, True),
    ("tgi", 200, "", True, False),
    ("tgi", 503, '{"error":"unhealthy","error_type":"healthcheck"}', False, False),
    ("sglang", None, "", False, True),
    ("sglang", 503, "", False, True),
    ("sglang", 200, "", True, False),
    ("llamacpp", 503, '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}', False, True),
    ("llamacpp", 503, '{"error":{"code":503,"message":"no slot available"}}', False, False),
    ("llamacpp", 200, '{"status":"ok"}', True, False),
    ("lmdeploy", None, "", False, True),
    ("lmdeploy", 503, '{"status":"unhealthy"}', False, False),
    ("lmdeploy", 200, '{"status":"healthy"}', True, False),
    ("ollama", 200, "Ollama is running", True, False),
    ("ollama", 404, "404 page not found", False, False),
    ("openai", 200, '{"object":"list","data":[]}', True, False),
    ("openai", 401, '{"error":"missing api key"}', False, False),
]


@pytest.mark.parametrize(("driver", "status", "body", "ready", "loading"), PROBES)
def test_probe_answers_read_the_way_each_engine_means_them(
    driver: str, status: int | None, body: str, ready: bool, loading: bool
) -> None:
    verdict = get_driver(driver).interpret_probe(status, body)
    assert (verdict.ready, verdict.loading) == (ready, loading)
    assert verdict.detail


def test_unexpected_probe_answer_is_described_with_status_and_body() -> None:
    verdict = get_driver("openai").interpret_probe(500, "Internal <b>error</b>\n" + "x" * 500)
    assert "500" in verdict.detail
    assert "Internal <b>error</b>" in verdict.detail
    assert len(verdict.detail) < 300, "the body is cut, not copied whole into messages"


# -- Prometheus text ------------------------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="chat"} 3.0
vllm:num_requests_running{engine="1",model_name="chat"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="chat"} 4.0
vllm:num_requests_waiting{engine="1",model_name="chat"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="chat"} 17
"""


def test_in_flight_sums_running_and_waiting_over_every_label_set() -> None:
    result = in_flight(VLLM_METRICS, get_driver("vllm").facts)
    assert result == InFlight(running=5.0, waiting=4.0, missing=())
    assert result.total == 9.0


def test_similar_metric_names_are_not_counted() -> None:
    # vllm:num_requests_waiting_by_reason shares a prefix with the gauge; only exact names count.
    assert in_flight(VLLM_METRICS, get_driver("vllm").facts).waiting == 4.0


def test_missing_gauges_are_named_not_taken_for_zero() -> None:
    text = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
    result = in_flight(text, get_driver("llamacpp").facts)
    assert result.running == 2.0
    assert result.waiting is None
    assert result.missing == ("llamacpp:requests_deferred",)
    assert result.total == 2.0


def test_no_gauges_at_all_tells_nothing() -> None:
    result = in_flight("# nothing here\nprocess_cpu_seconds_total 12.5\n", get_driver("tgi").facts)
    assert result.total is None
    assert result.missing == ("tgi_batch_current_size", "tgi_queue_size")


def test_engine_without_metrics_has_no_in_flight_count() -> None:
    result = in_flight("anything 1\n", get_driver("ollama").facts)
    assert (result.total, result.missing) == (None, ())


def test_nan_gauge_is_absent_not_zero() -> None:
    result = in_flight("tgi_queue_size NaN\ntgi_batch_current_size 1\n", get_driver("tgi").facts)
    assert result.waiting is None
    assert result.missing == ("tgi_queue_size",)


def test_proxy_error_page_is_never_read_as_zero_in_flight() -> None:
    with pytest.raises(MetricsFormatError):
        in_flight("<!DOCTYPE html>\n<title>404 Not Found</title>\n", get_driver("vllm").facts)

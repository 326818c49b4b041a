"""Engine drivers: one small class per inference engine, from the generic spec to container settings.

A driver knows two things about its engine and nothing else:

- how the generic ``engines.spec.EngineSpec`` becomes that engine's command line and environment
  (``Driver.container_settings``: plain data, no Docker import; labels, names and the host bind address
  are the caller's business);
- the engine's documented facts (``Driver.facts``): its port, how readiness looks while the model loads,
  where the model list and the metrics are, which gauges count running and waiting requests, and what
  SIGTERM does to work in flight. Where each fact comes from is written down in docs/ENGINE_DRIVERS.md.

Choices worth knowing:
- A promoted artifact is mounted read-only at ``MODEL_MOUNT_PATH``; the driver never sees the store.
- GPUs are selected with a Docker device request for exactly the ids in the spec (uuid, index or MIG
  uuid), and ``NVIDIA_VISIBLE_DEVICES`` is set to the same ids, or to ``void`` when the spec asks for none:
  CUDA base images set ``NVIDIA_VISIBLE_DEVICES=all``, which on a host whose default runtime is nvidia
  would otherwise hand every GPU to an engine that asked for none. The spec may therefore not set
  ``NVIDIA_VISIBLE_DEVICES`` itself.
- The driver owns the flags that decide where the engine listens and what it serves (port, host, model,
  served name); ``args`` that set them again are refused, because the engine would then listen somewhere
  the container does not publish.
- Metrics that need a flag (llama.cpp ``--metrics``, SGLang ``--enable-metrics``) are switched on by the
  driver: drain depends on them.
- Engines that split a model across GPUs share tensors between their processes through /dev/shm; where an
  engine's docs call for more than Docker's 64 MiB the driver defaults ``shm_size_mib``, always in the
  container's own IPC namespace: the docs' alternative, ``--ipc=host``, is the host policy's to allow. The
  spec's size wins; ``ipc_mode: host`` drops it (the host's /dev/shm is used). ``ulimits`` come from the spec
  only: the memlock=-1 that SGLang's compose file and NVIDIA's containers suggest is for RDMA, which engines
  published on one host's bridge network do not use, and a Docker Engine without CAP_SYS_RESOURCE (rootless,
  or confined) cannot start a container that asks for it.
- The spec's volumes are mounted read-only after the model, from the paths the host resolved and checked
  (``engines.volumes``); the driver never decides what may be mounted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedEngineSpec

__all__ = [
    "DRIVERS",
    "MODEL_MOUNT_PATH",
    "Driver",
    "DriverError",
    "EngineFacts",
    "InFlight",
    "LaunchSettings",
    "LlamaCppDriver",
    "LmDeployDriver",
    "Mount",
    "OllamaDriver",
    "OpenAIDriver",
    "ProbeVerdict",
    "SGLangDriver",
    "SigtermBehaviour",
    "TgiDriver",
    "VllmDriver",
    "get_driver",
    "in_flight",
]

MODEL_MOUNT_PATH = "/meridian/model"
# Engines listen on every interface inside the container; the host side publishes on the policy's address.
_ALL_INTERFACES = "0.0.0.0"  # noqa: S104
_BODY_EXCERPT = 200


class DriverError(MeridianError, ValueError):
    """The spec cannot be turned into settings for this engine; the message says what to change."""


class SigtermBehaviour(StrEnum):
    """What the engine does with requests in flight when its container is sent SIGTERM."""

    ABORTS_IN_FLIGHT = "aborts-in-flight"
    FINISHES_IN_FLIGHT = "finishes-in-flight"
    # Stops working and listening but never answers what is in flight and never exits: only the SIGKILL after
    # the stop timeout ends it, so a longer timeout only keeps clients waiting longer.
    HANGS_UNTIL_KILLED = "hangs-until-killed"


@dataclass(frozen=True)
class EngineFacts:
    """The documented behaviour of one engine (sources: docs/ENGINE_DRIVERS.md)."""

    container_port: int
    loading: str
    running_metric: str | None
    waiting_metric: str | None
    sigterm: SigtermBehaviour
    sigterm_detail: str
    stop_timeout_s: int
    # What most engines document; a driver names only where its engine differs.
    health_path: str = "/health"
    model_list_path: str = "/v1/models"
    metrics_path: str | None = "/metrics"
    metrics_flag: str | None = None
    stop_signal: str = "SIGTERM"

    @property
    def has_metrics(self) -> bool:
        return self.metrics_path is not None and (self.running_metric or self.waiting_metric) is not None


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class LaunchSettings:
    """How the engine's container runs, without Docker's names (labels, container name and bind address are
    the caller's: ``engines.probes.container_settings`` turns this into ``docker.engine.ContainerSettings``).

    ``entrypoint`` None keeps the image's own; ``command`` is then passed to it as arguments.
    ``gpu_device_ids`` become one NVIDIA device request; empty means no GPU at all. ``ulimits`` are
    ``(name, soft, hard)`` by name, -1 unlimited; ``shm_size_mib`` None is Docker's 64 MiB.
    ``secret_environment`` reaches the container beside ``environment``, never sharing a name with it.
    """

    image: str
    entrypoint: tuple[str, ...] | None
    command: tuple[str, ...]
    environment: Mapping[str, str]
    container_port: int
    host_port: int
    mounts: tuple[Mount, ...]
    gpu_device_ids: tuple[str, ...]
    stop_signal: str
    stop_timeout_s: int
    restart_policy: str = "unless-stopped"
    ipc_mode: str = "private"
    shm_size_mib: int | None = None
    ulimits: tuple[tuple[str, int, int], ...] = ()
    secret_environment: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeVerdict:
    """How one readiness probe answer reads: ready, still loading, or up but not well."""

    ready: bool
    loading: bool
    detail: str


@dataclass(frozen=True)
class InFlight:
    """Requests in flight as the engine's own gauges count them (summed over every label set)."""

    running: float | None
    waiting: float | None
    missing: tuple[str, ...] = ()

    @property
    def total(self) -> float | None:
        """Running plus waiting; None when the engine published neither gauge (nothing can be told)."""
        present = [value for value in (self.running, self.waiting) if value is not None]
        return sum(present) if present else None


def _excerpt(body: str) -> str:
    text = " ".join(body.split())
    return text if len(text) <= _BODY_EXCERPT else text[:_BODY_EXCERPT] + "..."


def _flag_in(args: Iterable[str], flags: Iterable[str]) -> str | None:
    wanted = tuple(flags)
    for arg in args:
        for flag in wanted:
            if arg == flag or arg.startswith(flag + "="):
                return flag
    return None


def _is_mig(gpu: str) -> bool:
    return gpu.startswith("MIG-")


class Driver:
    """Base of every driver: the shared mapping, with the engine-specific parts in small hooks."""

    name: ClassVar[str]
    facts: EngineFacts
    # flags the driver sets itself; the spec's args may not set them again
    owned_flags: ClassVar[tuple[str, ...]] = ()
    # (flag, aliases) that splits a model over several whole GPUs; None where the engine has none
    tensor_parallel_flags: ClassVar[tuple[str, ...] | None] = None
    reserved_env: ClassVar[tuple[str, ...]] = ("NVIDIA_VISIBLE_DEVICES",)
    # The /dev/shm (MiB) the engine's docs call for; the spec's own size wins (docs/ENGINE_DRIVERS.md)
    default_shm_size_mib: ClassVar[int | None] = None
    # Recognition hints: how the engine shows in a pod's or container's name, as words (the name split at
    # anything but letters and digits), besides the driver's own name: the names its images and charts
    # commonly use. ``name_is_a_hint`` False: the driver's name says nothing about which engine runs.
    also_named: ClassVar[tuple[tuple[str, ...], ...]] = ()
    name_is_a_hint: ClassVar[bool] = True
    # The engine's flags for the address and port it listens on and the model name it serves under, which the
    # driver sets (``_serving_args``); a served-name flag of None: the engine serves under the model's name.
    host_flag: ClassVar[str] = "--host"
    port_flag: ClassVar[str] = "--port"
    served_name_flag: ClassVar[str | None] = "--served-model-name"
    # How a 503 from the health path reads, where it means one thing for this engine; None: the generic reading.
    answer_503: ClassVar[ProbeVerdict | None] = None

    @classmethod
    def recognized_by(cls) -> tuple[tuple[str, ...], ...]:
        """Every run of words that says this engine runs where a name holds it (the Kubernetes observer's)."""
        return ((cls.name,), *cls.also_named) if cls.name_is_a_hint else cls.also_named

    def container_settings(
        self,
        spec: ParsedEngineSpec,
        *,
        model_dir: str | None = None,
        model_files: Sequence[str] = (),
    ) -> LaunchSettings:
        """The container for ``spec``.

        ``model_dir`` is the host directory of the promoted artifact named by ``spec.model.artifact``
        (the caller resolves it in the store); ``model_files`` its files, relative, as the manifest
        lists them, for engines that load one file rather than a directory. ``spec.volumes`` are mounted as
        they are: the caller has resolved and checked them on the host (``engines.volumes.resolve_volumes``).
        """
        self._check_spec(spec, model_dir)
        model = self._model_reference(spec, model_files)
        command = [
            *self._base_command(spec, model),
            *self._metrics_args(spec),
            *self._parallel_args(spec),
            *spec.args,
        ]
        environment = self._environment(spec)
        mounts: tuple[Mount, ...] = ()
        if spec.model.artifact is not None and model_dir is not None:
            mounts = (Mount(source=model_dir, target=MODEL_MOUNT_PATH, read_only=True),)
        mounts += tuple(Mount(source=volume.source, target=volume.target, read_only=True) for volume in spec.volumes)
        return LaunchSettings(
            image=spec.image,
            entrypoint=self._entrypoint(),
            command=tuple(command),
            environment=environment,
            secret_environment=dict(spec.secret_env),
            container_port=self.facts.container_port,
            host_port=spec.port,
            mounts=mounts,
            gpu_device_ids=tuple(spec.gpus),
            stop_signal=self.facts.stop_signal,
            stop_timeout_s=self.facts.stop_timeout_s,
            restart_policy=spec.restart_policy,
            ipc_mode=spec.ipc_mode,
            shm_size_mib=self._shm_size_mib(spec),
            ulimits=self._ulimits(spec),
        )

    def interpret_probe(self, status: int | None, body: str = "") -> ProbeVerdict:
        """Read one answer of the readiness probe; ``status`` None means nothing answered on the port."""
        if status is None:
            return ProbeVerdict(
                ready=False,
                loading=True,
                detail=f"nothing answers on port {self.facts.container_port} yet ({self.facts.loading})",
            )
        if status == 200:
            return ProbeVerdict(ready=True, loading=False, detail=f"GET {self.facts.health_path} answered 200")
        return self._not_ready(status, body)

    def served_name(self, spec: ParsedEngineSpec) -> str:
        """The model name clients use: the spec's served name, else the model name, else the engine's name."""
        return spec.served_model_name or spec.model.name or spec.name

    # hooks ---------------------------------------------------------------------------------------

    def _entrypoint(self) -> tuple[str, ...] | None:
        return None

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        raise NotImplementedError

    def _model_reference(self, spec: ParsedEngineSpec, model_files: Sequence[str]) -> str | None:
        return MODEL_MOUNT_PATH if spec.model.artifact is not None else spec.model.name

    def _engine_environment(self, spec: ParsedEngineSpec) -> dict[str, str]:
        return {}

    def _not_ready(self, status: int, body: str) -> ProbeVerdict:
        if status == 503 and self.answer_503 is not None:
            return self.answer_503
        return ProbeVerdict(
            ready=False,
            loading=False,
            detail=f"GET {self.facts.health_path} answered {status}: {_excerpt(body) or '(empty body)'}",
        )

    # shared --------------------------------------------------------------------------------------

    def _check_spec(self, spec: ParsedEngineSpec, model_dir: str | None) -> None:
        if spec.driver != self.name:
            raise DriverError(f"spec {spec.name!r} names driver {spec.driver!r}, not {self.name!r}")
        if spec.model.artifact is not None and not model_dir:
            raise DriverError(
                f"engine {spec.name!r} serves artifact {spec.model.artifact!r}: pass the promoted artifact's "
                "directory as model_dir (resolve it in the artifact store first)"
            )
        taken = _flag_in(spec.args, self.owned_flags)
        if taken is not None:
            raise DriverError(
                f"engine {spec.name!r}: args set {taken}, which the {self.name} driver sets itself from the "
                "spec (port, model, served_model_name); remove it from args"
            )
        for option, names in (("env", spec.env), ("secret_env", spec.secret_env)):
            reserved = sorted(set(names) & set(self.reserved_env))
            if reserved:
                raise DriverError(
                    f"engine {spec.name!r}: {option} sets {', '.join(reserved)}, which the {self.name} driver "
                    f"owns (GPUs are chosen with 'gpus', the port with 'port'); remove it from {option}"
                )

    def _serving_args(self, spec: ParsedEngineSpec) -> list[str]:
        # Every interface inside the container, the engine's own port, and the name clients ask for.
        args = [self.host_flag, _ALL_INTERFACES, self.port_flag, str(self.facts.container_port)]
        if self.served_name_flag is not None:
            args += [self.served_name_flag, self.served_name(spec)]
        return args

    def _metrics_args(self, spec: ParsedEngineSpec) -> list[str]:
        # Drain reads the gauges: an engine that publishes them only behind a flag gets it, once.
        flag = self.facts.metrics_flag
        return [flag] if flag is not None and flag not in spec.args else []

    def _parallel_args(self, spec: ParsedEngineSpec) -> list[str]:
        # Several whole GPUs mean one model split across them; MIG devices are never combined this way.
        if self.tensor_parallel_flags is None or len(spec.gpus) < 2 or any(_is_mig(g) for g in spec.gpus):
            return []
        if _flag_in(spec.args, self.tensor_parallel_flags) is not None:
            return []
        return [self.tensor_parallel_flags[0], str(len(spec.gpus))]

    def _shm_size_mib(self, spec: ParsedEngineSpec) -> int | None:
        if spec.shm_size_mib is not None:
            return spec.shm_size_mib
        # With the host's IPC namespace the engine uses the host's /dev/shm, and Docker ignores a size.
        return None if spec.ipc_mode == "host" else self.default_shm_size_mib

    @staticmethod
    def _ulimits(spec: ParsedEngineSpec) -> tuple[tuple[str, int, int], ...]:
        limits = {
            name: (value, value) if isinstance(value, int) else (value.soft, value.hard)
            for name, value in spec.ulimits.items()
        }
        return tuple((name, soft, hard) for name, (soft, hard) in sorted(limits.items()))

    def _environment(self, spec: ParsedEngineSpec) -> dict[str, str]:
        environment = self._engine_environment(spec)
        environment.update(spec.env)
        # A secret overrides a driver default as env would; it travels apart (secret_environment), so drop it here.
        for key in spec.secret_env:
            environment.pop(key, None)
        environment["NVIDIA_VISIBLE_DEVICES"] = ",".join(spec.gpus) if spec.gpus else "void"
        return environment


class VllmDriver(Driver):
    name = "vllm"
    facts = EngineFacts(
        container_port=8000,
        loading="vLLM binds its port before loading but only listens once the engine is built",
        running_metric="vllm:num_requests_running",
        waiting_metric="vllm:num_requests_waiting",
        sigterm=SigtermBehaviour.ABORTS_IN_FLIGHT,
        sigterm_detail=(
            "default --shutdown-timeout 0 aborts every request in flight; recent releases wait up to "
            "--shutdown-timeout seconds when it is set"
        ),
        stop_timeout_s=30,
    )
    owned_flags = ("--host", "--port", "--model", "--served-model-name")
    tensor_parallel_flags = ("--tensor-parallel-size", "-tp")
    answer_503 = ProbeVerdict(
        ready=False, loading=False, detail="GET /health answered 503: the engine is dead or draining"
    )
    # "--ipc=host or --shm-size": PyTorch shares tensor-parallel data through /dev/shm; 10 GiB as in vLLM's
    # examples/online_serving/run_cluster.sh (--shm-size 10.24g).
    default_shm_size_mib = 10240

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        # The vllm/vllm-openai image's entrypoint is `vllm serve`, which takes the model positionally.
        return [str(model), *self._serving_args(spec)]


class TgiDriver(Driver):
    name = "tgi"
    also_named = (("text", "generation", "inference"),)
    facts = EngineFacts(
        container_port=80,
        loading="the launcher starts the router only after every shard has loaded the model",
        running_metric="tgi_batch_current_size",
        waiting_metric="tgi_queue_size",
        sigterm=SigtermBehaviour.FINISHES_IN_FLIGHT,
        sigterm_detail=(
            "the router stops accepting and finishes requests in flight (axum graceful shutdown); the "
            "launcher kills it after --graceful-termination-timeout (default 90 s)"
        ),
        stop_timeout_s=120,
    )
    owned_flags = ("--hostname", "--port", "-p", "--model-id")
    host_flag = "--hostname"
    # TGI serves one model under its model id; it has no separate served-name flag.
    served_name_flag = None
    tensor_parallel_flags = ("--num-shard", "--sharded")
    # The README's "A note on Shared Memory": NCCL may fall back to host memory between shards; --shm-size 1g.
    default_shm_size_mib = 1024
    answer_503 = ProbeVerdict(
        ready=False,
        loading=False,
        detail="GET /health answered 503: the shards did not answer the router's health check",
    )

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        return ["--model-id", str(model), *self._serving_args(spec)]

    def served_name(self, spec: ParsedEngineSpec) -> str:
        return MODEL_MOUNT_PATH if spec.model.artifact is not None else str(spec.model.name)


class SGLangDriver(Driver):
    name = "sglang"
    facts = EngineFacts(
        container_port=30000,
        loading="the HTTP server starts after the model loads, then /health answers 503 until warm-up ends",
        running_metric="sglang:num_running_reqs",
        waiting_metric="sglang:num_queue_reqs",
        metrics_flag="--enable-metrics",
        sigterm=SigtermBehaviour.FINISHES_IN_FLIGHT,
        sigterm_detail=(
            "the tokenizer manager's SIGTERM watchdog answers /health with 503 and waits until no request "
            "is left, then exits (SGL_FORCE_SHUTDOWN=1 exits at once)"
        ),
        stop_timeout_s=60,
    )
    owned_flags = ("--host", "--port", "--model-path", "--served-model-name")
    tensor_parallel_flags = ("--tp-size", "--tp", "--tensor-parallel-size")
    # The install docs run the image with --shm-size 32g (and --ipc=host, which the host policy gates).
    default_shm_size_mib = 32768
    answer_503 = ProbeVerdict(
        ready=False,
        loading=True,
        detail="GET /health answered 503: starting (warm-up not done), unhealthy or shutting down",
    )

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        return ["python3", "-m", "sglang.launch_server", "--model-path", str(model), *self._serving_args(spec)]


class OllamaDriver(Driver):
    name = "ollama"
    facts = EngineFacts(
        container_port=11434,
        health_path="/",
        loading="Ollama answers as soon as it listens and loads models on first use",
        model_list_path="/api/tags",
        metrics_path=None,
        running_metric=None,
        waiting_metric=None,
        sigterm=SigtermBehaviour.ABORTS_IN_FLIGHT,
        sigterm_detail="SIGTERM closes the HTTP server at once (http.Server.Close) and unloads the runners",
        stop_timeout_s=30,
    )
    reserved_env = ("NVIDIA_VISIBLE_DEVICES", "OLLAMA_HOST", "OLLAMA_MODELS")

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        # The ollama/ollama image's entrypoint is /bin/ollama; models are not named on its command line.
        return ["serve"]

    def _engine_environment(self, spec: ParsedEngineSpec) -> dict[str, str]:
        environment = {"OLLAMA_HOST": f"{_ALL_INTERFACES}:{self.facts.container_port}"}
        if spec.model.artifact is not None:
            # The artifact is an Ollama models directory (manifests/ and blobs/), mounted read-only:
            # pruning at start-up would try to delete from it.
            environment["OLLAMA_MODELS"] = MODEL_MOUNT_PATH
            environment["OLLAMA_NOPRUNE"] = "1"
        return environment


class LlamaCppDriver(Driver):
    name = "llamacpp"
    also_named = (("llama", "cpp"), ("llama", "server"))
    facts = EngineFacts(
        container_port=8080,
        loading='/health answers 503 {"error": {"message": "Loading model"}} while the model loads',
        running_metric="llamacpp:requests_processing",
        waiting_metric="llamacpp:requests_deferred",
        metrics_flag="--metrics",
        # Measured on Debian's llama-server 0.7.0 (build 11669) by tests/system/e2e/test_real_engine.py.
        sigterm=SigtermBehaviour.HANGS_UNTIL_KILLED,
        sigterm_detail=(
            "with requests in flight, SIGTERM stops the task loop and closes the listener, but the requests are "
            "never answered and the process does not exit until the SIGKILL after the stop timeout (exit 137; "
            "clients get an empty reply); idle, it exits 0 at once"
        ),
        # Idle it exits in well under a second; with work in flight waiting longer finishes nothing.
        stop_timeout_s=5,
    )
    owned_flags = ("--host", "--port", "-m", "--model", "-hf", "-hfr", "--hf-repo", "-a", "--alias")
    served_name_flag = "--alias"

    def _model_reference(self, spec: ParsedEngineSpec, model_files: Sequence[str]) -> str | None:
        if spec.model.artifact is None:
            return spec.model.name
        return f"{MODEL_MOUNT_PATH}/{_pick_gguf(spec, model_files)}"

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        # The llama.cpp server image's entrypoint is /app/llama-server.
        source = ["-m", str(model)] if spec.model.artifact is not None else ["-hf", str(model)]
        return [*source, *self._serving_args(spec)]

    def _not_ready(self, status: int, body: str) -> ProbeVerdict:
        if status == 503 and "loading model" in body.lower():
            return ProbeVerdict(ready=False, loading=True, detail="GET /health answered 503 Loading model")
        return super()._not_ready(status, body)


_SHARD = re.compile(r"-0*1-of-\d+\.gguf$")


def _pick_gguf(spec: ParsedEngineSpec, model_files: Sequence[str]) -> str:
    ggufs = sorted(f for f in model_files if f.endswith(".gguf"))
    # A split model is loaded from its first shard; llama.cpp finds the others next to it.
    candidates = [f for f in ggufs if _SHARD.search(f)] or ggufs
    if len(candidates) == 1:
        return candidates[0]
    listed = ", ".join(ggufs) if ggufs else "none"
    raise DriverError(
        f"engine {spec.name!r}: llama.cpp loads one .gguf file, and artifact {spec.model.artifact!r} has "
        f"{len(candidates)} candidates ({listed}); publish the artifact with exactly one model file "
        "(or the shards of one split model)"
    )


class LmDeployDriver(Driver):
    name = "lmdeploy"
    facts = EngineFacts(
        container_port=23333,
        loading="the pipeline (and the model) is built before uvicorn starts listening",
        running_metric="lmdeploy:num_requests_running",
        waiting_metric="lmdeploy:num_requests_waiting",
        sigterm=SigtermBehaviour.FINISHES_IN_FLIGHT,
        sigterm_detail="uvicorn's graceful shutdown: stop accepting, wait for requests in flight, then exit",
        stop_timeout_s=60,
    )
    owned_flags = ("--server-name", "--server-port", "--model-name")
    host_flag = "--server-name"
    port_flag = "--server-port"
    served_name_flag = "--model-name"
    tensor_parallel_flags = ("--tp",)
    # The docs run the image with --ipc=host, which the host policy gates; a private 10 GiB /dev/shm (our
    # size, vLLM's) instead.
    default_shm_size_mib = 10240

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        # The openmmlab/lmdeploy image has no entrypoint: the command is the whole launcher.
        return ["lmdeploy", "serve", "api_server", str(model), *self._serving_args(spec)]

    def _not_ready(self, status: int, body: str) -> ProbeVerdict:
        if status == 503:
            return ProbeVerdict(
                ready=False,
                loading=False,
                detail=f"GET /health answered 503: the engine's health monitor says {_excerpt(body) or 'unhealthy'}",
            )
        return super()._not_ready(status, body)


class OpenAIDriver(Driver):
    """Any OpenAI-compatible server: the image's own entrypoint, the spec's args, a configurable probe."""

    name = "openai"
    name_is_a_hint = False  # any OpenAI-compatible server: the name does not say which engine runs
    default_port = 8000

    def __init__(
        self,
        *,
        health_path: str | None = None,
        container_port: int | None = None,
        running_metric: str | None = None,
        waiting_metric: str | None = None,
    ) -> None:
        if health_path is not None and not health_path.startswith("/"):
            raise DriverError(f"health_path {health_path!r} must be an absolute path such as /health")
        metrics = running_metric is not None or waiting_metric is not None
        self.facts = EngineFacts(
            container_port=container_port or self.default_port,
            health_path=health_path or "/v1/models",
            loading="an OpenAI-compatible server is ready when its health path answers 200",
            metrics_path="/metrics" if metrics else None,
            running_metric=running_metric,
            waiting_metric=waiting_metric,
            sigterm=SigtermBehaviour.ABORTS_IN_FLIGHT,
            sigterm_detail="unknown for a generic server: assume requests in flight are lost and drain first",
            stop_timeout_s=30,
        )

    def _base_command(self, spec: ParsedEngineSpec, model: str | None) -> list[str]:
        # Nothing is known about the server's flags: the spec's args are the whole command.
        return []


DRIVERS: dict[str, type[Driver]] = {
    driver.name: driver
    for driver in (VllmDriver, TgiDriver, SGLangDriver, OllamaDriver, LlamaCppDriver, LmDeployDriver, OpenAIDriver)
}


def get_driver(name: str, *, health_path: str | None = None) -> Driver:
    """The driver called ``name``; ``health_path`` configures the generic ``openai`` driver only."""
    try:
        driver_class = DRIVERS[name]
    except KeyError:
        raise DriverError(f"unknown engine driver {name!r}; the drivers are: {', '.join(sorted(DRIVERS))}") from None
    if driver_class is OpenAIDriver:
        return OpenAIDriver(health_path=health_path)
    if health_path is not None:
        raise DriverError(
            f"health_path is only for the generic 'openai' driver; the {name} driver probes "
            f"{driver_class.facts.health_path}"
        )
    return driver_class()


def in_flight(text: str, facts: EngineFacts) -> InFlight:
    """Sum the engine's running and waiting gauges over all their label sets.

    A gauge the text does not contain is None and named in ``missing``; NaN samples (no reading yet)
    count as absent, not as zero.
    """
    # Imported here: only a drain reads an engine's metrics, and a module pays its imports on every task.
    from ansible_collections.meridian.node.plugins.module_utils.engines.prometheus_text import parse_prometheus_text

    samples = parse_prometheus_text(text)
    totals: dict[str, float] = {}
    for sample in samples:
        if math.isnan(sample.value):
            continue
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    wanted = [m for m in (facts.running_metric, facts.waiting_metric) if m is not None]
    missing = tuple(m for m in wanted if m not in totals)
    return InFlight(
        running=totals.get(facts.running_metric) if facts.running_metric else None,
        waiting=totals.get(facts.waiting_metric) if facts.waiting_metric else None,
        missing=missing,
    )

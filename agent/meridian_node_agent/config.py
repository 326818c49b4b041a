"""The agent's configuration file (YAML, ``/etc/meridian-node/config.yaml`` by default).

What the agent is *allowed* to do is the root-owned policy's business; the config only says what this
agent is asked to do (which node, which mode, where the control plane is), and a config may not claim a
mode the policy does not allow. Unknown fields are errors: a misspelt option must not silently fall back
to a default.
"""

import importlib.util
import os
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._module import AGENT_STATE_DIR, DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import (
    YamlFileError,
    parse_yaml,
    read_text_file,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import NodeId, describe_validation_error
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import (
    DEFAULT_POLICY_PATH,
    Policy,
    PolicyError,
    load_policy,
)
from meridian_node_agent.errors import UsageError

DEFAULT_CONFIG_PATH = "/etc/meridian-node/config.yaml"
CONFIG_ENV = "MERIDIAN_NODE_CONFIG"

# Every timer of the agent that paces a call to the control plane (the lease renewal, the pause between cycles,
# the long-poll, the observation refresh, the certificate's renewal point) is drawn within this fraction of its
# setting, each time it is set: a fleet started in one rollout, or reconnecting after a control-plane restart,
# spreads out instead of calling in lockstep. A bound derived from these timers (how long until the agent has
# surely reported) allows for it.
TIMER_JITTER = 0.1

# Where the kubelet serves its PodResources API unless its --root-dir moved it (dcgm-exporter reads the same path).
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

Mode = Literal["observe-only", "managed-host", "kubernetes-integrated", "air-gapped"]
# Modes the contract names but this version does not build yet: refused by check-config, run and the apply unit,
# never run as something else. None today; the table stays so that a new mode starts here.
UNBUILT_MODES: dict[str, str] = {}
# Modes that never change the host: no apply, no supervision repair, no container or NVML change. The agent
# still verifies what the control plane publishes (and says why it does not apply it).
READ_ONLY_MODES = ("observe-only", "kubernetes-integrated")


def mode_unavailable(mode: str, via: str | None = None) -> str | None:
    """Why ``mode`` cannot run in this version, or None when it can; ``via`` is the agent's ``apply.via``.

    The root apply unit asks without ``via``: an air-gapped node's bundles come through the inbox, taken by
    whoever applies (docs/AIR_GAP.md: the agent in-process, root's ``meridian-node-airgap`` unit under the
    split), never as a request spooled by the agent.
    """
    if mode == "air-gapped" and via is None:
        return (
            "mode air-gapped takes bundles from its inbox; the root apply unit takes no spooled request in "
            "this mode (a request there did not come from this node's agent)"
        )
    if mode == "kubernetes-integrated" and via is not None:
        missing = kubernetes_unavailable()
        if missing:
            return missing
    why = UNBUILT_MODES.get(mode)
    if why is None:
        return None
    return f"mode {mode} is not available yet: {why}; use observe-only or managed-host"


def kubernetes_unavailable() -> str | None:
    """Why mode kubernetes-integrated cannot read the kubelet here, or None when it can.

    gRPC and protobuf are the ``kubernetes`` extra of the meridian-node package: agents in other modes run
    without them.
    """
    missing = [name for name, module in (("grpcio", "grpc"), ("protobuf", "google.protobuf")) if _absent(module)]
    if not missing:
        return None
    return (
        f"mode kubernetes-integrated reads the kubelet's PodResources API over gRPC, but the Python package(s) "
        f"{', '.join(missing)} are not installed; install meridian-node[kubernetes] "
        "(pip install 'meridian-node[kubernetes]')"
    )


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package (google) is missing
        return True


def metrics_unavailable(listen: str) -> str | None:
    """Why a ``metrics`` section listening on ``listen`` cannot be served here, or None when it can.

    prometheus-client is the ``metrics`` extra of the meridian-node package: an agent without a metrics
    section runs without it.
    """
    if importlib.util.find_spec("prometheus_client") is not None:
        return None
    return (
        f"metrics.listen is {listen!r} but the Python package prometheus-client is not installed; install "
        "meridian-node[metrics] (pip install 'meridian-node[metrics]') or remove the metrics section from "
        "the config"
    )


class ConfigError(MeridianError, ValueError):
    """The config file is unreadable or invalid; the message names the file and the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_S = TypeVar("_S", bound=_Section)


def _in_order(section: _S, first: str, longest: str) -> _S:
    """``section``, when its ``longest`` wait is not below its ``first`` (a backoff that doubles from one to the
    other); the ValueError pydantic reports for the section otherwise."""
    low, high = getattr(section, first), getattr(section, longest)
    if high < low:
        raise ValueError(f"{longest} ({high}) is below {first} ({low})")
    return section


class ControlPlaneConfig(_Section):
    url: AnyHttpUrl = Field(description="the control plane's base URL; https:// only (mutual TLS)")
    # Replicas of one control plane (devserver processes sharing one database and data dir) answer every node the
    # same: the agent needs no load balancer in front of them, only somewhere to go when its replica is down.
    replica_urls: list[AnyHttpUrl] = Field(
        default_factory=list,
        description="more base URLs of the same control plane (replicas on one database, one CA), https:// only, "
        "each once; when a call cannot reach one, the retry goes to the next (url, then these, round again)",
    )
    timeout_seconds: Annotated[
        float, Field(gt=0, le=300, description="bounds connecting and each read (a long-poll adds its wait)")
    ] = 10.0
    long_poll_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=300,
            description="how long one fetch waits for a new state, less up to 10 % (jitter) and never past the next "
            "heartbeat; 0 polls",
        ),
    ] = 30
    heartbeat_seconds: Annotated[
        int,
        Field(
            ge=1,
            le=3600,
            description="how often the lease is renewed, ±10 % (jitter), and at most every half lease; also the pause "
            "between cycles",
        ),
    ] = 15

    @model_validator(mode="after")
    def _tls_only(self) -> "ControlPlaneConfig":
        if self.url.scheme != "https":
            raise ValueError(f"url must be https:// (mutual TLS is how the node proves who it is), got {self.url}")
        seen = {_same_url(self.url): "url"}
        for index, replica in enumerate(self.replica_urls):
            where = f"replica_urls[{index}]"
            if replica.scheme != "https":
                raise ValueError(
                    f"{where} must be https:// like url (mutual TLS is how the node proves who it is), got {replica}"
                )
            first = seen.setdefault(_same_url(replica), where)
            if first != where:
                # A URL twice would only make the agent knock twice on a dead replica before moving on.
                raise ValueError(
                    f"{where} ({replica}) is the same URL as {first}: list each replica once, and not url again"
                )
        return self


def _same_url(url: AnyHttpUrl) -> str:
    """What makes two URLs the same replica: pydantic has lowercased the host and dropped a default port, and the
    client ignores a trailing slash."""
    return str(url).rstrip("/")


class BackoffConfig(_Section):
    initial_seconds: Annotated[
        float, Field(gt=0, description="the first wait after the control plane could not be reached; doubles")
    ] = 1.0
    max_seconds: Annotated[float, Field(gt=0, description="the longest wait (with jitter) between retries")] = 60.0

    @model_validator(mode="after")
    def _ordered(self) -> "BackoffConfig":
        return _in_order(self, "initial_seconds", "max_seconds")


class CertificateRenewalConfig(_Section):
    """When the agent replaces its client certificate (and key) with a new one from the control plane."""

    # Renew once less than this fraction of the certificate's lifetime is left: a third of a 30-day
    # certificate is 10 days of retries before it lapses.
    remaining_fraction: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description="renew once less than this fraction (±10 %, drawn at start) of the certificate's lifetime "
            "is left",
        ),
    ] = 1 / 3
    retry_initial_seconds: Annotated[
        float, Field(gt=0, le=86400, description="the wait before retrying a failed renewal; doubles with jitter")
    ] = 60.0
    retry_max_seconds: Annotated[float, Field(gt=0, le=86400, description="the longest wait between retries")] = 3600.0

    @model_validator(mode="after")
    def _ordered(self) -> "CertificateRenewalConfig":
        return _in_order(self, "retry_initial_seconds", "retry_max_seconds")


class Journal(_Section):
    """The journal: each apply's ansible-runner artifacts directory, kept on the side that applies."""

    keep_runs: Annotated[int, Field(ge=1, le=10000, description="how many runs' directories are kept; older go")] = 20


class AirGap(_Section):
    """``mode: air-gapped`` (docs/AIR_GAP.md): bundles arrive in ``inbox``, signed records leave by ``outbox``."""

    inbox: str = Field(description="where bundles arrive; root's own directory under apply.via systemd")
    outbox: str = Field(description="where signed observations and journal summaries are written")
    # The inbox is re-scanned this often even without an inotify event (one may be lost: removable media
    # mounted over the inbox, a replaced directory).
    poll_seconds: Annotated[
        float, Field(gt=0, le=3600, description="how often the inbox is re-scanned without an inotify event")
    ] = 5.0


class Apply(_Section):
    """How the agent applies: ``in-process`` (ansible-runner in the agent, for dev and tests) or ``systemd``
    (the agent spools a request; ``meridian-node-apply.path`` starts the root unit that runs it)."""

    via: Literal["in-process", "systemd"] = Field(
        default="in-process",
        description="in-process: ansible-runner inside the agent; systemd: root's meridian-node-apply unit applies",
    )
    # The root apply unit's own directory (its StateDirectory=): its record of the applied generation and
    # highest epoch, its journal and ansible-runner dirs, the draining marks, and ``public/`` where it
    # answers. Root-owned; the agent only reads ``public/`` and ``draining/`` there.
    state_dir: str = Field(
        default=DEFAULT_STATE_DIR,
        description="root's directory under apply.via systemd (record, journal, public/ answers); apart from state_dir",
    )
    # Large model downloads run inside one apply: generous by default, never unbounded.
    timeout_seconds: Annotated[
        float, Field(gt=0, le=86400, description="how long one apply may take (under the split: the wait for root)")
    ] = 3600.0


class Supervision(_Section):
    """How the agent keeps the applied engines running (``supervise``): graces and the crash-loop backoff."""

    # Missing, not running or lost readiness this long is drift (Docker's restart policy goes first).
    settle_seconds: Annotated[
        float, Field(ge=0, le=3600, description="missing, stopped or unready this long is drift, repaired")
    ] = 10.0
    # Never ready this long after the apply is drift: engines load models for minutes.
    startup_grace_seconds: Annotated[
        float, Field(ge=0, le=86400, description="a new engine never ready this long after the apply is drift")
    ] = 600.0
    # kubelet's CrashLoopBackOff: 10 s doubling to 5 min, forgotten after 10 min healthy.
    backoff_initial_seconds: Annotated[
        float, Field(gt=0, le=3600, description="an engine's first wait between repairs; doubles per repair")
    ] = 10.0
    backoff_max_seconds: Annotated[float, Field(gt=0, le=86400, description="the longest wait between repairs")] = 300.0
    healthy_reset_seconds: Annotated[
        float, Field(ge=0, le=86400, description="healthy this long, an engine's backoff starts again from the first")
    ] = 600.0

    @model_validator(mode="after")
    def _ordered(self) -> "Supervision":
        return _in_order(self, "backoff_initial_seconds", "backoff_max_seconds")


class KubernetesConfig(_Section):
    """``mode: kubernetes-integrated`` (docs/KUBERNETES.md): where and how the agent reads the kubelet's
    PodResources API. Read in that mode only."""

    # The kubelet's PodResources socket; relative paths resolve against the config file's directory.
    pod_resources_socket: Annotated[str, Field(min_length=1, description="the kubelet's PodResources unix socket")] = (
        DEFAULT_POD_RESOURCES_SOCKET
    )
    # Each call's deadline: the kubelet answers from memory, in milliseconds.
    timeout_seconds: Annotated[float, Field(gt=0, le=60, description="each call's deadline")] = 2.0
    # The pods' devices are re-read at most this often (and at once after a failed read's next cycle); pods are
    # scheduled in seconds, and the observation is re-sent only when what it says changed.
    refresh_seconds: Annotated[
        float, Field(ge=0, le=3600, description="the pods' devices are re-read at most this often")
    ] = 10.0


class MetricsConfig(_Section):
    listen: Annotated[
        str,
        Field(pattern=r"^[0-9A-Za-z.:\[\]-]+:[0-9]{1,5}$", description="HOST:PORT of the Prometheus /metrics endpoint"),
    ] = "127.0.0.1:9464"


class Log(_Section):
    """The agent's log on stderr (the journal under systemd)."""

    format: Literal["json", "text"] = Field(
        default="json", description="json: one object per line, for collectors; text: for a terminal"
    )
    level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="the lowest level written")


class AgentConfig(_Section):
    node_id: NodeId = Field(description="this host's id at the control plane; its certificate is bound to it")
    mode: Mode = Field(default="observe-only", description="what the agent may do; the policy must allow it")
    policy: str = Field(default=DEFAULT_POLICY_PATH, description="the root-owned policy file the agent runs under")
    state_dir: str = Field(
        default=AGENT_STATE_DIR, description="the agent's own directory: identity, spool, status, oplog"
    )
    control_plane: ControlPlaneConfig | None = Field(
        default=None, description="where desired state comes from; required in every mode but air-gapped"
    )
    backoff: BackoffConfig = Field(
        default_factory=BackoffConfig, description="retries while the control plane cannot be reached"
    )
    certificate_renewal: CertificateRenewalConfig = Field(
        default_factory=CertificateRenewalConfig, description="when the client certificate is renewed"
    )
    journal: Journal = Field(default_factory=Journal, description="how many apply runs are kept")
    apply: Apply = Field(default_factory=Apply, description="who applies a verified desired state")
    supervision: Supervision = Field(
        default_factory=Supervision, description="repairing engines that died or were changed by hand"
    )
    air_gap: AirGap | None = Field(default=None, description="inbox and outbox; required in mode air-gapped")
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig, description="the kubelet's PodResources API, mode kubernetes-integrated"
    )
    metrics: MetricsConfig | None = Field(default=None, description="a Prometheus endpoint; absent, none is served")
    log: Log = Field(default_factory=Log, description="the agent's log")

    @model_validator(mode="after")
    def _mode_needs(self) -> "AgentConfig":
        if self.mode == "air-gapped" and self.air_gap is None:
            raise ValueError("mode air-gapped needs an 'air_gap' section with 'inbox' and 'outbox'")
        if self.mode != "air-gapped" and self.control_plane is None:
            raise ValueError(f"mode {self.mode} needs a 'control_plane' section with a 'url'")
        return self

    @property
    def identity_dir(self) -> Path:
        return Path(self.state_dir) / "identity"

    @property
    def record_dir(self) -> Path:
        """Where the record that decides lives: the root unit's directory under the split, else the agent's."""
        return Path(self.apply.state_dir if self.apply.via == "systemd" else self.state_dir)


def default_config_path() -> str:
    return os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_PATH)


def load_config(path: os.PathLike[str] | str) -> AgentConfig:
    """Read and validate the config; relative paths in it resolve against the config file's directory."""
    source = os.fspath(path)
    what = f"config {source}"
    try:
        data = parse_yaml(read_text_file(source, what=what), what=what)
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: the top level must be a mapping with at least 'node_id'")
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{what}: {describe_validation_error(exc)}") from exc
    base = Path(source).resolve().parent
    resolved = config.model_copy(
        update={
            "policy": str(base / config.policy),
            "state_dir": str(base / config.state_dir),
            "apply": config.apply.model_copy(update={"state_dir": str(base / config.apply.state_dir)}),
            "kubernetes": config.kubernetes.model_copy(
                update={"pod_resources_socket": str(base / config.kubernetes.pod_resources_socket)}
            ),
            "air_gap": None
            if config.air_gap is None
            else config.air_gap.model_copy(
                update={"inbox": str(base / config.air_gap.inbox), "outbox": str(base / config.air_gap.outbox)}
            ),
        }
    )
    if resolved.apply.via == "systemd":
        agent_dir, root_dir = os.path.normpath(resolved.state_dir), os.path.normpath(resolved.apply.state_dir)
        if os.path.commonpath([agent_dir, root_dir]) in (agent_dir, root_dir):
            raise ConfigError(
                f"{what}: apply.state_dir ({root_dir}) and state_dir ({agent_dir}) must be separate directories, "
                "neither inside the other: the agent can rename anything under its own directory, so the root "
                f"apply unit keeps its record and journal apart (default {DEFAULT_STATE_DIR})"
            )
    return resolved


def config_for_verb(path: os.PathLike[str] | str) -> AgentConfig:
    """``load_config`` for a command-line verb: a config that cannot be used is the caller's usage error (exit 2
    with the file and the problem named), not a traceback."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def policy_for_run(config: AgentConfig) -> Policy:
    """The host policy ``run`` works under, refused when it cannot be read or when it (or this build)
    does not allow the configured mode."""
    try:
        policy = load_policy(config.policy)
    except PolicyError as exc:
        raise UsageError(str(exc)) from exc
    refusal = policy.mode_allowed(config.mode) or mode_unavailable(config.mode, config.apply.via)
    if refusal:
        raise UsageError(f"mode: {refusal}")
    return policy

"""Glue between a driver's launch settings and the Docker adapter, and the engine's HTTP probes.

A driver says how its engine runs (command, port, mounts, GPUs, stop signal) without knowing about
Docker; the adapter creates containers without knowing about engines. This module joins them with what
only the host knows (the container name, the policy's bind address), and reads an engine's readiness
and in-flight gauges over HTTP the way its driver says to.
"""

from __future__ import annotations

import socket

from ansible_collections.meridian.node.plugins.module_utils.docker._http import HttpLiteError, exchange
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    BindMount,
    ContainerSettings,
    PortBinding,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import (
    Driver,
    InFlight,
    LaunchSettings,
    ProbeVerdict,
    in_flight,
)

__all__ = ["HttpAnswer", "container_settings", "http_get", "probe_readiness", "read_in_flight"]

# Health and metrics pages are small; anything bigger is not what we asked for.
_MAX_BODY = 1024 * 1024


def container_settings(*, name: str, driver: str, launch: LaunchSettings, bind_address: str) -> ContainerSettings:
    """The Docker settings for engine ``name``: the driver's launch, published on ``bind_address`` only."""
    return ContainerSettings(
        name=name,
        instance=name,
        driver=driver,
        image=launch.image,
        command=launch.command,
        entrypoint=launch.entrypoint,
        env=dict(launch.environment),
        secret_env=dict(launch.secret_environment),
        port=PortBinding(container_port=launch.container_port, host_port=launch.host_port, host_ip=bind_address),
        mounts=tuple(BindMount(m.source, m.target, m.read_only) for m in launch.mounts),
        gpus=launch.gpu_device_ids,
        stop_signal=launch.stop_signal,
        stop_timeout_s=launch.stop_timeout_s,
        restart_policy=launch.restart_policy,
        shm_size_mib=launch.shm_size_mib,
        ipc_mode=launch.ipc_mode,
        ulimits=launch.ulimits,
    )


class HttpAnswer:
    """Status and (capped) body of one GET; ``status`` None when nothing answered."""

    def __init__(self, status: int | None, body: str, error: str | None = None) -> None:
        self.status = status
        self.body = body
        self.error = error


def http_get(host: str, port: int, path: str, timeout_s: float = 2.0) -> HttpAnswer:
    """One GET with a timeout; refused, reset and timed-out connections and garbled answers are 'nothing
    answered'. A body beyond 1 MiB is cut there (a health or metrics page never needs more)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            answer = exchange(
                sock,
                "GET",
                path,
                host=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                headers={"Accept": "*/*"},
                max_body=_MAX_BODY,
                truncate=True,
            )
    except (OSError, HttpLiteError) as exc:
        return HttpAnswer(None, "", error=f"{type(exc).__name__}: {exc}")
    return HttpAnswer(answer.status, answer.body.decode("utf-8", errors="replace"))


def probe_readiness(driver: Driver, host: str, port: int, timeout_s: float = 2.0) -> ProbeVerdict:
    """Ask the engine's health endpoint once and read the answer the way its driver says."""
    answer = http_get(host, port, driver.facts.health_path, timeout_s)
    return driver.interpret_probe(answer.status, answer.body)


def read_in_flight(driver: Driver, host: str, port: int, timeout_s: float = 2.0) -> InFlight | None:
    """The engine's running and waiting gauges; None when it has no metrics or did not answer."""
    if not driver.facts.has_metrics or driver.facts.metrics_path is None:
        return None
    answer = http_get(host, port, driver.facts.metrics_path, timeout_s)
    if answer.status != 200:
        return None
    return in_flight(answer.body, driver.facts)

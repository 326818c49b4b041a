"""Counting seams: prove that a run of the agent changed nothing by counting what it asked of Docker and NVML.

- ``counting_nvml(fake)``: a module that stands for ``pynvml`` (put it where the NVML seam looks,
  ``gpu.nvml._pynvml``). It is the fake pynvml (tests/support/fakes/pynvml.py) with every ``nvml*`` function
  wrapped to count its calls, and a module ``__getattr__`` that counts a look-up of any ``nvml*`` name the fake
  does not have (a setter the fake never needed is still seen asked for) before it raises AttributeError.
- ``count_docker_requests(monkeypatch)``: every Docker Engine API request the process makes through
  ``DockerApi._request`` (the one door of the stdlib client the agent and the modules use), by method and path,
  counted before it is sent.
- ``NVML_READS``: the read-only allow-list; ``outside_reads`` names whatever was asked beyond it.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi

__all__ = [
    "DOCKER_READS",
    "NVML_CHANGES",
    "NVML_READS",
    "count_docker_requests",
    "counting_nvml",
    "outside_reads",
]

# What NVML offers that only reads: init and shutdown of this process's handle, system and device getters, the
# event set this process waits on (registering for events changes nothing on the GPU), MIG instance getters.
NVML_READS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGet",
    "nvmlDeviceGet",
    "nvmlEventSetCreate",
    "nvmlEventSetWait",
    "nvmlEventSetFree",
    "nvmlDeviceRegisterEvents",
    "nvmlGpuInstanceGet",
    "nvmlComputeInstanceGet",
)
# What changes a GPU (named so that a failure says which kind it was): setters, resets, clears, MIG changes.
NVML_CHANGES = (
    "nvmlDeviceSet",
    "nvmlDeviceReset",
    "nvmlDeviceClear",
    "nvmlGpuInstanceCreate",
    "nvmlGpuInstanceDestroy",
    "nvmlComputeInstanceCreate",
    "nvmlComputeInstanceDestroy",
)
DOCKER_READS = ("GET", "HEAD")


def counting_nvml(fake: ModuleType) -> tuple[ModuleType, Counter[str]]:
    """A module standing for ``pynvml``: the fake, each ``nvml*`` call counted (and each look-up of a missing one)."""
    counted: Counter[str] = Counter()
    module = ModuleType("pynvml")
    for name, value in vars(fake).items():
        if name.startswith("nvml") and callable(value):
            setattr(module, name, _counted(name, value, counted))
        elif not name.startswith("__"):
            setattr(module, name, value)

    def missing(name: str) -> Any:
        if name.startswith("nvml"):
            counted[name] += 1
        raise AttributeError(f"the fake pynvml has no {name}")

    module.__getattr__ = missing  # type: ignore[method-assign]
    return module, counted


def _counted(name: str, function: Callable[..., Any], counted: Counter[str]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        counted[name] += 1
        return function(*args, **kwargs)

    return call


def outside_reads(names: Iterable[str]) -> list[str]:
    """The NVML names asked for that are not on the read-only allow-list."""
    return sorted(name for name in names if not name.startswith(NVML_READS))


def count_docker_requests(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """Every Docker Engine API request from now to the end of the test, as (method, path), counted before sending."""
    requests: Counter[tuple[str, str]] = Counter()
    send = DockerApi._request

    def counting(self: DockerApi, method: str, path: str, action: str, **kwargs: Any) -> Any:
        requests[(method.upper(), path)] += 1
        return send(self, method, path, action, **kwargs)

    monkeypatch.setattr(DockerApi, "_request", counting)
    return requests

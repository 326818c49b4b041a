"""GPU feature discovery's vocabulary: the ``nvidia.com/*`` node labels GFD would write for these facts.

Learnt from NVIDIA/k8s-device-plugin ``internal/lm`` (the labelers) and ``docs/gpu-feature-discovery``; pure
functions of the facts ``gpu.facts`` read, plus the DMI product name. docs/GPU_FACTS.md lists the labels,
the ones we do not write and why, and where we choose what GFD leaves to chance (Go map order).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DMI_PRODUCT_NAME",
    "MIG_ATTRIBUTE_LABELS",
    "architecture_family",
    "gfd_labels",
    "mig_strategy",
    "read_machine_type",
    "sanitise",
]

DMI_PRODUCT_NAME = "/sys/class/dmi/id/product_name"  # GFD's --machine-type-file default
_MACHINE_TYPE_MAX_BYTES = 4096  # a DMI string is at most 255 bytes; anything longer is not one
_UNWANTED = re.compile(r"[^A-Za-z0-9\-_. ]")
_PREFIX = "nvidia.com/"
# Compute capability major -> family, where the minor does not matter. Blackwell comes as 10.x (data
# centre) and 12.x (workstation and GeForce).
_FAMILIES = {
    1: "tesla",
    2: "fermi",
    3: "kepler",
    5: "maxwell",
    6: "pascal",
    9: "hopper",
    10: "blackwell",
    12: "blackwell",
    13: "rubin",
}
# MIG device attributes (nvmlDeviceGetAttributes) -> GFD's label suffix.
MIG_ATTRIBUTE_LABELS = (
    ("memorySizeMB", "memory"),
    ("multiprocessorCount", "multiprocessors"),
    ("gpuInstanceSliceCount", "slices.gi"),
    ("computeInstanceSliceCount", "slices.ci"),
    ("sharedCopyEngineCount", "engines.copy"),
    ("sharedDecoderCount", "engines.decoder"),
    ("sharedEncoderCount", "engines.encoder"),
    ("sharedJpegCount", "engines.jpeg"),
    ("sharedOfaCount", "engines.ofa"),
)


def sanitise(text: str) -> str:
    """GFD's label value: only letters, digits, ``-_.`` and spaces kept, runs of spaces made one ``-``."""
    return "-".join(_UNWANTED.sub("", text).split())


def architecture_family(major: int, minor: int) -> str:
    """The family GFD names for a CUDA compute capability (``nvidia.com/gpu.family``)."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILIES.get(major, "undefined")


def read_machine_type(path: str | None = DMI_PRODUCT_NAME) -> str | None:
    """The DMI product name, sanitised as GFD's ``gpu.machine``; None where it cannot be read (VMs and
    containers often have no DMI, and ``None`` is not an error: GFD labels it ``unknown``)."""
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            data = file.read(_MACHINE_TYPE_MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > _MACHINE_TYPE_MAX_BYTES:
        return None
    return sanitise(data.decode(errors="replace").strip()) or None


def _mig_profile(profile: str) -> str:
    # NVML spells media-extension profiles "1g.10gb+me"; GFD's resource names use "." for "+".
    return profile.replace("+", ".")


def _mig_devices(gpus: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    return [(gpu, instance) for gpu in gpus if gpu.get("mig_mode") for instance in gpu.get("mig_instances") or ()]


def mig_strategy(gpus: Sequence[Mapping[str, Any]]) -> str:
    """The MIG strategy that fits what NVML shows, as GFD would accept it.

    GFD takes the strategy as configuration; we derive the one it would label without complaint:
    ``none`` when no GPU has MIG on; ``single`` when every GPU has MIG on, none is without MIG devices
    and all of them share one profile (GFD's conditions for a valid single strategy, else it writes
    ``MIG-INVALID``); ``mixed`` otherwise.
    """
    enabled = [gpu for gpu in gpus if gpu.get("mig_mode")]
    if not enabled:
        return "none"
    profiles = {_mig_profile(str(instance.get("profile"))) for _gpu, instance in _mig_devices(gpus)}
    if len(enabled) == len(gpus) and all(gpu.get("mig_instances") for gpu in enabled) and len(profiles) == 1:
        return "single"
    return "mixed"


def _version_labels(facts: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = {}
    driver = facts.get("driver_version")
    driver = driver if isinstance(driver, str) else ""
    parts = driver.split(".") if driver else []
    # GFD refuses a driver version that is not X.Y[.Z]; so do we, by writing no driver labels.
    if 2 <= len(parts) <= 3:
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        labels.update(
            {
                "cuda.driver.major": major,
                "cuda.driver.minor": minor,
                "cuda.driver.rev": rev,
                "cuda.driver-version.major": major,
                "cuda.driver-version.minor": minor,
                "cuda.driver-version.revision": rev,
                "cuda.driver-version.full": driver,
            }
        )
    cuda = facts.get("cuda_driver_version")
    if isinstance(cuda, str) and "." in cuda:
        cuda_major, _dot, cuda_minor = cuda.partition(".")
        labels.update(
            {
                "cuda.runtime.major": cuda_major,
                "cuda.runtime.minor": cuda_minor,
                "cuda.runtime-version.major": cuda_major,
                "cuda.runtime-version.minor": cuda_minor,
                "cuda.runtime-version.full": cuda,
            }
        )
    return labels


def _resource_labels(resource: str, device: Mapping[str, Any], count: int, *, replicas: int) -> dict[str, str]:
    """GFD's labels for a full-GPU resource of one product: product, count, sharing, memory, architecture."""
    labels = {
        f"{resource}.product": sanitise(str(device["name"])),
        f"{resource}.count": str(count),
        f"{resource}.replicas": str(replicas),
        f"{resource}.sharing-strategy": "none",
    }
    memory = (device.get("memory") or {}).get("total_mib")
    if memory:
        labels[f"{resource}.memory"] = str(memory)
    capability = device.get("compute_capability")
    if capability:
        major, _dot, minor = str(capability).partition(".")
        if major.isdigit() and minor.isdigit() and int(major) != 0:
            labels[f"{resource}.family"] = architecture_family(int(major), int(minor))
            labels[f"{resource}.compute.major"] = major
            labels[f"{resource}.compute.minor"] = minor
    return labels


def _full_gpu_labels(gpus: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    named = [gpu for gpu in gpus if gpu.get("name")]
    counts: dict[str, int] = {}
    for gpu in named:
        counts[gpu["name"]] = counts.get(gpu["name"], 0) + 1
    labels: dict[str, str] = {}
    # GFD labels a product through its last GPU of that name, MIG-enabled ones first (without sharing,
    # so replicas 0) and full GPUs over them. With several products GFD's winner is Go's map order, i.e.
    # chance; ours is the product of the lowest-index GPU, written last.
    for mig_enabled in (True, False):
        group = [gpu for gpu in named if bool(gpu.get("mig_mode")) is mig_enabled]
        representative: dict[str, Mapping[str, Any]] = {}
        for gpu in group:
            representative[gpu["name"]] = gpu
        order = sorted(representative, key=lambda name: -min(gpu["index"] for gpu in group if gpu["name"] == name))
        for name in order:
            labels.update(
                _resource_labels(f"{_PREFIX}gpu", representative[name], counts[name], replicas=0 if mig_enabled else 1)
            )
    return labels


def _mig_labels(
    gpus: Sequence[Mapping[str, Any]], strategy: str, mig_attributes: Mapping[str, Mapping[str, int]]
) -> dict[str, str]:
    # Per profile, in enumeration order: its first MIG device stands for it (as in GFD), and a count.
    first: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    counts: dict[str, int] = {}
    for gpu, instance in _mig_devices(gpus):
        profile = _mig_profile(str(instance.get("profile")))
        first.setdefault(profile, (gpu, instance))
        counts[profile] = counts.get(profile, 0) + 1
    labels: dict[str, str] = {f"{_PREFIX}mig.strategy": strategy}
    for profile, (gpu, instance) in first.items():
        resource = f"{_PREFIX}gpu" if strategy == "single" else f"{_PREFIX}mig-{profile}"
        labels.update(
            {
                f"{resource}.product": "-".join(
                    part for part in (sanitise(str(gpu.get("name") or "")), "MIG", sanitise(profile)) if part
                ),
                f"{resource}.count": str(counts[profile]),
                f"{resource}.replicas": "1",
                f"{resource}.sharing-strategy": "none",
            }
        )
        attributes = mig_attributes.get(str(instance.get("uuid")), {})
        for attribute, suffix in MIG_ATTRIBUTE_LABELS:
            if attribute in attributes:
                labels[f"{resource}.{suffix}"] = str(attributes[attribute])
    return labels


def gfd_labels(
    facts: Mapping[str, Any], *, mig_attributes: Mapping[str, Mapping[str, int]] | None = None
) -> dict[str, str]:
    """The labels GFD (default configuration: no sharing, no timestamp) would write for ``facts``.

    ``facts`` are ``gpu.facts``' host facts with ``machine_type`` and ``mig_strategy`` set;
    ``mig_attributes`` maps a MIG uuid to its ``nvmlDeviceGetAttributes`` fields. A host without NVML or
    without GPUs gets none, as GFD writes none there.
    """
    gpus: Sequence[Mapping[str, Any]] = facts.get("gpus") or ()
    if not facts.get("nvml_available") or not gpus:
        return {}
    labels: dict[str, str] = {
        "gpu.machine": facts.get("machine_type") or "unknown",
        "mig.capable": "true" if any(gpu.get("mig_capable") for gpu in gpus) else "false",
        # Only an MPS sharing configuration makes GFD write "true"; meridian.node configures no sharing.
        "mps.capable": "false",
    }
    labels.update(_version_labels(facts))
    result = {f"{_PREFIX}{key}": value for key, value in labels.items()}
    result.update(_full_gpu_labels(gpus))
    strategy = facts.get("mig_strategy")
    if strategy in ("single", "mixed"):
        result.update(_mig_labels(gpus, strategy, mig_attributes or {}))
    return dict(sorted(result.items()))

"""``meridian.node.gpu_facts``'s arguments and what a run of it returns (``plugins/modules/gpu_facts.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

ARGUMENT_SPEC: dict[str, Any] = {
    "gather_processes": {"type": "bool", "default": True},
    "gather_nvlink": {"type": "bool", "default": True},
    "gather_health": {"type": "bool", "default": True},
}


def gpu_facts_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """The facts as ``ansible_facts.meridian_gpus``; never a change, so the same in check mode. A host without
    NVML is a fact (``nvml_available: false``), not a failure; so is a GPU whose health verdict is bad. An ad-hoc
    read has no earlier read to compare with, so the rules about rising counters cannot fire, and it sees only
    the XIDs that happen while it reads (docs/GPU_FACTS.md)."""
    del check_mode  # read-only
    facts = collect_gpu_facts(
        processes=params["gather_processes"], nvlink=params["gather_nvlink"], health=params["gather_health"]
    )
    return {"changed": False, "ansible_facts": {"meridian_gpus": facts}}

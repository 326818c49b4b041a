"""``meridian.node.gpu_facts``'s arguments and what a run of it returns (``plugins/modules/gpu_facts.py``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.plugins.module_utils.gpu.nvml import PYNVML_IMPORT_ERROR

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
    result: dict[str, Any] = {"changed": False, "ansible_facts": {"meridian_gpus": facts}}
    if PYNVML_IMPORT_ERROR is not None:
        # No driver is a fact of the host; no pynvml is the wrong interpreter (discovery found a shim or a
        # system python3), which only a warning puts where an ad-hoc run looks.
        result["warnings"] = [
            f"gpu_facts ran on {sys.executable}, which lacks the Python package nvidia-ml-py (module pynvml), so "
            "no GPU was read: set ansible_python_interpreter to a Python that has it (the agent's virtualenv, "
            "/opt/meridian-node/bin/python, does), or install it for this one (pip install nvidia-ml-py)"
        ]
    return result

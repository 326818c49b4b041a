"""Load the fake pynvml (tests/support/fakes/pynvml.py) in-process, for tests and benchmarks.

It is loaded under its own name, so the real pynvml that the seam may have imported stays untouched in
``sys.modules``; subprocesses get the fake instead by putting tests/support/fakes first on PYTHONPATH.
"""

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

FAKES = Path(__file__).resolve().parent / "fakes"


def load_fake_pynvml() -> ModuleType:
    spec = importlib.util.spec_from_file_location("meridian_fake_pynvml", FAKES / "pynvml.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the fake pynvml from {FAKES}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def two_healthy_gpus(**gpu1: Any) -> dict[str, Any]:
    """Two healthy H100s: the xid-79 scenario without its XID. ``gpu1``: keys changed on GPU 1 (the volatile-dbe
    scenario's GPU 1 is this one with its ECC changed)."""
    scenario: dict[str, Any] = json.loads((FAKES / "nvml_scenarios" / "xid-79.json").read_text())
    for gpu in scenario["gpus"]:
        gpu.pop("events", None)
    scenario["gpus"][1].update(copy.deepcopy(gpu1))
    return scenario

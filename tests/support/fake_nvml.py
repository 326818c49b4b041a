"""Load the fake pynvml (tests/support/fakes/pynvml.py) in-process, for tests and benchmarks.

It is loaded under its own name, so the real pynvml that the seam may have imported stays untouched in
``sys.modules``; subprocesses get the fake instead by putting tests/support/fakes first on PYTHONPATH.
"""

import importlib.util
from pathlib import Path
from types import ModuleType

FAKES = Path(__file__).resolve().parent / "fakes"


def load_fake_pynvml() -> ModuleType:
    spec = importlib.util.spec_from_file_location("meridian_fake_pynvml", FAKES / "pynvml.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the fake pynvml from {FAKES}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

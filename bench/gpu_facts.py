"""How long gpu_facts takes for 0, 8 and 64 GPUs: in-process, as a module process, and via Ansible; and what the
health read adds per GPU.

    .venv/bin/python bench/gpu_facts.py [--repeat N] [--no-ansible] [--health-only]

The GPUs are the fake pynvml's (tests/support/fakes): this measures our own cost per cycle (Python work per
NVML call, imports, process start), not the driver's. The health table reads 8 healthy H100s the way the
agent does (processes and NVLink peers off, then ``GpuFacts.model_validate`` as ``Observer.gpu`` does) and
the way the module does (everything on), with health off, on with a set per read, and on with an
``XidWatch`` kept open: NVML calls per read and per GPU, and the time. The agent re-reads GPU facts every
``gpu_refresh_s`` (30 s) and serves the cached facts in between, so this is the cost of its refresh cycle,
not of every cycle. Where a real NVIDIA GPU is present it also times the real module against
`nvidia-smi -q -x`, the usual alternative, and prints the ratio. Every figure is the median of repeated runs.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "support" / "fakes"
COLLECTIONS = REPO / ".build" / "collections"
MODULE = REPO / "plugins" / "modules" / "gpu_facts.py"
ANSIBLE = Path(sys.executable).parent / "ansible"
SIZES = (0, 8, 64)

sys.path.insert(0, str(COLLECTIONS))
from timing import median_seconds  # noqa: E402

from ansible_collections.meridian.node.plugins.module_utils.contracts import GpuFacts  # noqa: E402
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import (  # noqa: E402
    collect_gpu_facts,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.xid_events import XidWatch  # noqa: E402
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml  # noqa: E402


def module_env(scenario: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(COLLECTIONS)}
    env.pop("MERIDIAN_FAKE_NVML_SCENARIO", None)
    if scenario is not None:
        env["PYTHONPATH"] = f"{FAKES}{os.pathsep}{COLLECTIONS}"
        env["MERIDIAN_FAKE_NVML_SCENARIO"] = scenario
    return env


def run_module_process(args_file: Path, env: dict[str, str], expect: int | None) -> None:
    # What AnsiballZ ends up doing on the host: a fresh interpreter runs the module with its args.
    proc = subprocess.run(
        [sys.executable, str(MODULE), str(args_file)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"gpu_facts module failed (rc {proc.returncode}): {proc.stdout}{proc.stderr}")
    facts = json.loads(proc.stdout)["ansible_facts"]["meridian_gpus"]
    if expect is not None and facts["count"] != expect:
        raise SystemExit(f"expected {expect} GPUs from the fake, the module saw {facts['count']}")


def run_adhoc(env: dict[str, str]) -> None:
    env = {
        **env,
        "ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS),
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
    }
    subprocess.run(
        [str(ANSIBLE), "localhost", "-c", "local", "-i", "localhost,", "-m", "meridian.node.gpu_facts"],
        env=env,
        capture_output=True,
        check=True,
    )


def real_gpu_reason() -> str | None:
    """None where a real GPU can be read, else why not."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"nvmlInit failed: {exc}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    return None if count else "NVML sees no GPU"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:9.1f} ms"


HEALTH_GPUS = 8


def fine(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def health_table(fake: Any, repeat: int) -> None:
    """NVML calls and time of one read of 8 GPUs, health off and on, as the agent and as the module read."""
    fake.use_scenario(fake.generate_scenario(HEALTH_GPUS))
    print(f"health read on the fake seam, {HEALTH_GPUS} healthy H100s, median of {repeat} reads")
    print(f"{'read':<34}{'calls':>7}{'calls/GPU':>11}{'read':>12}{'read+model':>12}{'per GPU':>11}")
    measured: dict[str, tuple[int, float]] = {}
    with XidWatch() as watch:
        rows: list[tuple[str, dict[str, Any]]] = [
            ("agent, health off", {"processes": False, "nvlink": False, "health": False}),
            ("agent, health on, set per read", {"processes": False, "nvlink": False}),
            ("agent, health on, XidWatch", {"processes": False, "nvlink": False, "xids": watch}),
            ("module, health off", {"health": False}),
            ("module, health on", {}),
        ]
        for label, options in rows:

            def read(options: dict[str, Any] = options) -> dict[str, Any]:
                return collect_gpu_facts(fake, machine_type_path=None, **options)

            read()  # the watch opens its set on the first read; count a steady read
            fake.calls.clear()
            read()
            calls = sum(count for name, count in fake.calls.items() if name.startswith("nvml"))
            took = median_seconds(read, repeat)
            validated = median_seconds(lambda: GpuFacts.model_validate(read()), repeat)
            measured[label] = (calls, validated)
            print(
                f"{label:<34}{calls:>7}{calls / HEALTH_GPUS:>11.1f}{fine(took):>12}"
                f"{fine(validated):>12}{fine(validated / HEALTH_GPUS):>11}"
            )
    (off_calls, off_time), (on_calls, on_time) = measured["agent, health off"], measured["agent, health on, XidWatch"]
    print(
        f"health adds {(on_calls - off_calls) / HEALTH_GPUS:.1f} NVML calls and "
        f"{fine((on_time - off_time) / HEALTH_GPUS)} per GPU to the agent's GPU refresh (every gpu_refresh_s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15, help="runs per figure (in-process: 10x this)")
    parser.add_argument("--no-ansible", action="store_true", help="skip the `ansible -m` timings (~1 s each)")
    parser.add_argument("--health-only", action="store_true", help="print only the health read table")
    options = parser.parse_args()
    repeat = max(1, options.repeat)

    fake = load_fake_pynvml()
    health_table(fake, 10 * repeat)
    if options.health_only:
        return
    print()
    print(f"gpu_facts timings, median of {repeat} runs ({10 * repeat} in-process)")
    print(f"{'GPUs':>5}  {'in-process':>12}  {'module process':>14}  {'ansible -m':>12}")
    with tempfile.TemporaryDirectory() as scratch:
        args_file = Path(scratch) / "args.json"
        args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {}}))
        for size in SIZES:
            fake.use_scenario(fake.generate_scenario(size))
            in_process = median_seconds(lambda: collect_gpu_facts(fake), 10 * repeat)
            env = module_env(f"generated:{size}")
            process = median_seconds(partial(run_module_process, args_file, env, size), repeat)
            adhoc = "-" if options.no_ansible else milliseconds(median_seconds(partial(run_adhoc, env), repeat))
            print(f"{size:>5}  {milliseconds(in_process):>12}  {milliseconds(process):>14}  {adhoc:>12}")

        reason = real_gpu_reason()
        if reason is not None:
            print(f"real GPU: not measured ({reason})")
            return
        real_env = module_env(None)
        real_in_process = median_seconds(collect_gpu_facts, 10 * repeat)
        real_module = median_seconds(lambda: run_module_process(args_file, real_env, None), repeat)
        print(f"real GPU: in-process {milliseconds(real_in_process)}, module process {milliseconds(real_module)}")
        smi = shutil.which("nvidia-smi")
        if smi is None:
            print("real GPU: nvidia-smi is not on PATH, no comparison")
            return
        real_smi = median_seconds(lambda: subprocess.run([smi, "-q", "-x"], capture_output=True, check=True), repeat)
        print(
            f"real GPU: nvidia-smi -q -x {milliseconds(real_smi)}; "
            f"nvidia-smi / gpu_facts module = {real_smi / real_module:.2f}"
        )


if __name__ == "__main__":
    main()

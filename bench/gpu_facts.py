"""How long gpu_facts takes for 0, 8 and 64 GPUs: in-process, as a module process, and via Ansible.

    .venv/bin/python bench/gpu_facts.py [--repeat N] [--no-ansible]

The GPUs are the fake pynvml's (tests/support/fakes): this measures our own cost per cycle (Python work per
NVML call, imports, process start), not the driver's. Where a real NVIDIA GPU is present it also
times the real module against `nvidia-smi -q -x`, the usual alternative, and prints the ratio.
Every figure is the median of repeated runs.
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

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "support" / "fakes"
COLLECTIONS = REPO / ".build" / "collections"
MODULE = REPO / "plugins" / "modules" / "gpu_facts.py"
ANSIBLE = Path(sys.executable).parent / "ansible"
SIZES = (0, 8, 64)

sys.path.insert(0, str(COLLECTIONS))
from timing import median_seconds  # noqa: E402

from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import (  # noqa: E402
    collect_gpu_facts,
)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15, help="runs per figure (in-process: 10x this)")
    parser.add_argument("--no-ansible", action="store_true", help="skip the `ansible -m` timings (~1 s each)")
    options = parser.parse_args()
    repeat = max(1, options.repeat)

    fake = load_fake_pynvml()
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

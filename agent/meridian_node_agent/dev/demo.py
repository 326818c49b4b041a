"""``make demo``: the main job on an embedded default, run with the real tools and shown step by step.

1. GPU facts for this host through Ansible (``ansible localhost -m meridian.node.gpu_facts``).
2. The trust loop: keys, a policy, a signed desired state, verified and recorded as applied; then the
   attacks the host refuses (replay, tampering, an unknown signer, another node, expiry, a fenced epoch).
3. The whole loop (``dev.demo_loop``): devserver, enrolled agent, a published state with one engine, applied
   through ansible-runner onto Docker, the status table and the serving projection.

Everything happens in a temporary directory that is removed afterwards.
"""

import base64
import json
import os
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from meridian_node_agent.dev.demo_loop import whole_loop

BIN = Path(sys.executable).parent
COLLECTIONS = Path(__file__).resolve().parents[3] / ".build" / "collections"
NODE_ID = "demo-gpu-node"


def banner(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 74 - len(title)))


def run(argv: list[str], *, cwd: Path, show: bool = True, env: dict[str, str] | None = None) -> str:
    """Run a real command, echo it like a shell would, and return its standard output."""
    shown = " ".join(shlex.quote(str(Path(a).name) if i == 0 else str(a)) for i, a in enumerate(argv))
    if show:
        print(f"$ {shown}")
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    output = done.stdout.strip()
    if show and output:
        print(output)
    if show and done.returncode:
        print(f"(exit {done.returncode}) {done.stderr.strip()}".rstrip())
    return output


def gpu_facts(workdir: Path) -> None:
    banner("1. GPU facts on this host (ansible localhost -m meridian.node.gpu_facts)")
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=str(COLLECTIONS),
        ANSIBLE_PYTHON_INTERPRETER=sys.executable,
        ANSIBLE_NOCOLOR="1",
    )
    argv = [str(BIN / "ansible"), "localhost", "-c", "local", "-i", "localhost,", "-m", "meridian.node.gpu_facts"]
    print(f"$ {' '.join(Path(a).name if i == 0 else a for i, a in enumerate(argv))}")
    output = run(argv, cwd=workdir, show=False, env=env)
    try:
        # Ad-hoc output is "localhost | SUCCESS => {json}".
        result = json.loads(output.split("=>", 1)[1])
    except (ValueError, IndexError):
        print(f"could not read the module's result:\n{output}")
        return
    facts = result["ansible_facts"]["meridian_gpus"]
    if not facts["nvml_available"]:
        print(f"nvml_available: false — {facts['reason']}")
        print("(no NVIDIA driver here: the module reports why instead of failing)")
        return
    print(f"driver {facts['driver_version']}, CUDA {facts['cuda_driver_version']}, {facts['count']} GPU(s)")
    for gpu in facts["gpus"]:
        memory = gpu["memory"]
        print(
            f"  [{gpu['index']}] {gpu['name']}  {memory['used_mib']}/{memory['total_mib']} MiB  "
            f"util {gpu['utilization_gpu_percent']}%  MIG {gpu['mig_mode']}  {gpu['error'] or ''}"
        )


def desired_state(generation: int, epoch: int, *, node_id: str = NODE_ID, ttl: timedelta = timedelta(hours=1)) -> str:
    now = datetime.now(UTC).replace(microsecond=0)
    document: dict[str, Any] = {
        "apiVersion": "meridian.node/v1",
        "kind": "DesiredState",
        "node_id": node_id,
        "generation": generation,
        "lease_epoch": epoch,
        "issued_at": format_rfc3339(now),
        "expires_at": format_rfc3339(now + ttl),
        "artifacts": [],
        "engines": [
            {
                "name": "chat",
                "driver": "vllm",
                "image": "registry.internal.example/vllm/vllm-openai@sha256:" + "4f" * 32,
                "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                "port": 8000,
            }
        ],
    }
    return json.dumps(document, indent=2) + "\n"


def trust_loop(workdir: Path) -> None:
    cli = [str(BIN / "meridian-node")]
    banner("2. Keys and a policy")
    run([*cli, "keygen", "--out", "control.pem"], cwd=workdir)
    run([*cli, "keygen", "--out", "intruder.pem"], cwd=workdir, show=False)
    (workdir / "policy.yaml").write_text(
        "trust:\n"
        "  control: {threshold: 1, public_keys: [control.pub.pem]}\n"
        "  artifact: {threshold: 1, public_keys: [control.pub.pem]}\n"
        "  air_gap_authority: {threshold: 1, public_keys: [control.pub.pem]}\n"
        "images: {allowed_repositories: [registry.internal.example/vllm/vllm-openai], require_digest: true}\n"
        "engines: {allowed_drivers: [vllm], bind_address: 127.0.0.1, port_range: [8000, 8999]}\n"
        f"store: {{path: {workdir / 'store'}, max_bytes: 10G}}\n",
        encoding="utf-8",
    )
    print("policy.yaml trusts control.pub.pem for every role (threshold 1)")

    banner("3. Sign desired state generation 2 and apply it")
    for name, text in {
        "gen1.json": desired_state(1, 0),
        "gen2.json": desired_state(2, 1),
        "other-node.json": desired_state(3, 1, node_id="someone-else"),
        "fenced.json": desired_state(3, 0),
    }.items():
        (workdir / name).write_text(text, encoding="utf-8")
    sign = [*cli, "sign", "--key", "control.pem", "--type", "desired-state"]
    for name in ("gen1", "gen2", "other-node", "fenced"):
        (workdir / f"{name}.env.json").write_text(run([*sign, f"{name}.json"], cwd=workdir, show=name == "gen2") + "\n")
    forge = [*cli, "sign", "--key", "intruder.pem", "--type", "desired-state", "gen2.json"]
    (workdir / "forged.env.json").write_text(run(forge, cwd=workdir, show=False) + "\n")
    # Someone on the path rewrites the engine's port and keeps the original signature.
    envelope = json.loads((workdir / "gen2.env.json").read_text())
    body = base64.b64decode(envelope["payload"]).replace(b'"port": 8000', b'"port": 8666')
    envelope["payload"] = base64.b64encode(body).decode()
    (workdir / "tampered.env.json").write_text(json.dumps(envelope))

    verify = [
        *cli,
        "verify",
        "--policy",
        "policy.yaml",
        "--kind",
        "desired-state",
        "--node-id",
        NODE_ID,
        "--state-dir",
        "state",
    ]
    run([*verify, "--record", "gen2.env.json"], cwd=workdir)
    print("\nThe same envelope again is a no-op:")
    run([*verify, "gen2.env.json"], cwd=workdir)

    banner("4. What the host refuses (exit 1, reason code, nothing recorded)")
    for label, name in [
        ("a replayed older generation", "gen1.env.json"),
        ("a payload changed after signing", "tampered.env.json"),
        ("a state signed by a key the policy does not trust", "forged.env.json"),
        ("a state for another node", "other-node.env.json"),
        ("a state from a fenced (older) lease epoch", "fenced.env.json"),
    ]:
        print(f"\n# {label}")
        run([*verify, name], cwd=workdir)
    print("\n# the applied state two hours from now: it has expired")
    later = format_rfc3339(datetime.now(UTC) + timedelta(hours=2))
    run([*verify, "--at", later, "gen2.env.json"], cwd=workdir)
    print("\nApplied state on disk after all of that (still generation 2, epoch 1):")
    print((workdir / "state" / "applied.json").read_text(encoding="utf-8").strip())


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="meridian-demo-") as tmp:
        workdir = Path(tmp)
        gpu_facts(workdir)
        trust_loop(workdir)
        whole_loop(workdir)
    banner("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

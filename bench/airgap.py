"""Air-gap bundle verification speed beside ``openssl dgst -sha256`` of the same bytes.

    .venv/bin/python bench/airgap.py [--size-mib 1024] [--shards 4] [--rounds 3] [--dir DIR]

Makes one bundle of --size-mib random bytes (one artifact of --shards files, signed manifest, signed
bundle.json; made by make-bundle's own code), then in interleaved rounds times:
1. ``openssl dgst -sha256 BUNDLE`` (SHA-NI where the CPU has it: the practical limit for hashing those bytes);
2. ``airgap.bundle_reader.check_bundle`` (``verify --kind bundle``): every member read once and hashed, nothing kept;
3. ``airgap.bundle_reader.unpack_bundle``: the same, plus each member written into scratch (the agent's path);
4. ``dd bs=1M`` of the bundle into scratch, then removing the copy: the floor for anything that reads the
   bytes into memory and writes them again (``cp`` copies inside the kernel, which a reader that must hash
   what it writes cannot do).
Prints each median with its throughput and the ratio of rates, ours / openssl (target >= 0.9 for check),
and unpack's rate beside cp's.
The page cache is warm for every contender alike (the bundle is read once per run, by each of them).
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.airgap import bundle_reader
from ansible_collections.meridian.node.plugins.module_utils.contracts import format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import load_policy
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AppliedState
from meridian_node_agent.cli.bundle import BundleInputs, build_bundle

MIB = 1024 * 1024
NODE = "bench-node"


def _key(directory: Path, role: str) -> Any:
    pem, _ = dsse.generate_private_key_pem()
    key = dsse.load_private_key_pem(pem)
    (directory / f"{role}.pub.pem").write_bytes(dsse.public_key_pem(key.public_key()))
    return key


def make_bundle(directory: Path, size: int, shards: int) -> tuple[Path, Path, datetime]:
    """The bundle and the policy that trusts its keys; the source files are removed once it is written."""
    keys = {role: _key(directory, role) for role in ("control", "artifact", "authority")}
    scratch = directory / "scratch"
    policy = directory / "policy.yaml"
    policy.write_text(
        "trust:\n  control: {public_keys: [control.pub.pem]}\n  artifact: {public_keys: [artifact.pub.pem]}\n"
        f"  air_gap_authority: {{public_keys: [authority.pub.pem]}}\nair_gap: {{scratch_dir: {scratch}}}\n"
    )
    model = directory / "model"
    model.mkdir()
    files = []
    for index in range(shards):
        name = f"shard-{index}.bin"
        hasher = hashlib.sha256()
        with (model / name).open("wb") as handle:
            for _ in range(size // shards // (16 * MIB)):
                chunk = os.urandom(16 * MIB)
                hasher.update(chunk)
                handle.write(chunk)
        files.append({"path": name, "size": (model / name).stat().st_size, "sha256": hasher.hexdigest()})
    manifest = {
        "apiVersion": "meridian.node/v1",
        "kind": "ArtifactManifest",
        "name": "bench",
        "version": "1",
        "files": files,
    }
    manifest_path = directory / "manifest.json"
    manifest_envelope = dsse.sign(
        dsse.PAYLOAD_TYPES["artifact-manifest"], json.dumps(manifest).encode(), [keys["artifact"]]
    )
    manifest_path.write_text(json.dumps(manifest_envelope))
    now = datetime.now(UTC).replace(microsecond=0)
    state = {
        "apiVersion": "meridian.node/v1",
        "kind": "DesiredState",
        "node_id": NODE,
        "generation": 1,
        "lease_epoch": 0,
        "issued_at": format_rfc3339(now),
        "expires_at": format_rfc3339(now + timedelta(days=1)),
        # A bundle carries only the artifacts its state pins, with the same manifest.
        "artifacts": [{"name": "bench", "version": "1", "manifest": manifest_envelope}],
    }
    out = directory / "bundle.tar"
    build_bundle(
        out,
        BundleInputs(
            desired_envelope=dsse.sign(
                dsse.PAYLOAD_TYPES["desired-state"], json.dumps(state).encode(), [keys["control"]]
            ),
            node_id=NODE,
            authority_keys=[keys["authority"]],
            expires=timedelta(days=1),
            now=now,
            artifacts=[(manifest_path, model)],
        ),
    )
    for path in model.iterdir():
        path.unlink()
    return out, policy, now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to put the bundle (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="airgap-bench-") as temp:
        directory = Path(temp)
        bundle, policy_path, now = make_bundle(directory, args.size_mib * MIB, args.shards)
        policy = load_policy(policy_path)
        size = bundle.stat().st_size
        options: dict[str, Any] = {"node_id": NODE, "now": now + timedelta(minutes=1), "applied": AppliedState()}

        def openssl() -> None:
            subprocess.run(["openssl", "dgst", "-sha256", str(bundle)], check=True, capture_output=True)

        def check() -> None:
            bundle_reader.check_bundle(str(bundle), policy, **options)

        def unpack() -> None:
            bundle_reader.unpack_bundle(str(bundle), policy, **options).discard()

        def copy() -> None:
            target = directory / "scratch" / "copy.tar"
            subprocess.run(["dd", f"if={bundle}", f"of={target}", "bs=1M", "status=none"], check=True)
            target.unlink()

        contenders: dict[str, Callable[[], None]] = {
            "openssl dgst -sha256": openssl,
            "check_bundle": check,
            "unpack_bundle": unpack,
            "dd bs=1M (write floor)": copy,
        }
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        openssl()  # warm the page cache for everyone
        for _ in range(args.rounds):
            for name, run in contenders.items():
                start = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - start)
        base = statistics.median(samples["openssl dgst -sha256"])
        print(
            f"bundle: {size / MIB:.0f} MiB in {args.shards} shards + manifest; {args.rounds} interleaved rounds; "
            f"CPU count {os.cpu_count()}; Python {sys.version.split()[0]}"
        )
        for name, values in samples.items():
            median = statistics.median(values)
            print(
                f"  {name:22s} median {median:6.3f} s  {size / MIB / median:7.0f} MiB/s  "
                f"rate vs openssl {base / median:5.2f}x  (runs: {', '.join(f'{v:.3f}' for v in values)})"
            )
        floor = statistics.median(samples["dd bs=1M (write floor)"])
        print(f"  unpack_bundle rate vs dd: {floor / statistics.median(samples['unpack_bundle']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

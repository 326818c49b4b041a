"""The benches still run against the code as it is: each is started small and must print its figures.

A bench is not run by anything else in ``make test``, so a change to what it drives (the air-gap bundle
rules, for one) would break it unseen until someone needs its figures. Nothing here looks at the timings.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_airgap_bench_makes_verifies_and_unpacks_a_small_bundle(tmp_path: Path) -> None:
    # 64 MiB: four shards of one 16 MiB chunk each (the bench writes whole chunks).
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "airgap.py"),
            "--size-mib",
            "64",
            "--rounds",
            "1",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for contender in ("openssl dgst -sha256", "check_bundle", "unpack_bundle", "dd bs=1M"):
        assert contender in proc.stdout, proc.stdout
    assert "rate vs openssl" in proc.stdout

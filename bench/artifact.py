"""Artifact verification and download speed against the tools an operator would otherwise use.

    .venv/bin/python bench/artifact.py [--size-mib 1024] [--repeat 3] [--dir DIR]

Prints, for one file of --size-mib random bytes:
1. sha256 throughput of our streaming verifier (``artifacts.fetch.hash_file``) vs ``openssl dgst -sha256``
   on the same file, as a ratio (ours / openssl; target >= 0.9). openssl uses SHA-NI where the CPU has it,
   which is the practical limit; coreutils ``sha256sum`` is no bar.
2. download + verify from a local HTTP server (``busybox httpd``, a separate process, sendfile) with our
   fetcher vs ``curl -o`` followed by ``openssl dgst -sha256``, as a ratio of times (target <= 0.7: we hash
   while we download). Our figure includes the fsync we need for durability; curl does not fsync, so
   the pair is also timed with `sync FILE` added, the like-for-like figure on a real disk.
Medians of --repeat runs; the page cache is warm for every contender alike.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from timing import median_seconds

from ansible_collections.meridian.node.plugins.module_utils.artifacts.fetch import fetch_file, hash_file

MIB = 1024 * 1024


def make_file(path: Path, size: int) -> str:
    """Random content (incompressible, so nothing shortcuts it); returns its sha256 via openssl."""
    with path.open("wb") as handle:
        remaining = size
        while remaining:
            chunk = os.urandom(min(remaining, 16 * MIB))
            handle.write(chunk)
            remaining -= len(chunk)
    return openssl_sha256(path)


def openssl_sha256(path: Path) -> str:
    out = subprocess.run(["openssl", "dgst", "-sha256", "-r", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def http_server(directory: Path) -> Iterator[str]:
    """busybox httpd (sendfile, its own process) on 127.0.0.1, stopped afterwards."""
    busybox = shutil.which("busybox")
    if busybox is None:
        sys.exit("busybox is needed for the HTTP server (Debian package busybox-static)")
    port = free_port()
    process = subprocess.Popen([busybox, "httpd", "-f", "-p", f"127.0.0.1:{port}", "-h", str(directory)])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args()
    for tool in ("openssl", "curl"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is needed for the comparison")

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="meridian-bench-") as tmp:
        root = Path(tmp)
        served = root / "served"
        served.mkdir()
        source = served / "model.bin"
        size = args.size_mib * MIB
        digest = make_file(source, size)

        ours_hash = median_seconds(lambda: hash_file(str(source)), args.repeat)
        openssl_hash = median_seconds(lambda: openssl_sha256(source), args.repeat)

        target = root / "download.bin"
        with http_server(served) as base:
            url = f"{base}/model.bin"

            def ours() -> None:
                target.unlink(missing_ok=True)
                result = fetch_file(url, path="model.bin", size=size, sha256=digest, staging_path=str(target))
                assert result.sha256 == digest

            def pair() -> None:
                target.unlink(missing_ok=True)
                subprocess.run(["curl", "-sS", "-o", str(target), url], check=True)
                assert openssl_sha256(target) == digest

            def durable_pair() -> None:
                # The same pair made as durable as ours: `sync FILE` fsyncs the downloaded file.
                target.unlink(missing_ok=True)
                subprocess.run(["curl", "-sS", "-o", str(target), url], check=True)
                subprocess.run(["sync", str(target)], check=True)
                assert openssl_sha256(target) == digest

            ours_download = median_seconds(ours, args.repeat)
            pair_download = median_seconds(pair, args.repeat)
            durable_download = median_seconds(durable_pair, args.repeat)

    gib = size / (1024 * MIB)
    where = args.dir or tempfile.gettempdir()
    print(f"artifact benchmark: {args.size_mib} MiB file, median of {args.repeat}, files in {where}")
    print(f"  sha256, ours (hash_file)          {ours_hash:6.2f} s  {gib / ours_hash:5.2f} GiB/s")
    print(f"  sha256, openssl dgst -sha256      {openssl_hash:6.2f} s  {gib / openssl_hash:5.2f} GiB/s")
    print(f"  throughput ratio ours/openssl     {openssl_hash / ours_hash:6.2f}   (target >= 0.9)")
    print(f"  download+verify, ours (fetch_file, fsync'd)   {ours_download:6.2f} s")
    print(f"  curl -o, then openssl dgst -sha256            {pair_download:6.2f} s")
    print(f"  time ratio ours/pair                          {ours_download / pair_download:6.2f}   (target <= 0.7)")
    print(f"  curl -o, sync FILE, then openssl dgst         {durable_download:6.2f} s")
    print(f"  time ratio ours/durable pair                  {ours_download / durable_download:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

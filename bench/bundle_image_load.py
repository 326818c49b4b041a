"""Loading a bundle's engine image beside ``docker load`` of the same archive, on the real Docker Engine.

    .venv/bin/python bench/bundle_image_load.py [--size-mib 256] [--rounds 3] [--dir DIR]

Makes one image archive in the form a bundle carries (``airgap.image_archive``: one layer of --size-mib random
bytes, so no Docker has it, plus a small one), then in interleaved rounds times:
1. ours: ``verify_image_archive`` (every blob hashed, the chain and the pin checked) then ``load_stream`` into
   ``POST /images/load`` (``airgap.image_load.load_images``): what root does for a bundle's image;
2. ``docker load -i ARCHIVE``: the same bytes, unverified, tagged as the archive says.
The image (and with it its layers) is removed after every load, untimed, so each load writes the layers again.
Prints each median and the ratio ours / docker load (the work beyond Docker's is one sha256 pass over the
archive, which the page cache keeps warm for both).
"""

import argparse
import hashlib
import io
import json
import os
import secrets
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ansible_collections.meridian.node.plugins.module_utils.airgap.image_archive import (
    load_tag,
    verify_image_archive,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_load import load_images, plan_images
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi

MIB = 1024 * 1024


def _layer(directory: Path, name: str, size: int) -> Path:
    """A layer tar holding one file of ``size`` random bytes, written in 1 MiB pieces."""
    path = directory / f"{name}.layer.tar"
    with tarfile.open(path, "w:", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(f"data/{name}.bin")
        info.size = size
        source = io.BufferedReader(io.FileIO(os.open("/dev/urandom", os.O_RDONLY), "rb"))
        with source:
            tar.addfile(info, _Limited(source, size))
    return path


class _Limited(io.RawIOBase):
    def __init__(self, source: BinaryIO, size: int) -> None:
        super().__init__()
        self.source, self.left = source, size

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        wanted = self.left if size < 0 else min(size, self.left)
        data = self.source.read(wanted)
        self.left -= len(data)
        return data


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(MIB), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def make_archive(directory: Path, size: int) -> tuple[Path, str]:
    """The archive and its image id."""
    layers = [_layer(directory, "big", size), _layer(directory, "small", 4096)]
    hexes = [_sha256(layer) for layer in layers]
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{h}" for h in hexes]},
        }
    ).encode()
    config_hex = hashlib.sha256(config).hexdigest()
    manifest = [
        {"Config": f"blobs/sha256/{config_hex}", "RepoTags": None, "Layers": [f"blobs/sha256/{h}" for h in hexes]}
    ]
    out = directory / "image.tar"
    with tarfile.open(out, "w:", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), (f"blobs/sha256/{config_hex}", config)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for layer, hex_ in zip(layers, hexes, strict=True):
            tar.add(layer, arcname=f"blobs/sha256/{hex_}")
            layer.unlink()
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out, f"sha256:{config_hex}"


def _remove(image_id: str) -> None:
    subprocess.run(["docker", "rmi", "--force", image_id], capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    api = DockerApi.from_env(timeout_s=600)
    repository = f"meridian-bench/bundle-load-{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        archive, image_id = make_archive(Path(work), args.size_mib * MIB)
        size = archive.stat().st_size
        pin = f"{repository}@{image_id}"

        def ours() -> None:
            with archive.open("rb") as handle:
                image = verify_image_archive(handle, size, pins={image_id: pin}, max_layer_bytes=size, member="bench")
            planned = plan_images({"images/bench.tar": image}, api)
            assert planned[0].load, "the image was not removed before the round"
            load_images(planned, {"images/bench.tar": str(archive)}, api)

        def docker_load() -> None:
            subprocess.run(["docker", "load", "-q", "-i", str(archive)], capture_output=True, check=True)

        contenders: dict[str, Callable[[], None]] = {"ours (verify + load)": ours, "docker load": docker_load}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        try:
            for _round in range(args.rounds):
                for name, run in contenders.items():
                    _remove(image_id)
                    started = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - started)
        finally:
            _remove(load_tag(repository, image_id))
            _remove(image_id)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"image archive: {size / MIB:.0f} MiB, {args.rounds} interleaved rounds, medians:")
    for name, seconds in medians.items():
        print(f"  {name:22s} {seconds:7.3f} s  {size / MIB / seconds:7.1f} MiB/s")
    print(f"  ratio ours / docker load: {medians['ours (verify + load)'] / medians['docker load']:.2f}x")


if __name__ == "__main__":
    main()

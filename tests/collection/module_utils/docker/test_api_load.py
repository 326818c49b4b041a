"""``DockerApi.load`` and ``save`` against the real Docker Engine: an archive streamed in and out, and the
engine's refusals (which it reports inside a 200 answer's body, or as an error status) raised, not swallowed."""

from __future__ import annotations

import io
import json
import secrets
import tarfile
from collections.abc import Iterator
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError
from ansible_collections.meridian.node.tests.support.image_archives import (
    ImageParts,
    archive,
    layer_tar,
    own_repository,
)

pytestmark = pytest.mark.docker


@pytest.fixture
def api(docker_client: Any) -> DockerApi:
    return DockerApi.from_env()


@pytest.fixture
def repository(docker_client: Any) -> Iterator[str]:
    with own_repository(docker_client, "h26-api") as name:
        yield name


def _chunks(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_an_archive_streamed_in_is_loaded_and_saved_back(api: DockerApi, repository: str, docker_client: Any) -> None:
    parts = ImageParts(layers=[layer_tar({"x": secrets.token_bytes(3000)})], label=repository)
    manifest = [{"Config": f"blobs/sha256/{parts.image_id[7:]}", "RepoTags": [f"{repository}:t"], "Layers": []}]
    manifest[0]["Layers"] = [f"blobs/sha256/{member[0].name[13:]}" for member in parts.members()[2:3]]
    data = archive([*parts.members()[1:3], *archive_members(manifest)])

    loaded = api.load(_chunks(data), len(data), "a test image")

    assert any(parts.image_id in line or repository in line for line in loaded), loaded
    assert docker_client.images.get(parts.image_id).tags == [f"{repository}:t"]
    saved = io.BytesIO()
    assert api.save(parts.image_id, saved, max_bytes=10**8) == len(saved.getvalue()) > 0
    with pytest.raises(DockerApiError, match="larger than 100 bytes"):
        api.save(parts.image_id, io.BytesIO(), max_bytes=100)


def archive_members(manifest: list[dict[str, Any]]) -> list[tuple[tarfile.TarInfo, bytes]]:
    data = json.dumps(manifest).encode()
    info = tarfile.TarInfo("manifest.json")
    info.size = len(data)
    return [(info, data)]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not a tar at all" * 100, "invalid tar header"),
        (
            archive(archive_members([{"Config": "blobs/sha256/" + "0" * 64, "RepoTags": None, "Layers": []}])),
            "no such file",
        ),
    ],
)
def test_the_engine_refusing_a_load_raises_with_its_reason(api: DockerApi, body: bytes, says: str) -> None:
    with pytest.raises(DockerApiError, match=says):
        api.load(_chunks(body), len(body), "a broken archive")


def test_saving_an_image_docker_does_not_have_raises_with_the_engine_s_reason(api: DockerApi) -> None:
    out = io.BytesIO()
    with pytest.raises(DockerApiError, match=r"exporting image .* no such file"):
        api.save("sha256:" + "0" * 64, out, max_bytes=10**6)
    assert out.getvalue() == b""

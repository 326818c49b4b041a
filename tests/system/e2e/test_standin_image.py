"""The stand-in image builder: mirror discovery, recipe hashing and the two cache levels (tag, tarball).

The cache tests use recipes with an unreachable mirror: if the builder ever fell through to debootstrap
instead of reusing what is cached, they would fail instead of silently taking a minute.
"""

from __future__ import annotations

import io
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.standin_image import (
    BASE_REPOSITORY,
    SERVER_PATH_IN_IMAGE,
    BaseRecipe,
    LocalImage,
    StandinImageError,
    apt_mirror,
    ensure_base_image,
    ensure_engine_image,
)

UNREACHABLE = "http://192.0.2.1/debian"  # TEST-NET-1: debootstrap from here can only fail


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("source", "text"),
    [
        pytest.param(
            "sources.list.d/debian.sources",
            "Types: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\n"
            "Components: main\n\n"
            "# a comment\nTypes: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
            "Components: main\n",
            id="deb822-stanza-of-the-main-suite",
        ),
        pytest.param(
            "sources.list",
            "deb http://security.example/ bookworm-security main\n"
            "# deb http://commented.example/ bookworm main\n"
            "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n",
            id="one-line-source-with-options",
        ),
    ],
)
def test_mirror_comes_from_the_main_suites_apt_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, text: str
) -> None:
    monkeypatch.delenv("MERIDIAN_STANDIN_MIRROR", raising=False)
    write(tmp_path / source, text)
    assert apt_mirror(tmp_path) == "http://mirror.example/debian"


def test_no_apt_source_says_how_to_set_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MERIDIAN_STANDIN_MIRROR", raising=False)
    with pytest.raises(StandinImageError, match="MERIDIAN_STANDIN_MIRROR"):
        apt_mirror(tmp_path)
    monkeypatch.setenv("MERIDIAN_STANDIN_MIRROR", "http://override.example/debian")
    assert apt_mirror(tmp_path) == "http://override.example/debian"


def test_any_recipe_change_gives_a_new_tag() -> None:
    recipe = BaseRecipe(mirror="http://m/debian")
    assert recipe.tag == BaseRecipe(mirror="http://m/debian").tag
    assert recipe.tag.startswith(f"{BASE_REPOSITORY}:")
    changed = [
        BaseRecipe(mirror="http://m/debian", include=("python3", "curl")),
        BaseRecipe(mirror="http://m/debian", suite="trixie"),
        BaseRecipe(mirror="http://m/debian", changes=(*recipe.changes, "ENV X=1")),
        BaseRecipe(mirror="http://other/debian"),
    ]
    assert len({recipe.tag, *(c.tag for c in changed)}) == len(changed) + 1


@pytest.fixture
def throwaway_recipe(docker_client: Any) -> Iterator[BaseRecipe]:
    """A recipe nobody else uses; its image is removed afterwards."""
    recipe = BaseRecipe(mirror=f"{UNREACHABLE}/{secrets.token_hex(4)}")
    yield recipe
    if docker_client.images.list(name=recipe.tag):
        docker_client.images.remove(recipe.tag, force=True)


@pytest.mark.docker
def test_tagged_base_image_is_reused_without_building(
    docker_client: Any, throwaway_recipe: BaseRecipe, tmp_path: Path
) -> None:
    existing = ensure_base_image(docker_client)  # the real one: built or cached already
    repository, tag = throwaway_recipe.tag.rsplit(":", 1)
    docker_client.images.get(existing.id).tag(repository, tag)
    reused = ensure_base_image(docker_client, throwaway_recipe, cache=tmp_path)
    assert reused == LocalImage(tag=throwaway_recipe.tag, id=existing.id)
    assert list(tmp_path.glob("*.tar")) == []


@pytest.mark.docker
def test_cached_rootfs_tarball_is_imported_without_debootstrap(
    docker_client: Any, throwaway_recipe: BaseRecipe, tmp_path: Path
) -> None:
    tarball = tmp_path / f"standin-base-{throwaway_recipe.digest()[:16]}.tar"
    with tarfile.open(tarball, "w") as archive:
        marker = tarfile.TarInfo("etc/standin-marker")
        marker.size = 6
        archive.addfile(marker, io.BytesIO(b"cached"))
    image = ensure_base_image(docker_client, throwaway_recipe, cache=tmp_path)
    attrs = docker_client.api.inspect_image(image.id)
    assert image.tag == throwaway_recipe.tag
    assert attrs["Config"]["Cmd"] == ["python3", SERVER_PATH_IN_IMAGE]
    assert "PYTHONUNBUFFERED=1" in attrs["Config"]["Env"]


@pytest.mark.docker
def test_engine_image_is_rebuilt_only_when_the_server_changes(docker_client: Any, tmp_path: Path) -> None:
    base = ensure_base_image(docker_client)
    server = tmp_path / "standin_server.py"
    token = secrets.token_hex(4)  # unique bytes: a concurrent session never shares (or deletes) our images
    server.write_text(f"print('v1 {token}')\n")
    first = ensure_engine_image(docker_client, base, server)
    again = ensure_engine_image(docker_client, base, server)
    server.write_text(f"print('v2 {token}')\n")
    second = ensure_engine_image(docker_client, base, server)
    try:
        assert again == first
        assert second.tag != first.tag and second.id != first.id
        output = docker_client.containers.run(second.id, remove=True)
        assert output == f"v2 {token}\n".encode()
    finally:
        for image in (first, second):
            docker_client.images.remove(image.id, force=True)

"""The CI machine's Docker Engine is the real one later tests build on: check what they rely on."""

from typing import Any

import pytest


@pytest.mark.docker
def test_engine_answers_with_a_usable_api(docker_client: Any) -> None:
    version = docker_client.version()
    major, minor = (int(part) for part in version["ApiVersion"].split(".")[:2])
    assert (major, minor) >= (1, 41), f"Docker API {version['ApiVersion']} is older than 1.41"
    assert docker_client.info()["OSType"] == "linux"

"""playbooks/rollout.yml over three "hosts" whose engine image is only in a registry (issue 26): each host pulls
it by digest, verified, before its engine starts; a rerun pulls nothing; a dry run pulls nothing and says what
it would. The registry is Debian's docker-registry on 127.0.0.1 (tests/support/registry.py); the hosts are
tests/system/rollout/test_rollout_playbook.py's ``Fleet``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.meridian.node.tests.support.engine_harness import SERVER
from ansible_collections.meridian.node.tests.support.registry import PushedImage, pushed_image, running_registry
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy
from ansible_collections.meridian.node.tests.system.rollout.test_rollout_playbook import HOSTS, Fleet, models, recap

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def registry_image(docker_client: Any, standin_base_image: LocalImage, prefix: str) -> Iterator[PushedImage]:
    vllm = ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")
    with (
        running_registry() as registry,
        pushed_image(docker_client, registry, vllm.id, prefix, blob_bytes=1 << 20) as image,
    ):
        yield image


def test_rollout_pulls_an_engine_only_in_the_registry_by_digest_and_a_rerun_pulls_nothing(
    tmp_path: Path, docker_client: Any, registry_image: PushedImage, prefix: str
) -> None:
    fleet = Fleet(tmp_path, docker_client, registry_image, prefix)  # type: ignore[arg-type]  # .pinned is all it reads
    for host in fleet.hosts.values():
        policy = yaml.safe_load(host.policy.read_text())
        sections = {key: value for key, value in policy.items() if key != "trust"}
        sections["images"] = {"allowed_repositories": [registry_image.repository]}
        write_policy(host.policy.parent, control=[make_key()], extra=sections)
    specs = {alias: fleet.spec(alias) for alias in HOSTS}

    status, output = fleet.rollout(specs, check=True, verbose=True)
    assert status == 0, output[-6000:]
    assert output.count('"would_pull": true') == len(HOSTS), output[-4000:]
    assert docker_client.images.list(name=registry_image.repository) == []

    status, output = fleet.rollout(specs, verbose=True)
    assert status == 0, output[-6000:]
    assert output.count('"pulled": true') >= 1  # the first host pulls; hosts after it may find it already there
    for alias in HOSTS:
        container = fleet.container(alias)
        assert container is not None and container.status == "running", alias
        assert container.image.id == registry_image.id
        assert "chat-v1" in models(fleet.ports[alias])
    assert registry_image.pinned in docker_client.images.get(registry_image.id).attrs["RepoDigests"]

    status, output = fleet.rollout(specs, verbose=True)
    assert status == 0, output[-6000:]
    assert {host: counts["changed"] for host, counts in recap(output).items()} == dict.fromkeys(HOSTS, 0)
    assert '"image_pull"' not in output

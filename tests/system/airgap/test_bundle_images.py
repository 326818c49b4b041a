"""Engine images carried in air-gap bundles, on the real Docker Engine (issue 26, "Images in air-gap bundles").

The cycle: a stand-in vLLM image built here with a unique layer (so no Docker has seen it), exported by
make-bundle's code into the bundle, then removed from Docker; ``meridian-node run --once`` takes the bundle from
the inbox, loads the image from its verified copy and the engine serves. Docker then has the image by its pin,
tagged only with our tag, and no other image was loaded. Each hostile archive, in a real signed bundle, goes
through the ``airgap_bundle`` module's code (the real reader and loader) and is refused with nothing loaded;
the same archive built without the fault loads, so "nothing loaded" is not a test that cannot fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_args import airgap_bundle_outcome
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_archive import load_tag
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.tests.support.airgap_env import AirGapNode, make_airgap_node, state_bundle
from ansible_collections.meridian.node.tests.support.e2e_env import (
    E2E_REPOSITORY,
    engine_serving,
    engine_spec,
    free_engine_port,
    standin_policy,
)
from ansible_collections.meridian.node.tests.support.image_archives import (
    ARCHIVE_SAYS,
    HOSTILE,
    ImageParts,
    archive,
    engine,
    image_bundle,
    layer_tar,
    own_repository,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import current_state
from meridian_node_agent.errors import UsageError

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "meridian-node"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "meridian_node_agent.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, check=False)


def _loads(client: Any, since: float) -> list[str]:
    """The ids of the images Docker loaded since ``since`` (its ``load`` events)."""
    events = client.events(since=int(since), until=int(time.time()) + 1, filters={"type": "image", "event": "load"})
    return [json.loads(line)["id"] for line in events]


@pytest.fixture
def unseen_image(docker_client: Any, image: LocalImage) -> Iterator[LocalImage]:
    """The stand-in vLLM image plus a layer of its own, built, then untagged and removed: no Docker has it."""
    token = secrets.token_hex(6)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (
            ("Dockerfile", f"FROM {image.tag}\nCOPY token /etc/meridian-bundle-token\n".encode()),
            ("token", f"{token}\n".encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    tag = f"{E2E_REPOSITORY}:bundle-{token}"
    built, _logs = docker_client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True)
    local = LocalImage(tag=tag, id=built.id)
    try:
        yield local
    finally:
        for name in (tag, load_tag(E2E_REPOSITORY, built.id), built.id):
            with contextlib.suppress(Exception):  # already gone is what we want
                docker_client.images.remove(name)


def test_an_air_gapped_cycle_loads_the_engine_image_from_the_bundle(
    tmp_path: Path, docker_client: Any, unseen_image: LocalImage, prefix: str
) -> None:
    node = make_airgap_node(tmp_path / "node", policy_extra=standin_policy())
    port = free_engine_port()
    pin = unseen_image.pinned
    bundle = state_bundle(
        node,
        "g1.tar",
        generation=1,
        desired={"engines": [engine_spec(f"{prefix}-chat", unseen_image, port)]},
        images=[pin],
    )
    # From now on Docker has never seen the image: only the bundle carries it.
    docker_client.images.remove(unseen_image.tag)  # its only tag: the image and its own layer go with it
    with pytest.raises(Exception, match="No such image"):
        docker_client.images.get(unseen_image.id)
    started = time.time()
    (node.inbox / ".g1.tar.part").write_bytes(bundle.read_bytes())
    (node.inbox / ".g1.tar.part").rename(node.inbox / "g1.tar")

    run = _agent("--config", str(node.config_path), "run", "--once")

    assert run.returncode == 0, (run.stdout, run.stderr)
    reason = json.loads((node.inbox / "processed" / "g1.tar.reason.json").read_text())
    assert reason["result"] == "applied", reason
    assert engine_serving(port)
    resolved = DockerEngine(DockerApi.from_env()).resolve_image(
        pin
    )  # as engine_set finds it: by image id, tagged in its repository
    assert (resolved.id, resolved.pinned_by) == (unseen_image.id, "image-id")
    assert docker_client.images.get(unseen_image.id).tags == [load_tag(E2E_REPOSITORY, unseen_image.id)]
    assert _loads(docker_client, started) == [unseen_image.id]


def _outcome(node: AirGapNode, bundle: Path, *, check: bool = False) -> dict[str, Any]:
    state_dir = node.root / "apply"
    state_dir.mkdir(exist_ok=True)
    params = {
        "bundle": str(bundle),
        "node_id": node.node_id,
        "policy": node.config.policy,
        "state_dir": str(state_dir),
        "state": "unpacked",
        "directory": None,
    }
    return airgap_bundle_outcome(params, check_mode=check)


@pytest.fixture
def bundled_repository(docker_client: Any) -> Iterator[str]:
    """A repository name of this test's own; every image tagged in it is removed afterwards."""
    with own_repository(docker_client, "h26-bundle") as repository:
        yield repository


def _synthetic(token: str) -> ImageParts:
    return ImageParts(
        layers=[layer_tar({"srv/token": token.encode()}), layer_tar({"etc/motd": b"bundled\n"})], label=token
    )


@pytest.mark.parametrize("case", [None, *sorted(HOSTILE)])
def test_a_hostile_image_archive_is_refused_with_nothing_loaded(
    tmp_path: Path, docker_client: Any, bundled_repository: str, case: str | None
) -> None:
    node = make_airgap_node(
        tmp_path, policy_extra={"images": {"allowed_repositories": [bundled_repository], "require_digest": True}}
    )
    parts = _synthetic(secrets.token_hex(6))
    data = archive(parts.members()) if case is None else HOSTILE[case][0](parts)
    state = current_state(2, node_id=node.node_id, engines=[engine("chat", parts.pin(bundled_repository))])
    bundle = image_bundle(
        tmp_path / "b.tar",
        {"chat": data},
        state,
        created=datetime.now(UTC) - timedelta(minutes=1),
        node_id=node.node_id,
    )
    before = {image.id for image in docker_client.images.list(name=bundled_repository)}
    started = time.time()

    checked = _outcome(node, bundle, check=True)
    outcome = _outcome(node, bundle)

    after = {image.id for image in docker_client.images.list(name=bundled_repository)}
    if case is None:  # the control: the same image without a fault loads, and check mode predicted it
        assert checked["images"] == outcome["images"], (checked, outcome)
        assert outcome["images"][0]["loaded"] is True, outcome
        assert after == before | {parts.image_id}
        # Only our tag: the archive's own RepoTags never reach Docker.
        assert docker_client.images.get(parts.image_id).tags == [load_tag(bundled_repository, parts.image_id)]
        assert not docker_client.images.list(name=ARCHIVE_SAYS)
        assert _loads(docker_client, started) == [parts.image_id]
        assert _outcome(node, bundle)["images"][0]["loaded"] is False  # present now
        return
    reason = HOSTILE[case][1]
    assert (checked.get("reason"), outcome.get("reason")) == (reason, reason), (checked, outcome)
    assert outcome["failed"] is True and "images/chat.tar" in outcome["msg"]
    assert after == before == set()
    with pytest.raises(Exception, match="No such image"):
        docker_client.images.get(parts.image_id)
    assert _loads(docker_client, started) == []


def test_a_good_image_is_not_loaded_when_a_later_member_of_its_bundle_fails(
    tmp_path: Path, docker_client: Any, bundled_repository: str
) -> None:
    # Loading waits for the whole bundle: the image archive verifies, the member after it does not.
    node = make_airgap_node(
        tmp_path, policy_extra={"images": {"allowed_repositories": [bundled_repository], "require_digest": True}}
    )
    parts, other = _synthetic(secrets.token_hex(6)), _synthetic(secrets.token_hex(6))
    pins = [parts.pin(bundled_repository), other.pin(bundled_repository)]
    state = current_state(
        2, node_id=node.node_id, engines=[engine(f"chat{n}", pin, 9400 + n) for n, pin in enumerate(pins)]
    )
    bundle = image_bundle(
        tmp_path / "b.tar",
        {"a": archive(parts.members()), "b": archive(other.members())},
        state,
        created=datetime.now(UTC) - timedelta(minutes=1),
        node_id=node.node_id,
        tamper="b",
    )
    started = time.time()

    outcome = _outcome(node, bundle)

    assert (outcome["failed"], outcome["reason"]) == (True, "digest-mismatch"), outcome
    assert _loads(docker_client, started) == []
    assert not docker_client.images.list(name=bundled_repository)


def test_a_registry_digest_pin_is_refused_before_loading_on_a_classic_image_store(
    tmp_path: Path, docker_client: Any, bundled_repository: str
) -> None:
    # The archive proves the manifest digest, but a loaded image could never be found by it here.
    node = make_airgap_node(
        tmp_path, policy_extra={"images": {"allowed_repositories": [bundled_repository], "require_digest": True}}
    )
    parts = _synthetic(secrets.token_hex(6))
    pin = f"{bundled_repository}@{parts.manifest_digest}"
    state = current_state(2, node_id=node.node_id, engines=[engine("chat", pin)])
    bundle = image_bundle(
        tmp_path / "b.tar",
        {"chat": archive(parts.members())},
        state,
        created=datetime.now(UTC) - timedelta(minutes=1),
        node_id=node.node_id,
    )
    started = time.time()

    outcome = _outcome(node, bundle)

    assert (outcome["failed"], outcome["reason"]) == (True, "image-load-failed")
    assert f"{bundled_repository}@{parts.image_id}" in outcome["msg"]  # the pin that works, named
    assert _loads(docker_client, started) == []


def test_make_bundle_refuses_an_image_the_state_does_not_pin_and_a_registry_digest_it_cannot_export(
    tmp_path: Path, unseen_image: LocalImage, prefix: str
) -> None:
    node = make_airgap_node(tmp_path / "node", policy_extra=standin_policy())
    spec = engine_spec(f"{prefix}-chat", unseen_image, free_engine_port())
    with pytest.raises(UsageError, match="no engine of the desired state pins it"):
        state_bundle(
            node, "a.tar", generation=1, desired={"engines": [spec]}, images=[f"{E2E_REPOSITORY}@sha256:{'0' * 64}"]
        )
    with pytest.raises(UsageError, match="no image with registry digest or image id"):
        state_bundle(
            node,
            "b.tar",
            generation=1,
            desired={"engines": [dict(spec, image=f"{E2E_REPOSITORY}@sha256:{'0' * 64}")]},
            images=[f"{E2E_REPOSITORY}@sha256:{'0' * 64}"],
        )
    assert sorted(path.name for path in node.bundles.iterdir()) == []  # nothing written, no export left behind

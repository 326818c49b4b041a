"""Images the project pulled and no engine uses any more: removed after the grace, never anyone else's (issue 26).

Real parts: a registry on 127.0.0.1 (tests/support/registry.py) the images are pulled from, the real Docker
Engine, ``meridian.node.engine_set`` run by a real ``ansible-playbook``, and once in-process
(``run_engine_set``) where the test hands in the wall clock the grace counts on, so no test sleeps for it.
Every image is unique to its test (its own random layer, under the test's prefix); the operator's images
the tests make are their own too, removed by tag afterwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.set import SetOptions, converge_set
from ansible_collections.meridian.node.plugins.module_utils.engines.set_run import run_engine_set
from ansible_collections.meridian.node.tests.collection.modules.test_engine_image_pull import pull_host, pulled_by_host
from ansible_collections.meridian.node.tests.support.engine_harness import Host, free_port, run_foreign_engine
from ansible_collections.meridian.node.tests.support.image_archives import engine
from ansible_collections.meridian.node.tests.support.registry import Registry, pushed_image, running_registry
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def registry(docker_client: Any) -> Iterator[Registry]:
    with running_registry() as running:
        yield running


def steps(host: Host, owner: str, plays: Sequence[tuple[str, Sequence[Mapping[str, Any]], bool]]) -> dict[str, Any]:
    params = [
        (
            label,
            {
                "policy": str(host.policy),
                "state_dir": str(host.state_dir),
                "owner": owner,
                "prune": True,
                "engines": list(engines),
            },
            check,
        )
        for label, engines, check in plays
    ]
    return host.play_module("meridian.node.engine_set", params)[0]


def present(client: Any, image_id: str) -> bool:
    return any(image.id == image_id for image in client.images.list(all=True))


def ids(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(entry["image_id"]) for entry in entries]


@contextlib.contextmanager
def operator_image(client: Any, base_id: str, tag: str) -> Iterator[str]:
    """An image an operator built (its own layer, its own tag, never pulled by us); untagged afterwards."""
    context = io.BytesIO()
    files = {"Dockerfile": f"FROM {base_id}\nCOPY mine /mine\n".encode(), "mine": os.urandom(512)}
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    image, _logs = client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    try:
        yield str(image.id)
    finally:
        with contextlib.suppress(Exception):  # already gone would be this test's failure, reported above
            client.images.remove(tag)


def test_our_pulled_image_waits_out_the_grace_then_goes_and_check_mode_predicts_each_step(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pulled_by_host(host, docker_client, registry, vllm, prefix, prune_grace_seconds=3600) as image:
        spec = [engine(f"{prefix}-a", image.pinned, free_port())]
        first = steps(
            host, prefix, [("apply", spec, False), ("drop check", [], True), ("drop", [], False), ("again", [], False)]
        )
        assert first["apply"]["engines"][f"{prefix}-a"]["image_pull"]["pulled"] is True
        assert first["apply"]["images"] == {"removed": [], "waiting": []}
        record = json.loads((host.state_dir / "images.json").read_text())
        assert record["images"][image.id]["owner"] == prefix and record["images"][image.id]["brought"] == "pulled"
        for label in ("drop check", "drop", "again"):
            assert first[label]["images"]["removed"] == [], first[label]
            assert ids(first[label]["images"]["waiting"]) == [image.id]
            assert first[label]["images"]["waiting"][0]["reference"] == image.pinned
        assert first["drop"]["pruned"] == [{"name": f"{prefix}-a", "reason": "later"}]
        assert first["again"]["changed"] is False
        # Counted down from the grace, never past it; how far it went depends on the machine's speed, not on us
        # (the exact arithmetic is test_image_prune_plan.py's, on a handed-in clock).
        assert 0 < first["again"]["images"]["waiting"][0]["seconds_left"] <= 3600
        assert present(docker_client, image.id)

        pull_host(host, [f"{registry.host}/{prefix}"], prune_grace_seconds=0)
        second = steps(
            host, prefix, [("check", [], True), ("prune", [], False), ("again", [], False), ("again check", [], True)]
        )
        assert second["check"]["changed"] is True
        assert ids(second["check"]["images"]["removed"]) == [image.id]
        assert ids(second["prune"]["images"]["removed"]) == [image.id]
        assert second["prune"]["changed"] is True
        for label in ("again", "again check"):
            assert second[label]["changed"] is False and second[label]["images"]["removed"] == [], second[label]
        assert not present(docker_client, image.id)
        assert json.loads((host.state_dir / "images.json").read_text())["images"] == {}


def test_prune_never_touches_an_operators_image_another_tag_of_ours_or_an_image_a_foreign_container_uses(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with (
        pushed_image(docker_client, registry, vllm.id, prefix, tag="a") as tagged,
        pushed_image(docker_client, registry, vllm.id, f"{prefix}-b", tag="b") as used,
        operator_image(docker_client, vllm.id, f"{prefix}-operator:mine") as operators,
    ):
        pull_host(host, [f"{registry.host}/{prefix}", f"{registry.host}/{prefix}-b"], prune_grace_seconds=0)
        spec = [engine(f"{prefix}-a", tagged.pinned, free_port()), engine(f"{prefix}-b", used.pinned, free_port())]
        steps(host, prefix, [("apply", spec, False)])
        # An operator tags our image too (in another repository: untagging the last tag of a pulled image's own
        # repository makes Docker drop its digest reference with it, and the image).
        docker_client.images.get(tagged.id).tag(f"{prefix}-operator-tag", "keep")
        foreign = run_foreign_engine(docker_client, used.id, f"{prefix}-foreign", seconds=600)
        try:
            kept = steps(host, prefix, [("drop check", [], True), ("drop", [], False)])
            for label in ("drop check", "drop"):
                assert kept[label]["images"] == {"removed": [], "waiting": []}, kept[label]
            assert present(docker_client, tagged.id) and present(docker_client, used.id)
            assert present(docker_client, operators)
        finally:
            foreign.remove(force=True)
        docker_client.images.remove(f"{prefix}-operator-tag:keep")
        gone = steps(host, prefix, [("check", [], True), ("prune", [], False)])
        assert sorted(ids(gone["check"]["images"]["removed"])) == sorted([tagged.id, used.id])
        assert sorted(ids(gone["prune"]["images"]["removed"])) == sorted([tagged.id, used.id])
        assert not present(docker_client, tagged.id) and not present(docker_client, used.id)
        assert present(docker_client, operators)  # never ours: no record, no load tag


def _run(host: Host, specs: Sequence[Mapping[str, Any]], owner: str, now: float, check: bool = False) -> dict[str, Any]:
    params = {
        "policy": str(host.policy),
        "state_dir": str(host.state_dir),
        "owner": owner,
        "prune": True,
        "engines": list(specs),
        "parallel": 8,
    }
    return run_engine_set(params, check_mode=check, held_artifacts=lambda *_a, **_k: [], wall=lambda: now)


def test_the_grace_counts_from_the_first_prune_that_found_it_unused_on_the_wall_clock(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pulled_by_host(host, docker_client, registry, vllm, prefix, prune_grace_seconds=100) as image:
        _run(host, [engine(f"{prefix}-a", image.pinned, free_port())], prefix, now=500)
        assert _run(host, [], prefix, now=1000)["images"]["waiting"][0]["seconds_left"] == 100
        before = _run(host, [], prefix, now=1099)
        assert before["images"]["waiting"][0]["seconds_left"] == 1 and before["changed"] is False
        assert present(docker_client, image.id)
        predicted = _run(host, [], prefix, now=1100, check=True)
        assert ids(predicted["images"]["removed"]) == [image.id] and present(docker_client, image.id)
        after = _run(host, [], prefix, now=1100)
        assert ids(after["images"]["removed"]) == [image.id] and after["changed"] is True
        assert not present(docker_client, image.id)


def test_an_image_used_again_inside_the_grace_starts_it_over(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pulled_by_host(host, docker_client, registry, vllm, prefix, prune_grace_seconds=100) as image:
        spec = [engine(f"{prefix}-a", image.pinned, free_port())]
        _run(host, spec, prefix, now=500)
        _run(host, [], prefix, now=1000)
        again = _run(host, spec, prefix, now=1050)
        assert again["images"] == {"removed": [], "waiting": []}
        assert "image_pull" not in again["engines"][f"{prefix}-a"]  # still there: not pulled again
        assert _run(host, [], prefix, now=1150)["images"]["waiting"][0]["seconds_left"] == 100
        assert present(docker_client, image.id)


def test_a_damaged_record_fails_the_prune_by_name_and_removes_nothing(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pulled_by_host(host, docker_client, registry, vllm, prefix, prune_grace_seconds=0) as image:
        _run(host, [engine(f"{prefix}-a", image.pinned, free_port())], prefix, now=500)
        (host.state_dir / "images.json").write_text("{not json")
        results = steps(host, prefix, [("drop", [], False)])
        assert results["drop"]["failed"] is True
        assert results["drop"]["check"] == "image-prune"
        assert "images.json" in results["drop"]["msg"] and "damaged" in results["drop"]["msg"]
        assert present(docker_client, image.id)
        assert (host.state_dir / "images.json").read_text() == "{not json"


def _converge(host: Host, owner: str, now: float, *, loaded_too: bool, check: bool = False) -> dict[str, Any]:
    options = SetOptions(
        owner=owner,
        prune=True,
        policy_path=str(host.policy),
        state_dir=str(host.state_dir),
        prune_loaded=loaded_too,
    )
    engine = DockerEngine.from_env()
    try:
        return converge_set([], options, check_mode=check, engine=engine, wall=lambda: now)
    finally:
        engine.close()


def test_an_image_loaded_from_a_bundle_is_pruned_only_by_a_signed_states_run_and_only_by_its_own_tag(
    host: Host, vllm: LocalImage, prefix: str, docker_client: Any
) -> None:
    with (
        operator_image(docker_client, vllm.id, f"{prefix}-bundle/standin:built") as loaded,
        operator_image(docker_client, vllm.id, f"{prefix}-bundle/standin:other") as lookalike,
    ):
        # As airgap.image_load leaves a bundle's image: tagged only <repo>:meridian-<first 16 hex of its id>.
        load_tag = f"{prefix}-bundle/standin:meridian-{loaded.split(':', 1)[1][:16]}"
        docker_client.images.get(loaded).tag(load_tag)
        # A tag of the same form that does not name its image's own id (no image id starts with 16 zeros).
        docker_client.images.get(lookalike).tag(f"{prefix}-bundle/standin:meridian-{'0' * 16}")
        docker_client.images.remove(f"{prefix}-bundle/standin:built")
        docker_client.images.remove(f"{prefix}-bundle/standin:other")
        try:
            pull_host(host, [f"{prefix}-bundle"], prune_grace_seconds=0)
            operators = _converge(host, prefix, 1000, loaded_too=False)
            assert operators["images"] == {"removed": [], "waiting": []}  # an operator's engine_set: never
            predicted = _converge(host, f"agent:{prefix}", 1000, loaded_too=True, check=True)
            assert ids(predicted["images"]["removed"]) == [loaded] and present(docker_client, loaded)
            pruned = _converge(host, f"agent:{prefix}", 1000, loaded_too=True)
            assert ids(pruned["images"]["removed"]) == [loaded]
            assert pruned["images"]["removed"][0]["reference"] == load_tag
            assert not present(docker_client, loaded)
            assert present(docker_client, lookalike)  # its meridian- tag does not name its own id
            assert _converge(host, f"agent:{prefix}", 1000, loaded_too=True)["changed"] is False
        finally:
            for image_id in (loaded, lookalike):
                with contextlib.suppress(Exception):  # removed by the prune: what the test wanted
                    docker_client.images.remove(image_id, force=True)

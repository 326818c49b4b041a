"""Engines whose image is only in a registry: pulled by digest, verified, before anything is drained (issue 26).

Real parts only: a real registry on 127.0.0.1 (Debian's docker-registry, started and stopped here:
tests/support/registry.py), the real Docker Engine pulling from it, and ``meridian.node.engine_set`` /
``engine_instance`` run by a real ``ansible-playbook`` (and ``ansible-runner`` for the journal). Each test pushes
its own unique image (the stand-in vLLM engine plus a layer of random bytes) under its container prefix, and
removes it from the local engine before the module runs, so the module really has to pull it.

The disk floor is tested by policy arithmetic (a floor larger than any disk), not by filling a disk: the
refusal reads the real free space of Docker's data-root and must name both figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TRANSFERS_FILE, read_transfers
from ansible_collections.meridian.node.plugins.module_utils.engines.image_record import read_image_record
from ansible_collections.meridian.node.tests.support.engine_harness import BIND, PORTS, REPO, VENV_BIN, Host, free_port
from ansible_collections.meridian.node.tests.support.image_archives import engine
from ansible_collections.meridian.node.tests.support.registry import (
    PushedImage,
    Registry,
    StallingProxy,
    forget_local,
    push,
    pushed_image,
    running_registry,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PASSWORD = "pw-7c1e9a44-registry-secret"
USER = "mn-puller"


@pytest.fixture(scope="module")
def registry(docker_client: Any) -> Iterator[Registry]:
    with running_registry() as running:
        yield running


@pytest.fixture(scope="module")
def auth_registry(docker_client: Any) -> Iterator[Registry]:
    with running_registry(auth=(USER, PASSWORD)) as running:
        yield running


def pull_host(host: Host, repositories: Sequence[str], **images: Any) -> Host:
    """``host`` with a policy that allows ``repositories`` (each with everything below it) and ``images`` options."""
    host.policy = write_policy(
        host.root / "pull-policy",
        control=[make_key()],
        extra={
            "images": {"allowed_repositories": [f"{repository}/*" for repository in repositories], **images},
            "engines": {"allowed_drivers": list(Host.DRIVERS), "bind_address": BIND, "port_range": list(PORTS)},
            "store": {"path": str(host.store)},
        },
    )
    return host


@contextlib.contextmanager
def pulled_by_host(
    host: Host, docker_client: Any, registry: Registry, vllm: LocalImage, prefix: str, **images: Any
) -> Iterator[PushedImage]:
    """A unique stand-in image pushed to ``registry`` under ``prefix`` and gone from the local engine
    (``pushed_image``), with ``host``'s policy pulling from that repository (``pull_host``, with ``images``)."""
    with pushed_image(docker_client, registry, vllm.id, prefix) as image:
        pull_host(host, [f"{registry.host}/{prefix}"], **images)
        yield image


def set_steps(
    host: Host, steps: Sequence[tuple[str, Sequence[Mapping[str, Any]], bool]], owner: str, verbosity: str = ""
) -> tuple[dict[str, Any], str]:
    params = [
        (label, {"policy": str(host.policy), "state_dir": str(host.state_dir), "owner": owner, "engines": list(e)}, c)
        for label, e, c in steps
    ]
    return host.play_module("meridian.node.engine_set", params, extra_args=[verbosity] if verbosity else [])


def local_images(client: Any, repository: str) -> list[Any]:
    return list(client.images.list(name=repository))


def serving(port: int) -> bool:
    with urllib.request.urlopen(f"http://{BIND}:{port}/health", timeout=5) as answer:
        return bool(answer.status == 200)


def test_engine_only_in_the_registry_is_pulled_by_digest_verified_ready_and_a_rerun_pulls_nothing(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pushed_image(docker_client, registry, vllm.id, prefix, blob_bytes=4 * 1024 * 1024) as image:
        pull_host(host, [f"{registry.host}/{prefix}"])
        spec = [engine(f"{prefix}-a", image.pinned, free_port())]
        results, output = set_steps(
            host,
            [("check", spec, True), ("apply", spec, False), ("again", spec, False), ("again check", spec, True)],
            owner=prefix,
            verbosity="-v",
        )
        check = results["check"]["engines"][f"{prefix}-a"]
        assert results["check"]["changed"] is True
        assert check["image_pull"]["would_pull"] is True and check["image_pull"]["pulled"] is False
        assert check["image_pull"]["image"] == image.pinned
        assert "manifest" in check["image_pull"]["size_note"]
        applied = results["apply"]["engines"][f"{prefix}-a"]
        # The apply pulled the random layer: so check mode before it had pulled nothing.
        assert applied["image_pull"]["pulled"] is True
        assert applied["image_pull"]["bytes"] >= 4 * 1024 * 1024
        assert applied["ready"] is True
        assert '"image_pull"' in output and '"bytes"' in output  # what ansible-playbook -v shows per engine
        for label in ("again", "again check"):
            assert results[label]["changed"] is False, results[label]
            assert "image_pull" not in results[label]["engines"][f"{prefix}-a"]
        pulled = local_images(docker_client, image.repository)
        assert [i.id for i in pulled] == [image.id]
        assert image.pinned in pulled[0].attrs["RepoDigests"]
        container = host.container(f"{prefix}-a")
        assert container.image.id == image.id


def test_engine_instance_pulls_in_its_own_run_and_not_again(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pulled_by_host(host, docker_client, registry, vllm, prefix) as image:
        spec = host.params(**engine(f"{prefix}-i", image.pinned, free_port()), owner=prefix)
        results = host.play([("check", spec, True), ("apply", spec, False), ("again", spec, False)])
        assert results["check"]["image_pull"]["would_pull"] is True
        assert results["apply"]["image_pull"]["pulled"] is True and results["apply"]["ready"] is True
        assert results["again"]["changed"] is False and "image_pull" not in results["again"]
        # Recorded for its owner, as engine_set's pulls are: that owner's engine_set prune may remove it later.
        record = read_image_record(str(host.state_dir))
        assert [(i.reference, i.owner, i.brought) for i in record.values()] == [(image.pinned, prefix, "pulled")]


def test_the_registry_serving_another_image_under_the_same_tag_is_never_used(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    repository = f"{registry.host}/{prefix}/standin"
    pinned = push(docker_client, registry, vllm.id, repository, "latest", 64 * 1024)
    # The tag moves to another image; the pin still names the first one's digest.
    moved = push(docker_client, registry, vllm.id, repository, "latest", 64 * 1024)
    forget_local(docker_client, repository)
    try:
        assert moved.digest != pinned.digest
        pull_host(host, [f"{registry.host}/{prefix}"])
        results, _output = set_steps(
            host, [("apply", [engine(f"{prefix}-t", pinned.pinned, free_port())], False)], owner=prefix
        )
        assert results["apply"]["engines"][f"{prefix}-t"]["ready"] is True
        assert host.container(f"{prefix}-t").image.id == pinned.id
        assert moved.id not in {i.id for i in local_images(docker_client, repository)}
    finally:
        forget_local(docker_client, repository)


def _serving_engine(host: Host, image: PushedImage, name: str, owner: str) -> tuple[int, str]:
    port = free_port()
    results, _output = set_steps(host, [("old", [engine(name, image.pinned, port)], False)], owner=owner)
    assert results["old"]["engines"][name]["ready"] is True, results["old"]
    return port, str(host.container(name).id)


def test_a_digest_the_registry_lacks_fails_clearly_and_the_old_engine_keeps_serving(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pulled_by_host(host, docker_client, registry, vllm, prefix) as image:
        name = f"{prefix}-d"
        port, old_id = _serving_engine(host, image, name, prefix)
        absent = f"{image.repository}@sha256:{'0' * 64}"
        results, _output = set_steps(
            host,
            [("check", [engine(name, absent, port)], True), ("apply", [engine(name, absent, port)], False)],
            prefix,
        )
        for label in ("check", "apply"):
            failed = results[label]
            assert failed["failed"] is True and failed["check"] == "image-pull", failed
            assert "manifest" in failed["msg"] and absent in failed["msg"]
        assert host.container(name).id == old_id and host.container(name).status == "running"
        assert serving(port)


def test_a_stalled_pull_is_cancelled_within_the_bound_and_the_old_engine_keeps_serving(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with (
        pushed_image(docker_client, registry, vllm.id, prefix, tag="old") as old,
        pushed_image(docker_client, registry, vllm.id, prefix, tag="big", blob_bytes=64 * 1024 * 1024) as big,
        StallingProxy(registry.port, stall_after=8 * 1024 * 1024) as proxy,
    ):
        # A bound well above a loaded machine's gaps between progress messages: the first 8 MiB must get through
        # before the proxy stalls, or this would be the paused-registry case below.
        pull_host(host, [f"{registry.host}/{prefix}", f"{proxy.host}/{prefix}"], pull_stall_seconds=10)
        name = f"{prefix}-s"
        port, old_id = _serving_engine(host, old, name, prefix)
        stalling = big.pinned_via(proxy.host)
        results, _output = set_steps(host, [("apply", [engine(name, stalling, port)], False)], prefix)
        failed = results["apply"]
        assert failed["check"] == "image-pull-stalled", failed
        pull = failed["engines"][name]["image_pull"]
        assert pull["pulled"] is False and pull["bytes"] > 0
        assert "no progress for 10s" in failed["msg"]
        assert proxy.stalled.is_set()
        assert host.container(name).id == old_id and host.container(name).status == "running"
        assert serving(port)
        # The engine cancelled the pull when the connection closed: no image came of it.
        assert local_images(docker_client, f"{proxy.host}/{prefix}/standin") == []


def test_a_registry_paused_before_it_answers_is_a_stall_and_the_old_engine_keeps_serving(
    host: Host, vllm: LocalImage, prefix: str, docker_client: Any
) -> None:
    # Its own registry: this one is stopped with SIGSTOP, so the engine waits on it before its first byte.
    with (
        running_registry() as paused,
        pushed_image(docker_client, paused, vllm.id, prefix, tag="old") as old,
        pushed_image(docker_client, paused, vllm.id, prefix, tag="new") as new,
    ):
        pull_host(host, [f"{paused.host}/{prefix}"], pull_stall_seconds=3)
        name = f"{prefix}-p"
        port, old_id = _serving_engine(host, old, name, prefix)
        paused.process.send_signal(signal.SIGSTOP)
        try:
            results, _output = set_steps(host, [("apply", [engine(name, new.pinned, port)], False)], prefix)
        finally:
            paused.process.send_signal(signal.SIGCONT)
        failed = results["apply"]
        assert failed["check"] == "image-pull-stalled", failed
        pull = failed["engines"][name]["image_pull"]
        assert (pull["image"], pull["pulled"], pull["bytes"]) == (new.pinned, False, 0)
        assert host.container(name).id == old_id and serving(port)
        assert new.id not in {i.id for i in local_images(docker_client, new.repository)}


def test_a_pull_below_the_disk_floor_is_refused_before_it_starts(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    # Policy arithmetic: a floor no disk here has, against the real free space of Docker's data-root.
    with pulled_by_host(host, docker_client, registry, vllm, prefix, min_free_bytes="1000000T") as image:
        spec = [engine(f"{prefix}-f", image.pinned, free_port())]
        results, _output = set_steps(host, [("check", spec, True), ("apply", spec, False)], prefix)
        for label in ("check", "apply"):
            failed = results[label]
            assert failed["check"] == "disk-low", failed
            assert "1000000000000000000 bytes" in failed["msg"] and "bytes free now" in failed["msg"]
            assert docker_client.info()["DockerRootDir"] in failed["msg"]
        assert local_images(docker_client, image.repository) == []
        assert host.container(f"{prefix}-f") is None


def _auth_file(path: Path, registry: Registry, mode: int = 0o600) -> Path:
    path.write_text(json.dumps({"auths": {registry.host: {"username": USER, "password": PASSWORD}}}))
    path.chmod(mode)
    return path


def test_registry_credentials_come_from_the_policy_file_and_never_show(
    host: Host,
    vllm: LocalImage,
    auth_registry: Registry,
    prefix: str,
    docker_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # _runner_journal puts the venv's bin first
    with pushed_image(docker_client, auth_registry, vllm.id, prefix) as image:
        auth = _auth_file(tmp_path / "registry-auth.json", auth_registry)
        pull_host(host, [f"{auth_registry.host}/{prefix}"], registry_auth_file=str(auth))
        spec = [engine(f"{prefix}-c", image.pinned, free_port())]
        results, output = set_steps(host, [("check", spec, True), ("apply", spec, False)], prefix, verbosity="-vvv")
        assert results["apply"]["engines"][f"{prefix}-c"]["image_pull"]["pulled"] is True
        assert results["apply"]["engines"][f"{prefix}-c"]["ready"] is True
        assert PASSWORD not in output and PASSWORD not in json.dumps(results)
        journal = _runner_journal(host, spec, prefix, tmp_path)
        assert journal  # the run left its artifacts
        for path in journal:
            assert PASSWORD.encode() not in path.read_bytes(), path


def _runner_journal(host: Host, spec: Sequence[Mapping[str, Any]], owner: str, tmp_path: Path) -> list[Path]:
    """The same engine_set run through ansible-runner, as the agent applies: its artifacts are the journal."""
    import ansible_runner

    os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # restored by monkeypatch
    private = tmp_path / "runner"
    (private / "project").mkdir(parents=True)
    params = {"policy": str(host.policy), "state_dir": str(host.state_dir), "owner": owner, "engines": list(spec)}
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [{"meridian.node.engine_set": params}]}]
    (private / "project" / "site.yml").write_text(json.dumps(play))
    runner = ansible_runner.run(
        private_data_dir=str(private),
        playbook="site.yml",
        inventory={
            "all": {
                "hosts": {
                    "localhost": {"ansible_connection": "local", "ansible_python_interpreter": str(VENV_BIN / "python")}
                }
            }
        },
        envvars={"ANSIBLE_COLLECTIONS_PATH": str(REPO / ".build" / "collections")},
        verbosity=3,
        quiet=True,
    )
    assert runner.status == "successful", runner.stdout.read()
    return [path for path in private.rglob("*") if path.is_file()]


@pytest.mark.parametrize("fault", ["group-readable", "symlink", "not-root", "missing"])
def test_a_credentials_file_root_cannot_vouch_for_is_refused_with_nothing_pulled(
    fault: str, host: Host, vllm: LocalImage, auth_registry: Registry, prefix: str, docker_client: Any, tmp_path: Path
) -> None:
    with pushed_image(docker_client, auth_registry, vllm.id, prefix) as image:
        auth = tmp_path / "registry-auth.json"
        if fault == "group-readable":
            _auth_file(auth, auth_registry, 0o640)
        elif fault == "symlink":
            _auth_file(tmp_path / "real.json", auth_registry)
            auth.symlink_to(tmp_path / "real.json")
        elif fault == "not-root":
            _auth_file(auth, auth_registry)
            os.chown(auth, 1000, 1000)
        pull_host(host, [f"{auth_registry.host}/{prefix}"], registry_auth_file=str(auth))
        spec = [engine(f"{prefix}-r", image.pinned, free_port())]
        results, output = set_steps(host, [("apply", spec, False)], prefix)
        failed = results["apply"]
        assert failed["check"] == "registry-auth", failed
        assert str(auth) in failed["msg"]
        assert PASSWORD not in output
        assert local_images(docker_client, image.repository) == []


def test_a_registry_that_wants_credentials_without_them_fails_as_a_pull(
    host: Host, vllm: LocalImage, auth_registry: Registry, prefix: str, docker_client: Any
) -> None:
    with pushed_image(docker_client, auth_registry, vllm.id, prefix) as image:
        pull_host(host, [f"{auth_registry.host}/{prefix}"])
        results, _output = set_steps(
            host, [("apply", [engine(f"{prefix}-n", image.pinned, free_port())], False)], prefix
        )
        assert results["apply"]["check"] == "image-pull", results["apply"]
        assert "no basic auth credentials" in results["apply"]["msg"]


def test_a_pull_in_flight_writes_its_bytes_to_the_progress_file_and_leaves_nothing_when_done(
    host: Host, vllm: LocalImage, registry: Registry, prefix: str, docker_client: Any
) -> None:
    with (
        pushed_image(docker_client, registry, vllm.id, prefix, tag="big", blob_bytes=32 * 1024 * 1024) as big,
        StallingProxy(registry.port, stall_after=4 * 1024 * 1024) as proxy,
    ):
        pull_host(host, [f"{proxy.host}/{prefix}"], pull_stall_seconds=60)
        public = host.root / "public"
        public.mkdir(mode=0o750)
        progress = public / TRANSFERS_FILE
        pulling = big.pinned_via(proxy.host)
        params = {
            "policy": str(host.policy),
            "state_dir": str(host.state_dir),
            "owner": prefix,
            "engines": [engine(f"{prefix}-g", pulling, free_port())],
            "progress_file": str(progress),
        }
        outcome: dict[str, Any] = {}
        run = threading.Thread(
            target=lambda: outcome.update(host.play_module("meridian.node.engine_set", [("apply", params, False)])[0])
        )
        run.start()
        try:
            assert proxy.stalled.wait(120), "the pull never reached the proxy's stall"
            # The module writes at most once a second, and again each second while the pull stands still: the
            # bytes that came before the stall show within a few seconds.
            seen: list[Any] = []
            for _attempt in range(100):
                seen = read_transfers(str(progress))
                if seen and seen[0].bytes_done > 0:
                    break
                time.sleep(0.1)
            assert [(t.kind, t.name) for t in seen] == [("image", pulling)], seen
            assert 0 < seen[0].bytes_done <= 4 * 1024 * 1024
            assert stat.S_IMODE(progress.stat().st_mode) == 0o640
        finally:
            proxy.release()
            run.join(300)
        applied = outcome["apply"]["engines"][f"{prefix}-g"]
        assert applied["image_pull"]["pulled"] is True and applied["ready"] is True, outcome
        assert "progress_problem" not in applied["image_pull"]
        assert read_transfers(str(progress)) == []
        forget_local(docker_client, f"{proxy.host}/{prefix}/standin")


def test_pull_never_refuses_a_missing_image_without_asking_the_registry_and_changes_nothing(
    host: Host, vllm: LocalImage, prefix: str, docker_client: Any
) -> None:
    # The registry is stopped (SIGSTOP) for the whole test: asking it anything would hang into the stall bound.
    with running_registry() as stopped, pushed_image(docker_client, stopped, vllm.id, prefix) as image:
        pull_host(host, [f"{stopped.host}/{prefix}"], pull_stall_seconds=300)
        name = f"{prefix}-n"
        params = {
            "policy": str(host.policy),
            "state_dir": str(host.state_dir),
            "owner": prefix,
            "pull": "never",
            "engines": [engine(name, image.pinned, free_port())],
        }
        stopped.process.send_signal(signal.SIGSTOP)
        try:
            results, _output = host.play_module(
                "meridian.node.engine_set", [("check", params, True), ("apply", params, False)]
            )
        finally:
            stopped.process.send_signal(signal.SIGCONT)
        for label in ("check", "apply"):
            refused = results[label]
            assert refused["failed"] is True and refused["check"] == "image-missing", refused
            assert "pull: never" in refused["msg"] and f"make-bundle --image {image.pinned}" in refused["msg"]
        assert local_images(docker_client, image.repository) == []
        assert docker_client.containers.list(all=True, filters={"name": name}) == []

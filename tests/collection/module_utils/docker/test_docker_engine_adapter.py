"""The Docker adapter against the real Docker Engine: ownership, refusals before create, ports, logs.

Every test names its containers with a random prefix and removes all of them afterwards, failed or not.
The stand-in here is a placeholder HTTP server of this file's own (the engine stand-ins are tested with
the engine drivers): it serves what it finds in its read-only model mount and exits 0 on SIGTERM.
"""

from __future__ import annotations

import hashlib
import io
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_DRIVER,
    LABEL_INSTANCE,
    LABEL_OWNED,
    BindMount,
    ContainerInfo,
    ContainerNotFoundError,
    ContainerSettings,
    DockerEngine,
    DockerEngineError,
    DockerUnavailableError,
    ForeignContainerError,
    ImageNotFoundError,
    NvidiaRuntimeMissingError,
    PortBinding,
    UnsafeImageError,
    config_hash,
    port_bind_problem,
)
from ansible_collections.meridian.node.tests.support.public_api import assert_all_is_the_public_api
from ansible_collections.meridian.node.tests.support.standin_image import (
    LocalImage,
    ensure_base_image,
    ensure_engine_image,
)

PLACEHOLDER_SERVER = """\
import os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

for number in range(int(os.environ.get("STARTUP_LINES", "0"))):
    print(f"startup line {number}")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        try:
            with open("/model/hello.txt") as handle:
                content = handle.read().strip()
        except OSError:
            content = "no-model"
        try:
            with open("/model/written-by-engine", "w") as handle:
                handle.write("x")
            access = "rw"
        except OSError:
            access = "ro"
        body = f"{content}|{access}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def on_sigterm(signum, frame):
    print("got SIGTERM, exiting")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_sigterm)
server = ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("STANDIN_PORT", "8000"))), Handler)
print("listening")
server.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_http(url: str, deadline_s: float = 30.0) -> str:
    """The body of the first 200 from ``url``; fails with the last error once the deadline passes."""
    deadline = time.monotonic() + deadline_s
    last = "no attempt"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return str(response.read().decode())
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last = repr(exc)
        time.sleep(0.1)
    pytest.fail(f"{url} never answered 200 within {deadline_s}s; last error: {last}")


def wait_for_state(engine: DockerEngine, container: ContainerInfo, state: str, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if engine.container(container.id).state == state:
            return
        time.sleep(0.05)
    pytest.fail(f"container {container.name} never reached state {state!r}")


@pytest.fixture(scope="session")
def base_image(docker_client: Any) -> LocalImage:
    """What the ``standin_base_image`` fixture gives, without depending on conftest registering it."""
    return ensure_base_image(docker_client)


@pytest.fixture(scope="session")
def http_image(docker_client: Any, base_image: LocalImage, tmp_path_factory: pytest.TempPathFactory) -> LocalImage:
    server = tmp_path_factory.mktemp("placeholder") / "standin_server.py"
    server.write_text(PLACEHOLDER_SERVER)
    return ensure_engine_image(docker_client, base_image, server)


@pytest.fixture
def engine(docker_client: Any) -> DockerEngine:
    return DockerEngine.from_env()


def settings_for(source: LocalImage, name: str, **overrides: Any) -> ContainerSettings:
    values: dict[str, Any] = {
        "name": name,
        "instance": name,
        "driver": "openai",
        "image": source.pinned,
        "env": {"STANDIN_PORT": "8000"},
        "stop_timeout_s": 10,
    }
    values.update(overrides)
    return ContainerSettings(**values)


def foreign_container(docker_client: Any, image: LocalImage, name: str, command: list[str] | None = None) -> Any:
    """A container someone else made: no labels of ours."""
    return docker_client.containers.create(image.id, command=command or ["sleep", "600"], name=name, init=True)


# --- config hash: no engine needed --------------------------------------------------------------------


def test_config_hash_ignores_key_order_but_not_values() -> None:
    first = config_hash({"env": {"A": "1", "B": "2"}, "image": "x@sha256:" + "0" * 64})
    reordered = config_hash({"image": "x@sha256:" + "0" * 64, "env": {"B": "2", "A": "1"}})
    changed = config_hash({"env": {"A": "1", "B": "3"}, "image": "x@sha256:" + "0" * 64})
    assert first == reordered
    assert first != changed
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 64
    # Pinned: a new serialisation would relabel (and so replace) every running engine on upgrade.
    assert config_hash({"b": [1, "é"], "a": None}) == (
        "sha256:" + hashlib.sha256('{"a":null,"b":[1,"é"]}'.encode()).hexdigest()
    )


def test_settings_hash_changes_with_every_field_that_matters() -> None:
    image = LocalImage(tag="r/x:t", id="sha256:" + "1" * 64)
    base = settings_for(image, "e1")
    variants = [
        settings_for(image, "e1", env={"STANDIN_PORT": "8001"}),
        settings_for(image, "e1", command=("--flag",)),
        settings_for(image, "e1", gpus=("GPU-1",)),
        settings_for(image, "e1", port=PortBinding(8000, 9000)),
        settings_for(image, "e1", mounts=(BindMount("/srv/m", "/model"),)),
        settings_for(image, "e1", stop_timeout_s=11),
        settings_for(image, "e1", image="r/x@sha256:" + "2" * 64),
        settings_for(image, "e1", restart_policy="unless-stopped"),
        settings_for(image, "e1", shm_size_mib=1024),
        settings_for(image, "e1", ipc_mode="host"),
        settings_for(image, "e1", ulimits=(("stack", 67108864, 67108864),)),
        settings_for(image, "e1", ulimits=(("stack", 8388608, 67108864),)),
        settings_for(image, "e1", mounts=(BindMount("/srv/m", "/model", read_only=False),)),
        settings_for(image, "e1", labels={"com.example.team": "search"}),
    ]
    hashes = {variant.config_hash() for variant in variants}
    assert base.config_hash() == settings_for(image, "e1").config_hash()
    assert base.config_hash() not in hashes
    assert len(hashes) == len(variants)


def test_settings_from_before_ipc_and_ulimits_existed_keep_their_hash() -> None:
    # Only a set ipc_mode or ulimits enters the hash: an upgrade does not relabel (and so replace) engines that
    # use neither.
    canonical = settings_for(LocalImage(tag="r/x:t", id="sha256:" + "1" * 64), "e1").canonical()
    assert "ipc_mode" not in canonical and "ulimits" not in canonical


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"ipc_mode": "host", "shm_size_mib": 1024}, "needs a private or shareable ipc_mode"),
        ({"shm_size_mib": 0}, "at least 1 MiB"),
        ({"ipc_mode": "container:other"}, "is not one of private, shareable, host"),
        ({"ulimits": (("stack", 1, 1), ("stack", 2, 2))}, "more than once"),
        ({"ulimits": (("stack", 9, 8),)}, "is not a limit"),
        ({"ulimits": (("stack", -1, 8),)}, "is not a limit"),
        ({"restart_policy": "sometimes"}, "is not one of"),
    ],
)
def test_settings_docker_would_reject_or_silently_ignore_are_refused(overrides: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        settings_for(LocalImage(tag="r/x:t", id="sha256:" + "1" * 64), "e1", **overrides)


def test_settings_that_try_to_set_ownership_labels_are_refused() -> None:
    image = LocalImage(tag="r/x:t", id="sha256:" + "1" * 64)
    with pytest.raises(ValueError, match=r"meridian\.node/owned"):
        settings_for(image, "e1", labels={LABEL_OWNED: "true"})


def test_port_held_by_a_wildcard_listener_is_not_free_on_loopback() -> None:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        problem = port_bind_problem("127.0.0.1", port)
    assert problem is not None and str(port) in problem and "in use" in problem


def test_foreign_address_is_reported_not_crashed() -> None:
    problem = port_bind_problem("192.0.2.1", free_port())  # TEST-NET-1: never an address of this host
    assert problem is not None and "not an address of this host" in problem


# --- against the real engine ----------------------------------------------------------------------------


@pytest.mark.docker
def test_no_engine_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such.sock")
    with pytest.raises(DockerUnavailableError, match="Error connecting to the Docker Engine"):
        DockerEngine.from_env(timeout_s=5)


@pytest.mark.docker
def test_owned_engine_lives_and_dies_cleanly(
    engine: DockerEngine, http_image: LocalImage, prefix: str, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "hello.txt").write_text("weights-v1")
    port = free_port()
    settings = settings_for(
        http_image,
        f"{prefix}-engine",
        port=PortBinding(container_port=8000, host_port=port),
        mounts=(BindMount(str(model), "/model"),),
        restart_policy="unless-stopped",
    )

    created = engine.create(settings)
    assert created.state == "created" and created.owned
    assert created.labels[LABEL_OWNED] == "true"
    assert created.labels[LABEL_INSTANCE] == settings.instance
    assert created.labels[LABEL_DRIVER] == "openai"
    assert created.config_hash == settings.config_hash()
    assert created.image_id == http_image.id

    engine.start(created)
    # The model mount is there and read-only from inside: the engine cannot alter a promoted artifact.
    assert wait_for_http(f"http://127.0.0.1:{port}/") == "weights-v1|ro"
    assert not (model / "written-by-engine").exists()
    assert engine.container(created.id).running
    assert engine.find(settings.name) == engine.container(created.id)

    engine.stop(created, timeout_s=10)
    stopped = engine.container(created.id)
    assert stopped.state == "exited"
    assert "(0)" in stopped.status, f"SIGTERM did not end the server cleanly: {stopped.status}"
    assert "got SIGTERM" in engine.logs_tail(stopped, lines=5)

    engine.remove(stopped)
    assert engine.find(settings.name) is None


@pytest.mark.docker
def test_host_settings_are_what_the_engine_gets(
    engine: DockerEngine, docker_client: Any, http_image: LocalImage, prefix: str, tmp_path: Path
) -> None:
    (tmp_path / "tok").mkdir()
    settings = settings_for(
        http_image,
        f"{prefix}-host",
        mounts=(BindMount(str(tmp_path / "tok"), "/data/tok"),),
        labels={"com.example.team": "search"},
        restart_policy="unless-stopped",
        shm_size_mib=128,
        ulimits=(("nofile", 4096, 8192), ("stack", 67108864, 67108864)),
    )
    created = engine.create(settings)
    attrs = docker_client.api.inspect_container(created.id)
    host_config = attrs["HostConfig"]

    assert host_config["RestartPolicy"]["Name"] == "unless-stopped"
    assert (host_config["IpcMode"], host_config["ShmSize"]) == ("private", 128 * 1024 * 1024)
    assert host_config["Ulimits"] == [
        {"Name": "nofile", "Soft": 4096, "Hard": 8192},
        {"Name": "stack", "Soft": 67108864, "Hard": 67108864},
    ]
    assert host_config["Mounts"] == [
        {"Type": "bind", "Source": str(tmp_path / "tok"), "Target": "/data/tok", "ReadOnly": True}
    ]
    assert attrs["Config"]["Labels"]["com.example.team"] == "search"
    assert created.config_hash == settings.config_hash()


@pytest.mark.docker
def test_logs_tail_returns_only_the_last_lines(engine: DockerEngine, http_image: LocalImage, prefix: str) -> None:
    container = engine.create(settings_for(http_image, f"{prefix}-chatty", env={"STARTUP_LINES": "40"}))
    engine.start(container)
    deadline = time.monotonic() + 30
    while "listening" not in engine.logs_tail(container, lines=1) and time.monotonic() < deadline:
        time.sleep(0.05)
    tail = engine.logs_tail(container, lines=3).splitlines()
    assert tail == ["startup line 38", "startup line 39", "listening"]


@pytest.mark.docker
def test_listing_ignores_foreign_containers_with_similar_names(
    engine: DockerEngine, docker_client: Any, http_image: LocalImage, prefix: str
) -> None:
    ours = engine.create(settings_for(http_image, f"{prefix}-engine"))
    foreign_container(docker_client, http_image, f"{prefix}-engine-2")
    foreign_container(docker_client, http_image, f"x{prefix}-engine")

    assert [c.id for c in engine.list_owned(instance=f"{prefix}-engine")] == [ours.id]
    assert ours.id in [c.id for c in engine.list_owned()]
    assert not any(c.name.startswith((f"{prefix}-engine-", f"x{prefix}")) for c in engine.list_owned())
    found = engine.find(f"{prefix}-engine")
    assert found is not None and found.id == ours.id
    everything = {c.name: c.owned for c in engine.list_containers()}
    assert everything[f"{prefix}-engine-2"] is False and everything[f"{prefix}-engine"] is True


@pytest.mark.docker
def test_foreign_container_with_our_name_is_reported_and_left_running(
    engine: DockerEngine, docker_client: Any, http_image: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-engine"
    stranger = foreign_container(docker_client, http_image, name)
    stranger.start()

    found = engine.find(name)
    assert found is not None and not found.owned and found.id == stranger.id
    with pytest.raises(ForeignContainerError, match=r"not managed by meridian\.node") as raised:
        engine.find_owned(name)
    assert raised.value.container.id == stranger.id
    for attempt in (engine.start, engine.remove, lambda c: engine.stop(c, timeout_s=1)):
        with pytest.raises(ForeignContainerError):
            attempt(found)
    with pytest.raises(DockerEngineError, match=f"Error creating container '{name}'"):
        engine.create(settings_for(http_image, name))

    stranger.reload()
    assert stranger.status == "running"
    assert stranger.labels == {}


@pytest.mark.docker
def test_name_that_is_an_id_prefix_does_not_find_that_container(
    engine: DockerEngine, docker_client: Any, http_image: LocalImage, prefix: str
) -> None:
    stranger = foreign_container(docker_client, http_image, f"{prefix}-stranger")
    assert engine.find(stranger.id[:12]) is None


@pytest.mark.docker
def test_image_carrying_our_labels_does_not_make_its_containers_ours(
    engine: DockerEngine, docker_client: Any, http_image: LocalImage, prefix: str
) -> None:
    dockerfile = f"FROM {http_image.id}\nLABEL {LABEL_OWNED}=true {LABEL_INSTANCE}={prefix}-spoof\n"
    tag = f"meridian-node/spoof:{prefix}"
    spoof_image = docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)[0]
    try:
        foreign_container(docker_client, LocalImage(tag=tag, id=spoof_image.id), f"{prefix}-spoof")
        spoofed = engine.find(f"{prefix}-spoof")
        assert spoofed is not None and spoofed.labels[LABEL_OWNED] == "true"  # what Docker did
        assert not spoofed.owned  # what we make of it
        assert f"{prefix}-spoof" not in [c.name for c in engine.list_owned()]
        with pytest.raises(ForeignContainerError):
            engine.remove(spoofed)
        with pytest.raises(UnsafeImageError, match="carries labels"):
            engine.create(settings_for(LocalImage(tag=tag, id=spoof_image.id), f"{prefix}-from-spoof"))
        assert engine.find(f"{prefix}-from-spoof") is None
        # The verdict on an image is kept (its id is its content): the next listings ask no image question,
        # and the forged container still does not pass as ours.
        asked: list[Any] = []
        listing = engine.api.images

        def counted(filters: Any) -> list[dict[str, Any]]:
            asked.append(filters)
            return listing(filters)

        engine.api.images = counted  # type: ignore[method-assign]
        again = engine.find(f"{prefix}-spoof")
        assert again is not None and not again.owned
        assert f"{prefix}-spoof" not in [c.name for c in engine.list_owned()]
        assert asked == []
        seen_fresh = DockerEngine.from_env().find(f"{prefix}-spoof")
        assert seen_fresh is not None and not seen_fresh.owned
    finally:
        for container in docker_client.containers.list(all=True, filters={"ancestor": spoof_image.id}):
            container.remove(force=True)
        docker_client.images.remove(spoof_image.id, force=True)


@pytest.mark.docker
def test_gpu_request_without_nvidia_runtime_creates_nothing(
    engine: DockerEngine, http_image: LocalImage, prefix: str
) -> None:
    if engine.has_nvidia_runtime():
        pytest.skip("this Docker Engine has the NVIDIA runtime; the refusal cannot be shown here")
    name = f"{prefix}-gpu"
    with pytest.raises(NvidiaRuntimeMissingError, match=r"asks for GPUs \['GPU-0'\].*no NVIDIA runtime"):
        engine.create(settings_for(http_image, name, gpus=("GPU-0",)))
    assert engine.find(name) is None


@pytest.mark.docker
def test_port_published_by_a_container_is_in_use(engine: DockerEngine, http_image: LocalImage, prefix: str) -> None:
    port = free_port()
    assert engine.port_in_use("127.0.0.1", port) is None
    container = engine.create(settings_for(http_image, f"{prefix}-port", port=PortBinding(8000, port)))
    engine.start(container)
    problem = engine.port_in_use("127.0.0.1", port)
    assert problem is not None and f"published by container '{prefix}-port'" in problem


@pytest.mark.docker
def test_port_held_by_a_host_process_is_in_use(engine: DockerEngine) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        problem = engine.port_in_use("127.0.0.1", port)
    assert problem is not None and f"port {port} on 127.0.0.1 is already in use" in problem


@pytest.mark.docker
def test_local_image_pinned_by_id_resolves_only_in_its_own_repository(
    engine: DockerEngine, base_image: LocalImage
) -> None:
    resolved = engine.resolve_image(base_image.pinned)
    assert resolved.id == base_image.id and resolved.pinned_by == "image-id"
    assert engine.resolve_image(base_image.tag).pinned_by == ""
    # An allowed repository name cannot vouch for an image that was never tagged into it.
    with pytest.raises(ImageNotFoundError, match="is tagged"):
        engine.resolve_image(f"meridian-node/other@{base_image.id}")
    with pytest.raises(ImageNotFoundError, match="never pulls"):
        engine.resolve_image(f"{base_image.repository}@sha256:{'0' * 64}")
    with pytest.raises(ImageNotFoundError, match="never pulls"):
        engine.resolve_image("meridian-node/absent:1")


@pytest.mark.docker
def test_container_removed_behind_our_back_is_not_found(
    engine: DockerEngine, docker_client: Any, http_image: LocalImage, prefix: str
) -> None:
    container = engine.create(settings_for(http_image, f"{prefix}-vanishing"))
    docker_client.api.remove_container(container.id, force=True)
    with pytest.raises(ContainerNotFoundError, match=f"Error starting container '{prefix}-vanishing'"):
        engine.start(container)
    with pytest.raises(ContainerNotFoundError):
        engine.container(container.id)


@pytest.mark.docker
def test_missing_image_creates_nothing(engine: DockerEngine, http_image: LocalImage, prefix: str) -> None:
    name = f"{prefix}-noimage"
    with pytest.raises(ImageNotFoundError):
        engine.create(settings_for(http_image, name, image=f"{http_image.repository}@sha256:{'f' * 64}"))
    assert engine.find(name) is None


def test_all_is_the_public_api_with_the_settings_and_info_it_re_exports() -> None:
    from ansible_collections.meridian.node.plugins.module_utils.docker import engine as docker_engine

    assert_all_is_the_public_api(docker_engine)


@pytest.mark.parametrize(
    ("state", "restarts", "expected"),
    [
        ({"ExitCode": 0, "FinishedAt": "0001-01-01T00:00:00Z"}, 0, (0, None, None)),  # never exited
        ({"ExitCode": 0, "FinishedAt": "2026-12-01T10:00:00Z"}, 2, (2, 0, None)),
        ({"ExitCode": 1, "FinishedAt": "2026-12-01T10:00:00Z"}, 3, (3, 1, "exit 1")),
        ({"ExitCode": 137, "FinishedAt": "2026-12-01T10:00:00Z"}, 0, (0, 137, "killed by signal 9")),
        ({"ExitCode": 137, "OOMKilled": True, "FinishedAt": "2026-12-01T10:00:00Z"}, 1, (1, 137, "OOMKilled")),
        (
            {"ExitCode": 128, "Error": "could not select device driver", "FinishedAt": ""},
            0,
            (0, None, "could not select device driver"),
        ),
        ({"ExitCode": True, "FinishedAt": "2026-12-01T10:00:00Z"}, "7", (0, None, None)),  # not Docker's types
    ],
    ids=["never-exited", "clean-exit", "exit-1", "sigkill", "oom", "docker-error", "wrong-types"],
)
def test_exit_info_says_how_a_container_last_ended(
    state: dict[str, Any], restarts: Any, expected: tuple[Any, ...]
) -> None:
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import ExitInfo

    info = ExitInfo.from_inspect({"State": state, "RestartCount": restarts})

    assert (info.restarts, info.exit_code, info.exit_reason) == expected

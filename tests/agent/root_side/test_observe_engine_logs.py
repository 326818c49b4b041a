"""Engine logs where operators look: root's observe unit keeps each engine's tail, scrubbed, for the agent's group.

Real parts: a real Docker Engine running a crash-looping engine container (the stand-in vLLM image with its
command replaced by a shell that prints its environment and dies), root's real ``observe-engines`` verb, and
``meridian-node logs`` run in a child that dropped to ``nobody`` with and without the agent's group.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    LABEL_INSTANCE,
    LABEL_OWNED,
    DockerEngine,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import REDACTED
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from ansible_collections.meridian.node.tests.support.e2e_env import standin_policy
from ansible_collections.meridian.node.tests.support.path_unit import write_node_config
from ansible_collections.meridian.node.tests.support.shared_tmp import reachable_tmp_dir
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from meridian_node_agent.agent_side.observe import InventoryEngines, Observer
from meridian_node_agent.boundary.engine_logs_file import (
    LOG_FILE_MODE,
    MAX_LINE_CHARS,
    TAIL_LINES,
    EngineLogTail,
    KeptRun,
    read_log_tail,
    write_log_tail,
)
from meridian_node_agent.cli import build_parser
from meridian_node_agent.cli import main as cli_main
from meridian_node_agent.collectors.engine_log_keeper import KEEP_GONE_S, keep_engine_logs
from meridian_node_agent.root_side.observe_unit import cmd_observe_engines

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="plays root and drops to the agent's user: run as root (CI does)"),
]

NODE = "gpu-node-logs"
AGENT_GID = 4242  # the agent's group: any group nobody is not in
NOBODY = 65534
SECRET = "hf_LogSecret-6f1d2c9a"
# Prints its environment, a line of work and its crash, then dies: Docker restarts it (on-failure).
CRASHING = 'env; echo "loading model tiny"; echo "fatal: CUDA error: out of memory" >&2; exit 3'


@dataclass(frozen=True)
class Host:
    root: Path
    config: Path

    @property
    def apply(self) -> Path:
        return self.root / "apply"

    @property
    def logs(self) -> Path:
        return self.apply / "public" / "logs"


@pytest.fixture
def host() -> Iterator[Host]:
    with reachable_tmp_dir("mn-engine-logs-") as root:
        state = root / "state"
        state.mkdir(0o750)
        os.chown(state, -1, AGENT_GID)  # root's public/ takes the group of the agent's directory
        yield Host(root, write_node_config(root, node_id=NODE, policy_extra=standin_policy()))


def _observe(host: Host) -> int:
    args = build_parser("observe-engines").parse_args(["--config", str(host.config), "observe-engines"])
    return cmd_observe_engines(args)


def _engine(
    client: Any, image: LocalImage, name: str, script: str, *, env: dict[str, str], restart: str = "on-failure"
) -> Any:
    return client.containers.run(
        image.id,
        [script],
        entrypoint=["sh", "-c"],
        name=name,
        labels={LABEL_OWNED: "true", LABEL_INSTANCE: name, LABEL_OWNER: f"agent:{NODE}"},
        environment=env,
        restart_policy={"Name": restart, "MaximumRetryCount": 0} if restart != "no" else {"Name": "no"},
        detach=True,
    )


def _wait(container: Any, what: str, done: Any) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        container.reload()
        if done(container.attrs):
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} never happened: {container.attrs.get('State')}")


def _crash_looping(client: Any, image: LocalImage, name: str) -> Any:
    container = _engine(client, image, name, CRASHING, env={"HF_TOKEN": SECRET, "WORKERS": "1"})
    _wait(container, "a second crash", lambda attrs: attrs.get("RestartCount", 0) >= 1)
    _wait(container, "the second run's crash line", lambda _attrs: container.logs().count(b"fatal: CUDA") >= 2)
    return container


@pytest.fixture
def crash_loop_kept(host: Host, docker_client: Any, image: LocalImage, prefix: str) -> str:
    """The name of a crash-looping engine of this node (``<prefix>-chat``) whose tail one run of root's observe
    unit kept."""
    name = f"{prefix}-chat"
    _crash_looping(docker_client, image, name)
    assert _observe(host) == 0
    return name


def _files_under(path: Path) -> list[Path]:
    return [Path(d) / f for d, _dirs, files in os.walk(path) for f in files]


def test_a_crash_looping_engines_last_lines_are_kept_scrubbed_and_carried_by_the_observation(
    host: Host, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-chat"
    _crash_looping(docker_client, image, name)

    assert _observe(host) == 0

    tail = read_log_tail(host.logs, name)
    lines = tail.lines()
    # Both runs' crash lines: Docker keeps a container's log across its restarts, and the tail holds them.
    assert sum("fatal: CUDA error: out of memory" in line for line in lines) >= 2
    assert f"HF_TOKEN={REDACTED}" in lines and f"WORKERS={REDACTED}" in lines
    assert tail.current.restarts >= 1 and tail.current.exit_reason == "exit 3"
    for path in _files_under(host.apply):  # nowhere root wrote: not the tail, not engines.json
        assert SECRET.encode() not in path.read_bytes(), path
    kept = host.logs / f"{name}.json"
    info = kept.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (0, AGENT_GID, LOG_FILE_MODE)
    assert (host.logs.stat().st_gid, host.logs.stat().st_mode & 0o777) == (AGENT_GID, 0o750)

    # The agent under the split (no Docker): its observation carries the failing engine's last lines.
    engines = InventoryEngines(root_dir=host.apply, node_id=NODE)
    observation = Observer(store_path=None, gpu_facts=lambda: {"nvml_available": False}, engines=engines).observe(
        node_id=NODE, mode="managed-host", epoch=1, applied_generation=1, last_run=None, now=datetime.now(UTC)
    )
    (observed,) = [engine for engine in observation.engines if engine.name == name]
    assert not observed.ready and observed.last_lines is not None
    # It crash-loops on while observed: its last line is of whichever run printed last, a crash among them.
    assert any("fatal: CUDA error: out of memory" in line for line in observed.last_lines)
    assert SECRET not in observation.model_dump_json()


def test_a_recreated_engine_keeps_the_previous_containers_last_words(
    host: Host, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-chat"
    first = _crash_looping(docker_client, image, name)
    assert _observe(host) == 0
    first.remove(force=True)
    # A repair recreated it, and the new container has printed nothing yet.
    second = _engine(docker_client, image, name, "sleep 300", env={"HF_TOKEN": SECRET}, restart="no")
    _wait(second, "the new container running", lambda attrs: attrs["State"]["Status"] == "running")

    assert _observe(host) == 0

    tail = read_log_tail(host.logs, name)
    assert tail.current.container_id == second.id[:12] and tail.current.lines == ()
    assert tail.previous is not None and tail.previous.container_id == first.id[:12]
    assert any("fatal: CUDA error: out of memory" in line for line in tail.previous.lines)
    assert _observe(host) == 0  # and again: the previous stays while the new one says nothing
    assert read_log_tail(host.logs, name).previous == tail.previous


def test_the_tail_is_bounded_in_lines_and_line_length(
    host: Host, docker_client: Any, image: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-chatty"
    chatty = "i=0; while [ $i -lt 400 ]; do printf 'line %s %03000d\\n' $i 0; i=$((i+1)); done"
    container = _engine(docker_client, image, name, chatty, env={}, restart="no")
    _wait(container, "the chatty engine's exit", lambda attrs: attrs["State"]["Status"] == "exited")

    assert _observe(host) == 0

    lines = read_log_tail(host.logs, name).current.lines
    assert len(lines) == TAIL_LINES
    assert lines[-1].startswith("line 399 ")
    assert all(line.endswith(" more characters]") and len(line) < MAX_LINE_CHARS + 40 for line in lines)


def _as_nobody(groups: list[int], action: Any) -> tuple[int, str]:
    """``action()`` (an exit status) in a forked child that dropped to nobody with ``groups``: the status and
    what it printed. Everything it runs is imported already: nobody could not read the interpreter's files."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        status = 70
        out = io.StringIO()
        try:
            os.setgroups(groups)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                status = action()
        except BaseException as exc:  # reported to the parent, which fails the test with it
            out.write(f"{type(exc).__name__}: {exc}")
        os.write(write, out.getvalue().encode()[:60000])
        os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        printed = pipe.read().decode()
    _, code = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(code), printed


def test_meridian_node_logs_prints_the_tail_to_the_agents_group_and_no_one_else(
    host: Host, crash_loop_kept: str
) -> None:
    name = crash_loop_kept
    argv = ["--config", str(host.config), "logs", name]

    status, out = _as_nobody([AGENT_GID], lambda: cli_main(argv))

    assert status == 0, out
    assert "fatal: CUDA error: out of memory" in out and f"HF_TOKEN={REDACTED}" in out and SECRET not in out
    assert f"--- {name}: container " in out
    status, out = _as_nobody([AGENT_GID], lambda: cli_main([*argv, "--tail", "1"]))
    assert status == 0 and len(out.splitlines()) == 2, out  # the header, and the one line asked for

    status, out = _as_nobody([], lambda: cli_main(argv))

    assert status == 1
    assert "Permission denied" in out and "as a member of its group" in out


def _try_writing(paths: list[Path]) -> int:
    for path in paths:
        with contextlib.suppress(PermissionError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            print(f"wrote {path}")
    return 0


def test_the_agents_group_can_neither_change_nor_add_a_kept_log(host: Host, crash_loop_kept: str) -> None:
    name = crash_loop_kept

    status, out = _as_nobody([AGENT_GID], lambda: _try_writing([host.logs / f"{name}.json", host.logs / "x.json"]))

    assert (status, out) == (0, "")


def test_root_refuses_a_logs_directory_redirected_into_the_agents_and_writes_nothing_there(
    host: Host, crash_loop_kept: str
) -> None:
    name = crash_loop_kept
    agents = host.root / "state"
    # What a compromised agent would want root to follow: its own directory, where it could read or swap files.
    (host.logs / f"{name}.json").unlink()
    host.logs.rmdir()
    host.logs.symlink_to(agents)

    assert _observe(host) == 1

    assert list(agents.iterdir()) == []
    assert host.logs.is_symlink()


def test_a_symlink_planted_where_roots_tail_goes_is_replaced_not_followed(host: Host, crash_loop_kept: str) -> None:
    name = crash_loop_kept
    victim = host.root / "etc" / "shadow-like"
    victim.write_text("root's own secret\n")
    planted = host.logs / f"{name}.json"
    planted.unlink()
    planted.symlink_to(victim)

    assert _observe(host) == 0

    assert victim.read_text() == "root's own secret\n"
    assert not planted.is_symlink()
    assert isinstance(read_log_tail(host.logs, name), EngineLogTail)


def test_observe_without_an_engine_of_this_node_keeps_nothing(host: Host) -> None:
    assert _observe(host) == 0
    assert not host.logs.exists() or list(host.logs.iterdir()) == []


def test_the_tail_of_an_engine_gone_for_longer_than_a_week_is_removed_a_recent_one_kept(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    run = KeptRun("aaaaaaaaaaaa", 0, "exited", "exit 1", "2026-12-01T00:00:00Z", ("last words",))
    for name in ("old", "recent"):
        write_log_tail(logs, EngineLogTail(name, "2026-12-01T00:00:00Z", run))
    now = time.time()
    os.utime(logs / "old.json", (now - KEEP_GONE_S - 60, now - KEEP_GONE_S - 60))
    engine = DockerEngine.from_env(timeout_s=10)
    try:
        # An owner no container has: every engine is gone.
        kept = keep_engine_logs(engine, owner="agent:no-such-node", directory=logs, read_at="x", wall_clock=lambda: now)
    finally:
        engine.close()

    assert (kept.tails, kept.problems) == ({}, ())
    assert sorted(path.name for path in logs.iterdir()) == ["recent.json"]

"""The operator socket: ``publish`` beside a running ``serve`` hands its work to that server
(``devserver/control/operator_wire.py``, ``devserver/serving/operator_socket.py``), and without one does it itself.

Real ``serve`` processes and real CLI processes on one data dir. What the socket must not change is shown by
running the same publish both ways and comparing; what it must refuse (another user, a malformed request) is sent
to it as a real peer would.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from ansible_collections.meridian.node.tests.devserver.devserver_process import (
    cli,
    enroll_node,
    running,
)
from meridian_node_agent.devserver.control.operator_wire import SOCKET_NAME

NODE = "gpu-sock-1"
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


def _document(tmp_path: Path, text: str, name: str = "desired.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _generation(output: str) -> int:
    return int(output.split("generation ")[1].split()[0])


def _raw(path: Path, payload: bytes, *, user: int | None = None) -> dict[str, object]:
    """What the socket at ``path`` answers to ``payload`` sent by a peer of its own. As ``user``: the system's
    python3 (the test's own lives under root's home), started in the socket's directory and connecting by the
    relative name, because the directories above it are root's 0700 ones; the credentials the server sees are the
    ones the peer connects with."""
    code = textwrap.dedent(
        """
        import socket, sys
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(sys.argv[1])
        peer.sendall(sys.stdin.buffer.read())
        peer.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            chunk = peer.recv(65536)
            if not chunk:
                break
            answer += chunk
        sys.stdout.buffer.write(answer)
        """
    )
    python = SYSTEM_PYTHON if user is not None else sys.executable
    done = subprocess.run(
        [python, "-I", "-c", code, path.name],
        input=payload,
        capture_output=True,
        timeout=60,
        cwd=path.parent,
        user=user,
        check=True,
    )
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


def test_publish_beside_a_server_goes_through_its_socket_and_the_node_gets_it(tmp_path: Path) -> None:
    document = _document(tmp_path, yaml.safe_dump({"engines": [], "artifacts": []}))
    with running(tmp_path / "data") as server:
        sock = server.data_dir / SOCKET_NAME
        assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.lstat().st_mode) == 0o600
        with enroll_node(server, tmp_path / "node", NODE) as client:
            # The CLI's own imports show which way it went: opening the database itself loads SQLAlchemy.
            command = [sys.executable, "-X", "importtime", "-m", "meridian_node_agent.devserver.cli"]
            out = tmp_path / "state.json"
            done = subprocess.run(
                [*command, "publish", "--data-dir", str(server.data_dir), NODE, str(document), "--out", str(out)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            assert "sqlalchemy" not in done.stderr and "meridian_node_agent.devserver.control.plane" not in done.stderr
            assert done.stdout.strip() == f"node {NODE}: generation 1 (lease epoch 1)"
            fetched = client.fetch_desired_state(NODE)
            assert fetched.generation == 1 and fetched.envelope == out.read_bytes()


def test_without_a_server_for_its_database_publish_opens_the_database_itself(tmp_path: Path) -> None:
    document = _document(tmp_path, yaml.safe_dump({"engines": [], "artifacts": []}))
    data = tmp_path / "data"
    with running(data) as server:
        assert _generation(server.cli("publish", NODE, str(document)).stdout) == 1
        # Another database than the server's: the server says so and the CLI opens that one itself.
        other = f"sqlite:///{tmp_path / 'other.sqlite3'}"
        assert _generation(server.cli("publish", "--database-url", other, NODE, str(document)).stdout) == 1
        assert _generation(server.cli("publish", NODE, str(document)).stdout) == 2
    assert server.process is not None and server.process.returncode == 0  # SIGTERM: a clean shutdown
    assert not (data / SOCKET_NAME).exists()  # removed by the server that made it
    assert _generation(cli(data, "publish", NODE, str(document)).stdout) == 3
    # A socket left by a server that died (nothing listens on it): the CLI does the work itself.
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(data / SOCKET_NAME))
    left.close()
    assert _generation(cli(data, "publish", NODE, str(document)).stdout) == 4


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("engines: [\n", "is not valid YAML"),
        ("- a list\n", "must hold a mapping (a desired state), got list"),
        (yaml.safe_dump({"engines": [], "artifacts": [], "surprise": 1}), "surprise"),
    ],
)
def test_a_bad_document_is_refused_alike_with_and_without_a_server(tmp_path: Path, text: str, reason: str) -> None:
    document = _document(tmp_path, text)
    data = tmp_path / "data"
    with running(data) as server:
        through_server = server.cli("publish", NODE, str(document), check=False)
        assert _generation(server.cli("publish", NODE, str(_document(tmp_path, "engines: []\n", "ok.yaml"))).stdout)
    by_itself = cli(data, "publish", NODE, str(document), check=False)
    assert reason in through_server.stderr
    assert (through_server.returncode, through_server.stderr) == (by_itself.returncode, by_itself.stderr)
    assert through_server.returncode != 0


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK), reason="another user's peer needs root and python3"
)
def test_the_socket_answers_only_the_servers_own_user(tmp_path: Path) -> None:
    document = _document(tmp_path, "engines: []\n")
    with running(tmp_path / "data") as server:
        sock = server.data_dir / SOCKET_NAME
        # The data dir (0700) is the first barrier; opened here to reach the second one, the peer's credentials.
        server.data_dir.chmod(0o711)
        sock.chmod(0o666)
        request = {
            "verb": "publish",
            "node": NODE,
            "document": base64.b64encode(document.read_bytes()).decode(),
            "where": str(document),
            "ttl_s": None,
            "database": None,
        }
        answer = _raw(sock, json.dumps(request).encode(), user=NOBODY)
        assert answer == {
            "status": "refused",
            "message": f"uid {NOBODY} may not use this server's operator socket (only uid {os.geteuid()})",
        }
        # Nothing was published: the first publish is still generation 1.
        assert _generation(server.cli("publish", NODE, str(document)).stdout) == 1


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00not json", "the request is not JSON"),
        (b"[1, 2]", "the request must be a JSON object, got list"),
        (b'{"verb": "publish"}', "the request must have exactly the fields"),
        (
            json.dumps(
                {"verb": "fence", "node": NODE, "document": "", "where": "x", "ttl_s": None, "database": None}
            ).encode(),
            "unknown verb 'fence'",
        ),
        (
            json.dumps(
                {"verb": "publish", "node": NODE, "document": "%%%", "where": "x", "ttl_s": None, "database": None}
            ).encode(),
            "document is not base64",
        ),
        (
            json.dumps(
                {"verb": "publish", "node": NODE, "document": "", "where": "x", "ttl_s": "1h", "database": None}
            ).encode(),
            "ttl_s must be an integer or null",
        ),
        (b" " * (3 * 1024 * 1024), "the request is larger than"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_reason(tmp_path: Path, payload: bytes, reason: str) -> None:
    document = _document(tmp_path, "engines: []\n")
    with running(tmp_path / "data") as server:
        answer = _raw(server.data_dir / SOCKET_NAME, payload)
        assert answer["status"] == "refused" and reason in str(answer["message"]), answer
        # Nothing was published, and the server serves on.
        assert _generation(server.cli("publish", NODE, str(document)).stdout) == 1


def test_a_second_server_on_the_data_dir_leaves_the_socket_to_the_first(tmp_path: Path) -> None:
    document = _document(tmp_path, "engines: []\n")
    data = tmp_path / "data"
    with running(data, name="first") as first:
        inode = (data / SOCKET_NAME).lstat().st_ino
        with running(data, name="second") as second:
            assert (data / SOCKET_NAME).lstat().st_ino == inode
            assert _generation(second.cli("publish", NODE, str(document)).stdout) == 1
        assert second.stderr_path is not None and "is another server's" in second.stderr_path.read_text()
        # The second one's stop left the first one's socket in place.
        assert (data / SOCKET_NAME).lstat().st_ino == inode
        assert _generation(first.cli("publish", NODE, str(document)).stdout) == 2


def test_sigint_too_stops_the_server_cleanly(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running(data) as server:
        assert server.process is not None
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 0
    assert not (data / SOCKET_NAME).exists()


def test_a_data_dir_too_deep_for_a_unix_socket_address_still_gets_its_socket(tmp_path: Path) -> None:
    # sun_path holds 108 bytes: this data dir's socket path is longer (the CI run found serve crashing on it).
    data = tmp_path / ("deep-" * 14) / "data"
    assert len(str(data / SOCKET_NAME)) > 108
    data.parent.mkdir()
    document = _document(tmp_path, "engines: []\n")
    with running(data) as server:
        assert stat.S_ISSOCK((data / SOCKET_NAME).lstat().st_mode)
        command = [sys.executable, "-X", "importtime", "-m", "meridian_node_agent.devserver.cli"]
        done = subprocess.run(
            [*command, "publish", "--data-dir", str(data), NODE, str(document)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "sqlalchemy" not in done.stderr  # it went through the socket
        assert _generation(done.stdout) == 1
        assert _generation(server.cli("publish", NODE, str(document)).stdout) == 2
    assert not (data / SOCKET_NAME).exists()

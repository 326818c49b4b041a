"""``boundary.agent_files``: how the verbs that show the agent's files read them, whoever runs them. The refusals
of planted files through the real program are in tests/agent/cli/test_root_verbs_read_agent_files.py; here, what
is followed and what is not, named after what a compromised agent would try."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils._fileutil import read_capped
from meridian_node_agent.boundary.agent_files import read_agent_document, read_agent_file
from meridian_node_agent.boundary.directories import BoundaryError

CERT = b"-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n"


def _renewed_identity(state: Path) -> Path:
    """The identity directory as ``agent_side.identity`` leaves it after a renewal."""
    identity = state / "identity"
    version = identity / "versions" / "1f-0a0b0c0d"
    version.mkdir(parents=True)
    (version / "node.pem").write_bytes(CERT)
    (identity / "current").symlink_to("versions/1f-0a0b0c0d")
    (identity / "node.pem").symlink_to("current/node.pem")
    return identity


def _read_certificate(state: Path) -> bytes | None:
    return read_agent_file(state, "identity/node.pem", max_bytes=4096, what="the node certificate", links=True)


def test_the_identitys_own_links_are_followed_down(tmp_path: Path) -> None:
    _renewed_identity(tmp_path)

    read = read_agent_file(tmp_path, "identity/node.pem", max_bytes=4096, what="the node certificate", links=True)

    assert read == CERT


def test_without_links_the_identitys_link_is_refused(tmp_path: Path) -> None:
    _renewed_identity(tmp_path)

    with pytest.raises(BoundaryError, match=r"identity/node.pem: it is a symlink;"):
        read_agent_file(tmp_path, "identity/node.pem", max_bytes=4096, what="the node certificate")


@pytest.mark.parametrize(
    "target", ["../../secret.pem", "/etc/secret.pem", "versions/../../../secret.pem"], ids=["up", "absolute", "dotdot"]
)
def test_a_link_that_leaves_the_directory_is_refused(tmp_path: Path, target: str) -> None:
    identity = _renewed_identity(tmp_path / "state")
    (tmp_path / "secret.pem").write_bytes(b"root's own")
    (identity / "node.pem").unlink()
    (identity / "node.pem").symlink_to(target)

    with pytest.raises(BoundaryError, match="only a relative link that stays below its own directory is followed"):
        _read_certificate(tmp_path / "state")


def test_current_pointed_out_of_the_identity_directory_is_refused(tmp_path: Path) -> None:
    identity = _renewed_identity(tmp_path / "state")
    elsewhere = tmp_path / "root-only"
    elsewhere.mkdir()
    (elsewhere / "node.pem").write_bytes(b"root's own")
    (identity / "current").unlink()
    (identity / "current").symlink_to(elsewhere)

    with pytest.raises(BoundaryError, match=r"identity/current: it is a symlink to '/"):
        _read_certificate(tmp_path / "state")


def test_a_loop_of_links_ends_in_a_refusal(tmp_path: Path) -> None:
    identity = tmp_path / "identity"
    identity.mkdir()
    (identity / "node.pem").symlink_to("other.pem")
    (identity / "other.pem").symlink_to("node.pem")

    with pytest.raises(BoundaryError, match="it is a symlink"):
        read_agent_file(tmp_path, "identity/node.pem", max_bytes=4096, what="the node certificate", links=True)


def test_a_directory_on_the_way_swapped_for_a_symlink_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "node.pem").write_bytes(CERT)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "identity").symlink_to(elsewhere)

    with pytest.raises(BoundaryError, match=r"state/identity: it is a symlink"):
        read_agent_file(tmp_path / "state", "identity/node.pem", max_bytes=4096, what="the node certificate")


def test_a_file_in_place_of_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "identity").write_bytes(b"")

    with pytest.raises(BoundaryError, match=r"identity: it is a regular file, not a directory"):
        read_agent_file(tmp_path, "identity/node.pem", max_bytes=4096, what="the node certificate")


def test_what_is_not_there_is_none(tmp_path: Path) -> None:
    assert read_agent_file(tmp_path / "no-state", "status.json", max_bytes=10, what="x") is None
    assert read_agent_file(tmp_path, "identity/node.pem", max_bytes=10, what="x") is None
    assert read_agent_document(tmp_path, "status.json", max_bytes=10, what="x") is None


@pytest.mark.parametrize("content", [b"[1, 2]", b"{torn", b"\xff\xfe"], ids=["not-an-object", "torn", "not-utf8"])
def test_a_status_that_is_no_json_object_is_no_status(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "status.json").write_bytes(content)

    assert read_agent_document(tmp_path, "status.json", max_bytes=100, what="the agent's status file") is None


def test_a_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    (tmp_path / "status.json").write_bytes(b"{}")
    os.chown(tmp_path / "status.json", 65534, -1)

    with pytest.raises(BoundaryError, match=r"status.json: it is owned by uid 65534, neither by uid"):
        read_agent_file(tmp_path, "status.json", max_bytes=100, what="the agent's status file")


def test_a_long_log_is_read_from_its_end(tmp_path: Path) -> None:
    log = tmp_path / "oplog.jsonl"
    log.write_bytes(b"".join(b"line %05d\n" % number for number in range(10000)))

    tail = read_agent_file(tmp_path, "oplog.jsonl", max_bytes=100, what="the operation log", tail=True)

    assert tail is not None and len(tail) == 100 and tail.endswith(b"line 09999\n")
    assert read_capped(log, 100, what="the operation log", tail=True) == tail
    with pytest.raises(BoundaryError, match="it is larger than 100 bytes"):
        read_agent_file(tmp_path, "oplog.jsonl", max_bytes=100, what="the operation log")

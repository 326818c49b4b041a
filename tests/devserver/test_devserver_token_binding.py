"""Enrollment tokens bound to one node id: the real devserver process, real TLS, the agent's real client.

A token made for node A must not get a certificate for node B, whoever holds it; the refused attempt
must not burn the token (node A still enrolls with it) and must not tell the caller which node it is for.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, cli, enroll_node, running
from ansible_collections.meridian.node.tests.support.devserver_fixtures import DevServerOptions
from ansible_collections.meridian.node.tests.support.old_devserver_schema import OLD_TOKENS_TABLE
from meridian_node_agent.agent_side.control_client import ControlPlaneRejected
from meridian_node_agent.devserver.store.database import token_digest

DEVSERVER_OPTIONS = DevServerOptions(
    tokens=["edge@gpu-bound-serve:auto", "fixed@gpu-bound-fixed:va@lue:with:colons", "open:auto"]
)


def _refused(server: DevServer, directory: Path, node_id: str, token: str) -> ControlPlaneRejected:
    with pytest.raises(ControlPlaneRejected) as refused:
        enroll_node(server, directory, node_id, token)
    return refused.value


def test_token_bound_to_a_node_enrolls_that_node(server: DevServer, tmp_path: Path, node_id: str) -> None:
    made = server.cli("token", f"t-{node_id}", "--node-id", node_id)
    assert "warning" not in made.stderr

    with enroll_node(server, tmp_path / "node", node_id, made.stdout.strip()) as client:
        assert client.heartbeat(node_id).node_id == node_id


def test_stolen_bound_token_cannot_enroll_another_node_and_stays_usable(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    token = server.new_token_for(f"t-{node_id}", node_id)
    thief = f"{node_id}-thief"

    refused = _refused(server, tmp_path / "thief", thief, token)

    assert (refused.status, refused.reason) == (403, "token-wrong-node")
    assert "bound to another node" in refused.detail
    # The caller is not authenticated: it must not learn which node the token is for.
    assert node_id not in refused.detail.replace(thief, "")
    # The attempt is an attack signal: the server logs it, with what the caller was not told.
    log = server.stderr()
    assert "token-wrong-node" in log
    assert f"bound to node '{node_id}'" in log
    assert f"presented for node '{thief}'" in log
    # Refused means not consumed: the real node still enrolls with the same token, once.
    with enroll_node(server, tmp_path / "real", node_id, token) as client:
        assert client.heartbeat(node_id).node_id == node_id
    assert _refused(server, tmp_path / "again", node_id, token).reason == "token-used"


def test_serve_token_bound_with_at_node_id_refuses_other_nodes(server: DevServer, tmp_path: Path) -> None:
    token = server.tokens["edge"]

    assert _refused(server, tmp_path / "other", "gpu-not-bound-serve", token).reason == "token-wrong-node"
    enroll_node(server, tmp_path / "real", "gpu-bound-serve", token).close()


def test_serve_token_value_may_hold_at_and_colon_after_the_binding(server: DevServer, tmp_path: Path) -> None:
    # NAME@NODE_ID:VALUE splits at the first ':', so '@' and ':' inside the value are the value's.
    assert server.tokens["fixed"] == "va@lue:with:colons"

    assert _refused(server, tmp_path / "other", "lue", "va@lue:with:colons").reason == "token-wrong-node"
    enroll_node(server, tmp_path / "real", "gpu-bound-fixed", "va@lue:with:colons").close()


def test_unbound_token_still_enrolls_any_node_id_with_a_warning(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    made = server.cli("token", f"t-{node_id}")
    assert "can enroll any node id" in made.stderr
    assert "--node-id" in made.stderr

    enroll_node(server, tmp_path / "any", f"{node_id}-any-name", made.stdout.strip()).close()
    enroll_node(server, tmp_path / "serve", f"{node_id}-from-serve", server.tokens["open"]).close()
    assert "token 'open' can enroll any node id" in server.stderr()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["token", "t1", "--node-id", ""], "--node-id: a node id cannot be empty"),
        (["token", "t1", "--node-id", "GPU_1"], "--node-id: 'GPU_1' is not a node id"),
        (["token", "t1", "--node-id=-gpu.1-"], "'-gpu.1-' is not a node id"),
        (["token", "t1@gpu-1"], "a token name cannot contain '@'"),
        (["serve", "--port", "0", "--token", "t1@:auto"], "a node id cannot be empty"),
        (["serve", "--port", "0", "--token", "t1@Gpu.1:auto"], "'Gpu.1' is not a node id"),
        (["serve", "--port", "0", "--token", "t1@gpu-1@gpu-2:auto"], "'gpu-1@gpu-2' is not a node id"),
        (["serve", "--port", "0", "--token", "t1@gpu-1"], "with @NODE_ID after NAME"),
        (["serve", "--port", "0", "--token", "@gpu-1:auto"], "the name before ':' is empty"),
    ],
)
def test_malformed_token_binding_is_a_usage_error(tmp_path: Path, args: list[str], message: str) -> None:
    result = cli(tmp_path / "data", *args, check=False)

    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stdout == ""


def test_database_from_before_token_binding_is_migrated_on_open(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    database = data_dir / "devserver.sqlite3"
    with sqlite3.connect(database) as old:
        old.executescript(OLD_TOKENS_TABLE)
        old.execute(
            "INSERT INTO tokens (name, value_sha256, created_at) VALUES (?, ?, ?)",
            ("legacy", token_digest("legacy-token-value"), "2026-01-01T00:00:00Z"),
        )
    old.close()

    with running(data_dir) as server:
        # A token made before binding existed is unbound: it keeps working, for any node id.
        enroll_node(server, tmp_path / "legacy", "gpu-legacy-1", "legacy-token-value").close()
        # And the migrated database takes bound tokens.
        token = server.new_token_for("new", "gpu-legacy-2")
        assert _refused(server, tmp_path / "other", "gpu-legacy-3", token).reason == "token-wrong-node"
        enroll_node(server, tmp_path / "new", "gpu-legacy-2", token).close()

    with sqlite3.connect(database) as check:
        rows = dict(check.execute("SELECT name, node_id FROM tokens").fetchall())
    check.close()
    assert rows == {"legacy": None, "new": "gpu-legacy-2"}

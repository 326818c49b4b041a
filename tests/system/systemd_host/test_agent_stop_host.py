"""``systemctl stop meridian-node`` under a real systemd: the agent exits by itself, long before the unit's stop
timeout, and its journal says why.

One bookworm host booting systemd as PID 1 (tests/support/systemd_host.py) with the project's wheel and units
installed as docs/SECURITY.md says, a site under the privilege split (tests/support/systemd_site.py) against the
devserver in this test process. The agent long-polls for 30 s between states, the wait a stop used to sit out.
Before the agent took SIGTERM itself, systemd's SIGTERM ended it by the default action: killed by the signal, with
nothing in its journal about stopping.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import running
from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.systemd_host import SystemdHost
from ansible_collections.meridian.node.tests.support.systemd_site import (
    AGENT_DIR,
    AGENT_UNIT,
    APPLY_PATH_UNIT,
    APPLY_UNIT,
    agent_oplog,
    install_managed_site,
    root_generation,
    split_config,
    wait_until,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# A liveness bound for ``systemctl stop`` itself (it returns once the unit is down): well under the unit's stop
# timeout (systemd's default, 90 s), past which systemd would SIGKILL the agent and record ``Result=timeout``.
STOP_BOUND_S = 60.0


@dataclass(frozen=True)
class StopSite:
    host: SystemdHost
    node_id: str


@pytest.fixture(scope="module")
def stop_site(installed_host: SystemdHost, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StopSite]:
    host = installed_host
    node_id = f"sd-stop-{secrets.token_hex(3)}"
    with running(tmp_path_factory.mktemp("sd-stop-devserver") / "data") as server:
        config = split_config(node_id, "managed-host", control_plane=server.base_url)
        # The long-poll of a steady agent: a stop that waited it out would take up to 30 s more.
        config["control_plane"] = {"url": server.base_url, "long_poll_seconds": 30, "heartbeat_seconds": 30}
        install_managed_site(host, server, config)
        publish(server, node_id)  # generation 1: nothing to run, one real apply through root's unit
        host.exec(["systemctl", "enable", "--now", APPLY_PATH_UNIT, AGENT_UNIT])
        try:
            with host.logs_on_failure(AGENT_UNIT, APPLY_UNIT):
                wait_until("generation 1 applied", lambda: root_generation(host) == 1, host, [AGENT_UNIT, APPLY_UNIT])
                wait_until("the agent's answer recorded", lambda: _settled(host), host, [AGENT_UNIT, APPLY_UNIT])
            yield StopSite(host, node_id)
        finally:
            host.exec(["systemctl", "disable", "--now", AGENT_UNIT, APPLY_PATH_UNIT], check=False)


def _settled(host: SystemdHost) -> bool:
    result = host.exec(["cat", f"{AGENT_DIR}/oplog.jsonl"], check=False)
    return result.returncode == 0 and bool(result.stdout.strip()) and agent_oplog(host)[-1]["result"] != "started"


def _unit(host: SystemdHost, *properties: str) -> dict[str, str]:
    shown = host.exec(["systemctl", "show", AGENT_UNIT, *(f"--property={name}" for name in properties)]).stdout
    return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


def _journal_events(host: SystemdHost) -> list[dict[str, Any]]:
    """The agent's JSON log lines in the unit's journal, message only."""
    output = host.exec(["sh", "-c", f"journalctl --sync; journalctl --no-pager -o cat -u {AGENT_UNIT}"]).stdout
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_systemctl_stop_ends_the_agent_by_its_own_exit_and_the_journal_says_why(stop_site: StopSite) -> None:
    host = stop_site.host
    time.sleep(1)  # into the steady agent's 30-second long-poll
    started = time.monotonic()
    with host.logs_on_failure(AGENT_UNIT):
        host.exec(["systemctl", "stop", AGENT_UNIT], timeout=STOP_BOUND_S)
    print(f"systemctl stop {AGENT_UNIT} took {time.monotonic() - started:.2f} s (in a long-poll, under the split)")

    shown = _unit(host, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    # ExecMainCode 1 is CLD_EXITED: the agent returned 0 itself, it was neither killed by SIGTERM nor by SIGKILL.
    assert shown == {"ActiveState": "inactive", "Result": "success", "ExecMainCode": "1", "ExecMainStatus": "0"}
    events = _journal_events(host)
    stopping = [e for e in events if e["event"] == "agent-stopping"]
    stopped = [e for e in events if e["event"] == "agent-stopped"]
    assert [e["signal"] for e in stopping] == ["SIGTERM"]
    assert [(e["signal"], e["exit_status"]) for e in stopped] == [("SIGTERM", 0)]

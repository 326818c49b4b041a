"""Engines changed by hand under the privilege split, seen by root's own timer and repaired through the apply unit.

One bookworm host booting systemd as PID 1 (tests/support/systemd_host.py), the wheel and the checkout's
units installed as docs/SECURITY.md says, sharing this machine's network and Docker socket (see
test_privilege_boundary.py for why). The agent (``meridian``) has no Docker access: it sees its engines only
in root's ``public/engines.json``. ``meridian-node-apply-observe.timer`` has root rewrite that file on its
own schedule (a drop-in shortens it to 3 s here), read-only; a hand change shows there as ``drifted``, the
agent spools the same generation, and the apply unit reconciles it.

What is asserted: the drift shows in root's file and in the agent's repair (the oplog's reason names the
settings), the container is replaced with the settings the state asks for, and root's record does not move;
the observe unit never changes an engine (a stopped one stays stopped, with the agent away, until the agent
asks); and a malformed engines.json is refused by the agent with the field named.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.node_env import publish
from ansible_collections.meridian.node.tests.support.systemd_host import CHECKOUT, SystemdHost
from ansible_collections.meridian.node.tests.support.systemd_site import (
    AGENT_DIR,
    AGENT_UNIT,
    APPLY_PATH_UNIT,
    APPLY_UNIT,
    BIN,
    CONFIG,
    ROOT_DIR,
    SiteParts,
    SplitSite,
    install_managed_site,
    split_config,
    wait_until,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TIMER, OBSERVE_UNIT = "meridian-node-apply-observe.timer", "meridian-node-apply-observe.service"
ENGINES = f"{ROOT_DIR}/public/engines.json"
# The observe unit is read-only and needs less than the apply unit (2.5 when written): no network, no devices,
# CHOWN only. Its own bound, so that a loosened unit fails here.
OBSERVE_UNIT_MAX_EXPOSURE = 2.5
# One empty assignment: it resets every monotonic trigger of the unit, not only the one it names.
FAST_TIMER = b"[Timer]\nOnActiveSec=\nOnActiveSec=1s\nOnUnitActiveSec=3s\nAccuracySec=100ms\n"


@dataclass
class Site(SplitSite):
    generation: int

    def engines_file(self) -> dict[str, Any] | None:
        result = self.host.exec(["cat", ENGINES], check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def listed(self) -> dict[str, Any] | None:
        """This engine's entry in root's engines.json, or None."""
        document = self.engines_file()
        found = [e for e in (document or {}).get("engines", []) if e["name"] == self.engine]
        return found[0] if found else None

    def container(self) -> Any:
        return self.docker.containers.get(self.engine)

    def observe_runs(self) -> int:
        """How many times the observe unit has finished in this boot (a counter, not a clock)."""
        return self.host.journal(OBSERVE_UNIT).count("Finished meridian-node-apply-observe.service")

    def apply_starts(self) -> str:
        return self.host.exec(
            ["systemctl", "show", "--property=ExecMainStartTimestampMonotonic", "--value", APPLY_UNIT]
        ).stdout.strip()


def _wait(what: str, check: Callable[[], object], host: SystemdHost, timeout: float = 180) -> None:
    wait_until(what, check, host, (AGENT_UNIT, APPLY_UNIT, OBSERVE_UNIT), timeout=timeout)


@pytest.fixture(scope="module")
def site(site_parts: SiteParts) -> Iterator[Site]:
    host = site_parts.host
    node_id = site_parts.node_id("drift")
    stop_units = (TIMER, AGENT_UNIT, APPLY_PATH_UNIT)
    with site_parts.devserver("drift") as server, site_parts.engine("drift", stop_units=stop_units) as engine:
        supervision = {"settle_seconds": 1, "backoff_initial_seconds": 2, "backoff_max_seconds": 8}
        config = split_config(node_id, "managed-host", control_plane=server.base_url, supervision=supervision)
        install_managed_site(host, server, config)
        # install_meridian_node copies the .service and .path units; the timer is installed here the same way.
        host.put_file(f"/etc/systemd/system/{TIMER}", (CHECKOUT / "systemd" / TIMER).read_bytes(), mode=0o644)
        host.put_file(f"/etc/systemd/system/{TIMER}.d/fast.conf", FAST_TIMER, mode=0o644)
        host.exec(["systemctl", "daemon-reload"])
        generation = publish(server, node_id, document={"engines": [engine.spec()]})
        host.exec(["systemctl", "enable", "--now", APPLY_PATH_UNIT, AGENT_UNIT, TIMER])
        site = Site(host, node_id, engine, site_parts.docker, generation=generation)
        with host.logs_on_failure(AGENT_UNIT, APPLY_UNIT, OBSERVE_UNIT):
            _wait(f"generation {generation} applied", lambda: site.root_generation() == generation, host)
            _wait(f"engine {engine.name} serving", site.serving, host)
            _wait("root's engines file listing it running", lambda: _running_undrifted(site), host)
        yield site


def _running_undrifted(site: Site) -> bool:
    entry = site.listed()
    return entry is not None and entry["state"] == "running" and entry.get("drifted") == []


def _applying(site: Site) -> bool:
    """Whether an apply is under way: one the agent started and has no outcome for, or root's unit running."""
    oplog = site.oplog()
    started = {e["run_ident"] for e in oplog if e["result"] == "started"}
    finished = {e["run_ident"] for e in oplog if e["result"] != "started"}
    return bool(started - finished) or site.host.unit_state(APPLY_UNIT) != "inactive"


def _repairs(site: Site) -> list[dict[str, Any]]:
    return [e for e in site.oplog() if e.get("reason", "").startswith("drift:") and e.get("result") == "started"]


def test_the_observe_unit_is_hardened_and_rewrites_the_file_on_roots_schedule(site: Site) -> None:
    host = site.host
    runs = site.observe_runs()
    before = site.engines_file()
    _wait("two more runs of the observe unit", lambda: site.observe_runs() >= runs + 2, host)
    after = site.engines_file()
    assert before is not None and after is not None and after["written_at"] >= before["written_at"]
    assert host.exec(["stat", "-c", "%U %G %a", ENGINES]).stdout.split() == ["root", "meridian", "644"]
    assert host.exec(["find", AGENT_DIR, "-user", "root"]).stdout == ""  # nothing of root's in the agent's dir

    scores = {unit: host.unit_security_score(unit) for unit in (APPLY_UNIT, OBSERVE_UNIT)}
    # What one run costs (a figure for the docs, not asserted): the verb as the unit runs it, as root.
    cost = host.exec(
        ["python3", "-c", "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
         "capture_output=True); r = resource.getrusage(resource.RUSAGE_CHILDREN); print(r.ru_utime + r.ru_stime)",
         BIN, "--config", CONFIG, "observe-engines"]
    ).stdout.strip()  # fmt: skip
    print(f"systemd-analyze security: {OBSERVE_UNIT} {scores[OBSERVE_UNIT]}, {APPLY_UNIT} {scores[APPLY_UNIT]}")
    print(f"{OBSERVE_UNIT}: one run with one engine costs {float(cost):.2f} s of CPU")
    assert scores[OBSERVE_UNIT] <= OBSERVE_UNIT_MAX_EXPOSURE


def test_docker_update_under_the_split_is_seen_by_roots_timer_and_repaired_through_the_apply_unit(
    site: Site,
) -> None:
    host = site.host
    _wait("the engine serving, nothing drifted", lambda: site.serving() and _running_undrifted(site), host)
    before = site.container()
    repairs = len(_repairs(site))
    started = time.monotonic()

    # Keeps serving: only root's look at the container can tell.
    before.update(restart_policy={"Name": "no"}, cpu_quota=50_000, cpu_period=100_000)

    _wait("root's engines file showing the hand change", lambda: (site.listed() or {}).get("drifted"), host)
    seen = time.monotonic() - started
    assert site.listed()["drifted"] == ["restart_policy", "cpus"]  # type: ignore[index]
    _wait("the agent spooling a repair", lambda: len(_repairs(site)) > repairs, host)
    _wait("the engine replaced and serving", lambda: site.container().id != before.id and site.serving(), host)
    _wait("root's engines file without the drift", lambda: _running_undrifted(site), host)
    repaired = time.monotonic() - started
    print(f"docker update -> drifted in engines.json {seen:.1f} s, -> replaced, serving, clean {repaired:.1f} s")

    repair = _repairs(site)[-1]
    assert repair["generation"] == site.generation
    assert f"{site.engine}: changed by hand: restart_policy, cpus" in repair["reason"]
    settings = site.container().attrs["HostConfig"]
    assert settings["RestartPolicy"]["Name"] == "unless-stopped"
    assert (settings["CpuQuota"], settings["NanoCpus"]) == (0, 0)
    assert site.root_generation() == site.generation  # the same generation, reconciled again
    assert "changed by hand" not in host.journal(OBSERVE_UNIT)  # root's observer only reports; the agent asks


def test_the_observe_unit_never_changes_an_engine_a_stopped_one_stays_stopped_until_the_agent_asks(
    site: Site,
) -> None:
    host = site.host
    _wait("the engine serving, nothing drifted", lambda: site.serving() and _running_undrifted(site), host)
    host.exec(["systemctl", "stop", AGENT_UNIT])  # nobody to ask for a repair
    try:
        applies = site.apply_starts()
        container = site.container()
        container.stop(timeout=5)
        _wait("root's engines file showing it exited", lambda: (site.listed() or {}).get("state") == "exited", host)
        runs = site.observe_runs()
        _wait("three more runs of the observe unit", lambda: site.observe_runs() >= runs + 3, host)

        container.reload()
        assert container.status == "exited" and site.container().id == container.id
        assert site.apply_starts() == applies  # the apply unit did not run: nothing asked it
        assert (site.listed() or {}).get("state") == "exited"
    finally:
        host.exec(["systemctl", "start", AGENT_UNIT])
    _wait("the agent repairing it", site.serving, host)
    assert site.container().id == container.id  # started again through the apply unit, the same container


def test_a_malformed_engines_file_is_refused_by_the_agent_with_the_field_named(site: Site) -> None:
    host = site.host
    _wait("the engine serving, nothing drifted", lambda: site.serving() and _running_undrifted(site), host)
    host.exec(["systemctl", "stop", TIMER])
    # Stopping the timer leaves a run in flight: let it finish, or it replaces the file planted below. So does an
    # apply, which rewrites the file as it ends: the one the last test's restarted agent resumed can still be
    # running when the engine already serves (CI saw it overwrite the planted file).
    host.wait_unit(OBSERVE_UNIT, "inactive")
    _wait("no apply in flight", lambda: not _applying(site), host)
    try:
        document = site.engines_file()
        assert document is not None
        for entry in document["engines"]:
            entry["drifted"] = ["cpus; rm -rf /"]
        host.put_file(ENGINES, json.dumps(document).encode(), mode=0o644, owner="root:meridian")

        _wait("the agent refusing it", lambda: "is not a setting name" in host.journal(AGENT_UNIT), host)
        line = [ln for ln in host.journal(AGENT_UNIT).splitlines() if "is not a setting name" in ln][-1]
        assert "engines-not-observed" in line and "drifted" in line and ENGINES in line
    finally:
        host.exec(["systemctl", "start", TIMER])
    # Root's next look replaces it; the agent reads the good file again.
    _wait("root's engines file valid again", lambda: _running_undrifted(site), host)
    _wait("the engine serving", site.serving, host)

"""meridian.node.engine_set's two ways of running give one result: in Ansible's worker and as a module.

The action plugin runs the set in the worker when the task is local, as this user, with the controller's
interpreter (every test here, and the agent's apply unit); ``meridian_engine_set_in_worker=false`` forces the
module. Each test runs the same steps both ways on the real Docker Engine and compares the registered results
whole (only the containers' ids differ), the output's secrecy included; the last one shows which way each kind
of task goes, by what Ansible leaves in its remote temp directory and says at -vvv.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.collection.modules.test_engine_set import (
    SECRET,
    failing_then_good,
)
from ansible_collections.meridian.node.tests.support.e2e_env import engine_spec
from ansible_collections.meridian.node.tests.support.engine_harness import (
    VENV_BIN,
    Host,
    free_ports,
    run_playbook,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage
from ansible_collections.meridian.node.tests.support.trust_fixtures import NODE_ID

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def worker_python(output: str) -> str:
    """The interpreter Ansible's worker runs under, as ansible-playbook -vvv prints it."""
    found = re.search(r"^  python version = .*\(([^()]+)\)$", output, re.MULTILINE)
    assert found, output[:2000]
    return found.group(1)


def without_ids(value: Any) -> Any:
    """The result with every container id blanked: the only thing two runs of one spec may differ in."""
    if isinstance(value, dict):
        return {k: ("<id>" if k == "id" else without_ids(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def remove(host: Host, prefix: str) -> None:
    for container in host.client.containers.list(all=True, filters={"name": prefix}):
        container.remove(force=True)


def ways(module: str) -> dict[str, list[str]]:
    """The extra arguments that run ``module``'s task in the worker and as a module."""
    switch = f"meridian_{module.rsplit('.', 1)[-1]}_in_worker"
    return {"worker": ["-e", f"{switch}=true"], "module": ["-e", f"{switch}=false"]}


def both_ways(
    host: Host, module: str, steps: list[tuple[str, dict[str, Any], bool]], prefix: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``steps`` (``play_module``'s, with the host's policy and state dir) run in the worker and then as a module,
    each way at -vvv saying it went that way and never showing SECRET; the two ways' results, ids blanked. The
    containers named ``prefix``... are removed after each way."""
    seen = {}
    for way, extra in ways(module).items():
        results, output = host.play_module(
            module, [(label, host.params(**p), check) for label, p, check in steps], extra_args=[*extra, "-vvv"]
        )
        short = module.rsplit(".", 1)[-1]
        assert f"{short}: runs {'in the worker' if way == 'worker' else 'as a module'}" in output
        assert SECRET not in output and SECRET not in json.dumps(results), f"{way}: the secret showed"
        seen[way] = without_ids(results)
        remove(host, prefix)
    return seen["worker"], seen["module"]


def test_engines_form_converges_refuses_and_masks_alike_both_ways(host: Host, vllm: LocalImage, prefix: str) -> None:
    ports = free_ports(2)
    params = {
        "engines": [
            engine_spec(f"{prefix}-a", vllm, ports[0], secret_env={"API_TOKEN": SECRET}),
            engine_spec(f"{prefix}-b", vllm, ports[1]),
        ]
    }
    unpinned = {"engines": [{**engine_spec(f"{prefix}-c", vllm, ports[0]), "image": "meridian-node/standin:latest"}]}
    steps: list[tuple[str, dict[str, Any], bool]] = [
        ("check", params, True),
        ("apply", params, False),
        ("again", params, False),
        ("unsupported", {"engines": [], "bogus": 1}, False),
        ("exclusive", {"engines": [], "envelope": "/nonexistent", "node_id": NODE_ID}, False),
        ("unpinned", unpinned, False),
        ("record-without-envelope", {"engines": [], "record": True}, False),
    ]
    worker, module = both_ways(host, "meridian.node.engine_set", steps, prefix)
    assert worker["apply"]["changed"] is True and worker["again"]["changed"] is False, worker["again"]
    assert worker["unsupported"]["msg"].startswith(
        "Unsupported parameters for (meridian.node.engine_set) module: bogus"
    )
    assert "mutually exclusive" in worker["exclusive"]["msg"]
    assert worker["unpinned"]["failed"] is True and worker["record-without-envelope"]["failed"] is True
    assert sorted(worker["apply"]["engines"]) == [f"{prefix}-a", f"{prefix}-b"]
    for label, _params, _check in steps:
        assert worker[label] == module[label], f"{label}: the two ways differ"


def test_envelope_form_records_and_fails_alike_both_ways(
    tmp_path: Path, docker_client: Any, vllm: LocalImage, prefix: str
) -> None:
    host, _served, _never, failing, good = failing_then_good(tmp_path, docker_client, vllm, prefix)
    # The engine that serves gets 30 s to be ready (3 s was not always enough on a loaded machine, and the two ways
    # then differed by timing); the one that never gets ready has its own 3 s in the signed state.
    form = {"node_id": NODE_ID, "record": True, "owner": f"agent:{NODE_ID}", "prune": True, "ready_timeout": 30}
    steps = [
        ("failing", {"envelope": str(failing), **form}, False),
        ("check", {"envelope": str(good), **form}, True),
        ("good", {"envelope": str(good), **form}, False),
        ("again", {"envelope": str(good), **form}, False),
    ]
    seen = {}
    for way, extra in ways("meridian.node.engine_set").items():
        results, output = host.play_module(
            "meridian.node.engine_set",
            [(label, host.params(**p), check) for label, p, check in steps],
            extra_args=extra,
        )
        assert SECRET not in output and SECRET not in json.dumps(results), f"{way}: the secret showed"
        seen[way] = without_ids(results)
        remove(host, prefix)
        shutil.rmtree(host.state_dir)
        host.state_dir.mkdir()

    worker, module = seen["worker"], seen["module"]
    assert (worker["failing"]["failed"], worker["failing"]["recorded"]) == (True, False)
    assert (worker["good"]["recorded"], worker["again"]["recorded"], worker["again"]["changed"]) == (True, False, False)
    for label, _params, _check in steps:
        assert worker[label] == module[label], f"{label}: the two ways differ"


def test_only_a_local_task_with_the_controllers_interpreter_runs_in_the_worker(tmp_path: Path) -> None:
    remote_tmp = tmp_path / "remote-tmp"
    call = {"engines": [], "policy": str(tmp_path / "no-policy.yaml"), "state_dir": str(tmp_path)}
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        ("environment", {"environment": {"DOCKER_HOST": "unix:///var/run/docker.sock"}}),
        ("delegated", {"delegate_to": "localhost"}),
        ("async", {"async": 60, "poll": 1}),
        ("interpreter", {"vars": {"ansible_python_interpreter": "/usr/bin/python3"}}),
        ("switched off", {"vars": {"meridian_engine_set_in_worker": False}}),
    ]
    tasks = [
        {"name": kind, "meridian.node.engine_set": call, "ignore_errors": True, **keywords} for kind, keywords in kinds
    ]
    playbook = tmp_path / "play.yml"
    venv_python = {"ansible_python_interpreter": str(VENV_BIN / "python")}
    play = {"hosts": "localhost", "gather_facts": False, "vars": venv_python, "tasks": tasks}
    playbook.write_text(json.dumps([play]))
    proc = run_playbook(
        playbook,
        temp_dir=tmp_path / "local-tmp",
        extra_env={"ANSIBLE_KEEP_REMOTE_FILES": "1", "ANSIBLE_REMOTE_TEMP": str(remote_tmp)},
        extra_args=["-vvv"],
        host_vars="ansible_connection=local",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    ways = [line.split("engine_set: runs ", 1)[1] for line in proc.stdout.splitlines() if "engine_set: runs " in line]
    assert len(ways) == len(kinds), proc.stdout[-3000:]
    assert ways[0] == f"in the worker (local, interpreter {worker_python(proc.stdout)})"
    assert ways[1:] == [
        "as a module (the task has an environment)",
        "as a module (delegate_to)",
        "as a module (async)",
        f"as a module (ansible_python_interpreter /usr/bin/python3 is not {worker_python(proc.stdout)})",
        "as a module (meridian_engine_set_in_worker is false)",
    ]
    # Each one got as far as reading the (missing) policy, and failed on it alone.
    assert proc.stdout.count("fatal: [localhost]: FAILED!") == len(kinds) and f"ignored={len(kinds)}" in proc.stdout
    assert proc.stdout.count("cannot read the file: No such file or directory") >= len(kinds)
    # What a module run leaves behind when kept: one payload per module task, none for the worker's.
    payloads = sorted(remote_tmp.glob("ansible-tmp-*/AnsiballZ_engine_set.py"))
    assert len(payloads) == len(kinds) - 1, payloads

"""meridian.node.engine_instance's two ways of running give one result: in Ansible's worker and as a module.

The action plugin (plugin_utils.in_worker, as engine_set's) runs the engine's converge in the worker when the task
is local, as this user, with the controller's interpreter (every test here, and the agent's apply unit);
``meridian_engine_instance_in_worker=false`` forces the module. The same steps run both ways on the real Docker
Engine and the registered results are compared whole (only the containers' ids differ), secrecy included. Which
kinds of task go which way is shown once for both plugins by test_engine_set_worker.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from ansible_collections.meridian.node.tests.collection.action.test_engine_set_worker import both_ways
from ansible_collections.meridian.node.tests.collection.modules.test_engine_set import SECRET
from ansible_collections.meridian.node.tests.support.e2e_env import engine_spec
from ansible_collections.meridian.node.tests.support.engine_harness import Host, free_port
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_one_engine_converges_refuses_and_masks_alike_both_ways(host: Host, vllm: LocalImage, prefix: str) -> None:
    spec = engine_spec(f"{prefix}-one", vllm, free_port(), secret_env={"API_TOKEN": SECRET}, ready_timeout=30)
    steps: list[tuple[str, dict[str, Any], bool]] = [
        ("check", spec, True),
        ("apply", spec, False),
        ("again", spec, False),
        ("unsupported", {**spec, "bogus": 1}, False),
        ("missing", {"name": f"{prefix}-two", "state": "started"}, False),
        ("unpinned", {**spec, "name": f"{prefix}-three", "image": "meridian-node/standin:latest"}, False),
        ("absent", {"name": spec["name"], "state": "absent"}, False),
    ]
    worker, module = both_ways(host, "meridian.node.engine_instance", steps, prefix)
    assert (worker["check"]["changed"], worker["apply"]["changed"], worker["again"]["changed"]) == (True, True, False)
    assert worker["unsupported"]["msg"].startswith(
        "Unsupported parameters for (meridian.node.engine_instance) module: bogus"
    )
    assert "state is started but all of the following are missing" in worker["missing"]["msg"]
    assert worker["unpinned"]["failed"] is True and "digest" in worker["unpinned"]["msg"], worker["unpinned"]
    assert worker["absent"]["changed"] is True
    for label, _params, _check in steps:
        assert worker[label] == module[label], f"{label}: the two ways differ"

# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The argument spec of one engine, shared by ``engines.instance`` (one engine) and ``engines.set`` (a list),
and the options of how both run (``RUN_OPTIONS``).

One copy, so that an option added to an engine reaches both modules with the same type, default and no_log.
``run_on_docker`` is how each engine module's outcome reaches the host's Docker Engine and reports a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import ResultError
from ansible_collections.meridian.node.plugins.module_utils._module import HOST_ARGS
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, DockerEngineError
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import DRIVERS

# What a present, started or stopped engine cannot be built without.
SPEC_REQUIRED = ["driver", "image", "model", "port"]

ENGINE_SPEC_OPTIONS: dict[str, Any] = {
    "name": {"type": "str", "required": True},
    "state": {"type": "str", "default": "started", "choices": ["present", "started", "stopped", "absent"]},
    "driver": {"type": "str", "choices": list(DRIVERS)},
    "image": {"type": "str"},
    "model": {
        "type": "dict",
        "options": {"artifact": {"type": "str"}, "name": {"type": "str"}},
        "mutually_exclusive": [["artifact", "name"]],
        "required_one_of": [["artifact", "name"]],
    },
    "served_model_name": {"type": "str"},
    "gpus": {"type": "list", "elements": "str", "default": []},
    "min_vram_mib": {"type": "int", "default": 0},
    "force": {"type": "bool", "default": False},
    "port": {"type": "int"},
    "args": {"type": "list", "elements": "str", "default": []},
    # Only secret_env is no_log: Ansible masks a no_log value wherever it occurs in the output, so a plain
    # value such as "1" or "tgi" would star every digit of a hash and every engine name holding it.
    "env": {"type": "dict", "default": {}},
    "secret_env": {"type": "dict", "default": {}, "no_log": True},
    "restart_policy": {"type": "str", "default": "unless-stopped", "choices": ["no", "on-failure", "unless-stopped"]},
    "shm_size_mib": {"type": "int"},
    "ipc_mode": {"type": "str", "default": "private", "choices": ["private", "host"]},
    "ulimits": {"type": "dict", "default": {}},
    "volumes": {
        "type": "list",
        "elements": "dict",
        "default": [],
        "options": {"source": {"type": "str", "required": True}, "target": {"type": "str", "required": True}},
    },
    "labels": {"type": "dict", "default": {}},
    "health_path": {"type": "str"},
    "replace_strategy": {
        "type": "str",
        "default": "drain-then-replace",
        "choices": ["drain-then-replace", "stop-then-start"],
    },
}

# Where the spec is required: every state but absent.
SPEC_REQUIRED_IF = [("state", state, SPEC_REQUIRED) for state in ("present", "started", "stopped")]

# How either module waits, drains and finds the host's policy, state and store (top-level options of both).
RUN_OPTIONS: dict[str, Any] = {
    "wait_ready": {"type": "bool", "default": True},
    "ready_timeout": {"type": "int", "default": 600},
    "drain_timeout": {"type": "int", "default": 300},
    "drain_grace": {"type": "int", "default": 10},
    "drain_settle": {"type": "int", "default": 0},
    "replace_beside": {"type": "bool", "default": False},
    **HOST_ARGS,
    "store_path": {"type": "path"},
    "owner": {"type": "str"},
    "progress_file": {"type": "path"},
    "pull": {"type": "str", "choices": ["missing", "never"], "default": "missing"},
}


def run_on_docker(act: Callable[[DockerEngine], dict[str, Any]]) -> dict[str, Any]:
    """``act``'s result with the host's Docker Engine, closed afterwards. A Docker Engine that cannot be reached
    fails the run with check ``docker``; a ``ResultError`` fails it with what was done so far."""
    try:
        engine = DockerEngine.from_env()
    except DockerEngineError as exc:
        return {"failed": True, "msg": str(exc), "check": "docker"}
    try:
        return act(engine)
    except ResultError as exc:
        return exc.failure()
    finally:
        engine.close()

"""``meridian.node.drain``'s arguments and what a run of it returns (``plugins/modules/drain.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._module import STATE_DIR_ARGS
from ansible_collections.meridian.node.plugins.module_utils.engines.args import run_on_docker
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import DrainOptions, drain_engine

ARGUMENT_SPEC: dict[str, Any] = {
    "name": {"type": "str", "required": True},
    "state": {"type": "str", "default": "drained", "choices": ["drained", "undrained"]},
    "timeout": {"type": "int", "default": 300},
    "grace": {"type": "int", "default": 10},
    "force": {"type": "bool", "default": False},
    "stop": {"type": "bool", "default": True},
    "stop_timeout": {"type": "int"},
    **STATE_DIR_ARGS,
    "reason": {"type": "str", "default": "drained by meridian.node.drain"},
}


def drain_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """``drain_engine``'s result; on failure ``failed`` and ``msg`` with what was done so far."""
    for option in ("timeout", "grace", "stop_timeout"):
        if params[option] is not None and params[option] < 0:
            return {"failed": True, "msg": f"{option} must be >= 0 seconds, got {params[option]}"}
    options = DrainOptions(
        state=params["state"],
        timeout_s=params["timeout"],
        grace_s=params["grace"],
        force=params["force"],
        stop=params["stop"],
        stop_timeout_s=params["stop_timeout"],
        state_dir=params["state_dir"],
        reason=params["reason"],
    )
    return run_on_docker(lambda engine: drain_engine(params["name"], options, engine=engine, check_mode=check_mode))

"""``meridian.node.cordon``'s arguments and what a run of it returns (``plugins/modules/cordon.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._module import STATE_DIR_ARGS
from ansible_collections.meridian.node.plugins.module_utils.engines.args import run_on_docker
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon import CordonOptions, cordon_host

ARGUMENT_SPEC: dict[str, Any] = {
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
    "gpus": {"type": "list", "elements": "str", "default": []},
    "drain": {"type": "bool"},
    "reason": {"type": "str"},
    "timeout": {"type": "int", "default": 300},
    "grace": {"type": "int", "default": 10},
    "force": {"type": "bool", "default": False},
    **STATE_DIR_ARGS,
}


def _gpu_facts() -> Mapping[str, Any]:
    # Imported here: NVML is read only when a GPU cordon has engines to match against it.
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

    return collect_gpu_facts(processes=False, nvlink=False, health=False)


def cordon_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """``cordon_host``'s result; on failure ``failed`` and ``msg`` with what was done so far."""
    for option in ("timeout", "grace"):
        if params[option] < 0:
            return {"failed": True, "msg": f"{option} must be >= 0 seconds, got {params[option]}"}
    gpus = [str(gpu).strip() for gpu in params["gpus"]]
    if any(not gpu for gpu in gpus):
        return {"failed": True, "msg": f"gpus must name GPUs by uuid, index or MIG uuid; got an empty id in {gpus}"}
    options = CordonOptions(
        state=params["state"],
        gpus=tuple(gpus),
        drain=params["drain"],
        reason=params["reason"],
        timeout_s=params["timeout"],
        grace_s=params["grace"],
        force=params["force"],
        state_dir=params["state_dir"],
    )
    return run_on_docker(
        lambda engine: cordon_host(options, engine=engine, gpu_facts=_gpu_facts, check_mode=check_mode)
    )

"""``meridian.node.engine_info``'s arguments and what a run of it returns (``plugins/modules/engine_info.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._module import HOST_ARGS
from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import YAML_IMPORT_ERROR
from ansible_collections.meridian.node.plugins.module_utils.docker import engine as docker_engine
from ansible_collections.meridian.node.plugins.module_utils.engines.discovery import engine_info
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import DrainStateError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError

ARGUMENT_SPEC: dict[str, Any] = {
    **HOST_ARGS,
    "managed_only": {"type": "bool", "default": False},
    "owner": {"type": "str"},
    "probe": {"type": "bool", "default": True},
    "capacity": {"type": "bool", "default": True},
}


def _gpu_facts() -> Mapping[str, Any]:
    # Imported here: NVML is read only when capacity is asked for. Capacity only needs memory: processes
    # and NVLink cost NVML calls per GPU and say nothing about room.
    from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts

    return collect_gpu_facts(processes=False, nvlink=False)


def engine_info_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """What ``engine_info`` found, never a change (the same in check mode); ``failed`` and ``msg`` (and
    ``exception`` for a missing library) when the policy, the draining marks or Docker could not be read."""
    del check_mode  # read-only
    if YAML_IMPORT_ERROR is not None:
        return {"failed": True, "msg": missing_required_lib("PyYAML"), "exception": YAML_IMPORT_ERROR}
    try:
        result = engine_info(
            docker_engine.DockerEngine.from_env,
            policy_path=params["policy"],
            state_dir=params["state_dir"],
            managed_only=params["managed_only"],
            owner=params["owner"],
            probe=params["probe"],
            gpu_facts=_gpu_facts if params["capacity"] else None,
        )
    except PolicyError as exc:
        return {"failed": True, "msg": f"Error reading the policy: {exc}"}
    except DrainStateError as exc:
        return {"failed": True, "msg": f"Error reading the draining marks: {exc}"}
    except docker_engine.DockerEngineError as exc:
        # from_env's message already names the connection; listing errors name their action too.
        return {"failed": True, "msg": str(exc)}
    return {"changed": False, **result}

"""``meridian.node.engine_info``'s arguments and what a run of it returns (``plugins/modules/engine_info.py``)."""

from __future__ import annotations

import os
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
    ``exception`` for a missing library) when the policy, the draining marks or Docker could not be read.

    Listing needs no policy: an operator looks at a host before (or without) installing one. With no file at
    ``policy`` the engines are listed all the same; only ``capacity.free_ports`` needs the policy (its port
    range and bind address) and is null, with a warning when capacity was asked for. A policy file that
    exists is read and must be valid: a broken one fails as it would for every other module.
    """
    del check_mode  # read-only
    # lexists: a dangling symlink is a policy someone meant to install; reading it fails, naming the file.
    policy_path = params["policy"] if os.path.lexists(params["policy"]) else None
    if policy_path is not None and YAML_IMPORT_ERROR is not None:
        return {"failed": True, "msg": missing_required_lib("PyYAML"), "exception": YAML_IMPORT_ERROR}
    try:
        result = engine_info(
            docker_engine.DockerEngine.from_env,
            policy_path=policy_path,
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
    if policy_path is None and params["capacity"]:
        result["warnings"] = [
            f"no policy at {params['policy']}: the engines are listed without one, but capacity.free_ports is null "
            "because the free ports come from the policy's engines.port_range and bind_address; pass policy= "
            "(the policy file's path) to get them, or capacity=false to skip capacity"
        ]
    return {"changed": False, **result}

"""``meridian.node.engine_instance``'s arguments and what a run of it returns
(``plugins/modules/engine_instance.py``).

The spec options are ``engines.args``' (one copy, shared with ``engine_set``'s engines); converging is
``engines.instance.converge``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import YAML_IMPORT_ERROR
from ansible_collections.meridian.node.plugins.module_utils.engines.args import (
    ENGINE_SPEC_OPTIONS,
    RUN_OPTIONS,
    SPEC_REQUIRED_IF,
    run_on_docker,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import Options
from ansible_collections.meridian.node.plugins.module_utils.engines.instance import converge

ARGUMENT_SPEC: dict[str, Any] = {
    **ENGINE_SPEC_OPTIONS,
    **RUN_OPTIONS,
}
REQUIRED_IF = SPEC_REQUIRED_IF


def engine_instance_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """``converge``'s result, with a warning when the engine waits for its artifact (check mode); on failure
    ``failed``, ``msg`` and ``check`` with what was done so far (``exception`` for a missing library)."""
    if YAML_IMPORT_ERROR is not None:
        return {"failed": True, "msg": missing_required_lib("PyYAML"), "exception": YAML_IMPORT_ERROR}
    options = Options(
        state=params["state"],
        health_path=params["health_path"],
        replace_strategy=params["replace_strategy"],
        wait_ready=params["wait_ready"],
        ready_timeout_s=params["ready_timeout"],
        drain_timeout_s=params["drain_timeout"],
        drain_grace_s=params["drain_grace"],
        drain_settle_s=params["drain_settle"],
        replace_beside=params["replace_beside"],
        policy_path=params["policy"],
        state_dir=params["state_dir"],
        store_path=params["store_path"],
        owner=params["owner"],
        progress_file=params["progress_file"],
        pull=params["pull"],
    )
    result = run_on_docker(lambda engine: converge(params, options, check_mode=check_mode, engine=engine))
    if not result.get("failed") and result.get("pending"):
        return {**result, "warnings": [f"engine {params['name']!r}: {result['pending']}"]}
    return result

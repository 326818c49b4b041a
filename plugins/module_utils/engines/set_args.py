"""``meridian.node.engine_set``'s arguments and what a run of it returns, for its two ways of running.

The module (``plugins/modules/engine_set.py``) validates these through ``AnsibleModule`` on the managed host;
the action plugin (``plugins/action/engine_set.py``), when it runs the set in Ansible's own worker, validates
them with ``ArgumentSpecValidator``, the validator ``AnsibleModule`` uses. One copy of the spec and one
``engine_set_outcome`` keep the two from drifting; ``tests/collection/action/test_engine_set_worker.py`` runs both
ways and compares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import YAML_IMPORT_ERROR
from ansible_collections.meridian.node.plugins.module_utils.engines.args import (
    ENGINE_SPEC_OPTIONS,
    RUN_OPTIONS,
    SPEC_REQUIRED_IF,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.set import EngineSetError
from ansible_collections.meridian.node.plugins.module_utils.engines.set_run import run_engine_set

ENGINE_OPTIONS = {
    **ENGINE_SPEC_OPTIONS,
    "ready_timeout": {"type": "int"},
    "drain_timeout": {"type": "int"},
    "drain_grace": {"type": "int"},
}

ARGUMENT_SPEC = {
    "engines": {
        "type": "list",
        "elements": "dict",
        "options": ENGINE_OPTIONS,
        "required_if": SPEC_REQUIRED_IF,
    },
    "envelope": {"type": "path"},
    "node_id": {"type": "str"},
    "record": {"type": "bool", "default": False},
    "prune": {"type": "bool"},
    "parallel": {"type": "int", "default": 8},
    "cordon": {
        "type": "dict",
        "options": {
            "gpus": {"type": "list", "elements": "str", "default": []},
            "drain": {"type": "bool", "default": False},
            "reason": {"type": "str"},
        },
    },
    **RUN_OPTIONS,
}

MUTUALLY_EXCLUSIVE = [["engines", "envelope"], ["cordon", "envelope"]]
REQUIRED_ONE_OF = [["engines", "envelope"]]
REQUIRED_TOGETHER = [["envelope", "node_id"]]


def engine_set_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """The result of one run from validated parameters, as the module returns it before Ansible's own keys:
    ``failed`` and ``msg`` (and ``exception`` for a missing library) on failure, ``warnings`` when any."""
    if YAML_IMPORT_ERROR is not None:
        return {"failed": True, "msg": missing_required_lib("PyYAML"), "exception": YAML_IMPORT_ERROR}
    try:
        return run_engine_set(params, check_mode=check_mode, held_artifacts=_held_problems)
    except EngineSetError as exc:
        if exc.missing_library is not None:
            package, error = exc.missing_library
            return {"failed": True, "msg": missing_required_lib(package), "exception": error}
        return exc.failure()


def _held_problems(artifacts: Sequence[Mapping[str, Any]], *, policy_path: str, store_path: str | None) -> list[str]:
    # Imported on use: the store's contracts load pydantic (about 0.2 s), which a task whose state lists no
    # artifact, or that converges listed engines, never needs (bench/engines.py: engine_set's no-op).
    from ansible_collections.meridian.node.plugins.module_utils.artifacts.held import held_problems

    return held_problems(artifacts, policy_path=policy_path, store_path=store_path)

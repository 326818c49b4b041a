"""``meridian.node.desired_state``'s arguments and what a run of it returns (``plugins/modules/desired_state.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.meridian.node.plugins.module_utils._module import HOST_ARGS
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.desired_state import (
    EnvelopeInputError,
    read_envelope,
    reconcile_desired_state,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import PolicyError
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import Rejection, missing_libraries

ARGUMENT_SPEC: dict[str, Any] = {
    "envelope": {"type": "path", "required": True},
    "node_id": {"type": "str", "required": True},
    **HOST_ARGS,
    "record": {"type": "bool", "default": False},
    "secrets": {"type": "bool", "default": False},
}


def desired_state_outcome(params: Mapping[str, Any], *, check_mode: bool) -> dict[str, Any]:
    """The verified state's summary with ``changed`` and the applied generation's ``diff``; ``failed`` and
    ``msg`` (``rejection`` when the verifier refused, ``exception`` for a missing library) on failure."""
    for package, error in missing_libraries():
        return {"failed": True, "msg": missing_required_lib(package), "exception": error}
    try:
        outcome = reconcile_desired_state(
            read_envelope(params["envelope"]),
            policy_path=params["policy"],
            node_id=params["node_id"],
            state_dir=params["state_dir"],
            record=params["record"],
            check_mode=check_mode,
            secrets=params["secrets"],
        )
    except Rejection as exc:
        return {
            "failed": True,
            "msg": f"Error verifying desired state {params['envelope']}: {exc}",
            "rejection": exc.code.value,
        }
    except (PolicyError, StateStoreError, EnvelopeInputError) as exc:
        return {"failed": True, "msg": f"Error verifying desired state {params['envelope']}: {exc}"}
    result = outcome.result
    before = result["applied_generation_before"]
    diff = {
        "before": {"applied_generation": before},
        "after": {"applied_generation": result["generation"] if outcome.changed else before},
    }
    return {"changed": outcome.changed, "diff": diff, **result}

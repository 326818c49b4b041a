"""The labels meridian.node writes on an engine's container, and how they are read back.

Docker keeps labels with the container, so they are the record that survives the module's process: which
spec an engine was created from (``LABEL_SPEC``, without any env value), the VRAM it reserves on its GPUs
(``LABEL_MIN_VRAM``, read by ``engines.placement``), and who converges it (``LABEL_OWNER``). Ownership and
the config hash are the Docker layer's (``docker.engine``).
"""

from __future__ import annotations

import json
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import ContainerInfo
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import SECRET_SHOWN
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedEngineSpec

__all__ = [
    "LABEL_MIN_VRAM",
    "LABEL_OWNER",
    "LABEL_SPEC",
    "engine_labels",
    "label_spec",
    "public_spec",
    "shown_spec",
]

LABEL_SPEC = "meridian.node/spec"
LABEL_MIN_VRAM = "meridian.node/min-vram-mib"
# Who converges the engine, e.g. "agent:<node id>" for the pull agent's reconcile: what it prunes is only
# what it started, never an operator's playbook engines or another agent's on a shared Docker Engine.
LABEL_OWNER = "meridian.node/owner"


def public_spec(spec: ParsedEngineSpec) -> dict[str, Any]:
    """The spec without any env value, for the label (and so the config hash): env keys only.

    Its form is the one v0.1.0 wrote: the label is hashed, and a new form would replace every engine on
    upgrade. ``secret_env_keys`` is added only where there are secrets, which replace the engine anyway.

    The generic driver's health path is left out: it changes how the engine is probed, not the
    container, so changing it must not replace a serving engine.
    """
    return {
        "name": spec.name,
        "driver": spec.driver,
        "image": spec.image,
        "model": spec.model.as_dict(),
        "served_model_name": spec.served_model_name,
        "gpus": list(spec.gpus),
        "min_vram_mib": spec.min_vram_mib,
        "port": spec.port,
        "args": list(spec.args),
        "env_keys": sorted(spec.env),
        "restart_policy": spec.restart_policy,
        "shm_size_mib": spec.shm_size_mib,
        "ipc_mode": spec.ipc_mode,
        # One form for one limit: `stack: 8` and `stack: {soft: 8, hard: 8}` are the same container.
        "ulimits": {
            name: {"soft": limit, "hard": limit} if isinstance(limit, int) else {"soft": limit.soft, "hard": limit.hard}
            for name, limit in sorted(spec.ulimits.items())
        },
        "volumes": [{"source": volume.source, "target": volume.target} for volume in spec.volumes],
        "labels": dict(spec.labels),
        **({"secret_env_keys": sorted(spec.secret_env)} if spec.secret_env else {}),
    }


def shown_spec(spec: ParsedEngineSpec) -> dict[str, Any]:
    """The spec as diffs and results show it: the label's, with ``env`` values whole and each ``secret_env``
    key beside ``SECRET_SHOWN``. A changed secret shows as a changed ``config_hash`` (it hashes the values)."""
    shown = public_spec(spec)
    shown["env"] = dict(spec.env)
    if spec.secret_env:
        shown["secret_env"] = {key: SECRET_SHOWN for key in sorted(spec.secret_env)}
    return shown


def engine_labels(spec: ParsedEngineSpec, owner: str | None) -> dict[str, str]:
    """Our labels for a container created from ``spec``: its public spec, its reservation, its owner."""
    labels = {
        LABEL_SPEC: json.dumps(public_spec(spec), sort_keys=True, separators=(",", ":")),
        LABEL_MIN_VRAM: str(spec.min_vram_mib),
    }
    if owner:
        labels[LABEL_OWNER] = owner
    return labels


def label_spec(container: ContainerInfo) -> dict[str, Any]:
    """The non-secret spec an owned container carries in its label; {} when absent or unreadable."""
    try:
        spec = json.loads(container.labels.get(LABEL_SPEC, "{}"))
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}

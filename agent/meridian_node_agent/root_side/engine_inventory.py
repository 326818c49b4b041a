"""What root sees of this node's engines, collected from Docker for ``<state_dir>/engines.json``.

Runs on: the root side only: ``apply_unit.refresh_inventory`` calls it (after each apply, each second while one
runs, and for the observe unit on its timer) and writes what it returns in the format ``boundary.engines_file``
defines, which the agent reads. Only reads Docker: the engine discovery the playbook uses, a list, an inspect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from meridian_node_agent.boundary.engines_file import Inventory, InventoryEngine

__all__ = ["collect_inventory"]


def collect_inventory(
    connect: Callable[[], Any], *, node_id: str, policy_path: str, state_dir: str, written_at: str
) -> Inventory:
    """What root sees of this node's engines, through the engine discovery the playbook uses (root side).

    ``engine_info`` keeps the engines owned by ``agent:<node id>`` and needs no Docker Engine when the
    policy allows no image; the second listing adds the address each one is probed on. Raises what
    ``engine_info`` raises (``PolicyError``, ``DockerEngineError``).
    """
    from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
        DockerEngineError,
        EngineInspection,
    )
    from ansible_collections.meridian.node.plugins.module_utils.engines.discovery import engine_info
    from ansible_collections.meridian.node.plugins.module_utils.engines.drain import driver_of, probe_address
    from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER

    owner = f"agent:{node_id}"
    listed = engine_info(connect, policy_path=policy_path, state_dir=state_dir, owner=owner, probe=False)["engines"]
    # By engine name and published port: while an engine is replaced, its old and new containers both show.
    probes: dict[tuple[str, int | None], tuple[str, str, tuple[str, int] | None]] = {}
    exits: dict[tuple[str, int | None], EngineInspection] = {}  # how each last ended, what was changed by hand
    if listed:
        engine = connect()
        try:
            for container in engine.list_owned():
                if container.labels.get(LABEL_OWNER) == owner:
                    driver = driver_of(container)
                    address = probe_address(container, driver)
                    key = (container.instance or container.name, None if address is None else address[1])
                    probes[key] = (driver.name, driver.facts.health_path, address)
                    with contextlib.suppress(DockerEngineError):  # gone since the listing: nothing to say
                        exits[key] = engine.inspect_engine(container.id)
        finally:
            engine.close()
    engines = []
    for entry in listed:
        key = (entry["name"], entry["port"])
        probe_driver, health_path, address = probes.get(key, ("openai", "/health", None))
        inspected = exits.get(key)
        engines.append(
            InventoryEngine(
                name=entry["name"],
                driver=entry["driver"],
                served_model_name=entry["served_model_name"],
                image=entry["image"],
                host=None if address is None else address[0],
                port=None if address is None else address[1],
                probe_driver=probe_driver,
                health_path=health_path,
                gpus=tuple(entry["gpus"]),
                min_vram_mib=entry["min_vram_mib"],
                state=entry["state"],
                restarts=None if inspected is None else inspected.exit.restarts,
                exit_code=None if inspected is None else inspected.exit.exit_code,
                exit_reason=None if inspected is None else inspected.exit.exit_reason,
                drifted=None if inspected is None else inspected.drifted,
            )
        )
    return Inventory(node_id=node_id, written_at=written_at, engines=tuple(engines))

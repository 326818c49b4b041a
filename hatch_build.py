"""Build hook: a wheel carries the collection under ansible_collections/meridian/node.

Only standard wheels get the copy. An editable install must not: a copy in site-packages would shadow
the checkout, which the editable install already exposes through .build/collections.
"""

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

COLLECTION_PREFIX = "ansible_collections/meridian/node"
SHIPPED = ("galaxy.yml", "meta", "plugins", "playbooks", "roles", "contracts")


class CollectionInWheel(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version != "standard":
            return
        for name in SHIPPED:
            build_data["force_include"][name] = f"{COLLECTION_PREFIX}/{name}"

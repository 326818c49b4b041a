"""Build hook: a standard wheel carries the collection privately, for the agent alone.

The copy goes to ``meridian_node_agent/collection/ansible_collections/meridian/node``, a directory that is
on no Ansible collection path: ``ansible-galaxy collection install`` and ``ansible-playbook`` see only
Galaxy installs, while the agent puts the directory on ``sys.path`` and runs its playbooks with exactly
this copy (``meridian_node_agent/__init__.py``, ``apply.py``). A wheel that put it at
``site-packages/ansible_collections`` made Galaxy answer "Nothing to do" and let two copies drift.

Only standard wheels get the copy. An editable install must not: it would shadow the checkout, which the
editable install already exposes through .build/collections.
"""

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

COLLECTION_PREFIX = "meridian_node_agent/collection/ansible_collections/meridian/node"
SHIPPED = ("galaxy.yml", "meta", "plugins", "playbooks", "roles", "contracts")


def _shipped_files(root: Path) -> list[Path]:
    """The files under SHIPPED, less tool caches and bytecode (force_include would copy those too)."""
    files: list[Path] = []
    for name in SHIPPED:
        top = root / name
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            parts = path.relative_to(root).parts
            if path.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in parts):
                files.append(path)
    return files


class CollectionInWheel(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version != "standard":
            return
        root = Path(self.root)
        for path in _shipped_files(root):
            relative = path.relative_to(root).as_posix()
            build_data["force_include"][str(path)] = f"{COLLECTION_PREFIX}/{relative}"

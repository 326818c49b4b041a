# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run ``meridian.node.engine_instance`` in Ansible's own worker when the module would run there anyway
(``plugin_utils.in_worker``: when, and why that is the same process); the host variable
``meridian_engine_instance_in_worker`` set false forces the module. A loop of engines pays no process per item."""

from __future__ import annotations

from ansible_collections.meridian.node.plugins.plugin_utils.in_worker import InWorkerAction, ModuleCode


class EngineInstanceAction(InWorkerAction):
    MODULE = "meridian.node.engine_instance"
    SWITCH = "meridian_engine_instance_in_worker"

    def module_code(self) -> ModuleCode:
        from ansible_collections.meridian.node.plugins.module_utils.engines.instance_args import (
            ARGUMENT_SPEC,
            REQUIRED_IF,
            engine_instance_outcome,
        )

        return ModuleCode(ARGUMENT_SPEC, engine_instance_outcome, {"required_if": REQUIRED_IF})


# The name Ansible looks up in an action plugin; the class keeps a name of its own (one name, one class).
ActionModule = EngineInstanceAction

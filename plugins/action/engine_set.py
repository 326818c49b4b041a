# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run ``meridian.node.engine_set`` in Ansible's own worker when the module would run there anyway
(``plugin_utils.in_worker``: when, and why that is the same process); the host variable
``meridian_engine_set_in_worker`` set false forces the module."""

from __future__ import annotations

from ansible_collections.meridian.node.plugins.plugin_utils.in_worker import InWorkerAction, ModuleCode


class EngineSetAction(InWorkerAction):
    MODULE = "meridian.node.engine_set"
    SWITCH = "meridian_engine_set_in_worker"

    def module_code(self) -> ModuleCode:
        from ansible_collections.meridian.node.plugins.module_utils.engines.set_args import (
            ARGUMENT_SPEC,
            MUTUALLY_EXCLUSIVE,
            REQUIRED_ONE_OF,
            REQUIRED_TOGETHER,
            engine_set_outcome,
        )

        constraints = {
            "mutually_exclusive": MUTUALLY_EXCLUSIVE,
            "required_one_of": REQUIRED_ONE_OF,
            "required_together": REQUIRED_TOGETHER,
        }
        return ModuleCode(ARGUMENT_SPEC, engine_set_outcome, constraints)


# The name Ansible looks up in an action plugin; the class keeps a name of its own (one name, one class).
ActionModule = EngineSetAction

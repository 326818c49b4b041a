"""Attribute documentation shared by every meridian.node module.

Use ``meridian.node.attributes`` for the attributes every module declares (check_mode, diff_mode,
idempotent) with the support every module of this collection gives: full check mode, and idempotent. Add
``meridian.node.attributes.diff`` or ``meridian.node.attributes.no_diff`` for the module's diff mode,
``meridian.node.attributes.facts`` for modules that return ``ansible_facts`` and ``meridian.node.attributes.action``
for modules with an action plugin of the same name. A module's own ``attributes`` entry wins over a fragment's
(Ansible merges the fragments under the module's document), so a module that is not idempotent says so there,
with its details.
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description:
      - Can run in C(check_mode) and return changed status prediction without modifying the target.
    support: full
  diff_mode:
    description:
      - Will return details on what has changed (or possibly needs changing in C(check_mode)), when in
        diff mode.
  idempotent:
    description:
      - When run twice in a row outside check mode with the same arguments, the second run reports no
        change, as long as nothing else changed the host in between.
    support: full
"""

    DIFF = r"""
options: {}
attributes:
  diff_mode:
    support: full
"""

    NO_DIFF = r"""
options: {}
attributes:
  diff_mode:
    support: none
"""

    FACTS = r"""
options: {}
attributes:
  facts:
    description:
      - Action returns an C(ansible_facts) dictionary that will update existing host facts.
    support: full
"""

    ACTION = r"""
options: {}
attributes:
  action:
    description:
      - Has an action plugin of the same name, so part or all of the work can happen on the controller.
    support: full
    details:
      - When the task runs on the controller itself (connection C(local), no C(become), no C(delegate_to), no
        C(async), no task C(environment)) and C(ansible_python_interpreter) is the controller's own interpreter,
        the action plugin runs the module's code in Ansible's worker process, with the module's argument
        validation and no_log masking, without starting a module process. Set the variable
        C(meridian_<module>_in_worker) (C(meridian_engine_set_in_worker), C(meridian_engine_instance_in_worker))
        to V(false) to always run the module. C(-vvv) says which way each task went, and why.
  async:
    description:
      - Supports being used with the C(async) keyword.
    support: full
    details:
      - An C(async) task always runs as a module.
"""

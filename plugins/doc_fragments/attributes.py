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
  async:
    description:
      - Supports being used with the C(async) keyword.
    support: full
"""

"""Attribute documentation shared by every meridian.node module.

Use ``meridian.node.attributes`` for the attributes every module declares (check_mode, diff_mode,
idempotent), add ``meridian.node.attributes.facts`` for modules that return ``ansible_facts`` and
``meridian.node.attributes.action`` for modules with an action plugin of the same name.
Modules then only state their ``support`` level for each attribute.
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description:
      - Can run in C(check_mode) and return changed status prediction without modifying the target.
  diff_mode:
    description:
      - Will return details on what has changed (or possibly needs changing in C(check_mode)), when in
        diff mode.
  idempotent:
    description:
      - When run twice in a row outside check mode with the same arguments, the second run reports no
        change, as long as nothing else changed the host in between.
"""

    FACTS = r"""
options: {}
attributes:
  facts:
    description:
      - Action returns an C(ansible_facts) dictionary that will update existing host facts.
"""

    ACTION = r"""
options: {}
attributes:
  action:
    description:
      - Has an action plugin of the same name, so part or all of the work can happen on the controller.
  async:
    description:
      - Supports being used with the C(async) keyword.
"""

"""The host options several meridian.node modules share: where the policy and root's state live.

Use ``meridian.node.host`` for both, ``meridian.node.host.policy`` or ``meridian.node.host.state_dir`` for
one. Their defaults are ``module_utils/_module.py``'s ``HOST_ARGS``, written once. Each fragment is a literal
string, as ansible-test's yamllint reads it (it refuses computed ones), so the two options are written twice.
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  policy:
    description:
      - The host's root-owned policy file (docs/SECURITY.md) - trusted keys, allowed images and drivers, engine
        ports and bind address, the artifact store and the air gap.
    type: path
    default: /etc/meridian/policy.yaml
  state_dir:
    description:
      - The root-owned state directory of the host's apply side (the agent's C(apply.state_dir)) - the
        applied-state record C(applied.json) that decides replay, and the draining marks in C(draining/).
      - Never a directory an unprivileged user can write.
    type: path
    default: /var/lib/meridian-node-apply
"""

    POLICY = r"""
options:
  policy:
    description:
      - The host's root-owned policy file (docs/SECURITY.md) - trusted keys, allowed images and drivers, engine
        ports and bind address, the artifact store and the air gap.
    type: path
    default: /etc/meridian/policy.yaml
"""

    STATE_DIR = r"""
options:
  state_dir:
    description:
      - The root-owned state directory of the host's apply side (the agent's C(apply.state_dir)) - the
        applied-state record C(applied.json) that decides replay, and the draining marks in C(draining/).
      - Never a directory an unprivileged user can write.
    type: path
    default: /var/lib/meridian-node-apply
"""

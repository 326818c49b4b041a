"""The systemd test host (tests/helpers/systemd_host.py): ``installed_host`` is a booted bookworm container
with meridian-node installed, one per test module."""

from ansible_collections.meridian.node.tests.helpers.systemd_host import installed_host  # noqa: F401

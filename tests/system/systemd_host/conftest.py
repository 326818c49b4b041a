"""What every systemd-host module builds its site from (``site_parts``, see tests/support/systemd_site.py); the
host itself, ``installed_host``, comes from tests/support/systemd_host.py through tests/conftest.py."""

from ansible_collections.meridian.node.tests.support.systemd_site import site_parts  # noqa: F401

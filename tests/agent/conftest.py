"""Fixtures the agent tests share: one devserver per module and a node id per test (see
tests/support/devserver_fixtures.py)."""

from ansible_collections.meridian.node.tests.support.devserver_fixtures import (  # noqa: F401
    devserver_options,
    node_id,
    server,
)

"""Fixtures the devserver tests share: one devserver per module and a node id per test (see
tests/support/devserver_fixtures.py); the session's PostgreSQL, an empty database of a test's own on it, and an
empty store database on each backend per test (see tests/support/postgres.py)."""

from ansible_collections.meridian.node.tests.support.devserver_fixtures import (  # noqa: F401
    node_id,
    server,
)
from ansible_collections.meridian.node.tests.support.postgres import (  # noqa: F401
    postgres_database,
    postgres_server,
    store_backend,
)

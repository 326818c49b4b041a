"""The logs verb's tests with a real engine container name theirs with a prefix per test, removed afterwards
(tests/support/e2e_fixtures.py)."""

from ansible_collections.meridian.node.tests.support.e2e_fixtures import prefix  # noqa: F401

"""The rollout tests' container name prefix, its containers removed afterwards (tests/support/e2e_fixtures.py)."""

from ansible_collections.meridian.node.tests.support.e2e_fixtures import prefix  # noqa: F401

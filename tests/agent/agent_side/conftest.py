"""Fixtures the agent side's tests with real engines use: the stand-in vLLM image tagged for the module and a
container name prefix per test, its containers removed afterwards (tests/support/e2e_fixtures.py)."""

from ansible_collections.meridian.node.tests.support.e2e_fixtures import image, prefix  # noqa: F401

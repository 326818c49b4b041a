"""Shared fixtures. Docker-backed tests skip without an engine, except in CI, where they must fail."""

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

# One pytest worker runs gRPC tests (the fake kubelet) and, later, tests that fork ansible-playbook in process: with
# gRPC's fork support on, those children died before exec (grpc/grpc#43055). Off, as the agent has it
# (agent_side/podresources/client.py), before any test module imports gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _require_docker() -> bool:
    return os.environ.get("MERIDIAN_REQUIRE_DOCKER") == "1"


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A client for the real Docker Engine on this machine."""
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # any failure means the same thing here: no usable engine
        message = f"no Docker Engine answers on this machine ({type(exc).__name__}: {exc})"
        if _require_docker():
            pytest.fail(f"{message}; MERIDIAN_REQUIRE_DOCKER=1 forbids skipping", pytrace=False)
        pytest.skip(message)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _agent_logger_as_found() -> Iterator[None]:
    """Undo what a test's ``configure_logging`` did to the agent's logger (a handler on a stream pytest closes
    after that test, ``propagate`` off so that caplog sees nothing), so that no later test depends on the order."""
    logger = logging.getLogger("meridian_node_agent")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


# How pytest-xdist groups the tests and how many workers `-n auto` starts: see tests/support/parallel.py.
from ansible_collections.meridian.node.tests.support.parallel import (  # noqa: E402, F401
    pytest_xdist_auto_num_workers,
    pytest_xdist_make_scheduler,
)

# The stand-in engine base image (built once per machine, cached): see tests/support/standin_image.py.
from ansible_collections.meridian.node.tests.support.standin_image import standin_base_image  # noqa: E402, F401

# The systemd test host, booted with meridian-node installed: see tests/support/systemd_host.py.
from ansible_collections.meridian.node.tests.support.systemd_host import installed_host  # noqa: E402, F401

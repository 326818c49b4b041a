"""The devserver a test module talks to, and a node id per test: fixtures the devserver, agent and end-to-end
tests share (their conftest.py files register them).

``server`` is one real ``meridian-node-devserver serve`` process per test module
(tests/devserver/devserver_process.py), its data dir in a temporary directory of its own. A module that
needs it started otherwise (tokens made at start, a certificate lifetime) says so in one module-level line::

    DEVSERVER_OPTIONS = DevServerOptions(extra=["--certificate-seconds", "3600"])

``node_id`` names a node that no other test uses: after the module (``test_agent_cycle`` gives
``agent-cycle-node-3-1f0c``), numbered, with a random part, so that two test sessions sharing one Docker
Engine never label engines with the same owner.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, running

__all__ = ["DevServerOptions", "node_id", "server"]

_numbers = itertools.count(1)


@dataclass(frozen=True)
class DevServerOptions:
    """What ``running`` starts the module's devserver with: ``tokens`` (``--token`` specs) and ``extra`` (more
    ``serve`` arguments)."""

    tokens: Sequence[str] = ()
    extra: Sequence[str] = ()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[DevServer]:
    """The module's devserver, answering over TLS on 127.0.0.1; stopped when the module's tests are done. Started
    with the module's ``DEVSERVER_OPTIONS`` where it has them, else plainly: no tokens, the default certificate
    lifetime."""
    options: DevServerOptions = getattr(request.module, "DEVSERVER_OPTIONS", DevServerOptions())
    data_dir = tmp_path_factory.mktemp("devserver") / "data"
    with running(data_dir, tokens=options.tokens, extra=options.extra) as started:
        yield started


@pytest.fixture
def node_id(request: pytest.FixtureRequest) -> str:
    """A node id no other test uses, named after the test's module."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    return f"{module}-node-{next(_numbers)}-{secrets.token_hex(2)}"

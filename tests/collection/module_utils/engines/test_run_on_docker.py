"""run_on_docker: how every engine module's outcome reaches the Docker Engine and reports a failure, once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils._errors import ResultError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines import args as engine_args
from ansible_collections.meridian.node.plugins.module_utils.engines.cordon import CordonError
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError


class OpenedEngine:
    """Stands in for DockerEngine.from_env's answer: records that it was closed."""

    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> OpenedEngine:
    engine = OpenedEngine()
    monkeypatch.setattr(DockerEngine, "from_env", classmethod(lambda cls: engine))
    return engine


def test_an_unreachable_docker_engine_fails_the_run_with_check_docker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-docker.sock'}")
    result = engine_args.run_on_docker(lambda engine: pytest.fail("acted without a Docker Engine"))
    assert result["failed"] is True and result["check"] == "docker"
    assert "Error connecting to the Docker Engine" in result["msg"]


def test_the_result_is_acts_and_the_engine_is_closed(opened: OpenedEngine) -> None:
    seen: list[object] = []

    def act(engine: DockerEngine) -> dict[str, Any]:
        seen.append(engine)
        return {"changed": True}

    assert engine_args.run_on_docker(act) == {"changed": True}
    assert seen == [opened]
    assert opened.closed


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            CordonError("cordon refused", {"drained": ["a"]}),
            {"drained": ["a"], "failed": True, "msg": "cordon refused"},
        ),
        (
            EngineInstanceError("no room", check="placement", result={"changed": False}),
            {"changed": False, "failed": True, "msg": "no room", "check": "placement"},
        ),
    ],
)
def test_a_failure_part_way_returns_what_was_done_and_closes_the_engine(
    opened: OpenedEngine, error: ResultError, expected: dict[str, Any]
) -> None:
    def act(engine: Any) -> dict[str, Any]:
        raise error

    assert engine_args.run_on_docker(act) == expected
    assert opened.closed

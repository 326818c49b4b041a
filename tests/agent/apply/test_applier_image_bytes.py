"""The engine image bytes an apply pulled, as its result says them (the agent's
meridian_node_image_fetched_bytes_total): read from the engine modules' ``image_pull`` in ansible-runner's events,
each image once however many engines use it, and carried across the privilege split in root's answer.

The whole path on a real registry, Docker and agent is tests/system/e2e/test_e2e_image_pull.py; here the events
are the shape ansible-runner hands the applier's handler (``event``, ``event_data.task_action``, ``res``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from meridian_node_agent.apply.applier import _Counter
from meridian_node_agent.boundary.spool import ApplyAnswer, ApplyResult

PIN_A = "127.0.0.1:5000/team/vllm@sha256:" + "a" * 64
PIN_B = "127.0.0.1:5000/team/tgi@sha256:" + "b" * 64


def _event(kind: str, action: str, res: dict[str, Any]) -> dict[str, Any]:
    return {"event": kind, "event_data": {"task_action": action, "task": "engines", "res": res}}


def _pulled(image: str, size: int) -> dict[str, Any]:
    return {"image": image, "pulled": True, "bytes": size, "seconds": 0.5}


def test_an_engine_set_counts_each_pulled_image_once_and_no_forecast() -> None:
    counter = _Counter()
    engines = {
        "a-1": {"image_pull": _pulled(PIN_A, 1000)},
        "a-2": {"image_pull": _pulled(PIN_A, 1000)},  # the same pull, reported for both engines
        "b": {"image_pull": _pulled(PIN_B, 300)},
        "c": {"image_pull": {"image": PIN_B, "pulled": False, "would_pull": True}},
        "d": {},
    }
    counter(_event("runner_on_ok", "meridian.node.engine_set", {"changed": True, "engines": engines}))
    assert counter.image_bytes == 1300


def test_engine_instance_and_a_failed_run_count_what_was_pulled() -> None:
    counter = _Counter()
    counter(_event("runner_on_ok", "meridian.node.engine_instance", {"image_pull": _pulled(PIN_A, 55)}))
    stalled = {"image": PIN_B, "pulled": False, "bytes": 70}  # a stalled pull reports bytes but no image came
    failed = {"failed": True, "engines": {"a": {"image_pull": _pulled(PIN_A, 20)}, "b": {"image_pull": stalled}}}
    counter(_event("runner_on_failed", "meridian.node.engine_set", failed))
    counter(_event("runner_on_ok", "ansible.builtin.debug", {"image_pull": _pulled(PIN_A, 10_000)}))
    assert counter.image_bytes == 75  # 55 + 20: the stalled 70 brought no image


def test_the_answer_carries_image_bytes_and_an_older_answer_without_them_reads() -> None:
    at = datetime.now(UTC)
    result = ApplyResult("gen-1-20261205T070000.000000Z", 1, "successful", 0, 1, 0, Path("/j"), at, at, 1.0)
    result.image_bytes = 123
    answer = ApplyAnswer.from_result(result, "0" * 64, 1)
    assert answer.to_result().image_bytes == 123
    older = answer.model_dump()
    del older["image_bytes"]
    assert ApplyAnswer.model_validate(older).to_result().image_bytes == 0

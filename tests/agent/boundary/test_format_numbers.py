"""The files both sides exchange, and the agent's own record, name their format with the integer 1: written
``1.0`` or ``true`` it is refused (pydantic matches a ``Literal`` by equality, so both passed before), as the
published contracts refuse them (docs/PROTOCOL.md, "Numbers")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.support.recorded_events import SeenEvents
from meridian_node_agent.agent_side.supervision_record import SupervisionRecord
from meridian_node_agent.boundary.outcomes import OutcomesError, parse_outcomes
from meridian_node_agent.boundary.spool import ApplyAnswer, ApplyRequest

RUN = "gen-7-20261205T071500.000000Z"
NOT_ONE = ["1.0", "1e0", "true"]


def _with_format(document: dict[str, object], key: str, literal: str) -> bytes:
    text = json.dumps({**document, key: "@"}, separators=(",", ":"))
    return text.replace('"@"', literal).encode()


@pytest.mark.parametrize("literal", NOT_ONE)
def test_a_spooled_request_and_answer_name_format_1_only_as_an_integer(literal: str) -> None:
    request = {"format": 1, "request": RUN, "envelope": "e30=", "gpu_reports": []}
    answer = {
        "format": 1,
        "request": RUN,
        "payload_sha256": "",
        "generation": 7,
        "epoch": 1,
        "status": "successful",
        "rc": 0,
        "changed": 0,
        "failed": 0,
        "failures": [],
        "journal": "/var/lib/meridian-node-apply/runs/" + RUN,
        "started_at": "2026-12-05T07:15:00+00:00",
        "finished_at": "2026-12-05T07:15:01+00:00",
        "wall_seconds": 1.0,
    }
    assert ApplyRequest.model_validate_json(_with_format(request, "format", "1")).format == 1
    assert ApplyAnswer.model_validate_json(_with_format(answer, "format", "1")).format == 1

    for model, document in ((ApplyRequest, request), (ApplyAnswer, answer)):
        with pytest.raises(ValueError, match="must be an integer written without a fraction or exponent"):
            model.model_validate_json(_with_format(document, "format", literal))


@pytest.mark.parametrize("literal", NOT_ONE)
def test_roots_outcomes_file_names_format_1_only_as_an_integer(tmp_path: Path, literal: str) -> None:
    document = {
        "format": 1,
        "node_id": "gpu-node-01",
        "written_at": "2026-12-05T07:15:00Z",
        "applied": {"generation": 0, "epoch": 0},
        "outcomes": [],
    }
    path = tmp_path / "airgap-outcomes.json"
    assert parse_outcomes(_with_format(document, "format", "1"), path=path, node_id="gpu-node-01").format == 1

    with pytest.raises(OutcomesError, match="must be an integer written without a fraction or exponent"):
        parse_outcomes(_with_format(document, "format", literal), path=path, node_id="gpu-node-01")


@pytest.mark.parametrize("literal", ["1.0", "1e0"])
def test_a_supervision_record_of_version_1_point_0_is_ignored_as_malformed(tmp_path: Path, literal: str) -> None:
    boot = "0f4b5a0e-8c1d-4f7e-9a51-3c2d1e0f9b8a"
    SupervisionRecord(tmp_path, boot_id=lambda: boot).save(None, None)
    path = next(tmp_path.iterdir())
    document = json.loads(path.read_text())
    assert document["version"] == 1
    path.write_bytes(_with_format(document, "version", literal))

    events = SeenEvents()
    assert SupervisionRecord(tmp_path, boot_id=lambda: boot, log=events).load(0.0) is None
    [(event, fields)] = [seen for seen in events.seen if seen[0] != "supervision-record-rebased"]
    assert fields["reason"] == "malformed", (event, fields)

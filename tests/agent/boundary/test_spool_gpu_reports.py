"""The GPUs the agent relays in its apply request (``boundary.spool.GpuReport``): strict, bounded, optional.

Root parses this file from a directory a compromised agent owns, so every field is checked as the rest of the
request is: unknown fields refused, no coercion, a bound on everything that could grow.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from meridian_node_agent.agent_side.systemd_applier import write_request
from meridian_node_agent.boundary.spool import (
    MAX_GPU_REPORTS,
    MAX_REPORTED_XIDS,
    REQUEST_FILE,
    GpuReport,
    SpoolError,
    parse_request,
)

IDENT = "gen-3-20261205T080000.000000Z"
UUID = "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01"
SEEN = "2026-12-05T08:00:30Z"


def request(**fields: Any) -> bytes:
    document = {"format": 1, "request": IDENT, "envelope": base64.b64encode(b"{}").decode("ascii"), **fields}
    return json.dumps(document).encode("utf-8")


def report(**changes: Any) -> dict[str, Any]:
    return {"uuid": UUID, "xids": [79], "seen_at": SEEN, **changes}


def parse(raw: bytes) -> Any:
    return parse_request(raw, Path("/agent/spool") / REQUEST_FILE)


def test_a_request_written_by_the_agent_carries_its_reports_to_root(tmp_path: Path) -> None:
    sent = [GpuReport(uuid=UUID, xids=[74, 79], seen_at=datetime(2026, 12, 5, 8, 0, 30, tzinfo=UTC))]

    path = write_request(tmp_path, IDENT, b"envelope bytes", sent)
    read = parse(path.read_bytes())

    assert read.gpu_reports == sent
    assert json.loads(path.read_bytes())["gpu_reports"] == [{"uuid": UUID, "xids": [74, 79], "seen_at": SEEN}]


def test_a_request_from_before_the_relay_still_parses_with_no_reports() -> None:
    assert parse(request()).gpu_reports == []


def test_as_many_reports_as_allowed_parse_and_one_more_is_refused() -> None:
    most = [report(uuid=f"GPU-a1b2c3{n:02x}-51d0-4e7a-9c3f-6b0e2d4f1a01") for n in range(MAX_GPU_REPORTS)]
    assert len(parse(request(gpu_reports=most)).gpu_reports) == MAX_GPU_REPORTS

    with pytest.raises(SpoolError, match="gpu_reports"):
        parse(request(gpu_reports=[*most, report()]))


@pytest.mark.parametrize(
    "uuid",
    [
        "MIG-4c7a1e92-0b3d-5f6e-8a21-9d0c3b7e5f41",  # a MIG device: holds are per GPU
        "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01::1",  # a time-slicing replica id is not a GPU
        "GPU-../../etc/passwd",
        "gpu-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01",
        "GPU-a1b2c301-51d0-4e7a-9c3f-6b0e2d4f1a01\n",
        "",
    ],
)
def test_a_uuid_that_is_not_a_whole_gpus_is_refused(uuid: str) -> None:
    with pytest.raises(SpoolError, match="uuid"):
        parse(request(gpu_reports=[report(uuid=uuid)]))


@pytest.mark.parametrize(
    "xids",
    [
        [],  # a report names at least one XID
        [-1],
        [2**31],
        ["79"],  # no coercion from a string
        [79.0],
        [True],
        list(range(MAX_REPORTED_XIDS + 1)),
    ],
)
def test_xids_out_of_bounds_or_of_another_type_are_refused(xids: list[Any]) -> None:
    with pytest.raises(SpoolError, match="xids"):
        parse(request(gpu_reports=[report(xids=xids)]))


def test_the_largest_xid_and_as_many_xids_as_allowed_parse() -> None:
    xids = [*range(MAX_REPORTED_XIDS - 1), 2**31 - 1]
    assert parse(request(gpu_reports=[report(xids=xids)])).gpu_reports[0].xids == xids


@pytest.mark.parametrize("seen_at", ["2026-12-05T09:00:30+01:00", "2026-12-05 08:00:30", 1733385630])
def test_seen_at_must_be_a_utc_timestamp(seen_at: Any) -> None:
    with pytest.raises(SpoolError, match="seen_at"):
        parse(request(gpu_reports=[report(seen_at=seen_at)]))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"gpu_reports": [report(verdict="unhealthy")]}, "verdict"),
        ({"gpu_reports": [report(clear=True)]}, "clear"),
        ({"gpu_releases": [UUID]}, "gpu_releases"),
        ({"gpu_reports": {UUID: [79]}}, "gpu_reports"),
    ],
)
def test_unknown_fields_and_other_shapes_are_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(SpoolError, match=named):
        parse(request(**fields))

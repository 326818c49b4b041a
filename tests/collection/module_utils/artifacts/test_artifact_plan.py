"""The planner alone, as tables: a hand-made ``StoreState`` in, an ``ArtifactPlan`` out, no disk.

Here: partial downloads count against the budget, stale ones are dropped, resumed ones never are.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts.layout import ArtifactStoreError
from ansible_collections.meridian.node.plugins.module_utils.artifacts.plan import (
    PARTIAL_MAX_AGE,
    BlobRecord,
    PartialFile,
    StoreState,
    VersionRecord,
    plan_artifact,
    plan_removal,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import ArtifactManifest
from ansible_collections.meridian.node.tests.support.trust_fixtures import artifact_manifest

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
A, B, C = "a" * 64, "b" * 64, "c" * 64  # blobs of m/1, m/2 and the incoming m/3
YOUNG, OLD = "d" * 64, "e" * 64  # partial downloads of some other artifact


def version(number: str, sha: str, *, hours_ago: int) -> VersionRecord:
    return VersionRecord(
        name="m",
        version=number,
        manifest_sha256="0" * 64,
        files=(("w.bin", sha, 100),),
        size=100,
        pinned=False,
        last_used=NOW - timedelta(hours=hours_ago),
        verified_at=NOW - timedelta(hours=hours_ago),
    )


def state(partials: dict[str, PartialFile], observed_at: datetime | None = NOW) -> StoreState:
    """m/1 (100 bytes, unpinned, not current) and m/2 (100 bytes, current), plus ``partials``."""
    blobs = {A: BlobRecord(100, 1, 1), B: BlobRecord(100, 2, 2)}
    return StoreState(
        root="/store",
        versions={("m", "1"): version("1", A, hours_ago=2), ("m", "2"): version("2", B, hours_ago=1)},
        blobs=blobs,
        present=blobs,
        current={"m": "2"},
        partial=partials,
        observed_at=observed_at,
    )


def incoming() -> ArtifactManifest:
    files = [{"path": "w.bin", "size": 100, "sha256": C}]
    return ArtifactManifest.model_validate(artifact_manifest(name="m", version="3", files=files))


def partial(size: int, age: timedelta) -> PartialFile:
    return PartialFile(size, NOW - age)


@pytest.mark.parametrize(
    ("case", "partials", "observed_at", "dropped"),
    [
        ("foreign, untouched for 8 days", {OLD: partial(10, timedelta(days=8))}, NOW, [OLD]),
        ("foreign, untouched for 6 days", {YOUNG: partial(10, timedelta(days=6))}, NOW, []),
        ("foreign, exactly the max age", {YOUNG: partial(10, PARTIAL_MAX_AGE)}, NOW, []),
        ("foreign, from the future (clock skew)", {YOUNG: partial(10, -timedelta(days=30))}, NOW, []),
        ("resumed by this plan, 30 days old", {C: partial(40, timedelta(days=30))}, NOW, []),
        ("no clock reading: no age can be judged", {OLD: partial(10, timedelta(days=80))}, None, []),
        (
            "old and young side by side",
            {OLD: partial(10, timedelta(days=9)), YOUNG: partial(10, timedelta(hours=1))},
            NOW,
            [OLD],
        ),
    ],
)
def test_abandoned_partial_downloads_are_dropped_and_resumed_ones_never(
    case: str, partials: dict[str, PartialFile], observed_at: datetime | None, dropped: list[str]
) -> None:
    result = plan_artifact(
        incoming(), state(partials, observed_at), manifest_sha256="0" * 64, source="https://mirror.example/m/3"
    )
    assert [(d.sha256, d.reason) for d in result.drop_partials] == [(sha, "stale") for sha in dropped], case
    assert [step.resume_from for step in result.fetch] == [partials[C].size if C in partials else 0], case


@pytest.mark.parametrize(
    ("case", "partials", "max_bytes", "evicted", "dropped", "after"),
    [
        ("everything fits exactly", {YOUNG: partial(60, timedelta(hours=1))}, 360, [], [], 360),
        # 300 bytes of versions fit 359; only the partial's 60 bytes make room necessary.
        ("a young partial's bytes count", {YOUNG: partial(60, timedelta(hours=1))}, 359, ["1"], [], 260),
        (
            "a young partial goes only after every evictable version",
            {YOUNG: partial(60, timedelta(hours=1))},
            250,
            ["1"],
            [(YOUNG, "budget")],
            200,
        ),
        (
            "a stale partial does not count and is dropped anyway",
            {OLD: partial(1000, timedelta(days=8)), YOUNG: partial(60, timedelta(hours=1))},
            360,
            [],
            [(OLD, "stale")],
            360,
        ),
        # The partial of the incoming file is part of that file's 100 bytes, not counted twice.
        ("the resumed partial is the incoming blob", {C: partial(40, timedelta(days=30))}, 300, [], [], 300),
        (
            "oldest young partial goes first",
            {YOUNG: partial(60, timedelta(hours=1)), "f" * 64: partial(60, timedelta(hours=2))},
            260,
            ["1"],
            [("f" * 64, "budget")],
            260,
        ),
    ],
)
def test_partial_bytes_count_against_the_budget(
    case: str,
    partials: dict[str, PartialFile],
    max_bytes: int,
    evicted: list[str],
    dropped: list[tuple[str, str]],
    after: int,
) -> None:
    result = plan_artifact(
        incoming(), state(partials), manifest_sha256="0" * 64, source="https://mirror.example/m/3", max_bytes=max_bytes
    )
    assert [e.version for e in result.evict] == evicted, case
    assert [(d.sha256, d.reason) for d in result.drop_partials] == dropped, case
    assert result.store_bytes_after == after, case
    assert result.store_bytes_before == 200 + sum(p.size for p in partials.values()), case


def test_budget_unmet_even_without_foreign_partials_fails_and_says_why() -> None:
    with pytest.raises(ArtifactStoreError, match="does not fit the store budget: max_bytes is 199"):
        plan_artifact(
            incoming(),
            state({YOUNG: partial(60, timedelta(hours=1))}),
            manifest_sha256="0" * 64,
            source="https://mirror.example/m/3",
            max_bytes=199,
        )


def test_check_mode_shows_a_stale_partial_in_summary_and_diff_and_counts_it_as_a_change() -> None:
    blobs = {C: BlobRecord(100, 3, 3)}
    installed = VersionRecord("m", "3", "0" * 64, (("w.bin", C, 100),), 100, False, NOW, NOW)
    settled = StoreState(
        root="/store",
        versions={("m", "3"): installed},
        blobs=blobs,
        present=blobs,
        current={"m": "3"},
        partial={OLD: partial(1234, timedelta(days=10))},
        intact=True,
        version_dir_exists=True,
        observed_at=NOW,
    )
    result = plan_artifact(incoming(), settled, manifest_sha256="0" * 64)
    assert result.fetch == () and not result.assemble and not result.promote
    assert result.changed  # only because of the partial
    assert result.summary()["drop_partials"] == [
        {"sha256": OLD, "size": 1234, "modified": "2026-02-19T12:00:00Z", "reason": "stale"}
    ]
    diff = result.diff()
    assert f"partial download {OLD[:12]}... (1234 bytes, modified 2026-02-19T12:00:00Z)" in diff["before"]
    assert f"removed partial download {OLD[:12]}... (stale)" in diff["after"]
    fresh = StoreState(**{**settled.__dict__, "partial": {YOUNG: partial(1234, timedelta(days=1))}})
    assert not plan_artifact(incoming(), fresh, manifest_sha256="0" * 64).changed


def test_removal_drops_stale_partials_and_keeps_young_ones_in_its_byte_count() -> None:
    partials = {OLD: partial(10, timedelta(days=8)), YOUNG: partial(60, timedelta(hours=1))}
    result = plan_removal("m", "1", state(partials))
    assert result.remove
    assert [(d.sha256, d.reason) for d in result.drop_partials] == [(OLD, "stale")]
    assert result.store_bytes_before == 270 and result.store_bytes_after == 160

"""``engines.image_prune.plan_image_prune`` as data: what an owner's prune removes, keeps and waits on (issue 26).

Each row is one image on the host and the record about it; the wall clock is a number handed in. The real
Docker Engine side (removal, the record on disk, ansible-playbook) is in
tests/collection/modules/test_engine_image_prune.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.image_prune import ListedImage, plan_image_prune
from ansible_collections.meridian.node.plugins.module_utils.engines.image_record import (
    BroughtImage,
    ImageRecordError,
    read_image_record,
    write_image_record,
)

OURS = "sha256:" + "a" * 64
LOADED = "sha256:" + "b" * 64
REPO = "127.0.0.1:5000/team/vllm"
PIN = f"{REPO}@sha256:" + "c" * 64
GRACE = 100.0
NOW = 10_000.0


class Row(NamedTuple):
    case: str
    image: ListedImage
    record: dict[str, BroughtImage]
    in_use: set[str]
    owner: str
    loaded_too: bool
    remove: bool
    waiting: float | None  # seconds left, when it waits
    kept: str  # a word of the reason, when kept
    unused_since: float | None  # what the record says afterwards (None also when the image is not in it)


def pulled(owner: str = "ops", since: float | None = None) -> dict[str, BroughtImage]:
    return {OURS: BroughtImage(OURS, PIN, owner=owner, brought="pulled", unused_since=since)}


PULLED = ListedImage(OURS, repo_tags=(), repo_digests=(PIN,))
LOAD = ListedImage(LOADED, repo_tags=(f"{REPO}:meridian-{'b' * 16}",), repo_digests=())

ROWS = [
    Row("our pull, first found unused: the grace starts", PULLED, pulled(), set(), "ops", False, False, GRACE, "", NOW),
    Row("our pull, inside the grace", PULLED, pulled(since=NOW - 40), set(), "ops", False, False, 60.0, "", NOW - 40),
    Row(
        "our pull, the grace over",
        PULLED, pulled(since=NOW - GRACE), set(), "ops", False, True, None, "", NOW - GRACE,
    ),
    Row(
        "our pull, used again: its time cleared",
        PULLED, pulled(since=NOW - 500), {OURS}, "ops", False, False, None, "in use", None,
    ),
    Row(
        "another owner's pull is not ours to prune",
        PULLED, pulled("agent:n1", NOW - 500), set(), "ops", False, False, None, "", NOW - 500,
    ),
    Row(
        "an operator tagged our pull too",
        ListedImage(OURS, repo_tags=("mine/vllm:keep",), repo_digests=(PIN,)),
        pulled(since=NOW - 500), set(), "ops", False, False, None, "mine/vllm:keep", None,
    ),
    Row(
        "an operator pulled it from another repository too",
        ListedImage(OURS, repo_tags=(), repo_digests=(PIN, "docker.io/other/vllm@sha256:" + "c" * 64)),
        pulled(since=NOW - 500), set(), "ops", False, False, None, "docker.io/other/vllm", None,
    ),
    Row("a loaded image, the agent's state: grace starts", LOAD, {}, set(), "agent:n1", True, False, GRACE, "", NOW),
    Row("a loaded image, not a signed state's run: never", LOAD, {}, set(), "ops", False, False, None, "", None),
    Row(
        "a tag that looks like a load but does not match the id: never",
        ListedImage(LOADED, repo_tags=(f"{REPO}:meridian-{'d' * 16}",), repo_digests=()),
        {}, set(), "agent:n1", True, False, None, "", None,
    ),
    Row("a loaded image in use: nothing recorded", LOAD, {}, {LOADED}, "agent:n1", True, False, None, "in use", None),
    Row(
        "an image with no record and no load tag (an operator's)",
        ListedImage(OURS, repo_tags=(f"{REPO}:v1",), repo_digests=(PIN,)),
        {}, set(), "ops", True, False, None, "", None,
    ),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=[row.case for row in ROWS])
def test_plan_image_prune(row: Row) -> None:
    plan = plan_image_prune(
        row.record, [row.image], row.in_use, owner=row.owner, loaded_too=row.loaded_too, now=NOW, grace_s=GRACE
    )
    image_id = row.image.id
    assert (image_id in plan.remove) is row.remove
    assert plan.waiting.get(image_id) == row.waiting
    if row.kept:
        assert row.kept in plan.kept[image_id]
    else:
        assert image_id not in plan.kept
    entry = plan.record.get(image_id)
    assert (entry.unused_since if entry else None) == row.unused_since


def test_grace_zero_removes_at_the_first_prune_that_finds_it_unused() -> None:
    plan = plan_image_prune(pulled(), [PULLED], set(), owner="ops", loaded_too=False, now=NOW, grace_s=0)
    assert plan.remove == [OURS]


def test_an_image_gone_from_docker_is_forgotten() -> None:
    plan = plan_image_prune(pulled(since=NOW), [], set(), owner="ops", loaded_too=False, now=NOW, grace_s=GRACE)
    assert plan.record == {} and plan.record_changed and plan.remove == []


def test_a_second_pass_inside_the_grace_changes_nothing() -> None:
    first = plan_image_prune(pulled(), [PULLED], set(), owner="ops", loaded_too=False, now=NOW, grace_s=GRACE)
    again = plan_image_prune(first.record, [PULLED], set(), owner="ops", loaded_too=False, now=NOW + 1, grace_s=GRACE)
    assert first.record_changed and not again.record_changed
    assert again.waiting == {OURS: GRACE - 1}


def test_the_record_round_trips_and_is_root_only(tmp_path: Path) -> None:
    record = pulled(since=NOW)
    write_image_record(str(tmp_path), record)
    assert read_image_record(str(tmp_path)) == record
    assert (tmp_path / "images.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "content",
    [b"not json", b'{"version": 2, "images": {}}', b'{"version": 1, "images": {"abc": {}}}', b'{"version": 1}'],
    ids=["not-json", "another-version", "not-an-image-id", "no-images"],
)
def test_a_damaged_record_is_an_error_naming_the_file_never_a_reset(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "images.json").write_bytes(content)
    with pytest.raises(ImageRecordError, match=r"images\.json") as caught:
        read_image_record(str(tmp_path))
    assert "nothing was pruned" in str(caught.value)
    assert (tmp_path / "images.json").read_bytes() == content


def test_a_symlinked_record_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    write_image_record(str(tmp_path), pulled())
    (tmp_path / "images.json").rename(target)
    (tmp_path / "images.json").symlink_to(target)
    with pytest.raises(ImageRecordError, match=r"images\.json"):
        read_image_record(str(tmp_path))


def test_a_loaded_image_in_a_repository_the_policy_does_not_allow_is_never_a_candidate() -> None:
    plan = plan_image_prune(
        {}, [LOAD], set(), owner="agent:n1", loaded_too=True, now=NOW, grace_s=0, allowed=lambda repo: repo != REPO
    )
    assert plan.remove == [] and plan.record == {}
    allowed = plan_image_prune({}, [LOAD], set(), owner="agent:n1", loaded_too=True, now=NOW, grace_s=0)
    assert allowed.remove == [LOADED]

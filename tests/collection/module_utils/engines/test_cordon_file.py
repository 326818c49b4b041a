"""The host's cordon file: read back as written, every malformed form refused by name, merged with the state's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.cordon_file import (
    CORDON_FILE,
    CordonStateError,
    HostCordon,
    cordoned_gpu_keys,
    cordons_in_force,
    mark_cordoned,
    merge_cordons,
    read_cordon,
    remove_cordon,
    write_cordon,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import CordonPolicy

FACTS: dict[str, Any] = {
    "nvml_available": True,
    "gpus": [
        {"index": 0, "uuid": "GPU-aaaa", "mig_instances": []},
        {"index": 1, "uuid": "GPU-bbbb", "mig_instances": [{"uuid": "MIG-b1"}, {"uuid": "MIG-b2"}]},
    ],
}


def test_written_cordon_reads_back_with_since_filled_and_is_world_readable(tmp_path: Path) -> None:
    written = write_cordon(str(tmp_path), HostCordon(gpus=("1",), drain=True, reason="xid 79", held=("llm",)))

    assert written.since is not None
    assert read_cordon(str(tmp_path)) == written
    assert os.stat(tmp_path / CORDON_FILE).st_mode & 0o777 == 0o644


def test_no_file_is_no_cordon_and_removing_twice_says_so(tmp_path: Path) -> None:
    assert read_cordon(str(tmp_path)) is None
    write_cordon(str(tmp_path), HostCordon())
    assert remove_cordon(str(tmp_path)) is True
    assert remove_cordon(str(tmp_path)) is False
    assert read_cordon(str(tmp_path)) is None


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"{not json", "is not JSON"),
        (b"[]", "must be an object"),
        (json.dumps({"gpus": [], "drain": False, "reason": None, "since": None}).encode(), "must be an object"),
        (
            json.dumps({"gpus": [], "drain": "yes", "reason": None, "since": None, "held": []}).encode(),
            "drain (bool)",
        ),
        (json.dumps({"gpus": [""], "drain": False, "reason": None, "since": None, "held": []}).encode(), "gpus"),
        (
            json.dumps({"gpus": [], "drain": False, "reason": None, "since": None, "held": [], "x": 1}).encode(),
            "exactly",
        ),
    ],
)
def test_malformed_file_is_refused_naming_the_file_and_the_way_out(tmp_path: Path, content: bytes, words: str) -> None:
    (tmp_path / CORDON_FILE).write_bytes(content)

    with pytest.raises(CordonStateError) as caught:
        read_cordon(str(tmp_path))
    assert str(tmp_path / CORDON_FILE) in str(caught.value)
    assert words in str(caught.value)
    assert "state=absent" in str(caught.value)


def test_a_symlink_in_place_of_the_file_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"gpus": [], "drain": True, "reason": None, "since": None, "held": []}))
    (tmp_path / CORDON_FILE).symlink_to(elsewhere)

    with pytest.raises(CordonStateError, match=r"link"):
        read_cordon(str(tmp_path))


def test_gpu_keys_join_index_uuid_and_mig_instances() -> None:
    assert cordoned_gpu_keys(["1"], FACTS) == {"1", "GPU-bbbb", "MIG-b1", "MIG-b2"}
    assert cordoned_gpu_keys(["GPU-aaaa"], FACTS) == {"GPU-aaaa", "0"}
    # A GPU the facts no longer list stays cordoned by the id given.
    assert cordoned_gpu_keys(["GPU-gone"], FACTS) == {"GPU-gone"}


def test_covers_by_any_name_and_node_cordon_covers_everything() -> None:
    by_index = HostCordon(gpus=("1",))
    assert by_index.covers(["MIG-b2"], FACTS)
    assert by_index.covers(["GPU-bbbb"], FACTS)
    assert not by_index.covers(["0"], FACTS)
    assert HostCordon().covers([], FACTS)


def test_mark_cordoned_marks_only_the_cordoned_gpus() -> None:
    marked = mark_cordoned(FACTS, HostCordon(gpus=("GPU-bbbb",)))
    assert [gpu["cordoned"] for gpu in marked["gpus"]] == [False, True]
    assert [gpu["cordoned"] for gpu in mark_cordoned(FACTS, HostCordon())["gpus"]] == [True, True]
    assert "cordoned" not in mark_cordoned(FACTS, None)["gpus"][0]


def test_merge_is_the_union_and_a_node_cordon_wins(tmp_path: Path) -> None:
    write_cordon(str(tmp_path), HostCordon(gpus=("0",), reason="fan", held=("a",), since="2026-12-05T00:00:00Z"))
    policy = CordonPolicy(gpus=("GPU-bbbb",), drain=False, reason="spare")

    found = cordons_in_force(str(tmp_path), policy, {"gpus": ["1"], "drain": True, "reason": "xid"})
    assert [cordon.by for cordon in found] == ["policy", "policy", "desired-state"]
    merged = merge_cordons(found)
    assert merged is not None
    assert (merged.gpus, merged.drain, merged.held) == (("0", "1", "GPU-bbbb"), True, ("a",))
    assert merged.reason == "fan; spare; xid"
    assert merged.since == "2026-12-05T00:00:00Z"
    node = merge_cordons([*found, HostCordon(by="desired-state")])
    assert node is not None and node.node
    only_state = merge_cordons(cordons_in_force(str(tmp_path / "none"), None, {"gpus": ["1"]}))
    assert only_state is not None and only_state.by == "desired-state" and not only_state.drain
    assert merge_cordons([]) is None

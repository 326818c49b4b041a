"""Pruning order: which dropped engines must leave before converging (they hold a port or GPU a desired engine
needs), as a table. engine_set orders its pruning with it; tests/system/e2e/test_e2e_prune_order.py checks the order
a real reconcile run keeps."""

from __future__ import annotations

from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.engines.prune import gpus_may_overlap, prune_order

GPU_A = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
GPU_B = "GPU-11111111-2222-3333-4444-555555555555"
MIG_1 = "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
MIG_2 = "MIG-00000000-d268-c3f3-1b07-005d5ae1dc3f"


def running(name: str, port: int | None, gpus: tuple[str, ...] = (), vram: int = 0) -> dict[str, Any]:
    """An engine_info entry (only the fields the order reads, plus some it must ignore)."""
    return {
        "name": name,
        "managed": True,
        "state": "running" if port is not None else "created",
        "port": port,
        "gpus": list(gpus),
        "min_vram_mib": vram,
    }


def desired(name: str, port: int, gpus: tuple[str, ...] = (), vram: int = 0, state: str = "started") -> dict[str, Any]:
    """A desired_state engine (the fields the order reads)."""
    return {"name": name, "port": port, "gpus": list(gpus), "min_vram_mib": vram, "state": state, "driver": "vllm"}


@pytest.mark.parametrize(
    ("owned", "wanted", "first", "later"),
    [
        pytest.param([running("a", 9001)], [desired("b", 9001)], ["a"], [], id="same-port-would-be-refused-as-taken"),
        pytest.param(
            [running("a", 9001, (GPU_A,), 40000)],
            [desired("b", 9002, (GPU_A,), 40000)],
            ["a"],
            [],
            id="shared-gpu-by-uuid-would-be-refused-as-vram-short",
        ),
        pytest.param(
            [running("a", 9001, ("0",), 40000)],
            [desired("b", 9002, ("0",), 40000)],
            ["a"],
            [],
            id="shared-gpu-by-index",
        ),
        pytest.param(
            [running("a", 9001, ("0",), 40000)],
            [desired("b", 9002, (GPU_B,), 40000)],
            ["a"],
            [],
            id="index-against-uuid-cannot-be-told-apart-so-prunes-first",
        ),
        pytest.param(
            [running("a", 9001, (GPU_A,), 40000)],
            [desired("b", 9002, (MIG_1,), 10000)],
            ["a"],
            [],
            id="mig-against-gpu-uuid-cannot-be-told-apart-so-prunes-first",
        ),
        pytest.param(
            [running("a", 9001, (GPU_A,), 40000)],
            [desired("b", 9002, (GPU_B,), 40000)],
            [],
            ["a"],
            id="different-gpu-uuids-do-not-conflict",
        ),
        pytest.param(
            [running("a", 9001, ("0",), 40000)],
            [desired("b", 9002, ("1",), 40000)],
            [],
            ["a"],
            id="different-gpu-indexes-do-not-conflict",
        ),
        pytest.param(
            [running("m", 9003, (MIG_1,), 10000)],
            [desired("n", 9004, (MIG_2,), 10000)],
            [],
            ["m"],
            id="different-mig-instances-do-not-conflict",
        ),
        pytest.param(
            [running("a", 9001), running("c", 9005, ("1",), 100)],
            [desired("b", 9002, ("0",), 100)],
            [],
            ["a", "c"],
            id="no-conflict-keeps-serving-until-after-converging",
        ),
        pytest.param(
            # 'a' moves to another port under the same name and 'b' takes its old one: 'a' is listed, so it is no
            # dropped engine at all; the converge replaces it in place.
            [running("a", 9001)],
            [desired("a", 9002), desired("b", 9001)],
            [],
            [],
            id="renamed-engine-whose-old-name-is-still-listed-is-not-pruned",
        ),
        pytest.param(
            # 'b' already runs on GPU 0 beside 'a': converging it asks placement for nothing 'a' holds.
            [running("a", 9001, ("0",), 20000), running("b", 9002, ("0",), 20000)],
            [desired("b", 9002, ("0",), 20000)],
            [],
            ["a"],
            id="conflicting-desired-engine-already-running-under-its-name",
        ),
        pytest.param(
            # The same 'b' asking for more VRAM is placed again, and 'a' holds what it needs.
            [running("a", 9001, ("0",), 20000), running("b", 9002, ("0",), 20000)],
            [desired("b", 9002, ("0",), 40000)],
            ["a"],
            [],
            id="desired-engine-growing-its-vram-is-placed-again",
        ),
        pytest.param(
            # Stopped: no published port (Docker lists none), but its VRAM reservation still counts for placement.
            [running("a", None, (GPU_A,), 40000), running("c", None)],
            [desired("b", 9001, (GPU_A,), 40000)],
            ["a"],
            ["c"],
            id="stopped-dropped-engine-still-reserves-its-gpu",
        ),
        pytest.param(
            [running("a", 9001)], [desired("b", 9001, state="absent")], [], ["a"], id="absent-engine-needs-no-room"
        ),
        pytest.param(
            [running("z", 9001), running("y", 9002), running("x", 9009)],
            [desired("b", 9002), desired("c", 9001)],
            ["y", "z"],
            ["x"],
            id="both-lists-sorted-by-name",
        ),
        pytest.param([], [desired("b", 9001)], [], [], id="nothing-owned"),
        pytest.param([running("a", 9001)], [], [], ["a"], id="empty-state-prunes-everything-after"),
        pytest.param([], [], [], [], id="empty-inputs"),
    ],
)
def test_dropped_engine_holding_what_a_desired_engine_needs_is_pruned_first(
    owned: list[dict[str, Any]], wanted: list[dict[str, Any]], first: list[str], later: list[str]
) -> None:
    order = prune_order(owned, wanted)

    assert (order.first, order.later) == (first, later)


@pytest.mark.parametrize(
    ("left", "right", "overlap"),
    [
        (["0"], ["0"], True),
        (["0"], ["1"], False),
        ([GPU_A], [GPU_A], True),
        ([GPU_A], [GPU_B], False),
        ([MIG_1], [MIG_2], False),
        (["1"], [GPU_A], True),
        ([MIG_1], ["0"], True),
        (["something-else"], ["0"], True),
        ([], ["0"], False),
        (["0", "1"], ["2", "1"], True),
    ],
)
def test_gpu_ids_of_different_kinds_count_as_the_same_device(left: list[str], right: list[str], overlap: bool) -> None:
    assert gpus_may_overlap(left, right) is overlap
    assert gpus_may_overlap(right, left) is overlap

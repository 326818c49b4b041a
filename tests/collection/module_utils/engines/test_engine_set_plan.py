"""engine_set's planning as data: the set's reservations, port hand-overs, waves, and refusals before any change.

The placement numbers go through engine_instance.placement_problem, the same rule a lone engine meets; what
is tested here is what the set feeds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from ansible_collections.meridian.node.plugins.module_utils.artifacts.held import held_problems
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.placement import placement_problem
from ansible_collections.meridian.node.plugins.module_utils.engines.set import EngineSetError, SetOptions, converge_set
from ansible_collections.meridian.node.plugins.module_utils.engines.set_plan import (
    Held,
    Member,
    Wave,
    duplicate_names,
    placement_inputs,
    port_clashes,
    port_handover,
    waves,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.set_run import MASK, run_engine_set
from ansible_collections.meridian.node.tests.support.engine_harness import standin_policy

DIGEST = "sha256:" + "ab" * 32
FACTS = {
    "nvml_available": True,
    "reason": None,
    "gpus": [
        {"index": 0, "uuid": "GPU-aaaa", "memory": {"total_mib": 81920, "free_mib": 80000}, "mig_mode": False},
        {"index": 1, "uuid": "GPU-bbbb", "memory": {"total_mib": 81920, "free_mib": 20000}, "mig_mode": False},
    ],
}


def new(name: str, port: int, gpus: tuple[str, ...] = (), vram: int = 0, current: Held | None = None) -> Member:
    """An engine the run creates (replacing ``current`` when given)."""
    return Member(name, "started", port, gpus, vram, creates=True, retires=current is not None, current=current)


def kept(name: str, port: int, gpus: tuple[str, ...] = (), vram: int = 0) -> Member:
    """An engine already as asked: the run leaves its container alone."""
    return Member(name, "started", port, gpus, vram, current=Held(name, port, gpus, vram))


def place(member: Member, members: list[Member], outside: list[Held] = [], first: list[Held] = []) -> Any:  # noqa: B006
    inputs = placement_inputs(member, members, outside=outside, pruned_first=first)
    return placement_problem(
        name=member.name,
        gpus=member.gpus,
        min_vram_mib=member.min_vram_mib,
        gpu_facts=FACTS,
        others=inputs.others,
        replaced=inputs.replaced,
        freed=inputs.freed,
        arriving=inputs.arriving,
    )


# --- the set's reservations -------------------------------------------------------------------------------


def test_two_new_engines_on_one_gpu_must_fit_together() -> None:
    a, b = new("a", 9001, ("0",), 50000), new("b", 9002, ("0",), 50000)

    problem = place(a, [a, b])

    assert problem is not None and problem[0] == "placement-vram"
    assert "only 30000 MiB" in problem[1]
    assert "-50000 MiB for the other engines created with it" in problem[1]


def test_two_new_engines_that_fit_together_pass() -> None:
    a, b = new("a", 9001, ("0",), 40000), new("b", 9002, ("0",), 40000)
    assert place(a, [a, b]) is None and place(b, [a, b]) is None


def test_a_kept_engine_on_the_gpu_counts_as_reserved_not_as_arriving() -> None:
    # NVML already counts the kept engine's memory as used; its reservation caps what is left.
    a, k = new("a", 9001, ("0",), 40000), kept("k", 9002, ("0",), 50000)

    problem = place(a, [a, k])

    assert problem is not None and "50000 MiB reserved" in problem[1]


def test_vram_of_a_dropped_engine_pruned_first_is_credited() -> None:
    dropped = Held("old", 9005, ("1",), 60000)
    a = new("a", 9001, ("1",), 70000)

    assert place(a, [a]) is not None, "without the credit GPU 1 has only 20000 MiB free"
    assert place(a, [a], first=[dropped]) is None


def test_a_dropped_engine_pruned_later_keeps_its_reservation() -> None:
    dropped = Held("old", 9005, ("0",), 60000)
    a = new("a", 9001, ("0",), 30000)

    problem = place(a, [a], outside=[dropped])

    assert problem is not None and "60000 MiB reserved" in problem[1]


def test_vram_of_another_engine_being_replaced_is_credited() -> None:
    other = new("b", 9002, ("2",), 0, current=Held("b", 9002, ("1",), 60000))  # moves off GPU 1
    a = new("a", 9001, ("1",), 70000)

    assert place(a, [a, other]) is None


def test_own_replaced_container_is_credited() -> None:
    a = new("a", 9001, ("1",), 70000, current=Held("a", 9001, ("1",), 70000))
    assert place(a, [a]) is None


# --- ports -------------------------------------------------------------------------------------------------


def test_port_clashes_name_every_engine_asking_for_the_port() -> None:
    members = [new("a", 9001), new("b", 9001), kept("c", 9001), new("d", 9002)]
    assert port_clashes(members) == [(9001, ["a", "b", "c"])]
    assert port_clashes([new("a", 9001), Member("gone", "absent", 9001)]) == []


def test_duplicate_names_are_found() -> None:
    assert duplicate_names(["a", "b", "a", "c", "b"]) == ["a", "b"]


# (case, holders of the port, the set's other members, pruned first, blocker name or None, waits for)
HANDOVER = [
    ("nobody", [], [], [], None, ()),
    ("its own old container", [Held("a", 9001)], [], [], None, ()),
    ("a dropped engine pruned first", [Held("old", 9001)], [], ["old"], None, ()),
    (
        "an engine of the set being replaced",
        [Held("b", 9001)],
        [new("b", 9002, current=Held("b", 9001))],
        [],
        None,
        ("b",),
    ),
    ("an engine of the set kept as it is", [Held("b", 9001)], [kept("b", 9001)], [], "b", ()),
    ("another owner's engine", [Held("x", 9001, owner="ops")], [], [], "x", ()),
    ("a stranger's container", [Held("x", 9001, owned=False)], [], [], "x", ()),
    ("a stranger with a pruned engine's name", [Held("old", 9001, owned=False)], [], ["old"], "old", ()),
]


@pytest.mark.parametrize(
    ("holders", "others", "first", "blocker", "waits"), [row[1:] for row in HANDOVER], ids=[row[0] for row in HANDOVER]
)
def test_port_handover(
    holders: list[Held], others: list[Member], first: list[str], blocker: str | None, waits: tuple[str, ...]
) -> None:
    member = new("a", 9001, current=Held("a", 9001))
    members = {m.name: m for m in [member, *others]}

    handover = port_handover(member, holders, members, first)

    assert (None if handover.blocker is None else handover.blocker.name) == blocker
    assert handover.waits_for == waits


# --- waves ---------------------------------------------------------------------------------------------------


def test_independent_engines_go_in_one_wave() -> None:
    members = [new(f"e{i}", 9000 + i, (str(i),), 1000) for i in range(8)]
    assert waves(members, [m.name for m in members]) == [Wave(tuple(f"e{i}" for i in range(8)))]


def test_an_engine_taking_a_replaced_engines_port_waits_for_it() -> None:
    b = new("b", 9003, current=Held("b", 9001))  # b moves from 9001 to 9003
    a = new("a", 9001)  # and a takes 9001
    c = new("c", 9002)

    assert waves([a, b, c], ["a", "b", "c"]) == [Wave(("b", "c")), Wave(("a",))]


def test_an_engine_taking_a_replaced_engines_gpu_waits_for_it() -> None:
    b = new("b", 9002, ("1",), 1000, current=Held("b", 9002, ("0",), 40000))
    a = new("a", 9001, ("0",), 40000)
    assert waves([a, b], ["a", "b"]) == [Wave(("b",)), Wave(("a",))]


def test_engines_swapping_ports_retire_together_then_build() -> None:
    a = new("a", 9002, current=Held("a", 9001))
    b = new("b", 9001, current=Held("b", 9002))
    c = new("c", 9003)

    assert waves([a, b, c], ["a", "b", "c"]) == [Wave(("c",)), Wave(("a", "b"), retire_first=True)]


def test_engines_without_actions_are_in_no_wave() -> None:
    assert waves([kept("k", 9001), new("a", 9002)], ["a"]) == [Wave(("a",))]


# --- refusals come before any change ----------------------------------------------------------------------


class _ListOnly:
    """A Docker Engine API that lists no containers and fails the test on any other call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def containers(self, filters: Any) -> list[dict[str, Any]]:
        self.calls.append("containers")
        return []

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the set asked Docker for {name!r} before every engine passed its checks")


def spec(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "driver": "vllm",
        "image": f"meridian-node/standin@{DIGEST}",
        "model": {"name": "tiny"},
        "port": port,
        **extra,
    }


@pytest.fixture
def options(tmp_path: Path) -> SetOptions:
    policy = standin_policy(
        tmp_path / "policy", ["vllm"], port_range=(9000, 9100), store={"path": str(tmp_path / "store")}
    )
    return SetOptions(policy_path=str(policy), state_dir=str(tmp_path / "state"))


def _refused(specs: list[dict[str, Any]], options: SetOptions) -> tuple[EngineSetError, _ListOnly]:
    """The refusal of converging ``specs`` (it must refuse), and what Docker was asked meanwhile."""
    api = _ListOnly()
    with pytest.raises(EngineSetError) as caught:
        converge_set(specs, options, check_mode=False, engine=DockerEngine(cast(DockerApi, api)))
    return caught.value, api


def test_every_refused_engine_is_named_and_docker_only_listed(options: SetOptions) -> None:
    refused, api = _refused([spec("fine", 9001), spec("far", 9500), spec("tgi", 9002, driver="tgi")], options)

    message = str(refused)
    assert message.startswith("nothing was changed")
    assert "engine 'far' (check policy-port)" in message
    assert "engine 'tgi' (check policy-driver)" in message
    assert "'fine'" not in message
    assert refused.result["check"] == "engines"
    assert set(refused.result["engines"]) == {"far", "tgi"}
    assert api.calls == ["containers"]


def test_two_engines_on_one_port_are_refused_before_any_change(options: SetOptions) -> None:
    refused, _api = _refused([spec("a", 9001), spec("b", 9001)], options)

    assert refused.result["check"] == "placement-port"
    assert "engines ['a', 'b'] all ask for port 9001" in str(refused)


def test_a_name_listed_twice_is_refused_before_docker_is_asked(options: SetOptions) -> None:
    refused, api = _refused([spec("a", 9001), spec("a", 9002)], options)
    assert refused.result["check"] == "spec"
    assert api.calls == []


def test_options_that_need_each_other(options: SetOptions) -> None:
    engine = DockerEngine(cast(DockerApi, _ListOnly()))
    base = {"engines": [spec("a", 9001)], "policy": options.policy_path, "state_dir": options.state_dir, "parallel": 8}
    with pytest.raises(EngineSetError, match="prune: true needs owner"):
        run_engine_set({**base, "prune": True}, check_mode=True, engine=engine, held_artifacts=held_problems)
    with pytest.raises(EngineSetError, match="record: true needs envelope"):
        run_engine_set({**base, "record": True}, check_mode=True, engine=engine, held_artifacts=held_problems)
    with pytest.raises(EngineSetError, match="parallel must be at least 1, got 0"):
        run_engine_set({**base, "parallel": 0}, check_mode=True, engine=engine, held_artifacts=held_problems)


def test_secret_env_values_are_masked_in_refusal_messages(options: SetOptions) -> None:
    engine = DockerEngine(cast(DockerApi, _ListOnly()))
    secret = "s3cret-value-9"
    params = {
        # An invalid name is repeated in the refusal: here it carries the secret.
        "engines": [spec(f"Bad-{secret}", 9001, secret_env={"TOKEN": secret})],
        "policy": options.policy_path,
        "state_dir": options.state_dir,
        "parallel": 8,
    }
    with pytest.raises(EngineSetError) as caught:
        run_engine_set(params, check_mode=True, engine=engine, held_artifacts=held_problems)
    assert secret not in str(caught.value) and secret not in repr(caught.value.result)
    assert MASK in str(caught.value)


def test_env_values_and_short_secrets_never_star_an_engine_name(options: SetOptions) -> None:
    # Issue 25: env {X: "tgi"} made "engine 'aud-tgi' refused" read "engine 'aud-********' refused". A plain
    # value is not a secret, and a secret too short to tell apart from other text is not hunted by content.
    engine = DockerEngine(cast(DockerApi, _ListOnly()))
    name = "Aud-tgi-1"
    params = {
        "engines": [spec(name, 9001, env={"MODE": "tgi", "FLAG": "1"}, secret_env={"KEY": "t"})],
        "policy": options.policy_path,
        "state_dir": options.state_dir,
        "parallel": 8,
    }
    with pytest.raises(EngineSetError) as caught:
        run_engine_set(params, check_mode=True, engine=engine, held_artifacts=held_problems)
    assert f"engine '{name}'" in str(caught.value)
    assert MASK not in str(caught.value) + repr(caught.value.result)

"""The suite's parallel layout (tests/support/parallel.py) names what exists, and groups by file unless told."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.meridian.node.tests.support.parallel import (
    GROUPS,
    SLOWEST_FIRST,
    group_of,
    workers_for_machine,
)

TESTS = Path(__file__).resolve().parent


def test_every_named_group_member_and_slow_group_exists() -> None:
    members = [member for group in GROUPS.values() for member in group]
    missing = [member for member in members if not (TESTS / member).exists()]
    assert not missing, f"GROUPS names what tests/ no longer holds: {missing}"
    unknown = [group for group in SLOWEST_FIRST if group not in GROUPS and not (TESTS / group).is_file()]
    assert not unknown, f"SLOWEST_FIRST names neither a group nor a test file: {unknown}"


def test_a_test_file_outside_every_named_group_is_its_own_group() -> None:
    assert group_of("agent/test_config.py") == "agent/test_config.py"
    for name, group in GROUPS.items():
        for member in group:
            inside = member if member.endswith(".py") else f"{member.rstrip('/')}/test_x.py"
            assert group_of(inside) == name


def test_auto_starts_one_worker_more_than_the_cpus() -> None:
    assert [workers_for_machine(cpus) for cpus in (1, 2, 16)] == [2, 3, 17]

"""How pytest-xdist spreads the suite over workers (``make pytest``: ``pytest -n auto --dist loadgroup``).

Under ``--dist loadgroup`` the scheduler is ``GroupScheduling``: every test belongs to a group, and a group runs
on one worker, its tests in file order, never beside each other:

* by default the group is the test's **file**: a module's fixtures (a devserver, a systemd host, an image tagged
  for the module) are made once, as in a serial run, and tests that share a node id, an owner or a module's
  host never meet;
* a **named group** (``GROUPS``) holds files that must not run beside each other, whatever worker they land on;
* a group in ``ALONE`` runs when every other group has finished, with nothing beside it: its tests act on
  every engine of ours on the shared Docker Engine (a node cordon stops and holds them all), so they would
  stop other tests' engines, and other tests' engines would show up in what they drain.

Groups are handed out slowest first (``SLOWEST_FIRST``), so that no long file starts last and runs alone.

The groups come from each test's path, read by the scheduler from the node id: pytest 9.2 no longer lets
xdist's own ``loadgroup`` append ``@group`` to node ids (pytest-dev/pytest-xdist#1386), so ``xdist_group``
marks alone would group nothing. A node id that does carry ``@group`` still joins that group.

What the workers share is made safe where it is made, not by grouping: images and caches under
``~/.cache/meridian-node`` are built under a file lock (``standin_image._locked``, ``systemd_host._building``);
containers, images and registry repositories carry the test's own random prefix; servers (the registry,
PostgreSQL, devservers, stand-in engines) listen on free ports with their data in temporary directories; each
worker has its own ``tmp_path`` root and its own session fixtures.

``-n auto`` starts ``workers_for_machine()`` workers. Serially: ``pytest -n 0`` (or ``-p no:xdist``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

__all__ = [
    "ALONE",
    "GROUPS",
    "SLOWEST_FIRST",
    "group_of",
    "pytest_xdist_auto_num_workers",
    "pytest_xdist_make_scheduler",
    "workers_for_machine",
]

# Named group -> the folders or files under tests/ whose tests it holds (one worker, one at a time).
GROUPS: dict[str, tuple[str, ...]] = {
    # A node cordon through meridian.node.cordon (the module, and playbooks/maintenance.yml) drains and holds every
    # engine of ours on this Docker Engine, whoever started it.
    "engine-wide": (
        "collection/modules/test_cordon_module.py",
        "collection/playbooks/test_maintenance_playbook.py",
    ),
}

# Groups that run last, alone (see the module's docstring).
ALONE: frozenset[str] = frozenset({"engine-wide"})

# Groups (a named group, or a file under tests/) handed out before all others, in this order: the slowest files of
# a whole parallel run (3 workers on two busy cores, 2026-12-07: each over 60 s there, the systemd hosts' module
# setups included). A stale entry costs only balance; tests/test_parallel.py checks that each names a group that
# exists.
SLOWEST_FIRST: tuple[str, ...] = (
    "collection/modules/test_engine_instance_module.py",
    "system/systemd_host/test_privilege_boundary.py",
    "system/systemd_host/test_hand_changes_under_split.py",
    "system/systemd_host/test_airgap_under_split.py",
    "collection/modules/test_engine_image_pull.py",
    "system/rollout/test_rollout_playbook.py",
    "system/e2e/test_real_engine.py",
    "system/pull/test_pull_role.py",
    "system/packaging/test_packaging_host_pythons.py",
    "collection/modules/test_engine_replace_ways.py",
    "collection/modules/test_engine_set.py",
    "system/pull/test_pull_wrapper.py",
    "devserver/test_openapi_schemathesis.py",
    "devserver/test_fleet_smoke.py",
    "collection/modules/test_drain_module.py",
    "system/systemd_host/test_shutdown_drain_host.py",
    "system/e2e/test_e2e_supervision.py",
    "system/e2e/test_e2e_engines.py",
    "agent/agent_side/test_agent_apply.py",
    "collection/action/test_engine_set_worker.py",
    "collection/modules/test_engine_cordon.py",
    "collection/modules/test_engine_image_prune.py",
    "agent/agent_side/test_agent_cycle.py",
    "devserver/test_devserver_protocol.py",
    "agent/cli/test_root_verbs_read_agent_files.py",
    "agent/root_side/test_apply_split.py",
)


def workers_for_machine(cpus: int | None = None) -> int:
    """Workers for ``-n auto``: one more than the CPUs this process may use."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return max(cpus, 1) + 1


def group_of(relative: str) -> str:
    """The group of a test file, given as its path under tests/ (``agent/test_config.py``): its named group,
    else the file itself."""
    for name, members in GROUPS.items():
        if any(relative == member or relative.startswith(member.rstrip("/") + "/") for member in members):
            return name
    return relative


def _group_of_nodeid(nodeid: str) -> str:
    if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist_group suffix, where pytest and xdist still write one
        return nodeid.rsplit("@", 1)[1]
    path = nodeid.split("::", 1)[0]
    return group_of(path.removeprefix("tests/"))


def _rank(group: str) -> int:
    return SLOWEST_FIRST.index(group) if group in SLOWEST_FIRST else len(SLOWEST_FIRST)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: ``GroupScheduling``; any other mode: xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type information
        """xdist's scope scheduling, with our groups for scopes, handed out slowest first, ``ALONE`` ones last.

        xdist asks for a unit of work for a node when it starts and whenever the node is nearly out of work (a
        worker holds its last test until it knows what comes next, so "nearly" is as far as it gets). Once only
        ``ALONE`` units are left, a node that asks while another is still at work is shut down, and the last
        node left, once every other has finished and left, runs them one after another.
        """

        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _group_of_nodeid(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the first assignment: the work queue is complete, nothing handed out yet
                # sorted() is stable: groups of one rank keep xdist's order (the most tests first).
                ordered = sorted(self.workqueue.items(), key=lambda unit: _rank(unit[0]))
                self.workqueue.clear()
                self.workqueue.update(ordered)
                self._ordered = True
            scope = next((scope for scope in self.workqueue if scope not in ALONE), None)
            if scope is None:  # only groups that must run alone are left
                others = [other for other in self.nodes if other is not node]
                if others:
                    if not all(other.shutting_down for other in others):
                        node.shutdown()  # its tests end; the last node left runs the rest
                    return  # the survivor: asked again as each other node leaves (remove_node)
                scope = next(iter(self.workqueue))
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def remove_node(self, node: Any) -> Any:
            crashed = super().remove_node(node)
            for other in list(self.nodes):
                self._reschedule(other)
            return crashed

    return GroupScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: ``workers_for_machine()``, unless ``PYTEST_XDIST_AUTO_NUM_WORKERS`` says otherwise."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return workers_for_machine()

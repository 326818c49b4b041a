"""Changed by hand, as data: inspect documents and create requests in, the drifted settings out
(plugins/module_utils/docker/drift.py), and the plan that puts them back (engine_plan)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.drift import (
    LABEL_SETTINGS,
    SETTINGS,
    compare_settings,
    describe_drift,
    drifted_from_label,
    expected_settings,
    read_settings,
    settings_label,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.plan import Action, Observed, plan_engine

IMAGE_ID = "sha256:" + "6a" * 32
IMAGE: dict[str, Any] = {
    "Id": IMAGE_ID,
    "Config": {
        "Entrypoint": ["python3", "/standin/standin_server.py"],
        "Cmd": [],
        "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
        "Labels": {"org.opencontainers.image.title": "standin"},
    },
}
REQUEST: dict[str, Any] = {
    "Image": IMAGE_ID,
    "Cmd": ["--model", "tiny"],
    "Env": ["API_TOKEN=s3cret", "PATH=/opt/bin"],
    "Labels": {"meridian.node/owned": "true", "com.example.team": "search"},
    "StopSignal": "SIGTERM",
    "StopTimeout": 30,
    "HostConfig": {
        "Init": True,
        "IpcMode": "private",
        "Mounts": [{"Type": "bind", "Source": "/srv/m", "Target": "/models", "ReadOnly": True}],
        "PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "9401"}]},
        "RestartPolicy": {"Name": "unless-stopped"},
        "ShmSize": 256 * 1024 * 1024,
    },
}


def inspected(**changes: Any) -> dict[str, Any]:
    """The inspect document the daemon gives for a container created by REQUEST (as Docker 20.10 fills it
    in), with ``changes`` merged into its ``Config`` / ``HostConfig`` / top level."""
    document: dict[str, Any] = {
        "Image": IMAGE_ID,
        "Config": {
            "Entrypoint": ["python3", "/standin/standin_server.py"],
            "Cmd": ["--model", "tiny"],
            "Env": ["API_TOKEN=s3cret", "PATH=/opt/bin", "LANG=C.UTF-8"],
            "Labels": {
                "meridian.node/owned": "true",
                "com.example.team": "search",
                "org.opencontainers.image.title": "standin",
                LABEL_SETTINGS: settings_label(expected_settings(REQUEST, IMAGE)),
            },
            "StopSignal": "SIGTERM",
            "StopTimeout": 30,
        },
        "HostConfig": {
            "Binds": None,
            "NetworkMode": "default",
            "PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "9401"}]},
            "RestartPolicy": {"Name": "unless-stopped", "MaximumRetryCount": 0},
            "CapAdd": None,
            "IpcMode": "private",
            "PidMode": "",
            "Privileged": False,
            "SecurityOpt": None,
            "ShmSize": 256 * 1024 * 1024,
            "CpuShares": 0,
            "Memory": 0,
            "NanoCpus": 0,
            "BlkioWeight": 0,
            "CpuPeriod": 0,
            "CpuQuota": 0,
            "CpusetCpus": "",
            "Devices": None,
            "DeviceRequests": None,
            "MemoryReservation": 0,
            "MemorySwap": 0,
            "PidsLimit": None,
            "Ulimits": None,
            "Mounts": [{"Type": "bind", "Source": "/srv/m", "Target": "/models", "ReadOnly": True}],
            "Init": True,
        },
    }
    for section in ("Config", "HostConfig"):
        document[section].update(changes.pop(section, {}))
    document.update(changes)
    return document


def test_a_container_as_created_shows_no_drift_either_way() -> None:
    live = inspected()
    assert compare_settings(expected_settings(REQUEST, IMAGE), read_settings(live)) == []
    assert drifted_from_label(live) == ()


# (case, changes to the inspect document, drifted settings): what `docker update` and a container recreated
# by hand with our labels can change, one row each.
ROWS: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "update --restart no",
        {"HostConfig": {"RestartPolicy": {"Name": "no", "MaximumRetryCount": 0}}},
        ["restart_policy"],
    ),
    (
        "update --restart on-failure:3",
        {"HostConfig": {"RestartPolicy": {"Name": "on-failure", "MaximumRetryCount": 3}}},
        ["restart_policy"],
    ),
    ("update --memory", {"HostConfig": {"Memory": 314572800, "MemorySwap": 629145600}}, ["memory"]),
    ("update --cpus", {"HostConfig": {"NanoCpus": 500000000}}, ["cpus"]),
    ("update --cpuset-cpus", {"HostConfig": {"CpusetCpus": "0"}}, ["cpus"]),
    ("update --pids-limit", {"HostConfig": {"PidsLimit": 100}}, ["pids_limit"]),
    ("update --blkio-weight", {"HostConfig": {"BlkioWeight": 300}}, ["blkio"]),
    ("another image", {"Image": "sha256:" + "ff" * 32}, ["image"]),
    ("another command", {"Config": {"Cmd": ["--model", "other"]}}, ["command"]),
    ("another entrypoint", {"Config": {"Entrypoint": ["sh"]}}, ["command"]),
    ("an env value", {"Config": {"Env": ["API_TOKEN=other", "PATH=/opt/bin", "LANG=C.UTF-8"]}}, ["env"]),
    ("an extra env", {"Config": {"Env": ["API_TOKEN=s3cret", "PATH=/opt/bin", "LANG=C.UTF-8", "X=1"]}}, ["env"]),
    (
        "an extra label",
        {
            "Config": {
                "Labels": {**inspected()["Config"]["Labels"], "com.example.extra": "1"},
            }
        },
        ["labels"],
    ),
    (
        "published elsewhere",
        {"HostConfig": {"PortBindings": {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "9401"}]}}},
        ["ports"],
    ),
    (
        "a GPU asked by hand",
        {"HostConfig": {"DeviceRequests": [{"Driver": "nvidia", "DeviceIDs": ["0"], "Count": 0}]}},
        ["gpus"],
    ),
    (
        "a writable mount",
        {"HostConfig": {"Mounts": [{"Type": "bind", "Source": "/srv/m", "Target": "/models"}]}},
        ["mounts"],
    ),
    ("an extra -v", {"HostConfig": {"Binds": ["/etc:/host-etc"]}}, ["mounts"]),
    ("host IPC", {"HostConfig": {"IpcMode": "host", "SecurityOpt": ["label=disable"]}}, ["ipc_mode"]),
    ("another /dev/shm", {"HostConfig": {"ShmSize": 64 * 1024 * 1024}}, ["shm_size"]),
    ("a ulimit", {"HostConfig": {"Ulimits": [{"Name": "nofile", "Soft": 1, "Hard": 1}]}}, ["ulimits"]),
    ("no init", {"HostConfig": {"Init": False}}, ["init"]),
    ("another stop timeout", {"Config": {"StopTimeout": 1}}, ["stop"]),
    ("privileged", {"HostConfig": {"Privileged": True}}, ["privileged"]),
    ("a capability", {"HostConfig": {"CapAdd": ["SYS_ADMIN"]}}, ["capabilities"]),
    (
        "a host device",
        {"HostConfig": {"Devices": [{"PathOnHost": "/dev/fuse", "PathInContainer": "/dev/fuse"}]}},
        ["devices"],
    ),
    ("host network", {"HostConfig": {"NetworkMode": "host"}}, ["network_mode"]),
    ("host PID", {"HostConfig": {"PidMode": "host"}}, ["pid_mode"]),
    ("seccomp off", {"HostConfig": {"SecurityOpt": ["seccomp=unconfined"]}}, ["security_opt"]),
    (
        "two at once",
        {"HostConfig": {"RestartPolicy": {"Name": "no"}, "Memory": 1 << 30}},
        ["restart_policy", "memory"],
    ),
]


@pytest.mark.parametrize(("case", "changes", "drifted"), ROWS, ids=[row[0] for row in ROWS])
def test_a_change_by_hand_is_named_by_the_module_and_by_the_label(
    case: str, changes: dict[str, Any], drifted: list[str]
) -> None:
    live = inspected(**copy.deepcopy(changes))

    assert compare_settings(expected_settings(REQUEST, IMAGE), read_settings(live)) == drifted
    assert drifted_from_label(live) == tuple(drifted)


@pytest.mark.parametrize(
    ("case", "changes"),
    [
        ("restart policy no, as created", {"RestartPolicy": {"Name": "", "MaximumRetryCount": 0}}),
        ("restart policy no, after docker update", {"RestartPolicy": {"Name": "no", "MaximumRetryCount": 0}}),
        ("network mode spelt bridge", {"NetworkMode": "bridge"}),
        ("pids limit unlimited", {"PidsLimit": 0}),
        ("empty lists for null", {"CapAdd": [], "Ulimits": [], "DeviceRequests": [], "Binds": []}),
    ],
)
def test_one_meaning_is_read_in_one_form(case: str, changes: dict[str, Any]) -> None:
    request = copy.deepcopy(REQUEST)
    del request["HostConfig"]["RestartPolicy"]
    live = inspected(HostConfig={"RestartPolicy": {"Name": "", "MaximumRetryCount": 0}, **changes})
    assert compare_settings(expected_settings(request, IMAGE), read_settings(live)) == [], case


def test_the_image_defaults_are_merged_as_the_daemon_merges_them() -> None:
    bare = {"Image": IMAGE_ID, "Env": ["A=1", "PATH=/opt/bin"], "HostConfig": {}}
    expected = expected_settings(bare, IMAGE)
    # The image's entrypoint and command when the request gives neither; its env entries we do not set.
    assert expected["command"] == {"entrypoint": ["python3", "/standin/standin_server.py"], "cmd": []}
    assert expected["env"] == {"A": "1", "PATH": "/opt/bin", "LANG": "C.UTF-8"}
    assert expected["labels"] == {"org.opencontainers.image.title": "standin"}
    # An entrypoint of our own drops the image's command, as the daemon does.
    image = {"Config": {**IMAGE["Config"], "Cmd": ["--serve"]}}
    assert expected_settings({**bare, "Entrypoint": ["sh"]}, image)["command"] == {"entrypoint": ["sh"], "cmd": []}
    assert expected_settings(bare, image)["command"]["cmd"] == ["--serve"]
    # The daemon's own /dev/shm default is its configuration, not ours: unset is not compared.
    assert "shm_size" not in expected


def test_host_ipc_is_not_a_change_because_the_daemon_disables_labelling_for_it() -> None:
    request = copy.deepcopy(REQUEST)
    request["HostConfig"]["IpcMode"] = "host"
    del request["HostConfig"]["ShmSize"]
    live = inspected(HostConfig={"IpcMode": "host", "SecurityOpt": ["label=disable"]})
    assert compare_settings(expected_settings(request, IMAGE), read_settings(live)) == []


@pytest.mark.parametrize(
    "label",
    [None, "not json", json.dumps(["a"]), json.dumps({"image": 1}), "{" + " " * 5000 + "}"],
    ids=["absent", "not-json", "a-list", "not-digests", "too-long"],
)
def test_a_container_without_readable_digests_has_nothing_to_compare_with(label: str | None) -> None:
    labels = {k: v for k, v in inspected()["Config"]["Labels"].items() if k != LABEL_SETTINGS}
    if label is not None:
        labels[LABEL_SETTINGS] = label
    assert drifted_from_label(inspected(Config={"Labels": labels, "StopTimeout": 1})) is None


def test_the_label_holds_one_digest_per_setting_and_no_value() -> None:
    stored = json.loads(settings_label(expected_settings(REQUEST, IMAGE)))
    assert set(stored) == set(SETTINGS)  # REQUEST sets a /dev/shm size, so every setting is compared
    assert all(len(digest) == 16 for digest in stored.values())
    assert "s3cret" not in settings_label(expected_settings(REQUEST, IMAGE))


def test_an_env_difference_is_shown_by_name_never_by_value() -> None:
    live = {"API_TOKEN": "stolen", "PATH": "/opt/bin", "EXTRA": "1"}
    expected = {"API_TOKEN": "s3cret", "PATH": "/opt/bin"}
    assert describe_drift("env", live, expected) == (["API_TOKEN", "EXTRA"], ["API_TOKEN"])
    assert describe_drift("labels", {"a": "1", "b": "2"}, {"a": "1", "b": "3"}) == ({"b": "2"}, {"b": "3"})
    assert describe_drift("restart_policy", ["no", 0], ["unless-stopped", 0]) == (["no", 0], ["unless-stopped", 0])


# A running engine that drifted is replaced in place: drained, stopped and set aside until the new one is ready.
IN_PLACE = [
    Action.DRAIN,
    Action.STOP,
    Action.SET_ASIDE,
    Action.CREATE,
    Action.START,
    Action.WAIT_READY,
    Action.REMOVE_OLD,
]


@pytest.mark.parametrize(
    ("state", "status", "actions"),
    [
        ("started", "running", IN_PLACE),
        ("started", "exited", [Action.REMOVE, Action.CREATE, Action.START, Action.WAIT_READY]),
        ("stopped", "exited", [Action.REMOVE, Action.CREATE]),
        ("present", "running", IN_PLACE),
        ("absent", "running", [Action.STOP, Action.REMOVE]),
    ],
)
def test_a_drifted_container_with_our_hash_is_replaced_and_the_diff_shows_the_settings(
    state: Any, status: str, actions: list[Action]
) -> None:
    observed = Observed(
        owned=True,
        status=status,
        config_hash="sha256:same",
        drifted={"restart_policy": (["no", 0], ["unless-stopped", 0]), "env": ({"T": "x"}, {"T": "y"})},
    )

    plan = plan_engine(name="chat", state=state, config_hash="sha256:same", spec={}, observed=observed)

    assert list(plan.actions) == actions
    if state == "absent":
        assert plan.drifted == () and "settings" not in plan.before
        return
    assert plan.drifted == ("restart_policy", "env")
    assert plan.diff()["before"]["settings"] == {"restart_policy": ["no", 0], "env": ["T"]}
    assert plan.diff()["after"]["settings"] == {"restart_policy": ["unless-stopped", 0], "env": ["T"]}


def test_an_undrifted_container_with_our_hash_is_left_alone() -> None:
    observed = Observed(owned=True, status="running", config_hash="sha256:same")
    plan = plan_engine(name="chat", state="started", config_hash="sha256:same", spec={}, observed=observed)
    assert plan.actions == () and plan.drifted == ()

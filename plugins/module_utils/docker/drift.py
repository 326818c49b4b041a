"""Was an engine container changed behind our back? Its live settings against what it was created from.

The config-hash label says what a container was created from, but it proves nothing about the container
as it is now: ``docker update`` changes the restart policy, memory or CPUs and leaves every label alone,
and a container recreated by hand with our labels copied carries our hash over settings of its own. So the
settings meridian.node controls are read back from the container's inspect document and compared with the
create request, merged with the image's defaults the way the daemon merges them (``daemon/commit.go``
``merge``: the image's env entries the request does not set, its labels, its command when the request
gives no entrypoint and no command, its entrypoint when the request gives none).

Two readers:

- a converge (``engines.converge.prepare``) has the settings: it builds the request the container would be
  created from now, reads the expected settings out of it (``expected_settings``) and compares them with the
  live ones (``read_settings``); a difference replaces the container, naming the settings and both values.
- the agent has no settings at hand (they come from the spec, the policy and the store, root's side under
  the split), only the inspect document it reads each cycle for the restart count. So the create request
  stores a digest of each expected setting in the label ``meridian.node/settings`` (``settings_label``),
  and ``drifted_from_label`` compares the live settings with it: the names that differ, or None for a
  container created before the label existed (nothing to compare with; the module still compares).

What is compared: the image id, entrypoint and command, environment, labels, published ports, GPU device
requests, mounts, restart policy, IPC mode, shared memory size (only when the request sets one: the
daemon's default is its own configuration), ulimits, init, stop signal and timeout; and what we never set
but ``docker update`` or a hand-made container can: memory, CPU and block-IO limits, the pids limit,
privileges, capabilities, host devices, network and PID namespaces, security options.

Pure and standard library only: inspect documents in, names and values out. Runs on the managed host's
Python (3.9+).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "LABEL_SETTINGS",
    "SETTINGS",
    "compare_settings",
    "describe_drift",
    "drifted_from_label",
    "expected_settings",
    "read_settings",
    "settings_label",
]

LABEL_SETTINGS = "meridian.node/settings"
SETTINGS = (
    "image",
    "command",
    "env",
    "labels",
    "ports",
    "gpus",
    "mounts",
    "restart_policy",
    "ipc_mode",
    "shm_size",
    "ulimits",
    "init",
    "stop",
    "memory",
    "cpus",
    "blkio",
    "pids_limit",
    "privileged",
    "capabilities",
    "devices",
    "network_mode",
    "pid_mode",
    "security_opt",
)
# 64 bits of sha256 per setting: enough to tell "changed" from "unchanged", and the label stays small.
_DIGEST_HEX = 16
_MAX_LABEL = 4096


def _text_list(value: Any) -> list[str]:
    return [str(item) for item in value] if isinstance(value, Sequence) and not isinstance(value, str) else []


def _env(entries: Any) -> dict[str, str]:
    env: dict[str, str] = {}
    for entry in _text_list(entries):
        key, _eq, value = entry.partition("=")
        env.setdefault(key, value)  # the first of a key wins, as in the process's environment block
    return env


def _number(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _network_mode(value: Any) -> str:
    # The daemon reports "default" for a container created without one, which is the bridge network.
    return "default" if value in (None, "", "default", "bridge") else str(value)


def read_settings(document: Mapping[str, Any]) -> dict[str, Any]:
    """The settings we control, from an inspect document (``Image``, ``Config``, ``HostConfig``), as plain
    JSON data in one form per meaning (None, [] and an absent key all read as "not set")."""
    config: Mapping[str, Any] = document.get("Config") or {}
    host: Mapping[str, Any] = document.get("HostConfig") or {}
    restart: Mapping[str, Any] = host.get("RestartPolicy") or {}
    bindings: Mapping[str, Any] = host.get("PortBindings") or {}
    labels = {str(k): str(v) for k, v in (config.get("Labels") or {}).items() if k != LABEL_SETTINGS}
    settings: dict[str, Any] = {
        "image": str(document.get("Image") or config.get("Image") or ""),
        "command": {"entrypoint": _text_list(config.get("Entrypoint")), "cmd": _text_list(config.get("Cmd"))},
        "env": _env(config.get("Env")),
        "labels": labels,
        "ports": sorted(
            [str(port), str(b.get("HostIp") or ""), str(b.get("HostPort") or "")]
            for port, listed in bindings.items()
            for b in (listed or [])
        ),
        "gpus": sorted(
            [
                str(request.get("Driver") or ""),
                sorted(_text_list(request.get("DeviceIDs"))),
                _number(request.get("Count")),
                sorted(sorted(_text_list(caps)) for caps in (request.get("Capabilities") or [])),
            ]
            for request in (host.get("DeviceRequests") or [])
        ),
        "mounts": sorted(
            [
                [
                    str(m.get("Type") or ""),
                    str(m.get("Source") or ""),
                    str(m.get("Target") or ""),
                    bool(m.get("ReadOnly")),
                ]
                for m in (host.get("Mounts") or [])
            ]
            + [["bind-string", bind, "", False] for bind in _text_list(host.get("Binds"))]
            + [["volumes-from", source, "", False] for source in _text_list(host.get("VolumesFrom"))]
        ),
        # Created without one, the daemon says ""; after `docker update --restart no`, "no".
        "restart_policy": [str(restart.get("Name") or "no"), _number(restart.get("MaximumRetryCount"))],
        "ipc_mode": str(host.get("IpcMode") or ""),
        "shm_size": _number(host.get("ShmSize")),
        "ulimits": sorted(
            [str(u.get("Name") or ""), _number(u.get("Soft")), _number(u.get("Hard"))]
            for u in (host.get("Ulimits") or [])
        ),
        "init": bool(host.get("Init")),
        "stop": [str(config.get("StopSignal") or ""), config.get("StopTimeout")],
        "memory": [_number(host.get(k)) for k in ("Memory", "MemoryReservation", "MemorySwap", "KernelMemory")],
        "cpus": [
            *(_number(host.get(k)) for k in ("NanoCpus", "CpuShares", "CpuPeriod", "CpuQuota")),
            *(_number(host.get(k)) for k in ("CpuRealtimePeriod", "CpuRealtimeRuntime")),
            str(host.get("CpusetCpus") or ""),
            str(host.get("CpusetMems") or ""),
        ],
        "blkio": _number(host.get("BlkioWeight")),
        # Unset is null; `docker update --pids-limit 0` or -1 mean unlimited too.
        "pids_limit": max(0, _number(host.get("PidsLimit"))),
        "privileged": bool(host.get("Privileged")),
        "capabilities": [sorted(_text_list(host.get("CapAdd"))), sorted(_text_list(host.get("CapDrop")))],
        "devices": sorted(
            [str(d.get("PathOnHost") or ""), str(d.get("PathInContainer") or ""), str(d.get("CgroupPermissions") or "")]
            for d in (host.get("Devices") or [])
        ),
        "network_mode": _network_mode(host.get("NetworkMode")),
        "pid_mode": str(host.get("PidMode") or ""),
        "security_opt": sorted(_security_opt(host)),
    }
    return settings


def _security_opt(host: Mapping[str, Any]) -> list[str]:
    options = _text_list(host.get("SecurityOpt"))
    if host.get("IpcMode") == "host" or host.get("PidMode") == "host" or host.get("Privileged"):
        # The daemon adds this itself to a container sharing the host's IPC or PID namespace: not a change.
        options = [option for option in options if option != "label=disable"]
    return options


def expected_settings(request: Mapping[str, Any], image: Mapping[str, Any]) -> dict[str, Any]:
    """What ``read_settings`` will read from a container created by the Engine API request ``request``
    (the container-create body) from the image whose inspect document is ``image``.

    The shared memory size is left out when the request sets none: the daemon fills in its own default
    (``--default-shm-size``), which a host may configure.
    """
    image_config: Mapping[str, Any] = image.get("Config") or {}
    env = _text_list(request.get("Env"))
    keys = set(_env(env))
    env += [entry for entry in _text_list(image_config.get("Env")) if entry.partition("=")[0] not in keys]
    labels = {**(image_config.get("Labels") or {}), **(request.get("Labels") or {})}
    entrypoint = request.get("Entrypoint")
    command = request.get("Cmd")
    if not _text_list(entrypoint):
        if not _text_list(command):
            command = image_config.get("Cmd")
        if entrypoint is None:
            entrypoint = image_config.get("Entrypoint")
    document = {
        "Image": request.get("Image"),
        "Config": {
            "Entrypoint": entrypoint,
            "Cmd": command,
            "Env": env,
            "Labels": labels,
            "StopSignal": request.get("StopSignal") or image_config.get("StopSignal"),
            "StopTimeout": request.get("StopTimeout"),
        },
        "HostConfig": request.get("HostConfig") or {},
    }
    settings = read_settings(document)
    if "ShmSize" not in (request.get("HostConfig") or {}):
        del settings["shm_size"]
    return settings


def compare_settings(expected: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """The names of the settings in ``expected`` whose live value differs, in ``SETTINGS`` order."""
    return [name for name in SETTINGS if name in expected and _canonical(expected[name]) != _canonical(live.get(name))]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode("utf-8")).hexdigest()[:_DIGEST_HEX]


def settings_label(expected: Mapping[str, Any]) -> str:
    """The value of ``LABEL_SETTINGS`` for a container expected to have ``expected``: one digest per setting
    (never a value: the environment holds secrets)."""
    return _canonical({name: _digest(value) for name, value in expected.items()})


def drifted_from_label(document: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The settings of an inspected container that differ from the digests its create request stored; None
    when it carries no (readable) digests: created before they existed, so there is nothing to compare."""
    labels = (document.get("Config") or {}).get("Labels") or {}
    raw = labels.get(LABEL_SETTINGS)
    if not isinstance(raw, str) or len(raw) > _MAX_LABEL:
        return None
    try:
        stored: Any = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(stored, dict) or not all(isinstance(v, str) for v in stored.values()):
        return None
    live = read_settings(document)
    return tuple(name for name in SETTINGS if name in stored and stored[name] != _digest(live.get(name)))


def describe_drift(name: str, live: Any, expected: Any) -> tuple[Any, Any]:
    """``(before, after)`` for a diff of one drifted setting. For ``env`` only the names of the variables
    that differ (their values are secrets); for ``labels`` only the labels that differ."""
    if name in ("env", "labels") and isinstance(live, Mapping) and isinstance(expected, Mapping):
        keys = sorted(k for k in set(live) | set(expected) if live.get(k) != expected.get(k))
        if name == "env":
            return [k for k in keys if k in live], [k for k in keys if k in expected]
        return {k: live[k] for k in keys if k in live}, {k: expected[k] for k in keys if k in expected}
    return live, expected

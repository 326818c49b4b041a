"""The rules an engine's spec obeys, shared by every reader of one: the contract (``contracts.EngineSpec``),
the pydantic-free parser the engine modules use (``engines/spec.py``) and the host's policy (``trust/policy.py``).

Names, limits and patterns, and the checks that give a reason in words or None. Pure: no I/O. One copy, so
the three readers refuse the same documents (``tests/collection/module_utils/engines/test_engine_spec.py``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

from ansible_collections.meridian.node.plugins.module_utils._module import (
    AGENT_STATE_DIR,
    DEFAULT_STATE_DIR,
    DEFAULT_STORE_PATH,
)
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr

__all__ = [
    "DRIVERS",
    "ENGINE_STATES",
    "IMAGE_REFERENCE",
    "IMAGE_REFERENCE_FORM",
    "IPC_MODES",
    "MAX_LABELS",
    "MAX_LABEL_VALUE",
    "MAX_VOLUMES",
    "NAME_FORM",
    "NAME_PATTERN",
    "READY_TIMEOUT_MAX_S",
    "REPLACE_STRATEGIES",
    "RESERVED_CONTAINER_PATHS",
    "RESERVED_HOST_PATHS",
    "RESERVED_LABEL_PREFIXES",
    "RESTART_POLICIES",
    "SECRET_SHOWN",
    "SHM_SIZE_MAX_MIB",
    "ULIMIT_MAX",
    "ULIMIT_NAMES",
    "label_problem",
    "path_within",
    "paths_overlap",
    "secret_env_problem",
    "ulimit_problem",
    "volume_problem",
    "volume_targets_problem",
]

# The engines there is a driver for, in the order schemas and option choices list them: the one list of their names,
# which contracts.Driver is derived from and engines/drivers.py's DRIVERS holds a class for each of (a test holds
# the two to each other; trust/ reads this list and may not import engines/).
DRIVERS = ("vllm", "tgi", "sglang", "ollama", "llamacpp", "lmdeploy", "openai")
ENGINE_STATES = ("started", "stopped", "absent")
REPLACE_STRATEGIES = ("drain-then-replace", "stop-then-start")
RESTART_POLICIES = ("no", "on-failure", "unless-stopped")
IPC_MODES = ("private", "host")
ULIMIT_NAMES = ("core", "memlock", "nofile", "nproc", "stack")
# -1 is "unlimited" (RLIM_INFINITY); anything else fits the int64 the Engine API carries.
ULIMIT_MAX = 2**63 - 1
# /dev/shm is a tmpfs: the size is a cap, not an allocation. The bound only keeps the byte count (MiB * 2**20)
# far inside int64; it is larger than any host's memory.
SHM_SIZE_MAX_MIB = 16 * 1024 * 1024
# A day: longer than any model load, short enough that a wrong value does not hold an apply for ever.
READY_TIMEOUT_MAX_S = 86400
MAX_VOLUMES = 16
MAX_LABELS = 32
MAX_LABEL_VALUE = 1024

# Host paths no engine may mount, nor any directory above them (mounting /var would expose /var/run/docker.sock).
RESERVED_HOST_PATHS = (
    "/boot",
    "/dev",
    "/etc",
    "/proc",
    "/root",
    "/run",
    "/sys",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/kubelet",
    AGENT_STATE_DIR,
    DEFAULT_STATE_DIR,
    DEFAULT_STORE_PATH,
    "/var/run",
)
# Container paths a volume may not cover: /meridian holds the collection's own mounts (the model artifact).
RESERVED_CONTAINER_PATHS = ("/dev", "/meridian", "/proc", "/sys")
RESERVED_LABEL_PREFIXES = ("meridian.node", "com.docker.", "io.docker.", "org.dockerproject.")
_LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,126}[a-z0-9])?$")

# Names of engines and artifacts: they become container names, label values and store directories.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"

# repository[:tag]@sha256:<64 hex>. Whether a digest is *required* is policy's call, not the contract's;
# the contract only insists the reference is well formed.
IMAGE_REFERENCE = re.compile(
    r"^(?P<repository>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
IMAGE_REFERENCE_FORM = "repository[:tag][@sha256:<64 hex>]"
NAME_FORM = "a lowercase name of 1-63 letters, digits, '.', '_' or '-'"


# --- the rules both checks share (contracts.EngineSpec calls them too) -------------------------------------


def path_within(path: str, root: str) -> bool:
    """Whether normal absolute ``path`` is ``root`` or below it, by whole components (/data2 is not in /data)."""
    return root == "/" or path == root or path.startswith(root + "/")


def paths_overlap(first: str, second: str) -> bool:
    """Whether one of two normal absolute paths contains the other: mounting either exposes both."""
    return path_within(first, second) or path_within(second, first)


def _path_problem(path: str, what: str) -> str | None:
    if not path.startswith("/") or "\x00" in path or posixpath.normpath(path) != path or path.startswith("//"):
        return (
            f"{what} {short_repr(path)} must be an absolute path without '.', '..', '//' or a trailing '/'; "
            f"write it as {short_repr(posixpath.normpath(path))} if that is what you mean"
        )
    return None


def volume_problem(source: str, target: str) -> str | None:
    """None when host path ``source`` may be mounted read-only at ``target`` as far as the spec can tell, else
    why not. The host also checks its policy's allow-list against the path with symlinks resolved."""
    problem = _path_problem(source, "volume source") or _path_problem(target, "volume target")
    if problem is not None:
        return problem
    for reserved in RESERVED_HOST_PATHS:
        if paths_overlap(source, reserved):
            return (
                f"volume source {source!r} overlaps {reserved}, which no engine may mount (host configuration, "
                "secrets, the kernel's and container runtimes' interfaces, or meridian.node's own state); mount a "
                "data directory of its own instead"
            )
    if target == "/":
        return "volume target '/' would cover the whole container; mount at a directory such as /data"
    for reserved in RESERVED_CONTAINER_PATHS:
        if paths_overlap(target, reserved):
            return (
                f"volume target {target!r} overlaps {reserved} inside the container, which meridian.node or Docker "
                "mounts itself; choose another directory such as /data"
            )
    return None


def volume_targets_problem(targets: list[str]) -> str | None:
    for index, target in enumerate(targets):
        for other in targets[index + 1 :]:
            if paths_overlap(target, other):
                return f"volume targets {target!r} and {other!r} overlap: one mount would hide the other"
    return None


def label_problem(key: str, value: str) -> str | None:
    """None when ``key: value`` may be one of an engine's own labels, else why not."""
    if not _LABEL_KEY.match(key):
        return (
            f"label key {short_repr(key)} must be 1-128 lowercase letters, digits, '.', '_', '/' or '-', starting "
            "and ending with a letter or digit (such as com.example.team)"
        )
    for prefix in RESERVED_LABEL_PREFIXES:
        if key.startswith(prefix):
            return (
                f"label key {key!r} starts with {prefix!r}, which is reserved (meridian.node's ownership and spec "
                "labels, Docker's own namespaces); use a prefix of your own such as com.example."
            )
    if len(value) > MAX_LABEL_VALUE:
        return f"label {key!r}: the value is {len(value)} characters, more than {MAX_LABEL_VALUE}"
    return None


def ulimit_problem(name: str, soft: int, hard: int) -> str | None:
    """None when ``soft``/``hard`` (-1 = unlimited) is a limit the kernel accepts for ``name``, else why not."""
    if name not in ULIMIT_NAMES:
        return f"ulimit {name!r} is not one of {', '.join(ULIMIT_NAMES)}"
    if name == "nofile" and -1 in (soft, hard):
        return "ulimit nofile cannot be unlimited (the kernel caps it at fs.nr_open); give a number such as 1048576"
    if hard != -1 and (soft == -1 or soft > hard):
        return f"ulimit {name}: soft limit {soft} is above hard limit {hard} (-1 is unlimited)"
    return None


# What a diff, a result or a label shows for a secret_env value: the key is said, the value never.
SECRET_SHOWN = "<secret>"  # noqa: S105 - the placeholder shown instead of a secret, not one


def secret_env_problem(env_keys: Iterable[str], secret_keys: Iterable[str]) -> str | None:
    """None unless a variable is named in both ``env`` and ``secret_env``; then which, and what to do.

    Refused rather than merged: either winner would silently put a secret where it is shown or a shown
    value where it is hidden."""
    both = sorted(set(env_keys) & set(secret_keys))
    if not both:
        return None
    return (
        f"{', '.join(repr(key) for key in both)} set in both env and secret_env; keep each variable in one "
        "of them (secret_env for values that must never be shown)"
    )

"""The host's cordon: GPUs (or the whole node) that take no new engines, kept on the host across restarts.

One small JSON file, ``<state_dir>/cordon.json``, written atomically by ``meridian.node.cordon`` (root) and
read by the engine modules (placement refuses cordoned GPUs; engines the cordon holds stay stopped) and by
the agent (observations list the cordon; supervision leaves held engines alone: they carry draining marks).
Like the draining marks it holds nothing secret and is world-readable, because the agent runs unprivileged.

A cordon with no ``gpus`` is a node cordon. ``drain`` means its engines were drained and stopped, and are
``held``: the names the cordon stopped, so that lifting it starts exactly those again and nothing else.

The policy may cordon GPUs for good (``cordon:``) and the signed desired state may carry a cordon of its own
(``contracts.Cordon``); :func:`cordons_in_force` lists all three and :func:`merge_cordons` is the one rule for
reading them together: the union of the GPUs, a node cordon if any is one, drain if any drains.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    read_json_record,
    remove_json_record,
    write_json_record,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import CordonPolicy

__all__ = [
    "CORDON_FILE",
    "CordonStateError",
    "HostCordon",
    "cordoned_gpu_keys",
    "cordons_in_force",
    "mark_cordoned",
    "merge_cordons",
    "read_cordon",
    "remove_cordon",
    "write_cordon",
]

CORDON_FILE = "cordon.json"
_MAX_BYTES = 64 * 1024
_MAX_ENTRIES = 256
_WHAT = "cordon file"
_FIX = "remove it or run meridian.node.cordon with state=absent"


class CordonStateError(MeridianError, ValueError):
    """The cordon file could not be read or written; the message names the file and what to do."""


@dataclass(frozen=True)
class HostCordon:
    """A cordon in force. ``gpus`` empty: the whole node. ``by`` says where it came from (the file is "policy":
    the host's own word; a merge with the signed state's says "desired-state" when only the state cordons)."""

    gpus: tuple[str, ...] = ()
    drain: bool = False
    reason: str | None = None
    since: str | None = None
    held: tuple[str, ...] = field(default=())
    by: str = "policy"

    @property
    def node(self) -> bool:
        return not self.gpus

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpus": list(self.gpus),
            "drain": self.drain,
            "reason": self.reason,
            "since": self.since,
            "held": list(self.held),
        }

    def observed(self) -> dict[str, Any]:
        """As ``contracts.NodeCordon``."""
        return {"by": self.by, "gpus": list(self.gpus), "drain": self.drain, "reason": self.reason}

    def covers(self, ids: Sequence[str], gpu_facts: Mapping[str, Any] | None) -> bool:
        """Whether an engine on GPUs ``ids`` (uuids, indexes or MIG uuids) is inside this cordon."""
        if self.node:
            return True
        mine = cordoned_gpu_keys(self.gpus, gpu_facts)
        return bool(mine & cordoned_gpu_keys(ids, gpu_facts))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _path(state_dir: str) -> str:
    return os.path.join(state_dir, CORDON_FILE)


def read_cordon(state_dir: str) -> HostCordon | None:
    """The host's cordon, or None when there is none."""
    path = _path(state_dir)
    # Only ever written by atomic_write: a symlink or a FIFO in its place is not ours.
    document = read_json_record(path, _MAX_BYTES, what=_WHAT, fix=_FIX, error=CordonStateError)
    return None if document is None else _parse(path, document)


def _strings(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= _MAX_ENTRIES
        and all(isinstance(item, str) and 0 < len(item) <= 128 for item in value)
    )


def _parse(path: str, document: dict[str, Any]) -> HostCordon:
    if (
        set(document) != {"gpus", "drain", "reason", "since", "held"}
        or not _strings(document["gpus"])
        or not isinstance(document["drain"], bool)
        or not (document["reason"] is None or isinstance(document["reason"], str))
        or not (document["since"] is None or isinstance(document["since"], str))
        or not _strings(document["held"])
    ):
        raise CordonStateError(
            f"cordon file {path} must be an object with exactly gpus (list of ids), drain (bool), reason, since "
            f"(string or null) and held (list of engine names); {_FIX}"
        )
    return HostCordon(
        gpus=tuple(document["gpus"]),
        drain=document["drain"],
        reason=document["reason"],
        since=document["since"],
        held=tuple(document["held"]),
    )


def write_cordon(state_dir: str, cordon: HostCordon) -> HostCordon:
    """Write ``cordon`` (``since`` filled in when it has none); returns what was written."""
    written = cordon if cordon.since else HostCordon(**{**_fields(cordon), "since": _now()})
    write_json_record(_path(state_dir), written.as_dict(), what=_WHAT, error=CordonStateError)
    return written


def _fields(cordon: HostCordon) -> dict[str, Any]:
    return {
        "gpus": cordon.gpus,
        "drain": cordon.drain,
        "reason": cordon.reason,
        "since": cordon.since,
        "held": cordon.held,
        "by": cordon.by,
    }


def remove_cordon(state_dir: str) -> bool:
    """Lift the host's cordon; returns whether there was one."""
    return remove_json_record(_path(state_dir), what=_WHAT, error=CordonStateError)


def cordoned_gpu_keys(ids: Sequence[str], gpu_facts: Mapping[str, Any] | None) -> set[str]:
    """Every id by which the GPUs ``ids`` name can be asked for: a GPU's uuid, its index and its MIG instances'
    uuids, so that a cordon by index covers an engine placed by uuid, and a GPU's cordon its MIG instances.
    Ids the facts do not know are kept as they are (a cordon outlives a GPU that fell off the bus)."""
    keys = set(ids)
    for gpu in (gpu_facts or {}).get("gpus") or []:
        instances = [str(m.get("uuid")) for m in gpu.get("mig_instances") or []]
        names = {str(gpu.get("uuid")), str(gpu.get("index"))}
        if names & keys:
            keys |= names | set(instances)
    return keys


def cordons_in_force(
    state_dir: str | None, policy: CordonPolicy | None = None, state: Mapping[str, Any] | None = None
) -> list[HostCordon]:
    """Every cordon on this host, each with where it came from: the host's file (``meridian.node.cordon``; not
    read when ``state_dir`` is None), the policy's ``cordon`` section and the signed state's
    (``contracts.Cordon`` as a dict)."""
    found = []
    host = None if state_dir is None else read_cordon(state_dir)
    if host is not None:
        found.append(host)
    if policy is not None:
        found.append(HostCordon(gpus=policy.gpus, drain=policy.drain, reason=policy.reason, by="policy"))
    if state is not None:
        found.append(
            HostCordon(
                gpus=tuple(str(g) for g in state.get("gpus") or ()),
                drain=bool(state.get("drain")),
                reason=state.get("reason"),
                by="desired-state",
            )
        )
    return found


def merge_cordons(cordons: Sequence[HostCordon]) -> HostCordon | None:
    """The cordons as one: the union of their GPUs, a node cordon if any is one, drain if any drains, and the
    engines the host's file holds. None when there is none."""
    if not cordons:
        return None
    if len(cordons) == 1:
        return cordons[0]
    node = any(cordon.node for cordon in cordons)
    return HostCordon(
        gpus=() if node else tuple(sorted({gpu for cordon in cordons for gpu in cordon.gpus})),
        drain=any(cordon.drain for cordon in cordons),
        reason="; ".join(cordon.reason for cordon in cordons if cordon.reason) or None,
        since=next((cordon.since for cordon in cordons if cordon.since), None),
        held=tuple(name for cordon in cordons for name in cordon.held),
        by="+".join(dict.fromkeys(cordon.by for cordon in cordons)),
    )


def mark_cordoned(gpu_facts: Mapping[str, Any], cordon: HostCordon | None) -> dict[str, Any]:
    """``gpu_facts`` with ``cordoned: true`` on every GPU the cordon covers (every GPU for a node cordon)."""
    facts = dict(gpu_facts)
    if cordon is None:
        return facts
    keys = cordoned_gpu_keys(cordon.gpus, gpu_facts)
    facts["gpus"] = [
        {**gpu, "cordoned": cordon.node or bool({str(gpu.get("uuid")), str(gpu.get("index"))} & keys)}
        for gpu in gpu_facts.get("gpus") or []
    ]
    return facts

"""``<state_dir>/engines.json``: the engines root manages here, for an agent that cannot ask Docker.

Runs on: both sides: root's units write it (``write_inventory``), the agent reads it (``read_inventory``).

Under the privilege split (``apply.via: systemd``) the agent has no Docker access (the ``docker`` group
is root-equivalent), so the root apply unit writes what the agent needs to observe its engines: after
every apply it answers (before the answer, so the observation that follows the apply sees the change),
whether the run succeeded or not, and when it starts with nothing to apply. Written atomically, mode
0644, by root; the agent only reads it.

The file (format 1)::

    {"format": 1, "node_id": "<node id>", "written_at": "<RFC 3339 UTC>",
     "engines": [{"name": "chat", "driver": "vllm", "served_model_name": "m" | null,
                  "image": "repo@sha256:..." | null, "host": "127.0.0.1", "port": 8001 | null,
                  "probe_driver": "vllm", "health_path": "/health",
                  "gpus": ["GPU-..."], "min_vram_mib": 1000, "state": "running",
                  "restarts": 0, "exit_code": null, "exit_reason": null,
                  "drifted": ["restart_policy", "cpus"] | [] | null}]}

Only engines whose owner label is ``agent:<node id>`` (what reconcile.yml sets) are listed: foreign
containers are not reported under the split. ``state`` is the container's state at ``written_at``;
readiness is not in the file: the agent probes ``host:port`` on ``health_path`` the ``probe_driver``'s
way itself, every refresh, so an engine that dies after the write is reported not ready. ``restarts``,
``exit_code``, ``exit_reason`` and ``drifted`` (the settings changed by hand since the container was created,
``docker.drift``; null when it carries nothing to compare with) were added later and are optional: a file an
older root unit wrote lacks them. Besides the apply unit, ``meridian-node-apply-observe.timer`` has root
rewrite the file on its own schedule (``root_side.observe_unit``), so a hand change that keeps an engine ready shows.

Reading validates everything and raises ``InventoryError`` with a reason for people; the agent then
reports no engines rather than guessing.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write, read_if_present
from meridian_node_agent.boundary.documents import json_object

__all__ = [
    "INVENTORY_FILE",
    "INVENTORY_MODE",
    "MAX_DRIFTED",
    "MAX_ENGINES",
    "MAX_INVENTORY_BYTES",
    "FileIdentity",
    "Inventory",
    "InventoryEngine",
    "InventoryError",
    "file_identity",
    "parse_inventory",
    "read_inventory",
    "write_inventory",
]

INVENTORY_FILE = "engines.json"
INVENTORY_MODE = 0o644
FORMAT = 1
# A host runs a handful of engines; an entry is a few hundred bytes. Anything near these is not ours.
MAX_INVENTORY_BYTES = 1024 * 1024
MAX_ENGINES = 256

FileIdentity = tuple[int, int, int]  # inode, mtime in ns, size


class InventoryError(MeridianError, ValueError):
    """engines.json is missing, unreadable or malformed; the message names the file and the field."""


@dataclass(frozen=True)
class InventoryEngine:
    name: str
    driver: str | None
    served_model_name: str | None
    image: str | None
    host: str | None
    port: int | None
    probe_driver: str
    health_path: str
    gpus: tuple[str, ...]
    min_vram_mib: int
    state: str
    restarts: int | None = None
    exit_code: int | None = None
    exit_reason: str | None = None
    # Names of the settings changed by hand (``docker.drift``); None: nothing to compare with, or not known.
    drifted: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Every field, in order, as JSON data."""
        drifted = None if self.drifted is None else list(self.drifted)
        return {**asdict(self), "gpus": list(self.gpus), "drifted": drifted}


@dataclass(frozen=True)
class Inventory:
    node_id: str
    written_at: str
    engines: tuple[InventoryEngine, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "node_id": self.node_id,
            "written_at": self.written_at,
            "engines": [engine.as_dict() for engine in self.engines],
        }


def write_inventory(state_dir: Path, inventory: Inventory, *, group: int = -1) -> Path:
    """Replace ``<state_dir>/engines.json`` atomically (temporary file, fsync, rename), mode 0644, ``group``."""
    path = Path(state_dir) / INVENTORY_FILE
    data = json.dumps(inventory.as_dict(), sort_keys=True, indent=1).encode("utf-8") + b"\n"
    atomic_write(path, data, mode=INVENTORY_MODE, group=group)
    return path


def file_identity(path: Path) -> FileIdentity | None:
    """``(inode, mtime_ns, size)`` of ``path``, or None when it does not exist: a cheap 'did it change'."""
    try:
        info = Path(path).lstat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def read_inventory(path: Path, *, node_id: str) -> Inventory:
    """The inventory at ``path`` for ``node_id``; ``InventoryError`` (with the reason) when it is missing,
    not a regular file, larger than ``MAX_INVENTORY_BYTES``, not JSON, of another shape or another node."""
    raw = read_if_present(path, MAX_INVENTORY_BYTES, what="the engine inventory", error=InventoryError)
    if raw is None:
        raise InventoryError(
            f"{path} does not exist yet; the root apply unit (meridian-node apply-spooled) writes it "
            "after each apply and when it starts"
        )
    return parse_inventory(raw, path=path, node_id=node_id)


def parse_inventory(raw: bytes, *, path: Path, node_id: str) -> Inventory:
    document = json_object(raw, path, error=InventoryError)
    where = str(path)
    known = {"format", "node_id", "written_at", "engines"}
    _require(not set(document) - known, where, f"unknown fields {sorted(set(document) - known)}")
    _require(document.get("format") == FORMAT, where, f"format must be {FORMAT} (got {document.get('format')!r})")
    # Any: what the file holds, checked by the _require lines that follow (which mypy does not narrow by).
    written: Any = document.get("node_id")
    _require(isinstance(written, str), where, "node_id must be a string")
    _require(written == node_id, where, f"it was written for node {written!r}, not this node {node_id!r}")
    _require(isinstance(document.get("written_at"), str), where, "written_at must be a string")
    engines: Any = document.get("engines")
    _require(isinstance(engines, list), where, "engines must be a list")
    _require(len(engines) <= MAX_ENGINES, where, f"more than {MAX_ENGINES} engines ({len(engines)})")
    parsed = tuple(_engine(entry, f"{where}: engines[{index}]") for index, entry in enumerate(engines))
    names = [engine.name for engine in parsed]
    # Twice while it is replaced: the old container and the new one (engines.plan); never more.
    crowded = sorted({name for name in names if names.count(name) > 2})
    _require(not crowded, where, f"engine {crowded[0] if crowded else ''!r} is listed more than twice")
    listed = [(engine.name, engine.port) for engine in parsed if engine.port is not None]
    _require(len(set(listed)) == len(listed), where, "an engine is listed twice on one port")
    return Inventory(node_id=written, written_at=document["written_at"], engines=parsed)


_ENGINE_FIELDS = {
    "name",
    "driver",
    "served_model_name",
    "image",
    "host",
    "port",
    "probe_driver",
    "health_path",
    "gpus",
    "min_vram_mib",
    "state",
}
# Added later: a file an older root unit wrote lacks them.
_OPTIONAL_ENGINE_FIELDS = {"restarts", "exit_code", "exit_reason", "drifted"}
# A setting name as engine_drift spells them. Checked by shape, not against engine_drift.SETTINGS: a root unit
# upgraded before the agent restarts may name a setting this agent does not know yet, and that is still a
# hand change to repair, not a reason to stop observing every engine. Bounded: names end up in the oplog.
_SETTING_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
MAX_DRIFTED = 64


def _engine(entry: Any, where: str) -> InventoryEngine:
    _require(isinstance(entry, dict), where, "must be an object")
    _require(
        _ENGINE_FIELDS <= set(entry) <= _ENGINE_FIELDS | _OPTIONAL_ENGINE_FIELDS,
        where,
        f"must have exactly the fields {sorted(_ENGINE_FIELDS)} (and optionally {sorted(_OPTIONAL_ENGINE_FIELDS)})",
    )
    for field in ("name", "probe_driver", "health_path", "state"):
        _require(isinstance(entry[field], str) and entry[field], where, f"{field} must be a non-empty string")
    for field in ("driver", "served_model_name", "image", "host"):
        _require(entry[field] is None or isinstance(entry[field], str), where, f"{field} must be a string or null")
    _require(entry["health_path"].startswith("/"), where, "health_path must start with '/'")
    port = entry["port"]
    _require(port is None or (_is_int(port) and 0 < port < 65536), where, f"port must be 1-65535 or null ({port!r})")
    _require(port is None or entry["host"] is not None, where, "a port needs a host")
    gpus = entry["gpus"]
    _require(isinstance(gpus, list) and all(isinstance(g, str) for g in gpus), where, "gpus must be a list of strings")
    vram = entry["min_vram_mib"]
    _require(_is_int(vram) and vram >= 0, where, f"min_vram_mib must be an integer >= 0 ({vram!r})")
    restarts, code, reason = entry.get("restarts"), entry.get("exit_code"), entry.get("exit_reason")
    _require(restarts is None or (_is_int(restarts) and restarts >= 0), where, f"restarts must be >= 0 ({restarts!r})")
    _require(code is None or _is_int(code), where, f"exit_code must be an integer or null ({code!r})")
    _require(reason is None or (isinstance(reason, str) and len(reason) <= 200), where, "exit_reason is too long")
    drifted = _drifted(entry.get("drifted"), where)
    return InventoryEngine(
        name=entry["name"],
        driver=entry["driver"],
        served_model_name=entry["served_model_name"],
        image=entry["image"],
        host=entry["host"],
        port=port,
        probe_driver=entry["probe_driver"],
        health_path=entry["health_path"],
        gpus=tuple(gpus),
        min_vram_mib=vram,
        state=entry["state"],
        restarts=restarts,
        exit_code=code,
        exit_reason=reason,
        drifted=drifted,
    )


def _drifted(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    _require(isinstance(value, list), where, f"drifted must be a list of setting names or null ({value!r:.80})")
    _require(len(value) <= MAX_DRIFTED, where, f"drifted names more than {MAX_DRIFTED} settings ({len(value)})")
    for name in value:
        _require(
            isinstance(name, str) and _SETTING_NAME.fullmatch(name) is not None,
            where,
            f"drifted: {name!r:.80} is not a setting name (lowercase letters, digits and '_', at most 40)",
        )
    _require(len(set(value)) == len(value), where, "drifted names a setting twice")
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, where: str, problem: str) -> None:
    if not condition:
        raise InventoryError(f"{where}: {problem}")

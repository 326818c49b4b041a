"""Held GPU health verdicts: which GPUs were found unhealthy, kept on the host until a reset or an operator.

One small JSON file in root's state directory, ``<state_dir>/gpu-health-holds.json``, with the last
unhealthy ``contracts.GpuHealth`` of each GPU, by uuid. ``gpu.health_rules.judge`` keeps a verdict held from
one read to the next through its ``previous``; this file is what keeps it across processes: an engine
module's placement (a fresh process each task), a restarted agent, and the operator who clears it by name.

- ``sync(uuid, health)`` after each verdict: an unhealthy one is held (written only when its verdict, reasons
  or ``since`` change, not for every new counter value), any other releases the hold (``judge`` saw a reset);
- ``held(uuid)`` is the held verdict, ``previous_for(uuid, last)`` the ``previous`` to hand ``judge``: the
  held verdict after a restart, and, once an operator cleared the hold, ``last`` without what it held;
- ``add_reasons(uuid, reasons, since=...)`` holds a GPU for reasons found elsewhere (root, for the critical XIDs
  the agent's watch relays in its apply request): it only ever adds to a hold, never weakens or releases one;
- ``clear(which)`` drops the hold of the GPU named by uuid, index or PCI bus id, and says what it dropped.

Writes are atomic (``_fileutil.atomic_write``) under a lock, so a clear never races a sync into a lost
update. The file holds nothing secret and is world-readable: the unprivileged agent reads it. A damaged file
is an error naming the file and the fix, never an empty store: a hold silently lost would place work on a
GPU that fell off the bus.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    atomic_write,
    read_capped,
)
from ansible_collections.meridian.node.plugins.module_utils._lockfile import LOCK_WAIT_S, LockTimeout, hold_lock
from ansible_collections.meridian.node.plugins.module_utils.gpu.health_rules import SEVERITY

__all__ = ["HOLD_FILE", "HealthHoldError", "HealthHolds", "HeldVerdict"]

HOLD_FILE = "gpu-health-holds.json"
_FORMAT = 1
_MAX_BYTES = 1024 * 1024
# What a hold is about: a new counter value in the readings is not a new hold.
_IDENTITY_KEYS = ("verdict", "reasons", "since")
_FIX = (
    "restore it from a backup, or remove it (every hold is lost; a GPU still unhealthy is held again at its "
    "next read, but one held only for an earlier XID is not)"
)


class HealthHoldError(MeridianError, ValueError):
    """The hold file could not be read or written, or a GPU named to clear is not known; the message says which
    and what to do."""


@dataclass(frozen=True)
class HeldVerdict:
    """One GPU's held verdict: its uuid, where it was (index and PCI bus id when held), when it was first held."""

    uuid: str
    health: Mapping[str, Any]
    held_at: str
    index: int | None = None
    pci_bus_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)  # health too, copied

    def describe(self) -> str:
        codes = ", ".join(str(reason.get("code")) for reason in self.health.get("reasons") or []) or "no reasons"
        where = f"GPU {self.index} " if self.index is not None else "GPU "
        return f"{where}{self.uuid} (held since {self.health.get('since') or self.held_at}: {codes})"


def _held(uuid: str, health: dict[str, Any], gpu: Mapping[str, Any] | None, before: HeldVerdict | None) -> HeldVerdict:
    # A GPU held again keeps when it was first held, and where it was unless its facts say where it is now.
    return HeldVerdict(
        uuid=uuid,
        health=health,
        held_at=before.held_at if before is not None else _now(),
        index=_index(gpu) if gpu is not None else (before.index if before is not None else None),
        pci_bus_id=(gpu or {}).get("pci_bus_id") or (before.pci_bus_id if before is not None else None),
    )


class HealthHolds:
    """The hold file of ``state_dir`` (root's: ``_module.DEFAULT_STATE_DIR`` by default)."""

    def __init__(self, state_dir: str | os.PathLike[str], *, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.state_dir = os.fspath(state_dir)
        self.path = os.path.join(self.state_dir, HOLD_FILE)
        self.lock_wait_s = lock_wait_s

    # --- reading ---------------------------------------------------------------------------------------

    def all(self) -> dict[str, HeldVerdict]:
        """Every held verdict, by uuid ({} when nothing was ever held)."""
        try:
            # Only ever written by atomic_write: a symlink or a FIFO in its place is not ours.
            data = read_capped(self.path, _MAX_BYTES, what="GPU health hold file")
        except CappedFileMissingError:
            return {}
        except CappedReadError as exc:
            raise HealthHoldError(f"{exc}; {_FIX}") from exc
        return self._parse(data)

    def held(self, uuid: str) -> dict[str, Any] | None:
        """The held ``GpuHealth`` of GPU ``uuid``; None when it is not held."""
        found = self.all().get(uuid)
        return None if found is None else dict(found.health)

    def previous_for(self, uuid: str, last: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """The ``previous`` to hand ``judge`` for GPU ``uuid``, given the caller's ``last`` verdict of it.

        Held: ``last`` when it is the same unhealthy verdict (fresher readings), else the held one (a restart,
        a fresh process). Not held although ``last`` was unhealthy: an operator cleared it, so ``last`` is
        handed on without its verdict and its XIDs (its counters stay, for the rising rules): only what NVML
        shows from now on counts.
        """
        found = self.held(uuid)
        unhealthy = last is not None and last.get("verdict") == "unhealthy"
        if found is not None:
            return last if unhealthy else found
        if last is not None and unhealthy:
            readings = dict(last.get("readings") or {})
            readings["xid_events"] = []
            return {"verdict": "healthy", "reasons": [], "since": None, "held": False, "readings": readings}
        return last

    # --- writing ---------------------------------------------------------------------------------------

    def hold(self, uuid: str, health: Mapping[str, Any], *, gpu: Mapping[str, Any] | None = None) -> bool:
        """Hold GPU ``uuid``'s unhealthy ``health`` (``gpu``: its facts, for its index and PCI bus id); returns
        whether the file changed. A GPU already held keeps when it was first held."""
        if health.get("verdict") != "unhealthy":
            raise RuntimeError(f"only an unhealthy verdict is held, got {health.get('verdict')!r} for {uuid}")
        with self._locked():
            holds = self.all()
            before = holds.get(uuid)
            if before is not None and all(before.health.get(k) == health.get(k) for k in _IDENTITY_KEYS):
                return False
            holds[uuid] = _held(uuid, dict(health), gpu, before)
            self._write(holds)
        return True

    def add_reasons(
        self,
        uuid: str,
        reasons: Sequence[Mapping[str, Any]],
        *,
        since: str,
        readings: Mapping[str, Any] | None = None,
        gpu: Mapping[str, Any] | None = None,
        max_held: int | None = None,
        max_reasons: int | None = None,
    ) -> bool:
        """Hold GPU ``uuid`` unhealthy for ``reasons`` too, never weakening what is held; returns whether the file
        changed.

        A held GPU keeps its verdict, ``since``, readings and reasons, and gains those of ``reasons`` it lacks (an
        XID reason is the same XID whatever its source). A GPU not held is held for ``reasons`` alone, since
        ``since``, with ``readings`` as the counters a later read compares with (so a reset NVML shows then
        releases it). ``max_held``: a GPU not held is not added while the file holds that many already;
        ``max_reasons``: no reason is added past that many (what is held stays). Every reason must be one that
        makes a GPU unhealthy (``health_rules.SEVERITY``)."""
        weak = [str(reason.get("code")) for reason in reasons if SEVERITY.get(str(reason.get("code"))) != "unhealthy"]
        if weak or not reasons:
            raise RuntimeError(f"only reasons that make a GPU unhealthy are held, got {weak or 'none'} for {uuid}")
        with self._locked():
            holds = self.all()
            before = holds.get(uuid)
            if before is None and max_held is not None and len(holds) >= max_held:
                return False
            kept = list(before.health.get("reasons") or []) if before is not None else []
            known = {_reason_key(reason) for reason in kept}
            added: list[dict[str, Any]] = []
            room = len(reasons) if max_reasons is None else max(max_reasons - len(kept), 0)
            for reason in reasons:
                if len(added) < room and _reason_key(reason) not in known:
                    known.add(_reason_key(reason))
                    added.append(dict(reason))
            if not added:
                return False
            health: dict[str, Any] = {"since": since, "readings": dict(readings or {})}
            if before is not None:
                health = dict(before.health)
            health.update(verdict="unhealthy", reasons=kept + added, held=True)
            holds[uuid] = _held(uuid, health, gpu, before)
            self._write(holds)
        return True

    def sync(self, uuid: str, health: Mapping[str, Any], *, gpu: Mapping[str, Any] | None = None) -> bool:
        """Hold ``health`` when it is unhealthy, else release GPU ``uuid`` (``judge`` saw it reset); returns
        whether the file changed."""
        if health.get("verdict") == "unhealthy":
            return self.hold(uuid, health, gpu=gpu)
        if uuid not in self.all():
            return False
        with self._locked():
            holds = self.all()
            if holds.pop(uuid, None) is None:
                return False
            self._write(holds)
        return True

    def clear(self, which: str | int, *, gpu_facts: Mapping[str, Any] | None = None) -> list[HeldVerdict]:
        """Drop the hold of the GPU ``which`` names: its uuid, its index or its PCI bus id, looked up in
        ``gpu_facts`` (this host's GPUs now) and then in the holds. Returns what was dropped ([] for a GPU
        that was not held); a name that matches no GPU raises ``HealthHoldError`` listing what would."""
        wanted = str(which).strip()
        with self._locked():
            holds = self.all()
            uuid = _resolve(wanted, gpu_facts, holds)
            if uuid is None:
                raise HealthHoldError(_unknown(wanted, gpu_facts, holds, self.path))
            dropped = holds.pop(uuid, None)
            if dropped is None:
                return []
            self._write(holds)
        return [dropped]

    # --- the file --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            os.makedirs(self.state_dir, mode=0o755, exist_ok=True)
            with hold_lock(self.path + ".lock", wait_s=self.lock_wait_s, what="the GPU health hold file's lock"):
                yield
        except LockTimeout as exc:
            raise HealthHoldError(f"cannot update the GPU health hold file {self.path}: {exc}") from exc
        except OSError as exc:
            raise HealthHoldError(
                f"cannot lock the GPU health hold file {self.path}: {exc.strerror or exc}; it is root's: run as root"
            ) from exc

    def _write(self, holds: Mapping[str, HeldVerdict]) -> None:
        document = {"format": _FORMAT, "gpus": {uuid: holds[uuid].as_dict() for uuid in sorted(holds)}}
        data = json.dumps(document, sort_keys=True, indent=1).encode("utf-8") + b"\n"
        try:
            atomic_write(self.path, data, mode=0o644)
        except OSError as exc:
            raise HealthHoldError(
                f"cannot write the GPU health hold file {self.path}: {exc.strerror or exc}; it is root's: run as root"
            ) from exc

    def _parse(self, data: bytes) -> dict[str, HeldVerdict]:
        try:
            document: Any = json.loads(data)
        except ValueError as exc:
            raise HealthHoldError(f"the GPU health hold file {self.path} is not JSON ({exc}); {_FIX}") from exc
        problem = _shape_problem(document)
        if problem is not None:
            raise HealthHoldError(f"the GPU health hold file {self.path} is not a hold file: {problem}; {_FIX}")
        return {
            uuid: HeldVerdict(
                uuid=uuid,
                health=entry["health"],
                held_at=entry["held_at"],
                index=entry.get("index"),
                pci_bus_id=entry.get("pci_bus_id"),
            )
            for uuid, entry in document["gpus"].items()
        }


def _shape_problem(document: Any) -> str | None:
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        return f'it must be an object with "format": {_FORMAT}'
    gpus = document.get("gpus")
    if not isinstance(gpus, dict):
        return '"gpus" must be an object of held verdicts by GPU uuid'
    for uuid, entry in gpus.items():
        if not isinstance(entry, dict) or entry.get("uuid") != uuid:
            return f"the entry {uuid!r} must be an object whose uuid is {uuid!r}"
        health = entry.get("health")
        if not isinstance(health, dict) or health.get("verdict") != "unhealthy":
            return f"the entry {uuid!r} must hold an unhealthy verdict"
        if not isinstance(health.get("reasons"), list) or not all(isinstance(r, dict) for r in health["reasons"]):
            return f"the entry {uuid!r} must list its reasons"
        if not isinstance(entry.get("held_at"), str):
            return f"the entry {uuid!r} must say when it was held (held_at)"
        index = entry.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            return f"the entry {uuid!r} has an index that is not a number"
    return None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _reason_key(reason: Mapping[str, Any]) -> tuple[Any, ...]:
    # An XID reason names its XID in its value, and is the same XID whoever saw it (the agent's watch, root);
    # any other reason is one per code and source.
    code = str(reason.get("code"))
    return (code, reason.get("value")) if code.startswith("xid-") else (code, reason.get("source"))


def _index(gpu: Mapping[str, Any]) -> int | None:
    index = gpu.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _gpus(gpu_facts: Mapping[str, Any] | None) -> Sequence[Mapping[str, Any]]:
    return [gpu for gpu in (gpu_facts or {}).get("gpus") or [] if isinstance(gpu, Mapping)]


def _resolve(wanted: str, gpu_facts: Mapping[str, Any] | None, holds: Mapping[str, HeldVerdict]) -> str | None:
    """The uuid ``wanted`` names: the GPUs as they are now first (an index may have moved since the hold)."""
    for gpu in _gpus(gpu_facts):
        if gpu.get("uuid") and wanted in (gpu.get("uuid"), str(gpu.get("index")), gpu.get("pci_bus_id")):
            return str(gpu["uuid"])
    if wanted in holds:
        return wanted
    for uuid, held in holds.items():
        if wanted in (str(held.index), held.pci_bus_id):
            return uuid
    return None


def _unknown(wanted: str, gpu_facts: Mapping[str, Any] | None, holds: Mapping[str, HeldVerdict], path: str) -> str:
    gpus = [f"{gpu.get('index')}={gpu.get('uuid')}" for gpu in _gpus(gpu_facts) if gpu.get("uuid")]
    parent = next(
        (
            gpu
            for gpu in _gpus(gpu_facts)
            if any(isinstance(m, Mapping) and m.get("uuid") == wanted for m in gpu.get("mig_instances") or [])
        ),
        None,
    )
    if parent is not None:
        return (
            f"{wanted} is a MIG device; verdicts are held per GPU: clear its GPU, "
            f"{parent.get('index')}={parent.get('uuid')}"
        )
    held = "; ".join(verdict.describe() for verdict in holds.values()) or "none"
    return (
        f"no GPU {wanted!r} on this host to clear: name one by uuid, index or PCI bus id (GPUs: "
        f"{', '.join(gpus) or 'not read'}; held in {path}: {held})"
    )

"""XID events from NVML's event set, for ``GpuHealthReadings.xid_events``.

NVML records an event only in a set that was registered for it before it happened ("All events that
occurred before this call are not recorded", nvmlDeviceRegisterEvents). So there are two ways to read:

- :func:`read_xid_events`, a set per read (create, register, drain, free): all a stateless caller such
  as the ad-hoc ``gpu_facts`` module can do. It sees only the XIDs that happen while the set exists, in
  practice none; it still proves the event path works (an error creating or registering is reported);
- :class:`XidWatch`, one set kept open across reads by a long-lived caller (the agent): every XID
  between two reads is queued in it and drained by the next read. That is what the issue's XID window
  needs, and why the watch exists.

Either way the wait is 0 ms (:data:`WAIT_MS`): queued events come back at once, and no read blocks the
agent's cycle waiting for an XID that has not happened. Each event becomes
``{"xid", "at", "mig_uuid"}`` on the GPU it names (found by asking NVML for the event device's UUID), with
the MIG device its GPU/compute instance ids name, or ``None`` for the whole GPU. ``at`` is the read's
time: NVML's event carries none, so an event is dated within one read interval of when it happened.

Errors follow the health rule (``gpu.health_read``): NOT_SUPPORTED (a GPU or platform without events) is
quiet, anything else is named with its call in ``read_errors``; an error from the wait, or an event that
cannot be traced to its GPU, is charged to every GPU registered in the set, as the device plugin marks
them all unhealthy when its wait fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils.gpu.nvml import NvmlSession

__all__ = ["MAX_EVENTS_PER_READ", "WAIT_MS", "XidTarget", "XidWatch", "read_xid_events"]

WAIT_MS = 0
# A storm of XIDs must not hold a read for long: what is left stays queued in a watch for the next read.
MAX_EVENTS_PER_READ = 64
_ANY_INSTANCE = 0xFFFFFFFF  # NVML_GPU_INSTANCE_ID_ANY / NVML_COMPUTE_INSTANCE_ID_ANY: not a MIG event


@dataclass(frozen=True)
class XidTarget:
    """A GPU whose XIDs are wanted: its UUID, its NVML handle, and its MIG instances (``gpu.facts``' dicts)."""

    uuid: str
    handle: Any
    mig_instances: Sequence[Mapping[str, Any]] = field(default_factory=tuple)


def _outcome(targets: Sequence[XidTarget]) -> dict[str, dict[str, list[Any]]]:
    return {target.uuid: {"xid_events": [], "read_errors": []} for target in targets}


def _timestamp(now: datetime) -> str:
    # contracts.format_rfc3339's form, without importing the contracts (and pydantic) on the host.
    utc = now.astimezone(UTC)
    return utc.isoformat(timespec="microseconds" if utc.microsecond else "seconds").replace("+00:00", "Z")


def _charge(outcome: dict[str, dict[str, list[Any]]], targets: Sequence[XidTarget], error: str) -> None:
    for target in targets:
        outcome[target.uuid]["read_errors"].append(error)


def _create(session: NvmlSession, targets: Sequence[XidTarget], outcome: dict[str, dict[str, list[Any]]]) -> Any:
    lib = session.lib
    try:
        return lib.nvmlEventSetCreate()
    except lib.NVMLError as exc:
        if exc.value != session.not_supported:
            _charge(outcome, targets, f"{session.name(exc)} from nvmlEventSetCreate")
        return None


def _free(session: NvmlSession, event_set: Any) -> None:
    # A failed free leaves nothing to undo and nothing the GPUs' health depends on; NVML's shutdown frees it.
    with suppress(session.lib.NVMLError):
        session.lib.nvmlEventSetFree(event_set)


def _register(
    session: NvmlSession, event_set: Any, target: XidTarget, outcome: dict[str, dict[str, list[Any]]]
) -> bool:
    """Register ``target`` for critical XIDs where it supports them; True when it is registered."""
    lib = session.lib
    errors = outcome[target.uuid]["read_errors"]
    call = "nvmlDeviceGetSupportedEventTypes"
    try:
        supported = lib.nvmlDeviceGetSupportedEventTypes(target.handle)
        wanted = supported & lib.nvmlEventTypeXidCriticalError
        if not wanted:
            return False
        call = "nvmlDeviceRegisterEvents"
        lib.nvmlDeviceRegisterEvents(target.handle, wanted, event_set)
    except lib.NVMLError as exc:
        if exc.value != session.not_supported:
            errors.append(f"{session.name(exc)} from {call}")
        return False
    return True


def _mig_uuid(target: XidTarget, gpu_instance: int, compute_instance: int) -> str | None:
    if gpu_instance == _ANY_INSTANCE:
        return None
    matches = [
        instance
        for instance in target.mig_instances
        if instance.get("gpu_instance_id") == gpu_instance
        and (compute_instance == _ANY_INSTANCE or instance.get("compute_instance_id") == compute_instance)
    ]
    # A GPU instance split into several compute instances, with the event naming no one of them: the
    # event is the GPU instance's, which no single MIG uuid names, so it is charged to the whole GPU.
    return matches[0].get("uuid") if len(matches) == 1 else None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Waiter:
    """nvmlEventSetWait_v2, or the older nvmlEventSetWait where the driver lacks v2 (same event data)."""

    __slots__ = ("call", "session", "wait")

    def __init__(self, session: NvmlSession) -> None:
        self.session = session
        self.call = "nvmlEventSetWait_v2"
        self.wait = session.lib.nvmlEventSetWait_v2

    def __call__(self, event_set: Any, timeout_ms: int) -> Any:
        lib = self.session.lib
        try:
            return self.wait(event_set, timeout_ms)
        except lib.NVMLError as exc:
            if exc.value != self.session.function_not_found or self.call == "nvmlEventSetWait":
                raise
        self.call, self.wait = "nvmlEventSetWait", lib.nvmlEventSetWait
        return self.wait(event_set, timeout_ms)


def _drain(
    session: NvmlSession,
    event_set: Any,
    registered: Sequence[XidTarget],
    outcome: dict[str, dict[str, list[Any]]],
    *,
    at: str,
    wait_ms: int,
) -> bool:
    """Deliver the queued events to their GPUs' outcome; False when the set is broken (a wait error)."""
    lib = session.lib
    by_uuid = {target.uuid: target for target in registered}
    waiter = _Waiter(session)
    timeout = wait_ms
    for _event in range(MAX_EVENTS_PER_READ):
        try:
            data = waiter(event_set, timeout)
        except lib.NVMLError as exc:
            if exc.value == session.timeout:
                return True
            _charge(outcome, registered, f"{session.name(exc)} from {waiter.call}")
            return False
        timeout = 0  # the first wait may wait; the rest only collect what is already queued
        if not data.eventType & lib.nvmlEventTypeXidCriticalError:
            continue
        xid = int(data.eventData)
        try:
            uuid = _text(lib.nvmlDeviceGetUUID(data.device))
        except lib.NVMLError as exc:
            _charge(outcome, registered, f"{session.name(exc)} from nvmlDeviceGetUUID (the GPU of XID {xid})")
            continue
        target = by_uuid.get(uuid)
        if target is None:
            _charge(outcome, registered, f"XID {xid} from nvmlEventSetWait names {uuid}, a GPU not registered")
            continue
        outcome[uuid]["xid_events"].append(
            {"xid": xid, "at": at, "mig_uuid": _mig_uuid(target, data.gpuInstanceId, data.computeInstanceId)}
        )
    return True


def read_xid_events(
    session: NvmlSession, targets: Sequence[XidTarget], *, now: datetime, wait_ms: int = WAIT_MS
) -> dict[str, dict[str, list[Any]]]:
    """XIDs seen by a set made for this read: ``{uuid: {"xid_events": [...], "read_errors": [...]}}``."""
    outcome = _outcome(targets)
    if not targets:
        return outcome
    event_set = _create(session, targets, outcome)
    if event_set is None:
        return outcome
    try:
        registered = [target for target in targets if _register(session, event_set, target, outcome)]
        if registered:
            _drain(session, event_set, registered, outcome, at=_timestamp(now), wait_ms=wait_ms)
    finally:
        _free(session, event_set)
    return outcome


class XidWatch:
    """One event set kept across reads, so that the XIDs between two reads are seen by the second.

    It holds its own NVML initialisation (NVML counts them), so the set outlives each read's
    ``nvmlShutdown``. GPUs are registered the first time a read names them. A wait error frees the set
    (NVML leaves it undefined); the next read makes a new one, and the XIDs in between are lost, which the
    error in that read's ``read_errors`` already says. Call :meth:`close` (or use it as a context
    manager) when done.
    """

    def __init__(self, *, wait_ms: int = WAIT_MS) -> None:
        self.wait_ms = wait_ms
        self._lib: Any = None
        self._set: Any = None
        self._registered: set[str] = set()
        self._unsupported = False

    def __enter__(self) -> XidWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def open(self) -> bool:
        return self._set is not None

    def read(
        self, session: NvmlSession, targets: Sequence[XidTarget], *, now: datetime
    ) -> dict[str, dict[str, list[Any]]]:
        """The XIDs queued since the last read: ``{uuid: {"xid_events": [...], "read_errors": [...]}}``."""
        outcome = _outcome(targets)
        if self._lib is not None and self._lib is not session.lib:
            self.close()
        if not targets or self._unsupported:
            return outcome
        if self._set is None and not self._open(session, targets, outcome):
            return outcome
        for target in targets:
            if target.uuid not in self._registered and _register(session, self._set, target, outcome):
                self._registered.add(target.uuid)
        registered = [target for target in targets if target.uuid in self._registered]
        if registered and not _drain(session, self._set, registered, outcome, at=_timestamp(now), wait_ms=self.wait_ms):
            self.close()
        return outcome

    def _open(
        self, session: NvmlSession, targets: Sequence[XidTarget], outcome: dict[str, dict[str, list[Any]]]
    ) -> bool:
        lib = session.lib
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            _charge(outcome, targets, f"{session.name(exc)} from nvmlInit (the XID watch's own)")
            return False
        self._lib = lib
        try:
            self._set = lib.nvmlEventSetCreate()
        except lib.NVMLError as exc:
            if exc.value == session.not_supported:
                self._unsupported = True  # no events on this platform: asking again each read would not help
            else:
                _charge(outcome, targets, f"{session.name(exc)} from nvmlEventSetCreate")
            self.close()
            return False
        return True

    def close(self) -> None:
        """Free the set and give back the watch's NVML initialisation; the next read starts afresh."""
        lib, event_set = self._lib, self._set
        self._lib, self._set = None, None
        self._registered = set()
        if lib is None:
            return
        # Neither failure leaves anything to undo: the shutdown frees what NVML still holds of the set.
        if event_set is not None:
            with suppress(lib.NVMLError):
                lib.nvmlEventSetFree(event_set)
        with suppress(lib.NVMLError):
            lib.nvmlShutdown()

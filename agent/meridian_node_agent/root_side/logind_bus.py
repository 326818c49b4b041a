"""logind on the system bus, through jeepney: the shutdown drain's ``LogindPort``.

Runs on: the root side only (``meridian-node shutdown-drain``; ``root_side.drain_on_shutdown`` decides what to do
with what is heard here).

The delay lock is logind's ``Inhibit("shutdown", ..., "delay")``: a file descriptor, held until closed.
``PrepareForShutdown`` is a signal, and the system bus delivers any client's signals, also those addressed to this
connection alone: the agent's user could forge one. So a ``PrepareForShutdown`` counts only when it comes from the
unique name that owns ``org.freedesktop.login1`` at ``/org/freedesktop/login1`` (``NameOwnerChanged``, sent by the
bus itself, says who that is); anything else is a ``ForgedShutdownSignal``, which the drain logs and ignores.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from typing import Any

from jeepney import (
    DBusAddress,
    DBusErrorResponse,
    HeaderFields,
    MatchRule,
    Properties,
    message_bus,
    new_method_call,
)
from jeepney.io.blocking import open_dbus_connection
from jeepney.wrappers import unwrap_msg

from meridian_node_agent.root_side.drain_on_shutdown import (
    LOGIND_NAME,
    LOGIND_PATH,
    ForgedShutdownSignal,
    LogindEvent,
    LogindOwnerChanged,
    LogindUnavailableError,
    ShutdownSignal,
)

__all__ = ["LOGIND_MANAGER", "SystemBusLogind"]

LOGIND_MANAGER = "org.freedesktop.login1.Manager"
_BUS_NAME = "org.freedesktop.DBus"
_BUS_PATH = "/org/freedesktop/DBus"


class SystemBusLogind:
    """``LogindPort`` over a real D-Bus connection (jeepney, blocking I/O).

    Every signal that arrives, also while a method call waits for its reply, goes to one queue, so none is
    lost between calls. Signals are matched on the bus (``AddMatch``) and checked again here: the bus also
    delivers signals addressed to this connection alone, whoever sent them.
    """

    def __init__(self, connection: Any, *, call_timeout_s: float = 25.0) -> None:
        self._connection = connection
        self._timeout_s = call_timeout_s
        self._signals: deque[Any] = deque()
        self._filter = connection.filter(MatchRule(type="signal"), queue=self._signals)
        self._owner: str | None = None

    @classmethod
    def connect(cls, bus: str = "SYSTEM") -> SystemBusLogind:
        """Connect to the system bus (``DBUS_SYSTEM_BUS_ADDRESS``, else /run/dbus/system_bus_socket), subscribe to
        logind's ``PrepareForShutdown`` and its name's owner changes, and find that owner."""
        try:
            connection = open_dbus_connection(bus=bus, enable_fds=True, auth_timeout=5.0)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            where = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "/run/dbus/system_bus_socket"
            raise LogindUnavailableError(
                f"cannot connect to the system bus at {where}: {exc!r}; is dbus running (systemctl status "
                "dbus.service)? The shutdown drain needs it to hear from systemd-logind"
            ) from exc
        logind = cls(connection)
        try:
            logind._subscribe()
            # A method call activates logind if it is not running yet; only then has its name an owner.
            logind.preparing_for_shutdown()
            logind._owner = logind._name_owner()
        except BaseException:
            connection.close()
            raise
        return logind

    def take_delay_lock(self, who: str, why: str) -> int:
        body = self._call(
            new_method_call(self._manager(), "Inhibit", "ssss", ("shutdown", who, why, "delay")),
            "taking a delay inhibitor lock for shutdown (org.freedesktop.login1.Manager.Inhibit)",
        )
        fd: int = body[0].to_raw_fd()
        return fd

    def preparing_for_shutdown(self) -> bool:
        return bool(self._property("PreparingForShutdown"))

    def inhibit_delay_max_s(self) -> float:
        return int(self._property("InhibitDelayMaxUSec")) / 1_000_000

    def next_event(self) -> LogindEvent:
        while True:
            while not self._signals:
                try:
                    self._connection.recv_messages(timeout=None)
                except (OSError, ValueError) as exc:
                    raise LogindUnavailableError(
                        f"lost the system bus ({exc!r}): logind's shutdown signal can no longer be heard"
                    ) from exc
            event = self._event(self._signals.popleft())
            if event is not None:
                return event

    def close(self) -> None:
        self._filter.close()
        self._connection.close()

    def _event(self, message: Any) -> LogindEvent | None:
        fields: Mapping[Any, Any] = message.header.fields
        sender = str(fields.get(HeaderFields.sender, ""))
        path = str(fields.get(HeaderFields.path, ""))
        interface = fields.get(HeaderFields.interface)
        member = fields.get(HeaderFields.member)
        body = message.body
        if (interface, member) == (_BUS_NAME, "NameOwnerChanged"):
            # Only the bus itself can send as org.freedesktop.DBus.
            if sender != _BUS_NAME or path != _BUS_PATH or len(body) != 3 or body[0] != LOGIND_NAME:
                return None
            self._owner = str(body[2]) or None
            return LogindOwnerChanged(self._owner)
        if (interface, member) != (LOGIND_MANAGER, "PrepareForShutdown"):
            return None
        if self._owner is None or sender != self._owner or path != LOGIND_PATH:
            return ForgedShutdownSignal(sender=sender, path=path)
        if len(body) != 1 or not isinstance(body[0], bool):
            return ForgedShutdownSignal(sender=sender, path=path)
        return ShutdownSignal(active=body[0])

    def _subscribe(self) -> None:
        shutdown = MatchRule(
            type="signal", sender=LOGIND_NAME, interface=LOGIND_MANAGER, member="PrepareForShutdown", path=LOGIND_PATH
        )
        owner = MatchRule(
            type="signal", sender=_BUS_NAME, interface=_BUS_NAME, member="NameOwnerChanged", path=_BUS_PATH
        )
        owner.add_arg_condition(0, LOGIND_NAME)
        for rule in (shutdown, owner):
            self._call(message_bus.AddMatch(rule), f"subscribing to {rule.serialise()}")

    def _name_owner(self) -> str:
        return str(self._call(message_bus.GetNameOwner(LOGIND_NAME), f"finding who owns {LOGIND_NAME}")[0])

    def _property(self, name: str) -> Any:
        body = self._call(Properties(self._manager()).get(name), f"reading logind's {name}")
        return body[0][1]  # a variant: (signature, value)

    def _manager(self) -> Any:
        return DBusAddress(LOGIND_PATH, bus_name=LOGIND_NAME, interface=LOGIND_MANAGER)

    def _call(self, message: Any, what: str) -> tuple[Any, ...]:
        try:
            reply = self._connection.send_and_get_reply(message, timeout=self._timeout_s)
        except TimeoutError as exc:
            raise LogindUnavailableError(f"{what}: no answer within {self._timeout_s:g} s") from exc
        except (OSError, ValueError) as exc:
            raise LogindUnavailableError(f"{what}: lost the system bus ({exc!r})") from exc
        try:
            body: tuple[Any, ...] = unwrap_msg(reply)
        except DBusErrorResponse as exc:
            raise LogindUnavailableError(
                f"{what}: {exc.name}: {' '.join(map(str, exc.data))}; is systemd-logind running (systemctl "
                "status systemd-logind.service), and does this run as root?"
            ) from exc
        return body

"""An ``EventLogger`` whose events a test reads back: ``log, events = recording_logger("name")`` (through a logger of
its own, as the agent logs), or ``log = SeenEvents()`` (no logger in between: every event, whatever its level, in
``log.seen``)."""

from __future__ import annotations

import logging
from typing import Any

from meridian_node_agent.logs import EventLogger

__all__ = ["RecordedEvents", "SeenEvents", "recording_logger"]


class RecordedEvents(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((record.getMessage(), dict(getattr(record, "fields", {}))))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.events if event == name]


def recording_logger(name: str) -> tuple[EventLogger, RecordedEvents]:
    """A logger of its own (not the agent's), every level recorded, nothing printed."""
    handler = RecordedEvents()
    logger = logging.getLogger(f"meridian-test-events.{name}")
    logger.handlers = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return EventLogger(logger), handler


class SeenEvents(EventLogger):
    """The agent's logger, keeping each event (name and fields) for the test to read."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        self.seen.append((event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.seen if name == event]

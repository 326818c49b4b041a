"""Structured logs: one JSON object per line on stderr, ``{"at", "level", "event", ...fields}``.

Events are short kebab-case names (``desired-state-rejected``), fields carry the values. A log line is for
machines first; a person reads it with ``jq``.

Fields carry what others wrote (an engine's ``last_lines``, a server's error text), so no line may carry a raw
control character to the terminal of whoever reads the journal: JSON escapes them itself (``\u001b``, and every
non-ASCII character), and the text format writes each value through ``terminal_text.escape_text``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from meridian_node_agent.terminal_text import escape_text

__all__ = ["EventLogger", "JsonFormatter", "configure_logging"]

_LOGGER = "meridian_node_agent"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            document.update(fields)
        # ensure_ascii (the default) is what keeps escape sequences out of the line: do not turn it off.
        return json.dumps(document, default=str, sort_keys=False, ensure_ascii=True)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        extra = " ".join(f"{key}={_text(value)}" for key, value in fields.items())
        return f"{record.levelname.lower()} {record.getMessage()} {extra}".rstrip()


def _text(value: Any) -> str:
    """A field's value on one line, escaped: a list or a mapping (``last_lines``) as JSON, anything else as text."""
    if isinstance(value, dict | list | tuple):
        value = json.dumps(value, default=str, ensure_ascii=False)
    return escape_text(str(value), one_line=True)


class EventLogger:
    """``log.info("cycle-done", applied=3)``: an event name and its fields."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger(_LOGGER)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, extra={"fields": fields})


def configure_logging(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Send the agent's events to ``stream`` (stderr) as JSON lines or plain text."""
    logger = logging.getLogger(_LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False

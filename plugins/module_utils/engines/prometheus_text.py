"""The Prometheus text exposition an engine serves on its metrics path, read into samples.

Hand-written on purpose: it runs inside the engine modules on managed hosts, where ``prometheus_client``
is not a dependency, and it reads one small document per drain poll. What an engine sends is a remote peer's
output, so ``tests/collection/module_utils/engines/test_prometheus_text.py`` holds it to
``prometheus_client``'s own parser on the same texts: they agree on every sample, or this refuses the text.
It refuses rather than guesses: an HTML error page or a proxy's answer is never "no requests in flight".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = ["MetricSample", "MetricsFormatError", "parse_prometheus_text"]


class MetricsFormatError(MeridianError, ValueError):
    """The metrics endpoint answered with text that is not Prometheus text exposition."""


@dataclass(frozen=True)
class MetricSample:
    name: str
    labels: Mapping[str, str]
    value: float


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def parse_prometheus_text(text: str) -> list[MetricSample]:
    """Every sample in a Prometheus text exposition; comments, blank lines and timestamps are skipped.

    Raises ``MetricsFormatError`` naming the first line that is not a sample, so that an HTML error page
    or a proxy's answer is never mistaken for "no requests in flight".
    """
    samples: list[MetricSample] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            samples.append(_parse_sample(line))
        except ValueError as exc:
            raise MetricsFormatError(f"line {number} of the metrics is not a sample ({exc}): {line[:120]!r}") from None
    return samples


def _parse_sample(line: str) -> MetricSample:
    match = _METRIC_NAME.match(line)
    if match is None:
        raise ValueError("no metric name")
    name, pos = match.group(), match.end()
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        pos = _parse_labels(line, pos + 1, labels)
    rest = line[pos:]
    if not rest[:1].isspace():
        raise ValueError("no space before the value")
    # An OpenMetrics exemplar (" # {...} v") may follow the value and timestamp.
    fields = rest.split("#", 1)[0].split()
    if not 1 <= len(fields) <= 2:
        raise ValueError("expected a value and an optional timestamp")
    return MetricSample(name=name, labels=labels, value=float(fields[0]))


def _parse_labels(line: str, pos: int, labels: dict[str, str]) -> int:
    while True:
        while pos < len(line) and line[pos] in " ,":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return pos + 1
        match = _LABEL_NAME.match(line, pos)
        if match is None:
            raise ValueError("bad label name")
        pos = match.end()
        if line[pos : pos + 2] != '="':
            raise ValueError(f"label {match.group()} has no quoted value")
        pos += 2
        value: list[str] = []
        while True:
            if pos >= len(line):
                raise ValueError("unterminated label value")
            char = line[pos]
            if char == "\\" and pos + 1 < len(line):
                value.append(_ESCAPES.get(line[pos + 1], "\\" + line[pos + 1]))
                pos += 2
            elif char == '"':
                pos += 1
                break
            else:
                value.append(char)
                pos += 1
        labels[match.group()] = "".join(value)

"""Strict checks of plain data (parsed YAML, module parameters) without pydantic.

The engine modules and the policy loader run once per Ansible task, and each task is a fresh Python
process: importing pydantic and building its models cost about 0.25 s a task, more than the rest of
the module. These few checks validate the documents those paths read — the policy file and one engine
spec — in microseconds, and phrase errors the way ``contracts.describe_validation_error`` does
(``field.path: what is wrong (got value)``), so an operator sees one style whichever path refused.

They are strict: ``1`` is not ``true`` and ``"8000"`` is not a port. Wire documents (desired state,
manifests, observations) stay pydantic models in ``contracts``, where their JSON schemas come from.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "FieldError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_list",
    "check_mapping",
    "check_str",
    "check_str_list",
    "check_str_map",
    "join",
    "short_repr",
]


class FieldError(MeridianError, ValueError):
    """One or more problems in a document, each ``where: what is wrong``."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where or '(document)'}: {problem}")
        self.where = where
        self.problem = problem


def short_repr(value: Any, limit: int = 80) -> str:
    if type(value) in (list, tuple, dict) and len(value) > limit:
        # Its repr cannot fit (each item takes a character or more); render only the items that can show,
        # which gives the same text without building the repr of a huge (perhaps hostile) document.
        value = dict(list(value.items())[:limit]) if isinstance(value, dict) else value[:limit]
        return repr(value)[: limit - 3] + "..."
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def join(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _wrong_type(value: Any, where: str, kind: str) -> FieldError:
    return FieldError(where, f"input should be a valid {kind} (got {short_repr(value)})")


def check_mapping(
    value: Any, where: str, *, required: Collection[str] = (), optional: Collection[str] = ()
) -> Mapping[str, Any]:
    """A mapping with string keys, every required key present and no key outside required + optional.

    Missing and unknown keys are reported together: ``controll:`` is more quickly fixed when the message
    names both the missing ``control`` and the unknown ``controll``.
    """
    if not isinstance(value, Mapping):
        raise _wrong_type(value, where, "dictionary")
    problems = [(join(where, key), "a required field is missing") for key in required if key not in value]
    known = set(required) | set(optional)
    problems += [
        (join(where, str(key)), f"unknown field (got {short_repr(item)})")
        for key, item in value.items()
        if key not in known
    ]
    if problems:
        (first_where, first_problem), *others = problems
        raise FieldError(first_where, "; ".join([first_problem, *(f"{at}: {problem}" for at, problem in others)]))
    return value


def check_int(value: Any, where: str, *, ge: int | None = None, le: int | None = None) -> int:
    # bool is an int to Python, but `port: true` is a mistake, not port 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(value, where, "integer")
    if ge is not None and value < ge:
        raise FieldError(where, f"must be >= {ge} (got {value})")
    if le is not None and value > le:
        raise FieldError(where, f"must be <= {le} (got {value})")
    return value


def check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(value, where, "boolean")
    return value


def check_str(value: Any, where: str, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
    """A string, matching ``pattern`` when given; ``what`` says in words what the pattern wants."""
    if not isinstance(value, str):
        raise _wrong_type(value, where, "string")
    if pattern is not None and not pattern.match(value):
        wanted = what or f"match pattern {pattern.pattern!r}"
        raise FieldError(where, f"must be {wanted} (got {short_repr(value)})")
    return value


def check_choice(value: Any, where: str, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise FieldError(where, f"must be one of {', '.join(choices)} (got {short_repr(value)})")
    return value


def check_list(value: Any, where: str, *, min_items: int = 0, max_items: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise _wrong_type(value, where, "list")
    if len(value) < min_items:
        noun = "item" if min_items == 1 else "items"
        raise FieldError(where, f"list should have at least {min_items} {noun} (got {short_repr(value)})")
    if max_items is not None and len(value) > max_items:
        noun = "item" if max_items == 1 else "items"
        raise FieldError(where, f"list should have at most {max_items} {noun} (got {short_repr(value)})")
    return value


def check_str_list(value: Any, where: str, *, min_items: int = 0) -> tuple[str, ...]:
    items = check_list(value, where, min_items=min_items)
    return tuple(check_str(item, join(where, index)) for index, item in enumerate(items))


def check_str_map(value: Any, where: str) -> dict[str, str]:
    """A mapping of strings to strings (an environment); values are not echoed, they may be secrets."""
    if not isinstance(value, Mapping):
        raise _wrong_type(value, where, "dictionary")
    for key, item in value.items():
        if not isinstance(key, str):
            raise FieldError(where, f"keys must be strings (got {short_repr(key)})")
        if not isinstance(item, str):
            raise FieldError(join(where, key), f"input should be a valid string (got a {type(item).__name__})")
    return dict(value)

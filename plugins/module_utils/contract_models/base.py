"""What every contract model shares: the one ``StrictModel`` base, pydantic (or its stub where it is missing),
the one timestamp form, the field types several documents use, and pydantic's errors in one line.

The one place the contracts import pydantic: a host without it can still import them (``require_pydantic``
says what to install before anything is validated).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

from ansible_collections.meridian.node.plugins.module_utils._compat import UTC
from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import DRIVERS, NAME_PATTERN

try:
    from pydantic import (
        AfterValidator,
        AwareDatetime,
        BaseModel,
        BeforeValidator,
        ConfigDict,
        Field,
        PlainSerializer,
        ValidationError,
        WithJsonSchema,
        model_validator,
    )
except ImportError:
    PYDANTIC_IMPORT_ERROR: str | None = traceback.format_exc()
    from ansible_collections.meridian.node.plugins.module_utils._pydantic_stub import (  # type: ignore[assignment,no-redef]
        AfterValidator,
        AwareDatetime,
        BaseModel,
        ConfigDict,
        Field,
        PlainSerializer,
        ValidationError,
        model_validator,
    )

    # Markers only, like the rest of the stub: nothing validates without pydantic.
    BeforeValidator = WithJsonSchema = AfterValidator  # type: ignore[misc,assignment]
else:
    PYDANTIC_IMPORT_ERROR = None

API_VERSION = "meridian.node/v1"

# The engines there is a driver for, written once in engine_rules.DRIVERS (which the engine modules' own spec
# check and the host policy read too). A Literal of them, in their order, is what the schemas list.
if TYPE_CHECKING:
    Driver = str
else:
    Driver = Literal[DRIVERS]

__all__ = [
    "API_VERSION",
    "INT64_MAX",
    "PYDANTIC_IMPORT_ERROR",
    "RFC3339_UTC_PATTERN",
    "AfterValidator",
    "AwareDatetime",
    "BaseModel",
    "BeforeValidator",
    "ConfigDict",
    "Driver",
    "Field",
    "FormatOne",
    "KeyId",
    "Name",
    "NodeId",
    "PlainSerializer",
    "RelativePath",
    "Sha256Hex",
    "StrictModel",
    "UtcTimestamp",
    "ValidationError",
    "Version",
    "WithJsonSchema",
    "describe_validation_error",
    "format_rfc3339",
    "model_validator",
    "parse_rfc3339",
    "refuse_file_and_directory",
    "require_pydantic",
]


def require_pydantic() -> None:
    """Raise a clear error where the contracts are used on a host without pydantic."""
    if PYDANTIC_IMPORT_ERROR is not None:
        raise RuntimeError(
            "meridian.node needs the Python package 'pydantic' (>= 2.6) on this host; install it "
            "(pip install 'pydantic>=2.6') or install the meridian-node package, which depends on it."
        )


def format_rfc3339(value: datetime) -> str:
    """UTC, second precision unless there are microseconds, with a ``Z``: the only form we emit."""
    utc = value.astimezone(UTC)
    text = utc.isoformat(timespec="microseconds" if utc.microsecond else "seconds")
    return text.replace("+00:00", "Z")


def _require_utc(value: datetime) -> datetime:
    if value.utcoffset() != timedelta(0):
        raise ValueError(f"timestamp must be in UTC (offset Z or +00:00), got offset {value.utcoffset()}")
    return value.astimezone(UTC)


# The one spelling of a time on the wire: RFC 3339 ``date-time`` with an upper-case ``T``, seconds, at
# most six fractional digits (Python's precision: a seventh digit would be dropped by us and kept by
# another reader) and an offset. pydantic's own parser also takes a space for ``T``, lower case, no
# seconds, a bare Unix number and a number inside a string; none of those is accepted here.
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,6}))?"
    r"(Z|([+-])([0-9]{2}):([0-9]{2}))"
)
# The same in the JSON Schema, with the offset narrowed to UTC as the validator narrows it.
RFC3339_UTC_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-]00:00)$"
_TIMESTAMP_FORM = "an RFC 3339 timestamp in UTC such as 2025-06-01T12:00:00Z"


def parse_rfc3339(value: str) -> datetime:
    """An aware datetime from the one timestamp form contracts accept; ``ValueError`` saying why not."""
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise ValueError(
            f"must be {_TIMESTAMP_FORM} (upper-case T and Z, with seconds, at most 6 fractional digits) "
            f"(got {short_repr(value)})"
        )
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    fraction, zone, sign, offset_hours, offset_minutes = match.groups()[6:]
    tz = UTC
    if zone != "Z":
        if int(offset_hours) > 23 or int(offset_minutes) > 59:
            raise ValueError(f"must be {_TIMESTAMP_FORM}: offset {zone!r} is out of range (got {short_repr(value)})")
        offset = timedelta(hours=int(offset_hours), minutes=int(offset_minutes))
        tz = timezone(-offset if sign == "-" else offset)
    microsecond = int(fraction.ljust(6, "0")) if fraction else 0
    try:
        return datetime(year, month, day, hour, minute, second, microsecond, tzinfo=tz)
    except ValueError as exc:
        raise ValueError(f"must be {_TIMESTAMP_FORM}: {exc} (got {short_repr(value)})") from None


def _timestamp_input(value: Any) -> Any:
    # A datetime is what Python callers building a document pass (``model_validate`` of a dict); JSON
    # can only carry the string.
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        return parse_rfc3339(value)
    raise ValueError(f"must be {_TIMESTAMP_FORM} (got {short_repr(value)}): a time is a string, never a number")


# An RFC 3339 timestamp in UTC. Offsets other than zero are refused rather than converted: a control
# plane that sends local times has a bug worth hearing about.
UtcTimestamp = Annotated[
    AwareDatetime,
    BeforeValidator(_timestamp_input),
    AfterValidator(_require_utc),
    PlainSerializer(format_rfc3339, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time", "pattern": RFC3339_UTC_PATTERN}),
]

NodeId = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
        description="DNS-label-like node name: lowercase letters, digits, '.', '-'",
    ),
]
Name = Annotated[
    str,
    Field(pattern=NAME_PATTERN, description="lowercase name, 1-63 characters"),
]


def _not_reserved_version(value: str) -> str:
    if value == "current":
        raise ValueError("version 'current' is reserved: the artifact store uses it for the promoted version")
    return value


Version = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$"), AfterValidator(_not_reserved_version)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex sha256")]
KeyId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 of the raw public key")]


def describe_validation_error(exc: ValidationError, limit: int = 3) -> str:
    """pydantic's report as one line of ``field.path: what is wrong (got value)``; the first few errors."""
    errors = exc.errors(include_url=False)
    parts = [_describe_one(error) for error in errors[:limit]]
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more error(s)")
    return "; ".join(parts)


def _describe_one(error: Any) -> str:
    where = _location(error.get("loc", ()))
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    got = error.get("input")
    if kind == "missing":
        return f"{where}: a required field is missing"
    if kind == "extra_forbidden":
        return f"{where}: unknown field (got {short_repr(got)})"
    bound = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }.get(kind)
    if bound:
        message = f"must be {bound[0]} {ctx.get(bound[1])}"
    elif kind == "value_error":
        # Our validators already phrase the problem, value included.
        return f"{where}: {error.get('ctx', {}).get('error', error.get('msg'))}"
    else:
        message = str(error.get("msg", "invalid value"))
        message = message[0].lower() + message[1:] if message else "invalid value"
    return f"{where}: {message} (got {short_repr(got)})"


def _location(loc: Any) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(document)"


# pydantic evaluates the models' annotations (in every file of this package) at run time, on the host's Python:
# 3.9 has no ``X | None`` there, so the models spell ``Optional``/``Union`` (ruff keeps them: pyproject.toml,
# ``keep-runtime-typing``).


class StrictModel(BaseModel):
    """The one base of every wire model, here and in the agent: unknown fields refused, frozen, no coercion."""

    # defer_build: a module that imports the contracts but validates one kind (or none) should not pay
    # for building every schema at import; each model builds on first use.
    # strict: no coercion, in JSON and in Python (see contracts.py's docstring).
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False, defer_build=True, strict=True)


def _relative_store_path(value: str) -> str:
    """A manifest path must stay inside the artifact's directory, whatever the filesystem does."""
    if not value or value.startswith("/") or "\\" in value or "\x00" in value:
        raise ValueError(f"path {value!r} must be relative, use '/' separators and contain no NUL")
    parts = value.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"path {value!r} must not contain empty, '.' or '..' components")
    return value


RelativePath = Annotated[str, AfterValidator(_relative_store_path)]


def refuse_file_and_directory(seen: Mapping[str, str]) -> None:
    """Refuse a listing in which one path is the directory of another (``a`` and ``a/b``): ``seen`` maps each
    path's folded form (the form two paths that name one file share) to the path as listed."""
    prefixes = {key.rsplit("/", i)[0] for key in seen for i in range(1, key.count("/") + 1)}
    clash = sorted(prefixes & seen.keys())
    if clash:
        raise ValueError(f"path {seen[clash[0]]!r} is both a file and a directory")


# Counters and sizes in signed documents fit a signed 64-bit integer: every reader (SQLite, Go, Java, a
# JSON parser that maps to int64) sees the same number, and nothing downstream overflows on a huge one.
INT64_MAX = 2**63 - 1


def _exact_integer(value: Any) -> Any:
    # pydantic matches a Literal by equality, strict or not: 1.0 and True would pass as 1 (and the schema,
    # whose integers exclude booleans, would refuse True): the same signed bytes read two ways.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer written without a fraction or exponent (got {short_repr(value)})")
    return value


# A document format number: exactly the integer 1 (not 1.0, not true), for every versioned file on either side.
FormatOne = Annotated[Literal[1], BeforeValidator(_exact_integer)]

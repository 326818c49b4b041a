"""Reading the host's own YAML files (policy, agent config) strictly.

Duplicate keys are refused instead of silently keeping the last one (in a policy, the last of two
``trust:`` sections would win unseen), files are size-capped (a multi-megabyte policy is a mistake or a
YAML bomb), and every problem comes back as one ``YamlFileError`` whose message names the file and,
for syntax errors, the line and column.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedReadError,
    CappedReadReason,
    read_capped,
)

try:
    import yaml
except ImportError:
    YAML_IMPORT_ERROR: str | None = traceback.format_exc()
else:
    YAML_IMPORT_ERROR = None

__all__ = [
    "DEFAULT_MAX_BYTES",
    "YAML_IMPORT_ERROR",
    "MissingLibraryError",
    "YamlFileError",
    "parse_yaml",
    "read_text_file",
]

DEFAULT_MAX_BYTES = 1024 * 1024


class YamlFileError(MeridianError, ValueError):
    """The file cannot be read or is not valid YAML; the message says which and where."""


def read_text_file(path: os.PathLike[str] | str, *, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The UTF-8 text of a small file; ``what`` (e.g. ``policy /etc/meridian/policy.yaml``) starts messages.

    A symlink is followed: these are files an operator names (a policy, the agent's config), and a site may
    manage them as links. A FIFO or a directory is refused, without blocking.
    """
    try:
        raw = read_capped(path, max_bytes, what=what, nofollow=False)
    except CappedReadError as exc:
        if exc.reason is CappedReadReason.TOO_LARGE:
            raise YamlFileError(f"{what}: the file is larger than {max_bytes} bytes") from exc
        reason = os.strerror(exc.errno) if exc.errno is not None else exc.detail
        raise YamlFileError(f"{what}: cannot read the file: {reason}") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlFileError(f"{what}: the file is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


class MissingLibraryError(MeridianError):
    """A Python package this host needs is not installed; modules report it with ``missing_required_lib``
    before they read anything (``trust.verify.missing_libraries``)."""


def parse_yaml(text: str, *, what: str) -> Any:
    """Parse YAML with a safe loader that refuses duplicate keys."""
    if YAML_IMPORT_ERROR is not None:
        raise MissingLibraryError(
            "meridian.node needs the Python package 'PyYAML' on this host; install it (pip install PyYAML) "
            "or install the meridian-node package, which depends on it."
        )
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except yaml.YAMLError as exc:
        raise YamlFileError(f"{what}: not valid YAML: {_yaml_reason(exc)}") from exc


def _yaml_reason(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(problem)


if YAML_IMPORT_ERROR is None:

    class _StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _value_node in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

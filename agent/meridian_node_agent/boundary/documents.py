"""Reading the small JSON documents one side leaves for the other: capped, never through a symlink, absent until
the writer first writes them.

Runs on: both sides: the agent reads what root's units publish in ``public/`` (the apply answer, the engines file,
the air-gap outcomes, the kept engine logs), and root reads its own; each format's module parses what is read
here into its own type and raises its own error, which every failure here is reported as.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    read_capped,
)

__all__ = ["json_object", "read_if_present"]


def read_if_present(path: Path, max_bytes: int, *, what: str, error: Callable[[str], Exception]) -> bytes | None:
    """The bytes of ``path``, or None while it does not exist; ``error`` with ``read_capped``'s reason (a symlink,
    not a regular file, larger than ``max_bytes``) otherwise. What an absent file means is the caller's to say."""
    try:
        return read_capped(path, max_bytes, what=what)
    except CappedFileMissingError:
        return None
    except CappedReadError as exc:
        raise error(str(exc)) from exc


def json_object(raw: bytes, path: Path, *, error: Callable[[str], Exception], then: str = "") -> dict[str, Any]:
    """``raw`` (read from ``path``) as a JSON object; ``error`` naming the path when it is not JSON or not an
    object, followed by ``then`` (what happens next, such as "; the next observe run rewrites it")."""
    try:
        document: Any = json.loads(raw)
    except ValueError as exc:
        raise error(f"{path} is not JSON: {exc}{then}") from exc
    if not isinstance(document, dict):
        raise error(f"{path}: the document must be an object{then}")
    return document

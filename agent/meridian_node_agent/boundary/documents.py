"""Parsing the small JSON documents one side leaves for the other, once read (``_fileutil.read_if_present``:
capped, never through a symlink, absent until the writer first writes them).

Runs on: both sides: the agent reads what root's units publish in ``public/`` (the engines file, the kept engine
logs), and root reads its own; each format's module turns the object into its own type and raises its own error,
which every failure here is reported as.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["json_object"]


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

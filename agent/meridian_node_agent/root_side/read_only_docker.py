"""A Docker client for root's listings that refuses every call but ``GET``/``HEAD``, before it connects.

Runs on: the root side only. Root's observe unit (``root_side.observe_unit``), the apply unit's listing while
an apply runs (``root_side.apply_unit.LiveInventory``) and the shutdown drain list what runs through it, so
that a mistake anywhere under them (the engine discovery, a future listing) cannot change an engine.
"""

from __future__ import annotations

from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine

__all__ = ["ReadOnlyDockerApi", "connect_read_only"]

# The only methods that read: everything else the Engine API has creates, changes or removes something.
_READING = frozenset({"GET", "HEAD"})


class ReadOnlyDockerApi(DockerApi):
    """A ``DockerApi`` that refuses every call but ``GET``/``HEAD``, before connecting: what the observe unit
    uses, so that a mistake anywhere under it cannot change an engine."""

    def _request(self, method: str, path: str, action: str, **kwargs: Any) -> Any:
        if method.upper() not in _READING:
            raise DockerApiError(
                f"refused {method} {path}: root's listings only read the Docker Engine; changes go through "
                "the apply unit (meridian-node apply-spooled)",
                action=action,
            )
        return super()._request(method, path, action, **kwargs)


def connect_read_only(timeout_s: int = 30) -> DockerEngine:
    """The local Docker Engine through ``ReadOnlyDockerApi`` (DOCKER_HOST, or the local socket)."""
    return DockerEngine.from_env(timeout_s, api_class=ReadOnlyDockerApi, who="root")

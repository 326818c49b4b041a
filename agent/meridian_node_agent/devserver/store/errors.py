"""What the devserver's store refuses, and why it cannot open: the store's errors, importable without SQLAlchemy.

They live apart from ``database.py`` so that the devserver's command line can name the missing ``devserver`` extra
instead of failing on an import (``database.py`` re-exports them; import them from there).
"""

from __future__ import annotations

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = ["DatabaseUnavailable", "StoreConflict", "UnknownNode"]


class UnknownNode(MeridianError, LookupError):
    """No node by that id: never enrolled and nothing published for it."""


class StoreConflict(MeridianError):
    """A write refused because of what is stored: a used token, a stale epoch. ``reason`` is a short code.

    ``detail`` goes back to the caller; ``server_note``, when set, is for the server's log only and may
    name what an unauthenticated caller must not learn (such as the node a token is bound to).
    """

    def __init__(self, reason: str, detail: str, *, server_note: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.server_note = server_note


class DatabaseUnavailable(MeridianError):
    """The database cannot be used: a URL of a kind the devserver does not speak, a server that does not answer,
    or the ``devserver`` extra (SQLAlchemy, Alembic, psycopg) not installed. The message says which and what to do.
    """

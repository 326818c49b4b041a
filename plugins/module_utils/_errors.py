"""The one root of meridian.node's errors, in the collection and in the agent.

``str(error)`` is for people: what was wrong, with the value, and what to do. Programs read the fields the
subclasses that have them carry: ``check`` (the policy or host check that refused, in modules' results as
``check=``), ``code``/``reason`` (a verifier's or reader's reason, ``rejection=``). Every exception
class in ``plugins/`` and ``agent/`` derives from it (tests/architecture/test_house_rules.py), so a caller
that means "anything meridian.node refused" catches one class, and a shell never needs ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MeridianError", "ResultError"]


class MeridianError(Exception):
    """Something meridian.node refused or could not do; the message says what and how to fix it."""


class ResultError(MeridianError):
    """A module's run that failed part-way: ``result`` is what it returns beside ``msg`` (what was done so far),
    ``check`` the host or policy check that refused, where one did."""

    def __init__(self, message: str, result: Mapping[str, Any] | None = None, *, check: str | None = None) -> None:
        super().__init__(message)
        self.result = dict(result or {})
        self.check = check

    def failure(self) -> dict[str, Any]:
        """The module's failed result: what was done so far, ``failed``, ``msg``, and ``check`` where set."""
        failed = {**self.result, "failed": True, "msg": str(self)}
        if self.check is not None:
            failed["check"] = self.check
        return failed

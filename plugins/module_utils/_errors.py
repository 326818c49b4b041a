"""The one root of meridian.node's errors, in the collection and in the agent.

``str(error)`` is for people: what was wrong, with the value, and what to do. Programs read the fields the
subclasses that have them carry: ``check`` (the policy or host check that refused, in modules' results as
``check=``), ``code``/``reason`` (a verifier's or reader's reason, ``rejection=``). Every exception
class in ``plugins/`` and ``agent/`` derives from it (tests/architecture/test_house_rules.py), so a caller
that means "anything meridian.node refused" catches one class, and a shell never needs ``RuntimeError``.
"""

from __future__ import annotations

__all__ = ["MeridianError"]


class MeridianError(Exception):
    """Something meridian.node refused or could not do; the message says what and how to fix it."""

"""``__all__`` tells the truth: the check httpx makes in tests/test_exported_members.py, for our modules.

A module's ``__all__`` must name exactly its public API: every public name the module defines at its top level
(a function, a class, a constant; also inside a top-level ``try``/``if``), and, where the module is the face of
a sibling, the names it imports from another meridian.node module and lists on purpose, each of which that
module exports as well. A public definition left out of ``__all__``, a listed name that does not exist, or a
re-export of something its home module keeps private fails the test, naming the module and the names.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterator
from types import ModuleType

__all__ = ["assert_all_is_the_public_api"]

_OURS = "ansible_collections.meridian.node."


def _top_level(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    # Module level only: into try/if/with blocks (an optional import's fallback), never into a def or class.
    for statement in statements:
        yield statement
        if isinstance(statement, (ast.If, ast.With)):
            yield from _top_level(statement.body)
            yield from _top_level(getattr(statement, "orelse", []))
        elif isinstance(statement, ast.Try):
            for block in (statement.body, statement.orelse, statement.finalbody):
                yield from _top_level(block)
            for handler in statement.handlers:
                yield from _top_level(handler.body)


def _names(module: ModuleType) -> tuple[set[str], dict[str, str]]:
    """The names ``module`` defines at its top level, and those it imports with the module each comes from."""
    defined: set[str] = set()
    imported: dict[str, str] = {}
    for statement in _top_level(ast.parse(inspect.getsource(module)).body):
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(statement.name)
        elif isinstance(statement, ast.Assign):
            defined.update(target.id for target in statement.targets if isinstance(target, ast.Name))
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            defined.add(statement.target.id)
        elif isinstance(statement, ast.ImportFrom) and statement.module is not None:
            for alias in statement.names:
                imported[alias.asname or alias.name] = statement.module
    return defined - {"__all__"}, imported


def assert_all_is_the_public_api(module: ModuleType) -> None:
    """Fail unless ``module.__all__`` lists each public name ``module`` defines, and only names that exist and
    are either defined there or re-exported from another meridian.node module that exports them too."""
    listed: list[str] = list(module.__all__)
    assert len(listed) == len(set(listed)), f"{module.__name__}.__all__ names something twice: {sorted(listed)}"
    defined, imported = _names(module)
    left_out = sorted(name for name in defined - set(listed) if not name.startswith("_"))
    assert not left_out, f"{module.__name__} defines {left_out} but leaves them out of __all__ (or make them _private)"
    for name in listed:
        assert hasattr(module, name), f"{module.__name__}.__all__ lists {name!r}, which the module lacks"
        if name in defined:
            continue
        home = imported.get(name)
        assert home is not None and home.startswith(_OURS), (
            f"{module.__name__}.__all__ lists {name!r}, which it neither defines nor re-exports from meridian.node"
        )
        assert name in getattr(sys.modules[home], "__all__", ()), (
            f"{module.__name__} re-exports {name!r}, which its home module {home} does not export"
        )

"""``meridian-node-devserver`` imports what the verb being run needs and no more: ``--help`` lists every verb from
the table in ``devserver/cli/__init__.py`` without importing any verb's module (no control plane, no database, no
web stack), and a verb imports its own family's module only."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from meridian_node_agent.devserver import cli

PACKAGE = "meridian_node_agent.devserver"
# What none of the verbs' modules may cost `--help`.
HEAVY = ("sqlalchemy", "alembic", "cryptography", "pydantic", "yaml", "fastapi", "uvicorn")


def _loaded_by(code: str) -> tuple[list[str], list[str]]:
    """The devserver's modules and the HEAVY packages a fresh interpreter holds after running ``code``."""
    report = (
        "import json, sys\n"
        f"print(json.dumps([sorted(m for m in sys.modules if m.startswith('{PACKAGE}.')), "
        f"sorted(p for p in {HEAVY!r} if p in sys.modules)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True, check=True)
    modules, heavy = json.loads(done.stdout.splitlines()[-1])
    return modules, heavy


def test_every_verb_is_listed_and_defined_by_the_module_the_table_names() -> None:
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(subparsers.choices) == list(cli.VERB_MODULES)
    for verb, (module, _summary) in cli.VERB_MODULES.items():
        assert verb in importlib.import_module(f"{PACKAGE}.cli.{module}").DEFINE, f"{module} does not define {verb}"
        assert subparsers.choices[verb].get_default("handler") is not None, f"{verb} has no handler"


def test_help_imports_no_verb_module() -> None:
    modules, heavy = _loaded_by(
        "from meridian_node_agent.devserver.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    )
    assert modules == [f"{PACKAGE}.cli", f"{PACKAGE}.cli.common", f"{PACKAGE}.store", f"{PACKAGE}.store.errors"]
    assert heavy == []


@pytest.mark.parametrize("module", sorted({module for module, _summary in cli.VERB_MODULES.values()}))
def test_a_verb_imports_its_own_module_only(module: str) -> None:
    verb = next(verb for verb, (owner, _summary) in cli.VERB_MODULES.items() if owner == module)
    modules, _heavy = _loaded_by(f"from meridian_node_agent.devserver import cli\ncli.build_parser([{verb!r}])\n")
    assert sorted(name for name in modules if name.startswith(f"{PACKAGE}.cli")) == [
        f"{PACKAGE}.cli",
        f"{PACKAGE}.cli.common",
        f"{PACKAGE}.cli.{module}",
    ]
    if module != "serve":
        assert not any(name.startswith(f"{PACKAGE}.serving") for name in modules), modules


@pytest.mark.parametrize(
    ("argv", "verb"),
    [
        (["serve", "--port", "0"], "serve"),
        (["--foo", "nodes"], "nodes"),
        (["--help"], None),
        ([], None),
    ],
)
def test_the_verb_is_found_before_parsing(argv: list[str], verb: str | None) -> None:
    assert cli.verb_of(argv) == verb

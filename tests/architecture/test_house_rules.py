"""The house's rules (docs/ARCHITECTURE.md, "The import rules"), checked with plain ``ast`` over the source.

Each rule is a function from the parsed tree to a list of violations (file, line, what is wrong), so
``test_a_planted_violation_is_caught`` can plant one violation of each in a copy of the tree and see it named.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MU = "ansible_collections.meridian.node.plugins.module_utils"
AGENT = "meridian_node_agent"
# What each room of the agent may import besides the standard library, third-party packages and module_utils;
# "" is the package's own __init__ (its version), which every room may read.
AGENT_MAY_IMPORT = {
    "boundary": ("", "boundary"),
    "apply": ("", "apply", "boundary", "errors", "logs"),
    "agent_side": ("", "agent_side", "boundary", "apply", "config", "errors", "logs"),
    "root_side": ("", "root_side", "boundary", "apply", "config", "errors", "logs"),
    "devserver": ("", "devserver", "boundary", "errors"),
}
# The devserver's rooms, each with the rooms it may import (its own among them): the store knows no control plane,
# the control plane no server, and nothing imports the command line. Its package's __init__ imports none.
DEVSERVER = f"{AGENT}.devserver"
DEVSERVER_MAY_IMPORT = {
    "": (),
    "store": ("store",),
    "control": ("store", "control"),
    "serving": ("store", "control", "serving"),
    "cli": ("store", "control", "serving", "cli"),
}
LOW_ROOMS = ("trust", "gpu", "docker")  # module_utils rooms that never reach into engines/ or artifacts/
RUNS_ON = {"agent_side": "the agent side", "root_side": "the root side", "boundary": "both sides"}
# What a module shell may import besides one module_utils file named *_args (its ARGUMENT_SPEC and outcome).
SHELL_MAY_IMPORT = ("__future__", "ansible.module_utils.basic", f"{MU}._module")
SHELL_RULE = "a module shell imports only ansible.module_utils.basic, _module, one *_args file and its *_outcome"
# One engine's phases live once in engines/converge/; engines/instance.py (one engine) and engines/set.py (a set,
# with set_run.py, its module's run around it) only order them: neither side reaches into the other, and
# converge/ into neither.
CONVERGE = f"{MU}.engines.converge"
ORDERERS = {
    f"{MU}.engines.instance": "instance",
    f"{MU}.engines.set": "set",
    f"{MU}.engines.set_run": "set",
}


@dataclass
class Source:
    path: Path  # relative to the tree's root
    module: str
    tree: ast.Module
    imports: list[tuple[int, str]] = field(default_factory=list)


Rule = Callable[[dict[str, Source]], list[str]]


def _module_name(path: Path) -> str | None:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] == "plugins" and parts[1] in ("module_utils", "modules", "action"):
        return ".".join(["ansible_collections", "meridian", "node", *parts])
    return ".".join(parts[1:]) if parts[:2] == ["agent", AGENT] else None


@functools.cache
def _parse(text: str, name: str) -> ast.Module:
    return ast.parse(text, name)  # copies of the tree share their unchanged files' parse


def _imports(tree: ast.Module, package: str) -> Iterable[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def load(root: Path) -> dict[str, Source]:
    sources: dict[str, Source] = {}
    for path in sorted([*root.glob("plugins/**/*.py"), *root.glob(f"agent/{AGENT}/**/*.py")]):
        relative = path.relative_to(root)
        module = _module_name(relative)
        if module is None:
            continue
        tree = _parse(path.read_text(encoding="utf-8"), str(relative))
        package = module if relative.name == "__init__.py" else module.rpartition(".")[0]
        sources[module] = Source(relative, module, tree, list(_imports(tree, package)))
    return sources


def _ours(sources: dict[str, Source], name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name in one) refers to, or None."""
    while name and name not in sources:
        name = name.rpartition(".")[0]
    return name or None


def _room(module: str) -> tuple[str, str]:
    """("mu", "engines"), ("agent", "agent_side"), ("plugins", "modules"): which side and which room."""
    if module.startswith(MU + "."):
        rest = module[len(MU) + 1 :].split(".")
        return "mu", rest[0] if len(rest) > 1 else ""
    if module.startswith("ansible_collections."):
        return "plugins", module.split(".")[4]
    parts = module.split(".")
    return "agent", parts[1] if len(parts) > 1 else ""


def edges(sources: dict[str, Source]) -> Iterable[tuple[Source, int, str]]:
    """Each import of one of our modules by another, once per (importer, line, imported)."""
    seen: set[tuple[str, int, str]] = set()
    for source in sources.values():
        for line, name in source.imports:
            target = _ours(sources, name)
            if target is not None and target != source.module and (source.module, line, target) not in seen:
                seen.add((source.module, line, target))
                yield source, line, target


def rule_plugins_never_import_the_agent(sources: dict[str, Source]) -> list[str]:
    return [
        f"{source.path}:{line}: plugins/ imports the agent ({name})"
        for source in sources.values()
        if source.path.parts[0] == "plugins"
        for line, name in source.imports
        if name.split(".")[0] == AGENT
    ]


def rule_agent_rooms(sources: dict[str, Source]) -> list[str]:
    found = []
    for source, line, target in edges(sources):
        (side, room), (target_side, target_room) = _room(source.module), _room(target)
        if side != "agent" or target_side != "agent" or room == target_room:
            continue
        if target_room in ("cli", "dev"):
            found.append(f"{source.path}:{line}: imports {target}: nothing imports cli/ or dev/")
        elif room in AGENT_MAY_IMPORT and target_room not in AGENT_MAY_IMPORT[room]:
            found.append(f"{source.path}:{line}: {room}/ imports {target}, and {target_room}/ is not its to import")
    return found


def _devserver_room(module: str) -> str | None:
    """The devserver room ``module`` is in ("" for the package itself), or None outside the devserver."""
    if module != DEVSERVER and not module.startswith(DEVSERVER + "."):
        return None
    return module[len(DEVSERVER) + 1 :].partition(".")[0]


def rule_devserver_rooms(sources: dict[str, Source]) -> list[str]:
    """store/ imports only store/, control/ adds store/, serving/ adds control/; nothing imports cli/; every file of
    the devserver's is in one of those rooms."""
    rooms = ", ".join(f"{room}/" for room in DEVSERVER_MAY_IMPORT if room)
    found = [
        f"{source.path}: the devserver's files live in its rooms ({rooms})"
        for source in sources.values()
        if _devserver_room(source.module) not in (None, *DEVSERVER_MAY_IMPORT)
    ]
    for source, line, target in edges(sources):
        room, target_room = _devserver_room(source.module), _devserver_room(target)
        if room not in DEVSERVER_MAY_IMPORT or target_room is None or room == target_room:
            continue
        if target_room == "cli":
            found.append(f"{source.path}:{line}: imports {target}: nothing imports the devserver's cli/")
        elif target_room not in DEVSERVER_MAY_IMPORT[room]:
            found.append(f"{source.path}:{line}: the devserver's {room}/ imports {target}; {target_room}/ is above it")
    return found


def rule_module_utils_rooms(sources: dict[str, Source]) -> list[str]:
    found = []
    for source, line, target in edges(sources):
        (side, room), (target_side, target_room) = _room(source.module), _room(target)
        if side != "mu" or target_side != "mu":
            continue
        if room in LOW_ROOMS and target_room in ("engines", "artifacts"):
            found.append(f"{source.path}:{line}: {room}/ imports {target}: it never reaches into {target_room}/")
        elif (
            room == "engines"
            and target_room == "artifacts"
            and not target.endswith(".artifacts.layout")
            # A module's *_args file is its composition root: it hands the store's checks to engines/.
            and not source.module.endswith("_args")
        ):
            found.append(f"{source.path}:{line}: engines/ imports {target}: it takes only artifacts/layout")
    return found


def rule_one_converge(sources: dict[str, Source]) -> list[str]:
    """``engines/instance.py`` and ``engines/set.py`` (with ``set_run.py``) never import each other;
    ``engines/converge/`` imports neither."""
    found = []
    for source, line, target in edges(sources):
        if target not in ORDERERS:
            continue
        if source.module in ORDERERS and ORDERERS[source.module] != ORDERERS[target]:
            found.append(f"{source.path}:{line}: imports {target}: instance.py and set.py only share converge/")
        elif source.module == CONVERGE or source.module.startswith(CONVERGE + "."):
            found.append(f"{source.path}:{line}: converge/ imports {target}: it imports neither instance nor set")
    return found


def rule_module_shells(sources: dict[str, Source]) -> list[str]:
    """A module imports only ``__future__``, ``ansible.module_utils.basic``, ``_module`` and exactly one
    ``*_args`` file of module_utils, and from that file exactly one ``*_outcome`` function."""
    found = []
    for source in sources.values():
        if source.path.parts[:2] != ("plugins", "modules") or source.path.name == "__init__.py":
            continue
        args_files, outcomes = set(), []
        for node in ast.walk(source.tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in SHELL_MAY_IMPORT:
                continue
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_args_file(node.module or ""):
                args_files.add(node.module or "")
                outcomes += [alias.name for alias in node.names if alias.name.endswith("_outcome")]
                continue
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            found += [f"{source.path}:{node.lineno}: imports {name}: {SHELL_RULE}" for name in names]
        if len(args_files) != 1 or len(outcomes) != 1:
            files = ", ".join(sorted(args_files)) or "none"
            found.append(f"{source.path}: {SHELL_RULE} (_args files: {files}; outcome functions: {outcomes})")
    return found


def _is_args_file(module: str) -> bool:
    return module.startswith(MU + ".") and module.rpartition(".")[2].endswith("_args")


def _classes(sources: dict[str, Source]) -> Iterable[tuple[Source, ast.ClassDef]]:
    for source in sources.values():
        yield from ((source, node) for node in ast.walk(source.tree) if isinstance(node, ast.ClassDef))


def rule_unique_class_names(sources: dict[str, Source]) -> list[str]:
    defined: dict[str, list[str]] = defaultdict(list)
    for source, node in _classes(sources):
        defined[node.name].append(f"{source.path}:{node.lineno}")
    return [f"class {name} is defined {len(at)} times: {', '.join(at)}" for name, at in defined.items() if len(at) > 1]


def rule_one_error_root(sources: dict[str, Source]) -> list[str]:
    bases = {node.name: [ast.unparse(b).rpartition(".")[2] for b in node.bases] for _s, node in _classes(sources)}
    places = {node.name: f"{source.path}:{node.lineno}" for source, node in _classes(sources)}

    def reaches(name: str, goals: set[str], seen: frozenset[str] = frozenset()) -> bool:
        return any(b in goals or (b not in seen and reaches(b, goals, seen | {b})) for b in bases.get(name, []))

    builtin = {"Exception", "BaseException", "ValueError", "RuntimeError", "OSError", "KeyError", "TypeError"}
    return [
        f"{places[name]}: exception {name} does not derive from MeridianError"
        for name in sorted(bases)
        if name != "MeridianError" and reaches(name, builtin) and not reaches(name, {"MeridianError"})
    ]


def rule_no_circles(sources: dict[str, Source]) -> list[str]:
    # Imports inside functions count too: two files that each need the other are one room, whatever runs first.
    graph: dict[str, set[str]] = defaultdict(set)
    for source, _line, target in edges(sources):
        graph[source.module].add(target)
    found: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append("import circle: " + " -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def rule_runs_on_lines(sources: dict[str, Source]) -> list[str]:
    found = []
    for source in sources.values():
        expected = RUNS_ON.get(_room(source.module)[1]) if _room(source.module)[0] == "agent" else None
        if expected is None or source.path.name == "__init__.py":
            continue
        lines = (ast.get_docstring(source.tree) or "").splitlines()
        line = next((text for text in lines if text.startswith("Runs on:")), None)
        if line is None or expected not in line:
            found.append(f"{source.path}: its docstring needs a 'Runs on: {expected}' line (found {line!r})")
    return found


RULES: list[Rule] = [
    rule_plugins_never_import_the_agent,
    rule_agent_rooms,
    rule_devserver_rooms,
    rule_module_utils_rooms,
    rule_one_converge,
    rule_module_shells,
    rule_unique_class_names,
    rule_one_error_root,
    rule_no_circles,
    rule_runs_on_lines,
]


@pytest.fixture(scope="module")
def house() -> dict[str, Source]:
    return load(REPO)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_house_keeps_its_rules(rule: Rule, house: dict[str, Source]) -> None:
    assert rule(house) == []


A = f"agent/{AGENT}"
D = f"{A}/devserver"
M = "plugins/module_utils"
S = "plugins/modules"
# One violation of each rule: (rule, file, text appended to it, what every report line then names).
PLANTED = [
    (rule_plugins_never_import_the_agent, f"{M}/contracts.py", "import meridian_node_agent.config\n", "the agent"),
    (rule_agent_rooms, f"{A}/agent_side/cycle.py", "from meridian_node_agent.root_side import root_dir\n", "root_side"),
    (rule_agent_rooms, f"{A}/boundary/spool.py", "from meridian_node_agent.cli import main\n", "cli/"),
    (rule_devserver_rooms, f"{D}/store/database.py", f"from {DEVSERVER}.serving import hot_path\n", "store/ imports"),
    (
        rule_devserver_rooms,
        f"{D}/store/schema.py",
        f"from {DEVSERVER}.control.plane import Settings\n",
        "store/ imports",
    ),
    (
        rule_devserver_rooms,
        f"{D}/control/plane.py",
        f"from {DEVSERVER}.serving.hot_path import HotPath\n",
        "control/ im",
    ),
    (rule_devserver_rooms, f"{D}/serving/app.py", f"from {DEVSERVER}.cli import main\n", "nothing imports"),
    (rule_devserver_rooms, f"{D}/store/errors.py", f"from {DEVSERVER}.cli.common import Refused\n", "nothing imports"),
    (rule_module_utils_rooms, f"{M}/trust/dsse.py", f"from {MU}.engines import plan\n", "engines/"),
    (rule_module_utils_rooms, f"{M}/engines/prune.py", f"from {MU}.artifacts import fetch\n", "artifacts/layout"),
    (rule_module_utils_rooms, f"{M}/engines/set.py", f"from {MU}.artifacts.held import held_problems\n", "layout"),
    (rule_one_converge, f"{M}/engines/instance.py", f"from {MU}.engines.set import SetOptions\n", "only share"),
    (rule_one_converge, f"{M}/engines/set.py", f"from {MU}.engines import instance\n", "only share"),
    (rule_one_converge, f"{M}/engines/converge/act.py", f"from {MU}.engines.instance import converge\n", "neither"),
    (rule_one_converge, f"{M}/engines/converge/room.py", f"from {MU}.engines.set import converge_set\n", "neither"),
    (rule_one_converge, f"{M}/engines/set_run.py", f"from {MU}.engines.instance import converge\n", "only share"),
    (rule_module_shells, f"{S}/gpu_facts.py", "import json\n", SHELL_RULE),
    (rule_module_shells, f"{S}/drain.py", f"from {MU}.gpu.facts_args import gpu_facts_outcome\n", SHELL_RULE),
    (rule_unique_class_names, f"{A}/boundary/spool.py", "\n\nclass Agent:\n    pass\n", "class Agent"),
    (rule_one_error_root, f"{A}/boundary/spool.py", "\n\nclass StrayError(ValueError):\n    pass\n", "StrayError"),
    (rule_no_circles, f"{A}/agent_side/identity.py", "import meridian_node_agent.agent_side.cycle\n", "circle"),
]


@pytest.mark.parametrize(("rule", "path", "plant", "named"), PLANTED, ids=[f"{r.__name__}-{p}" for r, p, *_ in PLANTED])
def test_a_planted_violation_is_caught(tmp_path: Path, rule: Rule, path: str, plant: str, named: str) -> None:
    for tree in ("plugins", "agent"):
        shutil.copytree(REPO / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with (tmp_path / path).open("a", encoding="utf-8") as handle:
        handle.write(plant)
    found = rule(load(tmp_path))
    assert found and all(named in line for line in found), found


def test_a_missing_runs_on_line_is_caught(tmp_path: Path) -> None:
    shutil.copytree(REPO / "agent", tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    spool = tmp_path / A / "boundary" / "spool.py"
    spool.write_text(spool.read_text(encoding="utf-8").replace("Runs on:", "Runs:", 1), encoding="utf-8")
    expected = f"{A}/boundary/spool.py: its docstring needs a 'Runs on: both sides' line (found None)"
    assert rule_runs_on_lines(load(tmp_path)) == [expected]


def test_a_devserver_file_outside_its_rooms_is_caught(tmp_path: Path) -> None:
    shutil.copytree(REPO / "agent", tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tmp_path / D / "helpers.py").write_text(f"from {DEVSERVER}.store.database import Database\n", encoding="utf-8")
    found = rule_devserver_rooms(load(tmp_path))
    assert found == [f"{D}/helpers.py: the devserver's files live in its rooms (store/, control/, serving/, cli/)"]

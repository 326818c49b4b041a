"""The house's rules (docs/ARCHITECTURE.md, "The import rules"), checked with plain ``ast`` over the source.

Each rule is a function from the parsed house to a list of violations (file, line, what is wrong), so
``test_a_planted_violation_is_caught`` can plant violations in a copy of the tree (in memory: the changed files
are parsed again, the others shared) and see each one named.

The tables below are the rules' data: what each room and each top file may import of its own side (its layer),
which third-party packages each room may import and why, and the files still over the size limit.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import importlib
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MU = "ansible_collections.meridian.node.plugins.module_utils"
AGENT = "meridian_node_agent"
A = f"agent/{AGENT}"
M = "plugins/module_utils"
D = f"{A}/devserver"
S = "plugins/modules"
ARCHITECTURE = "docs/ARCHITECTURE.md"

# Layers: what each room (``name/``) and each top file (``name.py``) of a side may import of that side, besides
# itself. Every room and top file has a line: one without is a violation until it is given its layer.
# module_utils: the private helpers at the bottom, then the shared rules and the wire models, then the rooms.
MU_HELPERS = (
    "_errors.py",
    "_compat.py",
    "_module.py",
    "_fileutil.py",
    "_lockfile.py",
    "_plain_checks.py",
    "_strict_yaml.py",
    "_transfer_progress.py",
)
MU_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "_errors.py": (),  # MeridianError, the one root: imports nothing of ours
    "_compat.py": (),  # Python 3.9 shims
    "_module.py": (),  # the host options, the node's directories (named once) and run_module
    "_fileutil.py": ("_errors.py",),
    "_lockfile.py": ("_errors.py",),
    "_plain_checks.py": ("_errors.py",),
    "_pydantic_stub.py": ("_errors.py",),  # what contract_models/ stands on where a host lacks pydantic
    "_strict_yaml.py": ("_errors.py", "_fileutil.py"),
    "_transfer_progress.py": ("_errors.py", "_fileutil.py"),
    "engine_rules.py": ("_errors.py", "_module.py", "_plain_checks.py"),  # _module: the paths no engine mounts
    # contract_models/ holds the wire models by family; contracts.py is their one face, what everyone imports.
    "contract_models/": ("_compat.py", "_errors.py", "_plain_checks.py", "_pydantic_stub.py", "engine_rules.py"),
    "contracts.py": ("_errors.py", "contract_models/", "engine_rules.py"),
    # The low rooms never reach into engines/ or artifacts/.
    "docker/": MU_HELPERS,
    "gpu/": MU_HELPERS,
    "trust/": (*MU_HELPERS, "contracts.py", "contract_models/", "engine_rules.py"),
    "artifacts/": (*MU_HELPERS, "contracts.py", "contract_models/", "trust/"),
    # engines/ takes only artifacts/layout of artifacts/ (rule_module_utils_rooms, ARGS_MAY_IMPORT).
    "engines/": (
        *MU_HELPERS,
        "contracts.py",
        "contract_models/",
        "engine_rules.py",
        "trust/",
        "docker/",
        "gpu/",
        "artifacts/",
    ),
    # A bundle is read, staged and written above trust/, artifacts/ and docker/; its engines converge through the
    # playbook it carries, so airgap/ never imports engines/, and no room of module_utils imports airgap/.
    "airgap/": (*MU_HELPERS, "contracts.py", "contract_models/", "trust/", "artifacts/", "docker/"),
}
# The agent: the top files at the bottom, the formats both sides share (boundary/) above them, then what runs.
AGENT_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "__init__.py": (),  # the package's version, which every room may read
    "terminal_text.py": (),
    "errors.py": (),
    "logs.py": ("terminal_text.py",),
    "config.py": ("errors.py",),
    "boundary/": ("__init__.py",),
    "collectors/": ("__init__.py", "boundary/"),
    "apply/": ("__init__.py", "boundary/", "errors.py", "logs.py"),
    "agent_side/": (
        *("__init__.py", "terminal_text.py", "errors.py", "logs.py", "config.py"),
        *("boundary/", "collectors/", "apply/"),
    ),
    "root_side/": (
        *("__init__.py", "terminal_text.py", "errors.py", "logs.py", "config.py"),
        *("boundary/", "collectors/", "apply/"),
    ),
    "devserver/": ("__init__.py", "boundary/", "errors.py"),
    # cli/ loads its verbs from agent_side/ and root_side/ (VERB_MODULES); dev/ starts a devserver for the demo.
    "cli/": (
        *("__init__.py", "terminal_text.py", "errors.py", "logs.py", "config.py"),
        *("boundary/", "collectors/", "apply/", "agent_side/", "root_side/"),
    ),
    "dev/": (
        *("__init__.py", "terminal_text.py", "errors.py", "logs.py", "config.py"),
        *("boundary/", "agent_side/", "devserver/"),
    ),
}
# What of module_utils an agent unit may import, where that is narrower than all of it: the top files, and
# boundary/, which holds formats (reading Docker or the GPUs is the observers' work: collectors/, the sides).
AGENT_MU_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "__init__.py": (),
    "terminal_text.py": (),
    "errors.py": ("_errors.py",),
    "logs.py": (),
    "config.py": (
        "_errors.py",
        "_module.py",
        "_strict_yaml.py",
        "contracts.py",
        "contract_models/",
        "trust/",
    ),  # _module: the directories
    "boundary/": (*MU_HELPERS, "contracts.py", "contract_models/", "engine_rules.py", "trust/"),
}
# engines/ takes only artifacts/layout of artifacts/, but for these files: a module's *_args file is its
# composition root, and engine_set's hands the store's "held as signed" check to engines/set_run.py.
ARGS_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    f"{MU}.engines.set_args": (f"{MU}.artifacts.held",),
}
RUNS_ON = {
    "agent_side/": "the agent side",
    "root_side/": "the root side",
    "boundary/": "both sides",
    "collectors/": "both sides",
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
# The one dynamic import: the CLI's lazy verb table, a literal dict of verb -> module in this package, which the
# rules read as cli/'s imports. Any other import_module/__import__ names its module as a string literal.
# The lazy verb tables: the module holding one, its name, and the package its module names are relative to. A
# value is the module's name, or a tuple whose first item is (the devserver's: with the verb's --help line).
VERB_TABLES = {f"{AGENT}.cli": "VERB_MODULES", f"{AGENT}.devserver.cli": "VERB_MODULES"}
VERB_PACKAGES = {f"{AGENT}.cli": AGENT, f"{AGENT}.devserver.cli": f"{AGENT}.devserver.cli"}

# Third-party packages (top-level import names) each room may import: (files, package, why). The rest of the
# import names is the standard library and our own two packages. Every entry is used (a test says which is not).
PYPROJECT_DEPS = "pyproject.toml's dependencies"
THIRD_PARTY: tuple[tuple[str, str, str], ...] = (
    # plugins/ runs on managed hosts: the standard library and what the modules' `requirements:` name.
    ("plugins/modules/*", "ansible", "a module shell: AnsibleModule's ansible.module_utils.basic"),
    ("plugins/plugin_utils/*", "ansible", "the action plugins' shared code (in_worker), on the controller"),
    (f"{M}/_module.py", "ansible", "run_module: AnsibleModule, how every module shell ends"),
    (f"{M}/*_args.py", "ansible", "missing_required_lib: a module's message for a package the host lacks"),
    (f"{M}/artifacts/fetch.py", "ansible", "open_url: Ansible's TLS, proxy and redirect handling for downloads"),
    (
        f"{M}/contract_models/base.py",
        "pydantic",
        "the wire models' base (requirements: pydantic; _pydantic_stub.py without it)",
    ),
    (f"{M}/_strict_yaml.py", "yaml", "PyYAML, made strict: the one YAML reader (policy, config)"),
    (f"{M}/trust/*", "cryptography", "Ed25519 keys and signatures: dsse, verify, policy (requirements)"),
    (f"{M}/gpu/nvml.py", "pynvml", "nvidia-ml-py: the one NVML seam"),
    # The agent (Python 3.11): pyproject.toml's dependencies, and an extra only where that extra's feature lives.
    (f"{A}/config.py", "pydantic", "the config model, strict (" + PYPROJECT_DEPS + ")"),
    (f"{A}/boundary/*", "pydantic", "the formats both sides read strictly (" + PYPROJECT_DEPS + ")"),
    (
        f"{A}/boundary/outbox.py",
        "cryptography",
        "outbox records carry the node key's ECDSA signature, which the "
        "agent writes and the devserver's import-outbox checks: one signature rule for both",
    ),
    (f"{A}/apply/applier.py", "ansible_runner", "runs reconcile.yml; its artifacts directory is the journal"),
    (f"{A}/agent_side/*", "pydantic", "the control plane's answers and the agent's own files, read strictly"),
    (f"{A}/agent_side/*", "cryptography", "the node key, its CSR and TLS identity; the outbox key"),
    (f"{A}/agent_side/control_link.py", "h11", "the control link's HTTP parser (a remote peer's bytes)"),
    (f"{A}/agent_side/metrics.py", "prometheus_client", "the Prometheus endpoint (the `metrics` extra)"),
    (f"{A}/agent_side/podresources/*", "grpc", "the kubelet's PodResources API (the `kubernetes` extra)"),
    (f"{A}/agent_side/podresources/*", "google", "protobuf, the PodResources messages (the `kubernetes` extra)"),
    # Being split (issue 46): the D-Bus adapter of the shutdown drain; narrow this to its file once it lands.
    (f"{A}/root_side/logind_bus.py", "jeepney", "root's shutdown drain speaks to systemd-logind over D-Bus"),
    (f"{A}/cli/__init__.py", "argcomplete", "shell completion, imported only while the shell completes"),
    (f"{A}/cli/*", "pydantic", "the verbs' documents, checked the contracts' way"),
    (f"{A}/cli/*", "cryptography", "enrollment's key and CSR, the signing verbs"),
    # The reference control plane: the `devserver` extra.
    (f"{A}/devserver/*", "fastapi", "the HTTP API"),
    (f"{A}/devserver/*", "starlette", "FastAPI's requests and responses, used directly on the hot path"),
    (f"{A}/devserver/*", "uvicorn", "the server (with uvloop and httptools)"),
    (f"{A}/devserver/*", "sqlalchemy", "the store, SQLAlchemy Core"),
    (f"{A}/devserver/*", "alembic", "the store's migrations"),
    (f"{A}/devserver/*", "psycopg", "PostgreSQL's NOTIFY for the change feed"),
    (f"{A}/devserver/*", "pydantic", "the wire models it serves"),
    (f"{A}/devserver/*", "pydantic_core", "the JSON Schemas of the OpenAPI document"),
    (f"{A}/devserver/*", "cryptography", "its CA: node certificates, signing"),
    (f"{A}/devserver/*", "yaml", "its CLI reads desired states written in YAML"),
    # dev/: make demo and the generated docs, on a developer's machine (the `dev` extra).
    (f"{A}/dev/*", "pydantic", "the config and contract models documented and exported as schemas"),
    (f"{A}/dev/*", "pydantic_core", "docs/CONFIG.md: the models' defaults"),
    (f"{A}/dev/*", "annotated_types", "docs/CONFIG.md: the models' limits"),
    (f"{A}/dev/*", "jsonschema", "the exported schemas checked"),
    (f"{A}/dev/*", "docker", "make demo builds its stand-in engine image with the Docker SDK"),
    (f"{A}/dev/*", "yaml", "the demo loop writes desired states in YAML"),
)

MAX_LINES = 800


@dataclass
class Source:
    path: Path  # relative to the tree's root
    module: str
    tree: ast.Module
    imports: list[tuple[int, str]] = field(default_factory=list)  # (line, module or name in one)
    classes: list[ast.ClassDef] = field(default_factory=list)
    dynamic_imports: list[ast.Call] = field(default_factory=list)  # import_module(...), __import__(...)
    names: dict[str, str] = field(default_factory=dict)  # what each imported or class name is, as a dotted path


@dataclass
class House:
    root: Path
    sources: dict[str, Source]  # by module name: module_utils, modules, action, the agent
    files: dict[Path, str]  # every .py file under plugins/ and the agent (doc_fragments too): its text
    architecture: str  # docs/ARCHITECTURE.md


Rule = Callable[[House], list[str]]


def _module_name(path: Path) -> str | None:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] == "plugins" and parts[1] in ("module_utils", "modules", "action", "plugin_utils"):
        return ".".join(["ansible_collections", "meridian", "node", *parts])
    return ".".join(parts[1:]) if parts[:2] == ["agent", AGENT] else None


def _package(source_path: Path, module: str) -> str:
    return module if source_path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    return base


def _is_dynamic_import(node: ast.Call) -> bool:
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return name in ("import_module", "__import__")


def _literal_table(tree: ast.Module, name: str) -> dict[str, tuple[int, str]] | None:
    """``name``'s value at the top of ``tree`` when it is one literal dict of strings (or of tuples whose first item
    is one), with each value's line."""
    values: list[ast.expr | None] = []
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            values.append(node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None)
    if len(values) != 1 or not isinstance(values[0], ast.Dict):
        return None
    table = {}
    for key, value in zip(values[0].keys, values[0].values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return None
        if isinstance(value, ast.Tuple) and value.elts:
            value = value.elts[0]
        if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
            return None
        table[key.value] = (value.lineno, value.value)
    return table


@functools.cache
def _source(text: str, path: str, module: str) -> Source:
    """One file, walked once (copies of the tree share their unchanged files' walk)."""
    source = Source(Path(path), module, ast.parse(text, path))
    package = _package(source.path, module)
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Import):
            source.imports += [(node.lineno, alias.name) for alias in node.names]
            for alias in node.names:
                top = alias.name.split(".")[0]
                source.names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            source.imports += [(node.lineno, base), *((node.lineno, f"{base}.{alias.name}") for alias in node.names)]
            source.names.update({alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                source.imports.append((node.lineno, first.value))
            else:
                source.dynamic_imports.append(node)
        elif isinstance(node, ast.ClassDef):
            source.classes.append(node)
    source.names.update({node.name: f"{module}.{node.name}" for node in source.classes})
    if module in VERB_TABLES:  # the lazy verbs are cli/'s imports too
        table = _literal_table(source.tree, VERB_TABLES[module]) or {}
        source.imports += [(line, f"{VERB_PACKAGES[module]}.{name}") for line, name in table.values()]
    return source


def _is_generated(path: Path) -> bool:
    return "_pb2" in path.name  # make podresources-stubs


def load(root: Path, changes: Mapping[str, str] | None = None) -> House:
    """The house at ``root``; ``changes`` (relative path -> new text) replaces or adds files, as a copy would."""
    changes = dict(changes or {})
    paths = sorted([*root.glob("plugins/**/*.py"), *root.glob(f"{A}/**/*.py")])
    texts = {path.relative_to(root): path.read_text(encoding="utf-8") for path in paths}
    texts.update({Path(path): text for path, text in changes.items() if path != ARCHITECTURE})
    sources: dict[str, Source] = {}
    for relative in sorted(texts):
        module = _module_name(relative)
        if module is not None:
            sources[module] = _source(texts[relative], relative.as_posix(), module)
    architecture = changes.get(ARCHITECTURE) or (root / ARCHITECTURE).read_text(encoding="utf-8")
    return House(root, sources, texts, architecture)


def _ours(sources: Mapping[str, Source], name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name in one) refers to, or None."""
    while name and name not in sources:
        name = name.rpartition(".")[0]
    return name or None


def _unit(source: Source) -> tuple[str, str]:
    """Which side and which room or top file: ("mu", "engines/"), ("mu", "contracts.py"), ("agent",
    "boundary/"), ("agent", "config.py"), ("agent", "__init__.py"), ("plugins", "modules/")."""
    parts = source.path.with_suffix("").parts
    if parts[:2] == ("plugins", "module_utils"):
        side, rest = "mu", parts[2:]
    elif parts[0] == "plugins":
        return "plugins", parts[1] + "/"
    else:
        side, rest = "agent", parts[2:]
    return side, rest[0] + ("/" if len(rest) > 1 else ".py")


def edges(house: House) -> Iterable[tuple[Source, int, Source]]:
    """Each import of one of our modules by another, once per (importer, line, imported). ``from pkg import sub``
    imports ``pkg.sub``, not ``pkg``: a package is where its submodules are, as for ``import pkg.sub``."""
    for source in house.sources.values():
        by_line: dict[int, set[str]] = defaultdict(set)
        for line, name in source.imports:
            target = _ours(house.sources, name)
            if target is not None and target != source.module:
                by_line[line].add(target)
        for line, targets in by_line.items():
            for target in sorted(targets):
                if not any(other.startswith(target + ".") for other in targets):
                    yield source, line, house.sources[target]


def rule_plugins_never_import_the_agent(house: House) -> list[str]:
    return [
        f"{source.path}:{line}: plugins/ imports the agent ({name})"
        for source in house.sources.values()
        if source.path.parts[0] == "plugins"
        for line, name in source.imports
        if name.split(".")[0] == AGENT
    ]


def rule_every_unit_has_a_layer(house: House) -> list[str]:
    """Every room and top file of module_utils and of the agent has its line in the layer tables."""
    tables = {"mu": MU_MAY_IMPORT, "agent": AGENT_MAY_IMPORT}
    found = {}
    for source in house.sources.values():
        side, unit = _unit(source)
        if side in tables and unit not in tables[side]:
            table = "MU_MAY_IMPORT" if side == "mu" else "AGENT_MAY_IMPORT"
            found[unit, side] = f"{source.path}: {unit} has no layer: give it a line in {table} (what it may import)"
    return sorted(found.values())


def rule_agent_rooms(house: House) -> list[str]:
    """Each room and top file of the agent imports only what its layer lists (``AGENT_MAY_IMPORT``), and of
    module_utils only what ``AGENT_MU_MAY_IMPORT`` lists where it has a line; nothing imports cli/ or dev/."""
    found = []
    for source, line, target in edges(house):
        (side, unit), (target_side, target_unit) = _unit(source), _unit(target)
        if side != "agent" or (side, unit) == (target_side, target_unit) or unit not in AGENT_MAY_IMPORT:
            continue
        narrow = AGENT_MU_MAY_IMPORT.get(unit)
        if target_side == "mu" and narrow is not None and target_unit not in narrow:
            found.append(
                f"{source.path}:{line}: {unit} imports {target.module}: module_utils' {target_unit} is not its"
                " to import"
            )
        elif target_side != "agent":
            continue
        elif target_unit in ("cli/", "dev/"):
            found.append(f"{source.path}:{line}: imports {target.module}: nothing imports cli/ or dev/")
        elif target_unit not in AGENT_MAY_IMPORT[unit]:
            found.append(
                f"{source.path}:{line}: {unit} imports {target.module}, and {target_unit} is not its to import"
            )
    return found


def _devserver_room(module: str) -> str | None:
    """The devserver room ``module`` is in ("" for the package itself), or None outside the devserver."""
    if module != DEVSERVER and not module.startswith(DEVSERVER + "."):
        return None
    return module[len(DEVSERVER) + 1 :].partition(".")[0]


def rule_devserver_rooms(house: House) -> list[str]:
    """store/ imports only store/, control/ adds store/, serving/ adds control/; nothing imports cli/; every file of
    the devserver's is in one of those rooms."""
    rooms = ", ".join(f"{room}/" for room in DEVSERVER_MAY_IMPORT if room)
    found = [
        f"{source.path}: the devserver's files live in its rooms ({rooms})"
        for source in house.sources.values()
        if _devserver_room(source.module) not in (None, *DEVSERVER_MAY_IMPORT)
    ]
    for source, line, target in edges(house):
        room, target_room = _devserver_room(source.module), _devserver_room(target.module)
        if room not in DEVSERVER_MAY_IMPORT or target_room is None or room == target_room:
            continue
        if target_room == "cli":
            found.append(f"{source.path}:{line}: imports {target.module}: nothing imports the devserver's cli/")
        elif target_room not in DEVSERVER_MAY_IMPORT[room]:
            found.append(
                f"{source.path}:{line}: the devserver's {room}/ imports {target.module}; {target_room}/ is above it"
            )
    return found


def rule_module_utils_rooms(house: House) -> list[str]:
    """Each room and top file of module_utils imports only what its layer lists (``MU_MAY_IMPORT``); engines/
    takes only artifacts/layout of artifacts/, but what ``ARGS_MAY_IMPORT`` lists."""
    found = []
    for source, line, target in edges(house):
        (side, unit), (target_side, target_unit) = _unit(source), _unit(target)
        if side != "mu" or target_side != "mu" or unit == target_unit or unit not in MU_MAY_IMPORT:
            continue
        if target_unit not in MU_MAY_IMPORT[unit]:
            found.append(f"{source.path}:{line}: {unit} imports {target.module}: {target_unit} is not its to import")
        elif (
            unit == "engines/"
            and target_unit == "artifacts/"
            and target.module != f"{MU}.artifacts.layout"
            and target.module not in ARGS_MAY_IMPORT.get(source.module, ())
        ):
            found.append(f"{source.path}:{line}: engines/ imports {target.module}: it takes only artifacts/layout")
    return found


def rule_one_converge(house: House) -> list[str]:
    """``engines/instance.py`` and ``engines/set.py`` (with ``set_run.py``) never import each other;
    ``engines/converge/`` imports neither."""
    found = []
    for source, line, target in edges(house):
        if target.module not in ORDERERS:
            continue
        if source.module in ORDERERS and ORDERERS[source.module] != ORDERERS[target.module]:
            found.append(f"{source.path}:{line}: imports {target.module}: instance.py and set.py only share converge/")
        elif source.module == CONVERGE or source.module.startswith(CONVERGE + "."):
            found.append(
                f"{source.path}:{line}: converge/ imports {target.module}: it imports neither instance nor set"
            )
    return found


def rule_module_shells(house: House) -> list[str]:
    """A module imports only ``__future__``, ``ansible.module_utils.basic``, ``_module`` and exactly one
    ``*_args`` file of module_utils, and from that file exactly one ``*_outcome`` function."""
    found = []
    for source in house.sources.values():
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


def rule_one_dynamic_import(house: House) -> list[str]:
    """``import_module``/``__import__`` name their module as a string literal (so the rules see it), but for
    the CLI's lazy verbs, whose table (``VERB_TABLES``) is one literal dict of strings."""
    found = []
    for source in house.sources.values():
        dynamic = source.dynamic_imports
        table = VERB_TABLES.get(source.module)
        if table is not None and len(dynamic) <= 1:
            if dynamic and _literal_table(source.tree, table) is None:
                found.append(
                    f"{source.path}: {table} must be one literal dict of strings: the verbs it loads are cli/'s imports"
                )
            continue
        found += [
            f"{source.path}:{call.lineno}: a dynamic import ({ast.unparse(call)}): "
            f"name the module as a literal; the only table of modules is cli's {VERB_TABLES[f'{AGENT}.cli']}"
            for call in dynamic
        ]
    return found


def _third_party(name: str) -> str | None:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == AGENT or name.startswith("ansible_collections.meridian.node"):
        return None
    return top


def rule_third_party_per_room(house: House) -> list[str]:
    """Each third-party import is allowed for its file by a line of ``THIRD_PARTY``."""
    found = {}
    for source in house.sources.values():
        for line, name in source.imports:
            package = _third_party(name)
            if package is not None and not _allowed_third_party(source.path, package):
                found[source.path, line, package] = (
                    f"{source.path}:{line}: imports {package}, which THIRD_PARTY does not allow here "
                    "(a line there says which files may, and why)"
                )
    return list(found.values())


def _allowed_third_party(path: Path, package: str) -> bool:
    return any(package == allowed and fnmatch.fnmatch(path.as_posix(), files) for files, allowed, _ in THIRD_PARTY)


# Exceptions: each class's bases are followed through imports, across files, to the classes they are; a class with
# an exception among its ancestors (a builtin or third-party one, found by importing it) must have MeridianError
# among them too.
MERIDIAN_ERROR = (f"{MU}._errors", "MeridianError")
Ancestor = tuple[str, str] | type | None  # one of our classes (module, name), another class, or not followed


@functools.cache
def _external(path: str) -> type | None:
    """The class a dotted path outside our tree names (``builtins.LookupError``, ``yaml.YAMLError``), found by
    importing it; the type of what it names when that is no class (``typing.NamedTuple``); None if not found."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part, None)
        return None if value is None else value if isinstance(value, type) else type(value)
    return None


class _Classes:
    """Our classes by (module, name), and what each base expression of theirs resolves to."""

    def __init__(self, house: House) -> None:
        self.house = house
        self.nodes = {
            (source.module, node.name): (source, node) for source in house.sources.values() for node in source.classes
        }
        self.names = {module: source.names for module, source in house.sources.items()}

    def base(self, module: str, expression: ast.expr) -> Ancestor:
        if isinstance(expression, ast.Subscript):  # Generic[T], TypeDecorator[datetime]
            expression = expression.value
        chain: list[str] = []
        while isinstance(expression, ast.Attribute):
            chain.insert(0, expression.attr)
            expression = expression.value
        if not isinstance(expression, ast.Name):
            return None
        head = self.names[module].get(expression.id) or (
            f"builtins.{expression.id}" if hasattr(builtins, expression.id) else None
        )
        return None if head is None else self.follow(".".join([head, *chain]))

    def follow(self, path: str, hops: int = 0) -> Ancestor:
        owner = _ours(self.house.sources, path)
        if owner is None:
            return _external(path)
        name = path[len(owner) + 1 :]
        if (owner, name) in self.nodes:
            return owner, name
        if "." in name or name not in self.names[owner] or hops > 10:
            return None
        return self.follow(self.names[owner][name], hops + 1)  # a name another file of ours imported

    def ancestors(self, key: tuple[str, str]) -> Iterator[Ancestor]:
        """What each base of each class in ``key``'s lineage resolves to: ours, another's, or None."""
        todo, seen = [key], {key}
        while todo:
            module, name = todo.pop()
            for expression in self.nodes[module, name][1].bases:
                ancestor = self.base(module, expression)
                yield ancestor
                if isinstance(ancestor, tuple) and ancestor not in seen:
                    seen.add(ancestor)
                    todo.append(ancestor)


def rule_one_error_root(house: House) -> list[str]:
    """Every class whose lineage holds an exception holds MeridianError; every base can be followed."""
    classes = _Classes(house)
    found = []
    for key, (source, node) in sorted(classes.nodes.items()):
        if key == MERIDIAN_ERROR:
            continue
        where = f"{source.path}:{node.lineno}"
        lost = [ast.unparse(base) for base in node.bases if classes.base(key[0], base) is None]
        if lost:
            found.append(
                f"{where}: class {node.name}: its base {', '.join(lost)} cannot be followed: import it by name"
            )
        lineage = list(classes.ancestors(key))
        errors = sorted({a.__name__ for a in lineage if isinstance(a, type) and issubclass(a, BaseException)})
        if errors and MERIDIAN_ERROR not in lineage:
            found.append(f"{where}: exception {node.name} ({', '.join(errors)}) does not derive from MeridianError")
    return found


def rule_unique_class_names(house: House) -> list[str]:
    defined: dict[str, list[str]] = defaultdict(list)
    for source in house.sources.values():
        for node in source.classes:
            defined[node.name].append(f"{source.path}:{node.lineno}")
    return [f"class {name} is defined {len(at)} times: {', '.join(at)}" for name, at in defined.items() if len(at) > 1]


def rule_no_circles(house: House) -> list[str]:
    # Imports inside functions count too: two files that each need the other are one room, whatever runs first.
    graph: dict[str, set[str]] = defaultdict(set)
    for source, _line, target in edges(house):
        graph[source.module].add(target.module)
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


def rule_runs_on_lines(house: House) -> list[str]:
    found = []
    for source in house.sources.values():
        side, unit = _unit(source)
        expected = RUNS_ON.get(unit) if side == "agent" else None
        if expected is None or source.path.name == "__init__.py":
            continue
        lines = (ast.get_docstring(source.tree) or "").splitlines()
        line = next((text for text in lines if text.startswith("Runs on:")), None)
        if line is None or expected not in line:
            found.append(f"{source.path}: its docstring needs a 'Runs on: {expected}' line (found {line!r})")
    return found


def rule_no_file_over_max_lines(house: House) -> list[str]:
    return [
        f"{path}: {text.count(chr(10))} lines, more than {MAX_LINES}: split it along the seams it marks"
        for path, text in house.files.items()
        if text.count("\n") > MAX_LINES and not _is_generated(path)
    ]


_ENTRY = re.compile(r"^( {0,19})(\S+?/|\S+?\.py)(?:\s|$)")


def architecture_tree(text: str) -> dict[str, str]:
    """The first code block of "## The trees": each folder written there, with the text written for it (its line,
    the lines below it, and the lines of the files written under it, but not its subfolders')."""
    block = text.split("## The trees", 1)[-1].split("```", 2)[1]
    owned: dict[str, list[str]] = defaultdict(list)
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    current = ""
    for line in block.splitlines():
        match = _ENTRY.match(line)
        if match is not None:
            indent, name = len(match[1]), match[2]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            if name.endswith("/"):
                stack.append((indent, parent + name))
                current = parent + name
            else:
                current = parent
        owned[current].append(line)
    return {folder: "\n".join(lines) for folder, lines in owned.items()}


def rule_architecture_names_every_file(house: House) -> list[str]:
    """docs/ARCHITECTURE.md's tree names every product file (but ``__init__.py``) by its stem, in the text of the
    deepest folder it writes that holds the file."""
    tree = architecture_tree(house.architecture)
    missing = []
    for path in house.files:
        if path.name == "__init__.py" or _is_generated(path):
            continue
        folder = f"{path.parent.as_posix()}/"
        written = max((f for f in tree if folder.startswith(f)), key=len, default=None)
        if written is None or not re.search(rf"(?<!\w){re.escape(path.stem)}(?!\w)", tree[written]):
            missing.append(f"{ARCHITECTURE} does not name {path} (on the lines of {written or folder})")
    return missing


RULES: list[Rule] = [
    rule_plugins_never_import_the_agent,
    rule_every_unit_has_a_layer,
    rule_agent_rooms,
    rule_devserver_rooms,
    rule_module_utils_rooms,
    rule_one_converge,
    rule_module_shells,
    rule_one_dynamic_import,
    rule_third_party_per_room,
    rule_unique_class_names,
    rule_one_error_root,
    rule_no_circles,
    rule_runs_on_lines,
    rule_no_file_over_max_lines,
    rule_architecture_names_every_file,
]


@pytest.fixture(scope="module")
def house() -> House:
    return load(REPO)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_house_keeps_its_rules(rule: Rule, house: House) -> None:
    assert rule(house) == []


def test_every_third_party_allowance_is_used(house: House) -> None:
    """A line of THIRD_PARTY that no file needs is a hole left open: each one is used today."""
    used = {
        (files, package)
        for source in house.sources.values()
        for _line, name in source.imports
        for files, package, _why in THIRD_PARTY
        if _third_party(name) == package and fnmatch.fnmatch(source.path.as_posix(), files)
    }
    assert [(files, package) for files, package, _ in THIRD_PARTY if (files, package) not in used] == []


def test_every_layer_line_is_a_room_or_top_file(house: House) -> None:
    units = {_unit(source) for source in house.sources.values()}
    stale = [("mu", unit) for unit in MU_MAY_IMPORT if ("mu", unit) not in units]
    stale += [("agent", unit) for unit in AGENT_MAY_IMPORT if ("agent", unit) not in units]
    assert stale == []


def _class(name: str, base: str) -> str:
    return f"\n\nclass {name}({base}):\n    pass\n"


def _new_file(path: str) -> str:
    return path + "#new"  # PLANTED's mark for a file that does not exist yet


# Violations planted: (rule, {file: text appended to it}, what every report line then names). Each line after the
# first block is one of the holes a review found (issue 46), planted where it was missed.
PLANTED: list[tuple[Rule, dict[str, str], str]] = [
    (
        rule_plugins_never_import_the_agent,
        {f"{M}/contract_models/base.py": "import meridian_node_agent.config\n"},
        "the agent",
    ),
    (
        rule_agent_rooms,
        {f"{A}/agent_side/cycle.py": "from meridian_node_agent.root_side import root_dir\n"},
        "root_side",
    ),
    (rule_agent_rooms, {f"{A}/boundary/spool.py": "from meridian_node_agent.cli import main\n"}, "cli/"),
    (rule_module_utils_rooms, {f"{M}/trust/dsse.py": f"from {MU}.engines import plan\n"}, "engines/"),
    (rule_module_utils_rooms, {f"{M}/engines/prune.py": f"from {MU}.artifacts import fetch\n"}, "artifacts/layout"),
    (rule_module_utils_rooms, {f"{M}/engines/set.py": f"from {MU}.artifacts.held import held_problems\n"}, "layout"),
    (rule_one_converge, {f"{M}/engines/instance.py": f"from {MU}.engines.set import SetOptions\n"}, "only share"),
    (rule_one_converge, {f"{M}/engines/set.py": f"from {MU}.engines import instance\n"}, "only share"),
    (rule_one_converge, {f"{M}/engines/converge/act.py": f"from {MU}.engines.instance import converge\n"}, "neither"),
    (rule_one_converge, {f"{M}/engines/converge/room.py": f"from {MU}.engines.set import converge_set\n"}, "neither"),
    (rule_one_converge, {f"{M}/engines/set_run.py": f"from {MU}.engines.instance import converge\n"}, "only share"),
    (rule_module_shells, {f"{S}/gpu_facts.py": "import json\n"}, SHELL_RULE),
    (rule_module_shells, {f"{S}/drain.py": f"from {MU}.gpu.facts_args import gpu_facts_outcome\n"}, SHELL_RULE),
    (rule_unique_class_names, {f"{A}/boundary/spool.py": _class("Agent", "")}, "class Agent"),
    (rule_one_error_root, {f"{A}/boundary/spool.py": _class("StrayError", "ValueError")}, "StrayError"),
    (rule_no_circles, {f"{A}/agent_side/identity.py": "import meridian_node_agent.agent_side.cycle\n"}, "circle"),
    # 1-4. Exception bases outside the seven builtins the old rule knew, and a third-party one.
    (rule_one_error_root, {f"{A}/boundary/spool.py": _class("StrayLookup", "LookupError")}, "StrayLookup"),
    (rule_one_error_root, {f"{A}/agent_side/cycle.py": _class("StrayTimeout", "TimeoutError")}, "StrayTimeout"),
    (rule_one_error_root, {f"{A}/apply/inbox.py": _class("StrayLink", "ConnectionError")}, "StrayLink"),
    (
        rule_one_error_root,
        {f"{M}/_strict_yaml.py": "from yaml import YAMLError as ParseFailed\n" + _class("StrayYaml", "ParseFailed")},
        "StrayYaml",
    ),
    # ... through a module attribute, and across files: a class of ours in another file that leads to KeyError.
    (
        rule_one_error_root,
        {f"{M}/docker/_http.py": "import socket\n" + _class("StraySocket", "socket.timeout")},
        "StraySocket",
    ),
    (
        rule_one_error_root,
        {
            f"{M}/engines/labels.py": _class("StrayBase", "KeyError"),
            f"{M}/engines/volumes.py": f"from {MU}.engines.labels import StrayBase\n"
            + _class("StrayChild", "StrayBase"),
        },
        "Stray",
    ),
    # 5-8. The agent's top files have a layer.
    (
        rule_agent_rooms,
        {f"{A}/config.py": "from meridian_node_agent.agent_side import identity\n"},
        "config.py imports",
    ),
    (rule_agent_rooms, {f"{A}/logs.py": "from meridian_node_agent.config import AgentConfig\n"}, "logs.py imports"),
    (rule_agent_rooms, {f"{A}/errors.py": "from meridian_node_agent.logs import EventLogger\n"}, "errors.py imports"),
    (
        rule_agent_rooms,
        {f"{A}/terminal_text.py": "from meridian_node_agent import errors\n"},
        "terminal_text.py imports",
    ),
    (rule_agent_rooms, {f"{A}/errors.py": f"from {MU}.contracts import NodeId\n"}, "contracts.py is not its"),
    # 9. module_utils' top files have a layer, and a new top file (or room) is given one.
    (rule_module_utils_rooms, {f"{M}/_errors.py": f"from {MU}.contracts import JsonError\n"}, "_errors.py imports"),
    (rule_module_utils_rooms, {f"{M}/_fileutil.py": f"from {MU}.trust import dsse\n"}, "_fileutil.py imports"),
    (
        rule_module_utils_rooms,
        {f"{M}/contract_models/state.py": f"from {MU}.gpu import nvml\n"},
        "contract_models/ imports",
    ),
    (rule_every_unit_has_a_layer, {_new_file(f"{M}/_stray.py"): "X = 1\n", _new_file(f"{A}/stray.py"): ""}, "stray"),
    # 10. airgap/ has its rule: it never imports engines/, and no room of module_utils imports it.
    (rule_module_utils_rooms, {f"{M}/airgap/bundle_stage.py": f"from {MU}.engines import set\n"}, "airgap/ imports"),
    (rule_module_utils_rooms, {f"{M}/trust/policy.py": f"from {MU}.airgap import runbook\n"}, "airgap/ is not"),
    # 11. Third-party imports per room.
    (rule_third_party_per_room, {f"{M}/docker/api.py": "import requests\n"}, "requests"),
    (rule_third_party_per_room, {f"{A}/agent_side/observe.py": "import grpc\n"}, "grpc"),
    (rule_third_party_per_room, {f"{A}/agent_side/cycle.py": "from fastapi import FastAPI\n"}, "fastapi"),
    (rule_third_party_per_room, {f"{A}/boundary/spool.py": "from cryptography import x509\n"}, "cryptography"),
    (rule_third_party_per_room, {f"{M}/engines/spec.py": "import pydantic\n"}, "pydantic"),
    # 12. The *_args exception only where it is needed: engine_info's args file may not take the store.
    (rule_module_utils_rooms, {f"{M}/engines/info_args.py": f"from {MU}.artifacts.store import Store\n"}, "layout"),
    (rule_module_utils_rooms, {f"{M}/engines/set_args.py": f"from {MU}.artifacts import store\n"}, "layout"),
    # 13. A module loaded through a variable, but for the CLI's literal verb table.
    (
        rule_one_dynamic_import,
        {
            f"{A}/agent_side/cycle.py": "import importlib\n\n\ndef load(verb):\n"
            "    return importlib.import_module(verb)\n"
        },
        "dynamic import",
    ),
    (
        rule_one_dynamic_import,
        {f"{M}/engines/drivers.py": "\n\ndef load(name):\n    return __import__(name)\n"},
        "dynamic",
    ),
    (rule_one_dynamic_import, {f"{A}/cli/__init__.py": "VERB_MODULES = {**VERB_MODULES, 'x': NAME}\n"}, "literal"),
    (
        rule_one_dynamic_import,
        {f"{A}/cli/__init__.py": "\n\ndef load(name):\n    return importlib.import_module(name)\n"},
        "dynamic import",
    ),
    # 14. docs/ARCHITECTURE.md names every product file.
    (rule_architecture_names_every_file, {_new_file(f"{M}/engines/stray_helper.py"): "X = 1\n"}, "stray_helper.py"),
    (
        rule_architecture_names_every_file,
        {_new_file(f"{A}/root_side/stray_unit.py"): '"""Runs on: x"""\n'},
        "stray_unit",
    ),
    # 15. boundary/ holds formats: reading Docker is an observer's work (collectors/, the sides).
    (rule_agent_rooms, {f"{A}/boundary/engines_file.py": f"from {MU}.docker.engine import DockerEngine\n"}, "docker/"),
    # HOUSE.md's rule 6: no product file over 800 lines, but the known ones being split.
    (rule_no_file_over_max_lines, {f"{M}/engines/labels.py": "#\n" * MAX_LINES}, "labels.py"),
    # The devserver's rooms: the store below the control plane, below the server; nothing imports its cli/.
    (rule_devserver_rooms, {f"{D}/store/database.py": f"from {DEVSERVER}.serving import hot_path\n"}, "store/ imports"),
    (rule_devserver_rooms, {f"{D}/store/schema.py": f"from {DEVSERVER}.control.plane import Settings\n"}, "store/ imp"),
    (
        rule_devserver_rooms,
        {f"{D}/control/plane.py": f"from {DEVSERVER}.serving.hot_path import HotPath\n"},
        "control/",
    ),
    (rule_devserver_rooms, {f"{D}/serving/app.py": f"from {DEVSERVER}.cli import main\n"}, "nothing imports"),
    (
        rule_devserver_rooms,
        {f"{D}/store/errors.py": f"from {DEVSERVER}.cli.common import Refused\n"},
        "nothing imports",
    ),
    (
        rule_devserver_rooms,
        {f"{D}/helpers.py#new": f"from {DEVSERVER}.store.database import Database\n"},
        "live in its rooms",
    ),
]


def _planted(house_root: Path, plants: dict[str, str]) -> dict[str, str]:
    changes = {}
    for path, text in plants.items():
        if path.endswith("#new"):
            changes[path.removesuffix("#new")] = text
        elif path == ARCHITECTURE:
            changes[path] = text
        else:
            changes[path] = (house_root / path).read_text(encoding="utf-8") + text
    return changes


@pytest.mark.parametrize(
    ("rule", "plants", "named"),
    PLANTED,
    ids=[
        f"{rule.__name__}-{'+'.join(Path(p.removesuffix('#new')).name for p in plants)}" for rule, plants, _ in PLANTED
    ],
)
def test_a_planted_violation_is_caught(rule: Rule, plants: dict[str, str], named: str) -> None:
    found = rule(load(REPO, _planted(REPO, plants)))
    assert found and all(named in line for line in found), found


def test_a_missing_runs_on_line_is_caught() -> None:
    path = f"{A}/boundary/spool.py"
    text = (REPO / path).read_text(encoding="utf-8").replace("Runs on:", "Runs:", 1)
    expected = f"{path}: its docstring needs a 'Runs on: both sides' line (found None)"
    assert rule_runs_on_lines(load(REPO, {path: text})) == [expected]


def test_a_file_missing_from_the_architecture_is_listed() -> None:
    """The check lists what is missing: a file whose stem leaves its folder's lines is named, and only it."""
    text = (REPO / ARCHITECTURE).read_text(encoding="utf-8").replace("root_dir", "root-dir")
    missing = rule_architecture_names_every_file(load(REPO, {ARCHITECTURE: text}))
    assert missing == [f"{ARCHITECTURE} does not name {A}/root_side/root_dir.py (on the lines of {A}/root_side/)"]

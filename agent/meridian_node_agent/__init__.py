"""The meridian-node pull agent: CLI, agent loop and reference control plane.

Everything the agent shares with the collection's modules (contracts, trust, policy, NVML, engines,
artifact store) lives in ``ansible_collections.meridian.node.plugins.module_utils``; this package only
adds what runs off the managed path.

A standard wheel carries its own copy of the collection in ``collection/`` beside this file (hatch_build.py);
it goes first on ``sys.path`` here, before any submodule imports the collection, so the agent's Python and
the playbooks it runs (``apply.py`` derives ``ANSIBLE_COLLECTIONS_PATH`` from where ``module_utils`` was
imported) use the copy that shipped with this version, whatever else is installed. An editable install
has no ``collection/``: it reaches the checkout through .build/collections.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SHIPPED_COLLECTION = Path(__file__).resolve().parent / "collection"
if (_SHIPPED_COLLECTION / "ansible_collections").is_dir() and str(_SHIPPED_COLLECTION) not in sys.path:
    sys.path.insert(0, str(_SHIPPED_COLLECTION))


def package_version() -> str:
    """galaxy.yml's version, which the wheel takes as its own (pyproject.toml, [tool.hatch.version])."""
    # Imported here: importlib.metadata costs some 30 ms (it loads the email package), which every verb
    # would pay at start for a version only --version prints.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meridian-node")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


class VersionAction(argparse.Action):
    """``--version`` that looks the version up only when asked (argparse's own needs it up front)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()

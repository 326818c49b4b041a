"""``ansible-lint`` run where an operator meets the collection, in its installed copy, passes: the tarball ships
the lint config that keeps generated and data YAML out of it, and the playbooks and roles lint clean."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.system.packaging.packaging_env import BIN, run

pytestmark = pytest.mark.slow


def test_ansible_lint_passes_in_the_installed_collection(collection_tarball: Path, tmp_path: Path) -> None:
    collections = tmp_path / "collections"
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")}
    # Only the installed copy: not the checkout that the dev venv links into its collection path.
    env.update(ANSIBLE_COLLECTIONS_PATH=str(collections), PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}")
    run([BIN / "ansible-galaxy", "collection", "install", "--force", "-p", collections, collection_tarball], env=env)
    installed = collections / "ansible_collections" / "meridian" / "node"
    assert (installed / ".ansible-lint").is_file(), "the tarball does not ship .ansible-lint (galaxy.yml manifest)"
    result = run([BIN / "ansible-lint", "--offline", "--nocolor"], env=env, cwd=installed)
    assert "0 failure(s), 0 warning(s)" in result.stdout + result.stderr, result.stdout + result.stderr

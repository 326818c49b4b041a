"""galaxy.yml, the modules' docs and the changelog agree: one repository, one version, Python 3.9 for hosts."""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import version as installed_version
from typing import Any

import yaml

import ansible_collections.meridian.node.plugins.modules as modules
from ansible_collections.meridian.node.tests.system.packaging.packaging_env import CHECKOUT


def _galaxy() -> dict[str, Any]:
    galaxy = yaml.safe_load((CHECKOUT / "galaxy.yml").read_text())
    assert isinstance(galaxy, dict)
    return galaxy


def _seealso_links() -> dict[str, list[str]]:
    links: dict[str, list[str]] = {}
    for info in pkgutil.iter_modules(modules.__path__):
        module = importlib.import_module(f"{modules.__name__}.{info.name}")
        doc = yaml.safe_load(module.DOCUMENTATION)
        links[info.name] = [entry["link"] for entry in doc.get("seealso", []) if "link" in entry]
    return links


def test_galaxy_urls_name_the_repository() -> None:
    galaxy = _galaxy()
    repository = galaxy["repository"]
    assert repository.startswith("https://") and "example" not in repository
    assert galaxy["issues"] == f"{repository}/issues"
    assert galaxy["documentation"].startswith(f"{repository}/blob/main/")
    assert (CHECKOUT / galaxy["documentation"].removeprefix(f"{repository}/blob/main/")).is_file()


def test_module_seealso_links_into_the_repository_name_files_that_exist() -> None:
    repository = _galaxy()["repository"]
    into_repository = {
        name: [link for link in links if link.startswith("https://github.com/")]
        for name, links in _seealso_links().items()
    }
    assert any(into_repository.values()), "no module links into the repository: this test checks nothing"
    for name, links in into_repository.items():
        for link in links:
            assert link.startswith(f"{repository}/blob/main/"), f"{name}: {link} is not under {repository}"
            path = link.removeprefix(f"{repository}/blob/main/").partition("#")[0]
            assert (CHECKOUT / path).is_file(), f"{name}: {link} names {path}, which does not exist"


def test_the_installed_package_has_the_galaxy_version() -> None:
    # `make venv` reinstalls when galaxy.yml changes; a stale install would report the old version.
    assert installed_version("meridian-node") == _galaxy()["version"]


def test_host_python_is_three_nine_everywhere_it_is_stated() -> None:
    config = yaml.safe_load((CHECKOUT / "tests" / "config.yml").read_text())
    assert config["modules"]["python_requires"] == ">=3.9"
    makefile = (CHECKOUT / "Makefile").read_text()
    assert "--target=3.9-" in makefile


def test_changelog_has_a_release_of_the_galaxy_version() -> None:
    # antsibull-changelog release writes it; a bumped galaxy.yml without a release fails here.
    changelog = yaml.safe_load((CHECKOUT / "changelogs" / "changelog.yaml").read_text())
    release = changelog["releases"][_galaxy()["version"]]
    assert release["changes"]["release_summary"]
    assert (CHECKOUT / "CHANGELOG.rst").read_text().count(f"v{_galaxy()['version']}") == 1

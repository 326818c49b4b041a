"""The alert rules, their promtool tests and the Grafana dashboard ship in the Galaxy tarball (docs/METRICS.md
says where an operator finds them in the installed collection)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from ansible_collections.meridian.node.tests.system.packaging.packaging_env import CHECKOUT

pytestmark = pytest.mark.slow


def test_the_tarball_ships_every_file_of_extras(collection_tarball: Path) -> None:
    with tarfile.open(collection_tarball) as archive:
        names = {member.name for member in archive.getmembers() if member.isfile()}
    extras = {str(path.relative_to(CHECKOUT)) for path in (CHECKOUT / "extras").rglob("*") if path.is_file()}
    assert {
        "extras/prometheus/meridian-node.rules.yml",
        "extras/prometheus/meridian-node.rules.test.yml",
        "extras/grafana/meridian-node.json",
    } <= extras
    assert extras <= names

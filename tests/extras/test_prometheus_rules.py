"""The alert rules and the dashboard shipped in extras/: promtool checks and unit-tests the rules, and every series
they or the dashboard name is one the agent exports, so that neither drifts from the code.

promtool is Debian's ``prometheus`` package (.ci/run installs it). Without it these tests skip, except where
``MERIDIAN_REQUIRE_DOCKER=1`` says this is CI, where a missing tool fails them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meridian_node_agent.agent_side.metrics import Metrics

CHECKOUT = Path(__file__).resolve().parents[2]
RULES = CHECKOUT / "extras" / "prometheus" / "meridian-node.rules.yml"
RULES_TEST = CHECKOUT / "extras" / "prometheus" / "meridian-node.rules.test.yml"
DASHBOARD = CHECKOUT / "extras" / "grafana" / "meridian-node.json"
# A metric name in PromQL: the agent's prefix, then name characters (label names inside braces never start so).
_SERIES = re.compile(r"\bmeridian_node_[a-zA-Z0-9_]*")
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool is not installed (Debian package prometheus: apt-get install prometheus)"
        if os.environ.get("MERIDIAN_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{message}; CI (MERIDIAN_REQUIRE_DOCKER=1) must run the alert rules' tests", pytrace=False)
        pytest.skip(message)
    return found


def test_promtool_finds_the_rules_valid(promtool: str) -> None:
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name],
        cwd=RULES_TEST.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_and_a_section_in_the_docs() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test["alert_rule_test"]
    }
    documented = set(
        re.findall(r"^### (MeridianNode\w+)$", (CHECKOUT / "docs" / "METRICS.md").read_text(), re.MULTILINE)
    )
    assert alerts == tested
    assert alerts == documented


def exported_names() -> set[str]:
    """Every series name a fresh agent's endpoint lists: families are listed (HELP, TYPE) even without samples."""
    names: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(Metrics().registry).decode()):
        names.add(family.name)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def _rule_expressions() -> Iterator[str]:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield rule["expr"]


def _dashboard_expressions(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict | str):
                yield from _dashboard_expressions(value) if isinstance(value, dict) else [value]
            else:
                yield from _dashboard_expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_expressions(item)


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_series_the_rules_and_the_dashboard_name_is_exported_by_the_agent(source: str) -> None:
    expressions = list(
        _rule_expressions() if source == "rules" else _dashboard_expressions(json.loads(DASHBOARD.read_text()))
    )
    named = {name for expression in expressions for name in _SERIES.findall(expression)}
    assert len(named) >= 10, named  # the expressions were found at all
    assert named - exported_names() == set()


def exported_families() -> set[str]:
    """The family names a fresh agent's endpoint lists, as Prometheus' text parser names them."""
    return {family.name for family in text_string_to_metric_families(generate_latest(Metrics().registry).decode())}


def test_the_dashboard_shows_every_series_the_agent_exports() -> None:
    # Not Grafana's rule: ours, so that a series added to the agent is shown, not forgotten.
    dashboard = json.loads(DASHBOARD.read_text())
    named = {name for expression in _dashboard_expressions(dashboard) for name in _SERIES.findall(expression)}
    families = {name for name in exported_families() if not name.endswith("_created")}
    shown = {name for name in families if any(used == name or used.startswith(name + "_") for used in named)}
    assert families - shown == set()


def test_docs_metrics_lists_every_series_the_agent_exports() -> None:
    documented = set(
        re.findall(r"^\| `(meridian_node_\w+)` \|", (CHECKOUT / "docs" / "METRICS.md").read_text(), re.MULTILINE)
    )
    families = {name for name in exported_families() if not name.endswith("_created")}
    listed = {name for name in families if any(doc == name or doc.startswith(name + "_") for doc in documented)}
    assert families - listed == set()
    assert documented - exported_names() == set()  # nor a series the agent does not export

"""docs/CONFIG.md is what ``make config-doc`` writes from the config model, and the model documents every field."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from meridian_node_agent.config import AgentConfig
from meridian_node_agent.dev import config_doc


def test_the_committed_config_doc_is_the_generators_output() -> None:
    committed = config_doc.CONFIG_DOC.read_text(encoding="utf-8")
    assert committed == config_doc.render(), "docs/CONFIG.md is stale: run `make config-doc` and commit it"


def test_every_config_field_is_on_the_page_with_its_description() -> None:
    page = config_doc.render()
    pending: list[tuple[str, type[BaseModel]]] = [("", AgentConfig)]
    seen = 0
    while pending:
        prefix, model = pending.pop()
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            row = next((line for line in page.splitlines() if line.startswith(f"| `{path}` |")), None)
            assert row is not None, f"{path} has no row in docs/CONFIG.md"
            assert field.description, f"{path} has no Field(description=...) in config.py"
            assert field.description.replace("|", "\\|") in row
            seen += 1
            nested = config_doc._section_model(field.annotation)
            if nested is not None:
                pending.append((f"{path}.", nested))
    assert seen > 30


def test_a_field_added_to_the_model_changes_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    class Probe(AgentConfig):
        spare_seconds: int = Field(default=5, description="a field the real model does not have")

    before = config_doc.render()
    monkeypatch.setattr(config_doc, "AgentConfig", Probe)
    after = config_doc.render()

    assert "| `spare_seconds` | integer | `5` | a field the real model does not have |" in after
    assert "spare_seconds" not in before

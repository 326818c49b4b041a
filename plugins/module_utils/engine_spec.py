"""One engine's generic spec, as ``engine_instance`` runs it: the ``EngineSpec`` contract without pydantic.

``contracts.EngineSpec`` is the wire form (inside a desired state, with its JSON schema). The engine
modules validate the same fields with ``parse_engine_spec`` instead, because an Ansible task is a fresh
process and pydantic would be most of its start-up (see ``plain_checks``). The two must accept and
refuse the same documents: ``tests/unit/test_engine_spec.py`` holds them to it over a table, and both
take their patterns and driver names from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.plain_checks import (
    FieldError,
    check_choice,
    check_int,
    check_mapping,
    check_str,
    check_str_list,
    check_str_map,
    join,
)

__all__ = [
    "DRIVERS",
    "ENGINE_STATES",
    "IMAGE_REFERENCE",
    "NAME_PATTERN",
    "REPLACE_STRATEGIES",
    "EngineSpec",
    "FieldError",
    "ModelRef",
    "parse_engine_spec",
]

DRIVERS = ("vllm", "tgi", "sglang", "ollama", "llamacpp", "lmdeploy", "openai")
ENGINE_STATES = ("started", "stopped", "absent")
REPLACE_STRATEGIES = ("drain-then-replace", "stop-then-start")

# Names of engines and artifacts: they become container names, label values and store directories.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"
_NAME = re.compile(NAME_PATTERN)

# repository[:tag]@sha256:<64 hex>. Whether a digest is *required* is policy's call, not the contract's;
# the contract only insists the reference is well formed.
IMAGE_REFERENCE = re.compile(
    r"^(?P<repository>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
IMAGE_REFERENCE_FORM = "repository[:tag][@sha256:<64 hex>]"
NAME_FORM = "a lowercase name of 1-63 letters, digits, '.', '_' or '-'"

_REQUIRED = ("name", "driver", "image", "model", "port")
_OPTIONAL = ("served_model_name", "gpus", "min_vram_mib", "args", "env", "state", "replace_strategy")


@dataclass(frozen=True)
class ModelRef:
    """A promoted artifact in the local store, or a model name for engines that manage their own."""

    artifact: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {key: value for key, value in (("artifact", self.artifact), ("name", self.name)) if value is not None}


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    name: str
    driver: str
    image: str
    model: ModelRef
    port: int
    served_model_name: str | None = None
    gpus: tuple[str, ...] = ()
    min_vram_mib: int = 0
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    state: str = "started"
    replace_strategy: str = "drain-then-replace"


def parse_engine_spec(data: Any, where: str = "") -> EngineSpec:
    """Validate one engine spec; the first problem raises ``FieldError`` naming the field and value."""
    document = check_mapping(data, where, required=_REQUIRED, optional=_OPTIONAL)
    served = document.get("served_model_name")
    return EngineSpec(
        name=check_str(document["name"], join(where, "name"), pattern=_NAME, what=NAME_FORM),
        driver=check_choice(document["driver"], join(where, "driver"), DRIVERS),
        image=check_str(document["image"], join(where, "image"), pattern=IMAGE_REFERENCE, what=IMAGE_REFERENCE_FORM),
        model=_parse_model(document["model"], join(where, "model")),
        port=check_int(document["port"], join(where, "port"), ge=1, le=65535),
        served_model_name=None if served is None else check_str(served, join(where, "served_model_name")),
        gpus=check_str_list(document.get("gpus", []), join(where, "gpus")),
        min_vram_mib=check_int(document.get("min_vram_mib", 0), join(where, "min_vram_mib"), ge=0),
        args=check_str_list(document.get("args", []), join(where, "args")),
        env=check_str_map(document.get("env", {}), join(where, "env")),
        state=check_choice(document.get("state", "started"), join(where, "state"), ENGINE_STATES),
        replace_strategy=check_choice(
            document.get("replace_strategy", "drain-then-replace"), join(where, "replace_strategy"), REPLACE_STRATEGIES
        ),
    )


def _parse_model(data: Any, where: str) -> ModelRef:
    document = check_mapping(data, where, optional=("artifact", "name"))
    artifact, name = document.get("artifact"), document.get("name")
    if (artifact is None) == (name is None):
        raise FieldError(where, "model needs exactly one of 'artifact' or 'name'")
    if artifact is not None:
        return ModelRef(artifact=check_str(artifact, join(where, "artifact"), pattern=_NAME, what=NAME_FORM))
    return ModelRef(name=check_str(name, join(where, "name")))

"""bench/fleet.py's observation bodies: what an agent on an 8x H100 host serving one engine posts.

The GPU part is the agent's own reader on the fake NVML: ``collect_gpu_facts`` over the fake pynvml's generated
HGX board of eight H100 SXM (tests/support/fakes/pynvml.py), read as ``GpuHealthWatch`` reads it (processes
off, NVLink peers and health on) and validated as ``GpuFacts`` as ``Observer.gpu`` does. ``VARIANTS`` readings
of it differ in utilization, memory used, temperature and power, as successive reads of a host serving
traffic do; a simulated node whose GPUs are busy moves to another variant at each GPU refresh, which changes
its observation's fingerprint exactly as a real read does. Around it: one ready vLLM engine on the eight
GPUs (so ``/v1/serving`` lists every node), one artifact, the capacity left and the last run.

Every variant is checked by ``Observation.model_validate_json`` on the bytes it posts. Building a body is
string concatenation around pre-serialised parts: the generator must not spend its core re-serialising
17 KiB of GPU facts per post.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    API_VERSION,
    GpuFacts,
    Observation,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts import collect_gpu_facts
from ansible_collections.meridian.node.tests.support.fake_nvml import load_fake_pynvml

__all__ = ["GPUS", "VARIANTS", "ObservationBodies"]

GPUS = 8
VARIANTS = 8
ENGINE_PORT = 8000
_MIB = 1048576


@dataclass(frozen=True)
class ObservationBodies:
    """The pre-serialised observation of each GPU variant; ``body`` fills in one node's fields."""

    tails: tuple[bytes, ...]  # per variant: everything after the node's own fields, closing brace included

    @classmethod
    def build(cls, seed: int = 0) -> ObservationBodies:
        rng = random.Random(seed)
        fake = load_fake_pynvml()
        tails = []
        for _variant in range(VARIANTS):
            scenario = fake.generate_scenario(GPUS)
            for gpu in scenario["gpus"]:
                total = gpu["memory"]["total"]
                used = rng.randint(60_000, 78_000) * _MIB
                gpu["memory"] = {"total": total, "used": used, "free": total - used}
                gpu["utilization"] = {"gpu": rng.randint(55, 100), "memory": rng.randint(30, 95)}
                gpu["temperature"] = rng.randint(48, 78)
                gpu["power_usage_mw"] = rng.randint(350_000, 690_000)
            fake.use_scenario(scenario)
            facts = GpuFacts.model_validate(
                collect_gpu_facts(fake, processes=False, nvlink=True, machine_type_path=None)
            ).model_dump(mode="json")
            if facts["count"] != GPUS:
                raise RuntimeError(f"the fake NVML read {facts['count']} GPUs, not {GPUS}: {facts.get('reason')}")
            rest = json.dumps(_around(facts), separators=(",", ":"))
            tails.append(rest[1:].encode())  # without its opening brace: it follows the node's fields
        bodies = cls(tuple(tails))
        for variant in range(VARIANTS):  # the bytes a node posts are a valid Observation
            Observation.model_validate_json(bodies.body("check-node-1", 1, 1, variant))
        return bodies

    def body(self, node_id: str, epoch: int, applied_generation: int, variant: int) -> bytes:
        head = (
            f'{{"apiVersion":"{API_VERSION}","kind":"Observation","node_id":"{node_id}","lease_epoch":{epoch},'
            f'"observed_at":"{format_rfc3339(datetime.now(UTC))}","mode":"managed-host",'
            f'"applied_generation":{applied_generation},'
        )
        return head.encode() + self.tails[variant]


def _around(facts: dict[str, Any]) -> dict[str, Any]:
    """The observation's other parts: one ready engine on the eight GPUs, its model, capacity, the last run."""
    uuids = [gpu["uuid"] for gpu in facts["gpus"]]
    return {
        "gpu": facts,
        "engines": [
            {
                "name": "llm",
                "managed": True,
                "driver": "vllm",
                "image": "registry.local/vllm-openai@sha256:" + "5" * 64,
                "state": "running",
                "ready": True,
                "draining": False,
                "port": ENGINE_PORT,
                "served_model_name": "llama-3.1-70b-instruct",
                "restarts": 0,
                "exit_code": None,
                "exit_reason": None,
                "ready_since": "2026-01-01T00:00:00Z",
                "last_lines": None,
            }
        ],
        "artifacts": [
            {
                "name": "llama-3.1-70b-instruct",
                "version": "2024-07-23",
                "size_bytes": 141_107_412_736,
                "pinned": True,
                "current": True,
            }
        ],
        "capacity": {"vram_free_mib": {uuid: 2048 for uuid in uuids}, "free_ports": list(range(8001, 8016))},
        "last_run": {
            "ident": "20260101T000000-7f3a",
            "generation": 1,
            "status": "successful",
            "changed": 2,
            "failed": 0,
            "finished_at": "2026-01-01T00:00:00Z",
        },
        "kubernetes": None,
        "cordons": [],
        "refused_state": None,
    }

"""schemathesis against the real devserver, over mutual TLS: no 5xx, and every answer as /openapi.json says.

The document is fetched from the server (with the node's certificate) and every operation in it is driven
with generated requests: valid ones (``positive``) and ones the document says are wrong (``negative``).
Half of the requests speak for the enrolled node (its id in the path, and in a body with its current lease
epoch, every whole number spelled as an integer), so they reach the control plane's own checks, the store
and the serving projection instead of stopping at ``403 wrong-node`` or ``422`` for a ``2.0``; the other
half keep what was generated, ``2.0`` included, which the server must refuse as documented. Hypothesis runs
a bounded, seeded number of examples per operation and mode (``EXAMPLES``), without a database, so a run is
repeatable and takes well under a minute on two cores.

``positive_data_acceptance`` is left out, and why: the document cannot promise that a well-formed request
is accepted. A generated CSR never parses (``422 bad-csr``), a generated token was never issued (``403``),
and a generated epoch is not the node's (``409``); those refusals are documented answers, which the
status-code and schema checks hold the server to.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from ansible_collections.meridian.node.tests.support.devserver_fixtures import DevServerOptions
from meridian_node_agent.agent_side.identity import NodeIdentity

# schemathesis's generic parameters say nothing these tests use.
_Operation = APIOperation[Any, Any, Any, Any]
_Case = Case[Any]

# Per operation and generation mode (at most: hypothesis stops early when an operation has fewer distinct
# requests, such as one without parameters). About 600 requests in 40 s on two shared cores.
EXAMPLES = 60
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


# A long-poll the generator asks for (wait up to the document's maximum) then holds a request one second.
DEVSERVER_OPTIONS = DevServerOptions(extra=["--max-wait-seconds", "1"])


@pytest.fixture
def mtls_session(server: DevServer, tmp_path: Path, node_id: str) -> Iterator[requests.Session]:
    with enroll_node(server, tmp_path / node_id, node_id):
        pass
    identity = NodeIdentity(tmp_path / node_id)
    state = tmp_path / "state.yaml"
    state.write_text(yaml.safe_dump({"engines": [], "artifacts": []}))
    server.cli("publish", node_id, str(state))
    with requests.Session() as session:
        # The environment's CA bundle (REQUESTS_CA_BUNDLE) would win over the session's otherwise.
        session.trust_env = False
        session.cert = (str(identity.cert_path), str(identity.key_path))
        session.verify = str(identity.ca_path)
        yield session


@dataclass
class _Fuzzer:
    """Drives one operation at a time and counts the answers, by operation and status."""

    base_url: str
    session: requests.Session
    node_id: str
    epoch: int
    answers: Counter[str] = field(default_factory=Counter)

    def run(self, operation: _Operation, mode: GenerationMode) -> None:
        free = operation.as_strategy(generation_mode=mode)
        aimed = operation.as_strategy(generation_mode=mode, path_parameters=_node_path(operation.path, self.node_id))

        @seed(25)
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=st.one_of(free, aimed.map(lambda case: _speak_for(case, self.node_id, self.epoch))))
        def exercise(case: _Case) -> None:
            response = case.call_and_validate(
                base_url=self.base_url,
                session=self.session,
                checks=CHECKS,
                # schemathesis passes its own verify (True: the system's CAs) unless given one per call.
                verify=self.session.verify,
                cert=self.session.cert,
                timeout=10,
            )
            self.answers[f"{operation.label} -> {response.status_code}"] += 1

        exercise()


@pytest.mark.slow
def test_schemathesis_finds_nothing(
    server: DevServer, mtls_session: requests.Session, node_id: str, record_property: Callable[[str, Any], None]
) -> None:
    answer = mtls_session.get(f"{server.base_url}/openapi.json", timeout=10)
    assert answer.status_code == 200, answer.text
    document = answer.json()
    schema = schemathesis.openapi.from_dict(document)
    epoch = mtls_session.post(f"{server.base_url}/v1/nodes/{node_id}/heartbeat", timeout=10).json()["epoch"]
    fuzzer = _Fuzzer(server.base_url, mtls_session, node_id, epoch)
    labels = set()
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an Err would raise its InvalidSchema here
        labels.add(operation.label)
        definition = document["paths"][operation.path][operation.method.lower()]
        # An operation that takes nothing has no wrong request to send.
        takes_input = "parameters" in definition or "requestBody" in definition
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,):
            fuzzer.run(operation, mode)
    total = sum(fuzzer.answers.values())
    record_property("schemathesis_requests", total)
    print(f"schemathesis: {total} requests, by answer:\n" + json.dumps(dict(sorted(fuzzer.answers.items())), indent=1))
    # Every operation answered, and requests for the enrolled node got past authentication.
    assert {label.split(" -> ")[0] for label in fuzzer.answers} == labels
    assert fuzzer.answers["POST /v1/nodes/{node_id}/observations -> 204"], fuzzer.answers
    assert fuzzer.answers["GET /v1/nodes/{node_id}/desired-state -> 200"], fuzzer.answers


def _node_path(path: str, node_id: str) -> dict[str, str] | None:
    return {"node_id": node_id} if "{node_id}" in path else None


def _speak_for(case: _Case, node_id: str, epoch: int) -> _Case:
    """The case with the enrolled node's id and epoch in its body where it has them, and no ``2.0``."""
    if isinstance(case.body, dict):
        body: dict[str, Any] = _integers(case.body)
        if "node_id" in body:
            body["node_id"] = node_id
        if "lease_epoch" in body:
            body["lease_epoch"] = epoch
        case.body = body
    return case


def _integers(value: Any) -> Any:
    """``value`` with each whole float (schemathesis's spelling of some integers) turned into the int."""
    if isinstance(value, dict):
        return {key: _integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integers(item) for item in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value

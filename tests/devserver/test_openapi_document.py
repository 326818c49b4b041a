"""The devserver's /openapi.json: every route in it, every refusal a route raises in it, the same schemas as
contracts/v1, and served only to a client with a node certificate."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from fastapi.routing import APIRoute

from ansible_collections.meridian.node.tests.devserver.devserver_process import DevServer, enroll_node
from meridian_node_agent.agent_side.identity import NodeIdentity
from meridian_node_agent.dev import schemas
from meridian_node_agent.devserver.control import plane as control_module
from meridian_node_agent.devserver.control.plane import ControlPlane, Settings, open_control_plane
from meridian_node_agent.devserver.serving import app as app_module
from meridian_node_agent.devserver.serving.app import create_app
from meridian_node_agent.devserver.serving.openapi import OPENAPI_PATH, openapi_document, operations

DOCUMENT = openapi_document(Settings.max_wait_s)


@pytest.fixture
def control(tmp_path: Path) -> Iterator[ControlPlane]:
    opened = open_control_plane(tmp_path / "data", database=":memory:")
    yield opened
    opened.close()


def test_every_route_the_app_serves_is_in_the_document_and_nothing_else(control: ControlPlane) -> None:
    served = {
        (route.path, method.lower())
        for route in create_app(control).routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    }
    documented = {(path, method) for path, item in DOCUMENT["paths"].items() for method in item}
    assert served == documented


def _raised(source: Path) -> set[tuple[int, str]]:
    """(status, reason) of every ``ProtocolError(status, "reason", ...)`` written out in ``source``."""
    return {
        (int(status), reason)
        for status, reason in re.findall(r'ProtocolError\(\s*(\d{3}),\s*"([a-z-]+)"', source.read_text())
    }


def test_every_refusal_the_app_and_control_plane_spell_out_is_documented() -> None:
    documented = {
        (status, reason)
        for operation in operations(60)
        for status, reasons in operation.refusals.items()
        for reason in reasons
    }
    raised = _raised(Path(app_module.__file__)) | _raised(Path(control_module.__file__))
    assert raised, "the pattern no longer finds the refusals: update it"
    assert raised <= documented, raised - documented


def _as_component(node: Any) -> Any:
    """A contracts/v1 schema fragment as the document holds it: references into components, not $defs."""
    if isinstance(node, dict):
        return {key: _as_component(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_as_component(value) for value in node]
    if isinstance(node, str) and node.startswith("#/$defs/"):
        return node.replace("#/$defs/", "#/components/schemas/")
    return node


@pytest.mark.parametrize(
    ("stem", "component"),
    [
        ("enrollment-request", "EnrollmentRequest"),
        ("enrollment-response", "EnrollmentResponse"),
        ("lease", "Lease"),
        ("envelope", "Envelope"),
        ("observation", "Observation"),
        ("certificate-renewal-request", "CertificateRenewalRequest"),
        ("serving-projection", "ServingProjection"),
    ],
)
def test_each_body_s_schema_is_its_contracts_v1_schema(stem: str, component: str) -> None:
    published = json.loads(schemas.schema_path(stem).read_text(encoding="utf-8"))
    definitions = published.pop("$defs", {})
    for key in ("$schema", "$id", "$comment"):
        published.pop(key, None)
    components = DOCUMENT["components"]["schemas"]
    assert components[component] == _as_component(published)
    for name, definition in definitions.items():
        assert components[name] == _as_component(definition), name


def test_integers_carry_the_literal_format_in_the_document_too() -> None:
    epoch = DOCUMENT["components"]["schemas"]["Lease"]["properties"]["epoch"]
    assert epoch["type"] == "integer"
    assert epoch["format"] == "integer-literal"
    assert "integer-literal" in DOCUMENT["info"]["description"]


def _wait_limit(document: dict[str, Any]) -> float:
    parameters = document["paths"]["/v1/nodes/{node_id}/desired-state"]["get"]["parameters"]
    return float(next(parameter for parameter in parameters if parameter["name"] == "wait")["schema"]["maximum"])


def test_the_long_poll_limit_in_the_document_is_the_server_s() -> None:
    assert _wait_limit(DOCUMENT) == Settings.max_wait_s
    assert _wait_limit(openapi_document(Settings(max_wait_s=1.5).max_wait_s)) == 1.5
    with pytest.raises(ValueError, match="max_wait_seconds must be from 0 to 3600, got -1"):
        Settings(max_wait_s=-1)


def test_the_document_needs_a_node_certificate_and_is_what_the_server_runs(
    server: DevServer, tmp_path: Path, node_id: str
) -> None:
    url = f"{server.base_url}{OPENAPI_PATH}"
    with requests.Session() as anonymous:
        anonymous.trust_env = False
        refused = anonymous.get(url, verify=str(server.ca_bundle), timeout=10)
    assert refused.status_code == 403
    assert refused.json()["reason"] == "client-certificate-required"
    with enroll_node(server, tmp_path / node_id, node_id):
        pass
    identity = NodeIdentity(tmp_path / node_id)
    with requests.Session() as node:
        node.trust_env = False
        answer = node.get(
            url, cert=(str(identity.cert_path), str(identity.key_path)), verify=str(identity.ca_path), timeout=10
        )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == json.loads(json.dumps(DOCUMENT))


def test_a_wrong_method_is_refused_with_allow_and_the_error_body(server: DevServer) -> None:
    with requests.Session() as anonymous:
        anonymous.trust_env = False
        answer = anonymous.delete(f"{server.base_url}/v1/healthz", verify=str(server.ca_bundle), timeout=10)
    assert answer.status_code == 405
    assert answer.headers["allow"] == "GET"
    assert set(answer.json()) == {"reason", "detail"}


def test_the_curl_line_in_protocol_md_fetches_the_document(server: DevServer, tmp_path: Path, node_id: str) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    protocol = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    section = protocol.split("### `GET /openapi.json`", 1)[1]
    script = section.split("```sh\n", 1)[1].split("```", 1)[0]
    with enroll_node(server, tmp_path / "identity", node_id):
        pass
    script = script.replace("/var/lib/meridian-node/identity", str(tmp_path / "identity"))
    script = script.replace("https://control.example:8443", server.base_url)
    fetched = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert fetched.returncode == 0, fetched.stderr
    assert json.loads(fetched.stdout) == json.loads(json.dumps(DOCUMENT))

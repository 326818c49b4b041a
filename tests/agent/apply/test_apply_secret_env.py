"""A signed state's ``secret_env`` through the real apply path: ansible-runner runs reconcile.yml, whose
engine_set reads the secrets from the verified envelope, never from task arguments (issue 25).

The secret is one character, which the journal's scrub leaves alone (it only hunts values of 6 or more): it
stays out of every journal file because nothing writes it there, not because something rubbed it out. And
since nothing masks by content, the engine's name and plain env values are journaled whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.e2e_fixtures import prefix  # noqa: F401
from ansible_collections.meridian.node.tests.support.engine_harness import (
    SERVER,
    issue_25_engine,
    standin_policy,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image
from ansible_collections.meridian.node.tests.support.trust_fixtures import (
    NODE_ID,
    current_state,
    encode,
    make_key,
    signed,
)
from meridian_node_agent.apply.applier import Applier

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CONTROL = make_key()
SECRET = "\u01c2"  # one character that nothing else in a journal can hold
STARS = re.compile(r"(?<!\*)\*{8}(?!\*)")  # Ansible's mask alone, not a banner's run of stars


def test_a_signed_one_character_secret_reaches_the_engine_and_no_journal_file(
    tmp_path: Path,
    docker_client: Any,
    standin_base_image: LocalImage,
    prefix: str,  # noqa: F811 - the shared fixture, imported above
) -> None:
    vllm = ensure_engine_image(docker_client, standin_base_image, SERVER, engine="vllm")
    policy = standin_policy(tmp_path / "etc", ["vllm"], control=[CONTROL], store={"path": str(tmp_path / "store")})
    name = f"{prefix}-aud-tgi"
    engine = issue_25_engine(vllm, name, secret_env={"HF_TOKEN": SECRET})
    payload = current_state(1, engines=[engine])
    applier = Applier(state_dir=tmp_path / "state", node_id=NODE_ID, policy_path=str(policy))

    result = applier.apply(
        signed("desired-state", payload, [CONTROL]),
        generation=1,
        epoch=1,
        payload_sha256=hashlib.sha256(encode(payload)).hexdigest(),
        # As the agent passes them: the state's secret_env values, for the journal's scrub.
        secrets=[SECRET],
        lists_artifacts=False,
    )

    assert result.status == "successful", result.failures
    container = docker_client.containers.get(name)
    assert f"HF_TOKEN={SECRET}" in container.attrs["Config"]["Env"]
    assert SECRET not in json.dumps(container.labels, ensure_ascii=False)
    files = {path: path.read_text("utf-8") for path in sorted(result.journal.rglob("*")) if path.is_file()}
    text = "".join(files.values())
    assert SECRET not in text and json.dumps(SECRET)[1:-1] not in text
    # `command` holds ansible-runner's process environment, scrubbed by name on purpose (applier._KEEP_ENV).
    masked = [path.name for path, content in files.items() if path.name != "command" and STARS.search(content)]
    assert masked == [], "something was masked by content"
    assert f'"{name}"' in text
    assert '"MODE": "tgi"' in text and '"FLAG": "1"' in text
    assert '"HF_TOKEN": "<secret>"' in text

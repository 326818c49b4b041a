"""engine_set with ``env`` and ``secret_env``, run by ansible-playbook -vvv --diff on the real Docker Engine.

Issue 25: with env no_log, a value such as ``tgi`` or ``1`` was starred wherever it occurred (``engine
'aud-********'``, digits inside hashes and digests). Now env is shown whole and only secret_env is hidden. The
secrets are one character each - the hardest case for masking - chosen so that no other text can hold them,
which makes "appears nowhere" checkable with ``in``. The envelope path through ansible-runner's journal is
tests/agent/apply/test_apply_secret_env.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from ansible_collections.meridian.node.tests.support.engine_harness import Host, issue_25_engine
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SECRET = "\u01c2"
CHANGED = "\u01c3"
# Ansible's mask, alone: its banners are longer runs of stars.
STARS = re.compile(r"(?<!\*)\*{8}(?!\*)")


def hidden(text: str, *secrets: str) -> bool:
    """No secret in ``text``, raw or as JSON writes it (Ansible's -vvv output escapes non-ASCII)."""
    return not any(s in text or json.dumps(s)[1:-1] in text for s in secrets)


def steps(host: Host, plan: Sequence[tuple[str, Mapping[str, Any], bool]]) -> tuple[dict[str, Any], str]:
    paths = {"policy": str(host.policy), "state_dir": str(host.state_dir)}
    with_paths = [(label, {**paths, **params}, check) for label, params, check in plan]
    return host.play_module("meridian.node.engine_set", with_paths, extra_args=["-vvv"])


def test_one_character_secret_never_shows_and_plain_env_is_printed_whole(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-aud-tgi"
    spec = issue_25_engine(vllm, name)
    first = {"engines": [{**spec, "secret_env": {"HF_TOKEN": SECRET}}]}
    second = {"engines": [{**spec, "secret_env": {"HF_TOKEN": CHANGED}}]}
    results, output = steps(
        host,
        [
            ("check", first, True),
            ("apply", first, False),
            ("idempotent", first, False),
            ("idem-check", first, True),
            ("secret-changed-check", second, True),
            ("secret-changed", second, False),
            ("again", second, False),
        ],
    )
    for label, result in results.items():
        assert not result.get("failed"), (label, result.get("msg"))

    # Four steps with the same secret: created once, then nothing to do, and check mode says so beforehand.
    assert results["check"]["changed"] is True
    assert results["check"]["engines"][name]["actions"] == ["create", "start", "wait-ready"]
    assert results["apply"]["engines"][name]["done"] == ["create", "start", "wait-ready"]
    assert (results["idempotent"]["changed"], results["idem-check"]["changed"]) == (False, False)
    created = results["apply"]["engines"][name]["container"]["id"]
    assert results["idempotent"]["engines"][name]["container"]["id"] == created

    # A changed secret replaces the engine; the diff shows it as a changed config hash, the value as <secret>.
    predicted = results["secret-changed-check"]
    assert predicted["changed"] is True and predicted["engines"][name]["actions"], predicted
    diff = predicted["diff"]
    assert diff["before"][name]["config_hash"] != diff["after"][name]["config_hash"]
    assert diff["after"][name]["spec"]["secret_env"] == {"HF_TOKEN": "<secret>"}
    assert diff["after"][name]["spec"]["env"] == {"MODE": "tgi", "FLAG": "1"}
    assert results["secret-changed"]["engines"][name]["done"] == predicted["engines"][name]["actions"]
    replaced = host.container(name)
    assert replaced is not None and replaced.id != created
    assert f"HF_TOKEN={CHANGED}" in replaced.attrs["Config"]["Env"]
    assert results["again"]["changed"] is False

    # Nothing shows either secret, and nothing was starred: the name, env, hashes and digest print whole.
    assert hidden(output, SECRET, CHANGED) and hidden(json.dumps(results), SECRET, CHANGED)
    assert STARS.search(output) is None and STARS.search(json.dumps(results)) is None
    assert hidden(json.dumps(replaced.labels), SECRET, CHANGED)
    assert f"engine {name!r}" in output or f'"{name}"' in output
    assert '"MODE": "tgi"' in output and '"FLAG": "1"' in output
    for config_hash in (diff["before"][name]["config_hash"], diff["after"][name]["config_hash"]):
        assert config_hash in output
    assert vllm.pinned.split("@", 1)[1] in output

    info, info_output = host.play_module(
        "meridian.node.engine_info",
        [("info", {"policy": str(host.policy), "state_dir": str(host.state_dir), "capacity": False}, False)],
        extra_args=["-vvv"],
    )
    assert name in [engine["name"] for engine in info["info"]["engines"]]
    assert hidden(info_output, SECRET, CHANGED) and hidden(json.dumps(info), SECRET, CHANGED)

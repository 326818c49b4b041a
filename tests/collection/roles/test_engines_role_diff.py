"""The engines role under ``--check --diff``: the converge task shows each engine's plan (issue 25).

The task was ``no_log: true`` because env values were secrets, so a dry run of a rollout printed nothing but
"the output has been hidden". Now only ``secret_env`` is no_log (in the module and the role's argument spec),
and the diff shows the rest whole. Real ansible-playbook, real Docker Engine; check mode creates nothing.
"""

from __future__ import annotations

import json

import pytest

from ansible_collections.meridian.node.tests.support.engine_harness import (
    Host,
    issue_25_engine,
    run_playbook,
)
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SECRET = "\u01c2"  # one character that no other output can hold


def test_check_diff_of_the_role_previews_the_engine_and_hides_only_its_secret(
    host: Host, vllm: LocalImage, prefix: str
) -> None:
    name = f"{prefix}-aud-tgi"
    engine = issue_25_engine(vllm, name, secret_env={"HF_TOKEN": SECRET})
    variables = {
        "engines_policy": str(host.policy),
        "engines_state_dir": str(host.state_dir),
        "engines_instances": [engine],
    }
    playbook = host.root / "role.yml"
    playbook.write_text(
        json.dumps(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "roles": [{"role": "meridian.node.engines", "vars": variables}],
                }
            ]
        )
    )

    proc = run_playbook(playbook, temp_dir=host.root / "ansible-tmp", extra_args=["--check", "--diff"])
    output = proc.stdout + proc.stderr

    assert proc.returncode == 0, output[-4000:]
    assert "has been hidden" not in output, "the converge task's output is still no_log"
    assert f'"{name}"' in output
    assert '"MODE": "tgi"' in output and '"FLAG": "1"' in output
    assert '"HF_TOKEN": "<secret>"' in output
    assert SECRET not in output and json.dumps(SECRET)[1:-1] not in output
    assert host.container(name) is None, "check mode created the engine"

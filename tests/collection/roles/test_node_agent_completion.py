"""roles/node_agent's shell completion tasks (tasks/completion.yml), run for real by ansible-playbook on this
machine with the checkout's virtualenv standing in for /opt/meridian-node: the installed file completes
``meridian-node``'s verbs in a real bash, a second run changes nothing, and ``node_agent_shell_completion: false``
removes it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VENV = REPO / ".venv"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the role installs the file as root:root")

PLAY = """\
- name: The node_agent role's shell completion alone
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Run tasks/completion.yml
      ansible.builtin.include_role:
        name: meridian.node.node_agent
        tasks_from: completion
"""


def converge(tmp_path: Path, completion: Path, *, enabled: bool) -> str:
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAY)
    extra = {
        "node_agent_venv": str(VENV),
        "node_agent_completion_path": str(completion),
        "node_agent_shell_completion": enabled,
        "node_agent_dry_fresh": False,
    }
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / ".build" / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_PYTHON_INTERPRETER": str(VENV / "bin" / "python"),
    }
    done = subprocess.run(
        [VENV / "bin" / "ansible-playbook", "-i", "localhost,", "-c", "local", "-e", json.dumps(extra), playbook],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def changed(output: str) -> int:
    found = re.search(r"localhost\s*:.*changed=(\d+)", output)
    assert found, output
    return int(found.group(1))


def bash_completes(completion: Path, line: str) -> list[str]:
    """What bash offers for TAB at the end of ``line``, through the installed file's completion function."""
    words = line.split(" ")
    script = (
        f"source {completion}\n"
        f"COMP_LINE='{line}' COMP_POINT={len(line)} COMP_TYPE=9 COMP_CWORD={len(words) - 1}\n"
        f"COMP_WORDS=({' '.join(words)})\n"
        "complete -p meridian-node >/dev/null || exit 3\n"
        f"_python_argcomplete meridian-node '{words[-1]}' '{words[-2]}'\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return sorted(word.strip() for word in done.stdout.splitlines() if word.strip())


def test_the_role_installs_a_completion_that_bash_uses_and_removes_it_when_told(tmp_path: Path) -> None:
    completion = tmp_path / "share" / "bash-completion" / "completions" / "meridian-node"

    assert changed(converge(tmp_path, completion, enabled=True)) >= 1
    assert completion.is_file()
    assert oct(completion.stat().st_mode & 0o777) == "0o644"
    assert bash_completes(completion, "meridian-node ch") == ["check-config"]
    assert bash_completes(completion, "meridian-node gpu-health s") == ["show"]

    assert changed(converge(tmp_path, completion, enabled=True)) == 0

    assert changed(converge(tmp_path, completion, enabled=False)) == 1
    assert not completion.exists()

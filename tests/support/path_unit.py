"""The privilege split's systemd units, played by the tests: the root verb, and a path unit that runs it.

``apply_spooled`` runs the real ``meridian-node apply-spooled`` (what ``meridian-node-apply.service``
starts); ``PathUnit`` plays ``meridian-node-apply.path`` (``PathChanged=`` on the request file): each new
request file starts the verb once, in a thread, until the ``with`` block ends. ``write_split_config``
writes the root-owned config of such a node, which the verb reads; ``write_node_config`` writes one with its
policy and directories under one root, for the tests of root's other verbs (observe-engines, logs, gpu-health).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key, write_policy
from meridian_node_agent.agent_side.systemd_applier import watch_directory
from meridian_node_agent.boundary.spool import REQUEST_FILE, SPOOL_DIR


def write_split_config(
    path: Path,
    *,
    node_id: str,
    policy: Path,
    state_dir: Path,
    apply: Mapping[str, Any],
    mode: str = "managed-host",
) -> Path:
    """Write to ``path`` the root-owned config of a split node (as the apply unit reads it) and return it:
    ``node_id`` in ``mode``, ``policy``, the agent's ``state_dir``, the ``apply`` section, and a control plane that
    is never called (these nodes only apply what is spooled)."""
    config = {
        "node_id": node_id,
        "mode": mode,
        "policy": str(policy),
        "state_dir": str(state_dir),
        "control_plane": {"url": "https://127.0.0.1:9"},
        "apply": dict(apply),
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_node_config(
    root: Path,
    *,
    node_id: str,
    via: str = "systemd",
    mode: str = "managed-host",
    policy_extra: Mapping[str, Any] | None = None,
) -> Path:
    """``write_split_config`` of a node whose files all lie under ``root``: a policy in ``root/etc`` trusting a
    fresh control key (plus ``policy_extra``), the agent's ``root/state``, root's ``root/apply`` applying ``via``;
    the config is ``root/config.yaml``. No directory but ``etc`` is made."""
    policy = write_policy(root / "etc", control=[make_key()], extra=policy_extra)
    apply = {"via": via, "state_dir": str(root / "apply")}
    return write_split_config(
        root / "config.yaml", node_id=node_id, policy=policy, state_dir=root / "state", apply=apply, mode=mode
    )


def apply_spooled(config_path: Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One run of the root verb; ``env`` is root's environment (default: this process's, as it is now)."""
    return subprocess.run(
        [sys.executable, "-m", "meridian_node_agent.cli", "--config", str(config_path), "apply-spooled"],
        capture_output=True,
        text=True,
        timeout=300,
        env=None if env is None else dict(env),
        check=False,
    )


class PathUnit:
    """``PathChanged=`` on the request file starting a oneshot that runs the real verb.

    ``before`` is an attacker's move between the agent's write and root's read; ``env`` is root's
    environment, fixed when the unit starts however this process's environment changes meanwhile.

    As systemd does, a change made while the verb runs starts nothing (the verb reads the spool again after each
    answer; what it missed is lost); ``lose`` more are lost besides, the first ones: a trigger that never came.
    """

    def __init__(
        self,
        config_path: Path,
        state_dir: Path,
        *,
        before: Callable[[Path], None] | None = None,
        env: Mapping[str, str] | None = None,
        lose: int = 0,
    ) -> None:
        self.config_path = config_path
        self.before = before
        self.lose = lose
        self.env = None if env is None else dict(env)
        self.spool = state_dir / SPOOL_DIR
        self.runs: list[subprocess.CompletedProcess[str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PathUnit:
        self.spool.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=330)

    def _loop(self) -> None:
        seen: tuple[int, int] | None = None
        with watch_directory(self.spool) as watch:
            while not self._stop.is_set():
                current = self._request_identity()
                if current is not None and current != seen:
                    seen = current
                    if self.lose > 0:
                        self.lose -= 1
                        continue
                    if self.before is not None:
                        self.before(self.spool)
                    self.runs.append(apply_spooled(self.config_path, self.env))
                    seen = self._request_identity()  # what changed while it ran started nothing
                watch.wait(0.2)

    def _request_identity(self) -> tuple[int, int] | None:
        try:
            stat = (self.spool / REQUEST_FILE).stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns

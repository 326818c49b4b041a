"""Keep the tail of each of this node's engines' logs, scrubbed, where people without Docker access read it.

Runs on: both sides, whichever reads Docker: root's observe unit under the split (``root_side.observe_unit``, into
``<apply.state_dir>/public/logs``), the agent's observer in-process (``agent_side.observe.DockerEngines``, into
``<state_dir>/logs``). Only reads Docker: a list, an inspect per container and its image, its log.

Per engine of ``owner`` (the ``meridian.node/owner`` label, ``agent:<node id>``), one file
(``boundary.engine_logs_file``): the current container's last lines, and the previous container's when the
engine was recreated since. The text is scrubbed of the container's own environment (``docker.log_scrub``)
before it is split, cut or written. A file of an engine no longer listed is kept for ``KEEP_GONE_S`` after it
was last written (the last words of an engine that was removed), then removed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import (
    ContainerInfo,
    DockerEngine,
    DockerEngineError,
    ExitInfo,
)
from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import EnvScrubber
from ansible_collections.meridian.node.plugins.module_utils.engines.labels import LABEL_OWNER
from meridian_node_agent.boundary.engine_logs_file import (
    TAIL_LINES,
    EngineLogError,
    EngineLogTail,
    KeptRun,
    cap_line,
    check_logs_dir,
    log_path,
    read_log_tail,
    write_log_tail,
)

__all__ = ["KEEP_GONE_S", "KeptLogs", "keep_engine_logs"]

KEEP_GONE_S = 7 * 24 * 3600


@dataclass(frozen=True)
class KeptLogs:
    """What one pass kept: each engine's tail as written, and what went wrong (one line each, for a journal)."""

    tails: Mapping[str, EngineLogTail]
    problems: tuple[str, ...]


def keep_engine_logs(
    engine: DockerEngine,
    *,
    owner: str,
    directory: Path,
    read_at: str,
    group: int = -1,
    wall_clock: Callable[[], float] = time.time,
) -> KeptLogs:
    """Read and keep the tail of every engine of ``owner`` in ``directory`` (``group`` may read it).

    Raises ``DockerEngineError`` when Docker cannot list the containers, ``EngineLogError`` when ``directory`` is
    not safe to write in (nothing is written then); one engine that cannot be read or written is a problem in
    the result, and the others are still kept.
    """
    directory = check_logs_dir(directory, group=group)
    chosen: dict[str, ContainerInfo] = {}
    for container in engine.list_owned():
        if container.labels.get(LABEL_OWNER) != owner:
            continue
        name = container.instance or container.name
        # While an engine is replaced its old and new containers both show: the running one is the one to watch.
        if name not in chosen or (container.running and not chosen[name].running):
            chosen[name] = container
    tails: dict[str, EngineLogTail] = {}
    problems: list[str] = []
    images: dict[str, list[str]] = {}
    for name, container in sorted(chosen.items()):
        try:
            log_path(directory, name)  # a name no engine can have is refused before Docker is asked
            run = _read_run(engine, container, read_at, images)
            tail = EngineLogTail(engine=name, written_at=read_at, current=run, previous=_previous(directory, name, run))
            write_log_tail(directory, tail, group=group)
        except (DockerEngineError, EngineLogError, OSError) as exc:
            problems.append(f"engine {name!r}: {exc}")
            continue
        tails[name] = tail
    _forget_gone(directory, kept=set(chosen), now=wall_clock())
    return KeptLogs(tails=tails, problems=tuple(problems))


def _read_run(engine: DockerEngine, container: ContainerInfo, read_at: str, images: dict[str, list[str]]) -> KeptRun:
    try:
        attrs = engine.api.inspect_container(container.id)
        image_id = str(attrs.get("Image") or "")
        if image_id not in images:
            images[image_id] = _env(engine.api.inspect_image(image_id)) if image_id else []
        raw = engine.api.logs(container.id, tail=TAIL_LINES)
    except DockerApiError as exc:
        raise DockerEngineError(str(exc)) from exc  # one family for the caller, whichever call it was
    scrubber = EnvScrubber.from_env(_env(attrs), images[image_id])
    # Scrubbed whole, before any split or cut: a value with a newline in it is still found, and no cut leaves
    # the first half of a secret on one line.
    # A byte that is not UTF-8 is kept as a lone surrogate, so `logs --raw` can give it back (engine_logs_file).
    text = scrubber.scrub(raw.decode("utf-8", errors="surrogateescape"))
    lines = [cap_line(line) for line in text.splitlines()][-TAIL_LINES:]
    exited = ExitInfo.from_inspect(attrs)
    return KeptRun(
        container_id=container.id[:12],
        restarts=exited.restarts,
        state=str((attrs.get("State") or {}).get("Status") or container.state)[:40] or "unknown",
        exit_reason=exited.exit_reason,
        read_at=read_at,
        lines=tuple(lines),
    )


def _env(attrs: Mapping[str, Any]) -> list[str]:
    env = (attrs.get("Config") or {}).get("Env") or []
    return [entry for entry in env if isinstance(entry, str)]


def _previous(directory: Path, name: str, run: KeptRun) -> KeptRun | None:
    """The run to keep beside ``run``: the last container of this name that printed something, if not this one."""
    try:
        kept = read_log_tail(directory, name)
    except EngineLogError:
        return None  # none yet, or damaged: ours to overwrite (and never read through a symlink)
    if kept.current.container_id != run.container_id:
        # Recreated: the container before it is the one whose last words matter, unless it printed nothing
        # (a recreate that failed at once), and then the one before that still does.
        return kept.current if kept.current.lines else kept.previous
    return kept.previous


def _forget_gone(directory: Path, *, kept: set[str], now: float) -> None:
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(".json") or entry.name[: -len(".json")] in kept:
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode) or now - info.st_mtime > KEEP_GONE_S:
                    Path(entry.path).unlink()

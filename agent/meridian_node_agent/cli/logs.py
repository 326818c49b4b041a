"""``meridian-node logs ENGINE [--tail N]``: the kept tail of an engine's log, for the agent's user and group.

Reads the file the side that can read Docker keeps (``boundary.engine_logs_file``): root's observe unit under the
split (``<apply.state_dir>/public/logs/``, group-readable by the agent's group), the agent itself in-process
(``<state_dir>/logs/``). Needs neither root nor Docker access; asks nothing of Docker itself. docs/LOGS.md.
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from meridian_node_agent.boundary.engine_logs_file import (
    LOGS_DIR,
    TAIL_LINES,
    EngineLogError,
    EngineLogMissingError,
    EngineLogTail,
    KeptRun,
    log_path,
    read_log_tail,
)
from meridian_node_agent.boundary.engines_file import INVENTORY_FILE, InventoryError, read_inventory
from meridian_node_agent.boundary.spool import PUBLIC_DIR
from meridian_node_agent.config import AgentConfig, ConfigError, load_config
from meridian_node_agent.errors import UsageError

__all__ = ["add_parsers", "cmd_logs", "kept_logs_dir"]


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        "logs",
        help="print the kept tail of an engine's log (no root, no Docker access needed)",
        description="Print the last lines of ENGINE's log as this node keeps them: read from Docker by root's "
        "observe unit every 30 s under apply.via: systemd (<apply.state_dir>/public/logs/, readable by the "
        "agent's group), by the agent in-process (<state_dir>/logs/). The previous container's last lines come "
        "first when the engine was recreated since. Values of the container's environment are replaced by "
        "<redacted> (docs/LOGS.md says which). Exit 0, 1 when no log is kept for ENGINE or it cannot be read.",
    )
    verb.add_argument("engine", metavar="ENGINE", help="the engine's name, as in the desired state")
    verb.add_argument(
        "--tail",
        type=_lines,
        default=None,
        metavar="N",
        help=f"print only the last N lines (default: all kept, at most {TAIL_LINES} per container)",
    )
    verb.set_defaults(handler=cmd_logs)


def _lines(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tail takes a number of lines, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--tail must be 1 or more (got {value})")
    return value


def kept_logs_dir(config: AgentConfig) -> Path:
    """Where this node's engine logs are kept: root's ``public/logs`` under the split, the agent's own
    ``logs`` in-process."""
    if config.apply.via == "systemd":
        return Path(config.apply.state_dir) / PUBLIC_DIR / LOGS_DIR
    return Path(config.state_dir) / LOGS_DIR


def cmd_logs(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    directory = kept_logs_dir(config)
    try:
        log_path(directory, args.engine)
    except EngineLogError as exc:
        raise UsageError(str(exc)) from exc
    try:
        tail = read_log_tail(directory, args.engine)
    except EngineLogError as exc:
        print(f"meridian-node logs: error: {_explain(exc, config, args.engine)}", file=sys.stderr)
        return 1
    _print(tail, args.tail)
    return 0


def _explain(exc: EngineLogError, config: AgentConfig, engine: str) -> str:
    if getattr(exc.__cause__, "errno", None) == errno.EACCES:
        return (
            f"{exc}; the kept logs are readable by the group of {config.state_dir} (the agent's): run this as the "
            "agent's user, or as a member of its group"
        )
    if not isinstance(exc, EngineLogMissingError):
        return str(exc)
    known = _engines(config)
    if known is not None and engine not in known:
        listed = ", ".join(sorted(known)) or "none"
        return f"no engine {engine!r} on this node (engines: {listed}); name one of them"
    keeper = (
        "root's observe unit keeps one every 30 s for each engine Docker runs for this node: check "
        "'systemctl status meridian-node-apply-observe.timer' and 'journalctl -u meridian-node-apply-observe'"
        if config.apply.via == "systemd"
        else "the agent keeps one for each engine it observes (meridian-node run, every 30 s): is it running?"
    )
    return f"{exc}; {keeper}"


def _engines(config: AgentConfig) -> set[str] | None:
    """The engines root listed for this node under the split (``engines.json``); None in-process, where only
    Docker knows (and this verb asks Docker nothing), or when the list cannot be read."""
    if config.apply.via != "systemd":
        return None
    try:
        inventory = read_inventory(Path(config.apply.state_dir) / PUBLIC_DIR / INVENTORY_FILE, node_id=config.node_id)
    except InventoryError:
        return None
    return {engine.name for engine in inventory.engines}


def _print(tail: EngineLogTail, count: int | None) -> None:
    shown = tail.lines(count)
    previous = tail.previous.lines if tail.previous is not None else ()
    # How many of the lines shown are the previous container's: the last ones of it, before the current's.
    from_previous = max(0, len(shown) - len(tail.current.lines))
    if tail.previous is not None and from_previous:
        print(f"--- {tail.engine}: previous {_describe(tail.previous)} ---")
        for line in previous[len(previous) - from_previous :]:
            print(line)
    print(f"--- {tail.engine}: {_describe(tail.current)} ---")
    for line in shown[from_previous:]:
        print(line)


def _describe(run: KeptRun) -> str:
    ended = f", last {run.exit_reason}" if run.exit_reason else ""
    return f"container {run.container_id} ({run.state}, {run.restarts} restarts{ended}; read {run.read_at})"

"""``meridian-node logs ENGINE [--tail N]``: the kept tail of an engine's log, for the agent's user and group.

Reads the file the side that can read Docker keeps (``boundary.engine_logs_file``): root's observe unit under the
split (``<apply.state_dir>/public/logs/``, group-readable by the agent's group), the agent itself in-process
(``<state_dir>/logs/``). Needs neither root nor Docker access; asks nothing of Docker itself. docs/LOGS.md.

What an engine printed may hold escape sequences that would drive the terminal of whoever runs this (set its
title, clear it, write its clipboard with OSC 52): every line is written escaped (``terminal_text.escape_text``:
ESC as ``\\x1b``), to a terminal or not, as journalctl does; ``--raw`` writes the bytes as kept, and only where
stdout is not a terminal.
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
from meridian_node_agent.config import AgentConfig, config_for_verb
from meridian_node_agent.errors import UsageError
from meridian_node_agent.terminal_text import escape_text, unescape_text

__all__ = ["add_parsers", "cmd_logs", "kept_logs_dir"]


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verb = subparsers.add_parser(
        "logs",
        help="print the kept tail of an engine's log (no root, no Docker access needed)",
        description="Print the last lines of ENGINE's log as this node keeps them: read from Docker by root's "
        "observe unit every 30 s under apply.via: systemd (<apply.state_dir>/public/logs/, readable by the "
        "agent's group), by the agent in-process (<state_dir>/logs/). The previous container's last lines come "
        "first when the engine was recreated since. Values of the container's environment are replaced by "
        "<redacted> (docs/LOGS.md says which). Control characters, escape sequences and bytes that are not UTF-8 are "
        "written visibly (ESC as \\x1b, a backslash before one as \\\\), to a terminal, a pipe or a file alike, unless "
        "--raw. Exit 0, 1 when no log is kept for ENGINE or it cannot be read, 2 for --raw to a terminal.",
    )
    verb.add_argument("engine", metavar="ENGINE", help="the engine's name, as in the desired state")
    verb.add_argument(
        "--tail",
        type=_lines,
        default=None,
        metavar="N",
        help=f"print only the last N lines (default: all kept, at most {TAIL_LINES} per container)",
    )
    verb.add_argument(
        "--raw",
        action="store_true",
        help="write the lines as the engine printed them, escape sequences and all, for a pipe or a file "
        "(| less -R, > chat.log); refused when stdout is a terminal, which would act on them",
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
    config = config_for_verb(args.config)
    directory = kept_logs_dir(config)
    try:
        log_path(directory, args.engine)
    except EngineLogError as exc:
        raise UsageError(str(exc)) from exc
    if args.raw and sys.stdout.isatty():
        raise UsageError(
            "--raw writes the escape sequences an engine printed as they are, and stdout is a terminal, which would "
            f"act on them: pipe it (meridian-node logs {args.engine} --raw | less -R) or leave --raw out"
        )
    try:
        tail = read_log_tail(directory, args.engine)
    except EngineLogError as exc:
        print(
            f"meridian-node logs: error: {escape_text(_explain(exc, config, args.engine), one_line=True)}",
            file=sys.stderr,
        )
        return 1
    _print(tail, args.tail, raw=args.raw)
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


def _print(tail: EngineLogTail, count: int | None, *, raw: bool) -> None:
    """The headers, always escaped, and the engine's lines: escaped, or with ``raw`` as the engine printed them."""
    shown = tail.raw_lines(count)
    # How many of the lines shown are the previous container's: the last ones of it, before the current's.
    from_previous = max(0, len(shown) - len(tail.current.lines))
    out: list[bytes] = []
    if tail.previous is not None and from_previous:
        out.append(_header(f"--- {tail.engine}: previous {_describe(tail.previous)} ---"))
        out.extend(_line(line, raw=raw) for line in shown[:from_previous])
    out.append(_header(f"--- {tail.engine}: {_describe(tail.current)} ---"))
    out.extend(_line(line, raw=raw) for line in shown[from_previous:])
    data = b"".join(out)
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # a text stream put in stdout's place (a caller's StringIO): the same bytes, as it takes them
        sys.stdout.write(data.decode("utf-8", "surrogateescape"))
        return
    sys.stdout.flush()
    buffer.write(data)


def _header(text: str) -> bytes:
    return escape_text(text, one_line=True).encode("utf-8") + b"\n"


def _line(line: str, *, raw: bool) -> bytes:
    if not raw:
        return escape_text(line, one_line=True).encode("utf-8") + b"\n"
    try:
        return line.encode("utf-8", "surrogateescape") + b"\n"
    except UnicodeEncodeError:  # a surrogate no byte made (a hand-edited file): the bytes escape_text spells out
        return unescape_text(escape_text(line)) + b"\n"


def _describe(run: KeptRun) -> str:
    ended = f", last {run.exit_reason}" if run.exit_reason else ""
    return f"container {run.container_id} ({run.state}, {run.restarts} restarts{ended}; read {run.read_at})"

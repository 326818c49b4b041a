# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion looks for this line in a console script's module)
"""``meridian-node``: the agent's command line. Each verb lives in a module of its own.

Only the module of the verb being run is imported: the long-running ``run`` would otherwise carry the
artifact downloader and the signing tools in memory for nothing, and the root ``apply-spooled`` unit would
pay about a second of imports on every start. ``--help`` and unknown verbs load them all.

Shell completion (argcomplete's protocol: the shell calls the program with ``_ARGCOMPLETE``, ``COMP_LINE`` and
``COMP_POINT`` set) loads argcomplete only then, and the verbs the same way: all of them while the verb is
being typed, only its own module once it is there.
"""

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from meridian_node_agent import VersionAction
from meridian_node_agent.config import default_config_path
from meridian_node_agent.errors import UsageError

# verb -> the module (in this package) whose add_parsers defines it; the order is --help's order. Root's verbs
# are defined by the units they run (root_side/), outbox-key by the air-gapped agent that owns the key.
VERB_MODULES = {
    "artifact": "cli.artifact",
    "check-config": "cli.config",
    "keygen": "cli.trust",
    "sign": "cli.trust",
    "verify": "cli.trust",
    "make-bundle": "cli.bundle",
    "runbook-pin": "cli.bundle",
    "outbox-key": "agent_side.airgap_agent",
    "enroll": "cli.agent",
    "run": "cli.agent",
    "status": "cli.agent",
    "gpu-health": "cli.gpu_health",
    "logs": "cli.logs",
    "apply-spooled": "root_side.apply_unit",
    "airgap-inbox": "root_side.inbox_unit",
    "observe-engines": "root_side.observe_unit",
    "shutdown-drain": "root_side.shutdown_drain",
}


def verb_of(argv: Sequence[str]) -> str | None:
    """The verb ``argv`` asks for, or None (no verb, or an option before it that is not ``--config``)."""
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            next(args, None)
        elif arg.startswith("--config="):
            continue
        elif arg.startswith("-"):
            return None
        else:
            return arg
    return None


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser with every verb, or with only ``verb``'s module loaded when it is a known verb."""
    parser = argparse.ArgumentParser(
        prog="meridian-node",
        description="The meridian.node pull agent and its operator tools.",
    )
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    parser.add_argument(
        "--config",
        default=default_config_path(),
        metavar="PATH",
        help="the agent's config file (default: $MERIDIAN_NODE_CONFIG or /etc/meridian-node/config.yaml)",
    )
    subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    modules = [VERB_MODULES[verb]] if verb in VERB_MODULES else list(dict.fromkeys(VERB_MODULES.values()))
    for name in modules:
        importlib.import_module(f"meridian_node_agent.{name}").add_parsers(subparsers)
    return parser


def complete() -> NoReturn:
    """Answer one TAB of the shell's completion (``_ARGCOMPLETE`` is set) and exit."""
    import argcomplete
    from argcomplete.lexers import split_line

    line, point = os.environ.get("COMP_LINE", ""), int(os.environ.get("COMP_POINT", "0"))
    # The words before the one under the cursor, less the program (and the interpreter, `python -m`).
    words = split_line(line, point)[3][int(os.environ["_ARGCOMPLETE"]) :]
    argcomplete.autocomplete(build_parser(verb_of(words)))
    sys.exit(1)  # autocomplete() exits itself once it has answered; here it did not


def main(argv: list[str] | None = None) -> int:
    if argv is None and "_ARGCOMPLETE" in os.environ:
        complete()
    arguments = sys.argv[1:] if argv is None else argv
    parser = build_parser(verb_of(arguments))
    args = parser.parse_args(arguments)
    try:
        status: int = args.handler(args)
        # Inside the try: piped output is block-buffered, so a reader that went away shows here, not at exit.
        sys.stdout.flush()
    except UsageError as exc:
        print(f"meridian-node {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C is the person's own doing: a traceback tells them nothing.
        print(f"meridian-node {args.verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`check-config | head`): what is left has nowhere to go. Python flushes stdout once
        # more at exit and would fail again, so it is pointed at /dev/null first (the recipe of Python's signal
        # docs); 141 is what a shell reports for a writer killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return status


if __name__ == "__main__":
    sys.exit(main())

"""``meridian-node-devserver``: run the reference control plane and operate it. Each verb family lives in a module
of its own.

``serve`` runs the HTTPS server; the other verbs work on the same data dir (and the same database)
from another process while it runs, and announce what they changed to the running servers
(``store/change_feed.py``): on SQLite ``publish``, ``revoke`` and ``fence`` apply to the server's next request, on
PostgreSQL within a round trip (at most 2 s). Several ``serve`` processes may share one PostgreSQL database and
one data dir (replicas).

Only the module of the verb being run is imported, and ``--help`` (or an unknown verb) imports none: the table
below carries each verb's line in ``--help``, as pip's commands table does, so listing the verbs costs no control
plane, no database and no web stack.

Exit status: 0 done, 1 refused (unknown node, used token name, invalid document), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence

from meridian_node_agent import VersionAction
from meridian_node_agent.devserver.cli.common import Refused
from meridian_node_agent.errors import UsageError

__all__ = ["VERB_MODULES", "build_parser", "main", "verb_of"]

# verb -> (the module in this package whose DEFINE sets its arguments, its line in --help); the order is --help's.
VERB_MODULES = {
    "serve": ("serve", "run the HTTPS server"),
    "token": ("operate", "create an enrollment token"),
    "publish": ("operate", "sign and publish a desired state"),
    "fence": ("operate", "bump a node's lease epoch"),
    "revoke": ("operate", "revoke a node's certificates"),
    "nodes": ("show", "list nodes"),
    "info": ("show", "print the trust paths"),
    "import-outbox": ("outbox", "ingest an air-gapped node's outbox"),
}


def verb_of(argv: Sequence[str]) -> str | None:
    """The verb ``argv`` asks for: its first word that is not an option (the program's own options take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(defined: Collection[str] = tuple(VERB_MODULES)) -> argparse.ArgumentParser:
    """The parser listing every verb, with the arguments of the verbs in ``defined`` (their modules imported)."""
    parser = argparse.ArgumentParser(
        prog="meridian-node-devserver",
        description="The meridian.node reference control plane (protocol v1): HTTPS with mutual TLS, an embedded "
        "SQLite database (or PostgreSQL: --database-url), its own CA and control signing key, all in --data-dir.",
    )
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module, summary) in VERB_MODULES.items():
        verb_parser = verbs.add_parser(verb, help=summary)
        if verb in defined:
            importlib.import_module(f"{__name__}.{module}").DEFINE[verb](verb_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    verb = verb_of(arguments)
    args = build_parser([verb] if verb in VERB_MODULES else []).parse_args(arguments)
    try:
        status: int = args.handler(args)
    except UsageError as exc:
        print(f"meridian-node-devserver {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except Refused as exc:
        print(f"meridian-node-devserver {args.verb}: refused: {exc}", file=sys.stderr)
        return 1
    return status

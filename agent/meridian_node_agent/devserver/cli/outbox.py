"""``meridian-node-devserver import-outbox``: an air-gapped node's outbox, verified and ingested
(``control/outbox_import.py``; docs/AIR_GAP.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meridian_node_agent.boundary.outbox import load_node_public_key
from meridian_node_agent.devserver.cli.common import database_options, open_control, say
from meridian_node_agent.devserver.control.outbox_import import import_outbox
from meridian_node_agent.devserver.control.plane import check_node_id
from meridian_node_agent.errors import UsageError

__all__ = ["DEFINE", "cmd_import_outbox"]


def import_outbox_arguments(outbox: argparse.ArgumentParser) -> None:
    database_options(
        outbox,
        "Verify every NODE-SEQUENCE-KIND.json in DIR (signed by that node's key, given with --node-key) and "
        "ingest it as if it had arrived online: observations under the same epoch check, journal summaries "
        "kept. A record already imported is a no-op. Prints one JSON line per file; exit 1 when any was "
        "refused (docs/AIR_GAP.md).",
    )
    outbox.add_argument("directory", type=Path, metavar="DIR")
    outbox.add_argument(
        "--node-key",
        action="append",
        default=[],
        required=True,
        metavar="NODE=PUBLIC.pem",
        help="the public key (or certificate) NODE signs its outbox with: 'meridian-node outbox-key' on the "
        "node prints it (repeatable)",
    )
    outbox.set_defaults(handler=cmd_import_outbox)


def cmd_import_outbox(args: argparse.Namespace) -> int:
    keys = {}
    for spec in args.node_key:
        node, sep, path = spec.partition("=")
        if not sep or not path:
            raise UsageError(f"--node-key {spec!r}: expected NODE=PUBLIC.pem")
        try:
            keys[check_node_id(node)] = load_node_public_key(Path(path).read_bytes(), path)
        except OSError as exc:
            raise UsageError(f"--node-key {spec!r}: cannot read {path}: {exc.strerror}") from exc
        except ValueError as exc:
            raise UsageError(f"--node-key {spec!r}: {exc}") from exc
    if not args.directory.is_dir():
        raise UsageError(f"{args.directory} is not a directory: pass the copied outbox directory")
    control = open_control(args)
    try:
        results = import_outbox(control, args.directory, keys)
    finally:
        control.close()
    for result in results:
        say(json.dumps(result.as_json(), sort_keys=True))
    return 1 if any(result.result == "refused" for result in results) else 0


DEFINE = {"import-outbox": import_outbox_arguments}

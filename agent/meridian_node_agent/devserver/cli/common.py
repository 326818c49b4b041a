"""What every verb of ``meridian-node-devserver`` shares: the data dir and database options, opening the control
plane, a node id or token from the command line, the refusal (exit status 1), printing.

``cli/__init__`` imports this module before it knows the verb (for ``Refused``), so ``--help`` pays for what it
imports: the control plane is imported where it is opened, by the verb that opens it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from meridian_node_agent.devserver.store.errors import DatabaseUnavailable
from meridian_node_agent.errors import UsageError

if TYPE_CHECKING:
    from meridian_node_agent.devserver.control.plane import ControlPlane, Settings

__all__ = [
    "DATABASE_URL_ENV",
    "Refused",
    "create_token",
    "database_options",
    "node_id",
    "open_control",
    "say",
    "warn",
]

# Where the devserver's verbs find the database when --database-url is not given (else the SQLite file).
DATABASE_URL_ENV = "MERIDIAN_DEVSERVER_DATABASE_URL"


class Refused(MeridianError):
    """The control plane refused the operation: exit status 1."""


def database_options(parser: argparse.ArgumentParser, description: str) -> None:
    """A verb's description and the options every verb takes first: where its data dir and database are."""
    parser.description = description
    parser.add_argument("--data-dir", required=True, type=Path, help="the devserver's state directory")
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="the database: postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE (the database must exist; its "
        f"tables are made or migrated on open) or sqlite:///PATH (default: ${DATABASE_URL_ENV}, else the SQLite "
        "file DATA_DIR/devserver.sqlite3)",
    )


def selected_database(args: argparse.Namespace, database: str | None = None) -> str | None:
    """The database a verb opens, as given: ``database`` (serve's --database), --database-url,
    $MERIDIAN_DEVSERVER_DATABASE_URL, or None for the data dir's SQLite file."""
    if database is not None and args.database_url is not None:
        raise UsageError("--database and --database-url both name the database; give one of them")
    return database or args.database_url or os.environ.get(DATABASE_URL_ENV) or None


def open_control(
    args: argparse.Namespace, settings: Settings | None = None, database: str | None = None
) -> ControlPlane:
    from meridian_node_agent.devserver.control.plane import open_control_plane

    try:
        return open_control_plane(args.data_dir, database=selected_database(args, database), settings=settings)
    except DatabaseUnavailable as exc:
        raise UsageError(str(exc)) from exc
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot open data dir {str(args.data_dir)!r}: {exc}") from exc


def node_id(text: str, what: str) -> str:
    from meridian_node_agent.devserver.control.plane import check_node_id

    try:
        return check_node_id(text)
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from exc


def create_token(control: ControlPlane, name: str, value: str | None, node: str | None) -> str:
    try:
        return control.create_token(name, value, node)
    except ValueError as exc:
        raise Refused(str(exc)) from exc


def say(line: str) -> None:
    print(line, flush=True)


def warn(args: argparse.Namespace, message: str) -> None:
    print(f"meridian-node-devserver {args.verb}: warning: {message}", file=sys.stderr, flush=True)

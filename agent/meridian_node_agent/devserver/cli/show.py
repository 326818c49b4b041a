"""The verbs that only read: ``nodes`` (a table of the fleet) and ``info`` (the trust paths a node's config needs)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from meridian_node_agent.devserver.cli.common import database_options, open_control, say
from meridian_node_agent.devserver.store.database import NodeRow

__all__ = ["DEFINE", "cmd_info", "cmd_nodes", "format_nodes"]


def nodes_arguments(nodes: argparse.ArgumentParser) -> None:
    database_options(nodes, "Print a table of nodes: epoch, lease, certificates, generation, last observation.")
    nodes.set_defaults(handler=cmd_nodes)


def info_arguments(info: argparse.ArgumentParser) -> None:
    database_options(
        info,
        "Print the CA bundle path, the control public key "
        "path and keyid (put them in a node's config and policy), and the database path.",
    )
    info.set_defaults(handler=cmd_info)


def cmd_nodes(args: argparse.Namespace) -> int:
    control = open_control(args)
    try:
        rows = control.nodes()
        now = control.now()
    finally:
        control.close()
    say(format_nodes(rows, now))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    control = open_control(args)
    try:
        say(f"ca bundle: {control.ca.cert_path}")
        say(f"control public key: {control.paths.control_public_key} (keyid {control.control_keyid})")
        say(f"database: {control.store.path}")
    finally:
        control.close()
    return 0


def format_nodes(rows: list[NodeRow], now: datetime) -> str:
    header = ("NODE", "EPOCH", "LEASE", "ENROLLED", "CERTS", "REVOKED", "GENERATION", "LAST OBSERVATION")
    table = [header]
    for row in rows:
        table.append(
            (
                row.node_id,
                str(row.epoch),
                _lease_text(row.lease_expires_at, now),
                _stamp(row.enrolled_at),
                str(row.certificates),
                "yes" if row.revoked_at else "no",
                "-" if row.generation is None else str(row.generation),
                _stamp(row.last_observed_at),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in table
    )


def _lease_text(expires: datetime | None, now: datetime) -> str:
    if expires is None:
        return "none"
    left_s = int((expires - now).total_seconds())
    return f"{left_s}s left" if left_s >= 0 else f"lapsed {-left_s}s ago"


def _stamp(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


DEFINE = {"nodes": nodes_arguments, "info": info_arguments}

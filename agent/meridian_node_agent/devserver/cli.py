"""``meridian-node-devserver``: run the reference control plane and operate it.

``serve`` runs the HTTPS server; the other verbs work on the same data dir (and the same database)
from another process while it runs, and announce what they changed to the running servers
(``change_feed.py``): on SQLite ``publish``, ``revoke`` and ``fence`` apply to the server's next request, on
PostgreSQL within a round trip (at most 2 s). Several ``serve`` processes may share one PostgreSQL database and
one data dir (replicas).

Exit status: 0 done, 1 refused (unknown node, used token name, invalid document), 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from meridian_node_agent import VersionAction
from meridian_node_agent.devserver.control import ControlPlane, Settings, check_node_id, open_control_plane
from meridian_node_agent.devserver.store import DATABASE_URL_ENV, DatabaseUnavailable, NodeRow, UnknownNode
from meridian_node_agent.errors import UsageError

__all__ = ["build_parser", "main"]

DEFAULT_PORT = 8443
_MAX_DOCUMENT_BYTES = 1024 * 1024


class Refused(MeridianError):
    """The control plane refused the operation: exit status 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian-node-devserver",
        description="The meridian.node reference control plane (protocol v1): HTTPS with mutual TLS, an embedded "
        "SQLite database (or PostgreSQL: --database-url), its own CA and control signing key, all in --data-dir.",
    )
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    serve = _verb(
        verbs,
        "serve",
        "run the HTTPS server",
        "Serve protocol v1 with mutual TLS. Prints the CA "
        "bundle and control public key paths, any tokens created, and the URL once listening.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)")
    serve.add_argument(
        "--server-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name or address the server certificate is valid for (repeatable): the name nodes dial when "
        "replicas sit behind a load balancer or share a DNS name",
    )
    serve.add_argument(
        "--token",
        action="append",
        default=[],
        metavar="NAME[@NODE_ID]:auto|NAME[@NODE_ID]:VALUE",
        help="create a one-time enrollment token before serving (repeatable); 'auto' generates the value; "
        "'@NODE_ID' binds the token to that node id (recommended: an unbound token can enroll any node id)",
    )
    serve.add_argument(
        "--database",
        help="SQLite database: a file path or ':memory:' (default DATA_DIR/devserver.sqlite3; or --database-url)",
    )
    serve.add_argument("--lease-seconds", type=int, default=Settings.lease_s, help="lease length per heartbeat")
    serve.add_argument(
        "--certificate-days", type=int, default=Settings.certificate_days, help="validity of issued client certs"
    )
    serve.add_argument(
        "--certificate-seconds",
        type=int,
        metavar="N",
        help="validity of issued client certs in seconds, overriding --certificate-days (to see renewal in "
        "tests and demos)",
    )
    serve.add_argument(
        "--max-wait-seconds",
        type=float,
        default=Settings.max_wait_s,
        metavar="N",
        help=f"the longest long-poll a node may ask for (desired-state's wait; default {Settings.max_wait_s:g})",
    )
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(handler=cmd_serve)

    token = _verb(
        verbs,
        "token",
        "create an enrollment token",
        "Create one-time enrollment token NAME; the "
        "value is generated unless given as NAME:VALUE. Prints the value (only ever shown here). Bind it to "
        "the node it is for with --node-id: an unbound token can enroll any node id.",
    )
    token.add_argument("spec", metavar="NAME[:VALUE]")
    token.add_argument(
        "--node-id", metavar="NODE_ID", help="the only node id this token can enroll (recommended; default: any)"
    )
    token.set_defaults(handler=cmd_token)

    publish = _verb(
        verbs,
        "publish",
        "sign and publish a desired state",
        "Publish DESIRED.yaml as NODE's next "
        "desired state: assigns the next generation and the node's current lease epoch, sets "
        "issued_at/expires_at, signs it with the control key. Prints the generation.",
    )
    publish.add_argument("node", metavar="NODE")
    publish.add_argument("document", type=Path, metavar="DESIRED.yaml")
    publish.add_argument(
        "--ttl", type=int, default=Settings.state_ttl_s, help="seconds until the state expires (default 3600)"
    )
    publish.add_argument(
        "--out",
        type=Path,
        metavar="STATE.json",
        help="also write the signed envelope there, byte for byte as nodes fetch it: for an air-gapped node, "
        "`meridian-node make-bundle --desired STATE.json` (docs/AIR_GAP.md)",
    )
    publish.set_defaults(handler=cmd_publish)

    fence = _verb(
        verbs,
        "fence",
        "bump a node's lease epoch",
        "Increase NODE's lease epoch by one, as a "
        "control-plane failover does: writers holding the old epoch are refused from now on.",
    )
    fence.add_argument("node", metavar="NODE")
    fence.set_defaults(handler=cmd_fence)

    revoke = _verb(
        verbs,
        "revoke",
        "revoke a node's certificates",
        "Revoke every certificate issued to NODE; "
        "its next request is refused. Enrolling again with a new token issues a new one.",
    )
    revoke.add_argument("node", metavar="NODE")
    revoke.set_defaults(handler=cmd_revoke)

    nodes = _verb(
        verbs,
        "nodes",
        "list nodes",
        "Print a table of nodes: epoch, lease, certificates, generation, last observation.",
    )
    nodes.set_defaults(handler=cmd_nodes)

    info = _verb(
        verbs,
        "info",
        "print the trust paths",
        "Print the CA bundle path, the control public key "
        "path and keyid (put them in a node's config and policy), and the database path.",
    )
    info.set_defaults(handler=cmd_info)

    outbox = _verb(
        verbs,
        "import-outbox",
        "ingest an air-gapped node's outbox",
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
    return parser


def _verb(
    verbs: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    parser = verbs.add_parser(name, help=summary, description=description)
    parser.add_argument("--data-dir", required=True, type=Path, help="the devserver's state directory")
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help="the database: postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE (the database must exist; its "
        f"tables are made or migrated on open) or sqlite:///PATH (default: ${DATABASE_URL_ENV}, else the SQLite "
        "file DATA_DIR/devserver.sqlite3)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except UsageError as exc:
        print(f"meridian-node-devserver {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except Refused as exc:
        print(f"meridian-node-devserver {args.verb}: refused: {exc}", file=sys.stderr)
        return 1
    return status


def _open(args: argparse.Namespace, settings: Settings | None = None, database: str | None = None) -> ControlPlane:
    if database is not None and args.database_url is not None:
        raise UsageError("--database and --database-url both name the database; give one of them")
    if database is None:
        database = args.database_url or os.environ.get(DATABASE_URL_ENV) or None
    try:
        return open_control_plane(args.data_dir, database=database, settings=settings)
    except DatabaseUnavailable as exc:
        raise UsageError(str(exc)) from exc
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot open data dir {str(args.data_dir)!r}: {exc}") from exc


def _say(line: str) -> None:
    print(line, flush=True)


# The HTTP server's own packages: the `devserver` extra, absent from an agent-only install.
_WEB_STACK = frozenset({"fastapi", "starlette", "uvicorn", "h11", "anyio"})


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from meridian_node_agent.devserver.server import bind, prepare_tls, serve
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _WEB_STACK:
            raise
        raise UsageError(
            f"serving needs the devserver's web stack, and the Python package {exc.name!r} is not installed; "
            "install meridian-node[devserver] (pip install 'meridian-node[devserver]'). The other verbs "
            "work without it."
        ) from exc

    try:
        settings = Settings(
            lease_s=args.lease_seconds,
            certificate_days=args.certificate_days,
            certificate_s=args.certificate_seconds,
            max_wait_s=args.max_wait_seconds,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    tokens = [_serve_token_spec(spec) for spec in args.token]
    _log_to_stderr(args.log_level)
    control = _open(args, settings, args.database)
    try:
        try:
            sock = bind(args.host, args.port)
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
        tls = prepare_tls(control, args.host, args.server_name)
        _say(f"data dir: {args.data_dir}")
        _say(f"ca bundle: {tls.ca}")
        _say(f"control public key: {control.paths.control_public_key} (keyid {control.control_keyid})")
        for name, value, node_id in tokens:
            _say(f"token {name}: {_create_token(control, name, value, node_id)}")
            if node_id is None:
                _warn(args, f"token {name!r} can enroll any node id; bind it with --token {name}@NODE_ID:...")
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        _say(f"listening on https://{shown}:{port}")
        serve(control, sock, tls, log_level=args.log_level)
    finally:
        control.close()
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    name, value = _token_spec(args.spec)
    node_id = None if args.node_id is None else _node_id(args.node_id, "--node-id")
    control = _open(args)
    try:
        _say(_create_token(control, name, value, node_id))
    finally:
        control.close()
    if node_id is None:
        _warn(args, f"token {name!r} can enroll any node id; bind it to its node with --node-id NODE_ID")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    document = _read_document(args.document)
    control = _open(args)
    try:
        published = control.publish(args.node, document, ttl_s=args.ttl)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    finally:
        control.close()
    if args.out is not None:
        _write_envelope(args.out, published.envelope)
    _say(f"node {args.node}: generation {published.generation} (lease epoch {published.lease_epoch})")
    return 0


def _write_envelope(path: Path, envelope: bytes) -> None:
    """Write under a temporary name beside ``path``, then rename: a bundle is never made from half a file."""
    temp = path.with_name(f".{path.name}.part")
    try:
        temp.write_bytes(envelope)
        temp.replace(path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise Refused(
            f"the state was published, but --out {path} could not be written ({exc.strerror}); the signed state "
            "is the node's latest: publish it again with a writable --out"
        ) from exc


def cmd_fence(args: argparse.Namespace) -> int:
    control = _open(args)
    try:
        epoch = control.fence(args.node)
    except UnknownNode as exc:
        raise Refused(f"node {args.node!r} is not known to this control plane") from exc
    finally:
        control.close()
    _say(f"node {args.node}: lease epoch {epoch}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    control = _open(args)
    try:
        count = control.revoke(args.node)
    except UnknownNode as exc:
        raise Refused(f"node {args.node!r} is not known to this control plane") from exc
    finally:
        control.close()
    _say(f"node {args.node}: revoked {count} certificate(s)")
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    control = _open(args)
    try:
        rows = control.nodes()
        now = control.now()
    finally:
        control.close()
    _say(format_nodes(rows, now))
    return 0


def cmd_import_outbox(args: argparse.Namespace) -> int:
    import json

    from meridian_node_agent.boundary.outbox import load_node_public_key
    from meridian_node_agent.devserver.outbox_import import import_outbox

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
    control = _open(args)
    try:
        results = import_outbox(control, args.directory, keys)
    finally:
        control.close()
    for result in results:
        _say(json.dumps(result.as_json(), sort_keys=True))
    return 1 if any(result.result == "refused" for result in results) else 0


def cmd_info(args: argparse.Namespace) -> int:
    control = _open(args)
    try:
        _say(f"ca bundle: {control.ca.cert_path}")
        _say(f"control public key: {control.paths.control_public_key} (keyid {control.control_keyid})")
        _say(f"database: {control.store.path}")
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


def _token_spec(spec: str) -> tuple[str, str | None]:
    """``token``'s NAME[:VALUE]: the value is everything after the first ':', so it may hold ':' and '@'."""
    name, sep, value = spec.partition(":")
    if not name:
        raise UsageError(f"token {spec!r}: the name before ':' is empty")
    if "@" in name:
        raise UsageError(f"token {spec!r}: a token name cannot contain '@'; bind a token to its node with --node-id")
    if sep and not value:
        raise UsageError(f"token {spec!r}: the value after ':' is empty")
    return name, value or None


def _serve_token_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``serve --token``'s NAME[@NODE_ID]:auto|VALUE as (name, value or None for auto, node id or None).

    Names and node ids hold neither ':' nor '@', so splitting at the first ':' and then at '@' is
    unambiguous whatever the value holds.
    """
    head, sep, value = spec.partition(":")
    name, at, node = head.partition("@")
    if not sep:
        raise UsageError(
            f"--token {spec!r}: write NAME:auto for a generated value or NAME:VALUE, with @NODE_ID after NAME to "
            "bind the token to a node"
        )
    if not name:
        raise UsageError(f"--token {spec!r}: the name before ':' is empty")
    node_id = _node_id(node, f"--token {spec!r}") if at else None
    if not value:
        raise UsageError(f"--token {spec!r}: the value after ':' is empty")
    return name, (None if value == "auto" else value), node_id


def _node_id(text: str, what: str) -> str:
    try:
        return check_node_id(text)
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from exc


def _create_token(control: ControlPlane, name: str, value: str | None, node_id: str | None) -> str:
    try:
        return control.create_token(name, value, node_id)
    except ValueError as exc:
        raise Refused(str(exc)) from exc


def _warn(args: argparse.Namespace, message: str) -> None:
    print(f"meridian-node-devserver {args.verb}: warning: {message}", file=sys.stderr, flush=True)


def _log_to_stderr(level: str) -> None:
    """The devserver's own log lines (refused enrollments, say) next to uvicorn's, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("meridian_node_agent.devserver")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _read_document(path: Path) -> dict[str, Any]:
    try:
        # The operator named it on the command line: a symlink is followed.
        data = read_capped(path, _MAX_DOCUMENT_BYTES, what="the desired state", nofollow=False)
    except CappedReadError as exc:
        raise UsageError(str(exc)) from exc
    try:
        document = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise UsageError(f"{str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise UsageError(f"{str(path)!r} must hold a mapping (a desired state), got {type(document).__name__}")
    return document


if __name__ == "__main__":
    sys.exit(main())

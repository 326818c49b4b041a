"""``meridian-node-devserver serve``: the HTTPS server, with the tokens to create before it listens.

The web stack (``serving/``: FastAPI, uvicorn) is imported when the server starts, so that an install without the
``devserver`` extra hears which package to install rather than a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from meridian_node_agent.devserver.cli.common import (
    create_token,
    database_options,
    node_id,
    open_control,
    say,
    selected_database,
    warn,
)
from meridian_node_agent.devserver.control.plane import Settings
from meridian_node_agent.errors import UsageError

__all__ = ["DEFAULT_PORT", "DEFINE", "cmd_serve"]

DEFAULT_PORT = 8443
# The HTTP server's own packages: the `devserver` extra, absent from an agent-only install.
_WEB_STACK = frozenset({"fastapi", "starlette", "uvicorn", "h11", "anyio"})


def serve_arguments(serve: argparse.ArgumentParser) -> None:
    database_options(
        serve,
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


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from meridian_node_agent.devserver.serving.operator_socket import OperatorSocket
        from meridian_node_agent.devserver.serving.server import bind, prepare_tls, serve
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
    control = open_control(args, settings, args.database)
    try:
        try:
            sock = bind(args.host, args.port)
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
        tls = prepare_tls(control, args.host, args.server_name)
        say(f"data dir: {args.data_dir}")
        say(f"ca bundle: {tls.ca}")
        say(f"control public key: {control.paths.control_public_key} (keyid {control.control_keyid})")
        for name, value, node in tokens:
            say(f"token {name}: {create_token(control, name, value, node)}")
            if node is None:
                warn(args, f"token {name!r} can enroll any node id; bind it with --token {name}@NODE_ID:...")
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        operator = OperatorSocket(control, args.data_dir, selected_database(args, args.database))
        try:
            if operator.start():
                say(f"operator socket: {operator.path}")
        except OSError as exc:
            # The socket only saves the verbs their start-up: without it they open the database themselves.
            warn(args, f"no operator socket at {operator.path} ({exc}); the verbs will open the database themselves")
        say(f"listening on https://{shown}:{port}")
        try:
            serve(control, sock, tls, log_level=args.log_level)
        finally:
            operator.close()
    finally:
        control.close()
    return 0


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
    bound_to = node_id(node, f"--token {spec!r}") if at else None
    if not value:
        raise UsageError(f"--token {spec!r}: the value after ':' is empty")
    return name, (None if value == "auto" else value), bound_to


def _log_to_stderr(level: str) -> None:
    """The devserver's own log lines (refused enrollments, say) next to uvicorn's, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("meridian_node_agent.devserver")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


DEFINE = {"serve": serve_arguments}

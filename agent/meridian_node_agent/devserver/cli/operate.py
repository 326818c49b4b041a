"""The verbs that change what the control plane holds, from beside a running server: ``token``, ``publish``,
``fence`` and ``revoke``. Each announces its change to the servers (``store/change_feed.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from meridian_node_agent.devserver.cli.common import (
    Refused,
    create_token,
    database_options,
    node_id,
    open_control,
    say,
    warn,
)
from meridian_node_agent.devserver.control.plane import ControlPlane, Settings
from meridian_node_agent.devserver.store.errors import UnknownNode
from meridian_node_agent.errors import UsageError

__all__ = ["DEFINE", "cmd_fence", "cmd_publish", "cmd_revoke", "cmd_token"]

_MAX_DOCUMENT_BYTES = 1024 * 1024


def token_arguments(token: argparse.ArgumentParser) -> None:
    database_options(
        token,
        "Create one-time enrollment token NAME; the "
        "value is generated unless given as NAME:VALUE. Prints the value (only ever shown here). Bind it to "
        "the node it is for with --node-id: an unbound token can enroll any node id.",
    )
    token.add_argument("spec", metavar="NAME[:VALUE]")
    token.add_argument(
        "--node-id", metavar="NODE_ID", help="the only node id this token can enroll (recommended; default: any)"
    )
    token.set_defaults(handler=cmd_token)


def publish_arguments(publish: argparse.ArgumentParser) -> None:
    database_options(
        publish,
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


def fence_arguments(fence: argparse.ArgumentParser) -> None:
    _node_arguments(
        fence,
        "Increase NODE's lease epoch by one, as a "
        "control-plane failover does: writers holding the old epoch are refused from now on.",
        cmd_fence,
    )


def revoke_arguments(revoke: argparse.ArgumentParser) -> None:
    _node_arguments(
        revoke,
        "Revoke every certificate issued to NODE; "
        "its next request is refused. Enrolling again with a new token issues a new one.",
        cmd_revoke,
    )


def _node_arguments(
    parser: argparse.ArgumentParser, description: str, handler: Callable[[argparse.Namespace], int]
) -> None:
    database_options(parser, description)
    parser.add_argument("node", metavar="NODE")
    parser.set_defaults(handler=handler)


def cmd_token(args: argparse.Namespace) -> int:
    name, value = _token_spec(args.spec)
    bound_to = None if args.node_id is None else node_id(args.node_id, "--node-id")
    control = open_control(args)
    try:
        say(create_token(control, name, value, bound_to))
    finally:
        control.close()
    if bound_to is None:
        warn(args, f"token {name!r} can enroll any node id; bind it to its node with --node-id NODE_ID")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    document = _read_document(args.document)
    control = open_control(args)
    try:
        published = control.publish(args.node, document, ttl_s=args.ttl)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    finally:
        control.close()
    if args.out is not None:
        _write_envelope(args.out, published.envelope)
    say(f"node {args.node}: generation {published.generation} (lease epoch {published.lease_epoch})")
    return 0


def cmd_fence(args: argparse.Namespace) -> int:
    epoch = _on_known_node(args, ControlPlane.fence)
    say(f"node {args.node}: lease epoch {epoch}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    count = _on_known_node(args, ControlPlane.revoke)
    say(f"node {args.node}: revoked {count} certificate(s)")
    return 0


def _on_known_node(args: argparse.Namespace, change: Callable[[ControlPlane, str], int]) -> int:
    """``change`` made to NODE; refused when the control plane does not know it."""
    control = open_control(args)
    try:
        return change(control, args.node)
    except UnknownNode as exc:
        raise Refused(f"node {args.node!r} is not known to this control plane") from exc
    finally:
        control.close()


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


DEFINE = {
    "token": token_arguments,
    "publish": publish_arguments,
    "fence": fence_arguments,
    "revoke": revoke_arguments,
}

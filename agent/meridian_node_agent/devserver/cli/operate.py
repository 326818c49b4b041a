"""The verbs that change what the control plane holds, from beside a running server: ``token``, ``publish``,
``fence`` and ``revoke``. Each announces its change to the servers (``store/change_feed.py``)."""

from __future__ import annotations

import argparse
import base64
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from meridian_node_agent.devserver.cli.common import (
    Refused,
    create_token,
    database_options,
    node_id,
    open_control,
    say,
    selected_database,
    warn,
)
from meridian_node_agent.devserver.control.operator_wire import (
    MAX_DOCUMENT_BYTES,
    OperatorSocketError,
    PublishRequest,
    ask_server,
)
from meridian_node_agent.devserver.store.errors import UnknownNode
from meridian_node_agent.errors import UsageError

if TYPE_CHECKING:
    from meridian_node_agent.devserver.control.plane import ControlPlane

__all__ = ["DEFINE", "cmd_fence", "cmd_publish", "cmd_revoke", "cmd_token"]


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
    publish.add_argument("--ttl", type=int, help="seconds until the state expires (default: the control plane's, 3600)")
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
    """Through the server on this data dir when one listens (``control/operator_wire.py``), else here."""
    data = _read_document(args.document)
    request = PublishRequest(args.node, data, str(args.document), args.ttl, selected_database(args))
    try:
        answer = ask_server(args.data_dir, request)
    except OperatorSocketError as exc:
        raise Refused(str(exc)) from exc
    if answer is None:
        generation, epoch, envelope = _publish_here(args, request)
    else:
        generation, epoch, envelope = _published(answer)
    if args.out is not None:
        _write_envelope(args.out, envelope)
    say(f"node {args.node}: generation {generation} (lease epoch {epoch})")
    return 0


def _publish_here(args: argparse.Namespace, request: PublishRequest) -> tuple[int, int, bytes]:
    from meridian_node_agent.devserver.control.plane import parse_desired_document

    try:
        document = parse_desired_document(request.document, request.where)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    control = open_control(args)
    try:
        published = control.publish(request.node, document, ttl_s=request.ttl_s)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    finally:
        control.close()
    return published.generation, published.lease_epoch, published.envelope


def _published(answer: dict[str, object]) -> tuple[int, int, bytes]:
    """The server's answer to a publish: what it published, or its refusal raised as the CLI's own would be."""
    status, message = answer["status"], str(answer.get("message"))
    if status == "usage":
        raise UsageError(message)
    if status == "refused":
        raise Refused(message)
    generation, epoch, envelope = answer.get("generation"), answer.get("lease_epoch"), answer.get("envelope")
    if (
        status != "published"
        or not isinstance(generation, int)
        or not isinstance(epoch, int)
        or not isinstance(envelope, str)
    ):
        raise Refused(f"the server's operator socket answered {answer!r}; `nodes` shows whether it published")
    return generation, epoch, base64.b64decode(envelope)


def cmd_fence(args: argparse.Namespace) -> int:
    epoch = _on_known_node(args, lambda control, node: control.fence(node))
    say(f"node {args.node}: lease epoch {epoch}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    count = _on_known_node(args, lambda control, node: control.revoke(node))
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


def _read_document(path: Path) -> bytes:
    try:
        # The operator named it on the command line: a symlink is followed.
        return read_capped(path, MAX_DOCUMENT_BYTES, what="the desired state", nofollow=False)
    except CappedReadError as exc:
        raise UsageError(str(exc)) from exc


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

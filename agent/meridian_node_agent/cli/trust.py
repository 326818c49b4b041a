"""The CLI's trust verbs: ``keygen``, ``sign`` and ``verify``.

Other tools script against these, so their forms and outputs are fixed: ``verify`` prints exactly one JSON
line and exits 0 (accepted), 1 (rejected, with a reason code) or 2 (usage or policy error).
"""

import argparse
import json
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils._module import DEFAULT_STATE_DIR
from ansible_collections.meridian.node.plugins.module_utils.airgap.runbook import shipped_code_problem
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    ArtifactManifest,
    Bundle,
    DesiredState,
    ValidationError,
    describe_validation_error,
)
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import (
    DEFAULT_POLICY_PATH,
    Policy,
    PolicyError,
    load_policy,
)
from meridian_node_agent.errors import UsageError

KIND_MODELS: dict[str, type[BaseModel]] = {
    "desired-state": DesiredState,
    "artifact-manifest": ArtifactManifest,
    "bundle": Bundle,
}


def add_parsers(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    keygen = subparsers.add_parser(
        "keygen",
        help="create an Ed25519 signing key",
        description="Write a new Ed25519 private key (PKCS#8 PEM, mode 0600) to --out and its public key "
        "beside it (KEY.pub.pem, for policy files); print the keyid.",
    )
    keygen.add_argument("--out", required=True, type=Path, metavar="KEY.pem")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key file")
    keygen.set_defaults(handler=cmd_keygen)

    sign = subparsers.add_parser(
        "sign",
        help="sign a payload into a DSSE envelope",
        description="Sign PAYLOAD.json (its exact bytes) and print the DSSE envelope. The payload is "
        "checked against the contract schema first, so a document the hosts would refuse is not signed.",
    )
    sign.add_argument(
        "--key",
        action="append",
        required=True,
        type=Path,
        metavar="KEY.pem",
        help="private key; repeat to add signatures",
    )
    sign.add_argument("--type", required=True, choices=sorted(dsse.PAYLOAD_TYPES), dest="kind")
    sign.add_argument("--out", type=Path, help="write the envelope here instead of standard output")
    sign.add_argument("--no-check", action="store_true", help="sign without checking the schema")
    sign.add_argument("payload", type=Path, metavar="PAYLOAD.json")
    sign.set_defaults(handler=cmd_sign)

    verify = subparsers.add_parser(
        "verify",
        help="verify a signed envelope or an air-gap bundle against policy",
        description="Verify ENVELOPE.json as the host would; with --kind bundle, ENVELOPE.json may also be a "
        "whole bundle FILE.tar, every member read and checked, nothing kept. Prints one JSON line; exit 0 "
        "accepted, 1 rejected (with reason code), 2 usage or policy error.",
    )
    verify.add_argument("--policy", type=Path, default=Path(DEFAULT_POLICY_PATH))
    verify.add_argument("--kind", required=True, choices=sorted(dsse.PAYLOAD_TYPES))
    verify.add_argument("--node-id", default=None, help="the node the state must be for (default: this host's name)")
    verify.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the directory of the host's record of the applied generation and epoch (default: "
        "the one that decides under --config: apply.state_dir with apply.via: systemd, else "
        f"state_dir; {DEFAULT_STATE_DIR} when there is no config)",
    )
    verify.add_argument("--record", action="store_true", help="store the accepted generation and epoch as applied")
    verify.add_argument(
        "--at", type=parse_timestamp, default=None, metavar="RFC3339", help="verify as of this time instead of now"
    )
    verify.add_argument("envelope", type=Path, metavar="ENVELOPE.json")
    verify.set_defaults(handler=cmd_verify)


def parse_timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an RFC 3339 timestamp: {exc}") from None
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no UTC offset; write e.g. 2026-01-01T00:00:00Z")
    return value.astimezone(UTC)


def read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None


def cmd_keygen(args: argparse.Namespace) -> int:
    out: Path = args.out
    public_out = out.with_name(out.name.removesuffix(".pem") + ".pub.pem")
    for path in (out, public_out):
        if path.exists() and not args.force:
            raise UsageError(f"{path} exists; pass --force to overwrite it")
    private_pem, keyid = dsse.generate_private_key_pem()
    public_pem = dsse.public_key_pem(dsse.load_private_key_pem(private_pem).public_key())
    atomic_write(out, private_pem, mode=0o600)
    atomic_write(public_out, public_pem, mode=0o644)
    print(keyid)
    print(f"wrote {out} (private, 0600) and {public_out} (public, for policy files)", file=sys.stderr)
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    body = read_bytes(args.payload, "payload")
    if not args.no_check:
        try:
            KIND_MODELS[args.kind].model_validate_json(body)
        except ValidationError as exc:
            raise UsageError(
                f"{args.payload} is not a valid {args.kind} document, refusing to sign it "
                f"(--no-check to sign anyway): {describe_validation_error(exc)}"
            ) from None
    keys = []
    for path in args.key:
        try:
            keys.append(dsse.load_private_key_pem(read_bytes(path, "key")))
        except dsse.KeyLoadError as exc:
            raise UsageError(f"{path}: {exc}") from None
    envelope = dsse.sign(dsse.PAYLOAD_TYPES[args.kind], body, keys)
    text = json.dumps(envelope, indent=2) + "\n"
    if args.out:
        atomic_write(args.out, text.encode(), mode=0o644)
    else:
        sys.stdout.write(text)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        raise UsageError(str(exc)) from None
    now = args.at or datetime.now(UTC)
    store = StateStore(args.state_dir or record_dir(args.config))
    if args.kind == "bundle":
        from meridian_node_agent.cli import bundle as bundle_cli  # only this kind needs the bundle reader

        if not bundle_cli.is_envelope_file(args.envelope):
            return bundle_cli.verify_bundle_file(args, policy, store, now=now)
    data = read_bytes(args.envelope, "envelope")
    node_id = args.node_id or socket.gethostname().lower()
    try:
        result = _verify(args.kind, data, policy, store, node_id=node_id, now=now, record=args.record)
    except trust.Rejection as rejection:
        _emit({"accepted": False, "reason": rejection.code.value, "message": rejection.message})
        return 1
    except _ShippedCodeRefused as refused:
        _emit({"accepted": False, "reason": refused.reason, "message": refused.message})
        return 1
    except (StateStoreError, OSError) as exc:
        # A damaged record is not a verdict on the envelope: say so on the same one-line channel.
        _emit({"accepted": False, "reason": "record-error", "message": str(exc)})
        return 2
    _emit({"accepted": True, **result})
    return 0


def _verify(
    kind: str, data: bytes, policy: Policy, store: StateStore, *, node_id: str, now: datetime, record: bool
) -> dict[str, Any]:
    if kind == "artifact-manifest":
        manifest = trust.verify_artifact_manifest(data, policy)
        return {
            "kind": kind,
            "signers": list(manifest.signers),
            "name": manifest.manifest.name,
            "version": manifest.manifest.version,
            "files": len(manifest.manifest.files),
            "total_bytes": manifest.manifest.total_bytes,
        }
    applied = _load_applied(store)
    if kind == "bundle":
        bundle = trust.verify_bundle(data, policy, node_id=node_id, now=now, applied=applied)
        # The listing is in bundle.json, so a bare envelope answers for its shipped code as the reader would.
        problem = shipped_code_problem(bundle.bundle, bundle.desired.state, policy.air_gap.shipped_code)
        if problem is not None:
            raise _ShippedCodeRefused(*problem)
        verified = bundle.desired
        summary: dict[str, Any] = {"kind": kind, "bundle_id": bundle.bundle.bundle_id, "signers": list(bundle.signers)}
    else:
        verified = trust.verify_desired_state(data, policy, node_id=node_id, now=now, applied=applied)
        summary = {"kind": kind, "signers": list(verified.signers)}
    state = verified.state
    summary.update(
        node_id=state.node_id,
        generation=state.generation,
        lease_epoch=state.lease_epoch,
        expires_at=state.model_dump(mode="json")["expires_at"],
        already_applied=verified.already_applied,
        recorded=False,
    )
    if record and not verified.already_applied:
        try:
            store.record_applied(state.generation, state.lease_epoch, verified.payload_sha256)
        except OSError as exc:
            raise UsageError(f"cannot record the applied state in {store.state_dir}: {exc}") from None
        summary["recorded"] = True
    return summary


class _ShippedCodeRefused(MeridianError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _load_applied(store: StateStore) -> trust.AppliedState:
    return store.load()


def record_dir(config_path: str) -> Path:
    """The record that decides on this host, as the config names it; the production default without one."""
    from meridian_node_agent.config import ConfigError, load_config

    try:
        return load_config(config_path).record_dir
    except ConfigError:
        return Path(DEFAULT_STATE_DIR)


def _emit(document: dict[str, Any]) -> None:
    print(json.dumps(document, sort_keys=True))

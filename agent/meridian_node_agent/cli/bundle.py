"""The CLI's air-gap verbs: ``make-bundle``, and ``verify --kind bundle FILE.tar`` (reached from ``cli.trust``).

``make-bundle`` takes the desired state as a control-signed envelope, as the control plane publishes it:
the control keys stay where the control plane keeps them, and the authority that assembles bundles only
adds its own signature. ``--control-key`` signs a plain desired-state document here instead, for labs and
tests where one operator holds both roles. Either way the bundle is written under a temporary name and
renamed into place (docs/AIR_GAP.md).
"""

import argparse
import base64
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from ansible_collections.meridian.node.plugins.module_utils import contracts
from ansible_collections.meridian.node.plugins.module_utils._fileutil import CappedReadError, read_capped
from ansible_collections.meridian.node.plugins.module_utils._strict_yaml import YamlFileError, parse_yaml
from ansible_collections.meridian.node.plugins.module_utils.airgap import bundle_reader, image_archive
from ansible_collections.meridian.node.plugins.module_utils.airgap.bundle_writer import (
    BundleWriteError,
    PlannedMember,
    plan_members,
    write_bundle,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.image_export import (
    ImageExportError,
    rewrite_docker_save,
)
from ansible_collections.meridian.node.plugins.module_utils.airgap.runbook import listed_runbook
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApi, DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy, parse_duration
from meridian_node_agent.errors import UsageError

__all__ = [
    "BundleInputs",
    "add_parsers",
    "build_bundle",
    "cmd_make_bundle",
    "cmd_runbook_pin",
    "is_envelope_file",
    "shipped_code_pin",
    "verify_bundle_file",
]

_Body = TypeVar("_Body", contracts.DesiredState, contracts.ArtifactManifest)

# A desired-state file is small; the limit only keeps a wrong path (a model file) from being read whole.
_MAX_STATE_BYTES = bundle_reader.MAX_ENVELOPE_BYTES


def add_parsers(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    make = subparsers.add_parser(
        "make-bundle",
        help="make a signed air-gap bundle",
        description="Write an air-gap bundle (docs/AIR_GAP.md): one tar whose first member, bundle.json, is "
        "signed by the air-gap authority key(s) and lists every other member with its size and sha256. "
        "--desired is a control-signed desired-state envelope, or with --control-key a desired-state "
        "document (JSON or YAML) signed here.",
    )
    make.add_argument("--desired", required=True, type=Path, metavar="STATE.json|yaml")
    make.add_argument("--node", required=True, metavar="ID", help="the node the bundle is for (the state's node_id)")
    make.add_argument(
        "--key",
        action="append",
        required=True,
        type=Path,
        metavar="AUTH.pem",
        help="an air_gap_authority private key; repeat to meet the policy's threshold",
    )
    make.add_argument(
        "--control-key",
        action="append",
        default=[],
        type=Path,
        metavar="CONTROL.pem",
        help="sign --desired (a plain desired-state document) with this control key; repeatable",
    )
    make.add_argument(
        "--artifact",
        action="append",
        default=[],
        metavar="MANIFEST:DIR",
        help="a signed artifact manifest and the directory holding its files; repeatable",
    )
    make.add_argument("--playbooks", type=Path, metavar="DIR", help="a playbook directory to ship (with --collection)")
    make.add_argument(
        "--collection", type=Path, metavar="TARBALL", help="the collection tarball the playbooks run with"
    )
    make.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="REF@DIGEST",
        help="an engine image the state pins (repo@sha256:<image id>), exported from the local Docker into "
        "images/<name>.tar; repeatable",
    )
    make.add_argument("--expires", required=True, metavar="DURATION", help="how long the bundle is valid: 7d, 12h")
    make.add_argument("--bundle-id", default=None, metavar="NAME", help="default: g<generation>-<UTC time>")
    make.add_argument("--out", required=True, type=Path, metavar="FILE.tar")
    make.set_defaults(handler=cmd_make_bundle)
    pin = subparsers.add_parser(
        "runbook-pin",
        help="print the runbook pin a desired state needs to ship code in a bundle",
        description='Print {"runbook": {...}}: the digests of a playbook directory and a collection tarball '
        "that a control-signed desired state must carry for an air-gap bundle to run them (docs/AIR_GAP.md, "
        '"Shipped code"). Add it to the desired state before control signs it (devserver publish, sign).',
    )
    pin.add_argument("--playbooks", required=True, type=Path, metavar="DIR")
    pin.add_argument("--collection", required=True, type=Path, metavar="TARBALL")
    pin.set_defaults(handler=cmd_runbook_pin)


@dataclass(frozen=True)
class BundleInputs:
    """What a bundle is made of; ``build_bundle`` checks it all before writing anything."""

    desired_envelope: dict[str, Any]
    node_id: str
    authority_keys: Sequence[Any]
    expires: timedelta
    now: datetime
    artifacts: Sequence[tuple[Path, Path]] = ()
    playbooks: Path | None = None
    collection: Path | None = None
    bundle_id: str | None = None
    images: Sequence[str] = ()


def cmd_make_bundle(args: argparse.Namespace) -> int:
    now = datetime.now(UTC).replace(microsecond=0)
    try:
        expires = parse_duration(args.expires)
    except ValueError as exc:
        raise UsageError(f"--expires: {exc}") from None
    control_keys = [_private_key(path) for path in args.control_key]
    authority = [_private_key(path) for path in args.key]
    # Signing the state here (--control-key), make-bundle is control: it pins the code it ships itself.
    pin = shipped_code_pin(args.playbooks, args.collection) if control_keys else None
    desired = _desired_envelope(args.desired, control_keys, pin)
    artifacts = []
    for spec in args.artifact:
        manifest, sep, directory = spec.partition(":")
        if not sep or not manifest or not directory:
            raise UsageError(
                f"--artifact {spec!r}: write MANIFEST:DIR (a signed manifest and the directory of its files)"
            )
        artifacts.append((Path(manifest), Path(directory)))
    inputs = BundleInputs(
        desired_envelope=desired,
        node_id=args.node,
        authority_keys=authority,
        expires=expires,
        now=now,
        artifacts=artifacts,
        playbooks=args.playbooks,
        collection=args.collection,
        bundle_id=args.bundle_id,
        images=args.image,
    )
    payload = build_bundle(args.out, inputs)
    print(
        json.dumps(
            {
                "written": str(args.out),
                "bundle_id": payload["bundle_id"],
                "generation": payload["generation"],
                "members": len(payload["files"]),
                "expires_at": payload["expires_at"],
            },
            sort_keys=True,
        )
    )
    return 0


def cmd_runbook_pin(args: argparse.Namespace) -> int:
    print(json.dumps({"runbook": shipped_code_pin(args.playbooks, args.collection)}, sort_keys=True))
    return 0


def build_bundle(out: Path, inputs: BundleInputs) -> dict[str, Any]:
    """Check ``inputs``, write the bundle to ``out`` and return the signed payload. ``UsageError`` says
    what is wrong with an input; nothing is written then."""
    state = _state_of(inputs.desired_envelope)
    if state.node_id != inputs.node_id:
        raise UsageError(f"--desired is a state for node {state.node_id!r}, not for --node {inputs.node_id!r}")
    members: list[tuple[str, str]] = []
    manifests: list[tuple[contracts.ArtifactManifest, str]] = []
    pinned = {(ref.name, ref.version): base64.b64decode(ref.manifest.payload) for ref in state.artifacts}
    for manifest_path, directory in inputs.artifacts:
        manifest = _manifest_of(manifest_path)
        where = f"artifacts/{manifest.name}/{manifest.version}"
        # The host refuses both (bundle_reader: artifact-mismatch): say so before writing anything.
        key = (manifest.name, manifest.version)
        if key not in pinned:
            raise UsageError(
                f"--artifact {manifest_path}: the desired state names no artifact {manifest.name} {manifest.version}; "
                "a bundle carries only the artifacts its state asks for"
            )
        if pinned[key] != _manifest_body(manifest_path):
            raise UsageError(
                f"--artifact {manifest_path} is not the manifest the desired state pins for {manifest.name} "
                f"{manifest.version}: pass the manifest the state was published with"
            )
        members.append((f"{where}/manifest.json", str(manifest_path)))
        members.extend((f"{where}/files/{entry.path}", str(directory / entry.path)) for entry in manifest.files)
        manifests.append((manifest, where))
    members.extend(_code_members(inputs.playbooks, inputs.collection))
    exports = None
    if inputs.images:
        # Beside the output: the same filesystem, and removed whatever happens below.
        exports = Path(tempfile.mkdtemp(prefix=".images-", dir=out.resolve().parent))
    try:
        if exports is not None:
            members.extend(_export_images(inputs.images, state, exports))
        return _sign_and_write(out, inputs, state, members, manifests)
    finally:
        if exports is not None:
            shutil.rmtree(exports, ignore_errors=True)


def _sign_and_write(
    out: Path,
    inputs: BundleInputs,
    state: contracts.DesiredState,
    members: list[tuple[str, str]],
    manifests: list[tuple[contracts.ArtifactManifest, str]],
) -> dict[str, Any]:
    try:
        planned = plan_members(members)
    except BundleWriteError as exc:
        raise UsageError(str(exc)) from None
    _check_manifest_files(manifests, planned)
    _check_pin(state, planned)
    payload: dict[str, Any] = {
        "apiVersion": contracts.API_VERSION,
        "kind": "Bundle",
        "bundle_id": inputs.bundle_id or f"g{state.generation}-{inputs.now.strftime('%Y%m%dt%H%M%S')}",
        "node_id": inputs.node_id,
        "generation": state.generation,
        "created_at": contracts.format_rfc3339(inputs.now),
        "expires_at": contracts.format_rfc3339(inputs.now + inputs.expires),
        "desired_state": inputs.desired_envelope,
        "files": [member.listing() for member in planned],
    }
    body = json.dumps(payload, sort_keys=False).encode("utf-8")
    try:
        contracts.parse_document(contracts.Bundle, body)
    except (contracts.JsonError, contracts.ValidationError) as exc:
        detail = contracts.describe_validation_error(exc) if isinstance(exc, contracts.ValidationError) else str(exc)
        raise UsageError(f"the bundle would not be valid: {detail}") from None
    envelope = json.dumps(dsse.sign(dsse.PAYLOAD_TYPES["bundle"], body, list(inputs.authority_keys))).encode()
    try:
        write_bundle(str(out), envelope, planned, mtime=int(inputs.now.timestamp()))
    except (BundleWriteError, OSError) as exc:
        raise UsageError(f"cannot write {out}: {exc}") from None
    return payload


def _export_images(references: Sequence[str], state: contracts.DesiredState, directory: Path) -> list[tuple[str, str]]:
    """Each ``--image`` from the local Docker into ``directory`` in the archive form hosts verify, checked to
    yield exactly the pinned image before anything is signed; the ``(bundle path, file)`` of each."""
    pinned = {engine.image for engine in state.engines}
    members: list[tuple[str, str]] = []
    try:
        api = DockerApi.from_env()
    except DockerApiError as exc:
        raise UsageError(f"--image needs the local Docker Engine: {exc}") from None
    for reference in references:
        split = image_archive.split_pin(reference)
        if split is None:
            raise UsageError(f"--image {reference!r}: name the image by digest, repository@sha256:<64 hex>")
        if reference not in pinned:
            raise UsageError(
                f"--image {reference}: no engine of the desired state pins it (they pin "
                f"{sorted(pinned) or 'nothing'}); hosts load only the images their control-signed state names"
            )
        repository, digest = split
        image_id = _local_image_id(api, reference, digest)
        name = f"{re.sub(r'[^a-z0-9_.-]', '-', repository.rsplit('/', 1)[-1])}-{digest[7:19]}"
        saved, archive = directory / f"{name}.save.tar", directory / f"{name}.tar"
        try:
            with saved.open("wb") as handle:
                api.save(image_id, handle, max_bytes=1024**4)
            with saved.open("rb") as source, archive.open("wb") as target:
                rewrite_docker_save(source, target, image_id=image_id, what=f"--image {reference}")
            saved.unlink()
            with archive.open("rb") as handle:
                image_archive.verify_image_archive(
                    handle, archive.stat().st_size, pins={digest: reference}, max_layer_bytes=1024**4, member=name
                )
        except (DockerApiError, ImageExportError, OSError) as exc:
            raise UsageError(f"--image {reference}: {exc}") from None
        except image_archive.ImageArchiveRefused as exc:
            if image_id != digest:
                raise UsageError(
                    f"--image {reference} is pinned by its registry manifest digest, and this Docker Engine's export "
                    f"cannot reproduce that manifest (its classic image store keeps only the config, image id "
                    f"{image_id}, and the layers): pin the engine by its image id, {repository}@{image_id}, in the "
                    "desired state control signs"
                ) from None
            raise UsageError(f"--image {reference}: the export does not verify: {exc}") from None
        members.append((f"images/{name}.tar", str(archive)))
    return members


def _local_image_id(api: DockerApi, reference: str, digest: str) -> str:
    """The id of the local image ``reference`` names: by its registry digest, else by image id."""
    for name in (reference, digest):
        try:
            return str(api.inspect_image(name).get("Id"))
        except DockerApiError as exc:
            if not exc.not_found:
                raise UsageError(f"--image {reference}: {exc}") from None
    raise UsageError(
        f"--image {reference}: the local Docker Engine has no image with registry digest or image id {digest}: "
        "load or pull it here first"
    )


def _private_key(path: Path) -> Any:
    try:
        return dsse.load_private_key_pem(path.read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read key {path}: {exc.strerror}") from None
    except dsse.KeyLoadError as exc:
        raise UsageError(f"{path}: {exc}") from None


def _read_small(path: Path, what: str) -> bytes:
    try:
        # The operator named it on the command line: a symlink is followed.
        return read_capped(path, _MAX_STATE_BYTES, what=what, nofollow=False)
    except CappedReadError as exc:
        raise UsageError(str(exc)) from None


def _code_members(playbooks: Path | None, collection: Path | None) -> list[tuple[str, str]]:
    """The ``(bundle path, source)`` of the shipped code: ``--playbooks``' files and ``--collection``."""
    if (playbooks is None) != (collection is None):
        raise UsageError("--playbooks and --collection go together: a bundle's playbooks run with its collection")
    if playbooks is None or collection is None:
        return []
    if not collection.name.endswith(".tar.gz"):
        raise UsageError(f"--collection {collection}: a collection tarball is named <name>.tar.gz")
    return [*_playbook_members(playbooks), (f"collection/{collection.name}", str(collection))]


def shipped_code_pin(playbooks: Path | None, collection: Path | None) -> dict[str, object] | None:
    """The ``runbook`` a desired state must carry for these playbooks and collection to run (runbook.py)."""
    try:
        planned = plan_members(_code_members(playbooks, collection))
    except BundleWriteError as exc:
        raise UsageError(str(exc)) from None
    return listed_runbook(member.listing() for member in planned)


def _check_pin(state: contracts.DesiredState, planned: Sequence[PlannedMember]) -> None:
    """Hosts refuse shipped code the state does not pin, and a pin whose code is missing: say so here."""
    listed = listed_runbook(member.listing() for member in planned)
    pinned = None if state.runbook is None else state.runbook.model_dump()
    if listed == pinned:
        return
    if pinned is None:
        raise UsageError(
            f"--desired does not pin the code that --playbooks and --collection ship, and hosts run shipped code "
            f'only when the control-signed state pins it: have control sign the state with "runbook": '
            f"{json.dumps(listed)} (meridian-node runbook-pin prints it), or leave out --playbooks and --collection"
        )
    if listed is None:
        raise UsageError(
            f"--desired pins shipped code ({json.dumps(pinned)}) but no --playbooks and --collection were given: "
            "pass the playbooks and collection control signed for"
        )
    raise UsageError(
        f"--playbooks and --collection are not the code --desired pins: they give {json.dumps(listed)}, the state "
        f"pins {json.dumps(pinned)}; ship exactly the files control signed for"
    )


def _desired_envelope(path: Path, control_keys: Sequence[Any], pin: dict[str, object] | None) -> dict[str, Any]:
    data = _read_small(path, "--desired")
    if not control_keys:
        try:
            document = contracts.read_json(data)
            contracts.Envelope.model_validate(document)
        except (contracts.JsonError, contracts.ValidationError) as exc:
            raise UsageError(
                f"--desired {path} is not a signed desired-state envelope ({exc}); pass the envelope the control "
                "plane signed, or a plain desired state with --control-key"
            ) from None
        return dict(document)
    try:
        text = data.decode("utf-8")
        document = contracts.read_json(data) if path.suffix == ".json" else parse_yaml(text, what=f"--desired {path}")
        if pin is not None and isinstance(document, dict) and "runbook" not in document:
            document = {**document, "runbook": pin}
        state = contracts.DesiredState.model_validate(document)
    except (UnicodeDecodeError, contracts.JsonError, YamlFileError) as exc:
        raise UsageError(f"--desired {path}: {exc}") from None
    except contracts.ValidationError as exc:
        detail = contracts.describe_validation_error(exc)
        raise UsageError(f"--desired {path} is not a valid desired state: {detail}") from None
    body = state.model_dump_json().encode("utf-8")
    return dsse.sign(dsse.PAYLOAD_TYPES["desired-state"], body, list(control_keys))


def _state_of(envelope: dict[str, Any]) -> contracts.DesiredState:
    return _signed_body(envelope, "desired-state", contracts.DesiredState, "--desired")


def _manifest_of(path: Path) -> contracts.ArtifactManifest:
    try:
        envelope = contracts.read_json(_read_small(path, "--artifact manifest"))
    except contracts.JsonError as exc:
        raise UsageError(f"--artifact manifest {path} is not JSON: {exc}") from None
    return _signed_body(envelope, "artifact-manifest", contracts.ArtifactManifest, f"--artifact manifest {path}")


def _manifest_body(path: Path) -> bytes:
    """The signed body of the manifest envelope at ``path`` (``_manifest_of`` has checked its shape)."""
    envelope = contracts.read_json(_read_small(path, "--artifact manifest"))
    return base64.b64decode(contracts.Envelope.model_validate(envelope).payload)


def _signed_body(envelope: Any, kind: str, model: type[_Body], what: str) -> _Body:
    """The body of ``envelope`` as ``model``, its signatures not checked: the host checks them, with its policy."""
    try:
        parsed = contracts.Envelope.model_validate(envelope)
        if parsed.payloadType != dsse.PAYLOAD_TYPES[kind]:
            raise UsageError(f"{what} has payload type {parsed.payloadType!r}, expected {dsse.PAYLOAD_TYPES[kind]!r}")
        return contracts.parse_document(model, base64.b64decode(parsed.payload))
    except (contracts.JsonError, contracts.ValidationError) as exc:
        detail = contracts.describe_validation_error(exc) if isinstance(exc, contracts.ValidationError) else str(exc)
        raise UsageError(f"{what} is not a valid signed {kind}: {detail}") from None


def _playbook_members(directory: Path) -> list[tuple[str, str]]:
    if not directory.is_dir() or directory.is_symlink():
        raise UsageError(f"--playbooks {directory} is not a directory")
    members = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        # os.walk lists a symlinked directory without entering it: refuse it like a symlinked file.
        for name in sorted(files + dirs):
            source = Path(root) / name
            if source.is_symlink() or not (source.is_file() or source.is_dir()):
                raise UsageError(f"{source} is a symbolic link or special file: a bundle ships regular files only")
            if source.is_file():
                members.append((f"playbooks/{source.relative_to(directory).as_posix()}", str(source)))
    if not members:
        raise UsageError(f"--playbooks {directory} holds no files")
    return members


def _check_manifest_files(
    manifests: Sequence[tuple[contracts.ArtifactManifest, str]], planned: Sequence[PlannedMember]
) -> None:
    found = {member.path: member for member in planned}
    for manifest, where in manifests:
        for entry in manifest.files:
            member = found[f"{where}/files/{entry.path}"]
            if (member.size, member.sha256) != (entry.size, entry.sha256):
                raise UsageError(
                    f"{member.source} is {member.size} bytes with sha256 {member.sha256}, but the manifest for "
                    f"{manifest.name} {manifest.version} lists {entry.size} bytes, sha256 {entry.sha256}: hosts would "
                    "refuse it - ship the files the manifest was signed for"
                )


# --- verify --kind bundle FILE.tar ---------------------------------------------------------------------


def is_envelope_file(path: Path) -> bool:
    """Whether ``path`` holds a JSON envelope (starts with ``{``) rather than a bundle tar."""
    try:
        with path.open("rb") as handle:
            head = handle.read(64)
    except OSError:
        return True  # let the envelope path report the unreadable file as it always has
    return head.lstrip().startswith(b"{")


def verify_bundle_file(args: argparse.Namespace, policy: Policy, store: StateStore, *, now: datetime) -> int:
    """``verify --kind bundle FILE.tar``: every member read and checked, nothing kept; one JSON line."""
    node_id = args.node_id or socket.gethostname().lower()
    try:
        applied = store.load()
        check = bundle_reader.check_bundle(str(args.envelope), policy, node_id=node_id, now=now, applied=applied)
    except bundle_reader.BundleRefused as refused:
        _emit({"accepted": False, "reason": refused.reason.value, "message": refused.message, "member": refused.member})
        return 1
    except (StateStoreError, OSError) as exc:
        _emit({"accepted": False, "reason": "record-error", "message": str(exc)})
        return 2
    verified = check.verified
    state = verified.desired.state
    summary: dict[str, Any] = {
        "accepted": True,
        "kind": "bundle",
        "bundle_id": verified.bundle.bundle_id,
        "signers": list(verified.signers),
        "state_signers": list(verified.desired.signers),
        "node_id": state.node_id,
        "generation": state.generation,
        "lease_epoch": state.lease_epoch,
        "expires_at": contracts.format_rfc3339(verified.bundle.expires_at),
        "members": len(verified.bundle.files),
        "bytes": check.bytes_read,
        "artifacts": [f"{m.manifest.name}/{m.manifest.version}" for m in check.manifests],
        "images": [image.reference for image in check.images.values()],
        "already_applied": verified.desired.already_applied,
        "recorded": False,
    }
    if args.record and not verified.desired.already_applied:
        try:
            store.record_applied(state.generation, state.lease_epoch, verified.desired.payload_sha256)
        except OSError as exc:
            raise UsageError(f"cannot record the applied state in {store.state_dir}: {exc}") from None
        summary["recorded"] = True
    _emit(summary)
    return 0


def _emit(document: dict[str, Any]) -> None:
    print(json.dumps(document, sort_keys=True))

"""What the control plane does, independent of HTTP: the HTTP app and the CLI both call these methods.

Every refusal is a ``ProtocolError`` carrying the HTTP status, a short reason code for programs and a
sentence with the values for people; the app turns it into ``{"reason": ..., "detail": ...}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import TypeAdapter

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.contracts import (
    DRIVERS,
    CertificateRenewalRequest,
    DesiredState,
    EnrollmentRequest,
    EnrollmentResponse,
    Lease,
    NodeId,
    Observation,
    ServingProjection,
    ValidationError,
    describe_validation_error,
    format_rfc3339,
)
from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from meridian_node_agent.devserver.control.ca import (
    CertificateAuthority,
    CertificateExpiredError,
    CsrError,
    PeerCertificateError,
    node_ids_in,
)
from meridian_node_agent.devserver.control.files import private_file_exclusive, write_public_file
from meridian_node_agent.devserver.store.change_feed import (
    ChangeFeed,
    ChangeKind,
    InProcessFeed,
    PostgresChangeChannel,
    SqliteChangeLog,
    StateChange,
    change_log_path,
    libpq_conninfo,
)
from meridian_node_agent.devserver.store.database import (
    SUPERSEDED_BY_ENROLLMENT,
    CertificateRecord,
    Database,
    LeaseRecord,
    NodeRow,
    PublishedState,
    StoreConflict,
    UnknownNode,
)

__all__ = [
    "SERVER_ASSIGNED_FIELDS",
    "ControlPlane",
    "DataDir",
    "LocalState",
    "ProtocolError",
    "Settings",
    "check_node_id",
    "check_observation_node",
    "epoch_refusal",
    "open_control_plane",
    "unknown_node",
]

_log = logging.getLogger(__name__)
_NODE_ID = TypeAdapter(NodeId)

# How a certificate's record is looked up by serial: the database, or a server's cache of it.
CertificateRecords = Callable[[str], CertificateRecord | None]

# Fields of a desired state that publish fills in; a document that sets them is refused.
SERVER_ASSIGNED_FIELDS = ("generation", "lease_epoch", "issued_at", "expires_at")


class ProtocolError(MeridianError):
    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Settings:
    """Tunables, with the limits the server enforces."""

    lease_s: int = 30
    certificate_days: int = 30
    state_ttl_s: int = 3600
    max_wait_s: float = 60.0
    # When set, overrides certificate_days: short certificates for tests and demos of renewal.
    certificate_s: int | None = None

    def __post_init__(self) -> None:
        # Messages name what an operator sets (serve's --lease-seconds, --certificate-seconds...).
        limits = (
            ("lease_seconds", self.lease_s),
            ("certificate_days", self.certificate_days),
            ("state_ttl_seconds", self.state_ttl_s),
        )
        for name, value in limits:
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.certificate_s is not None and self.certificate_s < 1:
            raise ValueError(f"certificate_seconds must be at least 1, got {self.certificate_s}")
        if not 0 <= self.max_wait_s <= 3600:
            raise ValueError(f"max_wait_seconds must be from 0 to 3600, got {self.max_wait_s:g}")

    @property
    def certificate_lifetime(self) -> timedelta:
        if self.certificate_s is not None:
            return timedelta(seconds=self.certificate_s)
        return timedelta(days=self.certificate_days)


@dataclass(frozen=True)
class DataDir:
    """Where the devserver keeps its state. Private keys are 0600, the directory 0700."""

    root: Path

    @property
    def database(self) -> Path:
        return self.root / "devserver.sqlite3"

    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    @property
    def ca_bundle(self) -> Path:
        return self.ca_dir / "ca.pem"

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    @property
    def control_key(self) -> Path:
        return self.root / "control" / "control.key.pem"

    @property
    def control_public_key(self) -> Path:
        return self.root / "control" / "control.pub.pem"


def parse_desired_document(data: bytes, where: str) -> dict[str, Any]:
    """A desired state as an operator wrote it (YAML holding a mapping), read from ``where`` (named in messages);
    ValueError saying what is wrong. ``publish`` reads it with this, in the CLI and in the server's operator socket
    alike."""
    try:
        document = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where!r} is not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise ValueError(f"{where!r} must hold a mapping (a desired state), got {type(document).__name__}")
    return document


def open_control_plane(
    data_dir: Path, *, database: str | None = None, settings: Settings | None = None
) -> ControlPlane:
    """Open (creating on first use) the CA, control key and database in ``data_dir``.

    ``database``: a SQLite file path, ``:memory:`` or a database URL (``postgresql+psycopg://...``); by default
    the SQLite file in ``data_dir``. ``Database`` (``store/database.py``) migrates it to the newest schema.
    """
    paths = DataDir(data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = CertificateAuthority(paths.ca_dir)
    key = _load_or_create_control_key(paths)
    location = database if database is not None else str(paths.database)
    store = Database(location)
    return ControlPlane(
        store=store,
        ca=ca,
        control_key=key,
        paths=paths,
        settings=settings or Settings(),
        feed=_change_feed(store, location),
    )


def _change_feed(store: Database, location: str) -> ChangeFeed:
    """Where this database's changes are announced to the servers holding it in memory (``store/change_feed.py``)."""
    if store.backend == "postgresql":
        return PostgresChangeChannel(libpq_conninfo(location))
    if store.path == ":memory:":
        return InProcessFeed()
    return SqliteChangeLog(change_log_path(store.path))


def _load_or_create_control_key(paths: DataDir) -> Ed25519PrivateKey:
    paths.control_key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not paths.control_key.exists():
        pem, _keyid = dsse.generate_private_key_pem()
        private_file_exclusive(paths.control_key, pem)
    key = dsse.load_private_key_pem(paths.control_key.read_bytes())
    public = dsse.public_key_pem(key)
    if not paths.control_public_key.exists() or paths.control_public_key.read_bytes() != public:
        write_public_file(paths.control_public_key, public)
    return key


TOKEN_PREFIX = "mnt_"  # noqa: S105 - a prefix, not a secret


def check_node_id(value: str) -> str:
    """``value`` if it is a node id by the contracts' rule (the same check enrollment requests get)."""
    if not value:
        raise ValueError("a node id cannot be empty")
    try:
        return _NODE_ID.validate_python(value)
    except ValidationError as exc:
        raise ValueError(
            f"{value!r} is not a node id: use lowercase letters, digits, '.' and '-', starting and ending with a "
            "letter or digit, at most 253 characters"
        ) from exc


class LocalState(Protocol):
    """What a server in this process holds in memory (``state_cache.NodeStateCache``), told of this process's own
    changes as they commit: no announcement needs to come back for them."""

    def note_published(self, state: PublishedState) -> None: ...

    def note_epoch(self, node_id: str, epoch: int) -> None: ...

    def forget_certificates(self, node_id: str) -> None: ...


@dataclass(kw_only=True, eq=False)
class ControlPlane:
    """The control plane's verbs against the database, for the CLI and the server alike.

    Every verb that changes what a server holds in memory (a publish, a fence, a revocation, a re-enrollment)
    tells ``local`` (a server in this process, if any) and announces it on ``feed`` to the servers in other
    processes, after its transaction has committed (``store/change_feed.py``).
    """

    store: Database
    ca: CertificateAuthority
    control_key: Ed25519PrivateKey
    paths: DataDir
    settings: Settings
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    feed: ChangeFeed = field(default_factory=InProcessFeed)
    local: LocalState | None = field(default=None, init=False)

    @property
    def control_keyid(self) -> str:
        return dsse.keyid_for(self.control_key.public_key())

    def now(self) -> datetime:
        return self.clock()

    def close(self) -> None:
        self.feed.close()
        self.store.close()

    def _changed(self, kind: ChangeKind, node_id: str) -> None:
        self.feed.announce(StateChange(kind, node_id))

    # Operator verbs

    def create_token(self, name: str, value: str | None = None, node_id: str | None = None) -> str:
        """Create enrollment token ``name`` (a random value unless given); returns the value.

        With ``node_id`` the token can enroll only that node; without, it can enroll any node id.
        """
        # ':' separates the value and '@' the node id in 'serve --token NAME@NODE_ID:VALUE'.
        if not name or ":" in name or "@" in name:
            raise ValueError(f"token name {name!r} must be non-empty and contain no ':' or '@'")
        if node_id is not None:
            node_id = check_node_id(node_id)
        if value is not None and len(value) < 8:
            raise ValueError(f"token {name!r}: a value needs at least 8 characters, got {len(value)}")
        if value is not None and value.startswith("-"):
            raise ValueError(
                f"token {name!r}: a value must not start with '-' (command lines would read it as an option)"
            )
        # A fixed prefix: a generated token never starts with '-' (token_urlsafe's alphabet has it, and
        # 'enroll --token -abc' is then an error), and secret scanners can recognise leaked ones.
        token = value if value is not None else TOKEN_PREFIX + secrets.token_urlsafe(24)
        try:
            self.store.put_token(name, token, self.now(), node_id)
        except StoreConflict as exc:
            raise ValueError(exc.detail) from exc
        return token

    def publish(self, node_id: str, document: Mapping[str, Any], *, ttl_s: int | None = None) -> PublishedState:
        """Sign and store ``document`` as the node's next desired state (generation, epoch and times filled in)."""
        ttl = timedelta(seconds=ttl_s if ttl_s is not None else self.settings.state_ttl_s)
        if ttl <= timedelta(0):
            raise ValueError(f"the state's time to live must be positive, got {ttl.total_seconds():g} s")
        body_fields = _publishable(node_id, document)
        now = self.now().replace(microsecond=0)

        def build(generation: int, epoch: int) -> tuple[bytes, str]:
            payload = {
                **body_fields,
                "generation": generation,
                "lease_epoch": epoch,
                "issued_at": format_rfc3339(now),
                "expires_at": format_rfc3339(now + ttl),
            }
            try:
                state = DesiredState.model_validate(payload)
            except ValidationError as exc:
                raise ValueError(
                    f"the desired state for {node_id!r} is invalid: {describe_validation_error(exc)}"
                ) from exc
            body = json.dumps(state.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
            envelope = dsse.sign(dsse.PAYLOAD_TYPES["desired-state"], body, [self.control_key])
            data = json.dumps(envelope, separators=(",", ":")).encode()
            return data, f'"{hashlib.sha256(data).hexdigest()}"'

        published = self.store.publish(node_id, build, self.now())
        if self.local is not None:
            self.local.note_published(published)
        self._changed(ChangeKind.PUBLISHED, node_id)
        return published

    def fence(self, node_id: str) -> int:
        epoch = self.store.fence(node_id)
        if self.local is not None:
            self.local.note_epoch(node_id, epoch)
        self._changed(ChangeKind.FENCED, node_id)
        return epoch

    def revoke(self, node_id: str) -> int:
        revoked = self.store.revoke(node_id, self.now())
        if self.local is not None:
            self.local.forget_certificates(node_id)
        self._changed(ChangeKind.REVOKED, node_id)
        return revoked

    def nodes(self) -> list[NodeRow]:
        return self.store.nodes()

    # Protocol

    def enroll(self, request: EnrollmentRequest, remote_host: str | None = None) -> EnrollmentResponse:
        try:
            issued = self.ca.issue_node_certificate(
                request.node_id, request.csr_pem, lifetime=self.settings.certificate_lifetime
            )
        except CsrError as exc:
            raise ProtocolError(422, "bad-csr", str(exc)) from exc
        try:
            enrolled = self.store.enroll(
                token=request.token,
                node_id=request.node_id,
                serial=_serial_key(issued.serial),
                not_after=issued.not_after,
                lease_for=timedelta(seconds=self.settings.lease_s),
                now=self.now(),
            )
        except StoreConflict as exc:
            # Refused enrollments are what token guessing or a stolen token looks like: leave a trace.
            _log.warning(
                "enrollment refused (%s) for node %r from %s: %s",
                exc.reason,
                request.node_id,
                remote_host or "unknown address",
                exc.server_note or exc.detail,
            )
            raise ProtocolError(403, exc.reason, exc.detail) from exc
        if enrolled.superseded:
            # Certificates a server may hold as valid were revoked: no earlier key may speak for the node from now.
            if self.local is not None:
                self.local.forget_certificates(request.node_id)
            self._changed(ChangeKind.ENROLLED, request.node_id)
            # Expected after a revocation or a rebuilt node; anything else means someone else enrolled as it.
            _log.warning(
                "node %r enrolled again from %s: its %d earlier certificate(s) are revoked",
                request.node_id,
                remote_host or "unknown address",
                enrolled.superseded,
            )
        return EnrollmentResponse(
            node_id=request.node_id,
            certificate_pem=issued.pem,
            ca_bundle_pem=self.ca.bundle_pem,
            lease=_lease(enrolled.lease),
        )

    def authenticate(
        self, certificate_der: bytes | None, node_id: str | None, *, records: CertificateRecords | None = None
    ) -> str:
        """The node a request speaks for, from its client certificate; 403 unless it may speak for ``node_id``.

        ``node_id`` None (an endpoint without a node in its path) accepts any valid, unrevoked certificate.
        ``records`` looks the certificate's record up (default: the database; a server passes its cache, which a
        revocation empties, so ``revoke`` takes effect on the next request either way).
        """
        return self._authenticated(certificate_der, node_id, records or self.store.certificate)[1].node_id

    def renew_certificate(
        self,
        certificate_der: bytes | None,
        node_id: str,
        request: CertificateRenewalRequest,
        *,
        records: CertificateRecords | None = None,
    ) -> EnrollmentResponse:
        """A new certificate for the CSR's (new) key, for the node whose current certificate made the call.

        Authenticated like every node endpoint; the presented certificate stays valid until it expires.
        """
        presented, record = self._authenticated(certificate_der, node_id, records or self.store.certificate)
        if request.node_id != node_id:
            raise ProtocolError(
                403,
                "wrong-node",
                f"the renewal request is for node {request.node_id!r}, but was posted for node {node_id!r}",
            )
        try:
            issued = self.ca.issue_node_certificate(
                node_id, request.csr_pem, lifetime=self.settings.certificate_lifetime, renewing=presented
            )
        except CsrError as exc:
            raise ProtocolError(422, "bad-csr", str(exc)) from exc
        try:
            lease = self.store.add_renewed_certificate(
                node_id=node_id,
                presented_serial=record.serial,
                serial=_serial_key(issued.serial),
                not_after=issued.not_after,
                now=self.now(),
            )
        except StoreConflict as exc:
            raise ProtocolError(403, exc.reason, exc.detail) from exc
        return EnrollmentResponse(
            node_id=node_id, certificate_pem=issued.pem, ca_bundle_pem=self.ca.bundle_pem, lease=_lease(lease)
        )

    def _authenticated(
        self, certificate_der: bytes | None, node_id: str | None, records: CertificateRecords
    ) -> tuple[x509.Certificate, CertificateRecord]:
        if certificate_der is None:
            raise ProtocolError(
                403,
                "client-certificate-required",
                "this endpoint needs the node's client certificate (mutual TLS); enroll first and present it",
            )
        try:
            certificate = self.ca.check_peer(certificate_der, self.now())
        except CertificateExpiredError as exc:
            raise ProtocolError(403, "certificate-expired", str(exc)) from exc
        except PeerCertificateError as exc:
            raise ProtocolError(403, "certificate-untrusted", str(exc)) from exc
        serial = _serial_key(certificate.serial_number)
        record = records(serial)
        if record is None:
            raise ProtocolError(
                403, "certificate-unknown", f"certificate serial {serial} was never issued by this control plane"
            )
        if record.revoked_at is not None:
            when = format_rfc3339(record.revoked_at)
            if record.revoked_reason == SUPERSEDED_BY_ENROLLMENT:
                why = (
                    f"was superseded at {when}, when node {record.node_id!r} enrolled again (each enrollment "
                    "revokes the node's earlier certificates); if that was not this node, its identity is in "
                    "other hands: revoke it and enroll it again with a new token"
                )
            else:
                why = f"was revoked at {when}; enroll again with a new token"
            raise ProtocolError(
                403,
                "certificate-revoked",
                f"the certificate of node {record.node_id!r} (serial {serial[:16]}...) {why}",
            )
        names = node_ids_in(certificate)
        if node_id is not None and (node_id not in names or record.node_id != node_id):
            raise ProtocolError(
                403,
                "wrong-node",
                f"the client certificate is for node {record.node_id!r}, but the request is for node {node_id!r}",
            )
        return certificate, record

    def desired_state(self, node_id: str) -> PublishedState | None:
        """The node's latest desired state, read from the database (a server answers from memory: ``hot_path``)."""
        return self.store.latest_desired(node_id)

    def observe(self, node_id: str, observation: Observation, remote_host: str) -> None:
        """Store the observation now, in a transaction of its own (``import-outbox``; a server batches them:
        ``serving/observation_writer.py``)."""
        check_observation_node(node_id, observation)
        try:
            self.store.record_observation(
                node_id,
                observation.lease_epoch,
                observation.observed_at,
                remote_host,
                observation.model_dump_json(),
                self.now(),
            )
        except UnknownNode as exc:
            raise unknown_node(node_id) from exc
        except StoreConflict as exc:
            raise ProtocolError(409, exc.reason, exc.detail) from exc

    def serving(self) -> ServingProjection:
        """Every engine that its node last reported ready and not draining, with the address to route to.

        The host part of the address is where the node's last observation came from: the control plane
        knows no better address for a node, and it is the one that reached us.
        """
        endpoints: list[dict[str, Any]] = []
        for record in self.store.serving_observations():
            observation = Observation.model_validate_json(record.body)
            host = f"[{record.remote_host}]" if ":" in record.remote_host else record.remote_host
            for engine in observation.engines:
                if not engine.ready or engine.draining or engine.port is None or engine.driver not in DRIVERS:
                    continue
                endpoints.append(
                    {
                        "node_id": record.node_id,
                        "engine": engine.name,
                        "driver": engine.driver,
                        "served_model_name": engine.served_model_name or engine.name,
                        "address": f"{host}:{engine.port}",
                    }
                )
        return ServingProjection.model_validate(
            {
                "apiVersion": "meridian.node/v1",
                "kind": "ServingProjection",
                "generated_at": format_rfc3339(self.now()),
                "endpoints": endpoints,
            }
        )


def _publishable(node_id: str, document: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(document, Mapping):
        raise ValueError(f"a desired state document must be a mapping, got {type(document).__name__}")
    assigned = [name for name in SERVER_ASSIGNED_FIELDS if name in document]
    if assigned:
        raise ValueError(
            f"the document sets {', '.join(assigned)}; publish assigns generation, lease_epoch, issued_at and "
            "expires_at itself - remove them (use --ttl for the lifetime)"
        )
    for name, expected in (("node_id", node_id), ("apiVersion", "meridian.node/v1"), ("kind", "DesiredState")):
        if name in document and document[name] != expected:
            raise ValueError(f"the document's {name} is {document[name]!r}, expected {expected!r}")
    return {**dict(document), "apiVersion": "meridian.node/v1", "kind": "DesiredState", "node_id": node_id}


def _lease(record: LeaseRecord) -> Lease:
    return Lease(node_id=record.node_id, epoch=record.epoch, expires_at=record.expires_at, renewed_at=record.renewed_at)


def _serial_key(serial: int) -> str:
    return format(serial, "x")


def unknown_node(node_id: str) -> ProtocolError:
    return ProtocolError(404, "unknown-node", f"node {node_id!r} is not known to this control plane")


def check_observation_node(node_id: str, observation: Observation) -> None:
    """403 unless the observation is about the node it was posted for."""
    if observation.node_id != node_id:
        raise ProtocolError(
            403,
            "wrong-node",
            f"the observation is about node {observation.node_id!r}, but was posted for node {node_id!r}",
        )


def epoch_refusal(node_id: str, lease_epoch: int, epoch: int) -> ProtocolError:
    """The 409 for an observation under ``lease_epoch`` when the node is at ``epoch``."""
    if lease_epoch > epoch:
        return ProtocolError(
            409,
            "future-epoch",
            f"the observation carries lease epoch {lease_epoch}, but node {node_id!r} is only at epoch {epoch}: "
            "this control plane never issued it",
        )
    if lease_epoch < epoch:
        return ProtocolError(
            409,
            "stale-epoch",
            f"the observation carries lease epoch {lease_epoch}, but node {node_id!r} is at epoch {epoch}: it comes "
            "from a writer that has been fenced; heartbeat to learn the current epoch",
        )
    # The database's fence refused a row whose epoch moved while it was written, and moved back is impossible:
    # another observation of the node replaced it in its batch and that one was refused.
    return ProtocolError(
        409,
        "stale-epoch",
        f"the observation of node {node_id!r} under lease epoch {lease_epoch} was refused by the database's epoch "
        "check while it was being stored; heartbeat to learn the current epoch and post it again",
    )

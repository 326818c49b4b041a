"""The node's TLS identity: its private key, the certificate the control plane issued, and the CA bundle.

Runs on: the agent side: the key and certificate live in the agent's own ``<state_dir>/identity``.

Layout in the identity directory (0700) right after enrollment::

    node.key.pem   ECDSA P-256 private key, PKCS#8, mode 0600, created once and never overwritten
    node.pem       client certificate from enrollment (SAN = node id)
    ca.pem         the control plane's CA bundle, used to verify the server

and after the first renewal::

    node.key.pem -> current/node.key.pem
    node.pem     -> current/node.pem
    current      -> versions/<serial>-<random>
    versions/<serial>-<random>/{node.key.pem (0600), node.pem}   directory 0700

Renewal rotates the key. The new key and its certificate are written together into a fresh version
directory, and one ``rename`` of the ``current`` symlink switches both at once, so a crash at any point
leaves ``node.key.pem`` and ``node.pem`` naming a pair that belongs together: the old pair before the
rename, the new one after it. The two fixed names stay valid paths for everything that opens them (the
control client, ``meridian-node status``). Moving an enrolled node's flat files into a version directory
is done in steps that each leave a matching pair too (see ``_adopt_flat_layout``). The new private key
exists on disk only inside a 0700 directory, in a 0600 file, and only once its certificate has arrived.

P-256 rather than Ed25519 because the key is used in TLS, where P-256 works with every stack (see
``meridian_node_agent.devserver.control.ca``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    atomic_write,
    create_exclusive,
    fsync_directory,
)
from ansible_collections.meridian.node.plugins.module_utils.contracts import EnrollmentResponse, format_rfc3339

# The pinned public API (tests/devserver/test_devserver_units.py).
__all__ = [
    "CertificateInfo",
    "CertificateIssuer",
    "CertificateRenewal",
    "IdentityError",
    "NodeIdentity",
    "PendingKey",
    "certificate_info",
]

_CURRENT = "current"
_VERSIONS = "versions"
_KEY_FILE = "node.key.pem"
_CERT_FILE = "node.pem"


class IdentityError(MeridianError, ValueError):
    """The identity files are missing, unreadable or do not belong together; the message says which."""


@dataclass(frozen=True)
class CertificateInfo:
    node_ids: tuple[str, ...]
    serial: int
    not_before: datetime
    not_after: datetime

    def remaining(self, now: datetime) -> float:
        """Seconds until expiry (negative once expired)."""
        return (self.not_after - now).total_seconds()

    def renew_after(self, remaining_fraction: float) -> datetime:
        """When less than ``remaining_fraction`` of the certificate's lifetime is left."""
        return self.not_after - (self.not_after - self.not_before) * remaining_fraction


@dataclass(frozen=True)
class PendingKey:
    """A freshly generated key (PEM, in memory only) and the CSR made with it, awaiting its certificate."""

    key_pem: bytes = field(repr=False)
    csr_pem: str


@runtime_checkable
class CertificateIssuer(Protocol):
    """The part of the control client that renewal needs (``ControlClient`` is one)."""

    def renew_certificate(self, node_id: str, csr_pem: str) -> EnrollmentResponse: ...
    def reload_identity(self) -> None: ...


class NodeIdentity:
    """The identity files in ``directory``. Nothing is read or written until a method is called."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def key_path(self) -> Path:
        return self.directory / "node.key.pem"

    @property
    def cert_path(self) -> Path:
        return self.directory / "node.pem"

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def current_link(self) -> Path:
        return self.directory / _CURRENT

    @property
    def versions_dir(self) -> Path:
        return self.directory / _VERSIONS

    @property
    def enrolled(self) -> bool:
        return self.key_path.exists() and self.cert_path.exists() and self.ca_path.exists()

    def ensure_key(self) -> bool:
        """Create the private key (0600) unless it exists; True when this call created it.

        Never replaces an existing key: a certificate may already be bound to it.
        """
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.key_path.exists():
            return False
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        # link() refuses to replace an existing name: a concurrent creator keeps its key.
        return create_exclusive(self.key_path, pem, 0o600)

    def csr_pem(self, node_id: str) -> str:
        """A certificate signing request for ``node_id`` made with the node key (creating the key if needed)."""
        self.ensure_key()
        return _csr(self._private_key(), node_id)

    def new_key(self, node_id: str) -> PendingKey:
        """A new key and a CSR for ``node_id`` made with it, for a renewal; nothing is written yet."""
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return PendingKey(key_pem=pem, csr_pem=_csr(key, node_id))

    def install_renewal(self, response: EnrollmentResponse, pending: PendingKey) -> CertificateInfo:
        """Switch to ``pending``'s key and the certificate a renewal issued for it, atomically (see module doc).

        Refused, with nothing changed, when the certificate is for another node or another key.
        """
        key = serialization.load_pem_private_key(pending.key_pem, password=None)
        certificate, info = _issued_certificate(response, "renewal", "not installed")
        if certificate.public_key() != key.public_key():
            raise IdentityError("the renewed certificate is for another key than the one just generated; not installed")
        self._adopt_flat_layout()
        previous = self.current_link.readlink()
        version = self._write_version(pending.key_pem, response.certificate_pem.encode("ascii"), info.serial)
        if self.ca_path.read_bytes() != response.ca_bundle_pem.encode("ascii"):
            atomic_write(self.ca_path, response.ca_bundle_pem.encode("ascii"), mode=0o644)
        self._point_current_at(version)
        self._prune(keep={version.name, previous.name})
        return info

    def store(self, response: EnrollmentResponse) -> CertificateInfo:
        """Keep the certificate and CA bundle from an enrollment, after checking they fit this node and key.

        A certificate for another node id, or for a public key that is not ours, is refused rather than
        stored: it could never authenticate this node and would only hide the real problem.
        """
        certificate, info = _issued_certificate(response, "enrollment", "not stored")
        if certificate.public_key() != self._private_key().public_key():
            raise IdentityError(
                f"the issued certificate is for a different public key than {self.key_path}; not stored"
            )
        atomic_write(self.ca_path, response.ca_bundle_pem.encode("ascii"), mode=0o644)
        atomic_write(self.cert_path, response.certificate_pem.encode("ascii"), mode=0o644)
        return info

    def certificate(self) -> CertificateInfo:
        """What the stored certificate says: node ids, serial, validity."""
        try:
            data = self.cert_path.read_bytes()
        except OSError as exc:
            raise IdentityError(
                f"cannot read the node certificate {self.cert_path}: {exc.strerror}; enroll first"
            ) from exc
        try:
            return certificate_info(x509.load_pem_x509_certificate(data))
        except ValueError as exc:
            raise IdentityError(f"{self.cert_path} is not a PEM certificate: {exc}") from exc

    def describe_expiry(self, now: datetime) -> str:
        info = self.certificate()
        left = info.remaining(now)
        when = format_rfc3339(info.not_after)
        if left <= 0:
            return f"the node certificate expired at {when}; enroll again"
        return f"the node certificate is valid until {when} ({int(left // 86400)} day(s) left)"

    # The versioned layout

    def _adopt_flat_layout(self) -> None:
        """Make ``node.key.pem``/``node.pem`` symlinks into ``current/``, keeping the pair they hold now.

        Steps, each leaving a matching pair behind: copy the pair into a new version directory; point
        ``current`` at it; replace ``node.key.pem`` by a link to the same key; replace ``node.pem`` by a
        link to the same certificate. Also run after a re-enrollment, which writes ``node.pem`` flat.
        """
        if (
            self.current_link.is_symlink()
            and _links_to(self.key_path, f"{_CURRENT}/{_KEY_FILE}")
            and _links_to(self.cert_path, f"{_CURRENT}/{_CERT_FILE}")
            and self.enrolled
        ):
            return
        key_pem = self.key_path.read_bytes()
        cert_pem = self.cert_path.read_bytes()
        try:
            certificate = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as exc:
            raise IdentityError(f"{self.cert_path} is not a PEM certificate: {exc}") from exc
        if certificate.public_key() != self._private_key().public_key():
            raise IdentityError(
                f"{self.cert_path} and {self.key_path} do not belong together; enroll again before renewing"
            )
        version = self._write_version(key_pem, cert_pem, certificate.serial_number)
        self._point_current_at(version)
        for path, name in ((self.key_path, _KEY_FILE), (self.cert_path, _CERT_FILE)):
            if not _links_to(path, f"{_CURRENT}/{name}"):
                _replace_with_symlink(path, f"{_CURRENT}/{name}")
        fsync_directory(self.directory)

    def _write_version(self, key_pem: bytes, cert_pem: bytes, serial: int) -> Path:
        """A complete, fsynced version directory holding the pair; it appears under its name only when whole."""
        self.versions_dir.mkdir(mode=0o700, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.versions_dir, prefix=".new-"))  # mode 0700
        try:
            _write_new_file(staging / _KEY_FILE, key_pem, 0o600)
            _write_new_file(staging / _CERT_FILE, cert_pem, 0o644)
            fsync_directory(staging)
            version = self.versions_dir / f"{serial:x}-{secrets.token_hex(4)}"
            staging.rename(version)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_directory(self.versions_dir)
        return version

    def _point_current_at(self, version: Path) -> None:
        temp = self.directory / f".{_CURRENT}.{secrets.token_hex(4)}.tmp"
        temp.symlink_to(f"{_VERSIONS}/{version.name}")
        try:
            # rename(2) replaces the old link itself (it does not follow it): the switch is atomic.
            temp.replace(self.current_link)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            raise
        fsync_directory(self.directory)

    def _prune(self, keep: set[str]) -> None:
        """Remove versions other than ``keep`` (the new one and the one just replaced) and stale staging dirs."""
        for entry in self.versions_dir.iterdir():
            if entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)

    def _private_key(self) -> ec.EllipticCurvePrivateKey:
        try:
            key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        except OSError as exc:
            raise IdentityError(f"cannot read the node key {self.key_path}: {exc.strerror}") from exc
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"{self.key_path} is not an unencrypted PEM private key: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise IdentityError(f"{self.key_path} holds a {type(key).__name__}; the node key must be EC P-256")
        return key


class CertificateRenewal:
    """When to renew, and what happened last time: the expiry is cached, so an unchanged cycle reads no file.

    The caller (the agent's cycle) asks ``due(now)`` every cycle; that is a comparison of two datetimes
    once the certificate has been read. ``renew`` re-reads the certificate first (it may have been
    replaced by a re-enrollment), rotates the key and switches to the new pair; ``failed`` records a
    failure and when to try again, which the caller decides (it owns the backoff and its randomness).
    """

    def __init__(self, identity: NodeIdentity, *, remaining_fraction: float) -> None:
        if not 0 < remaining_fraction < 1:
            raise ValueError(f"remaining_fraction must be between 0 and 1, got {remaining_fraction}")
        self.identity = identity
        self.remaining_fraction = remaining_fraction
        self.info: CertificateInfo | None = None
        self.renew_at: datetime | None = None
        self.failures = 0
        self.next_attempt_at: datetime | None = None
        self.last_error: str | None = None
        self.last_failed_at: datetime | None = None
        self.last_renewed_at: datetime | None = None

    def due(self, now: datetime) -> bool:
        if self.info is None or self.renew_at is None:
            if self.next_attempt_at is not None and now < self.next_attempt_at:
                return False
            try:
                self._remember(self.identity.certificate())
            except IdentityError as exc:
                # Not enrolled (or unreadable): nothing to renew; look again at the next retry time.
                self.last_error = str(exc)
                self.next_attempt_at = now + timedelta(hours=1)
                return False
        assert self.renew_at is not None
        if now < self.renew_at:
            return False
        return self.next_attempt_at is None or now >= self.next_attempt_at

    def renew(self, issuer: CertificateIssuer, node_id: str, now: datetime) -> CertificateInfo | None:
        """Renew if the certificate on disk is still due; the new pair's info, or None when it was not due.

        Raises what the issuer or the identity raise; the old pair is then still in place.
        """
        self._remember(self.identity.certificate())
        assert self.renew_at is not None
        if now < self.renew_at:
            return None
        pending = self.identity.new_key(node_id)
        response = issuer.renew_certificate(node_id, pending.csr_pem)
        info = self.identity.install_renewal(response, pending)
        issuer.reload_identity()
        self._remember(info)
        self.failures = 0
        self.next_attempt_at = None
        self.last_error = None
        self.last_renewed_at = now
        return info

    def failed(self, now: datetime, error: str, retry_in_s: float) -> datetime:
        """Record a failure; the next attempt is ``retry_in_s`` seconds away, or half the time left if sooner."""
        self.failures += 1
        self.last_error = error
        self.last_failed_at = now
        left_s = self.info.remaining(now) if self.info is not None else 0.0
        if left_s > 0:
            # Try again before the certificate lapses, but not in a tight loop in its last seconds.
            retry_in_s = min(retry_in_s, max(left_s / 2, 10.0))
        self.next_attempt_at = now + timedelta(seconds=retry_in_s)
        return self.next_attempt_at

    def status(self) -> dict[str, Any]:
        """For status.json: plain JSON values."""
        return {
            "serial": f"{self.info.serial:x}" if self.info else None,
            "not_after": _stamp(self.info.not_after if self.info else None),
            "renew_after": _stamp(self.renew_at),
            "last_renewed_at": _stamp(self.last_renewed_at),
            "failures": self.failures,
            "last_failed_at": _stamp(self.last_failed_at),
            "last_error": self.last_error,
            "next_attempt_at": _stamp(self.next_attempt_at) if self.failures else None,
        }

    def _remember(self, info: CertificateInfo) -> None:
        self.info = info
        self.renew_at = info.renew_after(self.remaining_fraction)


def _issued_certificate(
    response: EnrollmentResponse, exchange: str, refused: str
) -> tuple[x509.Certificate, CertificateInfo]:
    """The certificate an enrollment or renewal answered with, readable and naming the node it was for."""
    try:
        certificate = x509.load_pem_x509_certificate(response.certificate_pem.encode("ascii"))
        x509.load_pem_x509_certificates(response.ca_bundle_pem.encode("ascii"))
    except ValueError as exc:
        raise IdentityError(f"the {exchange} response carries an unreadable certificate: {exc}") from exc
    info = certificate_info(certificate)
    if response.node_id not in info.node_ids:
        raise IdentityError(
            f"the {exchange}'s certificate names {list(info.node_ids)}, not node {response.node_id!r}; {refused}"
        )
    return certificate, info


def _stamp(value: datetime | None) -> str | None:
    return format_rfc3339(value) if value is not None else None


def _csr(key: ec.EllipticCurvePrivateKey, node_id: str) -> str:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode("ascii")


def _links_to(path: Path, target: str) -> bool:
    return path.is_symlink() and str(path.readlink()) == target


def _replace_with_symlink(path: Path, target: str) -> None:
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    temp.symlink_to(target)
    try:
        temp.replace(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise


def _write_new_file(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL with the final mode from the start: the key is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), mode)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def certificate_info(certificate: x509.Certificate) -> CertificateInfo:
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(san.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = ()
    return CertificateInfo(
        node_ids=names,
        serial=certificate.serial_number,
        not_before=certificate.not_valid_before_utc,
        not_after=certificate.not_valid_after_utc,
    )

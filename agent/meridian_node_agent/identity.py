"""The node's TLS identity: its private key, the certificate the control plane issued, and the CA bundle.

Layout in the identity directory (0700)::

    node.key.pem   ECDSA P-256 private key, PKCS#8, mode 0600, created once and never overwritten
    node.pem       client certificate from enrollment (SAN = node id)
    ca.pem         the control plane's CA bundle, used to verify the server

P-256 rather than Ed25519 because the key is used in TLS, where P-256 works with every stack (see
``meridian_node_agent.devserver.ca``). Renewal before expiry comes with the agent loop; this module
reports the expiry so the loop can decide.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ansible_collections.meridian.node.plugins.module_utils.contracts import EnrollmentResponse, format_rfc3339
from ansible_collections.meridian.node.plugins.module_utils.fileutil import atomic_write, fsync_directory

__all__ = ["CertificateInfo", "IdentityError", "NodeIdentity"]


class IdentityError(ValueError):
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
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=".node.key.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                os.fchmod(handle.fileno(), 0o600)
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                # link() refuses to replace an existing name: a concurrent creator keeps its key.
                os.link(temp, self.key_path)
            except FileExistsError:
                return False
            fsync_directory(self.directory)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                Path(temp).unlink()

    def csr_pem(self, node_id: str) -> str:
        """A certificate signing request for ``node_id`` made with the node key (creating the key if needed)."""
        self.ensure_key()
        key = self._private_key()
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
            .sign(key, hashes.SHA256())
        )
        return csr.public_bytes(serialization.Encoding.PEM).decode("ascii")

    def store(self, response: EnrollmentResponse) -> CertificateInfo:
        """Keep the certificate and CA bundle from an enrollment, after checking they fit this node and key.

        A certificate for another node id, or for a public key that is not ours, is refused rather than
        stored: it could never authenticate this node and would only hide the real problem.
        """
        try:
            certificate = x509.load_pem_x509_certificate(response.certificate_pem.encode("ascii"))
            x509.load_pem_x509_certificates(response.ca_bundle_pem.encode("ascii"))
        except ValueError as exc:
            raise IdentityError(f"the enrollment response carries an unreadable certificate: {exc}") from exc
        info = _info(certificate)
        if response.node_id not in info.node_ids:
            raise IdentityError(
                f"the issued certificate names {list(info.node_ids)}, not node {response.node_id!r}; not stored"
            )
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
            return _info(x509.load_pem_x509_certificate(data))
        except ValueError as exc:
            raise IdentityError(f"{self.cert_path} is not a PEM certificate: {exc}") from exc

    def describe_expiry(self, now: datetime) -> str:
        info = self.certificate()
        left = info.remaining(now)
        when = format_rfc3339(info.not_after)
        if left <= 0:
            return f"the node certificate expired at {when}; enroll again"
        return f"the node certificate is valid until {when} ({int(left // 86400)} day(s) left)"

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


def _info(certificate: x509.Certificate) -> CertificateInfo:
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

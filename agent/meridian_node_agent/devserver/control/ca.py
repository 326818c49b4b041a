"""The devserver's certificate authority: issues node client certificates and its own TLS server certificate.

Key type: ECDSA P-256 for the CA, the server and (by default) the nodes. Ed25519 would match our signing
keys, but Ed25519 *certificates* in TLS depend on the OpenSSL build and are refused by browsers, most load
balancers and FIPS-mode stacks, while P-256 works in every TLS 1.2/1.3 implementation that Python's ``ssl``,
``requests``/urllib3 and ``cryptography`` sit on. The TLS identity and the desired-state signing key are
separate anyway: the control key (Ed25519, DSSE) never touches TLS.

A node certificate names its node id twice: as the subject CN (for people reading logs) and as a DNS
subjectAltName, which is what the server checks against the node id in the request path.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from meridian_node_agent.devserver.control.files import private_file_exclusive, public_file_exclusive, write_public_file

__all__ = [
    "CertificateAuthority",
    "CertificateExpiredError",
    "CsrError",
    "IssuedCertificate",
    "PeerCertificateError",
    "node_ids_in",
]

_CA_NAME = "meridian-node devserver CA"
_BACKDATE = dt.timedelta(minutes=5)
# Client certificates whose signature check_peer has verified, by their DER bytes. Verifying is ~80 us of ECDSA per
# request (measured here), the rest of check_peer a few; the entry is a few hundred bytes. Past the cap the oldest
# entries go first.
_VERIFIED_CAP = 100_000


class CsrError(MeridianError, ValueError):
    """A certificate signing request the CA will not sign, with the reason."""


class PeerCertificateError(MeridianError, ValueError):
    """A client certificate that does not belong to this CA or is outside its validity period."""


class CertificateExpiredError(PeerCertificateError):
    """A client certificate of this CA whose validity period has ended (a node that missed its renewal)."""


@dataclass(frozen=True)
class IssuedCertificate:
    serial: int
    pem: str
    not_after: dt.datetime


def node_ids_in(certificate: x509.Certificate) -> list[str]:
    """The DNS subjectAltNames of a certificate: the node ids it may speak for."""
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.DNSName))


class CertificateAuthority:
    """A CA whose key and certificate live in ``directory`` (key 0600), created on first use.

    Creation is race-safe: two processes starting at once (``serve`` and a CLI verb, or two replicas) both end
    up with the key, and the certificate, that were linked into place first.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.key_path = directory / "ca.key.pem"
        self.cert_path = directory / "ca.pem"
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._key = self._load_or_create_key()
        self.certificate = self._load_or_create_certificate()
        self._verified: dict[bytes, x509.Certificate] = {}

    @property
    def bundle_pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode("ascii")

    def _load_or_create_key(self) -> ec.EllipticCurvePrivateKey:
        if not self.key_path.exists():
            fresh = ec.generate_private_key(ec.SECP256R1())
            private_file_exclusive(
                self.key_path,
                fresh.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                ),
            )
        key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{self.key_path} is not an EC private key; remove the data dir's ca/ to start over")
        return key

    def _load_or_create_certificate(self) -> x509.Certificate:
        existing = self._certificate_on_disk()
        if existing is not None:
            return existing
        replacing = self.cert_path.exists()  # a certificate of another key (the key was replaced): superseded
        certificate = self._new_certificate()
        pem = certificate.public_bytes(serialization.Encoding.PEM)
        if replacing:
            write_public_file(self.cert_path, pem)
        elif not public_file_exclusive(self.cert_path, pem):
            # Another process made it first: use theirs, so that every server hands out one CA bundle.
            return self._certificate_on_disk() or certificate
        return certificate

    def _certificate_on_disk(self) -> x509.Certificate | None:
        """The certificate in ``cert_path`` if there is one and it is this CA key's."""
        if not self.cert_path.exists():
            return None
        certificate = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        return certificate if certificate.public_key() == self._key.public_key() else None

    def _new_certificate(self) -> x509.Certificate:
        now = _now()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)])
        public = self._key.public_key()
        certificate = (
            _builder(name, name, public, _serial(), ca=True)
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=3650))
            .sign(self._key, hashes.SHA256())
        )
        return certificate

    def issue_node_certificate(
        self,
        node_id: str,
        csr_pem: str,
        *,
        days: int | None = None,
        lifetime: dt.timedelta | None = None,
        renewing: x509.Certificate | None = None,
    ) -> IssuedCertificate:
        """Sign a node's CSR. Only the CSR's public key is used: subject and SANs come from ``node_id``.

        ``lifetime`` (or ``days``) is how long the certificate is valid from now. With ``renewing`` (the
        certificate the node presented), the CSR must also name exactly ``node_id`` (CN and DNS SAN) and
        carry a new key: a renewal rotates the key, so a leaked old key stops mattering at its expiry.
        """
        if (days is None) == (lifetime is None):
            raise TypeError("give exactly one of days and lifetime")
        valid_for = lifetime if lifetime is not None else dt.timedelta(days=days or 0)
        if valid_for <= dt.timedelta(0):
            raise ValueError(f"a certificate lifetime must be positive, got {valid_for}")
        # Found by schemathesis: the codec's and cryptography's own words ("'ascii' codec can't encode",
        # "see the FAQ") told a client nothing it could act on.
        try:
            csr_bytes = csr_pem.encode("ascii")
        except UnicodeEncodeError as exc:
            raise CsrError(
                f"csr_pem holds {csr_pem[exc.start]!r} at position {exc.start}: PEM is ASCII text; send the "
                "CSR file as written ('-----BEGIN CERTIFICATE REQUEST-----' ...)"
            ) from exc
        try:
            csr = x509.load_pem_x509_csr(csr_bytes)
        except ValueError as exc:
            raise CsrError(
                f"csr_pem is not a PEM certificate signing request (got {csr_pem[:40]!r}"
                f"{'...' if len(csr_pem) > 40 else ''}): send the CSR file as written, from "
                "'-----BEGIN CERTIFICATE REQUEST-----' to its END line"
            ) from exc
        if not csr.is_signature_valid:
            raise CsrError("the CSR's self-signature does not verify: it was not made with the key it carries")
        public = csr.public_key()
        if isinstance(public, ec.EllipticCurvePublicKey):
            if public.curve.name not in ("secp256r1", "secp384r1"):
                raise CsrError(f"EC key on curve {public.curve.name} is not accepted; use P-256 or P-384")
        elif not isinstance(public, ed25519.Ed25519PublicKey):
            raise CsrError(f"{type(public).__name__} keys are not accepted; use an EC P-256/P-384 or Ed25519 key")
        if renewing is not None:
            _check_renewal_csr(csr, node_id, renewing)
        now = _now()
        not_after = now + valid_for
        serial = _serial()
        certificate = (
            self._leaf_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]), public, serial)
            # Backdated for clock skew between node and server, but never by more than a tenth of the
            # lifetime: a short test certificate must not spend most of its life before it was issued.
            .not_valid_before(now - min(_BACKDATE, valid_for / 10))
            .not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        pem = certificate.public_bytes(serialization.Encoding.PEM).decode("ascii")
        return IssuedCertificate(serial=serial, pem=pem, not_after=not_after.replace(microsecond=0))

    def write_server_certificate(self, directory: Path, hosts: list[str]) -> tuple[Path, Path]:
        """A fresh TLS server key and certificate for ``hosts`` (IPs or DNS names); returns (cert, key) paths."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys(hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = _now()
        certificate = (
            self._leaf_builder(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meridian-node devserver")]),
                key.public_key(),
                _serial(),
            )
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_path = directory / "server.key.pem"
        cert_path = directory / "server.pem"
        key_path.unlink(missing_ok=True)
        private_file_exclusive(
            key_path,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )
        write_public_file(cert_path, certificate.public_bytes(serialization.Encoding.PEM))
        return cert_path, key_path

    def check_peer(self, der: bytes, now: dt.datetime) -> x509.Certificate:
        """A client certificate this CA signed and that is valid at ``now``; otherwise ``PeerCertificateError``
        (``CertificateExpiredError`` for one past its end).

        The TLS layer already verified the chain; this repeats the check so that the application never
        trusts a certificate merely because something in front of it accepted the handshake.
        """
        certificate = self._verified.get(der)
        if certificate is None:
            certificate = self._verify(der)
            if len(self._verified) >= _VERIFIED_CAP:
                del self._verified[next(iter(self._verified))]
            self._verified[der] = certificate
        if now > certificate.not_valid_after_utc:
            raise CertificateExpiredError(
                f"the client certificate expired at {certificate.not_valid_after_utc.isoformat()} (now is "
                f"{now.isoformat()}); the node missed its renewal: enroll it again with a new token"
            )
        if now < certificate.not_valid_before_utc:
            raise PeerCertificateError(
                f"the client certificate is valid from {certificate.not_valid_before_utc.isoformat()} to "
                f"{certificate.not_valid_after_utc.isoformat()}, not yet now ({now.isoformat()}); check the "
                "control plane's clock, or enroll again"
            )
        return certificate

    def _verify(self, der: bytes) -> x509.Certificate:
        """``der`` parsed, if this CA signed it."""
        try:
            certificate = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise PeerCertificateError(f"the client certificate cannot be parsed: {exc}") from exc
        try:
            certificate.verify_directly_issued_by(self.certificate)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise PeerCertificateError(
                f"the client certificate (issuer {certificate.issuer.rfc4514_string()!r}) was not issued by this "
                "control plane's CA"
            ) from exc
        return certificate

    def _leaf_builder(
        self, subject: x509.Name, public: CertificatePublicKeyTypes, serial: int
    ) -> x509.CertificateBuilder:
        return _builder(subject, self.certificate.subject, public, serial, ca=False).add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
        )


def _builder(
    subject: x509.Name, issuer: x509.Name, public: CertificatePublicKeyTypes, serial: int, *, ca: bool
) -> x509.CertificateBuilder:
    """What the CA's certificate and a node's have in common: names, key, serial, and (both critical) the basic
    constraints and key usage of a CA (signs certificates and CRLs, no CA below it) or of a leaf (signs its TLS
    handshakes only); then the subject key identifier."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(serial)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )


def _check_renewal_csr(csr: x509.CertificateSigningRequest, node_id: str, renewing: x509.Certificate) -> None:
    common_names = [str(a.value) for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns_names = list(san.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        dns_names = []
    if common_names != [node_id] or dns_names != [node_id]:
        raise CsrError(
            f"a renewal CSR must name node {node_id!r} as its only CN and DNS subjectAltName; this one names "
            f"CN {common_names} and DNS {dns_names}"
        )
    if csr.public_key() == renewing.public_key():
        raise CsrError(
            "the renewal CSR carries the key of the certificate it renews; generate a new key for every renewal"
        )


def _serial() -> int:
    # 159 random bits: positive, under the 20-octet limit, and unguessable (RFC 5280 section 4.1.2.2).
    return secrets.randbits(159) | 1


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)

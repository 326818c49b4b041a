"""DSSE envelopes (https://github.com/secure-systems-lab/dsse) signed with Ed25519: keys, PAE, signing.

Verification lives in ``trust``; this module is the format and the key handling both sides share.

Key identity: a ``keyid`` is the lowercase hex sha256 of the 32 raw Ed25519 public-key bytes, so anyone
holding the public key computes the same id and an id cannot be chosen independently of the key.
"""

from __future__ import annotations

import base64
import hashlib
import traceback
from collections.abc import Sequence
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

try:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
except ImportError:
    CRYPTOGRAPHY_IMPORT_ERROR: str | None = traceback.format_exc()
else:
    CRYPTOGRAPHY_IMPORT_ERROR = None

__all__ = [
    "CRYPTOGRAPHY_IMPORT_ERROR",
    "PAYLOAD_TYPES",
    "KeyLoadError",
    "generate_private_key_pem",
    "keyid_for",
    "load_private_key_pem",
    "load_public_key_pem",
    "pae",
    "public_key_pem",
    "require_cryptography",
    "sign",
]

PAYLOAD_TYPES: dict[str, str] = {
    kind: f"application/vnd.meridian.{kind}.v1+json" for kind in ("desired-state", "artifact-manifest", "bundle")
}


class KeyLoadError(MeridianError, ValueError):
    """A key could not be loaded: not PEM, not Ed25519, encrypted, or private where public belongs."""


def require_cryptography() -> None:
    """Raise a clear error where signing or verification is attempted on a host without ``cryptography``."""
    if CRYPTOGRAPHY_IMPORT_ERROR is not None:
        raise RuntimeError(
            "meridian.node needs the Python package 'cryptography' (>= 42) on this host to sign or verify "
            "documents; install it (pip install 'cryptography>=42') or install the meridian-node package."
        )


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE pre-authentication encoding: what is actually signed, binding the type to the body."""
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(type_bytes), type_bytes, len(body), body)


def keyid_for(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def public_key_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """SubjectPublicKeyInfo PEM of a key (of a private key's public half): what a policy file lists."""
    require_cryptography()
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate_private_key_pem() -> tuple[bytes, str]:
    """A new Ed25519 key as unencrypted PKCS8 PEM, with its keyid. Store the PEM with mode 0600."""
    require_cryptography()
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return pem, keyid_for(key.public_key())


def load_private_key_pem(data: bytes) -> Ed25519PrivateKey:
    """An unencrypted Ed25519 private key from PEM; anything else raises ``KeyLoadError`` saying why."""
    require_cryptography()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:
        # cryptography raises TypeError for an encrypted key loaded without a password.
        raise KeyLoadError(
            f"the private key is encrypted ({exc}); meridian.node reads unencrypted PKCS8 PEM only - "
            "protect the key file with file permissions or keep it in the signing service"
        ) from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyLoadError(f"not a PEM private key: {_reason(exc)}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyLoadError(f"the private key is {_describe(key)}; meridian.node signs with Ed25519 keys only")
    return key


def load_public_key_pem(data: bytes) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM.

    A *private* key PEM is refused, not quietly reduced to its public half: trust anchors are copied to
    every host, and a policy that carries a signing key hands that key to anyone who can read the host.
    """
    require_cryptography()
    if b"PRIVATE KEY-----" in data:
        raise KeyLoadError(
            "this is a PRIVATE key; a trust policy lists public keys only - export the public half "
            "(openssl pkey -in KEY -pubout) and never copy the private key to hosts"
        )
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyLoadError(f"not a PEM public key: {_reason(exc)}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyLoadError(f"the public key is {_describe(key)}; meridian.node trusts Ed25519 keys only")
    return key


def sign(payload_type: str, body: bytes, private_keys: Sequence[Ed25519PrivateKey]) -> dict[str, Any]:
    """A DSSE envelope for ``body`` signed by each key, in the given order."""
    require_cryptography()
    if not private_keys:
        raise ValueError("sign() needs at least one private key: an unsigned envelope is never valid")
    message = pae(payload_type, body)
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(body).decode("ascii"),
        "signatures": [
            {"keyid": keyid_for(key.public_key()), "sig": base64.b64encode(key.sign(message)).decode("ascii")}
            for key in private_keys
        ],
    }


def _describe(key: object) -> str:
    """'an RSA key (2048 bits)', 'an EC key (secp256r1)': enough for an operator to recognise the file."""
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        return f"an RSA key ({key.key_size} bits)"
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        return f"an EC key ({key.curve.name})"
    return f"a {type(key).__name__.lstrip('_')}"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

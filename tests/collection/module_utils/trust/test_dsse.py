"""DSSE format and key handling: the bytes that get signed, and which keys are accepted where."""

import base64
import hashlib
import json

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ansible_collections.meridian.node.plugins.module_utils.trust import dsse
from ansible_collections.meridian.node.tests.support.trust_fixtures import make_key


def test_pae_matches_the_dsse_spec_example() -> None:
    assert (
        dsse.pae("http://example.com/HelloWorld", b"hello world")
        == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


def test_pae_counts_bytes_not_characters() -> None:
    # "é" is two bytes in UTF-8; counting characters would let two different (type, body) pairs collide.
    assert dsse.pae("t/é", "ü".encode()) == "DSSEv1 4 t/é 2 ü".encode()


def test_pae_of_an_empty_body_still_binds_the_type() -> None:
    assert dsse.pae("a", b"") == b"DSSEv1 1 a 0 "


def test_payload_types_are_the_documented_media_types() -> None:
    assert dsse.PAYLOAD_TYPES == {
        "desired-state": "application/vnd.meridian.desired-state.v1+json",
        "artifact-manifest": "application/vnd.meridian.artifact-manifest.v1+json",
        "bundle": "application/vnd.meridian.bundle.v1+json",
    }


def test_keyid_is_sha256_of_the_raw_public_key() -> None:
    key = Ed25519PrivateKey.generate().public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert len(raw) == 32
    assert dsse.keyid_for(key) == hashlib.sha256(raw).hexdigest()


def test_generated_key_is_pkcs8_pem_with_its_keyid() -> None:
    pem, keyid = dsse.generate_private_key_pem()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    key = dsse.load_private_key_pem(pem)
    assert keyid == dsse.keyid_for(key.public_key())
    assert len(keyid) == 64 and keyid == keyid.lower()


def test_sign_produces_an_envelope_any_dsse_verifier_accepts() -> None:
    first, second = make_key(), make_key()
    body = b'{"hello": "world"}'
    envelope = dsse.sign("application/x-test", body, [first.private, second.private])

    assert envelope["payloadType"] == "application/x-test"
    assert base64.b64decode(envelope["payload"]) == body
    assert [s["keyid"] for s in envelope["signatures"]] == [first.keyid, second.keyid]
    # Verify independently of our verifier: Ed25519 over PAE(type, body).
    for key, signature in zip((first, second), envelope["signatures"], strict=True):
        key.private.public_key().verify(base64.b64decode(signature["sig"]), dsse.pae("application/x-test", body))
    json.dumps(envelope)  # serialisable as is


def test_signing_with_no_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one private key"):
        dsse.sign("application/x-test", b"{}", [])


def test_public_key_pem_round_trips() -> None:
    key = make_key()
    assert dsse.keyid_for(dsse.load_public_key_pem(key.public_pem)) == key.keyid


def test_private_key_offered_as_trust_anchor_is_refused() -> None:
    with pytest.raises(dsse.KeyLoadError, match="PRIVATE key"):
        dsse.load_public_key_pem(make_key().private_pem)


def test_non_ed25519_public_key_is_refused_naming_its_type() -> None:
    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(dsse.KeyLoadError, match=r"an EC key \(secp256r1\); meridian.node trusts Ed25519 keys only"):
        dsse.load_public_key_pem(pem)


def test_garbage_is_not_a_public_key() -> None:
    with pytest.raises(dsse.KeyLoadError, match="not a PEM public key"):
        dsse.load_public_key_pem(b"-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")


def test_non_ed25519_private_key_is_refused() -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(dsse.KeyLoadError, match=r"an EC key \(secp256r1\); .*Ed25519 keys only"):
        dsse.load_private_key_pem(pem)


def test_encrypted_private_key_is_refused_with_advice() -> None:
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    with pytest.raises(dsse.KeyLoadError, match="encrypted"):
        dsse.load_private_key_pem(pem)


def test_public_key_is_not_a_private_key() -> None:
    with pytest.raises(dsse.KeyLoadError, match="not a PEM private key"):
        dsse.load_private_key_pem(make_key().public_pem)

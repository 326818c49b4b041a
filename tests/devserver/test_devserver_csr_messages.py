"""What a client is told about a CSR that cannot be read: the value and the fix, not a codec's or a library's
own words (schemathesis sent such CSRs; see test_openapi_schemathesis.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from meridian_node_agent.devserver.control.ca import CertificateAuthority, CsrError

LIFETIME = timedelta(days=1)


def test_a_csr_with_a_non_ascii_character_is_refused_naming_it_and_where(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    with pytest.raises(CsrError) as refused:
        ca.issue_node_certificate("node-1", "-----BEGIN CERTIFICATE REQUEST-----\nMII\u00e9", lifetime=LIFETIME)
    message = str(refused.value)
    assert "'é' at position 39" in message
    assert "PEM is ASCII text" in message
    assert "codec" not in message


def test_a_csr_that_is_not_pem_is_refused_with_its_start_and_the_form_expected(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    with pytest.raises(CsrError) as refused:
        ca.issue_node_certificate("node-1", "not a csr at all", lifetime=LIFETIME)
    message = str(refused.value)
    assert "not a PEM certificate signing request (got 'not a csr at all')" in message
    assert "-----BEGIN CERTIFICATE REQUEST-----" in message
    assert "cryptography.io" not in message

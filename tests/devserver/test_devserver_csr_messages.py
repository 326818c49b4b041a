"""What a client is told about a CSR that cannot be read: the value and the fix, not a codec's or a library's
own words (schemathesis sent such CSRs; see test_openapi_schemathesis.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from meridian_node_agent.devserver.control.ca import CertificateAuthority, CsrError

LIFETIME = timedelta(days=1)


@pytest.mark.parametrize(
    ("csr", "says", "never"),
    [
        pytest.param(
            "-----BEGIN CERTIFICATE REQUEST-----\nMII\u00e9",
            ["'é' at position 39", "PEM is ASCII text"],
            "codec",
            id="a-non-ascii-character-named-with-where",
        ),
        pytest.param(
            "not a csr at all",
            ["not a PEM certificate signing request (got 'not a csr at all')", "-----BEGIN CERTIFICATE REQUEST-----"],
            "cryptography.io",
            id="not-pem-its-start-and-the-form-expected",
        ),
    ],
)
def test_an_unreadable_csr_is_refused_in_the_devserver_s_words(
    tmp_path: Path, csr: str, says: list[str], never: str
) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    with pytest.raises(CsrError) as refused:
        ca.issue_node_certificate("node-1", csr, lifetime=LIFETIME)
    message = str(refused.value)
    for words in says:
        assert words in message
    assert never not in message  # the library's own words

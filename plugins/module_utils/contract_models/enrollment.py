"""A node's enrollment and its lease: the CSR it sends (first with a token, later to renew its key over mutual
TLS), the certificate it gets back, and the lease that says which epoch of the node may act."""

from __future__ import annotations

from typing import Annotated

from ansible_collections.meridian.node.plugins.module_utils.contract_models.base import (
    INT64_MAX,
    Field,
    NodeId,
    StrictModel,
    UtcTimestamp,
)

__all__ = ["CertificateRenewalRequest", "EnrollmentRequest", "EnrollmentResponse", "Lease"]


class Lease(StrictModel):
    node_id: NodeId
    epoch: Annotated[int, Field(ge=0, le=INT64_MAX)]
    expires_at: UtcTimestamp
    renewed_at: UtcTimestamp


class EnrollmentRequest(StrictModel):
    node_id: NodeId
    token: Annotated[str, Field(min_length=1)]
    csr_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE REQUEST-----")]


class CertificateRenewalRequest(StrictModel):
    """A CSR for a new key, sent over mutual TLS with the node's current certificate; answered with an
    ``EnrollmentResponse`` (the new certificate, the CA bundle and the node's current lease)."""

    node_id: NodeId
    csr_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE REQUEST-----")]


class EnrollmentResponse(StrictModel):
    node_id: NodeId
    certificate_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE-----")]
    ca_bundle_pem: Annotated[str, Field(pattern=r"^-----BEGIN CERTIFICATE-----")]
    lease: Lease

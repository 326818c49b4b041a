"""Why the air-gap bundle reader refused a bundle: ``BundleRefused``, with a ``reason`` for programs (a
``BundleProblem``, or the verifier's or the image checker's own code) and a ``message`` for people."""

from __future__ import annotations

from typing import Optional, Union

from ansible_collections.meridian.node.plugins.module_utils._compat import StrEnum
from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.airgap import image_archive, runbook
from ansible_collections.meridian.node.plugins.module_utils.trust import verify as trust

__all__ = ["BundleProblem", "BundleRefused", "Reason"]


class BundleProblem(StrEnum):
    """Why the reader refused a bundle, besides the verifier's own ``trust.RejectionCode`` values."""

    NOT_A_FILE = "not-a-file"
    UNREADABLE = "unreadable"
    NOT_A_TAR = "not-a-tar"
    ENVELOPE_NOT_FIRST = "envelope-not-first"
    UNSAFE_PATH = "unsafe-path"
    NOT_REGULAR = "not-a-regular-file"
    UNLISTED = "unlisted-member"
    DUPLICATE = "duplicate-member"
    MISSING = "missing-member"
    SIZE_MISMATCH = "size-mismatch"
    DIGEST_MISMATCH = "digest-mismatch"
    TOO_LARGE = "too-large"
    TRUNCATED = "truncated"
    TRAILING_DATA = "trailing-data"
    CHANGED = "changed-while-read"
    ARTIFACT = "artifact-mismatch"
    SCRATCH = "scratch-unusable"
    SCRATCH_FULL = "scratch-full"
    CODE_REFUSED = runbook.CODE_REFUSED
    CODE_NOT_PINNED = runbook.CODE_NOT_PINNED
    CODE_MISMATCH = runbook.CODE_MISMATCH
    IMAGE_NOT_ALLOWED = "image-not-allowed"


Reason = Union[BundleProblem, trust.RejectionCode, image_archive.ImageArchiveProblem]


class BundleRefused(MeridianError):
    """A bundle was refused. ``reason`` is for programs (a ``BundleProblem`` or, for ``bundle.json`` and
    the documents it carries, the verifier's ``RejectionCode``), ``message`` for people; ``member`` names
    the tar member at fault, when one is."""

    def __init__(self, reason: Reason, message: str, member: Optional[str] = None) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.member = member

"""What both tar readers of an air-gap bundle say about a member's type: the bundle itself
(``bundle_reader``) and an engine image archive inside it (``image_archive``). Both accept regular files
only; this is the one table of the header types that announce a name or attributes for the next member,
and the one wording of any other type, so the two refusals read alike."""

from __future__ import annotations

import tarfile

from ansible_collections.meridian.node.plugins.module_utils._plain_checks import short_repr

__all__ = ["EXTENDED_TYPES", "member_kind"]

# Headers that carry the next member's long name or attributes (pax, GNU): bounded by the readers.
EXTENDED_TYPES = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)
_TYPE_WORDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.DIRTYPE: "a directory",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}


def member_kind(info: tarfile.TarInfo) -> str:
    """What a member that is not a plain file is, in words, with a link's target: "a symbolic link to '/etc'"."""
    kind = "a sparse file" if info.issparse() else _TYPE_WORDS.get(info.type, f"tar type {info.type!r}")
    target = f" to {short_repr(info.linkname)}" if info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
    return kind + target

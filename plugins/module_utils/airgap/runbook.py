"""Code a bundle ships runs only because control signed its digest: the runbook pin.

An air-gap bundle may carry ``playbooks/`` and one ``collection/<name>.tar.gz`` that root runs instead of
the collection's own ``reconcile.yml``. The bundle's listing is signed by the ``air_gap_authority`` keys,
who deliver; code must be chosen by the ``control`` keys, who decide. So the control-signed desired state
inside names the code that applies it (``DesiredState.runbook``), and a bundle runs shipped code only when
that pin matches the listing exactly (docs/AIR_GAP.md, "Shipped code").

Digests, format 1:
- ``collection_sha256``: the sha256 of the tarball's bytes (the listed ``sha256`` of its member).
- ``playbooks_sha256``: the sha256 of the tree's listing in ``sha256sum`` form, one line per file,
  ``<hex sha256><two spaces><path below playbooks/>\\n``, sorted by the path's UTF-8 bytes. An operator
  can compute it with coreutils:
  ``(cd playbooks && find . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum) | sha256sum``.
  Paths and contents both count: a renamed, added, removed or changed file changes the digest.

Both come from the signed listing, so the check is made right after ``bundle.json`` verifies, before any
member is read; the reader then holds every member to its listed digest as it reads it. Pure: no I/O
(make-bundle and ``meridian-node runbook-pin`` hash the files and call ``listed_runbook`` on their listing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ansible_collections.meridian.node.plugins.module_utils.contracts import Bundle, DesiredState

__all__ = [
    "CODE_MISMATCH",
    "CODE_NOT_PINNED",
    "CODE_REFUSED",
    "RUNBOOK_FORMAT",
    "listed_runbook",
    "playbooks_digest",
    "shipped_code_problem",
]

RUNBOOK_FORMAT = 1
# Refusal reasons (the reader's ``BundleProblem`` carries the same strings).
CODE_REFUSED = "shipped-code-refused"
CODE_NOT_PINNED = "code-not-pinned"
CODE_MISMATCH = "code-mismatch"
_PLAYBOOKS = "playbooks/"
_COLLECTION = "collection/"


def playbooks_digest(files: Iterable[tuple[str, str]]) -> str:
    """The format-1 digest of a playbook tree from ``(path below playbooks/, hex sha256)`` pairs."""
    lines = sorted((path.encode("utf-8"), digest) for path, digest in files)
    tree = hashlib.sha256()
    for path, digest in lines:
        tree.update(digest.encode("ascii") + b"  " + path + b"\n")
    return tree.hexdigest()


def listed_runbook(files: Iterable[Mapping[str, object]]) -> Optional[dict[str, object]]:
    """The runbook pin a listing of members (``{"path", "sha256", ...}``) calls for, or None when it ships
    no code. It is exactly what a desired state must carry as ``runbook`` to let that code run."""
    playbooks: list[tuple[str, str]] = []
    collections: list[str] = []
    for entry in files:
        path, digest = str(entry["path"]), str(entry["sha256"])
        if path.startswith(_PLAYBOOKS):
            playbooks.append((path[len(_PLAYBOOKS) :], digest))
        elif path.startswith(_COLLECTION):
            collections.append(digest)
    if not playbooks and not collections:
        return None
    return {
        "format": RUNBOOK_FORMAT,
        "playbooks_sha256": playbooks_digest(playbooks),
        # The contract allows one collection, always beside playbooks/; an empty digest can never match a pin.
        "collection_sha256": collections[0] if len(collections) == 1 else "",
    }


def shipped_code_problem(bundle: Bundle, state: DesiredState, shipped_code: str) -> Optional[tuple[str, str]]:
    """``(reason, message)`` when ``bundle`` may not run the code it ships (or drops the code ``state`` pins)
    under the policy's ``air_gap.shipped_code``; None when it may. Decided from the signed listing alone."""
    listed = listed_runbook(entry.model_dump() for entry in bundle.files)
    pin = None if state.runbook is None else state.runbook.model_dump()
    what = f"bundle {bundle.bundle_id!r} (generation {bundle.generation})"
    if listed is not None and shipped_code == "refuse":
        return (
            CODE_REFUSED,
            f"{what} ships playbooks/ and collection/, and this site's policy refuses shipped code "
            "(air_gap.shipped_code: refuse): ask for a bundle without --playbooks, which applies with the host's "
            "own collection, or set air_gap.shipped_code: pinned",
        )
    if listed is None and pin is None:
        return None
    if pin is None:
        return (
            CODE_NOT_PINNED,
            f"{what} ships playbooks/ and collection/ that the control-signed desired state does not pin "
            f"(it has no runbook): the air-gap authority delivers code but cannot choose it. Have control sign "
            f"the state with runbook {_show(listed)} (meridian-node runbook-pin prints it)",
        )
    if listed is None:
        return (
            CODE_MISMATCH,
            f"{what} ships no playbooks/ or collection/, but the control-signed desired state pins the code that "
            f"applies it (runbook {_show(pin)}): the code was left out of the bundle - make it again with "
            "--playbooks and --collection",
        )
    if listed != pin:
        differs = [name for name in ("format", "playbooks_sha256", "collection_sha256") if listed[name] != pin[name]]
        return (
            CODE_MISMATCH,
            f"{what} ships code whose {' and '.join(differs)} {' / '.join(str(listed[n]) for n in differs)} is not "
            f"what the control-signed state pins ({' / '.join(str(pin[n]) for n in differs)}): the playbooks or "
            "the collection differ from the ones control signed for",
        )
    return None


def _show(runbook: Optional[Mapping[str, object]]) -> str:
    if runbook is None:
        return "none"
    return "{" + ", ".join(f"{key}: {value}" for key, value in runbook.items()) + "}"

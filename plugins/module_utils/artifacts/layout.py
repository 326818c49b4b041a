"""Where the artifact store keeps things, and the one rule for an artifact's promoted version.

The store (``artifacts.store``) writes this layout; engines (``engines.converge.prepare``) mount from it. Both read
``artifacts/<name>/current`` through ``current_version`` here, so a planted link is refused the same way
whether the store lists it or an engine is about to mount it::

    <root>/artifacts/<name>/<version>/   one version's files
    <root>/artifacts/<name>/current      symlink to <version>, the promoted one

Standard library only: engines import this on hosts where the store's contracts (pydantic) may be missing.
The errors of the artifacts room live here for the same reason.
"""

from __future__ import annotations

import os
import re

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError

__all__ = [
    "CURRENT",
    "NAME",
    "SHA256",
    "VERSION",
    "ArtifactNotPromotedError",
    "ArtifactPathError",
    "ArtifactStoreError",
    "artifacts_dir",
    "current_version",
    "promoted_dir",
    "version_dir",
]

# The name of the switch; a version may not be called this.
CURRENT = "current"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")
VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")


class ArtifactStoreError(MeridianError):
    """The store cannot do what was asked; the message names the path or value and what to do."""


class ArtifactPathError(ArtifactStoreError):
    """A path would leave its version directory, collide, or go through a symlink the store did not make."""


class ArtifactNotPromotedError(ArtifactStoreError):
    """An artifact has no promoted version whose directory exists."""


def artifacts_dir(root: str) -> str:
    return os.path.join(root, "artifacts")


def version_dir(root: str, name: str, version: str) -> str:
    """``<root>/artifacts/<name>/<version>``, after checking both parts are names the store makes."""
    if not NAME.match(name) or not VERSION.match(version) or version == CURRENT:
        raise ArtifactPathError(f"{name!r}/{version!r} is not a valid artifact name and version")
    return os.path.join(artifacts_dir(root), name, version)


def current_version(root: str, name: str) -> str | None:
    """The version ``artifacts/<name>/current`` points at; None when there is no such link.

    Checked on the resolved path: a link that leads anywhere but to a version directory beside it (an
    absolute path, ``..``, a version that is itself a symlink, a temporary, a file), or that sits in an
    ``artifacts/<name>`` which is itself a symlink, is refused, naming the link and its target. A link to a
    version that is missing is returned: nothing is read through it, and the next promote replaces it.
    """
    name_dir = os.path.join(artifacts_dir(root), name)
    link = os.path.join(name_dir, CURRENT)
    if not os.path.islink(link):
        if os.path.lexists(link):
            raise ArtifactPathError(
                f"{link} is not a symlink; the store only makes 'current' as a link to a version. Remove it "
                "and make a version current again"
            )
        return None
    target = os.readlink(link)
    resolved = os.path.realpath(link)
    real_name_dir = os.path.realpath(name_dir)
    if (
        not VERSION.match(target)
        or target == CURRENT
        or resolved != os.path.join(real_name_dir, target)
        or real_name_dir != os.path.join(os.path.realpath(artifacts_dir(root)), name)
        or (os.path.lexists(resolved) and not os.path.isdir(resolved))
    ):
        raise ArtifactPathError(
            f"{link} points at {target!r}, which resolves to {resolved}: not a version directory of {name!r} "
            f"in the store {root}. Refusing to use it; remove the link (rm {link}) and make a version current "
            "again"
        )
    return target


def promoted_dir(root: str, name: str) -> str:
    """The promoted version's directory of ``name``, resolved, for an engine to mount.

    Resolved to the version directory so the container mounts one fixed version, and a newly promoted
    version changes the engine's settings (and so replaces it) instead of changing under it.
    """
    version = current_version(root, name)
    link = os.path.join(artifacts_dir(root), name, CURRENT)
    if version is None:
        raise ArtifactNotPromotedError(f"artifact {name!r} has no promoted version in the store: {link} does not exist")
    if not os.path.isdir(os.path.join(artifacts_dir(root), name, version)):
        raise ArtifactNotPromotedError(
            f"artifact {name!r} has no promoted version in the store: {link} points at {version!r}, which is missing"
        )
    return os.path.realpath(link)

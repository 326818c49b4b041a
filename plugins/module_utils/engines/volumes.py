"""An engine's extra volumes, checked on the host where they will be mounted: the host half of the rules.

The spec (``engines.spec.volume_problem``) already refused what is never safe anywhere: relative or unusual
paths, host configuration and secrets, the kernel's and the container runtimes' interfaces, meridian.node's
own directories. What only the host can decide is checked here, in this order, before anything is created:

1. the host policy allows the path: it is at or below one of ``engines.allowed_volume_sources`` (empty, the
   default, allows none: a desired state alone can never mount anything);
2. the path exists, and with every symlink resolved it still passes the spec's rules, the allow-list (an
   allowed directory that is itself a symlink allows where it leads) and this host's own directories (the
   artifact store, the apply side's state directory): a symlink planted in an allowed directory must not
   lead out of it;
3. it is a directory or a regular file: a read-only bind mount of a Unix socket still lets the engine connect
   to it, and a device node is not data.

The resolved path is what gets mounted and hashed, so a symlink that changes target changes the container's
settings (and replaces the engine) instead of changing what a running engine reads. Docker resolves the path
again when it restarts the container; the operator allows only directories no untrusted user can change.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import file_kind
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import (
    path_within,
    paths_overlap,
    volume_problem,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import ParsedVolume
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import EnginesPolicy

__all__ = ["VolumeRefusedError", "resolve_volumes"]


class VolumeRefusedError(MeridianError):
    """A volume may not be mounted here; ``check`` is ``policy-volume`` (not allowed) or ``volume`` (on disk)."""

    def __init__(self, message: str, *, check: str) -> None:
        super().__init__(message)
        self.check = check


def resolve_volumes(
    volumes: Sequence[ParsedVolume], policy: EnginesPolicy, *, host_dirs: Iterable[str] = ()
) -> tuple[ParsedVolume, ...]:
    """``volumes`` with their sources resolved, each checked as the module docstring says.

    ``host_dirs`` are this host's own directories that no engine may mount (the store, the state dir), in any
    form: they are normalised and resolved here. Reads the filesystem (``realpath``, ``stat``), changes nothing.
    """
    reserved = sorted({os.path.realpath(os.path.normpath(path)) for path in host_dirs if path})
    # An allowed directory may itself be a symlink (a mount point moved elsewhere): where it leads is allowed too.
    roots = {*policy.allowed_volume_sources, *map(os.path.realpath, policy.allowed_volume_sources)}
    resolved: list[ParsedVolume] = []
    for volume in volumes:
        problem = policy.volume_source_problem(volume.source)
        if problem is not None:
            raise VolumeRefusedError(problem, check="policy-volume")
        real = os.path.realpath(volume.source)
        try:
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise VolumeRefusedError(
                f"volume source {volume.source!r} cannot be read on this host ({exc.strerror or exc}); create it, "
                "or remove the volume from the spec",
                check="volume",
            ) from None
        through = "" if real == volume.source else f"volume source {volume.source!r} resolves to {real!r}: "
        for path in dict.fromkeys((volume.source, real)):
            found = volume_problem(path, volume.target)
            if found is None and not any(path_within(path, root) for root in roots):
                found = policy.volume_source_problem(path)
            own = next((directory for directory in reserved if paths_overlap(path, directory)), None)
            if found is None and own is not None:
                found = (
                    f"volume source {path!r} overlaps {own}, a directory of meridian.node's own on this host (the "
                    "artifact store or the apply side's state); engines get their model through model.artifact"
                )
            if found is not None:
                raise VolumeRefusedError((through if path == real else "") + found, check="volume")
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise VolumeRefusedError(
                f"{through}volume source {real!r} is a {file_kind(mode)}, not a directory or a regular file; a "
                "read-only mount of a socket still lets the engine connect to it, so only data can be mounted",
                check="volume",
            )
        resolved.append(ParsedVolume(source=real, target=volume.target))
    return tuple(resolved)

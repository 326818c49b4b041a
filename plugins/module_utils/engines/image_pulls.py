"""The images a converge will create engines from, brought onto the host before anything is drained or stopped.

``engines.converge.images`` calls these, for one engine or a set, between placement and the first action, so a
pull that fails, stalls or is refused leaves every old engine serving as it was (issue 26, "pull before drain"). Only an
image a plan creates from and the local Docker lacks is pulled; a rerun finds it present and pulls nothing.
Check mode asks the registry instead (``docker.image_pull.ImagePuller.forecast``) and pulls nothing.

Each image is pulled once however many engines use it; the per-image result (bytes and seconds, or what a real
run would pull) goes into each of those engines' results as ``image_pull``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TransferReporter
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine, ImageNotFoundError
from ansible_collections.meridian.node.plugins.module_utils.docker.image_pull import (
    ImagePuller,
    ImagePullError,
    PullLimits,
)
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = ["bring_image", "image_missing", "puller_for"]


def image_missing(engine: DockerEngine, reference: str) -> bool:
    """Whether the local Docker lacks ``reference`` (by its registry digest, or a local pin by image id)."""
    try:
        engine.resolve_image(reference)
    except ImageNotFoundError:
        return True
    return False


def puller_for(policy: Policy, engine: DockerEngine, clock: Callable[[], float] = time.monotonic) -> ImagePuller:
    """A puller under the policy's image limits, asking the policy's own image check again before each pull."""
    limits = PullLimits(
        stall_s=policy.images.pull_stall_seconds,
        min_free_bytes=policy.images.min_free_bytes,
        auth_file=policy.images.registry_auth_file,
    )
    return ImagePuller(engine.api, limits, allowed=policy.image_allowed, clock=clock)


def bring_image(
    puller: ImagePuller, reference: str, *, check_mode: bool, reporter: TransferReporter | None = None
) -> dict[str, Any]:
    """Pull ``reference`` (check mode: forecast the pull); its summary for the engines' results. ``reporter``
    is told the pull's bytes as they move, for the agent (``_transfer_progress``).

    A failure raises ``docker.image_pull.ImagePullError``: its ``check`` and ``summary`` say what and how far,
    and its ``image`` is ``reference``.
    """
    try:
        if check_mode:
            return puller.forecast(reference).as_result()
        if reporter is None:
            return puller.pull(reference).as_result()
        reporter.start("image", reference)
        try:
            return puller.pull(reference, lambda done, total: reporter.advance(reference, done, total)).as_result()
        finally:
            reporter.end(reference)
    except ImagePullError as exc:
        exc.image = exc.image or reference  # the credentials file's errors name no image of their own
        raise

"""The images a converge creates engines from, brought before anything is drained or stopped, and root's record
of those it pulled (``engines.image_pulls``, ``engines.image_record``).

A pull that fails, stalls or is refused leaves every old engine serving as it was; a pulled image is checked
as placement checks a local one (``gates.check_image``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import EngineRun
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.gates import check_image
from ansible_collections.meridian.node.plugins.module_utils.engines.image_prune import record_pulled
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError
from ansible_collections.meridian.node.plugins.module_utils.trust.policy import Policy

__all__ = ["bring_images", "record_pulls"]


def bring_images(
    runs: Sequence[EngineRun],
    policy: Policy,
    *,
    check_mode: bool,
    clock: Callable[[], float] = time.monotonic,
    progress_file: str | None = None,
    pull: str = "missing",
) -> None:
    """Pull the images ``runs`` create from and Docker lacks, each once (check mode: forecast the pulls), each
    run's ``image_pull`` set; a pulled image is then checked as placement checks a local one (``check_image``).
    ``progress_file`` is told each pull's bytes as they move (``_transfer_progress``). ``pull`` ``never`` (an
    air-gapped host, whose images come in its bundles) refuses a missing image instead (``image-missing``), in
    check mode too, before any registry is asked.

    Raises ``EngineInstanceError`` naming the check (``image-pull``, ``image-pull-stalled``, ``disk-low``,
    ``registry-auth``, ``image-digest-mismatch``, ``policy-image``...) with the result of the first run that
    needed the failed image; every run that needed it has its ``image_pull`` saying how far it got. Nothing
    of any engine has been touched yet.
    """
    wanted = [(run, run.spec) for run in runs if run.image_missing and run.spec is not None]
    if not wanted:
        return
    if pull == "never":
        run, spec = wanted[0]
        raise EngineInstanceError(
            f"engine {run.name!r}: image {spec.image!r} is not in the local Docker Engine and this run may not pull "
            f"(pull: never); bring it with the bundle (meridian-node make-bundle --image {spec.image}) or load it "
            "first; nothing was changed",
            check="image-missing",
            result=run.result(),
        )
    # Imported here, once something is to be pulled: the puller and its progress (docker.image_pull,
    # _transfer_progress) are the larger part of what a converge would import, and an engine whose image is
    # local, as nearly every run's is, never needs them.
    from ansible_collections.meridian.node.plugins.module_utils._transfer_progress import TransferReporter
    from ansible_collections.meridian.node.plugins.module_utils.docker.image_pull import ImagePullError
    from ansible_collections.meridian.node.plugins.module_utils.engines.image_pulls import bring_image, puller_for

    reporter = TransferReporter(progress_file)
    puller = puller_for(policy, wanted[0][0].engine, clock)
    for reference in dict.fromkeys(spec.image for _run, spec in wanted):
        users = [run for run, spec in wanted if spec.image == reference]
        try:
            pulled = bring_image(puller, reference, check_mode=check_mode, reporter=reporter)
        except ImagePullError as exc:
            for run in users:
                run.image_pull = exc.summary
            raise EngineInstanceError(
                f"engine {users[0].name!r}: {exc}; nothing was changed", check=exc.check, result=users[0].result()
            ) from exc
        if reporter.problem is not None:
            pulled = {**pulled, "progress_problem": reporter.problem}
        for run in users:
            run.image_pull = dict(pulled)
            if not check_mode:
                run.image_missing = False
    if not check_mode:
        for run, spec in wanted:
            check_image(run, spec)


def record_pulls(runs: Sequence[EngineRun], engine: DockerEngine, *, state_dir: str, owner: str) -> None:
    """Root's record of the images ``runs`` pulled, each once, so that ``engine_set``'s image prune for the same
    owner may remove them once nothing uses them (``engines.image_record``). Raises ``MeridianError``: the
    caller says that no engine was changed."""
    pulled = [
        run.spec.image
        for run in runs
        if run.spec is not None and run.image_pull is not None and run.image_pull.get("pulled")
    ]
    record_pulled(engine, state_dir, owner, list(dict.fromkeys(pulled)))

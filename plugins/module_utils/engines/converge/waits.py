"""What a converge waits for: an old engine's drain, a new one's readiness (and an old one's again, once rolled
back), probed at ``poll_intervals``.

The waiting part of a drain is ``engines.drain.wait_until_idle``, shared with ``meridian.node.drain``; the mark
that takes an engine out of service is ``engines.drain_marks``'. A readiness wait that times out stops the new
container, never leaving it half-running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import ContainerInfo
from ansible_collections.meridian.node.plugins.module_utils.engines.converge.engine_run import EngineRun
from ansible_collections.meridian.node.plugins.module_utils.engines.drain import (
    driver_of,
    probe_address,
    wait_until_idle,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.drain_marks import clear_draining, mark_draining
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import Driver, ProbeVerdict
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import probe_readiness
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import EngineInstanceError

__all__ = ["drain", "poll_intervals", "probe", "wait_old_ready", "wait_ready"]

_POLL_S = 0.25
# The first probes come sooner: a small or cached engine is up within a second of its start, and every poll
# interval rounds that up for whoever waits on the module (a rollout batch, the agent's record).
_FIRST_POLL_S = 0.05
_PROBE_TIMEOUT_S = 2.0
_LOG_LINES = 30


def probe(run: EngineRun, container: ContainerInfo, driver: Driver | None = None) -> ProbeVerdict:
    """One readiness probe of ``container`` on the port it publishes (an engine that took over from a replace
    beside it runs on its free port, not the spec's), the run's driver's way unless ``driver`` is given."""
    driver = driver or run.driver
    address = None if driver is None else probe_address(container, driver)
    if driver is None or address is None:
        raise RuntimeError(f"engine {run.name!r}: probing needs the driver and the published port")
    return probe_readiness(driver, run.probe_host, address[1], timeout_s=_PROBE_TIMEOUT_S)


def poll_intervals() -> Iterator[float]:
    """The pauses between readiness probes: doubling from ``_FIRST_POLL_S`` up to ``_POLL_S``, then steady."""
    interval_s = _FIRST_POLL_S
    while True:
        yield interval_s
        interval_s = min(interval_s * 2, _POLL_S)


def wait_ready(
    run: EngineRun, container: ContainerInfo, sleep: Callable[[float], None], clock: Callable[[], float]
) -> ProbeVerdict:
    """Probe the new ``container`` until ready; on timeout (or once it exited) stop it and fail with the verdict
    and logs."""
    deadline = clock() + run.options.ready_timeout_s
    intervals = poll_intervals()
    while True:
        verdict = probe(run, container)
        if verdict.ready:
            return verdict
        state = run.engine.container(container.id).state
        if state != "running" or clock() >= deadline:
            break
        sleep(next(intervals))
    if state == "running":
        why = f"did not become ready within {run.options.ready_timeout_s:g}s"
    else:
        why = f"exited ({state}) before it became ready"
    # A restart policy brings a crashed engine back ("restarting"): stopped, it stays down, as a drain's does.
    if state in ("running", "restarting", "paused"):
        run.engine.stop(container, timeout_s=driver_of(container).facts.stop_timeout_s)
    # Read after stopping: the tail then also says how the engine took the stop.
    logs = run.engine.logs_tail(container, _LOG_LINES)
    if run.spec is not None:
        # The tail goes into the failure message, so the task's output and the journal: what the engine printed
        # of a secret goes first. Ansible masks only task arguments, and a signed state's secrets are none.
        from ansible_collections.meridian.node.plugins.module_utils.docker.log_scrub import EnvScrubber

        secrets = (f"{name}={value}" for name, value in run.spec.secret_env.items())
        logs = EnvScrubber.from_env(secrets).scrub(logs)
    run.current = run.engine.container(container.id)
    raise EngineInstanceError(
        f"engine {run.name!r} {why}; last probe: {verdict.detail}. The container is left "
        f"{run.current.state}, not serving. Last {_LOG_LINES} log lines:\n{logs}",
        check="readiness",
        result=run.result(ready=False, probe=verdict.detail),
    )


def wait_old_ready(
    run: EngineRun, container: ContainerInfo, sleep: Callable[[float], None], clock: Callable[[], float]
) -> ProbeVerdict:
    """Probe the restored old container (its own driver: a replace may change it) until ready or timed out."""
    driver = driver_of(container)
    deadline = clock() + run.options.ready_timeout_s
    intervals = poll_intervals()
    while True:
        verdict = probe(run, container, driver)
        if verdict.ready or clock() >= deadline or run.engine.container(container.id).state != "running":
            return verdict
        sleep(next(intervals))


def drain(
    run: EngineRun,
    old: ContainerInfo,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    *,
    only: bool = False,
) -> None:
    """Mark the old engine draining (``only`` it, by its port, when the new one already serves beside it), let
    the mark reach those who route to it (``drain_settle_s``), then wait until nothing is in flight; on timeout
    restore and fail."""
    driver = driver_of(old)
    address = probe_address(old, driver)
    port = address[1] if only and address is not None else None
    mark_draining(run.options.state_dir, run.name, reason=f"replacing with {run.config_hash}", port=port)
    if run.options.drain_settle_s > 0:
        sleep(run.options.drain_settle_s)
    outcome = wait_until_idle(
        driver,
        address,
        timeout_s=run.options.drain_timeout_s,
        grace_s=run.options.drain_grace_s,
        sleep=sleep,
        clock=clock,
    )
    if outcome.idle:
        return
    # Nothing was stopped: the old engine keeps serving, so it must not stay out of the serving set.
    clear_draining(run.options.state_dir, run.name)
    raise EngineInstanceError(
        f"engine {run.name!r}: drain timed out after {run.options.drain_timeout_s:g}s ({outcome.describe()}); the "
        "old container is left running and serving. Raise drain_timeout, or use replace_strategy: stop-then-start",
        check="drain",
        result=run.result(),
    )

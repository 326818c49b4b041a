"""Keep what was approved running: find the engines that drifted from the applied state, and pace repairs.

Runs on: the agent side. No I/O: the engines the cycle observed and a monotonic clock in, a decision out;
the cycle does the repair (a reconcile of the same generation, through whichever applier it has).

Each engine the applied state lists as ``started`` is drifted when, for longer than its grace:

- it is **missing** from what the agent observes, or **not running** (``settle_s``: Docker's own
  restart policy gets the first go, and a replace in progress is not mistaken for a loss);
- it **lost readiness**: it was ready and its probe now fails (``settle_s``; under the privilege split
  this is how a killed engine shows before root's next look at it in ``engines.json``);
- it was **never ready** since the state was applied (``startup_grace_s``: engines load models for
  minutes, and a slow start is not a failure);
- it was **changed by hand**: its live settings differ from those it was created with (``drifted``, the
  names of the settings, from ``docker.drift`` through the cycle's inspect: ``docker update``, or a
  container recreated by hand with our labels copied) (``settle_s``). Under the privilege split the
  names come from root's ``engines.json``, which root's observe timer rewrites (``root_side.observe_unit``).

A draining engine is never drifted: a drain wins over drift until the next generation. Engines listed
``stopped`` or ``absent`` are the reconcile's business, not supervision's.

An engine whose GPU turned **unhealthy** (``engines_on_unhealthy_gpus``, from the GPU facts' verdicts) is
reported, never repaired: the signed state pins an engine to the GPUs it names, so there is nowhere this host
may move it to, and re-applying the same generation would change nothing. Its track says ``reported`` with
the GPU and the reasons, in ``status`` and the agent's log, so the control plane can place it elsewhere
(and cordon the GPU). A problem supervision can repair (it stopped) is still repaired as usual.

Crash loops back off per engine, as kubelet's CrashLoopBackOff does: after the n-th repair of an engine
that has not been healthy since, the next waits ``initial * 2^(n-1)`` seconds, at most ``maximum``;
``healthy_reset_s`` of continuous readiness forgets the count. A repair is due when at least one
drifted engine is past its grace and not backing off.

What it knows outlives the process: the cycle writes the tracks to the agent's record
(``supervision_record``) when they change and hands them back through ``resume`` when the agent starts, so
``run --once`` from cron, a restarted agent and one that crash-loops decide as one long-running process
would. The clock is injected (the agent's monotonic clock, the one the record's times are on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["Drift", "EngineTrack", "Supervisor", "engines_on_unhealthy_gpus"]


# How a problem supervision reports but never repairs begins.
GPU_TROUBLE = "on unhealthy GPU"


def engines_on_unhealthy_gpus(engines: Sequence[Mapping[str, Any]], gpu_facts: Mapping[str, Any]) -> dict[str, str]:
    """Per engine of the applied state (``contracts.EngineSpec`` dicts) placed on a GPU whose verdict is
    ``unhealthy``, why: the GPU and its reasons' codes. A MIG instance answers for its parent GPU."""
    verdicts: dict[str, tuple[str, str]] = {}
    for gpu in gpu_facts.get("gpus") or []:
        health = gpu.get("health") or {}
        if health.get("verdict") != "unhealthy":
            continue
        codes = ", ".join(sorted({str(reason.get("code")) for reason in health.get("reasons") or []})) or "no reason"
        where = str(gpu.get("uuid") or gpu.get("index"))
        for key in (gpu.get("uuid"), str(gpu.get("index")), *(m.get("uuid") for m in gpu.get("mig_instances") or [])):
            if key is not None:
                verdicts[str(key)] = (where, codes)
    trouble: dict[str, str] = {}
    for engine in engines:
        bad = [verdicts[str(gpu)] for gpu in engine.get("gpus") or [] if str(gpu) in verdicts]
        if bad:
            described = "; ".join(f"{where} ({codes})" for where, codes in bad)
            trouble[str(engine.get("name"))] = f"{GPU_TROUBLE} {described}"
    return trouble


@dataclass
class EngineTrack:
    """What supervision remembers of one engine of the applied state."""

    name: str
    expected_since: float
    seen_ready: bool = False
    ready_since: float | None = None
    problem: str | None = None
    bad_since: float | None = None
    repairs: int = 0  # repairs since it was last healthy for healthy_reset_s
    retry_at: float = 0.0


@dataclass(frozen=True)
class Drift:
    """The engines a repair is for, each with why, and the generation it re-applies. ``last_lines``: per engine
    of them whose observation carried it, the last lines of its kept log (scrubbed: docs/LOGS.md), so that the
    agent's log line for the failure says what the engine last said."""

    generation: int
    engines: tuple[tuple[str, str], ...]
    last_lines: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def describe(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.engines)

    def engine_lines(self) -> dict[str, list[str]]:
        """``last_lines`` as the log event's field: engine -> its lines."""
        return {name: list(lines) for name, lines in self.last_lines}


@dataclass
class Supervisor:
    """Graces and backoff in seconds; ``cycle.Agent`` fills them from the config's ``supervision`` section
    (``settle_seconds`` -> ``settle_s`` and so on)."""

    settle_s: float = 10.0
    startup_grace_s: float = 300.0
    backoff_initial_s: float = 10.0
    backoff_max_s: float = 300.0
    healthy_reset_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    generation: int | None = None
    tracks: dict[str, EngineTrack] = field(default_factory=dict)

    def expect(self, generation: int, engines: Iterable[str]) -> None:
        """The applied state changed (or the agent started): supervise these engines from now on.

        The same generation again (a repair) keeps what is known, backoff included; a new one starts over.
        """
        names = list(engines)
        if generation == self.generation and set(names) == set(self.tracks):
            return
        now = self.clock()
        self.generation = generation
        self.tracks = {name: EngineTrack(name=name, expected_since=now) for name in names}

    def resume(self, generation: int, remembered: Mapping[str, EngineTrack], *, same_clock: bool) -> list[str]:
        """Take over what an earlier run of the agent knew of ``generation``'s engines; the names taken over.

        Called at start-up, after ``expect``, with the tracks of the agent's record. ``same_clock``: the tracks'
        times are on this clock (the same boot). Then each track is taken as it was, so a grace that began in
        an earlier run ends when it would have, and a backoff too, cut to what the settings allow now (they
        may have been shortened since). Otherwise (after a reboot) only the repair count is kept: every grace
        starts over from now and an engine must be seen ready again, so one that loads its model after the
        reboot gets the startup grace, not the settle time; but a crash-looping engine keeps its place in the
        backoff, and a host that reboots in a loop climbs it instead of starting over at the first step. The
        next repair is not held back further: a reboot outlasts the backoff it could still ask for. Another
        generation, or an engine the state no longer lists, is not taken over.
        """
        if generation != self.generation:
            return []
        now = self.clock()
        taken = []
        for name, track in self.tracks.items():
            old = remembered.get(name)
            if old is None:
                continue
            if same_clock:
                retry_at = min(old.retry_at, now + self.backoff(old.repairs)) if old.repairs else old.retry_at
                self.tracks[name] = replace(old, name=name, retry_at=retry_at)
            else:
                self.tracks[name] = EngineTrack(name=name, expected_since=track.expected_since, repairs=old.repairs)
            taken.append(name)
        return taken

    def forget(self) -> None:
        self.generation = None
        self.tracks = {}

    def assess(
        self, observed: Sequence[Mapping[str, Any]], gpu_trouble: Mapping[str, str] | None = None
    ) -> Drift | None:
        """Update what is known from this observation; the repair due now, if any. ``gpu_trouble``: per engine
        on an unhealthy GPU, why (``engines_on_unhealthy_gpus``), reported and never repaired."""
        if self.generation is None:
            return None
        now = self.clock()
        by_name = {str(engine.get("name")): engine for engine in observed}
        due: list[tuple[str, str]] = []
        for track in self.tracks.values():
            problem = self._problem(track, by_name.get(track.name), now)
            trouble = (gpu_trouble or {}).get(track.name)
            if problem is None and trouble is not None:
                if track.problem != trouble:
                    track.bad_since = now
                track.problem = trouble
                continue
            if problem is None:
                track.problem = track.bad_since = None
                continue
            if track.bad_since is None:
                track.bad_since = now
            track.problem = problem
            if now - track.bad_since >= self._grace(track, problem) and now >= track.retry_at:
                due.append((track.name, problem))
        if not due:
            return None
        lines = tuple(
            (name, tuple(str(line) for line in by_name[name].get("last_lines") or ()))
            for name, _why in due
            if name in by_name and by_name[name].get("last_lines")
        )
        return Drift(generation=self.generation, engines=tuple(due), last_lines=lines)

    def repaired(self, drift: Drift) -> None:
        """A repair for ``drift`` was made (whatever its result): those engines back off before the next."""
        now = self.clock()
        for name, _why in drift.engines:
            track = self.tracks.get(name)
            if track is None:
                continue
            track.repairs += 1
            track.retry_at = now + self.backoff(track.repairs)

    def backoff(self, repairs: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, repairs - 1)))

    def status(self) -> dict[str, dict[str, Any]]:
        """Per engine with a problem or a backoff: for status.json, observations and metrics.

        ``state`` is ``healthy`` (no problem now; a backoff left from earlier repairs is still counted),
        ``settling`` (a problem still inside its grace), ``backing-off`` (past its grace, waiting out the
        backoff after ``repairs`` repairs), ``repair-due`` (the next cycle repairs it) or ``reported`` (running,
        but on an unhealthy GPU: never repaired here). ``backoff_seconds``
        is the wait that followed the last repair, ``next_repair_in_seconds`` what is left of it.
        """
        now = self.clock()
        report: dict[str, dict[str, Any]] = {}
        for track in self.tracks.values():
            if track.problem is None and track.repairs == 0:
                continue
            report[track.name] = {
                "state": self._state(track, now),
                "problem": track.problem,
                "for_seconds": None if track.bad_since is None else round(now - track.bad_since, 1),
                "repairs": track.repairs,
                "backoff_seconds": self.backoff(track.repairs) if track.repairs else None,
                "next_repair_in_seconds": round(max(0.0, track.retry_at - now), 1) if track.repairs else None,
            }
        return report

    def _state(self, track: EngineTrack, now: float) -> str:
        if track.problem is None or track.bad_since is None:
            return "healthy"
        if track.problem.startswith(GPU_TROUBLE):
            return "reported"
        if now - track.bad_since < self._grace(track, track.problem):
            return "settling"
        return "backing-off" if now < track.retry_at else "repair-due"

    def _problem(self, track: EngineTrack, engine: Mapping[str, Any] | None, now: float) -> str | None:
        if engine is not None and engine.get("draining"):
            return None  # drained on purpose: stays as it is until the next generation
        if engine is None:
            problem = "missing"
        elif engine.get("state") != "running":
            problem = f"not running ({engine.get('state')})"
        elif engine.get("drifted"):
            problem = "changed by hand: " + ", ".join(str(name) for name in engine["drifted"])
        elif not engine.get("ready"):
            problem = "lost readiness" if track.seen_ready else "not ready since it was applied"
        else:
            if track.ready_since is None:
                track.ready_since = now
            track.seen_ready = True
            if track.repairs and now - track.ready_since >= self.healthy_reset_s:
                track.repairs, track.retry_at = 0, 0.0
            return None
        track.ready_since = None
        return problem

    def _grace(self, track: EngineTrack, problem: str) -> float:
        if problem == "not ready since it was applied":
            return self.startup_grace_s
        return self.settle_s

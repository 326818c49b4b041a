"""The clocks a test moves by hand: a wall clock, ``clock = WallClock(start); clock.advance(minutes=11)``, and a
monotonic one, ``clock = MonotonicClock(1000.0); clock.now += 5``, which the code under test moves too when it
sleeps on it (``clock.sleep``)."""

from __future__ import annotations

from datetime import datetime, timedelta

__all__ = ["MonotonicClock", "WallClock"]


class WallClock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


class MonotonicClock:
    """Seconds that move only when the test moves ``now`` or something sleeps on it; ``sleeps`` keeps each sleep."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

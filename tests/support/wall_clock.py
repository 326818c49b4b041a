"""A wall clock a test moves by hand: ``clock = WallClock(start); clock.advance(minutes=11)``."""

from __future__ import annotations

from datetime import datetime, timedelta

__all__ = ["WallClock"]


class WallClock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)

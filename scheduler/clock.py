"""Clocks: the scheduler's time source is a ``Callable[[], float]`` (seconds, monotonic),
so every timing decision can be driven by :class:`FakeClock` in tests and by simulated
time in :mod:`scheduler.sim`."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Clock", "FakeClock", "monotonic"]

Clock = Callable[[], float]
monotonic: Clock = time.monotonic


class FakeClock:
    """A clock that moves only when told to (``advance`` or ``set``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self.now += seconds
        return self.now

    def set(self, now: float) -> None:
        if now < self.now:
            raise ValueError("a clock does not go back")
        self.now = float(now)

    def __repr__(self) -> str:
        return f"<FakeClock t={self.now:.3f}>"

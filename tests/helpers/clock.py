"""A clock for tests: time that moves only when a test sets ``now``."""

from __future__ import annotations


class FakeClock:
    """Called like ``time.monotonic`` or ``time.time``; returns :attr:`now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

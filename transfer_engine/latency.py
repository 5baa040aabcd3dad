"""Every engine's latency histogram: finished transfers by operation and transport, at
the cost of one bucket increment each (:mod:`transfer_engine.metrics` serves it)."""

from __future__ import annotations

import bisect
import threading

__all__ = ["BUCKETS", "Latencies"]

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)


class Latencies:
    """Finished transfers' latencies per (operation, transport), in :data:`BUCKETS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], list[float]] = {}  # counts..., sum

    def observe(self, op: str, transport: str, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            row = self._series.get((op, transport))
            if row is None:
                row = self._series[(op, transport)] = [0.0] * (len(BUCKETS) + 2)
            row[i] += 1
            row[-1] += seconds

    def snapshot(self) -> dict[tuple[str, str], tuple[list[int], float]]:
        """Per (operation, transport): counts per bucket (the last one past
        :data:`BUCKETS`) and the sum of the seconds."""
        with self._lock:
            return {k: ([int(c) for c in row[:-1]], row[-1]) for k, row in self._series.items()}

"""Small helpers the benchmarks share: percentiles, medians, CPU time, random fills."""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["percentile", "median", "cpu_seconds", "fill_random", "expected_bytes",
           "timed_calls", "FILL_CHUNK"]

# Random fills are generated per chunk from (seed, chunk index), so any byte range can be
# regenerated without producing everything before it (the initiator checks a READ this way).
FILL_CHUNK = 4 << 20


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); nan for no values."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads together, and of its live
    tcp serving processes (``TcpTransport(serve="process")``), whose work is its own."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime + _serving_cpu_seconds()


def _serving_cpu_seconds() -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"transport.stream.worker" not in f.read():
                        continue
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            except (OSError, IndexError, ValueError):
                continue
    return total


def _chunk(seed: int, index: int) -> np.ndarray:
    words = np.random.default_rng([seed, index]).integers(
        0, 2**64 - 1, FILL_CHUNK // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)


def fill_random(buf: np.ndarray, seed: int) -> None:
    """Fills a uint8 array with seeded random bytes, touching (pre-faulting) every page."""
    n = buf.nbytes
    for index, start in enumerate(range(0, n, FILL_CHUNK)):
        end = min(n, start + FILL_CHUNK)
        buf[start:end] = _chunk(seed, index)[:end - start]


def expected_bytes(seed: int, offset: int, length: int) -> np.ndarray:
    """The bytes ``fill_random(buf, seed)`` put at ``buf[offset:offset+length]``."""
    out = np.empty(length, dtype=np.uint8)
    pos = 0
    while pos < length:
        index, within = divmod(offset + pos, FILL_CHUNK)
        take = min(length - pos, FILL_CHUNK - within)
        out[pos:pos + take] = _chunk(seed, index)[within:within + take]
        pos += take
    return out


def timed_calls(run: Callable[[int], None], duration: float) -> tuple[int, list[float]]:
    """Calls ``run(i)`` for ``duration`` seconds; returns calls and their latencies."""
    lat: list[float] = []
    end = time.perf_counter() + duration
    i = 0
    while True:
        t0 = time.perf_counter()
        run(i)
        lat.append(time.perf_counter() - t0)
        i += 1
        if t0 + lat[-1] >= end:
            return i, lat

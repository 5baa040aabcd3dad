"""What the registry lets an outsider make it hold, and where it may listen.

:class:`RegistryLimits` bounds members, their bytes, the event log, parked watches and
the join rate per source address; :class:`SourceBuckets` is that rate limit (a token
bucket per source, the table of sources itself bounded); :func:`check_bind` refuses a
network-reachable endpoint without a control secret unless the operator opted in.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from transfer_engine.control.auth import check_exposure

__all__ = ["RegistryLimits", "SourceBuckets", "check_bind"]

MiB = 1 << 20


@dataclass(frozen=True)
class RegistryLimits:
    """Bounds of one registry; every one is refused with a precise error, never grown.

    :param max_members: members at most; beyond it new names are refused while existing
        members keep heartbeating and updating.
    :param max_member_bytes: encoded bytes of all member records at most; a join or an
        update that would pass it is refused.
    :param log_events: events kept for watchers that fall behind (older ones get a
        snapshot instead).
    :param log_bytes: encoded bytes of those events at most (a join or update event
        carries the whole record, so this is what bounds the log's memory).
    :param join_rate: registrations (joins and record updates) per second allowed from
        one source address; ``0`` disables the limit.
    :param join_burst: registrations one source may make at once before ``join_rate``
        applies.
    :param max_sources: source addresses whose buckets are remembered (least recently
        seen ones are forgotten, which refills them).
    :param page_bytes: target size of one reply page of members or events (a page holds
        at least one item; items are at most a ``Register``'s 1 MiB).
    :param max_waiters: watches parked at once; more are answered at once, empty.
    """

    max_members: int = 20_000
    max_member_bytes: int = 1024 * MiB
    log_events: int = 65_536
    log_bytes: int = 64 * MiB
    join_rate: float = 64.0
    join_burst: int = 256
    max_sources: int = 65_536
    page_bytes: int = 1 * MiB
    max_waiters: int = 65_536

    def __post_init__(self) -> None:
        for name in ("max_members", "max_member_bytes", "log_events", "log_bytes",
                     "join_burst", "max_sources", "page_bytes", "max_waiters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not 0 <= self.join_rate < float("inf"):
            raise ValueError(f"join_rate must be finite and >= 0, not {self.join_rate!r}")
        if self.page_bytes > 2 * MiB:  # a page plus one 1 MiB record stays under 4 MiB
            raise ValueError("page_bytes must be at most 2 MiB")


class SourceBuckets:
    """Token buckets keyed by source address: ``take(source)`` spends one token, False
    when none is left. ``rate`` 0 never refuses. At most ``max_sources`` buckets are
    kept (least recently used dropped)."""

    def __init__(self, rate: float, burst: int, max_sources: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self._max = max_sources
        self._clock = clock
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = (
            collections.OrderedDict())  # source -> (tokens, when)

    def take(self, source: str) -> bool:
        if self.rate <= 0:
            return True
        now = self._clock()
        tokens, then = self._buckets.pop(source, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        ok = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


def check_bind(bind: str, secret: bool, allow_insecure: bool | None = None) -> None:
    """Refuses (``ValueError``) to bind a network-reachable ``bind`` without a control
    secret unless insecure serving was allowed; logs a warning when it was. Anyone who
    reaches such a registry could register, replace or remove members."""
    check_exposure(bind, secret, allow_insecure, what="the registry")

"""Traffic policy between instances: which path, which transport, which nodes to avoid.

Three parts, all driven by an injectable clock so every decision is testable without
waiting:

- **Path preference**: same host (``shm``) > same pod > same zone over RDMA > across
  zones over TCP (:func:`path_class`, :meth:`TrafficPolicy.order`).
- **RDMA/TCP share**: where both reach a peer, new transfers are split between them in
  proportion to ``(success ** 2 / cost) ** gamma`` from EWMAs of cost (seconds, or
  seconds per byte when sizes are given) and success, kept inside ``[floor, 1 - floor]``
  so the minority transport stays measured and can win back its share. The split is a
  smooth weighted round robin, so it is deterministic.
- **Circuit breaker** per node (:class:`CircuitBreaker`): opens after consecutive
  failures, half-opens after a cooldown that doubles with each reopening, closes after a
  good probe. :class:`BreakerBoard` never ejects more than ``max_eject_fraction`` of a
  pool: a node that would pass the cap stays in, and the caller's retries cover it.

How the engine consults it (``Engine`` owns one ``TrafficPolicy``): after a peer's rails
open, ``peer.order[:] = policy.order(peer.order, own_meta, peer.meta)``; after each
transfer (success or failure), ``policy.record(peer.name, transport, latency, ok,
nbytes)``; before each transfer, ``policy.order`` again when the share should steer it.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.clock import Clock, monotonic

__all__ = ["PathClass", "path_class", "BreakerState", "CircuitBreaker", "BreakerBoard",
           "PathStats", "TrafficPolicy"]


class PathClass(enum.IntEnum):
    """Where a peer sits relative to us, best first (the value orders them)."""

    HOST = 0
    POD = 1
    ZONE = 2
    CROSS_ZONE = 3


def _host(meta: Mapping[str, Any]) -> str:
    return str(meta.get("host_id") or meta.get("host") or meta.get("hostname") or "")


def path_class(local: Mapping[str, Any], peer: Mapping[str, Any]) -> PathClass:
    """The path between two members from their metadata (``host_id``/``host``/
    ``hostname``, ``pod``, ``zone``). Missing zone labels count as one zone, so an
    unlabelled fleet is treated as a single zone."""
    host = _host(local)
    if host and host == _host(peer):
        return PathClass.HOST
    pod = str(local.get("pod") or "")
    if pod and pod == str(peer.get("pod") or ""):
        return PathClass.POD
    zone, peer_zone = str(local.get("zone") or ""), str(peer.get("zone") or "")
    if zone == peer_zone:
        return PathClass.ZONE
    return PathClass.CROSS_ZONE


class BreakerState(enum.Enum):
    CLOSED = "closed"  # serving
    OPEN = "open"  # ejected until the cooldown ends
    HALF_OPEN = "half_open"  # one probe at a time decides


class CircuitBreaker:
    """One node's breaker.

    :param threshold: consecutive failures that open it.
    :param base_cooldown: seconds the first opening lasts; each reopening doubles it.
    :param max_cooldown: cap on the cooldown (seconds); a node that stayed closed this
        long since its last opening starts again from ``base_cooldown``.
    :param clock: time source (seconds).
    """

    def __init__(self, *, threshold: int = 3, base_cooldown: float = 1.0,
                 max_cooldown: float = 60.0, clock: Clock = monotonic) -> None:
        if threshold < 1 or base_cooldown <= 0 or max_cooldown < base_cooldown:
            raise ValueError("need threshold >= 1 and 0 < base_cooldown <= max_cooldown")
        self.threshold = threshold
        self.base_cooldown = base_cooldown
        self.max_cooldown = max_cooldown
        self._clock = clock
        self._state = BreakerState.CLOSED
        self.failures = 0  # consecutive
        self.strikes = 0  # openings in a row, for the exponential cooldown
        self.open_until = 0.0
        self._closed_at = -math.inf
        self._probe_at = -math.inf

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self.open_until:
            self._state = BreakerState.HALF_OPEN
            self._probe_at = -math.inf
        return self._state

    def cooldown(self) -> float:
        """Seconds the next opening would last."""
        return min(self.max_cooldown, self.base_cooldown * 2.0 ** self._strikes_now())

    def _strikes_now(self) -> int:
        healthy = self._clock() - self._closed_at >= self.max_cooldown
        return 0 if self._state is BreakerState.CLOSED and healthy else self.strikes

    def allow(self) -> bool:
        """Whether a request may go to this node now. In ``HALF_OPEN`` one probe is let
        through per ``base_cooldown`` (a probe whose answer never comes cannot hold the
        node out for good)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        now = self._clock()
        if now - self._probe_at >= self.base_cooldown:
            self._probe_at = now
            return True
        return False

    def would_open(self, ok: bool) -> bool:
        """Whether recording ``ok`` would open the breaker (for the ejection cap)."""
        if ok:
            return False
        state = self.state
        return state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self.failures + 1 >= self.threshold)

    def record(self, ok: bool, *, may_open: bool = True) -> None:
        """A request to the node succeeded or failed. ``may_open=False`` counts the
        failure but keeps the node in (the ejection cap is reached)."""
        state = self.state
        if ok:
            self.failures = 0
            if state is not BreakerState.CLOSED:
                self._state = BreakerState.CLOSED
                self._closed_at = self._clock()
            return
        if state is BreakerState.OPEN:
            return  # late answers from before the opening
        self.failures += 1
        if may_open and (state is BreakerState.HALF_OPEN or self.failures >= self.threshold):
            self.open()

    def open(self) -> None:
        """Ejects the node for the next cooldown."""
        self.strikes = self._strikes_now()
        self.open_until = self._clock() + self.cooldown()
        self.strikes += 1
        self._state = BreakerState.OPEN

    def __repr__(self) -> str:
        return (f"<CircuitBreaker {self.state.value} failures={self.failures} "
                f"strikes={self.strikes}>")


class BreakerBoard:
    """Breakers for every node, grouped in pools (e.g. ``prefill``, ``decode``), with an
    ejection cap per pool.

    :param max_eject_fraction: at most ``floor(fraction * pool size)`` nodes of a pool
        are ejected (open or half-open) at once.
    :param on_change: called ``(node, state)`` whenever a node is ejected or returns
        (lets an array-backed view keep its mask without polling every node).
    The other parameters are :class:`CircuitBreaker`'s.
    """

    def __init__(self, *, threshold: int = 3, base_cooldown: float = 1.0,
                 max_cooldown: float = 60.0, max_eject_fraction: float = 0.5,
                 clock: Clock = monotonic,
                 on_change: Callable[[str, BreakerState], None] | None = None) -> None:
        if not 0.0 <= max_eject_fraction <= 1.0:
            raise ValueError("max_eject_fraction must be within [0, 1]")
        self.max_eject_fraction = max_eject_fraction
        self._settings = (threshold, base_cooldown, max_cooldown)
        self._clock = clock
        self.on_change = on_change
        self._breakers: dict[str, CircuitBreaker] = {}
        self._pool_of: dict[str, str] = {}
        self._pools: dict[str, set[str]] = {}
        self._ejected: dict[str, set[str]] = {}
        self._reopen: list[tuple[float, str]] = []  # (open_until, node) heap
        self.capped = 0  # failures that would have ejected a node past the cap

    def add(self, node: str, pool: str) -> None:
        """Puts ``node`` in ``pool`` (moves it if it was in another)."""
        old = self._pool_of.get(node)
        if old == pool:
            return
        if old is not None:
            self.remove(node)
        self._pool_of[node] = pool
        self._pools.setdefault(pool, set()).add(node)
        threshold, base, cap = self._settings
        self._breakers[node] = CircuitBreaker(threshold=threshold, base_cooldown=base,
                                              max_cooldown=cap, clock=self._clock)

    def remove(self, node: str) -> None:
        pool = self._pool_of.pop(node, None)
        if pool is None:
            return
        self._pools[pool].discard(node)
        if node in self._ejected.get(pool, ()):
            self._ejected[pool].discard(node)
        del self._breakers[node]

    def __contains__(self, node: object) -> bool:
        return node in self._breakers

    def breaker(self, node: str) -> CircuitBreaker:
        return self._breakers[node]

    def cap(self, pool: str) -> int:
        """How many nodes of ``pool`` may be ejected at once."""
        return math.floor(self.max_eject_fraction * len(self._pools.get(pool, ())) + 1e-9)

    def ejected(self, pool: str) -> list[str]:
        self.poll()
        return sorted(self._ejected.get(pool, ()))

    def state(self, node: str) -> BreakerState:
        self.poll()
        return self._breakers[node].state

    def allow(self, node: str) -> bool:
        """Whether a request may go to ``node`` now (unknown nodes are allowed)."""
        self.poll()
        breaker = self._breakers.get(node)
        return breaker is None or breaker.allow()

    def record(self, node: str, ok: bool) -> None:
        breaker = self._breakers.get(node)
        if breaker is None:
            return
        pool = self._pool_of[node]
        ejected = self._ejected.setdefault(pool, set())
        before = breaker.state
        may_open = True
        if breaker.would_open(ok) and node not in ejected and len(ejected) >= self.cap(pool):
            may_open = False
            self.capped += 1
        breaker.record(ok, may_open=may_open)
        after = breaker.state
        if after is before and not (after is BreakerState.HALF_OPEN and not ok):
            return
        if after is BreakerState.CLOSED:
            ejected.discard(node)
        else:
            ejected.add(node)
            if after is BreakerState.OPEN:
                heapq.heappush(self._reopen, (breaker.open_until, node))
        if self.on_change is not None:
            self.on_change(node, after)

    def poll(self) -> None:
        """Reports nodes whose cooldown ended (now half-open) through ``on_change``."""
        now = self._clock()
        while self._reopen and self._reopen[0][0] <= now:
            until, node = heapq.heappop(self._reopen)
            breaker = self._breakers.get(node)
            if breaker is None or breaker.open_until != until:
                continue
            if breaker.state is BreakerState.HALF_OPEN and self.on_change is not None:
                self.on_change(node, BreakerState.HALF_OPEN)

    def __repr__(self) -> str:
        pools = " ".join(f"{p}={len(self._ejected.get(p, ()))}/{len(n)}"
                         for p, n in sorted(self._pools.items()))
        return f"<BreakerBoard ejected {pools or 'none'}>"


@dataclass
class PathStats:
    """EWMAs for one (peer, transport): cost of a success, and the success rate."""

    cost: float | None = None  # seconds (or seconds per byte) per successful transfer
    success: float = 1.0
    samples: int = 0

    def add(self, cost: float | None, ok: bool, alpha: float) -> None:
        self.samples += 1
        self.success += alpha * ((1.0 if ok else 0.0) - self.success)
        if ok and cost is not None:
            self.cost = cost if self.cost is None else self.cost + alpha * (cost - self.cost)


class TrafficPolicy:
    """Orders transports per peer by path and measured health; owns the breakers.

    :param fast: the transport preferred inside a zone when healthy (``rdma``).
    :param slow: the fallback sharing traffic with it (``tcp``).
    :param alpha: EWMA weight of a new sample (0..1].
    :param floor: the least share either transport keeps where both reach a peer.
    :param gamma: how sharply the share follows the health ratio.
    :param breakers: the per-node breakers (a default board when ``None``).
    :param clock: time source for the breakers.
    """

    def __init__(self, *, fast: str = "rdma", slow: str = "tcp", alpha: float = 0.2,
                 floor: float = 0.02, gamma: float = 2.0,
                 breakers: BreakerBoard | None = None, clock: Clock = monotonic) -> None:
        if not 0.0 < alpha <= 1.0 or not 0.0 <= floor <= 0.5 or gamma <= 0:
            raise ValueError("need 0 < alpha <= 1, 0 <= floor <= 0.5, gamma > 0")
        self.fast, self.slow = fast, slow
        self.alpha, self.floor, self.gamma = alpha, floor, gamma
        self.breakers = breakers if breakers is not None else BreakerBoard(clock=clock)
        self._stats: dict[tuple[str, str], PathStats] = {}
        self._credit: dict[str, float] = {}  # smooth weighted round robin, per peer

    def stats(self, peer: str, transport: str) -> PathStats:
        key = (peer, transport)
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = PathStats()
        return stats

    def record(self, peer: str, transport: str, latency: float, ok: bool,
               nbytes: int = 0) -> None:
        """A transfer to ``peer`` over ``transport`` took ``latency`` seconds (``nbytes``
        long, when known) and succeeded or not. Also feeds the peer's breaker."""
        cost = latency / nbytes if nbytes > 0 else latency
        self.stats(peer, transport).add(max(cost, 1e-15), ok, self.alpha)
        self.breakers.record(peer, ok)

    def _weight(self, peer: str, transport: str) -> float | None:
        stats = self._stats.get((peer, transport))
        if stats is None or stats.cost is None:
            return None
        return float((stats.success ** 2 / stats.cost) ** self.gamma)

    def share(self, peer: str) -> float:
        """The share of new transfers to ``peer`` that go over the fast transport."""
        fast, slow = self._weight(peer, self.fast), self._weight(peer, self.slow)
        if fast is None or slow is None:
            # Not both measured yet: keep the preference unless the fast one fails more.
            ok_fast = self.stats(peer, self.fast).success
            ok_slow = max(self.stats(peer, self.slow).success, 1e-9)
            raw = float(min(1.0, ok_fast / ok_slow) ** (2 * self.gamma))
        else:
            raw = fast / (fast + slow) if fast + slow > 0 else 0.5
        return min(1.0 - self.floor, max(self.floor, raw))

    def pick(self, peer: str, candidates: Sequence[str]) -> str:
        """The transport the next transfer to ``peer`` uses among ``candidates`` (which
        are in path order): the fast/slow split where both are candidates, else the
        first."""
        if self.fast in candidates and self.slow in candidates:
            share = self.share(peer)
            credit = self._credit.get(peer, 0.0) + share
            if credit >= 0.5:
                self._credit[peer] = credit - 1.0
                return self.fast
            self._credit[peer] = credit
            return self.slow
        return candidates[0]

    def order(self, transports: Iterable[str], local_meta: Mapping[str, Any],
              peer_meta: Mapping[str, Any]) -> list[str]:
        """``transports`` (the ones both sides have) best first for the next transfer to
        the peer described by ``peer_meta``: ``shm`` on one host; inside a zone the
        fast/slow split; across zones the slow transport first (the fast one may not
        span zones). Transports this policy does not know keep their relative order,
        after the ones it ranks."""
        given = list(transports)
        cls = path_class(local_meta, peer_meta)
        peer = str(peer_meta.get("name") or _host(peer_meta))
        ranked: list[str] = []
        if cls is PathClass.HOST and "shm" in given:
            ranked.append("shm")
        net = [t for t in (self.fast, self.slow) if t in given]
        if len(net) == 2 and cls is not PathClass.CROSS_ZONE:
            first = self.pick(peer, net)
            net = [first] + [t for t in net if t != first]
        elif len(net) == 2:
            net = [self.slow, self.fast]
        ranked += net
        return ranked + [t for t in given if t not in ranked]

    def __repr__(self) -> str:
        return f"<TrafficPolicy {self.fast}/{self.slow} paths={len(self._stats)} {self.breakers!r}>"

"""Picks the prefill and decode instances of each request.

Policies (by name, :data:`POLICIES`):

- ``round_robin``: the next live instance of each role, in turn.
- ``least_loaded``: the prefill instance with the fewest outstanding requests, the
  decode instance with the least KV in use.
- ``prefix_only``: the prefill instance caching the longest prefix of the request
  (ties in turn); decode in turn.
- ``cache_aware`` (``default``): per prefill instance, an estimate in seconds of when
  the request's prefill would end there: its queued work, plus the prefill of what it
  does not cache (from its own cache, or fetched from the store when that holds more,
  or read from the deepest holder's cache over their path when that is faster than
  computing it: ``peer_fetch``, a one-sided read that takes the holder's NIC, not its
  compute), plus the compute of the cached blocks it would leave behind on a better
  holder. Where
  some instances meet the request's TTFT target with ``slo_margin`` to spare, the least
  work among them wins; else the earliest estimate among those that still meet it; else,
  the target being lost everywhere, the least work (the capacity it does not take is
  what lets later requests meet theirs). Then the decode instance nearest to it (same
  pod, then zone, then across zones) among those whose KV has room and whose step time
  after admission meets the TPOT target, the least filled first. A prompt whose
  uncached part is at most ``local_prefill_tokens`` is prefilled on the decode instance
  itself (no transfer, no prefill queue).

Hot spots: a hot prefix cannot pull every request to one instance, because its queued
work is part of the estimate; ``sample`` > 0 restricts each choice to the instances
caching the request's prefix plus ``sample`` random others (power of ``sample``
choices), which bounds the work per request for very large fleets. Ties go round robin.

The router is pure bookkeeping over a :class:`~scheduler.fleet.Fleet` (no I/O, no
clock of its own): :meth:`Router.route` takes ``now`` and records the dispatch in the
fleet; the caller reports completion with the fleet's ``*_done`` methods.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from scheduler.cost import SLO, CostModel
from scheduler.errors import NoInstanceError, UnknownPolicyError
from scheduler.fleet import Fleet, Pool
from scheduler.policy import PathClass, path_class

__all__ = ["POLICIES", "DEFAULT_POLICY", "Request", "Decision", "Router"]

POLICIES = ("round_robin", "least_loaded", "prefix_only", "cache_aware")
DEFAULT_POLICY = "cache_aware"
_ALIASES = {"default": DEFAULT_POLICY}
F64 = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]
Peer = tuple[F64, F64, F64]  # per instance: blocks read from a holder, seconds, charge


def _held(depth: dict[int, int], store: int, n: int) -> F64:
    """Per prefill instance, the leading blocks it holds or the store gives."""
    blocks = np.full(n, float(store))
    for slot, held in depth.items():
        blocks[slot] = max(held, store)
    return blocks


@dataclass(frozen=True)
class Request:
    """What the router knows of a request: its chained block keys (see
    :mod:`scheduler.prefix`), prompt length, and expected output length (tokens)."""

    keys: Sequence[Hashable]
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Decision:
    """Where a request goes and what the router expects of it.

    ``prefill`` is ``None`` when the decode instance prefills the prompt itself.
    ``cached_blocks`` are leading blocks the prefill instance holds, ``store_blocks``
    further ones it reads instead of computing (from the store, or from another prefill
    instance's cache); ``path`` and ``transport`` are the KV's way
    from prefill to decode.
    """

    prefill: int | None
    decode: int
    prefill_name: str | None
    decode_name: str
    cached_blocks: int
    store_blocks: int
    uncached_tokens: int
    kv_tokens: int
    path: PathClass
    transport: str
    prefill_s: float
    est_ttft_s: float
    est_tpot_s: float

    @property
    def local(self) -> bool:
        return self.prefill is None


class Router:
    """Routes requests over ``fleet`` with the policy called ``policy``.

    :param cost: the cost model estimates use.
    :param slo: the TTFT/TPOT targets decode choices respect.
    :param local_prefill_tokens: prompts with at most this many uncached tokens are
        prefilled on their decode instance (``cache_aware`` only; ``0`` never).
    :param sample: ``0`` scores every instance; ``k > 0`` scores the cache holders plus
        ``k`` random instances per choice.
    :param seed: seeds the sampling (decisions are otherwise deterministic).
    :param affinity: seconds charged per second of compute of cached blocks a choice
        leaves behind (``1``: they are computed again; ``0``: no charge).
    :param slo_margin: share of the TTFT target within which ``cache_aware`` takes the
        least work rather than the earliest estimate (``0``: never).
    :param peer_fetch: ``cache_aware`` may have a prefill instance read cached prefix
        blocks from the instance holding the most of them, where that beats computing.
    :param copy_charge: share of a block's compute charged for each block such a copy
        evicts from a full cache (the LRU tail it pushes out may be needed again).
    """

    def __init__(self, fleet: Fleet, policy: str = DEFAULT_POLICY, *,
                 cost: CostModel | None = None, slo: SLO | None = None,
                 local_prefill_tokens: int = 512, sample: int = 0, seed: int = 0,
                 affinity: float = 1.0, slo_margin: float = 0.5,
                 peer_fetch: bool = True, copy_charge: float = 1.0) -> None:
        name = _ALIASES.get(policy, policy)
        if name not in POLICIES:
            raise UnknownPolicyError(f"unknown policy {policy!r}; choose one of "
                                     f"{', '.join(POLICIES + tuple(_ALIASES))}")
        self.fleet = fleet
        self.policy = name
        self.cost = cost or CostModel()
        self.slo = slo or SLO()
        self.local_prefill_tokens = local_prefill_tokens
        self.sample = sample
        self.affinity = affinity
        self.slo_margin = slo_margin
        self.peer_fetch = peer_fetch
        self.copy_charge = copy_charge
        self._rng = np.random.default_rng(seed)
        self._turn = {"prefill": 0, "decode": 0}
        self.routed = 0

    # --- helpers --------------------------------------------------------------------

    def _mask(self, pool: Pool, exclude: Collection[str]) -> Mask:
        mask = pool.usable().copy()
        for name in exclude:
            slot = pool.slot.get(name)
            if slot is not None:
                mask[slot] = False
        if not mask.any():
            raise NoInstanceError("no live instance to route to", role=pool.role)
        return mask

    def _pick(self, role: str, score: F64, mask: Mask) -> int:
        """The usable slot of least score; ties go to the first at or after the turn."""
        n = len(score)
        start = self._turn[role] % n
        self._turn[role] = start + 1
        order = np.concatenate((np.arange(start, n), np.arange(0, start)))
        masked = np.where(mask[order], score[order], np.inf)
        return int(order[int(np.argmin(masked))])

    def _admit(self, pool: Pool, slot: int, mask: Mask, role: str, score: F64) -> int:
        """``slot``, unless its breaker refuses (a half-open node takes one probe at a
        time); then the next best, a bounded number of times."""
        breakers = self.fleet.traffic.breakers
        for _ in range(4):
            if breakers.allow(pool.names[slot]):
                return slot
            mask[slot] = False
            if not mask.any():
                break
            slot = self._pick(role, score, mask)
        raise NoInstanceError("every candidate is being probed after failures", role=role)

    def _sampled(self, mask: Mask, holders: Collection[int]) -> Mask:
        if self.sample <= 0:
            return mask
        live = np.flatnonzero(mask)
        keep = np.zeros_like(mask)
        keep[self._rng.choice(live, size=min(self.sample, len(live)), replace=False)] = True
        for slot in holders:
            keep[slot] = mask[slot]
        return keep

    # --- routing --------------------------------------------------------------------

    def route(self, req: Request, now: float, *, exclude: Collection[str] = (),
              local: bool = False) -> Decision:
        """Chooses instances for ``req`` at clock time ``now`` (seconds) and records the
        dispatch in the fleet. ``exclude`` names instances this request already failed
        on; ``local`` has decode prefill it (no prefill server could). Raises
        :class:`NoInstanceError` when a role has no usable instance."""
        fleet = self.fleet
        with fleet.lock:
            fleet.traffic.breakers.poll()
            pre, dec = fleet.prefill, fleet.decode
            dmask = self._mask(dec, exclude)
            n_pre = len(pre)
            pmask = self._mask(pre, exclude) if n_pre and not local else None
            depth = fleet.prefix.overlaps(req.keys) if n_pre else {}
            store = fleet.store_prefix(req.keys) if fleet.store_prefix else 0
            cost = self.cost
            local_tokens = req.input_tokens - store * cost.block_tokens
            peer: Peer | None = None  # blocks read from a holder's cache, per instance
            if (self.policy == "cache_aware" and local_tokens <= self.local_prefill_tokens) \
                    or pmask is None or local:
                return self._local(req, now, dmask, store)
            if self.policy == "round_robin":
                p = self._pick("prefill", np.zeros(n_pre), pmask)
            elif self.policy == "least_loaded":
                p = self._pick("prefill", pre.queue[:n_pre].astype(float), pmask)
            elif self.policy == "prefix_only":
                ov = np.zeros(n_pre)
                for slot, blocks in depth.items():
                    ov[slot] = blocks
                p = self._pick("prefill", -ov, pmask)
            else:
                pmask = self._sampled(pmask, depth.keys())
                limit = self.slo.ttft_limit(req.input_tokens, cost)
                est, work = self._prefill_estimates(req, now, depth, store, pre)
                if self._fetch_from_peer(depth, est, pmask, limit):
                    peer = self._peer_fetch(req, depth, _held(depth, store, n_pre), pre)
                    est, work = self._prefill_estimates(req, now, depth, store, pre, peer)
                score, pmask = self._prefill_choice(est, work, pmask, limit)
                p = self._pick("prefill", score, pmask)
                p = self._admit(pre, p, pmask, "prefill", score)
            cached = min(depth.get(p, 0), len(req.keys))
            have = max(cached, store)
            fetched = have - cached  # from the store
            move = cost.fetch_s(fetched)
            if peer is not None:
                extra = int(peer[0][p])
                fetched, have, move = fetched + extra, have + extra, move + float(peer[1][p])
            uncached = max(1, req.input_tokens - have * cost.block_tokens)
            prefill_s = cost.prefill_s(uncached, req.input_tokens - uncached) + move
            d, path, transport, tpot = self._decode_for(req, p, dmask)
            wait = max(0.0, float(pre.free_at[p]) - now)
            ttft = wait + prefill_s + cost.transfer_s(req.input_tokens, path, transport)
            fleet.dispatched(p, d, req.keys, prefill_s, req.input_tokens + req.output_tokens,
                             now)
            self.routed += 1
            return Decision(p, d, pre.names[p], dec.names[d], cached, fetched, uncached,
                            req.input_tokens + req.output_tokens, path, transport,
                            prefill_s, ttft, tpot)

    def _prefill_choice(self, est: F64, work: F64, mask: Mask, limit: float
                        ) -> tuple[F64, Mask]:
        """The scores and candidates of the prefill choice, in three tiers by the
        request's TTFT target ``limit`` (seconds):

        1. instances whose estimate is within ``slo_margin`` of the target: least work
           wins, since the target holds anyway and the compute saved is capacity for the
           requests that come next (the margin keeps queues short enough for them);
        2. else instances where the target still holds: earliest estimate;
        3. else (it misses everywhere): least work again, since this request's TTFT is
           lost wherever it goes and the compute it does not take is what decides
           whether later requests make theirs.

        Ties in work go to the earlier estimate."""
        least_work: F64 = work + 1e-3 * est
        if self.slo_margin > 0:
            within = mask & (est <= self.slo_margin * limit)
            if within.any():
                return least_work, within
        feasible = mask & (est <= limit)
        if feasible.any():
            return est, feasible
        return least_work, mask

    def _fetch_from_peer(self, depth: dict[int, int], est: F64, mask: Mask, limit: float
                         ) -> bool:
        """Whether prefill instances may read cached blocks from another's cache for
        this request: only when no holder of its prefix meets the TTFT target with the
        margin to spare (a copy costs cache space on the reader: a holder that can take
        the request keeps it)."""
        if not (self.peer_fetch and depth):
            return False
        holders = [slot for slot in depth if mask[slot]]
        margin = self.slo_margin * limit if self.slo_margin > 0 else limit
        return not any(est[slot] <= margin for slot in holders)

    def _prefill_estimates(self, req: Request, now: float, depth: dict[int, int],
                           store: int, pre: Pool, peer: Peer | None = None
                           ) -> tuple[F64, F64]:
        """Estimated seconds to the end of prefill on each instance, and the prefill's
        own part of it; with ``peer`` (:meth:`_peer_fetch`), the blocks read from a
        holder's cache count as held, at their read's time and copy charge."""
        cost = self.cost
        n = len(pre)
        blocks = _held(depth, store, n)
        fetched = blocks - _held(depth, 0, n)  # from the store
        move = np.zeros(n)
        if store:
            per_block = cost.block_tokens * cost.kv_bytes_per_token / cost.store_bytes_per_s
            move = np.where(fetched > 0, cost.transfer_latency_s + fetched * per_block, 0.0)
        charge = np.zeros(n)
        if peer is not None:
            extra, seconds, charge = peer
            blocks = blocks + extra
            move = move + seconds
        uncached = np.maximum(1.0, req.input_tokens - blocks * cost.block_tokens)
        wait = np.maximum(0.0, pre.free_at[:n] - now)
        cached = req.input_tokens - uncached
        work = cost.prefill_overhead_s + uncached * (
            1.0 + (cached + uncached / 2) / cost.attention_tokens) / cost.prefill_tokens_per_s
        work = work + move + charge
        if self.affinity and depth:
            # Cached blocks left behind cost more than this prefill: they would be
            # computed again here and then cached twice, crowding both caches.
            best = max(depth.values())
            lost = np.maximum(0.0, best - blocks)
            work = work + self.affinity * lost * cost.block_tokens / cost.prefill_tokens_per_s
        return wait + work, work

    def _peer_fetch(self, req: Request, depth: dict[int, int], blocks: F64, pre: Pool
                    ) -> Peer:
        """Per prefill instance: the blocks beyond what it holds (or the store gives)
        that it would read from the deepest holder's cache instead of computing them,
        the seconds that read takes over their path, and a charge for the copy where
        the reader's cache is full (it evicts as many of the blocks it holds, at
        ``copy_charge`` of their compute each); zeros where computing is cheaper. The
        holder's NIC serves the read (one-sided), not its compute."""
        cost = self.cost
        n = len(pre)
        holder = max(depth, key=lambda slot: (depth[slot], -slot))
        extra = np.maximum(0.0, depth[holder] - blocks)
        bandwidth = self._bandwidth(pre, n, int(pre.pod[holder]), int(pre.zone[holder]))
        seconds = cost.transfer_latency_s + (
            extra * cost.block_tokens * cost.kv_bytes_per_token / bandwidth)
        per_block = cost.block_tokens / cost.prefill_tokens_per_s
        index = self.fleet.prefix
        free = np.array([index.capacity - index.blocks(slot) for slot in range(n)], float)
        charge = self.copy_charge * per_block * np.clip(extra - free, 0.0, extra)
        worth = (extra > 0) & (seconds + charge < extra * per_block)
        return (np.where(worth, extra, 0.0), np.where(worth, seconds, 0.0),
                np.where(worth, charge, 0.0))

    def _bandwidth(self, pool: Pool, n: int, pod: int, zone: int) -> F64:
        """Bytes per second from an instance in ``pod`` and ``zone`` to each of the
        first ``n`` of ``pool``: within the pod, the zone (RDMA), or across zones (TCP)."""
        cost = self.cost
        return np.where(pool.pod[:n] == pod, cost.pod_bytes_per_s,
                        np.where(pool.zone[:n] == zone, cost.rdma_bytes_per_s,
                                 cost.tcp_bytes_per_s))

    def _decode_for(self, req: Request, p: int, dmask: Mask
                    ) -> tuple[int, PathClass, str, float]:
        """The decode instance for a request prefilled on prefill slot ``p``."""
        pre, dec = self.fleet.prefill, self.fleet.decode
        n = len(dec)
        if self.policy in ("round_robin", "prefix_only"):
            d = self._pick("decode", np.zeros(n), dmask)
        elif self.policy == "least_loaded":
            d = self._pick("decode", dec.kv_used[:n] / dec.kv_cap[:n], dmask)
        else:
            d = self._pick("decode", self._decode_scores(req, p, dmask), dmask)
            d = self._admit(dec, d, dmask, "decode", self._decode_scores(req, p, dmask))
        path = path_class(pre.meta(p), dec.meta(d))
        transport = self._transport(dec.names[d], path)
        tpot = self.cost.decode_step(float(dec.kv_used[d]) + req.input_tokens
                                     + req.output_tokens)
        return d, path, transport, tpot

    def _decode_scores(self, req: Request, p: int | None, dmask: Mask) -> F64:
        cost, dec = self.cost, self.fleet.decode
        n = len(dec)
        need = req.input_tokens + req.output_tokens
        after = dec.kv_used[:n] + need
        if p is None:
            move = np.zeros(n)
        else:
            pre = self.fleet.prefill
            bytes_ = req.input_tokens * cost.kv_bytes_per_token
            move = bytes_ / self._bandwidth(dec, n, int(pre.pod[p]), int(pre.zone[p]))
        late = cost.decode_step_s + cost.decode_step_per_kv_token_s * after > self.slo.tpot_s
        full = after > dec.kv_cap[:n]
        score: F64 = move + 100.0 * late + 1000.0 * full + 1e-3 * after / dec.kv_cap[:n]
        return score

    def _transport(self, decode_name: str, path: PathClass) -> str:
        if path is PathClass.HOST:
            return "shm"
        if path is PathClass.CROSS_ZONE:
            return "tcp"
        return self.fleet.traffic.pick(decode_name, ["rdma", "tcp"])

    def _local(self, req: Request, now: float, dmask: Mask, store: int) -> Decision:
        cost, dec = self.cost, self.fleet.decode
        n = len(dec)
        if self.policy == "cache_aware":
            score = self._decode_scores(req, None, dmask)
            score = score + np.maximum(0.0, dec.free_at[:n] - now)
            d = self._admit(dec, self._pick("decode", score, dmask), dmask, "decode", score)
        else:
            d = self._pick("decode", np.zeros(n), dmask)
        uncached = max(1, req.input_tokens - store * cost.block_tokens)
        prefill_s = cost.prefill_s(uncached, req.input_tokens - uncached) + cost.fetch_s(store)
        wait = max(0.0, float(dec.free_at[d]) - now)
        kv = req.input_tokens + req.output_tokens
        tpot = cost.decode_step(float(dec.kv_used[d]) + kv)
        self.fleet.dispatched(None, d, req.keys, prefill_s, kv, now)
        self.routed += 1
        return Decision(None, d, None, dec.names[d], 0, store, uncached, kv,
                        PathClass.HOST, "local", prefill_s, wait + prefill_s, tpot)

    def __repr__(self) -> str:
        return f"<Router {self.policy} routed={self.routed} {self.fleet!r}>"

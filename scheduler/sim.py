"""Trace-driven simulator: replays a request trace over N simulated instances, routed by
the real :class:`~scheduler.router.Router`, so policies are compared at fleet sizes no
test machine has.

The fleet: pods of ``pod_size`` instances, a ``prefill_fraction`` of each pod prefill and
the rest decode, pods spread over ``zones``. Each prefill instance caches
``cache_blocks`` blocks (LRU); an optional store holds ``store_blocks`` more for every
instance. Costs come from :class:`~scheduler.cost.CostModel`:

- a prefill instance serves its queue in order; a prefill takes the time of its
  uncached tokens (plus fetching the blocks it takes from the store);
- the KV then moves to the decode instance at the bandwidth of their path (pod, zone
  RDMA or TCP as the traffic policy picks, cross-zone TCP; links are not shared);
- a decode instance admits requests in arrival order while its KV has room; a request's
  time per output token is the step time of the batch it joins, and it holds its KV
  until its last token;
- TTFT runs from arrival to admission at decode (prefill on the decode instance itself
  when the router says so, in a queue of its own there).

Simulated time is the router's clock; nothing sleeps. Same trace, configuration and
seed give the same numbers.

    python -m scheduler.sim --trace ../shared/traces/conversation_trace.jsonl \\
        --nodes 1000 --policy default --time-scale 200 --json results/sim.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.cost import SLO, CostModel
from scheduler.fleet import Fleet
from scheduler.policy import PathClass, TrafficPolicy
from scheduler.prefix import PrefixIndex
from scheduler.router import DEFAULT_POLICY, POLICIES, Request, Router
from scheduler.trace import Trace, load_trace

__all__ = ["SimConfig", "simulate", "main"]

_PREFILL_DONE, _AT_DECODE, _DECODE_DONE = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    """The simulated fleet and load.

    :param nodes: instances in all (prefill and decode).
    :param prefill_fraction: share of each pod that prefills.
    :param pod_size: instances per pod.
    :param zones: zones the pods are spread over.
    :param cache_blocks: prefix-cache blocks per prefill instance.
    :param store_blocks: blocks the shared KV store holds (``0``: no store).
    :param time_scale: arrivals come this many times faster than in the trace.
    :param seed: seeds the router's sampling.
    :param sample: the router's ``sample`` (``0``: score every instance).
    :param local_prefill_tokens: the router's threshold for prefill on decode.
    """

    nodes: int = 100
    prefill_fraction: float = 0.75
    pod_size: int = 8
    zones: int = 4
    cache_blocks: int = 1000
    store_blocks: int = 0
    time_scale: float = 1.0
    seed: int = 0
    sample: int = 0
    local_prefill_tokens: int = 512
    cost: CostModel = field(default_factory=CostModel)
    slo: SLO = field(default_factory=SLO)

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.pod_size < 2 or self.zones < 1:
            raise ValueError("need at least 2 nodes, pods of 2 and 1 zone")
        if not 0.0 < self.prefill_fraction < 1.0 or self.time_scale <= 0:
            raise ValueError("prefill_fraction must be in (0, 1) and time_scale > 0")


def build_fleet(config: SimConfig, traffic: TrafficPolicy
                ) -> tuple[Fleet, PrefixIndex | None]:
    """The simulated fleet, every instance joined, and the store's index (if any)."""
    store: PrefixIndex | None = None
    if config.store_blocks > 0:
        store = PrefixIndex(config.store_blocks)
    fleet = Fleet(cache_blocks=config.cache_blocks, kv_tokens=config.cost.decode_kv_tokens,
                  traffic=traffic,
                  store_prefix=(lambda keys: store.longest(keys)) if store else None)
    per_pod = min(config.pod_size - 1,
                  max(1, round(config.pod_size * config.prefill_fraction)))
    roles = ["prefill" if i % config.pod_size < per_pod else "decode"
             for i in range(config.nodes)]
    if "decode" not in roles:
        roles[-1] = "decode"
    if "prefill" not in roles:
        roles[0] = "prefill"
    for i, role in enumerate(roles):
        pod = i // config.pod_size
        fleet.add(f"{role[0]}{i}", role, host=f"h{i}", pod=f"pod{pod}",
                  zone=f"zone{pod % config.zones}")
    return fleet, store


def simulate(trace: Trace, policy: str = DEFAULT_POLICY,
             config: SimConfig | None = None) -> dict[str, Any]:
    """Replays ``trace`` and returns the summary (see :func:`main` for the fields)."""
    config = config or SimConfig()
    started = time.perf_counter()
    cost, slo = config.cost, config.slo
    clock_now = [0.0]
    traffic = TrafficPolicy(clock=lambda: clock_now[0])
    fleet, store = build_fleet(config, traffic)
    router = Router(fleet, policy, cost=cost, slo=slo,
                    local_prefill_tokens=config.local_prefill_tokens,
                    sample=config.sample, seed=config.seed)
    dec = fleet.decode
    n_dec = len(dec)
    kv_in = np.zeros(n_dec)  # KV tokens admitted per decode instance
    waiting: list[deque[int]] = [deque() for _ in range(n_dec)]
    n = len(trace)
    arrival = trace.arrival_s / config.time_scale
    ttft = np.full(n, np.nan)
    tpot = np.full(n, np.nan)
    hit_blocks = np.zeros(n, np.int64)
    decode_of = np.zeros(n, np.int64)
    prefill_of = np.full(n, -1, np.int64)
    kv_of = np.zeros(n)
    paths = {p.name.lower(): 0 for p in PathClass}
    paths["local"] = 0
    transports: dict[str, int] = {}
    events: list[tuple[float, int, int, int]] = []
    seq = 0

    def admit(d: int, rid: int, now: float) -> bool:
        need = kv_of[rid]
        if kv_in[d] + need > dec.kv_cap[d] and kv_in[d] > 0:
            return False
        kv_in[d] += need
        ttft[rid] = now - arrival[rid]
        step = cost.decode_step(kv_in[d])
        tpot[rid] = step
        nonlocal seq
        seq += 1
        heapq.heappush(events, (now + max(1, trace.output_tokens[rid]) * step, seq,
                                _DECODE_DONE, rid))
        return True

    def handle(kind: int, rid: int, now: float) -> None:
        d = int(decode_of[rid])
        if kind == _PREFILL_DONE:
            p = int(prefill_of[rid])
            fleet.prefill_done(None if p < 0 else p, d, now)
        elif kind == _AT_DECODE:
            if waiting[d] or not admit(d, rid, now):
                waiting[d].append(rid)
        else:
            kv_in[d] -= kv_of[rid]
            fleet.decode_done(d, kv_of[rid], now, local_prefill=prefill_of[rid] < 0)
            queue = waiting[d]
            while queue and admit(d, queue[0], now):
                queue.popleft()

    for rid in range(n):
        now = float(arrival[rid])
        while events and events[0][0] <= now:
            t, _, kind, ev = heapq.heappop(events)
            clock_now[0] = t
            handle(kind, ev, t)
        clock_now[0] = now
        keys = trace.keys[rid]
        inp, out = int(trace.input_tokens[rid]), int(trace.output_tokens[rid])
        decision = router.route(Request(keys, inp, out), now)
        decode_of[rid] = decision.decode
        kv_of[rid] = decision.kv_tokens
        hit_blocks[rid] = min(len(keys), decision.cached_blocks + decision.store_blocks)
        if decision.prefill is None:
            done = float(dec.free_at[decision.decode])
            at_decode = done
            paths["local"] += 1
        else:
            prefill_of[rid] = decision.prefill
            done = float(fleet.prefill.free_at[decision.prefill])
            move = cost.transfer_s(inp, decision.path, decision.transport)
            at_decode = done + move
            paths[decision.path.name.lower()] += 1
            transports[decision.transport] = transports.get(decision.transport, 0) + 1
            traffic.record(decision.decode_name, decision.transport, move, True,
                           inp * cost.kv_bytes_per_token)
        if store is not None:
            store.insert(0, keys)
        seq += 2
        heapq.heappush(events, (done, seq - 1, _PREFILL_DONE, rid))
        heapq.heappush(events, (at_decode, seq, _AT_DECODE, rid))
    while events:
        t, _, kind, ev = heapq.heappop(events)
        clock_now[0] = t
        handle(kind, ev, t)

    limits = np.array([slo.ttft_limit(int(t), cost) for t in trace.input_tokens])
    ttft_ok = ttft <= limits
    tpot_ok = tpot <= slo.tpot_s
    blocks = sum(len(k) for k in trace.keys)
    return {
        "policy": router.policy,
        "nodes": config.nodes,
        "requests": n,
        "prefix_hit_rate": round(float(hit_blocks.sum()) / blocks, 4) if blocks else 0.0,
        "hit_bound": round(trace.hit_bound, 4),
        "goodput": round(float(np.mean(ttft_ok & tpot_ok)), 4),
        "p50_ttft_s": round(float(np.nanpercentile(ttft, 50)), 4),
        "p90_ttft_s": round(float(np.nanpercentile(ttft, 90)), 4),
        "p99_ttft_s": round(float(np.nanpercentile(ttft, 99)), 4),
        "sim_seconds": round(time.perf_counter() - started, 3),
        "ttft_slo_met": round(float(np.mean(ttft_ok)), 4),
        "tpot_slo_met": round(float(np.mean(tpot_ok)), 4),
        "p50_tpot_s": round(float(np.nanpercentile(tpot, 50)), 4),
        "p99_tpot_s": round(float(np.nanpercentile(tpot, 99)), 4),
        "paths": paths,
        "transports": transports,
        "time_scale": config.time_scale,
        "trace": trace.name,
        "simulated_s": round(float(np.nanmax(arrival + ttft)) if n else 0.0, 3),
        "config": _config_json(config),
    }


def _config_json(config: SimConfig) -> dict[str, Any]:
    out = asdict(config)
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m scheduler.sim``: prints one summary and writes it as JSON with the
    fields ``policy``, ``nodes``, ``requests``, ``prefix_hit_rate``, ``hit_bound``,
    ``goodput`` (share of requests meeting both SLOs), ``p50_ttft_s``, ``p99_ttft_s``,
    ``sim_seconds`` (wall time of the run) and more detail."""
    ap = argparse.ArgumentParser(prog="python -m scheduler.sim",
                                 description="Replay a request trace over simulated nodes.")
    ap.add_argument("--trace", required=True, help="JSONL trace (shared/traces format)")
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help=f"one of {', '.join(POLICIES)} or default")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="replay arrivals this many times faster")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--limit", type=int, help="replay only the first LIMIT requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-fraction", type=float, default=0.75)
    ap.add_argument("--pod-size", type=int, default=8)
    ap.add_argument("--zones", type=int, default=4)
    ap.add_argument("--cache-blocks", type=int, default=1000,
                    help="prefix-cache blocks per prefill instance")
    ap.add_argument("--store-blocks", type=int, default=0,
                    help="blocks in the shared KV store (0: none)")
    ap.add_argument("--sample", type=int, default=0,
                    help="score cache holders plus this many random instances (0: all)")
    ap.add_argument("--ttft-slo", type=float, default=SLO.ttft_s,
                    help="fixed TTFT allowance, seconds")
    ap.add_argument("--ttft-slo-x", type=float, default=SLO.ttft_x,
                    help="TTFT allowance per second of full prefill")
    ap.add_argument("--tpot-slo", type=float, default=SLO.tpot_s, help="seconds per token")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, args.limit)
    config = SimConfig(nodes=args.nodes, prefill_fraction=args.prefill_fraction,
                       pod_size=args.pod_size, zones=args.zones,
                       cache_blocks=args.cache_blocks, store_blocks=args.store_blocks,
                       time_scale=args.time_scale, seed=args.seed, sample=args.sample,
                       slo=SLO(args.ttft_slo, args.ttft_slo_x, args.tpot_slo))
    result = simulate(trace, args.policy, config)
    keys = ("policy", "nodes", "requests", "prefix_hit_rate", "hit_bound", "goodput",
            "p50_ttft_s", "p99_ttft_s", "sim_seconds")
    print(" ".join(f"{k}={result[k]}" for k in keys))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

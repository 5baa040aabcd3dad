"""What the planner tests share: random transfers and the checks every plan must pass."""

from __future__ import annotations

import random
from collections.abc import Sequence

from transfer_engine.planner import (
    Pair,
    Plan,
    WorkRequest,
)

Run = tuple[int, int, int, int, int]  # remote seg, remote off, local seg, local off, n


def canonical(runs: list[Run]) -> list[Run]:
    """Runs sorted by remote address and merged where contiguous on both sides; fails
    if two runs write the same remote byte."""
    out: list[Run] = []
    for rs, ro, ls, lo, n in sorted(runs):
        assert n > 0
        if out:
            prs, pro, pls, plo, pn = out[-1]
            if prs == rs:
                assert ro >= pro + pn, f"remote byte written twice at {rs}:{ro}"
                if ro == pro + pn and pls == ls and lo == plo + pn:
                    out[-1] = (prs, pro, pls, plo, pn + n)
                    continue
        out.append((rs, ro, ls, lo, n))
    return out


def pairs_map(pairs: Sequence[Pair]) -> list[Run]:
    return canonical([(r[0], r[1], loc[0], loc[1], loc[2]) for loc, r in pairs])


def request_runs(wr: WorkRequest) -> list[Run]:
    """Walks a request's gather and scatter lists side by side: byte k of the gathered
    local pieces lands at byte k of the remote ranges."""
    assert sum(p[2] for p in wr.local) == wr.nbytes == sum(p[2] for p in wr.remote)
    runs: list[Run] = []
    li = ri = lpos = rpos = 0
    while li < len(wr.local):
        (ls, lo, ln), (rs, ro, rn) = wr.local[li], wr.remote[ri]
        n = min(ln - lpos, rn - rpos)
        runs.append((rs, ro + rpos, ls, lo + lpos, n))
        lpos += n
        rpos += n
        if lpos == ln:
            li, lpos = li + 1, 0
        if rpos == rn:
            ri, rpos = ri + 1, 0
    assert ri == len(wr.remote)
    return runs


def plan_map(requests: Sequence[WorkRequest]) -> list[Run]:
    return canonical([run for wr in requests for run in request_runs(wr)])


def random_pairs(rng: random.Random, count: int, max_len: int = 300) -> list[Pair]:
    """Pairs with disjoint remote ranges over a few segments; some runs of pairs are
    contiguous on both sides, some only on one."""
    pairs: list[Pair] = []
    rcursor = {s: rng.randrange(64) for s in (10, 11, 12)}
    while len(pairs) < count:
        rs = rng.choice(list(rcursor))
        ls, lo = rng.choice((1, 2)), rng.randrange(10_000)
        ro = rcursor[rs] + rng.choice((0, 0, rng.randrange(1, 50)))
        for _ in range(rng.randint(1, 4)):  # a run, contiguous on the remote side
            n = rng.randint(1, max_len)
            pairs.append(((ls, lo, n), (rs, ro, n)))
            ro += n
            lo += n if rng.random() < 0.7 else rng.randint(1, 30)
        rcursor[rs] = ro
    rng.shuffle(pairs)
    return pairs[:count]


def pieces_of(sizes: Sequence[int], *, remote_gap: int = 0) -> list[Pair]:
    out: list[Pair] = []
    lo = ro = 0
    for n in sizes:
        out.append(((1, lo, n), (2, ro, n)))
        lo += n + 3  # local pieces scattered
        ro += n + remote_gap
    return out


def requests(sizes: Sequence[int]) -> list[WorkRequest]:
    return [WorkRequest([(1, i, n)], [(2, i, n)], n, rail=7, imm=True)
            for i, n in enumerate(sizes)]


def check_rails(wrs: list[WorkRequest], used: int, num_rails: int,
                weights: Sequence[float] | None = None) -> None:
    weights = weights or [1.0] * num_rails
    rails = {w.rail for w in wrs}
    assert used == len(rails) and rails <= set(range(num_rails))
    for rail in rails:
        mine = [w for w in wrs if w.rail == rail]
        assert [w.imm for w in mine] == [False] * (len(mine) - 1) + [True]
    if wrs:
        biggest = max(w.nbytes for w in wrs)
        load = [sum(w.nbytes for w in wrs if w.rail == r) for r in range(num_rails)]
        finish = max(load[r] / weights[r] for r in range(num_rails))
        # greedy: no rail could have taken the last request of the busiest one and
        # finished earlier
        assert all(finish <= (load[r] + biggest) / weights[r] + 1e-9
                   for r in range(num_rails))


def check_plan(plan: Plan, pairs: Sequence[Pair], *, num_rails: int, slice_size: int,
               max_sge: int, max_wr_bytes: int, remote_scatter: bool,
               weights: Sequence[float] | None = None) -> None:
    assert plan.nbytes == sum(loc[2] for loc, _ in pairs)
    assert sum(w.nbytes for w in plan.requests) == plan.nbytes
    assert plan_map(plan.requests) == pairs_map(pairs)
    for w in plan.requests:
        assert 1 <= len(w.local) <= max_sge
        assert 0 < w.nbytes <= min(slice_size, max_wr_bytes)
        if not remote_scatter:
            assert len(w.remote) == 1
    assert plan.rails_used == sum(w.imm for w in plan.requests)
    check_rails(plan.requests, plan.rails_used, num_rails, weights)
    assert sorted(plan.by_rail()) == sorted({w.rail for w in plan.requests})

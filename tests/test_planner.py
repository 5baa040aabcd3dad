"""Planner: coalesce, slice, pack, assign; every plan covers every byte exactly once."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from transfer_engine.descriptor import Extent
from transfer_engine.planner import (
    Pair,
    Plan,
    WorkRequest,
    assign_rails,
    coalesce,
    pack,
    plan_transfer,
    slice_pairs,
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


# --- coalesce ------------------------------------------------------------------------


def test_coalesce_merges_only_pairs_contiguous_on_both_sides() -> None:
    assert coalesce([]) == []
    pairs: list[Pair] = [
        ((1, 100, 10), (9, 0, 10)),
        ((1, 110, 10), (9, 10, 10)),  # contiguous on both: merges
        ((1, 500, 10), (9, 20, 10)),  # remote contiguous only
        ((1, 510, 5), (9, 40, 5)),  # local contiguous only
        ((2, 515, 5), (9, 45, 5)),  # other local segment
        ((2, 520, 5), (8, 50, 5)),  # other remote segment
    ]
    assert coalesce(pairs) == [
        ((2, 520, 5), (8, 50, 5)),
        ((1, 100, 20), (9, 0, 20)),
        ((1, 500, 10), (9, 20, 10)),
        ((1, 510, 5), (9, 40, 5)),
        ((2, 515, 5), (9, 45, 5)),
    ]


def test_coalesce_is_order_independent_and_accepts_extents() -> None:
    pairs = [(Extent(1, i * 8, 8), Extent(2, 64 + i * 8, 8)) for i in range(6)]
    for order in (pairs, pairs[::-1], pairs[3:] + pairs[:3]):
        assert coalesce(order) == [((1, 0, 48), (2, 64, 48))]


def test_coalesce_keeps_every_byte_and_leaves_nothing_mergeable() -> None:
    rng = random.Random(1)
    for _ in range(300):
        pairs = random_pairs(rng, rng.randint(1, 30))
        merged = coalesce(pairs)
        assert pairs_map(merged) == pairs_map(pairs)
        assert len(merged) <= len(pairs)
        for (l1, r1), (l2, r2) in zip(merged, merged[1:], strict=False):
            assert not (l1[0] == l2[0] and r1[0] == r2[0] and l2[1] == l1[1] + l1[2]
                        and r2[1] == r1[1] + r1[2])


# --- slice ---------------------------------------------------------------------------


def test_slice_bounds_and_even_cuts() -> None:
    pair: Pair = ((1, 1000, 1_000_001), (2, 7, 1_000_001))
    pieces = slice_pairs([pair], 500_000)
    assert [p[0][2] for p in pieces] == [333_334, 333_334, 333_333]
    assert pieces[0] == ((1, 1000, 333_334), (2, 7, 333_334))
    assert pieces[2] == ((1, 1000 + 666_668, 333_333), (2, 7 + 666_668, 333_333))
    assert slice_pairs([pair], 1_000_001) == [pair]
    assert slice_pairs([], 10) == []
    for bad in (0, -1):
        with pytest.raises(ValueError, match="slice_size"):
            slice_pairs([pair], bad)


def test_slice_random_pairs() -> None:
    rng = random.Random(2)
    for _ in range(500):
        pairs = random_pairs(rng, rng.randint(1, 8), max_len=5000)
        size = rng.randint(1, 2000)
        pieces = slice_pairs(pairs, size)
        assert pairs_map(pieces) == pairs_map(pairs)
        assert all(loc[2] == rem[2] and 0 < loc[2] <= size for loc, rem in pieces)
        for loc, _ in pairs:  # each pair: the fewest pieces, all about the same size
            mine = [p[0][2] for p in pieces if p[0][0] == loc[0]
                    and loc[1] <= p[0][1] < loc[1] + loc[2]]
            if loc[2] <= size or len(mine) != -(-loc[2] // size):
                continue  # overlapping local ranges of another pair: not attributable
            assert max(mine) - min(mine) < len(mine)


# --- pack ----------------------------------------------------------------------------


def pieces_of(sizes: Sequence[int], *, remote_gap: int = 0) -> list[Pair]:
    out: list[Pair] = []
    lo = ro = 0
    for n in sizes:
        out.append(((1, lo, n), (2, ro, n)))
        lo += n + 3  # local pieces scattered
        ro += n + remote_gap
    return out


def test_pack_respects_max_sge_and_bytes() -> None:
    pieces = pieces_of([10] * 7)
    wrs = pack(pieces, max_sge=3, max_wr_bytes=1000, remote_scatter=False)
    assert [len(w.local) for w in wrs] == [3, 3, 1]
    assert [w.remote for w in wrs] == [[(2, 0, 30)], [(2, 30, 30)], [(2, 60, 10)]]
    wrs = pack(pieces, max_sge=16, max_wr_bytes=25, remote_scatter=False)
    assert [w.nbytes for w in wrs] == [20, 20, 20, 10]
    wrs = pack(pieces, max_sge=2, max_wr_bytes=1000, remote_scatter=True)
    assert [w.remote for w in wrs][0] == [(2, 0, 10), (2, 10, 10)]
    for bad in ((0, 10), (1, 0)):
        with pytest.raises(ValueError, match="positive"):
            pack(pieces, max_sge=bad[0], max_wr_bytes=bad[1], remote_scatter=True)
    assert pack([], max_sge=4, max_wr_bytes=10, remote_scatter=False) == []


def test_pack_without_remote_scatter_splits_where_the_remote_jumps() -> None:
    pieces = pieces_of([10] * 4, remote_gap=1)
    wrs = pack(pieces, max_sge=8, max_wr_bytes=1000, remote_scatter=False)
    assert [w.remote for w in wrs] == [[(2, i * 11, 10)] for i in range(4)]
    wrs = pack(pieces, max_sge=8, max_wr_bytes=1000, remote_scatter=True)
    assert len(wrs) == 1 and len(wrs[0].remote) == 4
    other_seg = [((1, 0, 8), (2, 0, 8)), ((1, 8, 8), (3, 8, 8))]
    wrs = pack(other_seg, max_sge=8, max_wr_bytes=1000, remote_scatter=False)
    assert [w.remote for w in wrs] == [[(2, 0, 8)], [(3, 8, 8)]]


def test_pack_random_within_bounds() -> None:
    rng = random.Random(3)
    for _ in range(500):
        max_wr = rng.randint(1, 3000)
        pieces = slice_pairs(random_pairs(rng, rng.randint(1, 20)), max_wr)
        max_sge, scatter = rng.randint(1, 6), rng.random() < 0.5
        wrs = pack(pieces, max_sge=max_sge, max_wr_bytes=max_wr, remote_scatter=scatter)
        assert plan_map(wrs) == pairs_map(pieces)
        assert [p for w in wrs for p in w.local] == [p[0] for p in pieces]  # in order
        for w in wrs:
            assert 1 <= len(w.local) <= max_sge and 0 < w.nbytes <= max_wr
            if not scatter:
                assert len(w.remote) == 1


# --- assign rails --------------------------------------------------------------------


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


def test_assign_rails_balances_bytes_and_marks_the_last_request_of_each_rail() -> None:
    wrs = requests([100] * 8)
    assert assign_rails(wrs, 4) == 4
    assert [w.rail for w in wrs] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [w.imm for w in wrs] == [False] * 4 + [True] * 4
    wrs = requests([400, 100, 100, 100, 100])
    assert assign_rails(wrs, 2) == 2
    assert [w.rail for w in wrs] == [0, 1, 1, 1, 1]
    assert [w.imm for w in wrs] == [True, False, False, False, True]
    wrs = requests([10, 10])
    assert assign_rails(wrs, 8) == 2
    assert assign_rails([], 3) == 0


def test_assign_rails_weights() -> None:
    wrs = requests([100] * 9)
    assert assign_rails(wrs, 2, weights=[2.0, 1.0]) == 2
    assert sum(w.nbytes for w in wrs if w.rail == 0) == 600
    for bad in ([1.0], [1.0, 0.0], [1.0, -2.0]):
        with pytest.raises(ValueError, match="weight"):
            assign_rails(wrs, 2, weights=bad)
    with pytest.raises(ValueError, match="num_rails"):
        assign_rails(wrs, 0)


def test_assign_rails_random() -> None:
    rng = random.Random(4)
    for _ in range(500):
        wrs = requests([rng.randint(1, 10_000) for _ in range(rng.randint(0, 40))])
        num_rails = rng.randint(1, 6)
        weights = ([rng.uniform(0.5, 4) for _ in range(num_rails)]
                   if rng.random() < 0.5 else None)
        order = [id(w) for w in wrs]
        used = assign_rails(wrs, num_rails, weights)
        assert [id(w) for w in wrs] == order
        check_rails(wrs, used, num_rails, weights)
        if not weights:
            assert used == min(num_rails, len(wrs))


# --- the whole plan ------------------------------------------------------------------


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


def test_plan_transfer_stripes_a_large_block_over_every_rail() -> None:
    pairs: list[Pair] = [((1, 0, 4 << 20), (2, 0, 4 << 20))]
    plan = plan_transfer(pairs, num_rails=4, slice_size=1 << 20, max_sge=4,
                         max_wr_bytes=1 << 30, remote_scatter=False)
    assert plan.nbytes == 4 << 20 and plan.rails_used == 4
    assert [w.nbytes for w in plan.requests] == [1 << 20] * 4
    small = plan_transfer([((1, 0, 256 << 10), (2, 0, 256 << 10))], num_rails=4,
                          slice_size=1 << 20, max_sge=4, max_wr_bytes=1 << 30,
                          remote_scatter=False)
    assert small.rails_used == 4  # cut finer so every rail gets a share
    assert plan_transfer([], num_rails=2, slice_size=64, max_sge=2, max_wr_bytes=64,
                         remote_scatter=True) == Plan([], 0, 0)


def test_plan_transfer_merges_adjacent_blocks_unless_told_not_to() -> None:
    pairs: list[Pair] = [((1, i * 64, 64), (2, i * 64, 64)) for i in range(16)]
    kwargs = dict(num_rails=1, slice_size=1 << 20, max_sge=1, max_wr_bytes=1 << 20,
                  remote_scatter=False)
    assert len(plan_transfer(pairs, **kwargs).requests) == 1  # type: ignore[arg-type]
    plan = plan_transfer(pairs, merge=False, **kwargs)  # type: ignore[arg-type]
    assert len(plan.requests) == 16


def test_plan_transfer_random_covers_every_byte_once_within_bounds() -> None:
    rng = random.Random(5)
    for _ in range(400):
        pairs = random_pairs(rng, rng.randint(1, 25))
        kwargs = dict(num_rails=rng.randint(1, 5), slice_size=rng.randint(1, 2000),
                      max_sge=rng.randint(1, 5), max_wr_bytes=rng.randint(1, 2000),
                      remote_scatter=rng.random() < 0.5)
        if rng.random() < 0.3:
            kwargs["weights"] = [rng.uniform(0.5, 4) for _ in range(kwargs["num_rails"])]
        plan = plan_transfer(pairs, min_split=rng.randint(1, 600),
                             merge=rng.random() < 0.8, **kwargs)  # type: ignore[arg-type]
        check_plan(plan, pairs, **kwargs)  # type: ignore[arg-type]

"""Planner: coalesce, slice, pack, assign; every plan covers every byte exactly once."""

from __future__ import annotations

import random

import pytest

from tests.helpers.planning import (
    check_plan,
    check_rails,
    pairs_map,
    pieces_of,
    plan_map,
    random_pairs,
    requests,
)
from transfer_engine.descriptor import Extent
from transfer_engine.planner import (
    Pair,
    Plan,
    assign_rails,
    coalesce,
    pack,
    plan_transfer,
    slice_pairs,
)

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

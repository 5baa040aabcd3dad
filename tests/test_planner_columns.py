"""The planner's columnar form: the same plans as the tuple API, and Extents that read as
lists of tuples."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.helpers.planning import check_plan, random_pairs
from transfer_engine.planner import (
    Columns,
    Extents,
    Pair,
    coalesce_columns,
    pack_columns,
    plan_columns,
    plan_transfer,
    slice_columns,
)


def test_spans_read_as_a_list_of_tuples() -> None:
    spans = Extents(np.array([3, 3, 4]), np.array([0, 10, 5]), np.array([10, 2, 7]))
    rows = [(3, 0, 10), (3, 10, 2), (4, 5, 7)]
    assert len(spans) == 3 and list(spans) == rows and spans == rows and rows == spans
    assert spans[1] == (3, 10, 2) and spans[-1] == (4, 5, 7) and spans[1:] == rows[1:]
    assert spans != rows[:2] and spans != "abc" and repr(spans) == repr(rows)
    assert all(type(v) is int for row in spans for v in row)
    with pytest.raises(TypeError):
        hash(spans)


def test_uniform_columns_plan_like_the_tuple_api() -> None:
    rng = np.random.default_rng(1)
    lo = rng.permutation(4096)[:300] * 4096
    ro = rng.permutation(4096)[:300] * 4096
    n = np.full(300, 4096)
    pairs: list[Pair] = [((1, int(a), 4096), (2, int(b), 4096)) for a, b in zip(lo, ro,
                                                                            strict=True)]
    kwargs = dict(num_rails=2, slice_size=1 << 20, max_sge=100, max_wr_bytes=1 << 20,
                  remote_scatter=True)
    a = plan_columns(Columns.uniform(1, lo, 2, ro, n), min_split=1 << 20,
                     **kwargs)  # type: ignore[arg-type]
    b = plan_transfer(pairs, min_split=1 << 20, **kwargs)  # type: ignore[arg-type]
    assert [(w.local, w.remote, w.nbytes, w.rail, w.imm) for w in a.requests] == [
        (w.local, w.remote, w.nbytes, w.rail, w.imm) for w in b.requests]
    assert a.rails_used == b.rails_used and a.nbytes == b.nbytes == 300 * 4096
    check_plan(a, pairs, **kwargs)  # type: ignore[arg-type]


def test_pieces_match_each_request() -> None:
    rng = random.Random(9)
    for _ in range(200):
        pairs = random_pairs(rng, rng.randint(1, 40))
        scatter = rng.random() < 0.5
        wrs = pack_columns(Columns.from_pairs(pairs), max_sge=rng.randint(1, 8),
                           max_wr_bytes=rng.randint(300, 3000), remote_scatter=scatter)
        for w in wrs:
            assert w.columns is not None
            assert list(w.local) == list(zip(w.columns.lseg.tolist(), w.columns.loff.tolist(),
                                             w.columns.length.tolist(), strict=True))
            assert w.columns.nbytes == w.nbytes


def test_one_request_when_everything_fits() -> None:
    cols = Columns.uniform(1, np.arange(0, 128 * 8192, 8192), 2,
                           np.arange(128 * 8192, 0, -8192), np.full(128, 4096))
    wrs = pack_columns(cols, max_sge=128, max_wr_bytes=128 * 4096, remote_scatter=True)
    assert len(wrs) == 1 and wrs[0].nbytes == 128 * 4096 and len(wrs[0].local) == 128
    wrs = pack_columns(cols, max_sge=127, max_wr_bytes=128 * 4096, remote_scatter=True)
    assert [len(w.local) for w in wrs] == [127, 1]
    wrs = pack_columns(cols, max_sge=128, max_wr_bytes=128 * 4096 - 1, remote_scatter=True)
    assert [len(w.local) for w in wrs] == [127, 1]


def test_blocks_of_one_length_are_packed_in_order_as_they_are() -> None:
    """Blocks of one known length: requests take as many blocks as the bytes and entry
    bounds allow, in the caller's order, and say that their remote entries are uniform
    (the stream transports then send offsets alone)."""
    rng = random.Random(5)
    for _ in range(300):
        block = rng.choice([1, 7, 512, 4096])
        count = rng.randint(1, 300)
        lo = np.array(rng.sample(range(4 * count), count)) * block
        ro = np.array(rng.sample(range(4 * count), count)) * block
        if rng.random() < 0.3:  # some runs contiguous on both sides
            lo, ro = np.sort(lo), np.sort(ro)
        cols = Columns.uniform(1, lo, 2, ro, np.full(count, block), count * block, block)
        pairs: list[Pair] = [((1, int(a), block), (2, int(b), block))
                             for a, b in zip(lo, ro, strict=True)]
        rails, sge = rng.randint(1, 3), rng.randint(1, 64)
        slice_size, wr_bytes = rng.randint(block, 40 * block), rng.randint(block, 80 * block)
        plan = plan_columns(cols, num_rails=rails, slice_size=slice_size, max_sge=sge,
                            max_wr_bytes=wr_bytes, remote_scatter=True, min_split=block)
        check_plan(plan, pairs, num_rails=rails, slice_size=slice_size, max_sge=sge,
                   max_wr_bytes=wr_bytes, remote_scatter=True)
        remotes = [w.remote for w in plan.requests]
        assert all(isinstance(r, Extents) and r.uniform in (None, (2, block)) for r in remotes)
        cap = min(slice_size, wr_bytes, max(block, -(-count * block // rails)))
        if block * sge >= cap:  # bytes bound every request: the pairs go as they are
            per = cap // block
            assert [len(r) for r in remotes] == [min(per, count - i)
                                                 for i in range(0, count, per)]
            spans = [r for r in remotes if isinstance(r, Extents)]
            assert all(r.uniform == (2, block) for r in spans)
            assert np.array_equal(np.concatenate([r.offset for r in spans]), ro)


def test_local_rows_follow_their_pairs_through_the_planner() -> None:
    """``iov`` rows stay aligned with their pairs when the planner sorts or slices them,
    and are dropped where it merges pairs (the engine lays merged rows out anew)."""
    base = 1 << 40
    lo = np.array([0, 8192, 4096, 16384], dtype=np.int64)
    ro = np.array([12288, 0, 4096, 8192], dtype=np.int64)  # remote neighbours only
    iov = np.stack([lo + base, np.full(4, 4096)], axis=1).astype(np.uint64)
    cols = Columns.uniform(1, lo, 2, ro, np.full(4, 4096), block=4096)
    cols.iov = iov
    sorted_cols = coalesce_columns(cols)
    assert sorted_cols.roff.tolist() == [0, 4096, 8192, 12288]
    assert sorted_cols.iov is not None
    assert sorted_cols.iov[:, 0].tolist() == (sorted_cols.loff + base).tolist()
    part = sorted_cols.slice(1, 3)
    assert part.iov is not None and part.iov[:, 0].tolist() == (part.loff + base).tolist()
    picked = sorted_cols.take(np.array([3, 0]))
    assert picked.iov is not None
    assert picked.iov[:, 0].tolist() == (picked.loff + base).tolist()
    merged = Columns.uniform(1, np.array([0, 4096]), 2, np.array([0, 4096]),
                             np.full(2, 4096), block=4096)
    merged.iov = np.array([[base, 4096], [base + 4096, 4096]], dtype=np.uint64)
    out = coalesce_columns(merged)
    assert len(out) == 1 and out.length.tolist() == [8192] and out.iov is None
    assert slice_columns(out, 4096).iov is None

"""The planner's columnar form: the same plans as the tuple API, and Spans that read as
lists of tuples."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.test_planner import check_plan, random_pairs
from transfer_engine.planner import (
    Columns,
    Pair,
    Spans,
    pack_columns,
    plan_columns,
    plan_transfer,
)


def test_spans_read_as_a_list_of_tuples() -> None:
    spans = Spans(np.array([3, 3, 4]), np.array([0, 10, 5]), np.array([10, 2, 7]))
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
            assert w.pieces is not None
            assert list(w.local) == list(zip(w.pieces.lseg.tolist(), w.pieces.loff.tolist(),
                                             w.pieces.length.tolist(), strict=True))
            assert w.pieces.nbytes == w.nbytes


def test_one_request_when_everything_fits() -> None:
    cols = Columns.uniform(1, np.arange(0, 128 * 8192, 8192), 2,
                           np.arange(128 * 8192, 0, -8192), np.full(128, 4096))
    wrs = pack_columns(cols, max_sge=128, max_wr_bytes=128 * 4096, remote_scatter=True)
    assert len(wrs) == 1 and wrs[0].nbytes == 128 * 4096 and len(wrs[0].local) == 128
    wrs = pack_columns(cols, max_sge=127, max_wr_bytes=128 * 4096, remote_scatter=True)
    assert [len(w.local) for w in wrs] == [127, 1]
    wrs = pack_columns(cols, max_sge=128, max_wr_bytes=128 * 4096 - 1, remote_scatter=True)
    assert [len(w.local) for w in wrs] == [127, 1]

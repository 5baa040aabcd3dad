"""Arena: allocation, coalescing, all-or-nothing batches, compaction, waste."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.arena import Arena, _class_floor, _size_class
from kvstore.errors import CapacityError, ValueTooLargeError

SLAB = 1 << 16


def _fill(arena: Arena, rng: np.random.Generator, n: int, top: int = 3000) -> dict[int, bytes]:
    out = {}
    for i in range(n):
        value = rng.integers(0, 256, size=int(rng.integers(0, top)), dtype=np.uint8).tobytes()
        loc = arena.alloc(len(value))
        arena.write(loc, np.array([i], dtype=np.uint64), memoryview(value), float(i))
        out[loc] = value
    return out


def _check(arena: Arena, records: dict[int, bytes]) -> None:
    locs = np.array(sorted(records), dtype=np.int64)
    for loc in locs.tolist():
        assert bytes(arena.value_view(loc)) == records[loc]
    sizes = [arena.record_size(len(records[loc])) for loc in locs.tolist()]
    ends = locs + np.array(sizes, dtype=np.int64)
    assert (ends[:-1] <= locs[1:]).all(), "records overlap"
    assert ((locs // SLAB) == ((ends - 1) // SLAB)).all(), "a record crosses a slab"
    assert arena.live_bytes == sum(arena.header_bytes + len(v) for v in records.values())


def test_size_classes_are_ordered_and_tight() -> None:
    prev = -1
    for size in range(8, 1 << 18, 8):
        cls = _size_class(size)
        assert cls >= prev
        assert _class_floor(cls) <= size < _class_floor(cls + 1)
        # a class spans at most 1/8 of its floor above 1 KiB
        assert _class_floor(cls + 1) - _class_floor(cls) <= max(8, _class_floor(cls) // 8)
        prev = cls


def test_roundtrip_and_free_everything_returns_all_slabs() -> None:
    rng = np.random.default_rng(1)
    arena = Arena(32 * SLAB, slab_bytes=SLAB)
    records = _fill(arena, rng, 400)
    _check(arena, records)
    keys = arena.keys_at(np.array(sorted(records), dtype=np.int64))
    assert keys.shape == (400, 1)
    for loc in rng.permutation(sorted(records)).tolist():
        arena.free(loc)
    assert arena.reserved_bytes == 0 and arena.live_bytes == 0 and arena.waste == 0.0
    assert arena.free_bytes == arena.capacity_bytes


def test_holes_are_reused_before_new_slabs() -> None:
    rng = np.random.default_rng(2)
    arena = Arena(64 * SLAB, slab_bytes=SLAB)
    records = _fill(arena, rng, 600)
    reserved = arena.reserved_bytes
    for loc in list(records)[::2]:
        arena.free(loc)
        del records[loc]
    records.update(_fill(arena, rng, 150, top=1000))
    assert arena.reserved_bytes == reserved
    _check(arena, records)


def test_alloc_many_is_all_or_nothing() -> None:
    rng = np.random.default_rng(3)
    arena = Arena(8 * SLAB, slab_bytes=SLAB)
    records = _fill(arena, rng, 100)
    before = (arena.reserved_bytes, arena.live_bytes, arena.free_bytes, arena.live_records)
    with pytest.raises(CapacityError):
        arena.alloc_many(np.full(400, 2000))
    assert (arena.reserved_bytes, arena.live_bytes, arena.free_bytes, arena.live_records) == before
    _check(arena, records)
    locs = arena.alloc_many(np.full(50, 100))
    assert len(set(locs.tolist()) | set(records)) == 150


def test_full_arena_refuses_cleanly() -> None:
    arena = Arena(2 * SLAB, slab_bytes=SLAB)
    value = np.random.default_rng(4).integers(0, 256, size=SLAB // 2, dtype=np.uint8).tobytes()
    a = arena.alloc(len(value))
    arena.write(a, np.array([1], dtype=np.uint64), memoryview(value))
    b = arena.alloc(len(value))
    arena.write(b, np.array([2], dtype=np.uint64), memoryview(value))
    with pytest.raises(CapacityError):
        arena.alloc(len(value))
    assert bytes(arena.value_view(a)) == value == bytes(arena.value_view(b))


def test_value_larger_than_a_slab_is_refused() -> None:
    arena = Arena(4 * SLAB, slab_bytes=SLAB)
    with pytest.raises(ValueTooLargeError):
        arena.alloc(SLAB)
    with pytest.raises(ValueTooLargeError):
        arena.alloc_many([10, SLAB])
    assert arena.reserved_bytes == 0
    arena.alloc(arena.max_value_bytes)  # exactly a slab is fine


def test_compaction_preserves_every_record_and_removes_holes() -> None:
    rng = np.random.default_rng(5)
    arena = Arena(128 * SLAB, slab_bytes=SLAB)
    records = _fill(arena, rng, 1500)
    for _ in range(3):  # churn
        for loc in rng.permutation(sorted(records))[: len(records) // 3].tolist():
            arena.free(loc)
            del records[loc]
        records.update(_fill(arena, rng, 400, top=6000))
    deadlines = {loc: float(arena.deadlines_at(np.array([loc]))[0]) for loc in records}
    keys = {loc: int(arena.keys_at(np.array([loc]))[0, 0]) for loc in records}
    assert arena.waste > 0.05
    old = np.array(list(records), dtype=np.int64)
    new = arena.compact(old)
    moved = {int(n): records[int(o)] for o, n in zip(old, new, strict=True)}
    _check(arena, moved)
    for o, n in zip(old.tolist(), new.tolist(), strict=True):
        assert float(arena.deadlines_at(np.array([n]))[0]) == deadlines[o]
        assert int(arena.keys_at(np.array([n]))[0, 0]) == keys[o]
    assert arena.waste < 0.05
    records = moved
    records.update(_fill(arena, rng, 100))
    _check(arena, records)


def test_waste_counts_reserved_but_not_live_bytes() -> None:
    arena = Arena(4 * SLAB, slab_bytes=SLAB)
    loc = arena.alloc(1000)
    assert arena.reserved_bytes == SLAB
    assert arena.waste == pytest.approx((SLAB - 1000 - arena.header_bytes) / SLAB)
    arena.free(loc)
    assert arena.waste == 0.0


def test_slabs_are_writable_views_of_one_buffer() -> None:
    arena = Arena(4 * SLAB, slab_bytes=SLAB)
    slabs = arena.slabs()
    assert len(slabs) == 4 and all(s.nbytes == SLAB for s in slabs)
    assert all(np.shares_memory(s, arena.buffer) for s in slabs)
    assert slabs[0].flags.writeable

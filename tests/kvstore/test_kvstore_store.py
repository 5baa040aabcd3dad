"""KVStore against a dict model; capacity, bad input, lifecycle, block hashes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore import (
    CapacityError,
    InvalidArgumentError,
    KeyFormatError,
    KVStore,
    StoreClosedError,
    StoreError,
    ValueTooLargeError,
    block_hashes,
)
from tests.helpers.clock import FakeClock
from transfer_engine.errors import TransferEngineError

SLAB = 1 << 16



def _value(rng: np.random.Generator, top: int = 3000) -> bytes:
    return rng.integers(0, 256, size=int(rng.integers(1, top)), dtype=np.uint8).tobytes()


def _to_key(k: int, key_bytes: int) -> int | bytes:
    return k.to_bytes(key_bytes, "little") if k % 2 else k


def _array(keys: list[int], key_bytes: int) -> np.ndarray:
    if key_bytes == 8:
        return np.array(keys, dtype=np.uint64)
    return np.array([[k & (2**64 - 1), k >> 64] for k in keys], dtype=np.uint64).reshape(-1, 2)


def _assert_matches(
    store: KVStore, model: dict[int, tuple[bytes, float]], now: float, universe: list[int], kb: int
) -> None:
    views = store.batch_get(_array(universe, kb))
    for k, view in zip(universe, views, strict=True):
        want = model.get(k)
        if want is None or want[1] <= now:
            assert view is None, f"key {k} should be absent"
        else:
            assert view is not None and bytes(view) == want[0], f"key {k} differs"


@pytest.mark.parametrize("key_bytes", [8, 16])
def test_random_operations_match_a_dict(key_bytes: int) -> None:
    rng = np.random.default_rng(100 + key_bytes)
    clock = FakeClock(50.0)
    universe = [int(x) for x in rng.integers(0, 2**63, size=400)]
    if key_bytes == 16:
        universe = [k | int(rng.integers(0, 2**62)) << 64 for k in universe]
    model: dict[int, tuple[bytes, float]] = {}
    with KVStore(
        256 * SLAB,
        slab_bytes=SLAB,
        key_bytes=key_bytes,
        clock=clock,
        evict=False,
        ttl_granularity=0.25,
    ) as store:
        for step in range(1500):
            op = rng.random()
            k = universe[int(rng.integers(0, len(universe)))]
            if op < 0.45:
                v = _value(rng)
                ttl = None if rng.random() < 0.6 else float(rng.uniform(0.1, 3.0))
                store.put(_to_key(k, key_bytes), v, ttl=ttl)
                model[k] = (v, math.inf if ttl is None else clock.now + ttl)
            elif op < 0.55:
                ks = list({universe[int(i)]: None for i in rng.integers(0, len(universe), 20)})
                vs = [_value(rng, 500) for _ in ks]
                store.batch_put(_array(ks, key_bytes), vs)
                model.update({kk: (vv, math.inf) for kk, vv in zip(ks, vs, strict=True)})
            elif op < 0.7:
                was = model.pop(k, None)
                assert store.delete(_to_key(k, key_bytes)) == (
                    was is not None and was[1] > clock.now
                )
            elif op < 0.85:
                got = store.get(_to_key(k, key_bytes))
                want = model.get(k)
                if want is None or want[1] <= clock.now:
                    assert got is None
                else:
                    assert got is not None and bytes(got) == want[0]
            elif op < 0.95:
                clock.now += float(rng.exponential(0.3))
                expired = store.expire()
                gone = [kk for kk, (_, d) in model.items() if d <= clock.now]
                assert expired == len(gone)
                for kk in gone:
                    del model[kk]
            else:
                store.compact()
            if step % 100 == 0:
                _assert_matches(store, model, clock.now, universe, key_bytes)
                assert len(store) == len(model)
        _assert_matches(store, model, clock.now, universe, key_bytes)
        assert store.stats().compactions > 0 and store.stats().expirations > 0


def test_eviction_under_pressure_never_returns_wrong_data() -> None:
    rng = np.random.default_rng(7)
    model: dict[int, bytes] = {}
    with KVStore(32 * SLAB, slab_bytes=SLAB, max_entries=5000) as store:
        for _ in range(3000):
            k = int(rng.integers(0, 800))
            if rng.random() < 0.8:
                model[k] = _value(rng, 8000)
                store.put(k, model[k])
            else:
                store.delete(k)
                model.pop(k, None)
            if rng.random() < 0.3:
                store.get(int(rng.integers(0, 800)))
        views = store.batch_get(np.arange(800, dtype=np.uint64))
        present = 0
        for k, view in enumerate(views):
            if view is not None:
                present += 1
                assert bytes(view) == model[k]
        stats = store.stats()
        assert stats.evictions > 0 and present == stats.entries
        assert stats.waste < 0.10


def test_fill_index_to_95_percent_and_fail_without_losing_anything() -> None:
    rng = np.random.default_rng(8)
    keys = np.unique(rng.integers(0, 2**64, size=5000, dtype=np.uint64))[:4000]
    values = rng.integers(0, 256, size=(4000, 16), dtype=np.uint8)
    with KVStore(64 * SLAB, slab_bytes=SLAB, max_entries=2400, evict=False) as store:
        slots = store.index.slots
        assert slots == 3072
        store.batch_put(keys[:2500], values[:2500])
        n = 2500
        with pytest.raises(CapacityError):
            while n < 4000:
                store.put(int(keys[n]), values[n])
                n += 1
        assert n / slots >= 0.95
        assert len(store) == n
        views = store.batch_get(keys[: n + 1])
        assert views[n] is None
        assert all(bytes(v) == values[i].tobytes() for i, v in enumerate(views[:n]))
        live = store.arena.live_records
        with pytest.raises(CapacityError):  # a batch that cannot fit is rolled back
            store.batch_put(keys[n : n + 200], values[n : n + 200])
        assert len(store) == n and store.arena.live_records == live


def test_full_arena_without_eviction_refuses_and_keeps_everything() -> None:
    rng = np.random.default_rng(9)
    with KVStore(4 * SLAB, slab_bytes=SLAB, evict=False) as store:
        stored = {}
        with pytest.raises(CapacityError):
            for i in range(100):
                v = _value(rng, 20_000)
                store.put(i, v)
                stored[i] = v
        assert len(store) == len(stored)
        for k, v in stored.items():
            assert bytes(store.get(k)) == v


def _snapshot(store: KVStore) -> tuple[object, ...]:
    views = store.batch_get(np.arange(20, dtype=np.uint64))
    return (store.stats(), [None if v is None else bytes(v) for v in views])


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.put("abc", b"v"), KeyFormatError),
        (lambda s: s.put(1.5, b"v"), KeyFormatError),
        (lambda s: s.put(True, b"v"), KeyFormatError),
        (lambda s: s.put(-1, b"v"), KeyFormatError),
        (lambda s: s.put(2**64, b"v"), KeyFormatError),
        (lambda s: s.put(b"short", b"v"), KeyFormatError),
        (lambda s: s.get(b"\x00" * 16), KeyFormatError),
        (lambda s: s.batch_get(np.arange(3, dtype=np.int64)), KeyFormatError),
        (lambda s: s.batch_get(np.zeros((3, 2), dtype=np.uint64)), KeyFormatError),
        (lambda s: s.batch_put([1, "x"], [b"a", b"b"]), KeyFormatError),
        (lambda s: s.put(1, b"x" * SLAB), ValueTooLargeError),
        (lambda s: s.batch_put([1, 2], [b"a", b"x" * SLAB]), ValueTooLargeError),
        (lambda s: s.batch_put([1, 2], np.zeros((2, SLAB), dtype=np.uint8)), ValueTooLargeError),
        (lambda s: s.put(1, b"v", ttl=-1.0), InvalidArgumentError),
        (lambda s: s.put(1, b"v", ttl=0), InvalidArgumentError),
        (lambda s: s.put(1, b"v", ttl=float("nan")), InvalidArgumentError),
        (lambda s: s.put(1, b"v", ttl=float("inf")), InvalidArgumentError),
        (lambda s: s.put(1, b"v", ttl="5"), InvalidArgumentError),
        (lambda s: s.batch_put([1, 2], [b"a", b"b"], ttl=-3), InvalidArgumentError),
        (lambda s: s.put(1, "text"), InvalidArgumentError),
        (lambda s: s.put(1, None), InvalidArgumentError),
        (lambda s: s.batch_put([1, 2], [b"a"]), InvalidArgumentError),
        (lambda s: s.batch_put([1, 2], b"ab"), InvalidArgumentError),
    ],
)
def test_bad_input_is_rejected_and_leaves_the_store_unchanged(call, error) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(10)
    with KVStore(8 * SLAB, slab_bytes=SLAB) as store:
        for i in range(10):
            store.put(i, _value(rng), ttl=100.0 if i % 2 else None)
        before = _snapshot(store)
        with pytest.raises(error) as info:
            call(store)
        assert isinstance(info.value, StoreError) and isinstance(info.value, TransferEngineError)
        assert _snapshot(store) == before


def test_batch_put_last_duplicate_wins_and_matrix_path() -> None:
    rng = np.random.default_rng(11)
    with KVStore(16 * SLAB, slab_bytes=SLAB) as store:
        store.batch_put([5, 6, 5], [b"first", b"six", b"last"])
        assert bytes(store.get(5)) == b"last" and len(store) == 2
        keys = np.arange(100, 400, dtype=np.uint64)
        for width in (24, 13):
            values = rng.integers(0, 256, size=(keys.size, width), dtype=np.uint8)
            store.batch_put(keys, values)
            assert all(bytes(v) == values[i].tobytes() for i, v in enumerate(store.batch_get(keys)))
        assert len(store) == 302
        assert store.batch_delete(np.array([5, 7, 100], dtype=np.uint64)).tolist() == [
            True,
            False,
            True,
        ]


def test_compaction_preserves_every_value_and_index_entry() -> None:
    rng = np.random.default_rng(12)
    with KVStore(128 * SLAB, slab_bytes=SLAB, compact_threshold=1.0) as store:
        model = {}
        for i in range(2000):
            model[i] = _value(rng, 4000)
            store.put(i, model[i], ttl=1e6 if i % 3 else None)
        for i in rng.permutation(2000)[:900].tolist():
            store.delete(i)
            del model[i]
        waste = store.stats().waste
        deadlines_before = store.arena.deadlines_at(
            store.lookup(np.array(sorted(model), dtype=np.uint64))
        )
        moved = store.compact()
        assert moved > 0 and store.stats().waste < min(waste, 0.05)
        assert len(store) == len(model) == store.index.entries()[0].size
        keys = np.array(sorted(model), dtype=np.uint64)
        locs = store.lookup(keys)
        assert (locs >= 0).all()
        np.testing.assert_array_equal(store.arena.deadlines_at(locs), deadlines_before)
        for k, v in zip(keys.tolist(), store.batch_get(keys), strict=True):
            assert bytes(v) == model[k]


def test_views_are_zero_copy_and_read_only() -> None:
    with KVStore(4 * SLAB, slab_bytes=SLAB) as store:
        data = np.random.default_rng(13).integers(0, 256, size=1000, dtype=np.uint8)
        store.put(1, data)
        view = store.get(1)
        assert view is not None and view.readonly
        assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), store.arena.buffer)
        assert bytes(view) == data.tobytes()
        store.put(2, np.arange(10, dtype=np.float32))  # any contiguous buffer
        assert bytes(store.get(2)) == np.arange(10, dtype=np.float32).tobytes()


def test_lifecycle_close_is_idempotent_and_final() -> None:
    store = KVStore(4 * SLAB, slab_bytes=SLAB)
    store.put(1, b"x")
    assert "entries=1" in repr(store) and "OPEN" in repr(store)
    with store as same:
        assert same is store and 1 in store
    store.close()
    store.close()
    assert repr(store) == "<KVStore CLOSED>"
    for call in (lambda: store.get(1), lambda: store.put(2, b"y"), store.compact, store.expire):
        with pytest.raises(StoreClosedError):
            call()


def test_block_hashes_chain_prefixes() -> None:
    rng = np.random.default_rng(14)
    a = rng.integers(0, 50_000, size=100)
    b = a.copy()
    b[70] += 1  # differs inside block 4 (block size 16)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha.dtype == np.uint64 and ha.shape == (6,)  # the partial last block has no key
    assert ha[:4].tolist() == hb[:4].tolist()
    assert all(x != y for x, y in zip(ha[4:], hb[4:], strict=True))
    assert block_hashes(a[:64], 16).tolist() == ha[:4].tolist()
    # continuing a chain from a parent key gives the same keys
    assert block_hashes(a[64:96], 16, parent=int(ha[3])).tolist() == ha[4:6].tolist()
    assert block_hashes(a, 16, salt=b"model-b")[0] != ha[0]
    wide = block_hashes(a, 16, key_bytes=16)
    assert wide.shape == (6, 2)
    with KVStore(4 * SLAB, slab_bytes=SLAB, key_bytes=16) as store:
        store.batch_put(wide, [b"kv"] * 6)
        assert store.batch_contains(block_hashes(a[:40], 16, key_bytes=16)).all()
    for bad in ((a, 0), (a.astype(float), 16), (a.reshape(10, 10), 16)):
        with pytest.raises(InvalidArgumentError):
            block_hashes(*bad)
    with pytest.raises(KeyFormatError):
        block_hashes(a, 16, key_bytes=4)

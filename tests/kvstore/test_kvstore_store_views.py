"""Views kept across later writes: they show their own bytes or nothing, never another
key's. Their records are held while they live and reused once they are gone."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvstore import CapacityError, KVStore

SLAB = 1 << 16


def _bytes(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


def _churn(store: KVStore, rng: np.random.Generator, rounds: int, first_key: int) -> None:
    """Puts random values of random sizes under fresh keys: several times the arena,
    so everything unpinned is evicted, reused and compacted many times over."""
    for i in range(rounds):
        store.put(first_key + i, _bytes(rng, int(rng.integers(100, 6000))))
        if i % 50 == 0:
            store.compact()


def test_a_view_kept_across_delete_and_a_same_size_put_keeps_its_bytes() -> None:
    """The attack as reported: get, delete, put another key of the same size."""
    rng = np.random.default_rng(1)
    with KVStore(4 * SLAB, slab_bytes=SLAB) as store:
        mine, other = _bytes(rng, 1000), _bytes(rng, 1000)
        store.put(1, mine)
        view = store.get(1)
        assert view is not None
        assert store.delete(1)
        store.put(2, other)
        assert bytes(view) == mine and bytes(store.get(2)) == other  # type: ignore[arg-type]
        assert store.stats().held_bytes > 0
        del view
        store.put(3, other)
        assert store.stats().held_bytes == 0
        store.verify()


@pytest.mark.parametrize("how", ["delete", "overwrite", "evict", "expire", "close"])
def test_views_and_what_is_made_from_them_survive_heavy_reuse(how: str) -> None:
    rng = np.random.default_rng(2)
    now = [100.0]
    store = KVStore(
        16 * SLAB, slab_bytes=SLAB, max_entries=400, compact_threshold=0.0, clock=lambda: now[0]
    )
    kept = {k: _bytes(rng, int(rng.integers(1, 5000))) for k in range(10)}
    store.batch_put(list(kept), list(kept.values()), ttl=5.0 if how == "expire" else None)
    views = store.batch_get(list(kept))
    single = store.get(3)
    assert single is not None
    sliced = views[4][10:20]  # type: ignore[index]
    again = memoryview(views[5])  # type: ignore[arg-type]
    array = np.frombuffer(views[6], dtype=np.uint8)  # type: ignore[arg-type]
    del views[4:7]
    gc.collect()
    if how == "delete":
        assert store.batch_delete(list(kept)).all()
    elif how == "overwrite":
        store.batch_put(list(kept), [_bytes(rng, len(v)) for v in kept.values()])
    elif how == "expire":
        now[0] += 10.0
        assert store.expire() == len(kept)
    elif how == "close":
        store.close()
    if how != "close":
        _churn(store, rng, 600, 1000)
        stats = store.stats()
        assert stats.evictions > 0 and stats.compactions > 0
        if how != "evict":
            assert stats.held_bytes >= sum(len(v) for v in kept.values())
        store.verify()
    for k, view in zip(kept, views[:4] + [None, None, None] + views[4:], strict=True):
        if view is not None:
            assert bytes(view) == kept[k], f"key {k}: {how} changed a kept view"
    assert bytes(single) == kept[3]
    assert bytes(sliced) == kept[4][10:20]
    assert bytes(again) == kept[5] and array.tobytes() == kept[6]
    if how == "close":
        return
    del views, view, single, sliced, again, array
    gc.collect()
    assert store.stats().held_bytes == 0
    _churn(store, rng, 200, 5000)  # the held bytes are reused
    store.verify()
    store.close()


def test_a_pinned_slab_stays_put_and_the_others_are_compacted() -> None:
    rng = np.random.default_rng(3)
    with KVStore(32 * SLAB, slab_bytes=SLAB, compact_threshold=1.0) as store:
        values = {k: _bytes(rng, int(rng.integers(500, 3000))) for k in range(400)}
        for k, v in values.items():
            store.put(k, v)
        view = store.get(7)
        loc = int(store.lookup([7])[0])
        for k in range(0, 400, 2):
            if k != 7:
                store.delete(k)
                del values[k]
        waste = store.stats().waste
        assert store.compact() > 0
        assert int(store.lookup([7])[0]) == loc
        assert store.stats().waste < waste / 2
        assert bytes(view) == values[7]  # type: ignore[arg-type]
        got = [bytes(v) for v in store.batch_get(sorted(values))]  # type: ignore[arg-type]
        assert got == [values[k] for k in sorted(values)]
        store.verify()


def test_views_that_hold_the_whole_arena_make_puts_fail_cleanly_not_hang() -> None:
    rng = np.random.default_rng(4)
    with KVStore(4 * SLAB, slab_bytes=SLAB) as store:
        keys = list(range(4 * (SLAB // 2024)))  # 2,000-byte values fill every slab
        values = [_bytes(rng, 2000) for _ in keys]
        store.batch_put(keys, values)
        views = store.batch_get(keys)
        store.batch_delete(keys)
        with pytest.raises(CapacityError, match="held for views"):
            store.put(1000, _bytes(rng, 2000))
        assert [bytes(v) for v in views] == values  # type: ignore[arg-type]
        store.verify()
        del views
        store.put(5000, b"room again")
        assert store.stats().held_bytes == 0
        store.verify()


def test_a_view_can_be_stored_again_under_another_key() -> None:
    rng = np.random.default_rng(5)
    with KVStore(4 * SLAB, slab_bytes=SLAB) as store:
        value = _bytes(rng, 3000)
        store.put(1, value)
        view = store.get(1)
        store.put(2, view)
        store.put(1, view)  # overwrite a key with a view of its own old value
        assert bytes(store.get(1)) == bytes(store.get(2)) == value  # type: ignore[arg-type]
        store.verify()


def test_pinned_slabs_do_not_make_every_put_compact() -> None:
    """Holes in pinned slabs cannot be packed: once a compaction has left them, puts do
    not compact again and again for them."""
    rng = np.random.default_rng(6)
    with KVStore(32 * SLAB, slab_bytes=SLAB) as store:
        keys = list(range(800))
        store.batch_put(keys, [_bytes(rng, 2000) for _ in keys])
        views = store.batch_get(keys[::25])  # about one record per slab
        store.batch_delete(keys[::2])
        before = store.stats().compactions
        for i in range(300):
            store.put(10_000 + i, _bytes(rng, int(rng.integers(100, 3000))))
        assert store.stats().compactions - before <= 2
        assert all(v is not None for v in views)
        store.verify()

"""Expiry layers and CLOCK reclamation, against simple models, with a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import KVStore
from kvstore.errors import InvalidArgumentError
from kvstore.index import CuckooIndex
from kvstore.ttl import ClockReclaimer, ExpiryLayers
from tests.helpers.clock import FakeClock
from tests.helpers.faults import clock_hand, sorted_layers


@pytest.mark.parametrize("granularity", [0.1, 1.0, 7.0])
def test_layers_pop_exactly_the_due_deadlines(granularity: float) -> None:
    rng = np.random.default_rng(1)
    layers = ExpiryLayers(granularity)
    pending: dict[int, float] = {}
    key = 0
    now = 0.0
    for _ in range(300):
        for d in (now + rng.exponential(5.0, size=int(rng.integers(0, 20)))).tolist():
            layers.add(key, d)
            pending[key] = d
            key += 1
        if rng.random() < 0.2 and pending:  # a deadline exactly at "now"
            now = min(pending.values())
        else:
            now += float(rng.exponential(0.5))
        due = layers.pop_due(now)
        expect = sorted(k for k, d in pending.items() if d <= now)
        assert sorted(k for k, _ in due) == expect
        assert all(pending[k] == d for k, d in due)
        for k in expect:
            del pending[k]
        assert len(layers) == len(pending)


def test_layers_ignore_infinite_deadlines_and_reject_bad_granularity() -> None:
    layers = ExpiryLayers(1.0)
    layers.add(1, float("inf"))
    assert len(layers) == 0 and layers.next_deadline() is None
    layers.add(2, 5.5)
    assert layers.next_deadline() == 5.5
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError):
            ExpiryLayers(bad)


def test_popping_nothing_touches_no_layer() -> None:
    layers = ExpiryLayers(1.0)
    for i in range(10_000):
        layers.add(i, 100.0 + i * 0.01)
    assert layers.pop_due(99.999) == []
    assert sorted_layers(layers) == set()  # no layer was even sorted
    assert len(layers.pop_due(100.5)) == 51
    assert sorted_layers(layers) == {100}  # only the straddling layer


def _clock_model(occupied: np.ndarray, ref: np.ndarray, hand: int, count: int) -> list[int]:
    """Textbook CLOCK: one slot at a time, at most one full turn."""
    victims = []
    for step in range(occupied.size):
        if len(victims) == count:
            break
        i = (hand + step) % occupied.size
        if not occupied[i]:
            continue
        if ref[i]:
            ref[i] = 0
        else:
            victims.append(i)
    return victims


def test_clock_selects_what_the_textbook_clock_selects() -> None:
    rng = np.random.default_rng(2)
    index = CuckooIndex(64, lambda locs: np.zeros((locs.size, 1), dtype=np.uint64))
    reclaimer = ClockReclaimer(index, window=100)  # windows not aligned to anything
    for _ in range(50):
        index.tags[:] = rng.integers(0, 256, size=index.tags.shape) * (
            rng.random(index.tags.shape) < 0.7
        )
        index.ref[:] = (rng.random(index.ref.shape) < 0.5) & (index.tags != 0)
        occupied = (index.tags != 0).ravel()
        ref = index.ref.ravel().copy()
        count = int(rng.integers(1, 300))
        expect = _clock_model(occupied, ref, reclaimer.hand, count)
        got = reclaimer.select(count).tolist()
        assert got == expect
        if len(got) == count:
            assert reclaimer.hand == (got[-1] + 1) % occupied.size
            np.testing.assert_array_equal(index.ref.ravel(), ref)


def test_store_expiry_is_exact_with_a_fake_clock() -> None:
    clock = FakeClock()
    rng = np.random.default_rng(3)
    values = [rng.integers(0, 256, size=50, dtype=np.uint8).tobytes() for _ in range(200)]
    with KVStore(1 << 22, slab_bytes=1 << 16, clock=clock, ttl_granularity=0.5) as store:
        ttls = rng.uniform(0.1, 10.0, size=200)
        for i, (v, t) in enumerate(zip(values, ttls.tolist(), strict=True)):
            store.put(i, v, ttl=t)
        store.put(1000, b"forever")
        for step in np.linspace(0.0, 11.0, 45).tolist():
            clock.now = 1000.0 + step
            alive = {i for i, t in enumerate(ttls.tolist()) if 1000.0 + t > clock.now}
            live = store.batch_contains(np.arange(200, dtype=np.uint64))
            assert set(np.flatnonzero(live).tolist()) == alive
            store.expire()
            assert len(store) == len(alive) + 1
            for i in list(alive)[:5]:
                assert bytes(store.get(i)) == values[i]
        assert store.stats().expirations == 200
        assert bytes(store.get(1000)) == b"forever"
        # at the deadline exactly, the entry is gone
        store.put(5, b"x", ttl=2.0)
        clock.now += 2.0
        assert store.get(5) is None and store.expire() == 1


def test_overwrite_resets_the_deadline() -> None:
    clock = FakeClock()
    with KVStore(1 << 20, slab_bytes=1 << 16, clock=clock) as store:
        store.put(1, b"a", ttl=1.0)
        store.put(1, b"b", ttl=5.0)
        store.put(2, b"c", ttl=1.0)
        store.put(2, b"d")  # no ttl any more
        clock.now += 3.0
        assert store.expire() == 0
        assert bytes(store.get(1)) == b"b" and bytes(store.get(2)) == b"d"
        clock.now += 2.0
        assert store.expire() == 1 and store.get(1) is None


def test_forced_reclamation_evicts_only_unreferenced_entries() -> None:
    rng = np.random.default_rng(4)
    value = rng.integers(0, 256, size=4000, dtype=np.uint8).tobytes()
    with KVStore(16 << 16, slab_bytes=1 << 16, max_entries=10_000, compact_threshold=1.0) as store:
        index = store.index
        n = 0
        while store.stats().evictions == 0 and n < 1000:
            store.put(n, value)
            n += 1
        present = np.flatnonzero(store.batch_contains(np.arange(n, dtype=np.uint64)))
        hot = set(present[::3].tolist())
        for k in hot:
            assert store.get(k) is not None  # sets the reference bit
        for _ in range(3):  # three more rounds of forced reclamation
            occupied = (index.tags != 0).ravel()
            ref = index.ref.ravel().copy()
            slot_keys = {
                int(p): int(store.arena.keys_at(np.array([loc]))[0, 0])
                for p, loc in zip(*index.entries(), strict=True)
            }
            order = _clock_model(occupied, ref.copy(), clock_hand(store), occupied.size)
            before = store.stats().evictions
            keys_before = set(slot_keys.values())
            while store.stats().evictions == before:
                store.put(n, value)
                n += 1
            keys_after = set(
                np.flatnonzero(store.batch_contains(np.arange(n, dtype=np.uint64))).tolist()
            )
            evicted = keys_before - keys_after
            expect = {slot_keys[p] for p in order[: len(evicted)]}
            assert evicted == expect, "victims are the first unreferenced slots from the hand"
            assert not evicted & hot, "entries with their reference bit set got a second chance"


def test_entry_budget_evicts_one_per_new_key() -> None:
    with KVStore(1 << 22, slab_bytes=1 << 16, max_entries=50) as store:
        for i in range(50):
            store.put(i, bytes([i]) * 10)
        for i in range(50, 60):
            store.put(i, b"new")
            assert len(store) == 50
        assert store.stats().evictions == 10
        store.put(55, b"overwrite does not evict")
        assert store.stats().evictions == 10

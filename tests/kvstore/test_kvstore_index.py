"""CuckooIndex against a dict model, at high load, and on bad input."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from kvstore.errors import CapacityError, InvalidArgumentError, KeyFormatError
from kvstore.index import _ALT, ROW_BYTES, SLOTS, CuckooIndex


class Records:
    """Stands in for the arena: location ``i`` holds ``keys[i]``; counts key reads."""

    def __init__(self, keys: npt.NDArray[np.uint64]) -> None:
        self.keys = keys if keys.ndim == 2 else keys[:, None]
        self.reads = 0

    def keys_at(self, locs: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        self.reads += 1
        return self.keys[locs]


def _random_keys(rng: np.random.Generator, n: int, words: int = 1) -> npt.NDArray[np.uint64]:
    keys = np.unique(rng.integers(0, 2**64, size=(n * 2, words), dtype=np.uint64), axis=0)
    rng.shuffle(keys)
    keys = keys[:n]
    return keys[:, 0].copy() if words == 1 else keys


def _snapshot(index: CuckooIndex, keys: npt.NDArray[np.uint64]) -> tuple[int, list[int]]:
    return len(index), index.lookup(keys, touch=False).tolist()


def _check_layout(index: CuckooIndex) -> None:
    """Tags sit in padded rows whose pad bytes stay 0; every write reached the table."""
    rows = index.tags.base  # the padded rows ``tags`` is a view into
    assert rows.shape == (index.num_buckets, ROW_BYTES)
    assert np.shares_memory(index.tags, rows)
    assert not rows[:, SLOTS:].any()
    occupied = index.tags != 0
    assert int(occupied.sum()) == len(index) - index.stash_count
    np.testing.assert_array_equal(index.locs >= 0, occupied)
    pos, _ = index.entries()
    table = pos[pos >= 0]
    np.testing.assert_array_equal(table, np.flatnonzero(occupied))


def test_alternate_bucket_is_an_involution_of_bucket_and_tag() -> None:
    mask = (1 << 10) - 1
    for tag in range(1, 256):
        for b in (0, 1, 517, mask):
            alt = (b ^ int(_ALT[tag])) & mask
            assert alt != b
            assert (alt ^ int(_ALT[tag])) & mask == b


@pytest.mark.parametrize("words", [1, 2])
def test_random_batches_match_a_dict(words: int) -> None:
    rng = np.random.default_rng(7 + words)
    universe = _random_keys(rng, 6000, words)
    rec = Records(universe)
    index = CuckooIndex(512, rec.keys_at, key_words=words)
    model: dict[int, int] = {}  # universe position -> location (its own position)
    for _ in range(200):
        op = rng.integers(0, 3)
        pick = np.unique(rng.integers(0, universe.shape[0], size=int(rng.integers(1, 200))))
        if op == 0:
            old = index.insert(universe[pick], pick)
            assert old.tolist() == [model.get(int(i), -1) for i in pick]
            model.update({int(i): int(i) for i in pick})
        elif op == 1:
            gone = index.delete(universe[pick])
            assert gone.tolist() == [model.pop(int(i), -1) for i in pick]
        probe = rng.integers(0, universe.shape[0], size=300)
        got = index.lookup(universe[probe])
        assert got.tolist() == [model.get(int(i), -1) for i in probe]
        assert len(index) == len(model)
        _check_layout(index)
    index.clear()
    _check_layout(index)
    assert len(index) == 0 and (index.lookup(universe) == -1).all()


def test_occupied_reads_a_range_of_flat_positions() -> None:
    rng = np.random.default_rng(15)
    keys = _random_keys(rng, 3000)
    index = CuckooIndex(256, Records(keys).keys_at)
    index.insert(keys[:2000], np.arange(2000))
    index.delete(keys[:500])
    _check_layout(index)
    want = (index.tags != 0).ravel()
    total = index.slots
    ends = [(0, total), (0, 0), (total, total), (5, 6), (11, 13), (12, 24), (total - 1, total)]
    for _ in range(200):
        a, b = np.sort(rng.integers(0, total + 1, size=2)).tolist()
        ends.append((a, b))
    for a, b in ends:
        got = index.occupied(a, b)
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(got, want[a:b])


def test_fill_beyond_95_percent_then_fail_cleanly() -> None:
    rng = np.random.default_rng(11)
    keys = _random_keys(rng, 4000)
    rec = Records(keys)
    index = CuckooIndex(256, rec.keys_at, stash_size=4)
    i = 0
    # bulk first, then one by one until the first refusal
    index.insert(keys[:2600], np.arange(2600))
    i = 2600
    with pytest.raises(CapacityError):
        while i < keys.size:
            index.insert(keys[i : i + 1], [i])
            i += 1
    assert i / index.slots >= 0.95, f"load before first failure {i / index.slots:.3f}"
    assert len(index) == i
    assert index.lookup(keys[:i]).tolist() == list(range(i))
    assert index.lookup(keys[i : i + 1]).tolist() == [-1]


def test_failed_batch_is_rolled_back_including_overwrites() -> None:
    rng = np.random.default_rng(12)
    keys = _random_keys(rng, 4000)
    rec = Records(np.concatenate((keys, keys)))  # location i + 4000 also holds key i
    index = CuckooIndex(128, rec.keys_at, stash_size=2)
    index.insert(keys[:1400], np.arange(1400))
    before = _snapshot(index, keys)
    batch = np.arange(1300, 1700)  # 100 overwrites, 300 new keys that cannot all fit
    with pytest.raises(CapacityError):
        index.insert(keys[batch], batch + 4000)
    assert _snapshot(index, keys) == before


def test_displacement_moves_entries_without_reading_keys() -> None:
    rng = np.random.default_rng(13)
    keys = _random_keys(rng, 3000)
    rec = Records(keys)
    index = CuckooIndex(128, rec.keys_at, stash_size=0)
    index.insert(keys[:1300], np.arange(1300))  # ~85% full
    moved_any = False
    for i in range(1300, 1440):
        before = index.tags.copy()
        rec.reads = 0
        index.insert(keys[i : i + 1], [i])
        # one confirmation read for the existence check, none for displacement
        assert rec.reads <= 1
        moved_any |= int((before != index.tags).sum()) > 1
    assert moved_any
    assert index.lookup(keys[:1440]).tolist() == list(range(1440))


def test_stash_takes_overflow_and_drains_on_delete() -> None:
    rng = np.random.default_rng(14)
    keys = _random_keys(rng, 200)
    rec = Records(np.concatenate((keys, keys)))  # location i + 200 also holds key i
    index = CuckooIndex(2, rec.keys_at, stash_size=4)
    n = 0
    with pytest.raises(CapacityError):
        for n in range(200):  # noqa: B007
            index.insert(keys[n : n + 1], [n])
    assert index.stash_count == 4 and len(index) == 2 * SLOTS + 4 == n
    assert index.lookup(keys[:n]).tolist() == list(range(n))
    # overwriting keys that sit in the stash updates them in place
    stashed = index.stash_locs[index.stash_locs >= 0]
    assert index.insert(keys[stashed], stashed + 200).tolist() == stashed.tolist()
    assert len(index) == n
    index.insert(keys[stashed], stashed)
    index.delete(keys[:6])
    assert index.stash_count == 0
    assert index.lookup(keys[6:n]).tolist() == list(range(6, n))
    assert len(index) == n - 6


def test_entries_and_set_locations() -> None:
    rng = np.random.default_rng(15)
    keys = _random_keys(rng, 500)
    rec = Records(np.concatenate((keys, keys)))
    index = CuckooIndex(64, rec.keys_at)
    index.insert(keys, np.arange(500))
    pos, locs = index.entries()
    assert sorted(locs.tolist()) == list(range(500))
    index.set_locations(pos, locs + 500)
    assert index.lookup(keys).tolist() == list(range(500, 1000))


def test_lookup_sets_reference_bits_only_for_hits() -> None:
    rng = np.random.default_rng(16)
    keys = _random_keys(rng, 100)
    rec = Records(keys)
    index = CuckooIndex(16, rec.keys_at)
    index.insert(keys[:50], np.arange(50))
    assert index.ref.sum() == 0
    index.lookup(keys[40:60])
    assert index.ref.sum() == 10
    index.lookup(keys[:5], touch=False)
    assert index.ref.sum() == 10


@pytest.mark.parametrize(
    "bad",
    [
        np.arange(4, dtype=np.int64),
        np.zeros((4, 2), dtype=np.uint64),
        np.zeros((2, 2, 1), dtype=np.uint64),
        [1, 2, 3],
    ],
)
def test_bad_keys_are_rejected_and_change_nothing(bad: object) -> None:
    rng = np.random.default_rng(17)
    keys = _random_keys(rng, 50)
    rec = Records(keys)
    index = CuckooIndex(16, rec.keys_at)
    index.insert(keys[:20], np.arange(20))
    before = _snapshot(index, keys)
    with pytest.raises(KeyFormatError):
        index.insert(bad, np.arange(4))  # type: ignore[arg-type]
    with pytest.raises(KeyFormatError):
        index.lookup(bad)  # type: ignore[arg-type]
    assert _snapshot(index, keys) == before


def test_duplicate_keys_in_a_batch_are_rejected() -> None:
    rng = np.random.default_rng(18)
    keys = _random_keys(rng, 10)
    index = CuckooIndex(16, Records(keys).keys_at)
    with pytest.raises(InvalidArgumentError):
        index.insert(keys[[1, 2, 1]], [1, 2, 1])
    assert len(index) == 0


def test_bad_geometry_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        CuckooIndex(12, Records(np.zeros(1, dtype=np.uint64)).keys_at)

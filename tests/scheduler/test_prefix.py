"""Prefix caches: overlap depth per instance, LRU eviction that keeps prefixes whole."""

from __future__ import annotations

from scheduler.prefix import PrefixIndex, text_keys


def test_overlaps_count_leading_blocks_per_instance() -> None:
    idx = PrefixIndex(100)
    idx.insert(0, [1, 2, 3, 4])
    idx.insert(1, [1, 2])
    idx.insert(2, [9])
    assert idx.overlaps([1, 2, 3, 7]) == {0: 3, 1: 2}
    assert idx.overlaps([1, 2, 3, 4, 5]) == {0: 4, 1: 2}
    assert idx.overlaps([7, 2]) == {}  # the first block is nowhere
    assert idx.longest([1, 2, 3]) == 3 and idx.longest([]) == 0


def test_eviction_takes_the_tail_first() -> None:
    idx = PrefixIndex(4)
    idx.insert(0, [1, 2, 3])
    idx.insert(0, [10, 11])  # one block must go: the old prompt's tail (3)
    assert idx.overlaps([1, 2, 3]) == {0: 2}
    assert idx.overlaps([10, 11]) == {0: 2}
    assert idx.blocks(0) == 4 and idx.evictions == 1


def test_drop_forgets_an_instance() -> None:
    idx = PrefixIndex(10)
    idx.insert(0, [1, 2])
    idx.insert(1, [1])
    idx.drop(0)
    assert idx.overlaps([1, 2]) == {1: 1}
    assert PrefixIndex(0).overlaps([1]) == {}


def test_text_keys_are_chained_and_whole_blocks() -> None:
    a = text_keys("x" * 100 + "y" * 100, chunk_chars=50)
    b = text_keys("x" * 100 + "z" * 100, chunk_chars=50)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]
    assert text_keys("y" * 50 + "x" * 50, chunk_chars=50)[1] != a[1]  # position matters
    assert text_keys("short", chunk_chars=50) == []

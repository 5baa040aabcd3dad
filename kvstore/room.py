"""How :class:`~kvstore.store.KVStore` makes room: expiry sweeps, compaction, eviction.

When memory runs short a put first sweeps expired entries, then compacts if that makes
room, and then (``evict=True``) evicts with CLOCK; with ``evict=False`` it raises
:class:`CapacityError` instead and nothing stored is lost. A put also compacts first when
too much of the reserved arena is not live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstore.errors import CapacityError
from kvstore.index import ABSENT

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvstore.arena import Arena
    from kvstore.index import CuckooIndex
    from kvstore.ttl import ClockReclaimer, ExpiryLayers

__all__ = ["Room"]

I64 = npt.NDArray[np.int64]
_M64 = (1 << 64) - 1


class Room:
    """Mixed into :class:`~kvstore.store.KVStore`: expiry, compaction and eviction.
    Called with the store's lock held."""

    if TYPE_CHECKING:
        max_entries: int
        evictions: int
        expirations: int
        compactions: int
        _words: int
        _arena: Arena
        _index: CuckooIndex
        _expiry: ExpiryLayers
        _clock_policy: ClockReclaimer
        _clock: Callable[[], float]
        _evict: bool
        _compact_threshold: float

    def _expire(self) -> int:
        now = self._clock()
        due = self._expiry.pop_due(now)
        if not due:
            return 0
        pairs = sorted(set(due))
        keys = [k for k, _ in pairs]
        deadlines = np.array([d for _, d in pairs])
        rows = np.array(
            [[(k >> (64 * j)) & _M64 for j in range(self._words)] for k in keys], dtype=np.uint64
        )
        locs, pos = self._index.positions(rows)
        found = np.flatnonzero(pos != ABSENT)
        current = self._arena.deadlines_at(locs[found])
        dead = found[(current == deadlines[found]) & (current <= now)]
        self._index.delete_at(pos[dead])
        self._arena.free_many(locs[dead])
        self.expirations += int(dead.size)
        return int(dead.size)

    def _compact(self) -> int:
        pos, locs = self._index.entries()
        new = self._arena.compact(locs)
        self._index.set_locations(pos, new)
        self.compactions += 1
        return self._arena.moved_bytes

    def _should_compact(self) -> bool:
        a = self._arena
        reserved = a.reserved_bytes
        if 2 * reserved < a.capacity_bytes:
            return False
        # held records and the slabs pinned at the last compaction cannot be packed
        return (reserved - a.live_bytes - a.settled_waste) / reserved > self._compact_threshold

    def _allocate(self, value_len: int) -> int:
        """A record location, making room as the module docstring says."""
        if self._should_compact():
            self._compact()
        arena = self._arena
        try:
            return arena.alloc(value_len)
        except CapacityError:
            pass
        need = arena.record_size(value_len)
        if self._expire():
            try:
                return arena.alloc(value_len)
            except CapacityError:
                pass
        if arena.free_bytes >= need and arena.waste > 0:
            self._compact()
            try:
                return arena.alloc(value_len)
            except CapacityError:
                pass
        if not self._evict:
            raise CapacityError(
                f"arena full: {need} bytes wanted, {arena.free_bytes} free in pieces; "
                "nothing was evicted (evict=False)"
            )
        batch = max(need, arena.capacity_bytes // 64)
        while True:
            if not self._evict_entries(0, batch):
                raise CapacityError(
                    f"arena cannot hold a {need}-byte record even when empty "
                    f"({arena.held_bytes} bytes held for views still alive)"
                )
            try:
                return arena.alloc(value_len)
            except CapacityError:
                pass
            if arena.free_bytes >= need:
                self._compact()
                try:
                    return arena.alloc(value_len)
                except CapacityError:
                    pass  # free space is in slab tails too small for it: evict more

    def _allocate_many(self, lens: I64, n: int) -> I64 | None:
        """Locations for a batch, or None when only eviction could make room."""
        if self._should_compact():
            self._compact()
        if self._evict and len(self._index) + n > self.max_entries:
            return None
        for attempt in range(3):
            try:
                return self._arena.alloc_many(lens)
            except CapacityError:
                if attempt == 0:
                    self._expire()
                elif attempt == 1 and self._arena.waste > 0:
                    self._compact()
        if self._evict:
            return None
        raise CapacityError(f"arena cannot hold the batch of {n} records; nothing was stored")

    def _evict_entries(self, count: int, nbytes: int) -> int:
        """Evicts with CLOCK until ``count`` entries are gone and ``nbytes`` bytes are
        reusable (pinned records free nothing yet), or the index is empty. Returns
        entries evicted."""
        evicted = freed = 0
        arena, index = self._arena, self._index
        while (evicted < count or freed < nbytes) and len(index):
            avg = max(1, arena.live_bytes // max(1, arena.live_records))
            want = max(count - evicted, -(-(nbytes - freed) // avg), 1)
            pos = self._clock_policy.select(want)
            if pos.size == 0:
                pos = self._clock_policy.select(want)  # bits are clear after a full turn
            if pos.size == 0:
                pos, _ = index.entries()  # only the stash is left
            freed += arena.free_many(index.delete_at(pos))
            evicted += int(pos.size)
        self.evictions += evicted
        return evicted

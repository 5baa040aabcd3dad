"""Free space of one storage pool, as the master sees it: an offset allocator.

The master never holds value bytes, so it cannot use :class:`kvstore.arena.Arena` (which
owns its buffer and writes record headers into it). It only needs to know which byte
ranges of a node's registered segment are free. Free extents are kept in two dicts
(start -> size, end -> start) for coalescing on free, and in power-of-two size classes
for allocation. Memory is proportional to the number of *free* extents, not to the
objects stored: an allocated extent is remembered only by the object that holds it.

Sizes are rounded up to ``align`` bytes (64 by default: values start on a cache line).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgumentError

__all__ = ["Space"]

_SCAN = 8  # extents of the exact class looked at before moving one class up


class Space:
    """Offsets in ``[0, capacity)`` handed out and taken back.

    Parameters:
        capacity: bytes of the pool (rounded down to ``align``).
        align: allocation granularity in bytes, a power of two.
    """

    def __init__(self, capacity: int, *, align: int = 64) -> None:
        if align <= 0 or align & (align - 1):
            raise InvalidArgumentError(f"align must be a power of two, not {align}")
        if capacity < align:
            raise InvalidArgumentError(f"capacity {capacity} is below one unit of {align}")
        self.align = align
        self.capacity = capacity - capacity % align
        self._start: dict[int, int] = {}  # free extent start -> size
        self._end: dict[int, int] = {}  # free extent end -> start
        self._classes: list[set[int]] = [set() for _ in range(self.capacity.bit_length() + 1)]
        self.free_bytes = 0
        self._add(0, self.capacity)

    @classmethod
    def from_used(
        cls,
        capacity: int,
        offsets: npt.ArrayLike,
        sizes: npt.ArrayLike,
        *,
        align: int = 64,
    ) -> Space:
        """A pool whose only used ranges are ``(offsets[i], sizes[i])`` (rounded up to
        ``align``), as a restarted master learns them from a node. Overlapping or
        out-of-range entries raise :class:`InvalidArgumentError`."""
        space = cls(capacity, align=align)
        off = np.asarray(offsets, dtype=np.int64)
        size = np.asarray(sizes, dtype=np.int64)
        if off.size == 0:
            return space
        if (off < 0).any() or (size < 0).any() or (off > space.capacity - size).any():
            raise InvalidArgumentError("used ranges overlap or leave the pool")
        size = space.round(size)  # within the pool: no overflow
        order = np.argsort(off, kind="stable")
        off, size = off[order], size[order]
        end = off + size
        if off[0] < 0 or end[-1] > space.capacity or (off[1:] < end[:-1]).any():
            raise InvalidArgumentError("used ranges overlap or leave the pool")
        space._remove(0)
        space.free_bytes = 0
        starts = np.concatenate(([0], end))
        stops = np.concatenate((off, [space.capacity]))
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            if b > a:
                space._add(a, b - a)
        return space

    def round(self, size: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``size`` rounded up to the allocation unit (at least one unit)."""
        a = self.align
        out: npt.NDArray[np.int64] = np.maximum((size + a - 1) & ~np.int64(a - 1), a)
        return out

    def unit(self, size: int) -> int:
        a = self.align
        return max((size + a - 1) & ~(a - 1), a)

    def __repr__(self) -> str:
        return (f"<Space free={self.free_bytes}/{self.capacity} "
                f"extents={len(self._start)}>")

    @property
    def extents(self) -> int:
        return len(self._start)

    def largest(self) -> int:
        """Size of the largest free extent (0 when full)."""
        for c in range(len(self._classes) - 1, -1, -1):
            if self._classes[c]:
                return max(self._start[s] for s in self._classes[c])
        return 0

    def _add(self, start: int, size: int) -> None:
        self._start[start] = size
        self._end[start + size] = start
        self._classes[size.bit_length() - 1].add(start)
        self.free_bytes += size

    def _remove(self, start: int) -> int:
        size = self._start.pop(start)
        del self._end[start + size]
        self._classes[size.bit_length() - 1].discard(start)
        self.free_bytes -= size
        return size

    def alloc(self, size: int) -> int:
        """Offset of a free range of ``size`` bytes (rounded up), or -1 when no free
        extent is large enough."""
        need = self.unit(size)
        c = need.bit_length() - 1
        classes = self._classes
        found = -1
        if classes[c]:
            for i, start in enumerate(classes[c]):
                if self._start[start] >= need:
                    found = start
                    break
                if i >= _SCAN:
                    break
        if found < 0:
            for k in range(c + 1, len(classes)):
                if classes[k]:
                    found = next(iter(classes[k]))
                    break
        if found < 0:
            return -1
        have = self._remove(found)
        if have > need:
            self._add(found + need, have - need)
        return found

    def free(self, start: int, size: int) -> None:
        """Returns ``[start, start + unit(size))``, merging it with free neighbours."""
        size = self.unit(size)
        if start in self._start or start < 0 or start + size > self.capacity:
            raise InvalidArgumentError(f"bad free of [{start}, {start + size})")
        before = self._end.get(start)
        if before is not None:
            size += start - before
            self._remove(before)
            start = before
        after = self._start.get(start + size)
        if after is not None:
            self._remove(start + size)
            size += after
        self._add(start, size)

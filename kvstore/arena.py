"""Slab arena: records (key, length, deadline, value) packed into large slabs.

Record layout, 8-byte aligned, ``W`` = key words (1 or 2)::

    u64 key[W] | u64 value_len | f64 deadline (inf: none) | value bytes | pad to 8

The key sits in the record (key-in-value), so the index keeps only a tag and a location,
and a record can be identified from memory alone. A location is the record's byte offset
in the arena; ``offset // slab_bytes`` is its slab.

Memory is one reservation (``numpy.zeros``: the OS backs pages only when they are first
written) cut into ``slab_bytes`` slabs. One reservation is what makes confirmation
vectorised: the keys of any set of locations are one gather from a ``uint64`` view. Each
slab (or the whole arena) is a plain writable buffer the engine can register as a segment.

Allocation is exact (8-byte granularity) from *free extents kept in size classes*
(segregated fit: exact classes of 8 bytes below 1 KiB, then 8 classes per power of two),
with boundary coalescing on free. A request takes the smallest class that is sure to fit,
and only opens a new slab when no extent fits, so holes are reused before memory grows.
We chose this over memcached-style slot classes (one record size per slab): there,
rounding up to a class and the partly filled slab of every class cost 10-15% with mixed
value sizes (Mooncake reports ~85% utilisation), while here waste is only alignment and
holes, and holes are what compaction removes.

``waste`` = (bytes in slabs in use - live record bytes) / bytes in slabs in use; alignment
padding counts as waste. Compaction slides every live record towards the start of the
arena in address order (a record never moves right, so moves within one buffer are safe)
and returns the new locations; the caller updates the index. Afterwards the only holes are
slab tails that could not take the next record.

Zero-copy views handed out by :meth:`value_view` point into the arena: they are valid
until that record is freed or the arena is compacted. A caller that hands views out and
cannot tell when they are dropped *pins* their records (:meth:`pin`): freeing a pinned
record only retires it (its bytes are *held*, neither live nor reusable) until the last
pin goes (:meth:`unpin`), and compaction moves no record of a slab that holds a pinned one
(the other slabs are packed as usual, around it). So a pinned view never shows another
record's bytes.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np
import numpy.typing as npt

from kvstore.errors import CapacityError, InvalidArgumentError, StoreError, ValueTooLargeError

__all__ = ["Arena"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]

_EXACT_LIMIT = 1024  # exact 8-byte classes below this
_SUB = 3  # 2**_SUB classes per power of two above it


def _size_class(size: int) -> int:
    if size < _EXACT_LIMIT:
        return size >> 3
    fl = size.bit_length() - 1
    return (
        (_EXACT_LIMIT >> 3) + (fl - 10) * (1 << _SUB) + ((size >> (fl - _SUB)) & ((1 << _SUB) - 1))
    )


def _class_floor(cls: int) -> int:
    """Smallest size in class ``cls``."""
    if cls < _EXACT_LIMIT >> 3:
        return cls << 3
    rel = cls - (_EXACT_LIMIT >> 3)
    fl = 10 + (rel >> _SUB)
    return (1 << fl) + ((rel & ((1 << _SUB) - 1)) << (fl - _SUB))


class Arena:
    """Slab memory for records.

    Parameters:
        capacity_bytes: total memory, rounded down to whole slabs (at least one).
        slab_bytes: bytes per slab, a multiple of 8; also the largest record.
        key_words: 1 for 64-bit keys, 2 for 128-bit keys.
    """

    def __init__(
        self, capacity_bytes: int, *, slab_bytes: int = 1 << 20, key_words: int = 1
    ) -> None:
        if key_words not in (1, 2):
            raise InvalidArgumentError(f"key_words must be 1 or 2, not {key_words}")
        self.key_words = key_words
        self.header_bytes = 8 * (key_words + 2)
        if slab_bytes % 8 or slab_bytes < self.header_bytes + 8:
            raise InvalidArgumentError(
                f"slab_bytes must be a multiple of 8 >= 64, not {slab_bytes}"
            )
        if capacity_bytes < slab_bytes:
            raise InvalidArgumentError(
                f"capacity_bytes ({capacity_bytes}) is smaller than one slab ({slab_bytes})"
            )
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        self.buffer = np.zeros(self.capacity_bytes, dtype=np.uint8)
        self._u64: U64 = self.buffer.view(np.uint64)
        self._f64: F64 = self.buffer.view(np.float64)
        self._mv = memoryview(self.buffer)  # type: ignore[arg-type]
        self._nclasses = _size_class(slab_bytes) + 1
        self._classes: list[set[int]] = [set() for _ in range(self._nclasses)]
        self._nonempty = 0  # bit c set: class c holds a free extent
        self._hole_size: dict[int, int] = {}
        self._hole_end: dict[int, int] = {}
        self._free_slabs = list(range(self.num_slabs))  # a heap: low slabs first
        self.live_bytes = 0
        self.live_records = 0
        self.moved_bytes = 0  # by the last compaction
        self._tokens = itertools.count()
        self._pending: dict[int, I64] = {}  # pin token -> locations, not counted yet
        self._counted: dict[int, I64] = {}  # pin token -> locations counted in _pins
        self._pins: dict[int, int] = {}  # location -> pins counted and not released
        self._held: dict[int, int] = {}  # freed while pinned: location -> record size
        self.held_bytes = 0
        self.settled_waste = 0  # not-live bytes a compaction with pins could not remove

    # -- accounting --------------------------------------------------------------------

    def record_size(self, value_len: int) -> int:
        """Bytes a record with a value of ``value_len`` bytes occupies (aligned)."""
        return (self.header_bytes + value_len + 7) & ~7

    @property
    def max_value_bytes(self) -> int:
        return self.slab_bytes - self.header_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes in slabs that hold at least one record."""
        return (self.num_slabs - len(self._free_slabs)) * self.slab_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes + sum(self._hole_size.values())

    @property
    def waste(self) -> float:
        """Reserved but not live, over reserved (0.0 when nothing is reserved)."""
        reserved = self.reserved_bytes
        return (reserved - self.live_bytes) / reserved if reserved else 0.0

    def __repr__(self) -> str:
        return (
            f"<Arena {self.reserved_bytes >> 20}/{self.capacity_bytes >> 20} MiB "
            f"slabs={self.num_slabs} records={self.live_records} waste={self.waste:.1%}>"
        )

    def slabs(self) -> list[npt.NDArray[np.uint8]]:
        """Every slab as a writable buffer (for registration as engine segments)."""
        sb = self.slab_bytes
        return [self.buffer[i * sb : (i + 1) * sb] for i in range(self.num_slabs)]

    # -- free extents ------------------------------------------------------------------

    def _add_extent(self, start: int, size: int) -> None:
        self._hole_size[start] = size
        self._hole_end[start + size] = start
        cls = _size_class(size)
        self._classes[cls].add(start)
        self._nonempty |= 1 << cls

    def _remove_extent(self, start: int) -> int:
        size = self._hole_size.pop(start)
        del self._hole_end[start + size]
        cls = _size_class(size)
        bucket = self._classes[cls]
        bucket.discard(start)
        if not bucket:
            self._nonempty &= ~(1 << cls)
        return size

    def _release(self, start: int, size: int) -> None:
        """Returns ``[start, start+size)`` to the free extents, merging neighbours within
        the slab; a slab that becomes wholly free goes back to the slab heap."""
        sb = self.slab_bytes
        end = start + size
        if start % sb and start in self._hole_end:
            left = self._hole_end[start]
            self._remove_extent(left)
            start = left
        if end % sb and end in self._hole_size:
            end += self._remove_extent(end)
        if start % sb == 0 and end - start == sb:
            heapq.heappush(self._free_slabs, start // sb)
        else:
            self._add_extent(start, end - start)

    def _take(self, need: int) -> int:
        """Start of ``need`` free bytes; raises :class:`CapacityError` (nothing changed)."""
        cls = _size_class(need)
        first = cls if _class_floor(cls) == need else cls + 1
        avail = self._nonempty >> first
        if avail:
            c = first + (avail & -avail).bit_length() - 1
            start = next(iter(self._classes[c]))
        else:
            start = -1
            for s in itertools.islice(self._classes[cls], 16):  # bounded good-fit probe
                if self._hole_size[s] >= need:
                    start = s
                    break
            if start < 0:
                if not self._free_slabs:
                    raise CapacityError(
                        f"arena full: no free extent of {need} bytes "
                        f"(live {self.live_bytes} of {self.capacity_bytes} bytes, "
                        f"waste {self.waste:.1%})"
                    )
                s = heapq.heappop(self._free_slabs) * self.slab_bytes
                self._add_extent(s, self.slab_bytes)
                start = s
        size = self._remove_extent(start)
        if size > need:
            self._add_extent(start + need, size - need)
        return start

    # -- allocation --------------------------------------------------------------------

    def check_value_len(self, value_len: int) -> None:
        if value_len > self.max_value_bytes:
            raise ValueTooLargeError(
                f"value of {value_len} bytes does not fit in a slab "
                f"({self.max_value_bytes} bytes of value at most)"
            )

    def alloc(self, value_len: int) -> int:
        """Location of a new record for a value of ``value_len`` bytes; its length field
        is set, the rest is the caller's to :meth:`write`."""
        self.check_value_len(value_len)
        loc = self._take(self.record_size(value_len))
        self._u64[(loc >> 3) + self.key_words] = value_len
        self.live_bytes += self.header_bytes + value_len
        self.live_records += 1
        return loc

    def alloc_many(self, value_lens: npt.ArrayLike) -> I64:
        """Locations for many records, all or nothing: on :class:`CapacityError` the
        arena is unchanged. Whole free slabs are filled back to back (vectorised); the
        rest comes from free extents one by one."""
        lens = np.asarray(value_lens, dtype=np.int64).reshape(-1)
        if lens.size and int(lens.max()) > self.max_value_bytes:
            self.check_value_len(int(lens.max()))
        if lens.size and int(lens.min()) < 0:
            raise InvalidArgumentError("value lengths must be >= 0")
        sizes = (self.header_bytes + lens + 7) & ~7
        n = lens.size
        locs = np.empty(n, dtype=np.int64)
        sb = self.slab_bytes
        window = sb // (self.header_bytes + 8) + 1
        i = 0
        try:
            while i < n and self._free_slabs:
                if self._nonempty and n - i < window:
                    break  # a short tail goes into existing holes first
                base = heapq.heappop(self._free_slabs) * sb
                chunk = sizes[i : i + window]
                cs = np.cumsum(chunk)
                k = int(np.searchsorted(cs, sb, side="right"))
                locs[i : i + k] = base + cs[:k] - chunk[:k]
                used = int(cs[k - 1])
                if used < sb:
                    self._add_extent(base + used, sb - used)
                i += k
            while i < n:
                locs[i] = self._take(int(sizes[i]))
                i += 1
        except CapacityError:
            for j in range(i - 1, -1, -1):
                self._release(int(locs[j]), int(sizes[j]))
            raise
        self._u64[(locs >> 3) + self.key_words] = lens.astype(np.uint64)
        self.live_bytes += int(lens.sum()) + self.header_bytes * n
        self.live_records += n
        return locs

    def free(self, loc: int) -> int:
        """Frees the record at ``loc``; returns the bytes made reusable (0 while it is
        pinned: it is held until :meth:`unpin` releases the last pin)."""
        value_len = int(self._u64[(loc >> 3) + self.key_words])
        self.live_bytes -= self.header_bytes + value_len
        self.live_records -= 1
        size = self.record_size(value_len)
        if self._pending:
            self._count_pins()
        if loc in self._pins:
            self._held[loc] = size
            self.held_bytes += size
            return 0
        self._release(loc, size)
        return size

    def free_many(self, locs: npt.ArrayLike) -> int:
        """:meth:`free` of each location; returns the bytes made reusable."""
        return sum(self.free(loc) for loc in np.asarray(locs, dtype=np.int64).reshape(-1).tolist())

    # -- pins --------------------------------------------------------------------------

    def pin(self, locs: I64) -> int:
        """Keeps the records at ``locs`` (live ones; repeats allowed) in place, bytes and
        location, until :meth:`unpin` of the returned token.

        Counting is lazy: a pin only costs a dict entry until something is freed while it
        is held, so pins that come and go between frees (a read loop) stay O(1)."""
        token = next(self._tokens)
        self._pending[token] = locs
        return token

    def unpin(self, token: int) -> None:
        """Drops the pins of :meth:`pin`'s ``token``; a held record whose last pin goes is
        released."""
        # still pending: nothing was freed while it was held, so nothing to count down
        pending = self._pending.pop(token, None) is not None
        locs = None if pending else self._counted.pop(token, None)
        pins, held = self._pins, self._held
        for loc in () if locs is None else locs.tolist():
            left = pins[loc] - 1
            if left > 0:
                pins[loc] = left
                continue
            del pins[loc]
            size = held.pop(loc, 0)
            if size:
                self.held_bytes -= size
                self._release(loc, size)
        if not pins and not self._pending:
            self.settled_waste = 0

    def _count_pins(self) -> None:
        """Counts the pins not counted yet into ``_pins`` (location -> pins)."""
        pins = self._pins
        for token, locs in self._pending.items():
            for loc in locs.tolist():
                pins[loc] = pins.get(loc, 0) + 1
            self._counted[token] = locs
        self._pending.clear()

    def verify(self, locs: I64) -> None:
        """Raises :class:`StoreError` unless ``locs`` are exactly the live records and
        live records, held records and free extents tile the reserved slabs: no overlap,
        no record across a slab boundary, no byte unaccounted for."""
        sb = self.slab_bytes
        self._count_pins()

        def fail(what: str) -> None:
            raise StoreError(f"arena inconsistent: {what}")

        if locs.size != self.live_records:
            fail(f"{locs.size} records given, {self.live_records} live")
        lens = self.lengths_at(locs)
        if int((self.header_bytes + lens).sum()) != self.live_bytes:
            fail("live_bytes does not match the live records")
        held = np.array(sorted(self._held), dtype=np.int64)
        if np.isin(held, locs).any():
            fail("a held record is also live")
        held_sizes = np.array([self._held[x] for x in held.tolist()], dtype=np.int64)
        if int(held_sizes.sum()) != self.held_bytes:
            fail("held_bytes does not match the held records")
        holes = np.array(sorted(self._hole_size.items()), dtype=np.int64).reshape(-1, 2)
        starts = np.concatenate((locs, held, holes[:, 0]))
        sizes = (self.header_bytes + lens + 7) & ~7
        ends = starts + np.concatenate((sizes, held_sizes, holes[:, 1]))
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        if (ends[:-1] > starts[1:]).any():
            fail("records or free extents overlap")
        if (starts // sb != (ends - 1) // sb).any():
            fail("a record or free extent crosses a slab boundary")
        if int((ends - starts).sum()) != self.reserved_bytes:
            fail("live, held and free bytes do not add up to the reserved slabs")
        if set(self._free_slabs) & set((starts // sb).tolist()):
            fail("a free slab holds records or extents")

    # -- record access -----------------------------------------------------------------

    def write(self, loc: int, key: U64, value: memoryview, deadline: float = math.inf) -> None:
        """Fills the record at ``loc`` (allocated for ``len(value)`` bytes)."""
        w = loc >> 3
        self._u64[w : w + self.key_words] = key
        self._f64[w + self.key_words + 1] = deadline
        start = loc + self.header_bytes
        self._mv[start : start + value.nbytes] = value

    def write_many(
        self, locs: I64, keys: U64, values: npt.NDArray[np.uint8], deadlines: F64
    ) -> None:
        """Vectorised :meth:`write` of equal-length values (``values`` is ``uint8[n, L]``)."""
        w = locs >> 3
        for j in range(self.key_words):
            self._u64[w + j] = keys[:, j]
        self._f64[w + self.key_words + 1] = deadlines
        length = values.shape[1]
        if length:
            if length % 8 == 0:
                words = np.ascontiguousarray(values).view(np.uint64)
                idx = (w + self.key_words + 2)[:, None] + np.arange(length // 8)
                self._u64[idx] = words
            else:
                idx = (locs + self.header_bytes)[:, None] + np.arange(length)
                self.buffer[idx] = values

    def keys_at(self, locs: I64) -> U64:
        """Keys of the records at ``locs`` as ``uint64[n, key_words]``."""
        w = locs >> 3
        if self.key_words == 1:
            return np.take(self._u64, w)[:, None]
        return np.take(self._u64, w[:, None] + np.arange(self.key_words))

    def lengths_at(self, locs: I64) -> I64:
        return np.take(self._u64, (locs >> 3) + self.key_words).astype(np.int64)

    def deadlines_at(self, locs: I64) -> F64:
        return np.take(self._f64, (locs >> 3) + self.key_words + 1)

    def set_deadline(self, loc: int, deadline: float) -> None:
        self._f64[(loc >> 3) + self.key_words + 1] = deadline

    def value_span(self, loc: int) -> tuple[int, int]:
        """Start and end offsets in :attr:`buffer` of the value at ``loc``."""
        start = loc + self.header_bytes
        return start, start + int(self._u64[(loc >> 3) + self.key_words])

    def value_view(self, loc: int) -> memoryview:
        """Read-only zero-copy view of the value at ``loc``."""
        n = int(self._u64[(loc >> 3) + self.key_words])
        start = loc + self.header_bytes
        return self._mv[start : start + n].toreadonly()

    # -- compaction --------------------------------------------------------------------

    def compact(self, locs: npt.ArrayLike) -> I64:
        """Packs the live records ``locs`` (every live record, in any order) towards the
        start of the arena; returns their new locations in the same order. All other
        space becomes free. Views into the arena are invalid afterwards, except those of
        pinned records: a slab holding a pinned record keeps every record and hole where
        they are, and the other slabs are packed around it."""
        src_all = np.asarray(locs, dtype=np.int64).reshape(-1)
        if src_all.size != self.live_records:
            raise InvalidArgumentError(
                f"compact needs every live record: got {src_all.size}, "
                f"arena holds {self.live_records}"
            )
        sb = self.slab_bytes
        self._count_pins()
        pinned = np.unique(np.fromiter(self._pins, dtype=np.int64, count=len(self._pins)) // sb)
        movable = np.setdiff1d(np.arange(self.num_slabs, dtype=np.int64), pinned)
        moves = np.flatnonzero(~np.isin(src_all // sb, pinned)) if pinned.size else None
        src_sel = src_all if moves is None else src_all[moves]
        order = np.argsort(src_sel, kind="stable")
        src = src_sel[order]
        sizes = (self.header_bytes + self.lengths_at(src) + 7) & ~7
        n = src.size
        dst = np.empty(n, dtype=np.int64)
        window = sb // (self.header_bytes + 8) + 1
        tails: list[tuple[int, int]] = []
        # Packing in the order of the movable slabs: a record never moves right, so the
        # moves are safe within one buffer, and pinned slabs are never written.
        i = slab = 0
        while i < n:
            base = int(movable[slab]) * sb
            chunk = sizes[i : i + window]
            cs = np.cumsum(chunk)
            k = int(np.searchsorted(cs, sb, side="right"))
            dst[i : i + k] = base + cs[:k] - chunk[:k]
            tails.append((base + int(cs[k - 1]), sb - int(cs[k - 1])))
            i += k
            slab += 1
        self.moved_bytes = self._move_runs(src, dst, sizes)
        fixed = set(pinned.tolist())
        kept = [(s, z) for s, z in self._hole_size.items() if s // sb in fixed]
        self._hole_size.clear()
        self._hole_end.clear()
        for bucket in self._classes:
            bucket.clear()
        self._nonempty = 0
        for start, size in kept + tails:
            if size:
                self._add_extent(start, size)
        self._free_slabs = movable[slab:].tolist()  # ascending: a valid heap
        out = src_all.copy()
        if moves is None:
            out[order] = dst
        else:
            out[moves[order]] = dst
        self.settled_waste = self.reserved_bytes - self.live_bytes if pinned.size else 0
        return out

    def _move_runs(self, src: I64, dst: I64, sizes: I64) -> int:
        """Copies records in ascending order, one copy per run of records that are
        adjacent and shift by the same amount. Returns bytes moved."""
        moving = src != dst
        if not moving.any():
            return 0
        shift = src - dst
        brk = np.ones(src.size, dtype=bool)
        brk[1:] = (shift[1:] != shift[:-1]) | (src[1:] != src[:-1] + sizes[:-1])
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], src.size)
        moved = 0
        buf = self.buffer
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            if not moving[a]:
                continue
            s0 = int(src[a])
            d0 = int(dst[a])
            length = int(src[b - 1] + sizes[b - 1]) - s0
            buf[d0 : d0 + length] = buf[s0 : s0 + length]  # numpy copes with overlap
            moved += length
        return moved

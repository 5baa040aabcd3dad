"""KVStore: the facade over index, arena and expiry.

Keys are 64-bit (``key_bytes=8``) or 128-bit (``key_bytes=16``) block hashes, given as an
``int``, as ``bytes`` of exactly ``key_bytes`` (little-endian), or, for batches, as a
``uint64`` array of shape ``(n,)`` / ``(n, 2)`` (low word first). Values are any
contiguous bytes-like object; reads return read-only zero-copy ``memoryview``s of the
arena.

A view stays valid until the next call that mutates the store (put, delete, expire,
compact, or a put that evicts or compacts to make room); copy it (``bytes(view)``) to keep
it longer. Every argument is checked before anything is touched, so a rejected call
leaves the store unchanged.

When memory runs short a put first sweeps expired entries, then compacts if that makes
room, and then (``evict=True``) evicts with CLOCK; with ``evict=False`` it raises
:class:`CapacityError` instead and nothing stored is lost. The store is single-threaded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.arena import Arena
from kvstore.errors import (
    CapacityError,
    InvalidArgumentError,
    KeyFormatError,
    StoreClosedError,
)
from kvstore.index import ABSENT, CuckooIndex
from kvstore.ttl import ClockReclaimer, ExpiryLayers
from transfer_engine.closeable import Closeable

__all__ = ["KVStore", "StoreStats"]

Key = int | bytes | bytearray | np.integer[Any]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
_M64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int
    load_factor: float
    live_bytes: int
    reserved_bytes: int
    capacity_bytes: int
    waste: float
    evictions: int
    expirations: int
    compactions: int


class KVStore(Closeable):
    """In-memory KV block store.

    Parameters:
        capacity_bytes: arena memory in bytes (rounded down to whole slabs).
        max_entries: entry budget; the index is sized for it at <= 90% load, and with
            ``evict=True`` a put of a new key beyond it evicts. Default: one entry per
            256 bytes of capacity (at least 1024).
        slab_bytes: slab size in bytes; a value plus its 24/32-byte header must fit.
        key_bytes: 8 or 16.
        default_ttl: seconds an entry lives when ``put`` gets no ``ttl``; None: forever.
        ttl_granularity: width in seconds of an expiry layer.
        evict: make room by CLOCK eviction when memory or the entry budget runs out.
        compact_threshold: a put compacts first when more than this fraction of the
            reserved arena is not live (and the arena is at least half reserved).
        clock: seconds, monotonic; inject a fake one in tests.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_entries: int | None = None,
        slab_bytes: int = 1 << 20,
        key_bytes: int = 8,
        default_ttl: float | None = None,
        ttl_granularity: float = 1.0,
        evict: bool = True,
        compact_threshold: float = 0.04,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if key_bytes not in (8, 16):
            raise KeyFormatError(f"key_bytes must be 8 or 16, not {key_bytes!r}")
        self._closed = True  # until fully built, so __del__ stays quiet
        self.key_bytes = key_bytes
        self._words = key_bytes // 8
        self._default_ttl = None if default_ttl is None else _check_ttl(default_ttl)
        self._arena = Arena(capacity_bytes, slab_bytes=slab_bytes, key_words=self._words)
        self.max_entries = max(1024, capacity_bytes // 256) if max_entries is None else max_entries
        if self.max_entries < 1:
            raise InvalidArgumentError(f"max_entries must be >= 1, not {max_entries}")
        self._index = CuckooIndex.for_capacity(
            self.max_entries, self._arena.keys_at, key_words=self._words
        )
        self._expiry = ExpiryLayers(ttl_granularity)
        self._clock_policy = ClockReclaimer(self._index)
        self._evict = evict
        self._compact_threshold = compact_threshold
        self._clock = clock
        self.evictions = self.expirations = self.compactions = 0
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Drops every entry and the arena. Idempotent. Views handed out keep their own
        bytes alive but must not be used as store data any more."""
        if self._closed:
            return
        self._closed = True
        self._expiry.clear()
        self._index.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def __repr__(self) -> str:
        if self._closed:
            return "<KVStore CLOSED>"
        a = self._arena
        return (
            f"<KVStore entries={len(self._index)} load={self._index.load_factor:.2f} "
            f"arena={a.reserved_bytes / 2**20:.1f}/{a.capacity_bytes / 2**20:.1f}MiB "
            f"waste={a.waste:.1%} OPEN>"
        )

    def __len__(self) -> int:
        """Entries held, including expired ones not yet swept."""
        return len(self._index)

    # -- argument checks ---------------------------------------------------------------

    def _key_row(self, key: object) -> U64:
        w = self._words
        if isinstance(key, bool):
            raise KeyFormatError("a key cannot be a bool")
        if isinstance(key, int | np.integer):
            k = int(key)
            if not 0 <= k < 1 << (64 * w):
                raise KeyFormatError(f"key {k} does not fit in {self.key_bytes} unsigned bytes")
            return np.array([[(k >> (64 * j)) & _M64 for j in range(w)]], dtype=np.uint64)
        if isinstance(key, bytes | bytearray):
            if len(key) != self.key_bytes:
                raise KeyFormatError(f"key must be {self.key_bytes} bytes, not {len(key)}")
            return np.frombuffer(bytes(key), dtype="<u8").astype(np.uint64).reshape(1, w)
        raise KeyFormatError(f"a key must be int or bytes, not {type(key).__name__}")

    def _key_rows(self, keys: object) -> U64:
        if isinstance(keys, np.ndarray):
            return self._index.check_keys(keys)
        if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Iterable):
            raise KeyFormatError("keys must be a uint64 array or a sequence of keys")
        rows = [self._key_row(k) for k in keys]
        if not rows:
            return np.zeros((0, self._words), dtype=np.uint64)
        return np.concatenate(rows)

    def _key_ints(self, rows: U64) -> list[int]:
        if self._words == 1:
            return [int(x) for x in rows[:, 0].tolist()]
        return [int(a) | int(b) << 64 for a, b in rows.tolist()]

    def _deadline(self, ttl: float | None) -> float:
        ttl = self._default_ttl if ttl is None else _check_ttl(ttl)
        return math.inf if ttl is None else self._clock() + ttl

    # -- writes ------------------------------------------------------------------------

    def put(self, key: Key, value: Any, ttl: float | None = None) -> None:
        """Stores ``value`` (bytes-like) under ``key``, replacing any old value.

        ``ttl``: seconds until the entry expires (> 0); None uses ``default_ttl``.
        Raises :class:`KeyFormatError`, :class:`ValueTooLargeError`,
        :class:`InvalidArgumentError` (store unchanged) or :class:`CapacityError`.
        """
        self._check_open()
        row = self._key_row(key)
        view = _as_view(value)
        self._arena.check_value_len(view.nbytes)
        deadline = self._deadline(ttl)
        self._put_one(row, view, deadline)

    def _put_one(self, row: U64, view: memoryview, deadline: float) -> None:
        if self._evict and len(self._index) >= self.max_entries:
            if self._index.positions(row)[1][0] == ABSENT:
                self._evict_entries(1, 0)
        loc = self._allocate(view.nbytes)
        self._arena.write(loc, row[0], view, deadline)
        try:
            old = int(self._index.insert(row, np.array([loc]))[0])
        except CapacityError:
            self._arena.free(loc)
            raise
        if old >= 0:
            self._arena.free(old)
        if deadline != math.inf:
            self._expiry.add(self._key_ints(row)[0], deadline)

    def batch_put(self, keys: object, values: Any, ttl: float | None = None) -> None:
        """Stores many values. ``values`` is a sequence of bytes-like objects or a
        ``uint8[n, L]`` array (the fast path: one vectorised allocation and write).
        A later duplicate key wins. Arguments are checked first (store unchanged on a
        rejection); with ``evict=False`` a :class:`CapacityError` rolls back the batch.
        With ``evict=True`` a batch that needs eviction is stored entry by entry, and
        its own early entries may be evicted by later ones."""
        self._check_open()
        rows = self._key_rows(keys)
        n = rows.shape[0]
        matrix = isinstance(values, np.ndarray) and values.ndim == 2 and values.dtype == np.uint8
        if matrix:
            if values.shape[0] != n:
                raise InvalidArgumentError(f"{n} keys but {values.shape[0]} values")
            self._arena.check_value_len(values.shape[1])
            views: list[memoryview] = []
        else:
            if isinstance(values, str | bytes | bytearray | memoryview | np.ndarray):
                raise InvalidArgumentError("values must be a sequence of bytes-like or uint8[n, L]")
            views = [_as_view(v) for v in values]
            if len(views) != n:
                raise InvalidArgumentError(f"{n} keys but {len(views)} values")
            for v in views:
                self._arena.check_value_len(v.nbytes)
        deadline = self._deadline(ttl)
        if n == 0:
            return
        keep = _last_occurrences(rows)
        if keep is not None:
            rows = rows[keep]
            if matrix:
                values = values[keep]
            else:
                views = [views[i] for i in keep.tolist()]
            n = rows.shape[0]
        if not matrix:
            lens = np.array([v.nbytes for v in views], dtype=np.int64)
        else:
            lens = np.full(n, values.shape[1], dtype=np.int64)
        locs = self._allocate_many(lens, n)
        if locs is None:  # needs eviction: entry by entry
            for i in range(n):
                v = memoryview(values[i]) if matrix else views[i]
                self._put_one(rows[i : i + 1], v, deadline)
            return
        deadlines = np.full(n, deadline)
        if matrix:
            self._arena.write_many(locs, rows, values, deadlines)
        else:
            for i, v in enumerate(views):
                self._arena.write(int(locs[i]), rows[i], v, deadline)
        try:
            old = self._index.insert(rows, locs)
        except CapacityError:
            self._arena.free_many(locs)
            raise
        self._arena.free_many(old[old >= 0])
        if deadline != math.inf:
            for k in self._key_ints(rows):
                self._expiry.add(k, deadline)

    def delete(self, key: Key) -> bool:
        """Removes ``key``; True if a live (unexpired) entry was removed."""
        self._check_open()
        return bool(self._delete_rows(self._key_row(key))[0])

    def batch_delete(self, keys: object) -> npt.NDArray[np.bool_]:
        """Removes many keys; True where a live entry was removed."""
        self._check_open()
        rows = self._key_rows(keys)
        keep = _last_occurrences(rows)
        if keep is None:
            return self._delete_rows(rows)
        removed = self._delete_rows(rows[keep])
        out = np.zeros(rows.shape[0], dtype=bool)
        out[keep] = removed
        return out

    def _delete_rows(self, rows: U64) -> npt.NDArray[np.bool_]:
        locs = self._index.delete(rows)
        found = locs >= 0
        live = found.copy()
        if found.any():
            live[found] = self._arena.deadlines_at(locs[found]) > self._clock()
            self._arena.free_many(locs[found])
        return live

    # -- reads -------------------------------------------------------------------------

    def lookup(self, keys: object, *, touch: bool = True) -> I64:
        """Arena location of each key's record, -1 where absent or expired. Vectorised;
        this is what :meth:`batch_get` and the benchmark use. ``touch`` marks hits as
        recently used for CLOCK; probes (``contains``) do not."""
        self._check_open()
        locs = self._index.lookup(self._key_rows(keys), touch=touch)
        if not len(self._expiry):
            return locs  # every live entry with a deadline has one pending there
        hit = np.flatnonzero(locs >= 0)
        if hit.size:
            expired = self._arena.deadlines_at(locs[hit]) <= self._clock()
            if expired.any():
                locs[hit[expired]] = -1
        return locs

    def get(self, key: Key) -> memoryview | None:
        """Read-only view of the value, or None when absent or expired."""
        self._check_open()
        loc = int(self.lookup(self._key_row(key))[0])
        return None if loc < 0 else self._arena.value_view(loc)

    def batch_get(self, keys: object) -> list[memoryview | None]:
        """Read-only views (None where absent or expired), in the order of ``keys``."""
        locs = self.lookup(keys)
        view = self._arena.value_view
        return [None if loc < 0 else view(loc) for loc in locs.tolist()]

    def contains(self, key: Key) -> bool:
        """Whether ``key`` holds a live entry; does not count as a use for eviction."""
        return bool(self.lookup(self._key_row(key), touch=False)[0] >= 0)

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]

    def batch_contains(self, keys: object) -> npt.NDArray[np.bool_]:
        """Vectorised :meth:`contains`."""
        return self.lookup(keys, touch=False) >= 0

    # -- maintenance -------------------------------------------------------------------

    def expire(self) -> int:
        """Frees entries whose deadline has passed; returns how many. Costs work in
        proportion to what expires (see :mod:`kvstore.ttl`)."""
        self._check_open()
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

    def compact(self) -> int:
        """Packs live records to the front of the arena and repoints the index; returns
        bytes moved. Every value is preserved; views handed out earlier are invalid."""
        self._check_open()
        pos, locs = self._index.entries()
        new = self._arena.compact(locs)
        self._index.set_locations(pos, new)
        self.compactions += 1
        return self._arena.moved_bytes

    def stats(self) -> StoreStats:
        self._check_open()
        a = self._arena
        return StoreStats(
            entries=len(self._index),
            load_factor=self._index.load_factor,
            live_bytes=a.live_bytes,
            reserved_bytes=a.reserved_bytes,
            capacity_bytes=a.capacity_bytes,
            waste=a.waste,
            evictions=self.evictions,
            expirations=self.expirations,
            compactions=self.compactions,
        )

    def slabs(self) -> list[npt.NDArray[np.uint8]]:
        """The arena's slabs as writable buffers, to register with the engine."""
        self._check_open()
        return self._arena.slabs()

    @property
    def index(self) -> CuckooIndex:
        return self._index

    @property
    def arena(self) -> Arena:
        return self._arena

    # -- making room -------------------------------------------------------------------

    def _should_compact(self) -> bool:
        a = self._arena
        return a.waste > self._compact_threshold and 2 * a.reserved_bytes >= a.capacity_bytes

    def _allocate(self, value_len: int) -> int:
        """A record location, making room as the class docstring says."""
        if self._should_compact():
            self.compact()
        arena = self._arena
        try:
            return arena.alloc(value_len)
        except CapacityError:
            pass
        need = arena.record_size(value_len)
        if self.expire():
            try:
                return arena.alloc(value_len)
            except CapacityError:
                pass
        if arena.free_bytes >= need and arena.waste > 0:
            self.compact()
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
                raise CapacityError(f"arena cannot hold a {need}-byte record even when empty")
            try:
                return arena.alloc(value_len)
            except CapacityError:
                pass
            if arena.free_bytes >= need:
                self.compact()
                try:
                    return arena.alloc(value_len)
                except CapacityError:
                    pass  # free space is in slab tails too small for it: evict more

    def _allocate_many(self, lens: I64, n: int) -> I64 | None:
        """Locations for a batch, or None when only eviction could make room."""
        if self._should_compact():
            self.compact()
        if self._evict and len(self._index) + n > self.max_entries:
            return None
        for attempt in range(3):
            try:
                return self._arena.alloc_many(lens)
            except CapacityError:
                if attempt == 0:
                    self.expire()
                elif attempt == 1 and self._arena.waste > 0:
                    self.compact()
        if self._evict:
            return None
        raise CapacityError(f"arena cannot hold the batch of {n} records; nothing was stored")

    def _evict_entries(self, count: int, nbytes: int) -> int:
        """Evicts with CLOCK until ``count`` entries and ``nbytes`` bytes are freed, or
        the index is empty. Returns entries evicted."""
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
            locs = index.delete_at(pos)
            freed += int((arena.lengths_at(locs) + arena.header_bytes).sum())
            arena.free_many(locs)
            evicted += int(pos.size)
        self.evictions += evicted
        return evicted


def _check_ttl(ttl: object) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise InvalidArgumentError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise InvalidArgumentError(f"ttl must be finite and > 0 seconds, not {ttl}")
    return float(ttl)


def _as_view(value: object) -> memoryview:
    if isinstance(value, str) or value is None:
        raise InvalidArgumentError(f"a value must be bytes-like, not {type(value).__name__}")
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidArgumentError(
            f"a value must be bytes-like, not {type(value).__name__}"
        ) from exc
    if not view.c_contiguous:
        raise InvalidArgumentError("a value must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _last_occurrences(rows: U64) -> I64 | None:
    """Indices (ascending) of the last occurrence of each distinct key row, or None when
    all rows are distinct."""
    n = rows.shape[0]
    if n < 2:
        return None
    rev = rows[::-1]
    if rows.shape[1] == 1:
        _, first = np.unique(rev[:, 0], return_index=True)
    else:
        _, first = np.unique(rev, axis=0, return_index=True)
    if first.size == n:
        return None
    return np.sort(n - 1 - first)

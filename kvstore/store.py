"""KVStore: the facade over index, arena and expiry.

Keys are 64-bit (``key_bytes=8``) or 128-bit (``key_bytes=16``) block hashes, given as an
``int``, as ``bytes`` of exactly ``key_bytes`` (little-endian), or, for batches, as a
``uint64`` array of shape ``(n,)`` / ``(n, 2)`` (low word first). Values are any
contiguous bytes-like object; reads return read-only zero-copy ``memoryview``s of the
arena.

Views are pinned: the records a ``get``/``batch_get`` call returned views of stay where
they are, with their bytes, while any view of that call (or anything made from one: a
slice, ``memoryview(view)``, ``np.frombuffer(view)``) is alive. Deleting, overwriting,
expiring or evicting such a key removes it from the store at once, but its bytes are only
*held* (reported as ``StoreStats.held_bytes``) and become reusable when the views are
gone; compaction leaves a slab holding a pinned record as it is. So a view never shows
another key's bytes. Pins are per call: one view kept alive holds every record its call
returned; copy (``bytes(view)``) what you keep for long.

Every argument is checked before anything is touched (:mod:`kvstore.checks`), so a
rejected call raises a :class:`StoreError` subclass and leaves the store unchanged.

When memory runs short a put first sweeps expired entries, then compacts if that makes
room, and then (``evict=True``) evicts with CLOCK; with ``evict=False`` it raises
:class:`CapacityError` instead and nothing stored is lost (:mod:`kvstore.room`).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.arena import Arena
from kvstore.checks import (
    as_view,
    check_clock,
    check_ttl,
    int_arg,
    last_occurrences,
    real_arg,
)
from kvstore.errors import (
    CapacityError,
    InvalidArgumentError,
    KeyFormatError,
    StoreClosedError,
    StoreError,
)
from kvstore.index import ABSENT, CuckooIndex
from kvstore.room import Room
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
    held_bytes: int = 0
    """Bytes of removed entries kept for views still alive (counted in ``waste``)."""


class KVStore(Room, Closeable):
    """In-memory KV block store.

    Thread safety: one store may be shared by any number of threads. Every public method
    holds one re-entrant lock for its whole effect, so each call is atomic with respect to
    the others (argument checks and cutting the views of ``get``/``batch_get`` run
    outside it); calls do not run in parallel. Single-threaded the lock is one
    uncontended acquire per call, lost in the noise of ``python -m bench.kvstore_bench
    --keys 1000000`` (lookups of 4,096-key batches: 13.3-13.9 M/s before, 12.1-13.9 M/s
    with it, on a shared 2-core VM). Pinning views costs a few microseconds per call
    (``get`` of one key: ~64 -> ~72 us there), and ``batch_get`` got faster (2.4-2.5 M ->
    3.0-4.6 M keys/s) because its views are now cut from one base view. ``index``,
    ``arena`` and the locations from :meth:`lookup` are unlocked internals.

    Parameters:
        capacity_bytes: arena memory in bytes (rounded down to whole slabs).
        max_entries: entry budget; the index is sized for it at <= 90% load, and with
            ``evict=True`` a put of a new key beyond it evicts. Default: one entry per
            256 bytes of capacity (at least 1024). At most what the arena can hold of
            empty values.
        slab_bytes: slab size in bytes; a value plus its 24/32-byte header must fit.
        key_bytes: 8 or 16.
        default_ttl: seconds an entry lives when ``put`` gets no ``ttl``; None: forever.
        ttl_granularity: width in seconds of an expiry layer.
        evict: make room by CLOCK eviction when memory or the entry budget runs out.
        compact_threshold: a put compacts first when more than this fraction (0..1) of
            the reserved arena is not live (and the arena is at least half reserved).
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
        self._closed = True  # until fully built, so __del__ stays quiet
        if int_arg("key_bytes", key_bytes, 1) not in (8, 16):
            raise KeyFormatError(f"key_bytes must be 8 or 16, not {key_bytes!r}")
        int_arg("capacity_bytes", capacity_bytes, 1)
        int_arg("slab_bytes", slab_bytes, 1)
        if max_entries is not None:
            int_arg("max_entries", max_entries, 1)
        if not isinstance(evict, bool):
            raise InvalidArgumentError(f"evict must be a bool, not {type(evict).__name__}")
        threshold = real_arg("compact_threshold", compact_threshold)
        if not 0.0 <= threshold <= 1.0:
            raise InvalidArgumentError(f"compact_threshold must be in [0, 1], not {threshold}")
        granularity = real_arg("ttl_granularity", ttl_granularity)
        if not granularity > 0:
            raise InvalidArgumentError(f"ttl_granularity must be > 0 seconds, not {granularity}")
        check_clock(clock)
        self.key_bytes = key_bytes
        self._words = key_bytes // 8
        self._default_ttl = None if default_ttl is None else check_ttl(default_ttl)
        try:
            self._arena = Arena(capacity_bytes, slab_bytes=slab_bytes, key_words=self._words)
        except (MemoryError, ValueError) as exc:
            if isinstance(exc, StoreError):
                raise
            raise CapacityError(f"cannot reserve {capacity_bytes} bytes: {exc}") from exc
        most = self._arena.capacity_bytes // self._arena.record_size(0)
        if max_entries is None:
            max_entries = min(most, max(1024, capacity_bytes // 256))
        elif max_entries > most:
            raise InvalidArgumentError(
                f"max_entries {max_entries} exceeds the {most} records the arena can hold"
            )
        self.max_entries = max_entries
        self._index = CuckooIndex.for_capacity(
            self.max_entries, self._arena.keys_at, key_words=self._words
        )
        self._expiry = ExpiryLayers(granularity)
        self._clock_policy = ClockReclaimer(self._index)
        self._evict = evict
        self._compact_threshold = threshold
        self._clock = clock
        self.evictions = self.expirations = self.compactions = 0
        self._lock = threading.RLock()
        frozen = self._arena.buffer.view()
        frozen.flags.writeable = False
        self._frozen = frozen  # views are cut from read-only copies of this array object
        # id of the weakref to the array a call's views share -> (that weakref, the
        # arena's pin token); by id because a weakref hashes as its (unhashable) array
        self._views: dict[int, tuple[weakref.ref[np.ndarray[Any, Any]], int]] = {}
        # filled by weakref callbacks (any thread, any time): only appends, no lock
        self._released: deque[weakref.ref[np.ndarray[Any, Any]]] = deque()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Drops every entry. Idempotent. Views handed out keep their bytes (the arena
        lives while they do) but are no longer store data."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._expiry.clear()
            self._index.clear()
            self._views.clear()  # their callbacks die with them
            self._released.clear()

    def _ready(self) -> None:
        """Refuses a closed store; releases the pins of views dropped since the last call.
        Called with the lock held by every public method."""
        if self._closed:
            raise StoreClosedError("the store is closed")
        released = self._released
        while released:  # only lock holders pop; callbacks only append
            entry = self._views.pop(id(released.popleft()), None)
            if entry is not None:
                self._arena.unpin(entry[1])

    def __repr__(self) -> str:
        with self._lock:
            if self._closed:
                return "<KVStore CLOSED>"
            a = self._arena
            return (
                f"<KVStore entries={len(self._index)} load={self._index.load_factor:.2f} "
                f"arena={a.reserved_bytes / 2**20:.1f}/{a.capacity_bytes / 2**20:.1f}MiB "
                f"waste={a.waste:.1%} OPEN>"
            )

    def __len__(self) -> int:
        """Entries held, including expired ones not yet swept (0 once closed)."""
        with self._lock:
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

    def _ttl(self, ttl: object) -> float | None:
        return self._default_ttl if ttl is None else check_ttl(ttl)

    def _deadline(self, ttl: float | None) -> float:
        return math.inf if ttl is None else self._clock() + ttl

    # -- writes ------------------------------------------------------------------------

    def put(self, key: Key, value: Any, ttl: float | None = None) -> None:
        """Stores ``value`` (bytes-like) under ``key``, replacing any old value.

        ``ttl``: seconds until the entry expires (> 0); None uses ``default_ttl``.
        Raises :class:`KeyFormatError`, :class:`ValueTooLargeError`,
        :class:`InvalidArgumentError` (store unchanged) or :class:`CapacityError`.
        """
        row = self._key_row(key)
        view = as_view(value)
        self._arena.check_value_len(view.nbytes)
        seconds = self._ttl(ttl)
        with self._lock:
            self._ready()
            self._put_one(row, view, self._deadline(seconds))

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
        rows = self._key_rows(keys)
        n = rows.shape[0]
        matrix = isinstance(values, np.ndarray) and values.ndim == 2 and values.dtype == np.uint8
        if matrix:
            if values.shape[0] != n:
                raise InvalidArgumentError(f"{n} keys but {values.shape[0]} values")
            self._arena.check_value_len(values.shape[1])
            views: list[memoryview] = []
        else:
            if isinstance(values, str | bytes | bytearray | memoryview | np.ndarray) or not (
                isinstance(values, Iterable)
            ):
                raise InvalidArgumentError("values must be a sequence of bytes-like or uint8[n, L]")
            views = [as_view(v) for v in values]
            if len(views) != n:
                raise InvalidArgumentError(f"{n} keys but {len(views)} values")
            for v in views:
                self._arena.check_value_len(v.nbytes)
        seconds = self._ttl(ttl)
        if n == 0:
            with self._lock:
                self._ready()
            return
        keep = last_occurrences(rows)
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
        with self._lock:
            self._ready()
            self._put_many(rows, matrix, values, views, lens, self._deadline(seconds))

    def _put_many(
        self,
        rows: U64,
        matrix: bool,
        values: Any,
        views: list[memoryview],
        lens: I64,
        deadline: float,
    ) -> None:
        n = rows.shape[0]
        locs = self._allocate_many(lens, n)
        if locs is None:  # needs eviction: entry by entry
            for i in range(n):
                v = memoryview(values[i]) if matrix else views[i]
                self._put_one(rows[i : i + 1], v, deadline)
            return
        if matrix:
            self._arena.write_many(locs, rows, values, np.full(n, deadline))
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
        row = self._key_row(key)
        with self._lock:
            self._ready()
            return bool(self._delete_rows(row)[0])

    def batch_delete(self, keys: object) -> npt.NDArray[np.bool_]:
        """Removes many keys; True where a live entry was removed."""
        rows = self._key_rows(keys)
        keep = last_occurrences(rows)
        with self._lock:
            self._ready()
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
        recently used for CLOCK; probes (``contains``) do not. A location is not pinned:
        it is only meaningful until the next call that changes the store."""
        rows = self._key_rows(keys)
        if not isinstance(touch, bool):
            raise InvalidArgumentError(f"touch must be a bool, not {type(touch).__name__}")
        with self._lock:
            self._ready()
            return self._lookup(rows, touch)

    def _lookup(self, rows: U64, touch: bool) -> I64:
        locs = self._index.lookup(rows, touch=touch)
        if not len(self._expiry):
            return locs  # every live entry with a deadline has one pending there
        hit = np.flatnonzero(locs >= 0)
        if hit.size:
            expired = self._arena.deadlines_at(locs[hit]) <= self._clock()
            if expired.any():
                locs[hit[expired]] = -1
        return locs

    def _pinned_base(self, locs: I64) -> memoryview:
        """A read-only view of the whole arena whose life (and that of every view cut
        from it) pins the records at ``locs``. Called with the lock held."""
        holder = self._frozen.view()  # a fresh array object: the views' only owner
        ref = weakref.ref(holder, self._released.append)
        self._views[id(ref)] = (ref, self._arena.pin(locs))
        return memoryview(holder)  # type: ignore[arg-type]

    def get(self, key: Key) -> memoryview | None:
        """Read-only pinned view of the value, or None when absent or expired."""
        row = self._key_row(key)
        with self._lock:
            self._ready()
            locs = self._lookup(row, True)
            loc = int(locs[0])
            if loc < 0:
                return None
            base = self._pinned_base(locs)
            start, end = self._arena.value_span(loc)
        return base[start:end]

    def batch_get(self, keys: object) -> list[memoryview | None]:
        """Read-only pinned views (None where absent or expired), in the order of
        ``keys``; all of one call's views pin their records together."""
        rows = self._key_rows(keys)
        with self._lock:
            self._ready()
            locs = self._lookup(rows, True)
            hit = np.flatnonzero(locs >= 0)
            if hit.size == 0:
                return [None] * locs.size
            found = locs[hit]
            base = self._pinned_base(found)
            starts = found + self._arena.header_bytes
            ends = (starts + self._arena.lengths_at(found)).tolist()
        out: list[memoryview | None] = [None] * locs.size
        for i, a, b in zip(hit.tolist(), starts.tolist(), ends, strict=True):
            out[i] = base[a:b]
        return out

    def contains(self, key: Key) -> bool:
        """Whether ``key`` holds a live entry; does not count as a use for eviction."""
        row = self._key_row(key)
        with self._lock:
            self._ready()
            return bool(self._lookup(row, False)[0] >= 0)

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]

    def batch_contains(self, keys: object) -> npt.NDArray[np.bool_]:
        """Vectorised :meth:`contains`."""
        return self.lookup(keys, touch=False) >= 0

    # -- maintenance -------------------------------------------------------------------

    def expire(self) -> int:
        """Frees entries whose deadline has passed; returns how many. Costs work in
        proportion to what expires (see :mod:`kvstore.ttl`)."""
        with self._lock:
            self._ready()
            return self._expire()

    def compact(self) -> int:
        """Packs live records to the front of the arena and repoints the index; returns
        bytes moved. Every value is preserved; slabs holding pinned records stay put."""
        with self._lock:
            self._ready()
            return self._compact()

    def stats(self) -> StoreStats:
        with self._lock:
            self._ready()
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
                held_bytes=a.held_bytes,
            )

    def verify(self) -> None:
        """Checks the store's invariants, raising :class:`StoreError` naming the first one
        broken: every index entry is found where it is and points at a distinct record
        holding its key; records (live and held) do not overlap or cross a slab; live
        records, held records and free extents account for every reserved byte. Costs a
        pass over everything stored: for tests and diagnosis."""
        with self._lock:
            self._ready()
            _verify(self._index, self._arena)

    def slabs(self) -> list[npt.NDArray[np.uint8]]:
        """The arena's slabs as writable buffers, to register with the engine."""
        with self._lock:
            self._ready()
            return self._arena.slabs()

    @property
    def index(self) -> CuckooIndex:
        return self._index

    @property
    def arena(self) -> Arena:
        return self._arena


def _verify(index: CuckooIndex, arena: Arena) -> None:
    """See :meth:`KVStore.verify`."""
    pos, locs = index.entries()
    if pos.size != len(index):
        raise StoreError(f"store inconsistent: {pos.size} index entries, len {len(index)}")
    if np.unique(locs).size != locs.size:
        raise StoreError("store inconsistent: two index entries point at one record")
    found, where = index.positions(arena.keys_at(locs))
    if not (np.array_equal(found, locs) and np.array_equal(where, pos)):
        raise StoreError(
            "store inconsistent: an entry is not found at its position, "
            "or its record holds another key"
        )
    arena.verify(locs)

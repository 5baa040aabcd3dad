"""The client's local DRAM tier: a :class:`KVStore` in front of the cluster store.

``Client(..., local_cache_bytes=N)`` keeps copies of the values it reads (and writes) in
a local :class:`KVStore`, so a repeated get of a large value costs the master round trip
only, not the transfer. The cluster stays the source of truth: puts write through, and a
copy evicted from the local tier is simply dropped (the cluster still holds the object).

Staleness rule: every local copy carries the *version* the master gave the object when
it was put (each put of a key gets a new one; moving it between a node's tiers keeps
it). A get asks the master anyway, to locate the keys the local tier cannot serve and
to lease them, and its answer carries each key's current version; a local copy is
served only when its version equals that one. A key overwritten or removed by another
client therefore never comes back stale: the version differs, or the master answers
MISSING, and the copy is dropped. This holds for any key, not only for the immutable
content-addressed block hashes KV caches use, at no extra round trip.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgumentError, StoreError
from kvstore.store import KVStore
from transfer_engine.closeable import Closeable

__all__ = ["LocalTier"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
_VERSION = 8  # bytes of the version in front of each copy


class LocalTier(Closeable):
    """Versioned copies of cluster objects in local memory.

    Parameters:
        capacity_bytes: memory for the copies (rounded down to whole slabs); the CLOCK
            of the underlying :class:`KVStore` evicts when it is full.
        max_value_bytes: the largest value kept (larger ones are read from the cluster
            every time); sets the slab size.
    """

    def __init__(self, capacity_bytes: int, *, max_value_bytes: int = 4 << 20) -> None:
        self._closed = True
        if capacity_bytes <= 0 or max_value_bytes <= 0:
            raise InvalidArgumentError("local_cache_bytes and max_value_bytes must be > 0")
        slab = 1 << (max_value_bytes + _VERSION + 64).bit_length()
        slab = max(1 << 16, min(slab, capacity_bytes))
        self.max_value_bytes = min(max_value_bytes, slab - _VERSION - 64)
        self.store = KVStore(capacity_bytes, slab_bytes=slab, key_bytes=16, evict=True)
        self.hits = 0
        self.stale = 0
        self.promotions = 0
        self.writes = 0
        self._closed = False

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else f"entries={len(self.store)}"
        return f"<LocalTier {state} hits={self.hits} promotions={self.promotions}>"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.store.close()

    def counters(self) -> dict[str, int]:
        return {"local_hits": self.hits, "local_stale": self.stale,
                "promotions": self.promotions, "local_writes": self.writes,
                "local_evictions": self.store.evictions,
                "local_entries": len(self.store)}

    def lookup(self, rows: U64, versions: U64, found: npt.NDArray[np.bool_]
               ) -> list[memoryview | None]:
        """Copies of ``rows`` whose version is ``versions[i]`` (only where ``found``):
        pinned read-only views, None where there is none. Copies of another version, or
        of keys the master no longer has, are dropped here."""
        out: list[memoryview | None] = [None] * rows.shape[0]
        if rows.shape[0] == 0 or len(self.store) == 0:
            return out
        views = self.store.batch_get(rows)
        drop: list[int] = []
        for i, view in enumerate(views):
            if view is None:
                continue
            if found[i] and int.from_bytes(view[:_VERSION], "little") == int(versions[i]):
                out[i] = view[_VERSION:]
            else:
                drop.append(i)
        if drop:
            self.stale += len(drop)
            self.store.batch_delete(rows[drop])
        return out

    def serve(self, rows: U64, versions: U64, found: npt.NDArray[np.bool_], addrs: I64,
              checks: U64 | None, checksum: Callable[[Any], int]) -> npt.NDArray[np.bool_]:
        """Copies the values held at the master's version to memory at ``addrs`` (the
        caller's registered buffers); True where served. With ``checks`` (recorded
        checksums, 0: none) a copy whose ``checksum`` differs is dropped, not served."""
        served = np.zeros(rows.shape[0], dtype=bool)
        views = self.lookup(rows, versions, found)
        bad: list[int] = []
        for i, view in enumerate(views):
            if view is None:
                continue
            if checks is not None and checks[i] and checksum(view) != int(checks[i]):
                bad.append(i)
                continue
            if view.nbytes:
                src = np.frombuffer(view, dtype=np.uint8)
                ctypes.memmove(int(addrs[i]), int(src.ctypes.data), view.nbytes)
            served[i] = True
        del views
        if bad:
            self.invalidate(rows[bad])
        self.hits += int(served.sum())
        return served

    def fill(self, rows: U64, versions: U64, values: list[Any], *, promotion: bool) -> None:
        """Keeps copies of ``values`` (bytes-like) as version ``versions[i]`` of
        ``rows[i]``: read from the cluster (``promotion``) or just put there. Values
        too large for the tier are skipped."""
        keep: list[int] = []
        blobs: list[bytearray] = []
        for i, value in enumerate(values):
            view = memoryview(value).cast("B")
            if view.nbytes > self.max_value_bytes:
                continue
            blob = bytearray(_VERSION + view.nbytes)
            blob[:_VERSION] = int(versions[i]).to_bytes(_VERSION, "little")
            blob[_VERSION:] = view
            keep.append(i)
            blobs.append(blob)
        if not keep:
            return
        try:
            self.store.batch_put(rows[keep], blobs)
        except StoreError:  # no room even after eviction: the cluster still has them
            return
        if promotion:
            self.promotions += len(keep)
        else:
            self.writes += len(keep)

    def invalidate(self, rows: U64) -> None:
        if rows.shape[0] and len(self.store):
            self.store.batch_delete(rows)

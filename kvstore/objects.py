"""The master's object table: one row per object version, columns in NumPy.

A row (a *record*) holds a key (two ``uint64`` words), the value's length, checksum and
version, its state, how many leases hold it, its TTL deadline, and up to ``max_replicas``
placements ``(pool, offset)``, and a recency stamp. Rows live in arrays that double when
full, so a million objects cost about 120 bytes each here (no Python object per object).
Committed rows are found through the same partial-key cuckoo index as the local store
(:class:`kvstore.index.CuckooIndex`, confirming candidates against the key column), and
expired with the same time layers (:class:`kvstore.ttl.ExpiryLayers`).

Eviction is least recently used, exactly, and prefix-aware. A row's *stamp* (8 bytes)
holds in its high bits the *turn* (a counter that advances with every get or query batch
and after every commit) and in its low bits the row's rank within that turn. A batch is
taken to be a chain of blocks in prefix order (as a KV prefix cache asks for them), so
within a turn earlier keys rank above later ones: the deepest block of a chain goes first
and its prefix last, because a block is useless once its prefix is gone while a prefix
still serves shorter requests. Objects published by a commit rank in the current turn
*below* every key of that turn's get: a client that got a chain's prefix and then put the
missing tail keeps the prefix longer than the tail. Victims are the lowest stamps among
LIVE rows no lease holds (their space could not be reused anyway; PENDING rows, being
written by a put, are never in the index). One ``argpartition`` over the table queues
the 1/64 of rows with the lowest stamps, and evictions pop the queue: stamps only grow,
so every row outside the queue ranks above all of it, and a queued row whose stamp,
state or lease changed since is skipped (it ranks higher now and comes back with the next
queue). An eviction thus costs O(rows evicted), and O(rows) once per 1/64 of the table.

States: FREE (row unused), PENDING (space allocated, bytes being written, not in the
index), LIVE (committed, in the index), RETIRED (removed, overwritten, evicted or expired
while a lease held it: out of the index, its space kept until the last lease ends).
"""

from __future__ import annotations

import enum
import math

import numpy as np
import numpy.typing as npt

from kvstore.errors import CapacityError
from kvstore.index import CuckooIndex
from kvstore.ttl import ExpiryLayers

__all__ = ["ObjectTable", "State"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

_RANK_BITS = 20  # low bits of a stamp: the rank within a turn (MAX_BATCH = 2**16 fits)
_GET_TOP = (1 << _RANK_BITS) - 1  # rank of a get's first key; later keys rank lower
_PUT_TOP = (1 << (_RANK_BITS - 1)) - 1  # published rows rank below every got key


class State(enum.IntEnum):
    FREE = 0
    PENDING = 1
    LIVE = 2
    RETIRED = 3


class ObjectTable:
    """Rows of object metadata; see the module docstring.

    Parameters:
        max_replicas: placements a row can hold.
        initial: rows allocated up front (the table doubles as needed).
        ttl_granularity: width in seconds of an expiry layer.
    """

    def __init__(self, *, max_replicas: int = 4, initial: int = 1024,
                 ttl_granularity: float = 1.0) -> None:
        self.max_replicas = max_replicas
        self.capacity = 0
        self.keys = np.zeros((0, 2), dtype=np.uint64)
        self.length = np.zeros(0, dtype=np.int64)
        self.checksum = np.zeros(0, dtype=np.uint64)
        self.version = np.zeros(0, dtype=np.uint64)
        self.state = np.zeros(0, dtype=np.uint8)
        self.leases = np.zeros(0, dtype=np.int32)
        self.deadline = np.zeros(0, dtype=np.float64)
        self.nrep = np.zeros(0, dtype=np.uint8)
        self.pool = np.zeros((0, max_replicas), dtype=np.int32)
        self.offset = np.zeros((0, max_replicas), dtype=np.int64)
        self.stamp = np.zeros(0, dtype=np.uint64)  # recency; see the module docstring
        self.turn = 0
        self._queue = np.zeros(0, dtype=np.int64)  # eviction candidates, oldest first
        self._queued = np.zeros(0, dtype=np.uint64)  # their stamps when queued
        self._head = 0
        self._queue_key: bytes | None = None  # the pools the queue was made for
        self._free = np.zeros(0, dtype=np.int64)  # stack of free row ids
        self._nfree = 0
        self.expiry = ExpiryLayers(ttl_granularity)
        self._grow(initial)
        self.index = CuckooIndex.for_capacity(initial, self._keys_at, key_words=2)

    def __len__(self) -> int:
        """Live (committed, findable) objects."""
        return len(self.index)

    @property
    def rows_in_use(self) -> int:
        return self.capacity - self._nfree

    def _keys_at(self, rows: I64) -> U64:
        return self.keys[rows]

    def _grow(self, want: int) -> None:
        old = self.capacity
        new = max(want, 2 * old, 1024)

        def grown(arr: np.ndarray, fill: int | float = 0) -> np.ndarray:
            out = np.full((new, *arr.shape[1:]), fill, dtype=arr.dtype) if fill else \
                np.zeros((new, *arr.shape[1:]), dtype=arr.dtype)
            out[:old] = arr
            return out

        self.keys = grown(self.keys)
        self.length = grown(self.length)
        self.checksum = grown(self.checksum)
        self.version = grown(self.version)
        self.state = grown(self.state)
        self.leases = grown(self.leases)
        self.deadline = grown(self.deadline)
        self.nrep = grown(self.nrep)
        self.pool = grown(self.pool, -1)
        self.offset = grown(self.offset)
        self.stamp = grown(self.stamp)
        free = np.zeros(new, dtype=np.int64)
        free[: self._nfree] = self._free[: self._nfree]
        # new rows pushed so that the lowest ids are popped first
        added = np.arange(new - 1, old - 1, -1, dtype=np.int64)
        free[self._nfree : self._nfree + added.size] = added
        self._free = free
        self._nfree += added.size
        self.capacity = new

    # -- rows --------------------------------------------------------------------------

    def new_rows(self, n: int) -> I64:
        """``n`` unused rows, reset (state still FREE: the caller sets it)."""
        if n > self._nfree:
            self._grow(self.capacity + n)
        rows = self._free[self._nfree - n : self._nfree][::-1].copy()
        self._nfree -= n
        self.leases[rows] = 0
        self.nrep[rows] = 0
        self.pool[rows] = -1
        self.deadline[rows] = math.inf
        self.checksum[rows] = 0
        self.stamp[rows] = 0
        return rows

    def drop_rows(self, rows: I64) -> None:
        """Returns rows to the free stack (they must be out of the index)."""
        if rows.size == 0:
            return
        self.state[rows] = State.FREE
        self.pool[rows] = -1
        self.nrep[rows] = 0
        self._free[self._nfree : self._nfree + rows.size] = rows
        self._nfree += rows.size

    def replicas(self, row: int) -> list[tuple[int, int]]:
        n = int(self.nrep[row])
        return list(zip(self.pool[row, :n].tolist(), self.offset[row, :n].tolist(),
                        strict=True))

    # -- the index ---------------------------------------------------------------------

    def lookup(self, keys: U64, *, touch: bool = False, new_turn: bool = True) -> I64:
        """Row of each key's LIVE object, -1 where none. ``touch`` refreshes the recency
        of the rows found (:meth:`refresh`)."""
        rows = self.index.lookup(keys, touch=False)
        if touch:
            self.refresh(rows, new_turn=new_turn)
        return rows

    def refresh(self, rows: I64, *, new_turn: bool) -> None:
        """Marks ``rows`` (one batch in key order, -1 where a key missed) as used now.
        ``new_turn``: a get or query, whose keys rank above everything before; else a put
        or commit, whose rows rank in the current turn below its get. A stamp never goes
        down, so a put touching a key just got does not age it."""
        if new_turn:
            self.turn += 1
        pos = np.flatnonzero(rows >= 0)
        if pos.size == 0:
            return
        top = _GET_TOP if new_turn else _PUT_TOP
        stamp = (np.uint64(self.turn) << np.uint64(_RANK_BITS)) + (
            np.uint64(top) - np.minimum(pos, top).astype(np.uint64))
        hit = rows[pos]
        self.stamp[hit] = np.maximum(self.stamp[hit], stamp)

    def publish(self, rows: I64, *, schedule: bool = True, distinct: bool = False) -> I64:
        """Makes ``rows`` (distinct keys) the LIVE objects of their keys; returns the rows
        they replace (-1 where none). Schedules their TTLs and refreshes their recency
        (``schedule`` False: rows put back after :meth:`victims`, whose TTLs are still
        scheduled and whose recency stands). ``distinct``: the caller checked that the
        rows' keys are distinct."""
        keys = self.keys[rows]
        if len(self.index) + rows.size > 0.9 * self.index.slots:
            self._rebuild(len(self.index) + rows.size)
        try:
            old = self.index.insert(keys, rows, distinct=distinct)
        except CapacityError:  # displacement failed: a bigger table always has room
            self._rebuild(2 * (len(self.index) + rows.size))
            old = self.index.insert(keys, rows)
        self.state[rows] = State.LIVE
        if not schedule:
            return old
        # KV blocks just computed are the likeliest to be asked for next (the next turn of
        # the conversation); they rank below the prefix their put followed
        self.refresh(rows, new_turn=False)
        self.turn += 1  # the next commit ranks above this one
        dl = self.deadline[rows]
        for r, d in zip(rows[np.isfinite(dl)].tolist(), dl[np.isfinite(dl)].tolist(),
                        strict=True):
            self.expiry.add(r, d)
        return old

    def unpublish(self, keys: U64) -> I64:
        """Removes the keys' LIVE objects from the index; returns their rows (-1: none).
        The caller retires them."""
        return self.index.delete(keys)

    def unpublish_rows(self, rows: I64) -> None:
        """Removes LIVE ``rows`` from the index."""
        if rows.size:
            self.index.delete(self.keys[rows])

    def _rebuild(self, entries: int) -> None:
        pos, rows = self.index.entries()
        index = CuckooIndex.for_capacity(max(2 * entries, 1024), self._keys_at, key_words=2)
        if rows.size:
            index.insert(self.keys[rows], rows)
        self.index = index

    def victims(self, nbytes: int, *, pools: npt.NDArray[np.bool_] | None = None) -> I64:
        """LIVE rows no lease holds, least recently used first, whose space (length
        times replicas) adds up to ``nbytes`` (all of them when they hold less); removed
        from the index and RETIRED (the caller frees them or puts them back). Empty when
        ``nbytes <= 0`` or there is nothing to evict. ``pools`` (a flag per pool): only
        rows with a replica on a flagged pool, counting the space of those replicas."""
        mask = None if pools is None else np.append(np.asarray(pools, dtype=bool), False)
        key = None if mask is None else mask.tobytes()
        if key != self._queue_key:  # queued for other pools: queue again
            self._head = self._queue.size
        out: list[I64] = []
        while nbytes > 0:
            if self._head >= self._queue.size and not self._refill(nbytes, mask):
                break
            q = self._queue[self._head:self._head + 4096]
            ok = ((self.stamp[q] == self._queued[self._head:self._head + q.size])
                  & (self.state[q] == State.LIVE) & (self.leases[q] == 0))
            if mask is None:
                reps = self.nrep[q].astype(np.int64)
            else:
                reps = mask[self.pool[q]].sum(axis=1)  # -1 indexes the trailing False
                ok &= reps > 0
            rows = q[ok]
            if rows.size == 0:
                self._head += q.size
                continue
            total = np.cumsum(np.maximum(self.length[rows], 1) * reps[ok])
            if total[-1] >= nbytes:  # stop at the row that reaches nbytes
                take = int(np.searchsorted(total, nbytes)) + 1
                rows = rows[:take]
                self._head += int(np.flatnonzero(ok)[take - 1]) + 1
                nbytes = 0
            else:
                self._head += q.size
                nbytes -= int(total[-1])
            self.state[rows] = State.RETIRED  # not queued again by a refill below
            out.append(rows)
        if not out:
            return np.zeros(0, dtype=np.int64)
        rows = np.concatenate(out)
        self.unpublish_rows(rows)
        return rows

    def _refill(self, nbytes: int, mask: npt.NDArray[np.bool_] | None) -> bool:
        """Queues the evictable rows (with a replica on a pool of ``mask``, when given)
        with the lowest stamps: at least enough for ``nbytes`` at the mean size, and 1/64
        of the table. False when none."""
        cap = self.capacity
        live = (self.state[:cap] == State.LIVE) & (self.leases[:cap] == 0)
        if mask is not None:
            live &= mask[self.pool[:cap]].any(axis=1)
        self._queue_key = None if mask is None else mask.tobytes()
        cand = np.flatnonzero(live)
        if cand.size == 0:
            self._queue = np.zeros(0, dtype=np.int64)
            self._head = 0
            return False
        mean = max(1, int(self.length[cand].mean()))
        k = min(cand.size, max(cap // 64, 2 * (nbytes // mean) + 1))
        stamps = self.stamp[cand]
        if k < cand.size:
            part = np.argpartition(stamps, k - 1)[:k]
        else:
            part = np.arange(cand.size)
        part = part[np.argsort(stamps[part], kind="stable")]
        self._queue = cand[part]
        self._queued = stamps[part]
        self._head = 0
        return True

    def expired(self, now: float) -> I64:
        """LIVE rows whose TTL passed, removed from the index."""
        due = self.expiry.pop_due(now)
        if not due:
            return np.zeros(0, dtype=np.int64)
        rows = np.array([r for r, _ in due], dtype=np.int64)
        dls = np.array([d for _, d in due], dtype=np.float64)
        ok = (self.state[rows] == State.LIVE) & (self.deadline[rows] == dls)
        rows = np.unique(rows[ok])
        if rows.size:
            # a row reused since holds another key; only rows still in the index count
            found = self.index.lookup(self.keys[rows], touch=False)
            rows = rows[found == rows]
            self.unpublish_rows(rows)
        return rows

    def nbytes(self) -> int:
        """Bytes held by the columns and the index (what a million objects cost)."""
        cols = (self.keys, self.length, self.checksum, self.version, self.state,
                self.leases, self.deadline, self.nrep, self.pool, self.offset, self.stamp,
                self._free)
        idx = self.index
        return int(sum(c.nbytes for c in cols) + idx.locs.nbytes + idx.ref.nbytes
                   + idx.num_buckets * 16)

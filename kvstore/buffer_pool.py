"""Mooncake's ``BufferPool``: scratch buffers already registered with a
:class:`~kvstore.mooncake_store.MooncakeDistributedStore`, leased for zero-copy
``get_into`` / ``put_from`` so callers do not register and unregister memory per call.

Where leases come from:

* a local area the size of the store's ``local_buffer_size``, registered once when the
  pool is made and carved into power-of-two blocks (a buddy allocator: one free list per
  size class from ``min_size_class`` up, split on acquire, merged on release);
* when that area has no block for a request (full, fragmented, or the request is above
  ``max_size_class``), a short-lived overflow buffer, registered for the lease and
  unregistered when it is released.

``max_bytes`` bounds the bytes all active leases hold (local blocks count their class
size), ``max_regions`` the number of active leases. Errors are Mooncake's:
``RuntimeError`` with its messages (``BufferError`` for the view of a released lease,
``TypeError`` for a negative size).
"""

from __future__ import annotations

import ctypes
import heapq
import mmap
import operator
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BufferPool", "BufferLease", "BufferLeaseView", "RegisteredBufferPool",
           "RegisteredBufferLease", "RegisteredBufferLeaseView"]

_POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)


def _size(value: Any, name: str) -> int:
    """A non-negative int, refused as Mooncake's binding refuses (``TypeError``)."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative integer, not "
                        f"{type(value).__name__}") from None
    if n < 0:
        raise TypeError(f"{name} must be a non-negative integer, not {n}")
    return n


class _Mapping:
    """Anonymous memory aligned to ``alignment``: pages are committed on first touch and
    returned to the system on :meth:`close`."""

    def __init__(self, size: int, alignment: int) -> None:
        extra = alignment if alignment > mmap.PAGESIZE else 0
        self._mm = mmap.mmap(-1, size + extra)
        probe = ctypes.c_char.from_buffer(self._mm)
        base = ctypes.addressof(probe)
        del probe  # no export may outlive this, or close() could not unmap
        self.address = (base + alignment - 1) & ~(alignment - 1)
        self.size = size

    def close(self) -> None:
        self._mm.close()


class _Buddy:
    """Power-of-two blocks of one area, offsets relative to its start. Per order: a set
    of free offsets and a heap of them (entries whose block has since merged are skipped
    when popped), so the lowest free block is found without a scan."""

    def __init__(self, size: int, min_block: int) -> None:
        self.min_order = (min_block - 1).bit_length()
        self.max_order = max(size.bit_length() - 1, self.min_order - 1)
        orders = range(self.min_order, self.max_order + 1)
        self._free: dict[int, set[int]] = {k: set() for k in orders}
        self._heaps: dict[int, list[int]] = {k: [] for k in orders}
        self._used: dict[int, int] = {}
        offset = 0
        for order in range(self.max_order, self.min_order - 1, -1):
            if size - offset >= 1 << order:  # largest first: each block aligned to its size
                self._add(order, offset)
                offset += 1 << order

    def order_for(self, size: int) -> int:
        return max(self.min_order, (max(size, 1) - 1).bit_length())

    def _add(self, order: int, offset: int) -> None:
        self._free[order].add(offset)
        heap = self._heaps[order]
        heapq.heappush(heap, offset)
        if len(heap) > 2 * len(self._free[order]) + 64:  # drop the stale entries
            heap[:] = sorted(self._free[order])

    def _pop_lowest(self, order: int) -> int:
        free, heap = self._free[order], self._heaps[order]
        while True:
            offset = heapq.heappop(heap)
            if offset in free:
                free.discard(offset)
                return offset

    def alloc(self, order: int) -> int | None:
        """The offset of a free block of ``order`` (the lowest, which keeps the top of
        the area whole for large requests), or None."""
        if order > self.max_order:
            return None
        k = next((k for k in range(order, self.max_order + 1) if self._free[k]), None)
        if k is None:
            return None
        offset = self._pop_lowest(k)
        while k > order:
            k -= 1
            self._add(k, offset + (1 << k))
        self._used[offset] = order
        return offset

    def free(self, offset: int) -> None:
        order = self._used.pop(offset)
        while order < self.max_order:
            buddy = offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)  # its heap entry goes stale
            offset = min(offset, buddy)
            order += 1
        self._add(order, offset)


@dataclass
class _Region:
    """One active lease's memory: a local block (``offset``) or an overflow mapping."""

    ptr: int
    accounted: int
    offset: int | None = None
    mapping: _Mapping | None = None


class BufferLeaseView:
    """What a lease's ``buffer`` memoryview is over: while one exists (or a slice of it,
    or an array made from it) the lease stays alive and refuses ``release()``."""

    __slots__ = ("_lease", "_size", "__weakref__")

    def __init__(self, lease: BufferLease, size: int) -> None:
        self._lease = lease
        self._size = size

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self._size,), "typestr": "|u1", "version": 3,
                "data": (self._lease.ptr, False)}

    @property
    def buffer(self) -> memoryview:
        return memoryview(np.asarray(self))  # type: ignore[arg-type]  # base: this view


class BufferLease:
    """A registered buffer of ``size`` bytes at ``ptr`` until :meth:`release` (or the
    end of a ``with`` block, or garbage collection)."""

    def __init__(self, pool: BufferPool, region: _Region, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._region: _Region | None = region
        self._size = size
        self._views: weakref.WeakSet[BufferLeaseView] = weakref.WeakSet()

    @property
    def ptr(self) -> int:
        region = self._region
        if region is None:
            raise RuntimeError("buffer lease is closed")
        return region.ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        """A writable byte memoryview of the requested size over the lease's memory."""
        if self._region is None:  # BufferError, as Mooncake's buffer protocol raises
            raise BufferError("buffer lease is closed")
        view = BufferLeaseView(self, self._size)
        self._views.add(view)
        return view.buffer

    def release(self) -> None:
        """Gives the memory back; refused while a memoryview of it is alive, since the
        next lease would write under it."""
        if self._region is not None and len(self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        self._release()

    def _release(self) -> None:
        pool, region = self._pool, self._region
        if pool is None or region is None:
            return
        pool._give_back(self)

    def _detach(self) -> _Region | None:
        region, self._region, self._pool = self._region, None, None
        return region

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self._release()  # views keep the lease alive, so none is left here
        except Exception:  # noqa: BLE001 - nothing can be raised from a finaliser
            pass


class BufferPool:
    """Leases of store-registered memory; see the module docstring. Thread-safe:
    blocking ``acquire`` waits (without the GIL) for another lease's release."""

    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 64 * 1024,
                 max_size_class: int | None = None, alignment: int = 8 * 1024 * 1024,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        max_bytes = _size(max_bytes, "max_bytes")
        min_size_class = _size(min_size_class, "min_size_class")
        alignment = _size(alignment, "alignment")
        prewarm_count = _size(prewarm_count, "prewarm_count")
        self._closed = True  # until the area is registered: nothing for close() to do
        if store is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if not callable(getattr(store, "_local_buffer_bytes", None)):
            raise RuntimeError("BufferPool store parameter must be a "
                               "MooncakeDistributedStore or a store wrapper that "
                               "implements _local_buffer_bytes()")
        capacity = store._local_buffer_bytes()
        if capacity is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < _POINTER_SIZE or alignment & (alignment - 1):
            raise RuntimeError(
                "alignment must be a power of two and at least sizeof(void*)")
        if capacity == 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self._max_bytes = 2 * capacity if max_bytes == 0 else max(max_bytes, capacity)
        self._max_size_class = (self._max_bytes if max_size_class is None
                                else _size(max_size_class, "max_size_class"))
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._default_timeout = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else _size(max_regions,
                                                                   "max_regions")
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._pending: list[_Region] = []  # releases deferred by _give_back
        self._active: dict[int, _Region] = {}
        self._total = 0  # bytes held by active leases
        self._reserved_bytes = 0  # overflow buffers being made outside the lock
        self._reserved_regions = 0
        self._closing = False

        self._area = _Mapping(capacity, alignment)
        if store.register_buffer(self._area.address, capacity) != 0:
            self._area.close()
            raise RuntimeError("local buffer registration failed")
        self._buddy = _Buddy(capacity, min_size_class)
        self._closed = False
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    # -- leases ------------------------------------------------------------------------

    def acquire(self, size: int, block: bool | None = None,
                timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes; when the pool is exhausted, waits (``block``,
        default ``block_on_exhaustion``) up to ``timeout`` (default ``default_timeout``,
        None: no limit) for a release, else raises ``RuntimeError``."""
        size = _size(size, "size")
        should_block = self._block if block is None else bool(block)
        timeout_s = self._default_timeout if timeout is None else float(timeout)
        if timeout_s is not None and timeout_s < 0:
            raise RuntimeError("timeout must be non-negative")
        need = max(size, 1)
        if need > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_if_not_open()
                self._drain_locked()
                region = self._try_acquire_locked(need)
                if region is not None:
                    self._active[region.ptr] = region
                    return BufferLease(self, region, size)
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)

    def buffer(self, size: int, block: bool | None = None,
               timeout: float | None = None) -> BufferLease:
        """Same as :meth:`acquire` (Mooncake's name for use in ``with``)."""
        return self.acquire(size, block, timeout)

    def _room_locked(self, nbytes: int) -> bool:
        if self._total + self._reserved_bytes + nbytes > self._max_bytes:
            return False
        return self._max_regions is None or \
            len(self._active) + self._reserved_regions < self._max_regions

    def _try_acquire_locked(self, need: int) -> _Region | None:
        if need <= self._max_size_class:
            order = self._buddy.order_for(need)
            if order <= self._buddy.max_order and self._room_locked(1 << order):
                offset = self._buddy.alloc(order)
                if offset is not None:
                    self._total += 1 << order
                    return _Region(self._area.address + offset, 1 << order, offset=offset)
        if not self._room_locked(need):
            return None
        # an overflow buffer: registering it may take a while, so not under the lock
        self._reserved_bytes += need
        self._reserved_regions += 1
        self._cond.release()
        mapping: _Mapping | None = None
        try:
            try:
                mapping = _Mapping(need, self._alignment)
            except (OSError, MemoryError, ValueError):
                mapping = None
            if mapping is not None and \
                    self._store.register_buffer(mapping.address, need) != 0:
                mapping.close()
                raise RuntimeError("overflow buffer registration failed")
        finally:
            self._cond.acquire()
            self._reserved_bytes -= need
            self._reserved_regions -= 1
            self._cond.notify_all()
        if mapping is None:
            return None
        if self._closing or self._closed:
            self._cond.release()
            try:
                self._store.unregister_buffer(mapping.address)
                mapping.close()
            finally:
                self._cond.acquire()
            raise RuntimeError("buffer pool is closing")
        self._total += need
        return _Region(mapping.address, need, mapping=mapping)

    def _give_back(self, lease: BufferLease) -> None:
        """Ends ``lease``: its block goes back to its free list, an overflow buffer is
        unregistered and unmapped."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            # a finaliser the garbage collector ran inside this pool's own locked code,
            # mid-change: the next acquire or close finishes it
            region = lease._detach()
            if region is not None:
                self._pending.append(region)
            return
        with self._cond:
            region = lease._detach()
            if region is None:
                return
            mapping = self._drop_locked(region)
        if mapping is None:
            return
        try:
            ret = self._store.unregister_buffer(region.ptr)
        finally:
            mapping.close()
            with self._cond:
                self._cond.notify_all()
        if ret != 0:
            raise RuntimeError("overflow buffer unregistration failed")

    def _drop_locked(self, region: _Region) -> _Mapping | None:
        """Forgets an ended lease's region; its overflow mapping, if any, is the
        caller's to unregister and unmap."""
        del self._active[region.ptr]
        self._total -= region.accounted
        if region.offset is not None:
            self._buddy.free(region.offset)
            self._cond.notify_all()
        return region.mapping

    def _drain_locked(self) -> None:
        """Finishes the releases deferred by :meth:`_give_back`."""
        while self._pending:
            region = self._pending.pop()
            mapping = self._drop_locked(region)
            if mapping is not None:
                self._store.unregister_buffer(region.ptr)
                mapping.close()
                self._cond.notify_all()

    # -- pool --------------------------------------------------------------------------

    @property
    def active_leases(self) -> int:
        """Leases handed out and not yet released (``close`` refuses while any are)."""
        with self._cond:
            return len(self._active)

    def prewarm(self, size: int, count: int) -> None:
        """Touches the local-area memory ``count`` leases of ``size`` would get, so
        their first use does not take page faults; blocks in use are left alone."""
        size, count = _size(size, "size"), _size(count, "count")
        with self._cond:
            if self._closed or self._closing or max(size, 1) > self._max_size_class:
                return
            self._drain_locked()
            order = self._buddy.order_for(size)
            taken: list[int] = []
            for _ in range(count):
                offset = self._buddy.alloc(order)
                if offset is None:
                    break
                taken.append(offset)
            for offset in taken:
                ctypes.memset(self._area.address + offset, 0, 1 << order)
                self._buddy.free(offset)

    def close(self) -> None:
        """Unregisters and frees the local area; refused while leases are active."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.wait_for(lambda: self._reserved_regions == 0)
            self._drain_locked()
            if self._active:
                self._closing = False
                self._cond.notify_all()
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._closing = False
            self._cond.notify_all()
        # a store closed first has dropped the registration already
        self._store.unregister_buffer(self._area.address)
        self._area.close()

    def _raise_if_not_open(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if self._closing:
            raise RuntimeError("buffer pool is closing")

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing can be raised from a finaliser
            pass


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView

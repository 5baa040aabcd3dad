"""The GPU tier: a pool of fixed-size device blocks in front of a lower tier.

A :class:`DevicePool` holds KV blocks (values up to ``block_bytes``) in one torch tensor
of ``num_blocks`` rows on the device, the top of the store's tiers (GPU -> local DRAM ->
remote -> disk). On CUDA machines the tensor is GPU memory; elsewhere it is a CPU tensor
standing in for it (``device="cpu"``), so the same logic (allocate, put, get, evict,
promote) runs and is tested everywhere.

* ``get`` of a resident key is a *hit* (no copy: a view of its block); a miss asks the
  lower tier (a :class:`kvstore.client.Client`, with or without its local DRAM tier, a
  :class:`kvstore.KVStore`: anything with ``get``/``put``) and *promotes* what it
  finds into a block.
* When no block is free, the least recently used one is evicted. A block put here and
  not yet written below is *dirty*: eviction *demotes* it (puts it into the lower tier)
  before reusing the block, so nothing is lost. A clean block (promoted from below, or
  written through) is dropped, since the lower tier holds it.

torch is imported when a pool is made, not with :mod:`kvstore`.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Protocol

import numpy as np

from kvstore.errors import InvalidArgumentError, StoreClosedError, ValueTooLargeError
from transfer_engine.closeable import Closeable

__all__ = ["DevicePool", "LowerTier", "default_device"]


class LowerTier(Protocol):
    """What a device pool demotes to and promotes from."""

    def get(self, key: Any) -> Any: ...

    def put(self, key: Any, value: Any) -> None: ...


def default_device() -> str:
    """``"cuda"`` when torch sees a GPU, else ``"cpu"`` (the stand-in device)."""
    import torch  # noqa: PLC0415

    return "cuda" if torch.cuda.is_available() else "cpu"


class DevicePool(Closeable):
    """Blocks of device memory caching KV blocks; see the module docstring.

    Parameters:
        num_blocks: blocks in the pool.
        block_bytes: bytes per block (the largest value it holds).
        lower: the tier below (None: evicted blocks are dropped, dirty or not).
        device: a torch device string; default :func:`default_device`.
        write_through: also put every value into ``lower`` at once (blocks stay
            clean, so eviction never writes); default False: write on eviction.
    """

    def __init__(self, num_blocks: int, block_bytes: int, *, lower: LowerTier | None = None,
                 device: str | None = None, write_through: bool = False) -> None:
        self._closed = True
        if num_blocks <= 0 or block_bytes <= 0:
            raise InvalidArgumentError("num_blocks and block_bytes must be > 0")
        import torch  # noqa: PLC0415

        self._torch = torch
        self.device = torch.device(device or default_device())
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.lower = lower
        self.write_through = write_through
        self.blocks = torch.empty((num_blocks, block_bytes), dtype=torch.uint8,
                                  device=self.device)
        # key -> (block, length, dirty); order is recency (last: most recent)
        self._slots: collections.OrderedDict[Any, tuple[int, int, bool]] = \
            collections.OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.RLock()
        self.hits = self.misses = self.lower_hits = 0
        self.promotions = self.demotions = self.evictions = 0
        self._closed = False

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "OPEN"
        return (f"<DevicePool {self.device} blocks={len(self._slots)}/{self.num_blocks} "
                f"x{self.block_bytes} {state}>")

    def close(self) -> None:
        """Drops the blocks (dirty ones included: :meth:`flush` first to keep them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._slots.clear()
            del self.blocks

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def stats(self) -> dict[str, int]:
        return {"device_hits": self.hits, "device_misses": self.misses,
                "lower_hits": self.lower_hits, "device_promotions": self.promotions,
                "device_demotions": self.demotions, "device_evictions": self.evictions,
                "device_blocks": len(self._slots)}

    # -- moving bytes ------------------------------------------------------------------

    def _as_tensor(self, value: Any) -> Any:
        torch = self._torch
        if isinstance(value, torch.Tensor):
            return value.reshape(-1).view(torch.uint8) if value.is_contiguous() else \
                value.contiguous().reshape(-1).view(torch.uint8)
        if isinstance(value, np.ndarray):
            value = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        try:
            host = np.array(memoryview(value).cast("B"), dtype=np.uint8, copy=True)
        except TypeError as exc:
            raise InvalidArgumentError(f"not a bytes-like value or tensor: "
                                       f"{type(value).__name__}") from exc
        return torch.from_numpy(host)

    def _block(self, key: Any) -> Any:
        slot, length, _ = self._slots[key]
        return self.blocks[slot, :length]

    def _take_block(self) -> int:
        """A free block, evicting the least recently used (demoting it if dirty)."""
        if self._free:
            return self._free.pop()
        key, entry = self._slots.popitem(last=False)
        slot, length, dirty = entry
        if dirty and self.lower is not None:
            try:
                self.lower.put(key, self.blocks[slot, :length].cpu().numpy().tobytes())
            except BaseException:  # keep the only copy
                self._slots[key] = entry
                self._slots.move_to_end(key, last=False)
                raise
            self.demotions += 1
        self.evictions += 1
        return slot

    def _store(self, key: Any, data: Any, dirty: bool) -> None:
        old = self._slots.pop(key, None)
        slot = old[0] if old is not None else self._take_block()
        try:
            self.blocks[slot, :data.numel()].copy_(data)
        except BaseException:
            self._free.append(slot)
            raise
        self._slots[key] = (slot, int(data.numel()), dirty)

    # -- the API -----------------------------------------------------------------------

    def put(self, key: Any, value: Any) -> None:
        """Keeps ``value`` (bytes-like, numpy array or tensor on any device) in a block;
        evicts the least recently used block when none is free. Raises
        :class:`ValueTooLargeError` for a value over ``block_bytes`` (pool unchanged)."""
        data = self._as_tensor(value)
        if data.numel() > self.block_bytes:
            raise ValueTooLargeError(f"{data.numel()} bytes exceed the {self.block_bytes}-"
                                     "byte device block")
        with self._lock:
            if self._closed:
                raise StoreClosedError("the device pool is closed")
            if self.write_through and self.lower is not None:
                self.lower.put(key, data.cpu().numpy().tobytes())
            self._store(key, data, dirty=not self.write_through)

    def get(self, key: Any) -> Any | None:
        """The value as a ``uint8`` tensor on the device (a view of its block, valid
        until the block is evicted or overwritten), or None. A miss reads the lower tier
        and promotes what it finds."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("the device pool is closed")
            if key in self._slots:
                self._slots.move_to_end(key)
                self.hits += 1
                return self._block(key)
            self.misses += 1
            if self.lower is None:
                return None
            value = self.lower.get(key)
            if value is None:
                return None
            self.lower_hits += 1
            data = self._as_tensor(value)
            if data.numel() > self.block_bytes:  # the lower tier holds larger values
                return data.to(self.device)
            self._store(key, data, dirty=False)
            self.promotions += 1
            return self._block(key)

    def get_bytes(self, key: Any) -> bytes | None:
        """As :meth:`get`, copied to host bytes."""
        block = self.get(key)
        return None if block is None else bytes(block.cpu().numpy().tobytes())

    def remove(self, key: Any) -> bool:
        """Drops the block of ``key`` here (not below); True when there was one."""
        with self._lock:
            entry = self._slots.pop(key, None)
            if entry is None:
                return False
            self._free.append(entry[0])
            return True

    def flush(self) -> int:
        """Writes every dirty block to the lower tier (they stay resident, clean);
        returns how many."""
        with self._lock:
            if self.lower is None:
                return 0
            dirty = [k for k, (_, _, d) in self._slots.items() if d]
            for key in dirty:
                slot, length, _ = self._slots[key]
                self.lower.put(key, self.blocks[slot, :length].cpu().numpy().tobytes())
                self._slots[key] = (slot, length, False)
            return len(dirty)

"""Memory in the Mooncake ``TransferEngine`` API: registering regions under their
addresses (published to the metadata server), managed buffers, local byte copies and
the first buffer of a segment."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from transfer_engine.errors import TransferEngineError
from transfer_engine.segment import Segment

from .address_map import SEGMENT_PREFIX, AddressMap, remote_map
from .codes import ERR_ADDRESS_NOT_REGISTERED, ERR_ADDRESS_OVERLAPPED, Failed, log
from .engine_base import EngineBase

__all__ = ["MemoryAPI"]


class MemoryAPI(EngineBase):
    """Registration and local memory of the Mooncake ``TransferEngine``."""

    def _rebuild_local_map(self) -> None:
        self._local_map = AddressMap([(s.address, s.address + s.length, s)
                                      for s in self._local.values()])

    def _publish_buffers(self) -> None:
        directory = self._directory
        if directory is not None and directory.mode != "p2p":
            with self._lock:
                regions = [(s.address, s.length)
                           for s in sorted(self._local.values(), key=lambda s: s.id)]
            directory.publish_buffers(self._name, regions)

    def _register(self, address: int, length: int, owner: object = None) -> Segment:
        engine = self._need_engine()
        if not isinstance(address, int) or not isinstance(length, int) or address <= 0 \
                or length <= 0:
            raise Failed(-1, f"bad region ({address!r}, {length!r})")
        with self._lock:
            if self._local_map.overlaps(address, length):
                raise Failed(ERR_ADDRESS_OVERLAPPED,
                             f"{length} bytes at {address:#x} overlap a registered region")
            seg = engine.register(owner if owner is not None else (address, length),
                                  name=f"{SEGMENT_PREFIX}{address:x}")
            self._local[address] = seg
            self._rebuild_local_map()
        self._publish_buffers()
        return seg

    def _unregister(self, address: int) -> None:
        with self._lock:
            seg = self._local.get(address)
            if seg is None:
                raise Failed(ERR_ADDRESS_NOT_REGISTERED, f"{address:#x} is not registered")
            seg.close()  # waits (bounded) for transfers using it
            del self._local[address]
            self._rebuild_local_map()
        self._publish_buffers()

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``capacity`` bytes at ``buffer_addr`` so that peers can read and
        write them by address. 0; -7 if the range overlaps a registered one; -1."""
        return self._call("register_memory", self._register, buffer_addr, capacity)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Revokes peer access to the region registered at ``buffer_addr``. 0; -3 if
        nothing is registered there."""
        return self._call("unregister_memory", self._unregister, buffer_addr)

    def batch_register_memory(self, buffer_addresses: Sequence[int],
                              capacities: Sequence[int], location: str = "*") -> int:
        """Registers every region or none. 0, or the first failure's code."""
        if len(buffer_addresses) != len(capacities):
            log.warning("batch_register_memory: %d addresses, %d capacities",
                        len(buffer_addresses), len(capacities))
            return -1
        for i, (addr, cap) in enumerate(zip(buffer_addresses, capacities, strict=True)):
            ret = self.register_memory(addr, cap)
            if ret != 0:
                for done in buffer_addresses[:i]:
                    self.unregister_memory(done)
                return ret
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Unregisters each region; 0, or the first failure's code (the rest are still
        unregistered)."""
        result = 0
        for addr in buffer_addresses:
            ret = self.unregister_memory(addr)
            result = result or ret
        return result

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers ``length`` bytes (at least one); returns their
        address, or 0."""
        try:
            if not isinstance(length, int) or length < 0:
                raise Failed(-1, f"bad length {length!r}")
            try:
                buf = np.zeros(max(length, 1), dtype=np.uint8)
            except MemoryError as exc:
                raise Failed(-1, f"cannot allocate {length} bytes") from exc
            address = int(buf.ctypes.data)
            self._register(address, buf.nbytes, owner=buf)
            with self._lock:
                self._managed[address] = (buf, length)
            return address
        except (Failed, TransferEngineError) as exc:
            log.warning("allocate_managed_buffer: %s", exc)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees a buffer of :meth:`allocate_managed_buffer`. 0; -1 if none of that
        length is allocated at ``buffer_addr`` (Mooncake does not check)."""
        def free() -> None:
            with self._lock:
                entry = self._managed.get(buffer_addr)
                if entry is None or entry[1] != length:
                    raise Failed(-1, f"no managed buffer of {length} bytes at "
                                     f"{buffer_addr:#x}")
                self._unregister(buffer_addr)
                del self._managed[buffer_addr]
        return self._call("free_managed_buffer", free)

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copies ``length`` bytes of ``src_ptr`` to ``dest_address`` (local memory)."""
        if length < 0 or length > len(src_ptr) or dest_address <= 0:
            return -1
        ctypes.memmove(dest_address, bytes(src_ptr[:length]), length)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes at ``source_address`` (local memory)."""
        if length <= 0 or source_address <= 0:
            return b""
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first memory registered by the engine ``segment_name``
        (our own name gives ours), or 0."""
        try:
            if segment_name == self._name:
                with self._lock:
                    first = self._local_map.first()
                return int(first.address) if first is not None else 0
            peer = self._peer(segment_name)
            peer.refresh()
            with self._lock:
                self._maps[segment_name] = remote_map(peer)
                seg = self._maps[segment_name].first()
            return int(seg.name[len(SEGMENT_PREFIX):], 16) if seg is not None else 0
        except (Failed, TransferEngineError) as exc:
            log.warning("get_first_buffer_address(%s): %s", segment_name, exc)
            return 0

"""A stand-in GPU for tests on machines without one: memory the host cannot touch.

Its "device memory" is a reserved, inaccessible address range (``PROT_NONE``): a system
call handed one of its addresses fails with ``EFAULT`` (a socket send, a cross-memory
copy), and a host dereference would crash, so a transfer that works proves the bytes
went through the device's own copies. Those copies (``to_host``/``to_device``, the
:class:`transfer_engine.devmem.Copier` protocol) move bytes between the host and a
hidden host buffer that plays the device's DRAM. Installed for a device name
(``"cuda:0"``) with :meth:`StandInGpu.installed`; arrays made by :meth:`alloc` expose
``__cuda_array_interface__``, so the engine registers them as that device's memory.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np

from transfer_engine import devmem

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_NONE, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0, 0x02, 0x20, 0x4000


class DeviceArray:
    """A stand-in device allocation: an address range with no host access."""

    def __init__(self, gpu: StandInGpu, address: int, nbytes: int, index: int) -> None:
        self.gpu, self.address, self.nbytes = gpu, address, nbytes
        self.device = SimpleNamespace(id=index)
        self.itemsize = 1

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"data": (self.address, False), "shape": (self.nbytes,), "typestr": "|u1",
                "version": 3, "strides": None}

    def upload(self, data: np.ndarray) -> None:
        """Sets the device bytes (the test's cudaMemcpy)."""
        self.gpu.shadow(self)[:] = data

    def download(self) -> np.ndarray:
        return self.gpu.shadow(self).copy()


class StandInGpu:
    """One stand-in device: allocations, their hidden storage, the copier."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.copies = 0
        self.exported = self.opened = self.closed_maps = self.device_to_device = 0
        self._allocs: list[tuple[int, int, np.ndarray]] = []  # (address, size, storage)

    def alloc(self, nbytes: int) -> DeviceArray:
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        address = _libc.mmap(None, size, _PROT_NONE,
                             _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of stand-in device memory failed")
        self._allocs.append((address, size, np.zeros(size, dtype=np.uint8)))
        return DeviceArray(self, address, nbytes, self.index)

    def shadow(self, arr: DeviceArray) -> np.ndarray:
        return self._storage(arr.address, arr.nbytes)

    def _storage(self, address: int, n: int) -> np.ndarray:
        for base, size, store in self._allocs:
            if base <= address and address + n <= base + size:
                return store[address - base:address - base + n]
        raise ValueError(f"{address:#x}+{n} is not stand-in device memory")

    def to_host(self, rows: Sequence[devmem.Row]) -> None:
        for dev, host, n in rows:
            ctypes.memmove(host, self._storage(dev, n).ctypes.data, n)
            self.copies += 1

    def to_device(self, rows: Sequence[devmem.Row]) -> None:
        for dev, host, n in rows:
            ctypes.memmove(self._storage(dev, n).ctypes.data, host, n)
            self.copies += 1

    # device IPC: the stand-in's memory is this process's, so peers that map it must
    # be engines of this process (CUDA itself refuses a handle in its own process)

    def export_ipc(self, address: int, length: int) -> dict[str, Any]:
        self._storage(address, length)  # ours, or ValueError
        self.exported += 1
        return {"address": address, "length": length}

    def open_ipc(self, handle: dict[str, Any]) -> tuple[int, int, Any]:
        address = int(handle["address"])
        for base, size, _ in self._allocs:
            if base <= address < base + size:
                self.opened += 1
                return address, base + size - address, self._unmap
        raise ValueError(f"{address:#x} is not stand-in device memory")

    def _unmap(self) -> None:
        self.closed_maps += 1

    def _host_view(self, address: int, n: int) -> int:
        for base, size, store in self._allocs:
            if base <= address < base + size:
                return int(store.ctypes.data) + address - base
        return address  # host memory

    def between(self, rows: Sequence[tuple[int, int, int]], on_device: bool = False
                ) -> None:
        for dst, src, n in rows:
            ctypes.memmove(self._host_view(dst, n), self._host_view(src, n), n)
            self.copies += 1
            self.device_to_device += 1

    @contextmanager
    def installed(self) -> Iterator[StandInGpu]:
        undo = devmem.install(f"cuda:{self.index}", self)
        try:
            yield self
        finally:
            undo()
            self.close()

    def close(self) -> None:
        for address, size, _ in self._allocs:
            _libc.munmap(address, size)
        self._allocs.clear()

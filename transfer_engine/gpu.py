"""CUDA helpers: IPC handles, dma-buf export, pinned staging with copy/send overlap.

cupy drives the CUDA runtime (torch tensors are registered by address, so they work
too once cupy is installed); the driver calls cupy does not wrap go through ``ctypes``
on ``libcuda.so.1``. Nothing here is imported by ``import transfer_engine``. Every
entry point raises ``NotSupportedError`` saying what is missing when there is no CUDA.

Used today: the RDMA transport registers GPU memory through a dma-buf (:func:`dmabuf_fd`)
and falls back to nvidia-peermem; :mod:`transfer_engine.devmem` copies device ranges
(through host bounces for tcp, :mod:`transfer_engine.staging`) and maps a same-host peer's
GPU memory for shm (:func:`export_ipc`, :class:`IpcMapping`,
:mod:`transfer_engine.transport.shm_ipc`). Not yet wired into a transport: the
overlapped pinned staging of :class:`StagingPool` (:func:`overlapped`,
:func:`send_device_memory`, :func:`recv_device_memory`); their GPU tests run where a GPU
is.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from transfer_engine.errors import NotSupportedError, RegistrationError

__all__ = ["cuda_unavailable_reason", "require_cuda", "dmabuf_fd", "IpcHandle",
           "export_ipc", "IpcMapping", "StagingPool", "overlapped", "chunks",
           "copy_device_to_host_async", "copy_host_to_device_async",
           "send_device_memory", "recv_device_memory"]

_HINT = "install cupy (`pip install cupy-cuda12x`, extra [gpu]) or torch with CUDA"
_MEMCPY_D2H, _MEMCPY_H2D = 2, 1
_DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
_IPC_LAZY_PEER_ACCESS = 1


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here, or None when a GPU is usable."""
    cp = _cupy()
    if cp is None:
        return f"cupy is not importable; {_HINT}"
    try:
        if not cp.cuda.is_available():
            return "cupy imports but finds no CUDA device or driver"
    except Exception as exc:  # cupy raises its own runtime errors here
        return f"cupy cannot query CUDA: {exc}"
    return None


def require_cuda() -> Any:
    """The cupy module, or ``NotSupportedError`` with the reason."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise NotSupportedError(f"no CUDA GPU: {reason}")
    return _cupy()


_LIBCUDA: ctypes.CDLL | None = None


def _libcuda() -> ctypes.CDLL:
    global _LIBCUDA
    if _LIBCUDA is None:
        try:
            _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise NotSupportedError(f"no CUDA GPU: libcuda.so.1 not loadable ({exc})") from exc
    return _LIBCUDA


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise NotSupportedError(f"{what} failed with CUresult {rc}")


def dmabuf_fd(address: int, length: int) -> tuple[int, int]:
    """Exports GPU memory as a dma-buf: ``(fd, offset of address in it)``.

    The exported range is widened to whole host pages (the driver requires it). The
    caller owns the fd. Needs CUDA 11.7+, an open kernel module or a driver with dma-buf
    support; otherwise ``NotSupportedError`` (the caller then tries nvidia-peermem).
    """
    require_cuda()
    lib = _libcuda()
    import mmap

    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    end = (address + length + page - 1) & ~(page - 1)
    fd = ctypes.c_int(-1)
    try:
        fn = lib.cuMemGetHandleForAddressRange
    except AttributeError as exc:
        raise NotSupportedError("CUDA driver lacks cuMemGetHandleForAddressRange "
                                "(dma-buf needs CUDA 11.7+)") from exc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int,
                   ctypes.c_ulonglong]
    _check(fn(ctypes.byref(fd), start, end - start, _DMA_BUF_FD, 0),
           "cuMemGetHandleForAddressRange (dma-buf export)")
    return fd.value, address - start


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """What a same-host peer needs to map our GPU memory (msgpack-able via to_wire)."""

    handle: bytes  # cudaIpcMemHandle_t of the allocation's base
    offset: int  # of the registered address from that base
    length: int
    device: int

    def to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle, "offset": self.offset, "length": self.length,
                "device": self.device}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> IpcHandle:
        return cls(bytes(data["handle"]), int(data["offset"]), int(data["length"]),
                   int(data["device"]))


def export_ipc(address: int, length: int, device: int) -> IpcHandle:
    """A CUDA IPC handle for GPU memory at ``address`` (any offset in an allocation)."""
    cp = require_cuda()
    lib = _libcuda()
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    fn = lib.cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    with cp.cuda.Device(device):
        _check(fn(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange")
        try:
            handle = cp.cuda.runtime.ipcGetMemHandle(base.value)
        except cp.cuda.runtime.CUDARuntimeError as exc:
            raise RegistrationError(f"cannot export CUDA IPC handle: {exc}",
                                    transport="shm", length=length) from exc
    return IpcHandle(bytes(handle), address - base.value, length, device)


class IpcMapping:
    """A peer's GPU memory mapped into this process; ``close()`` unmaps (idempotent)."""

    def __init__(self, handle: IpcHandle) -> None:
        cp = require_cuda()
        self._cp = cp
        self.device = handle.device
        with cp.cuda.Device(handle.device):
            try:
                self._base = int(cp.cuda.runtime.ipcOpenMemHandle(
                    handle.handle, _IPC_LAZY_PEER_ACCESS))
            except cp.cuda.runtime.CUDARuntimeError as exc:
                raise RegistrationError(f"cannot open CUDA IPC handle: {exc}",
                                        transport="shm") from exc
        self.address = self._base + handle.offset
        self.length = handle.length
        self._closed = False
        try:  # what the allocation really holds from ``address``: a peer's word is not
            lib = _libcuda()  # enough to bound copies into this process's own memory
            base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
            fn = lib.cuMemGetAddressRange_v2
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
            with cp.cuda.Device(handle.device):
                _check(fn(ctypes.byref(base), ctypes.byref(size), self._base),
                       "cuMemGetAddressRange")
            self.mapped = int(size.value) - handle.offset
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._cp.cuda.Device(self.device):
            self._cp.cuda.runtime.ipcCloseMemHandle(self._base)

    def __enter__(self) -> IpcMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagingPool:
    """Pinned host buffers for moving GPU memory over TCP (bounded: ``count`` buffers).

    ``acquire`` blocks (bounded by ``timeout``) until a buffer is free, so staging never
    allocates on the data path. Closing frees the pinned memory; buffers handed out must
    be released first.
    """

    def __init__(self, buffer_bytes: int = 4 << 20, count: int = 4) -> None:
        import numpy as np

        cp = require_cuda()
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError("buffer_bytes and count must be positive")
        self.buffer_bytes = buffer_bytes
        self._mems = [cp.cuda.alloc_pinned_memory(buffer_bytes) for _ in range(count)]
        self._arrays = [np.frombuffer(m, dtype=np.uint8, count=buffer_bytes)
                        for m in self._mems]
        self._free = list(range(count))
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, timeout: float | None = 10.0) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout):
                raise TimeoutError("no staging buffer became free")
            if self._closed:
                raise RuntimeError("staging pool is closed")
            return self._free.pop()

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify()

    def view(self, index: int, nbytes: int | None = None) -> memoryview:
        return self._arrays[index].data[: nbytes or self.buffer_bytes]

    def address(self, index: int) -> int:
        return int(self._arrays[index].ctypes.data)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._arrays.clear()
        self._mems.clear()

    def __enter__(self) -> StagingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunks(length: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(offset, size) pieces of ``length`` bytes, at most ``chunk`` each."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    for off in range(0, length, chunk):
        yield off, min(chunk, length - off)


def overlapped(pieces: list[tuple[int, int]], start: Callable[[int, int, int], Any],
               wait: Callable[[Any], None], consume: Callable[[int, int, int], None],
               depth: int = 2) -> None:
    """Pipelines ``start`` (an async copy of piece k into buffer k % depth) with
    ``consume`` (send it) so copy k+1 runs while piece k is sent.

    ``start(buffer, offset, size) -> token``; ``wait(token)`` blocks until that copy is
    done; ``consume(buffer, offset, size)`` uses the buffer. Pure scheduling: tested
    without a GPU by passing plain functions.
    """
    if depth < 1:
        raise ValueError("depth must be >= 1")
    tokens: dict[int, Any] = {}
    for k in range(min(depth, len(pieces))):
        tokens[k] = start(k % depth, *pieces[k])
    for k, (off, size) in enumerate(pieces):
        wait(tokens.pop(k))
        consume(k % depth, off, size)
        nxt = k + depth
        if nxt < len(pieces):
            tokens[nxt] = start(nxt % depth, *pieces[nxt])


def copy_device_to_host_async(cp: Any, host_ptr: int, device_ptr: int, nbytes: int,
                              stream: Any) -> Any:
    """Starts a D2H copy on ``stream``; returns an event to ``synchronize()``."""
    cp.cuda.runtime.memcpyAsync(host_ptr, device_ptr, nbytes, _MEMCPY_D2H, stream.ptr)
    event = cp.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def copy_host_to_device_async(cp: Any, device_ptr: int, host_ptr: int, nbytes: int,
                              stream: Any) -> Any:
    cp.cuda.runtime.memcpyAsync(device_ptr, host_ptr, nbytes, _MEMCPY_H2D, stream.ptr)
    event = cp.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def send_device_memory(device_ptr: int, length: int, send: Callable[[memoryview], None],
                       pool: StagingPool) -> None:
    """Sends GPU bytes through pinned staging, the copy of chunk k+1 overlapping the send
    of chunk k. On failure any prefix may have been sent."""
    cp = require_cuda()
    stream = cp.cuda.Stream(non_blocking=True)
    bufs = [pool.acquire(), pool.acquire()]
    try:
        overlapped(list(chunks(length, pool.buffer_bytes)),
                   lambda b, off, n: copy_device_to_host_async(
                       cp, pool.address(bufs[b]), device_ptr + off, n, stream),
                   lambda ev: ev.synchronize(),
                   lambda b, off, n: send(pool.view(bufs[b], n)), depth=2)
    finally:
        stream.synchronize()
        for b in bufs:
            pool.release(b)


def recv_device_memory(device_ptr: int, length: int,
                       recv_into: Callable[[memoryview], None], pool: StagingPool) -> None:
    """Receives into GPU memory: chunk k+1 is received while chunk k is copied up."""
    cp = require_cuda()
    stream = cp.cuda.Stream(non_blocking=True)
    bufs = [pool.acquire(), pool.acquire()]
    pending: list[Any] = [None, None]
    try:
        for k, (off, n) in enumerate(chunks(length, pool.buffer_bytes)):
            b = k % 2
            if pending[b] is not None:
                pending[b].synchronize()  # the buffer's previous copy has left it
            recv_into(pool.view(bufs[b], n))
            pending[b] = copy_host_to_device_async(cp, device_ptr + off,
                                                   pool.address(bufs[b]), n, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            pool.release(b)

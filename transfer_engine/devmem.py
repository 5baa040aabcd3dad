"""Copies between device memory and host memory, for transports that only reach host
memory (tcp, shm): the engine and the stream servers stage device segments through
host bounce buffers with these (see :mod:`transfer_engine.staging`).

A device is named as segments name it (``"cuda:N"``). CUDA devices copy with cupy: one
``cudaMemcpyAsync`` per range on a stream of the device's own, then one synchronize, so
a request's ranges cost one wait. :func:`install` puts another copier in place for a
device name: a stand-in device in tests (whose addresses the host cannot dereference),
or a runtime of the application's choosing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from transfer_engine.errors import NotSupportedError, TransferError

__all__ = ["Copier", "CudaCopier", "HostCopier", "TorchCopier", "bounce_rows", "copier",
           "host_buffer", "install", "move", "Row"]

Row = tuple[int, int, int]  # (device address, host address, length)

log = logging.getLogger(__name__)


class Copier(Protocol):
    """Moves bytes between one device's memory and host memory; raises
    ``TransferError`` when a copy fails. Returns once every row is copied.

    A copier may start copies off the device without waiting for them
    (``to_host_async(rows)`` returns what waits), so that sends overlap them, and may
    offer device IPC between processes of one host (the shm
    transport uses it where present): ``export_ipc(address, length)`` gives a
    msgpack-able handle, ``open_ipc(handle)`` maps it here, and
    ``between(rows)`` copies ``(destination, source, length)`` rows of any memory of
    this process, device or host. ``open_ipc`` returns ``(address, bytes, close)``:
    ``bytes`` is what the mapping really holds from ``address`` (not what the exporter
    said), so that no copy strays past it into this process's own memory."""

    def to_host(self, rows: Sequence[Row]) -> None: ...
    def to_device(self, rows: Sequence[Row]) -> None: ...


_installed: dict[str, Copier] = {}
_cuda: dict[str, Copier] = {}
_lock = threading.Lock()


def install(device: str, impl: Copier) -> Callable[[], None]:
    """Uses ``impl`` for ``device``'s copies from now on; returns the undo."""
    with _lock:
        before = _installed.get(device)
        _installed[device] = impl

    def undo() -> None:
        with _lock:
            if before is None:
                _installed.pop(device, None)
            else:
                _installed[device] = before
    return undo


class HostCopier:
    """``"cpu"`` rows (host ranges beside device ones in a staged transfer): the same
    moves by ``memmove``, so that every range takes one path."""

    def to_host(self, rows: Sequence[Row]) -> None:
        for src, dst, n in rows:
            ctypes.memmove(dst, src, n)

    def to_device(self, rows: Sequence[Row]) -> None:
        for dst, src, n in rows:
            ctypes.memmove(dst, src, n)


_HOST = HostCopier()


def copier(device: str) -> Copier:
    """The copier of ``device`` (``"cpu"``: :class:`HostCopier`); ``NotSupportedError``
    saying what is missing."""
    with _lock:
        found = _installed.get(device)
        if found is not None:
            return found
        if device == "cpu":
            return _HOST
        if not device.startswith("cuda"):
            raise NotSupportedError(f"no copier for {device} memory")
        cuda = _cuda.get(device)
        if cuda is None:
            try:
                cuda = CudaCopier(device)
            except NotSupportedError as no_cupy:  # torch with CUDA does the copies too
                try:
                    cuda = TorchCopier(device)
                except NotSupportedError:
                    raise no_cupy from None
            _cuda[device] = cuda
        return cuda


def bounce_rows(addresses: Sequence[int], lengths: np.ndarray, devices: Sequence[str],
                base: int) -> tuple[np.ndarray, dict[str, list[Row]]]:
    """Ranges laid back to back in a bounce buffer at ``base``: each range's offset in
    it, and the ``(range, bounce address, length)`` rows by device."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    rows: dict[str, list[Row]] = {}
    for address, n, at, device in zip(addresses, lengths.tolist(), starts.tolist(), devices,
                                      strict=True):
        rows.setdefault(device, []).append((address, base + at, n))
    return starts, rows


def move(rows: dict[str, list[Row]], to_device: bool) -> None:
    """Every device's rows, by its copier: onto the devices, or off them."""
    for device, dev_rows in rows.items():
        mover = copier(device)
        (mover.to_device if to_device else mover.to_host)(dev_rows)


def host_buffer(nbytes: int, device: str) -> np.ndarray:
    """Host memory for staging ``device``'s bytes: page-locked (pinned) where CUDA
    copies them, so that its copies run at full speed and truly asynchronously; plain
    memory for an installed copier or where pinning fails."""
    with _lock:
        cuda = device.startswith("cuda") and device not in _installed
    if cuda:
        try:
            from transfer_engine import gpu  # lazy: needs CUDA

            cp = gpu.require_cuda()
            pinned = cp.cuda.alloc_pinned_memory(nbytes)
            return np.ndarray((nbytes,), dtype=np.uint8, buffer=pinned)  # as cupyx's
        except Exception:  # noqa: BLE001 - no cupy: torch's pinned memory, else plain
            pass
        try:
            import torch

            if torch.cuda.is_available():  # the array keeps the tensor alive
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        except Exception:  # noqa: BLE001 - no room to pin: plain memory works
            pass
    return np.empty(nbytes, dtype=np.uint8)


# One thread block per row: 16-byte loads and stores where the row allows, bytes
# elsewhere. A batch of small device-to-device rows (a KV block per layer, K and V
# apart) costs one launch instead of a runtime call per row.
_GATHER = r"""
extern "C" __global__ void te_gather(const unsigned long long* rows, int n) {
    int r = blockIdx.x;
    if (r >= n) return;
    unsigned char* d = (unsigned char*)rows[r];
    const unsigned char* s = (const unsigned char*)rows[n + r];
    unsigned long long len = rows[2 * n + r];
    if ((((unsigned long long)d | (unsigned long long)s | len) & 15ULL) == 0) {
        uint4* d4 = (uint4*)d;
        const uint4* s4 = (const uint4*)s;
        for (unsigned long long i = threadIdx.x; i < (len >> 4); i += blockDim.x)
            d4[i] = s4[i];
    } else {
        for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
    }
}
"""
GATHER_MIN_ROWS = 8  # fewer rows: a runtime copy each
GATHER_MAX_MEAN = 1 << 20  # larger rows: the runtime's copies use the whole device


def _synchronize(event: Any, device: str) -> None:
    """Waits for the copies before ``event`` (cupy's or torch's); ``TransferError`` if
    they failed."""
    try:
        event.synchronize()
    except Exception as exc:  # the runtime's errors, whichever library raised them
        raise TransferError(f"{device} copy failed: {exc}") from exc


class CudaCopier:
    """cupy's runtime copies on a stream of the device's own."""

    _D2H, _H2D, _DEFAULT = 2, 1, 4  # cudaMemcpyKind
    _gather: Any = None  # the compiled kernel; False once it failed

    def __init__(self, device: str) -> None:
        from transfer_engine import gpu  # lazy: needs CUDA

        self._cp = gpu.require_cuda()
        self._index = int(device.partition(":")[2] or 0)
        with self._cp.cuda.Device(self._index):
            self._stream = self._cp.cuda.Stream(non_blocking=True)
        self._lock = threading.Lock()  # one request's copies at a time on the stream

    def _start(self, pieces: Sequence[Row], kind: int) -> Any:
        """Queues ``(destination, source, length)`` copies on the stream; the event
        after them."""
        cp = self._cp
        try:
            with self._lock, cp.cuda.Device(self._index):
                for dst, src, n in pieces:
                    cp.cuda.runtime.memcpyAsync(dst, src, n, kind, self._stream.ptr)
                event = cp.cuda.Event(disable_timing=True)
                event.record(self._stream)
            return event
        except Exception as exc:  # cupy's CUDARuntimeError and kin
            raise TransferError(f"cuda:{self._index} copy failed: {exc}") from exc

    def _wait(self, event: Any) -> None:
        _synchronize(event, f"cuda:{self._index}")

    def to_host(self, rows: Sequence[Row]) -> None:
        self.to_host_async(rows)()

    def to_device(self, rows: Sequence[Row]) -> None:
        self._wait(self._start(rows, self._H2D))  # (device, host): destination first

    def to_host_async(self, rows: Sequence[Row]) -> Callable[[], None]:
        """Starts ``rows``' copies off the device; returns what waits for them (and
        raises ``TransferError`` if they failed)."""
        event = self._start([(host, dev, n) for dev, host, n in rows], self._D2H)
        return lambda: self._wait(event)

    def between(self, rows: Sequence[Row], on_device: bool = False) -> None:
        """``(destination, source, length)`` rows, unified addressing picking the path
        (device to device over NVLink or PCIe, or either way with the host).
        ``on_device``: every row lies in this device's memory (its own or mapped), so
        many small rows go in one kernel launch."""
        if on_device and len(rows) >= GATHER_MIN_ROWS and self._gather is not False \
                and sum(n for _, _, n in rows) <= GATHER_MAX_MEAN * len(rows):
            try:
                self._gather_rows(rows)
                return
            except TransferError:
                raise
            except Exception as exc:  # noqa: BLE001 - no compiler here: runtime copies
                log.warning("cuda:%d: batched device copies unavailable (%s); copying "
                            "row by row", self._index, exc)
                CudaCopier._gather = False
        self._wait(self._start(rows, self._DEFAULT))

    def _gather_rows(self, rows: Sequence[Row]) -> None:
        cp = self._cp
        table = np.array(rows, dtype=np.uint64).T.copy()  # destinations, sources, lengths
        with self._lock, cp.cuda.Device(self._index):
            if CudaCopier._gather is None:
                CudaCopier._gather = cp.RawKernel(_GATHER, "te_gather")
            with self._stream:
                on_gpu = cp.asarray(table.reshape(-1))
                CudaCopier._gather((len(rows),), (256,), (on_gpu, np.int32(len(rows))))
                event = cp.cuda.Event(disable_timing=True)
                event.record(self._stream)
        self._wait(event)  # the row table (on_gpu) lives until the kernel is done

    def export_ipc(self, address: int, length: int) -> dict[str, Any]:
        from transfer_engine import gpu

        try:
            return gpu.export_ipc(address, length, self._index).to_wire()
        except TransferError:
            raise
        except Exception as exc:  # cupy's errors: no IPC for this memory
            raise TransferError(f"cuda:{self._index} IPC export failed: {exc}") from exc

    def open_ipc(self, handle: dict[str, Any]) -> tuple[int, int, Callable[[], None]]:
        from transfer_engine import gpu

        try:
            mapping = gpu.IpcMapping(gpu.IpcHandle.from_wire(handle))
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"cuda IPC open failed: {exc}") from exc
        return mapping.address, mapping.mapped, mapping.close


class _DeviceRange:
    """``n`` bytes of device memory at ``address``, as the CUDA array interface shows
    them (what ``torch.as_tensor`` takes without copying)."""

    def __init__(self, address: int, n: int) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (n,),
                                         "typestr": "|u1", "version": 3}


class TorchCopier:
    """Copies with torch where cupy is absent (as in a vLLM server): device ranges seen
    as tensors through the CUDA array interface, host ranges through ``frombuffer``,
    ``copy_`` on a stream of the device's own. No IPC: same-host peers stage."""

    def __init__(self, device: str) -> None:
        try:
            import torch
        except ImportError:
            raise NotSupportedError("neither cupy nor torch is importable") from None
        if not torch.cuda.is_available():
            raise NotSupportedError("torch finds no CUDA device")
        self._torch = torch
        self._device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()

    def _pairs(self, rows: Sequence[Row], to_device: bool) -> list[tuple[Any, Any]]:
        torch = self._torch
        out = []
        for dev, host, n in rows:
            d = torch.as_tensor(_DeviceRange(dev, n), device=self._device)
            h = torch.frombuffer((ctypes.c_uint8 * n).from_address(host), dtype=torch.uint8)
            out.append((d, h) if to_device else (h, d))
        return out

    def _start(self, rows: Sequence[Row], to_device: bool) -> Any:
        torch = self._torch
        try:
            with self._lock, torch.cuda.stream(self._stream):
                for dst, src in self._pairs(rows, to_device):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return event
        except Exception as exc:  # torch's RuntimeError and kin
            raise TransferError(f"{self._device} copy failed: {exc}") from exc

    def _wait(self, event: Any) -> None:
        _synchronize(event, str(self._device))

    def to_host(self, rows: Sequence[Row]) -> None:
        self._wait(self._start(rows, False))

    def to_device(self, rows: Sequence[Row]) -> None:
        self._wait(self._start(rows, True))

    def to_host_async(self, rows: Sequence[Row]) -> Callable[[], None]:
        event = self._start(rows, False)
        return lambda: self._wait(event)


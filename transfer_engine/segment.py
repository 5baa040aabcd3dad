"""Registered memory: local segments and the peer's view of them.

A :class:`Segment` is made by :meth:`Engine.register` from a CPU torch tensor, a numpy
array, any writable buffer (bytearray, memoryview, mmap) or a raw ``(address, length)``.
It keeps the owning object alive while registered. Deregistering (``close()``) revokes
peer access: transfers already landing finish first (bounded wait; stalled ones are torn
down), later ones are refused with :class:`InvalidDescriptorError`. Ids are never
reused, so a stale id can never reach memory registered later.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from transfer_engine.errors import BusyError, InvalidDescriptorError, RegistrationError

__all__ = ["Segment", "RemoteSegment", "MemoryInfo", "describe_memory"]

REVOKE_GRACE = 2.0  # seconds for pins to drop once their transfers were torn down


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    address: int
    length: int
    device: str  # "cpu" or "cuda:N"
    writable: bool
    owner: Any  # kept alive while registered


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")  # never import torch ourselves
    return torch is not None and isinstance(obj, torch.Tensor)


def describe_memory(obj: Any, length: int | None = None) -> MemoryInfo:
    """Finds address, length and device of ``obj`` without copying it."""
    if (isinstance(obj, tuple) and len(obj) in (2, 3)
            and all(isinstance(v, int) for v in obj[:2])):
        address, nbytes = obj[:2]
        device = obj[2] if len(obj) == 3 else "cpu"
        if address <= 0 or nbytes <= 0:
            raise RegistrationError(f"raw memory needs address > 0 and length > 0, got {obj}")
        if device != "cpu" and not (isinstance(device, str) and device.startswith("cuda:")
                                    and device[5:].isdigit()):
            raise RegistrationError(f"raw memory's device must be 'cpu' or 'cuda:N', got "
                                    f"{device!r}")
        return MemoryInfo(address, nbytes, device, True, None)
    if _is_torch_tensor(obj):
        if not obj.is_contiguous():
            raise RegistrationError("tensor is not contiguous; register its base tensor")
        dev = str(obj.device)
        nbytes = obj.numel() * obj.element_size()
        if nbytes == 0:
            raise RegistrationError("tensor is empty")
        return MemoryInfo(obj.data_ptr(), nbytes, "cpu" if dev == "cpu" else dev, True, obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, readonly = cai["data"]
        itemsize = int(getattr(obj, "itemsize", 1))
        count = 1
        for dim in cai["shape"]:
            count *= int(dim)
        if cai.get("strides") not in (None,) and not getattr(obj, "flags", {}).get(
            "C_CONTIGUOUS", True
        ):
            raise RegistrationError("CUDA array is not contiguous")
        dev_id = int(getattr(getattr(obj, "device", None), "id", 0))
        return MemoryInfo(int(ptr), count * itemsize, f"cuda:{dev_id}", not readonly, obj)
    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise RegistrationError(
            f"cannot register {type(obj).__name__}: need a CPU tensor, numpy array, "
            "writable buffer or (address, length)"
        ) from exc
    if not view.c_contiguous:
        raise RegistrationError("buffer is not C-contiguous")
    view = view.cast("B")
    if view.nbytes == 0:
        raise RegistrationError("buffer is empty")
    if view.readonly:
        # Read-only memory can still be the source of a WRITE or the target of a READ.
        import numpy as np

        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        return MemoryInfo(address, view.nbytes, "cpu", False, obj)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return MemoryInfo(address, view.nbytes, "cpu", True, obj)


def _view_at(address: int, length: int, writable: bool) -> memoryview:
    view = memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
    return view if writable else view.toreadonly()


class Segment:
    """A registered region of local memory, addressable by peers while open.

    Every transfer that moves bytes in or out of it holds a *pin* (ours while our
    transfer uses it, the transport's while a peer's request lands or is read), and
    :meth:`close` hands the memory back only once no pin is left. A peer stalled
    mid-request cannot hold that off for ever: after the wait, the transfers still
    pinning it are torn down (``on_stuck``: the engine fails its own transfers as a
    cancel does, and asks every transport to ``revoke`` the segment, closing the
    connections serving it).

    What a torn-down WRITE into this segment leaves behind: any prefix of its bytes may
    have landed; its immediate was not counted, so no notification fired for it; the
    initiator's handle fails (``PeerLostError``). A torn-down READ from it sent the
    initiator a prefix at most, and its handle fails too.
    """

    __slots__ = (
        "id", "name", "address", "length", "device", "writable", "keys",
        "_owner", "_view", "_cond", "_pins", "_open", "_released", "_on_close",
        "_on_stuck", "close_timeout", "__weakref__",
    )

    def __init__(
        self,
        seg_id: int,
        name: str,
        info: MemoryInfo,
        on_close: Callable[[Segment], None] | None = None,
        on_stuck: Callable[[Segment], None] | None = None,
    ) -> None:
        self.id = seg_id
        self.name = name
        self.address = info.address
        self.length = info.length
        self.device = info.device
        self.writable = info.writable
        self.keys: dict[str, Any] = {}
        self._owner = info.owner
        self._view = (_view_at(info.address, info.length, info.writable)
                      if info.device == "cpu" else None)
        self._cond = threading.Condition()
        self._pins = 0
        self._open = True
        self._released = False
        self._on_close = on_close
        self._on_stuck = on_stuck
        self.close_timeout: float | None = 5.0  # close's, for what it waits on elsewhere

    @property
    def closed(self) -> bool:
        return not self._open

    @property
    def pins(self) -> int:
        """Transfers (ours or a peer's) using this segment now; ``close`` waits for 0."""
        return self._pins

    def check(self, offset: int, length: int, *, write: bool, op: str | None = None,
              peer: str | None = None) -> None:
        """Raises :class:`InvalidDescriptorError` unless the range may be accessed."""
        ctx: dict[str, Any] = dict(peer=peer, op=op, segment=self.name, offset=offset,
                                   length=length)
        if not self._open:
            raise InvalidDescriptorError("segment is deregistered", **ctx)
        if length <= 0:
            raise InvalidDescriptorError("zero or negative length", **ctx)
        if offset < 0 or offset + length > self.length:
            raise InvalidDescriptorError(
                f"range out of bounds of segment of {self.length} bytes", **ctx)
        if write and not self.writable:
            raise InvalidDescriptorError("segment is read-only", **ctx)

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A zero-copy byte view (CPU segments only)."""
        if self._view is None:
            raise RegistrationError("device memory has no host view", segment=self.name)
        end = self.length if length is None else offset + length
        return self._view[offset:end]

    def pin(self) -> None:
        """Holds off deregistration while bytes land in (or leave) this segment."""
        with self._cond:
            if not self._open:
                raise InvalidDescriptorError("segment is deregistered", segment=self.name)
            self._pins += 1

    def unpin(self) -> None:
        with self._cond:
            self._pins -= 1
            if self._pins == 0:
                self._cond.notify_all()

    @contextmanager
    def pinned(self) -> Iterator[Segment]:
        self.pin()
        try:
            yield self
        finally:
            self.unpin()

    def close(self, timeout: float | None = 5.0) -> None:
        """Deregisters: refuses new pins at once, waits up to ``timeout`` seconds
        (``None``: without bound) for the transfers using it, tears down those still
        there (``on_stuck``) and waits a little more (``timeout`` again, between 0.1 s
        and :data:`REVOKE_GRACE`), then revokes
        access and releases the memory. Raises :class:`BusyError` if pins remain even
        then; the segment stays closed to new transfers, and ``close()`` may be called
        again. Idempotent once it returned."""
        with self._cond:
            if self._released:
                return
            self.close_timeout = timeout
            self._open = False  # new pins are refused from here on
            drained = self._cond.wait_for(lambda: self._pins == 0, timeout)
        if not drained and self._on_stuck is not None:
            self._on_stuck(self)
        with self._cond:
            if self._released:
                return
            grace = REVOKE_GRACE if timeout is None else min(REVOKE_GRACE,
                                                             max(timeout, 0.1))
            if not drained and not self._cond.wait_for(lambda: self._pins == 0, grace):
                raise BusyError(f"{self._pins} transfers still use the segment after "
                                "tearing them down", segment=self.name)
            self._released = True
        if self._on_close is not None:
            self._on_close(self)
        self._view = None
        self._owner = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "OPEN" if self._open else "CLOSED"
        return (f"<Segment {self.name!r} id={self.id} {self.device} {self.length}B "
                f"{'rw' if self.writable else 'ro'} {state}>")

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "length": self.length,
                "device": self.device, "writable": self.writable, "keys": self.keys}


@dataclass(frozen=True, slots=True)
class RemoteSegment:
    """A peer's segment as its metadata describes it."""

    peer: str
    id: int
    name: str
    length: int
    device: str = "cpu"
    writable: bool = True
    keys: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_wire(cls, peer: str, data: dict[str, Any]) -> RemoteSegment:
        """Raises ``ValueError``, ``KeyError`` or ``TypeError`` for a description no
        engine sends: ids and lengths outside what the planner's int64 columns hold,
        names that are not short strings."""
        seg_id, length, name = data["id"], data["length"], data["name"]
        for what, value in (("id", seg_id), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) \
                    or not 0 <= value < 1 << 63:
                raise ValueError(f"segment {what} {value!r:.40} is not an integer in "
                                 "[0, 2**63)")
        if not isinstance(name, str) or not 0 < len(name) <= 4096:
            raise ValueError(f"segment name {name!r:.40} is not a string of 1 to 4096 "
                             "characters")
        return cls(peer, seg_id, name, length, str(data.get("device", "cpu")),
                   bool(data.get("writable", True)), dict(data.get("keys", {})))

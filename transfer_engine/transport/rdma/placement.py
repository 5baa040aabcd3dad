"""Which NICs a segment is registered on, and the route settings of a queue pair.

A memory region on a NIC that never carries it costs pinned-page bookkeeping on that
NIC and, for GPU memory, a dma-buf import; traffic to memory on another socket or
behind another PCIe switch crosses the inter-socket link or the host bridge. So a
segment is registered on the NICs nearest its memory (:func:`memory_location` and
``topology.nearest_nics``), and transfers are carried by rails whose NICs hold the
regions of both sides. Where no rail does (the peer's memory sits near a NIC our
nearest one does not pair with), the local segment is registered once more on a NIC
that reaches the peer's region: slower than a near NIC, never a failed transfer.

Route settings (RoCE GID index, traffic class, service level) come from the
transport's arguments, else ``$TE_RDMA_GID_INDEX``, ``$TE_RDMA_TRAFFIC_CLASS``,
``$TE_RDMA_SERVICE_LEVEL``; a value out of range is refused when the transport is made.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from transfer_engine.errors import NotSupportedError, RegistrationError
from transfer_engine.segment import Segment
from transfer_engine.transport.rdma.plan import MrKey

__all__ = ["PLACEMENTS", "MrTable", "RouteSettings", "memory_node", "memory_location",
           "placement_of"]

PLACEMENTS = ("nearest", "all")
_MOVE_PAGES = 279  # x86_64; other architectures answer "unknown" (see memory_node)
_libc = ctypes.CDLL(None, use_errno=True)


def memory_node(address: int, length: int) -> int:
    """The NUMA node holding most of the sampled pages of ``[address, address+length)``
    (first, middle, last), or -1 when unknown: pages not yet touched, no NUMA, or a
    kernel or architecture without ``move_pages``. Never raises, never faults a page in.
    """
    if length <= 0 or os.uname().machine != "x86_64":
        return -1
    page = mmap.PAGESIZE
    first = address - address % page
    last = address + length - 1
    points = sorted({first, first + (last - first) // 2 // page * page,
                     last - last % page})
    count = len(points)
    pages = (ctypes.c_void_p * count)(*points)
    status = (ctypes.c_int * count)()
    rc = _libc.syscall(_MOVE_PAGES, 0, ctypes.c_ulong(count), pages, None, status, 0)
    if rc != 0:
        return -1
    nodes = [s for s in status if s >= 0]
    if not nodes:
        return -1
    return max(set(nodes), key=nodes.count)


def memory_location(address: int, length: int, device: str) -> str:
    """``topology`` location of a segment's memory: ``"cuda:N"`` for GPU memory,
    ``"cpu:N"`` for host memory on NUMA node N, ``"cpu"`` when the node is unknown."""
    if device != "cpu":
        return device
    node = memory_node(address, length)
    return f"cpu:{node}" if node >= 0 else "cpu"


def placement_of(value: str | None) -> str:
    """The registration policy: ``"nearest"`` (default) or ``"all"`` (every NIC)."""
    chosen = value or os.environ.get("TE_RDMA_PLACEMENT") or "nearest"
    if chosen not in PLACEMENTS:
        raise NotSupportedError(f"unknown RDMA placement {chosen!r}; known: "
                                f"{list(PLACEMENTS)}", transport="rdma")
    return chosen


def _setting(value: int | None, env: str, low: int, high: int, what: str) -> int | None:
    if value is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return None
        try:
            value = int(text, 0)
        except ValueError:
            raise ValueError(f"${env}={text!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """How this host's queue pairs address their peers: the GID table index (None:
    the device picks a RoCE v2 one), the IP traffic class (DSCP << 2 | ECN) of a
    global route, and the InfiniBand service level (also the RoCE priority on most
    fabrics)."""

    gid_index: int | None = None
    traffic_class: int = 0
    service_level: int = 0

    @classmethod
    def resolve(cls, gid_index: int | None = None, traffic_class: int | None = None,
                service_level: int | None = None) -> RouteSettings:
        gid = _setting(gid_index, "TE_RDMA_GID_INDEX", 0, 0xFFFF, "gid_index")
        tc = _setting(traffic_class, "TE_RDMA_TRAFFIC_CLASS", 0, 255, "traffic_class")
        sl = _setting(service_level, "TE_RDMA_SERVICE_LEVEL", 0, 15, "service_level")
        return cls(gid, tc or 0, sl or 0)


class MrTable:
    """The memory regions of every registered segment, per device: registration on the
    chosen devices (all or nothing), one more device on demand, and the lookups rails
    and the side channel make. Thread-safe."""

    def __init__(self, devices: Sequence[Any]) -> None:
        self._lock = threading.Lock()
        self._mrs: dict[int, dict[str, tuple[Any, MrKey, MrKey]]] = {}
        self._local_keys: dict[str, dict[int, MrKey]] = {d.name: {} for d in devices}

    def register(self, segment: Segment, devices: Sequence[Any]) -> dict[str, list[int]]:
        """Registers ``segment`` on each of ``devices``; the published ``mrs`` entry
        (device -> [base, length, rkey]). Nothing stays registered if one fails."""
        done: dict[str, tuple[Any, MrKey, MrKey]] = {}
        try:
            for dev in devices:
                done[dev.name] = _region(dev, segment)
        except RegistrationError:
            for mr, _, _ in done.values():
                mr.close()
            raise
        with self._lock:
            self._mrs.setdefault(segment.id, {}).update(done)
            for name, (_, lkey, _) in done.items():
                self._local_keys[name][segment.id] = lkey
        return {name: [r.base, r.length, r.key] for name, (_, _, r) in done.items()}

    def extend(self, segment: Segment, device: Any) -> bool:
        """Registers ``segment`` on ``device`` too, unless it is there already or no
        longer registered at all; True when it is there afterwards."""
        with self._lock:
            held = self._mrs.get(segment.id)
            if held is None:
                return False
            if device.name in held:
                return True
        entry = _region(device, segment)
        with self._lock:
            held = self._mrs.get(segment.id)
            if held is None or device.name in held:  # deregistered or raced meanwhile
                keep = held is not None
            else:
                held[device.name] = entry
                self._local_keys[device.name][segment.id] = entry[1]
                return True
        entry[0].close()
        return keep

    def deregister(self, segment_id: int) -> None:
        with self._lock:
            done = self._mrs.pop(segment_id, {})
            for name in done:
                self._local_keys[name].pop(segment_id, None)
        for mr, _, _ in done.values():
            mr.close()  # later remote access fails with REM_ACCESS_ERR at the initiator

    def close(self) -> None:
        with self._lock:
            ids = list(self._mrs)
        for sid in ids:
            self.deregister(sid)

    def local_keys(self, device: str) -> dict[int, MrKey]:
        return self._local_keys[device]

    def holds(self, device: str, segment_ids: Iterable[int]) -> bool:
        keys = self._local_keys[device]
        return all(sid in keys for sid in segment_ids)

    def devices_of(self, segment_id: int) -> list[str]:
        with self._lock:
            return list(self._mrs.get(segment_id, {}))

    def remote_keys(self, device: str, ids: Iterable[int] | None) -> dict[int, list[int]]:
        """What the side channel sends: ``{id: [base, length, rkey]}`` on ``device``."""
        wanted = None if ids is None else set(ids)
        with self._lock:
            return {sid: [r.base, r.length, r.key] for sid, d in self._mrs.items()
                    if (wanted is None or sid in wanted) and device in d
                    for r in (d[device][2],)}


def _region(dev: Any, segment: Segment) -> tuple[Any, MrKey, MrKey]:
    mr, base = dev.register(segment.address, segment.length, segment.device,
                            writable=segment.writable, segment=segment.name)
    return mr, MrKey(base, segment.length, mr.lkey), MrKey(base, segment.length, mr.rkey)

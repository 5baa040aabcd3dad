"""GPU memory between processes of one host: device IPC on the shm rails.

Host memory goes between shm peers by cross-memory attach: the target copies between
the initiator's announced ranges and its own checked segments. Device memory goes the
same way, with the device's IPC instead of the kernel: the initiator exports each of its
device segments (a CUDA IPC handle, ``devmem`` ``export_ipc``) and announces them on the
rail (:func:`encode_devices`, ``KIND_DEVICES``); the target maps an announced segment the
first time a request names it (:class:`PeerDevices`) and copies between the mapping and
its own rows, device or host, with one device copy each (``devmem`` ``between``:
device to device over NVLink or PCIe, no host bounce on either side).

What is checked is what cross-memory attach checks: the target's own rows against its
segments (the stream server), the initiator's rows against the ranges it announced
(writable ones only for a READ, whose bytes the target writes into the initiator's
memory). Mappings close with the rail. Where the initiator cannot export (no IPC in its
copier) or the target serves from a serving process (no device runtime there), the
engine stages device memory through host bounces instead (:mod:`transfer_engine.staging`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from transfer_engine import devmem
from transfer_engine.errors import (
    InvalidDescriptorError,
    NotSupportedError,
    ProtocolError,
    TransferError,
)
from transfer_engine.segment import Segment
from transfer_engine.transport.stream.targets import Targets
from transfer_engine.transport.stream.wire import HEADER, KIND_DEVICES, MAX_BODY

__all__ = ["DeviceTable", "PeerDevices", "encode_devices", "ipc_copy"]

log = logging.getLogger(__name__)

MAX_DEVICE_SEGMENTS = 4096


@dataclass(frozen=True, slots=True)
class DeviceRange:
    """A device segment the initiator announced: its addresses and its IPC handle."""

    start: int
    length: int
    writable: bool
    device: str
    handle: Any  # the exporting copier's wire form


class DeviceTable:
    """Our device segments that peers on this host may map (the initiator's side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, DeviceRange] = {}
        self.version = 0

    def add(self, segment: Segment) -> bool:
        """Exports ``segment`` for IPC; False (and nothing kept) where its device's
        copier cannot."""
        try:
            export = devmem.copier(segment.device).export_ipc  # type: ignore[attr-defined]
            handle = export(segment.address, segment.length)
        except (AttributeError, TransferError) as exc:
            log.debug("no device IPC for %s (%s): staged through host memory",
                      segment.name, exc)
            return False
        with self._lock:
            self._entries[segment.id] = DeviceRange(segment.address, segment.length,
                                                    segment.writable, segment.device,
                                                    handle)
            self.version += 1
        return True

    def remove(self, segment_id: int) -> None:
        with self._lock:
            if self._entries.pop(segment_id, None) is not None:
                self.version += 1

    def has(self, segment_id: int) -> bool:
        return segment_id in self._entries

    def announcement(self) -> tuple[int, bytes]:
        with self._lock:
            return self.version, encode_devices(list(self._entries.values()))


def encode_devices(entries: Sequence[DeviceRange]) -> bytes:
    body: bytes = msgpack.packb([[e.start, e.length, e.writable, e.device, e.handle]
                                 for e in entries])
    return HEADER.pack(KIND_DEVICES, 0, 0, 0, 0, len(body), 0, 0, 0) + body


def _decode(body: bytes, peer: str) -> list[DeviceRange]:
    try:
        rows = msgpack.unpackb(body)
        if not isinstance(rows, list) or len(rows) > MAX_DEVICE_SEGMENTS:
            raise ValueError("not a list of at most 4096 entries")
        out = []
        for row in rows:
            start, length, writable, device, handle = row
            if not (isinstance(start, int) and isinstance(length, int) and 0 < start
                    and 0 < length and start + length < 1 << 64
                    and isinstance(device, str) and device.startswith("cuda:")):
                raise ValueError(f"bad entry {row!r:.80}")
            out.append(DeviceRange(start, length, bool(writable), device, handle))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed device announcement: {exc}", peer=peer,
                            transport="shm") from None
    return sorted(out, key=lambda e: e.start)


class PeerDevices:
    """The device segments one initiator announced on a rail, and their mappings in
    this process (opened on first use, closed with the rail). An initiator in this very
    process (two engines in one, as the kernel's credentials vouch) needs no mapping:
    CUDA refuses to open a process's own handles, and its addresses are valid here."""

    def __init__(self, peer: str, same_process: bool = False) -> None:
        self.peer = peer
        self._same_process = same_process
        self._ranges: list[DeviceRange] = []
        self._starts = np.empty(0, dtype=np.uint64)
        self._maps: dict[tuple[int, int], tuple[int, int, Callable[[], None]]] = {}
        # the last request's answer: the server asks once to stage, once to copy
        self._last: tuple[Any, bool, list[tuple[int, int, str]] | None] = (None, False, None)

    def announce(self, body: bytes) -> None:
        if len(body) > MAX_BODY:
            raise ProtocolError("device announcement too large", peer=self.peer)
        ranges = _decode(body, self.peer)
        keep = {(e.start, e.length) for e in ranges}
        for key in [k for k in self._maps if k not in keep]:
            self._maps.pop(key)[2]()
        self._ranges = ranges
        self._starts = np.array([e.start for e in ranges], dtype=np.uint64)
        self._last = (None, False, None)

    def translate(self, local: np.ndarray, writable: bool
                  ) -> list[tuple[int, int, str]] | None:
        """The initiator's ``(address, length)`` rows as ``(mapped address, length,
        device)`` in this process; None when a row is not in an announced device
        segment (writable when ``writable``)."""
        if not self._ranges or not len(local):
            return None
        last, was_writable, answer = self._last
        if last is local and was_writable == writable:
            return answer
        out = self._translate(local, writable)
        self._last = (local, writable, out)
        return out

    def _translate(self, local: np.ndarray, writable: bool
                   ) -> list[tuple[int, int, str]] | None:
        if local.dtype.names:  # the wire's (address, length) records
            addresses, lengths = local["address"], local["length"]
        else:
            addresses, lengths = local[:, 0], local[:, 1]
        found = np.searchsorted(self._starts, addresses.astype(np.uint64),
                                side="right").astype(np.int64) - 1
        if len(found) and found.min() < 0:
            return None
        out = []
        bases: dict[int, int] = {}
        for address, length, i in zip(addresses.tolist(), lengths.tolist(), found.tolist(),
                                      strict=True):
            entry = self._ranges[i]
            if (address + length > entry.start + entry.length or length <= 0
                    or (writable and not entry.writable)):
                return None
            base = bases.get(i)
            if base is None:
                base = bases[i] = self._map(entry) - entry.start
            out.append((base + address, length, entry.device))
        return out

    def _map(self, entry: DeviceRange) -> int:
        if self._same_process:
            return entry.start
        key = (entry.start, entry.length)
        got = self._maps.get(key)
        if got is None:
            try:
                opener = devmem.copier(entry.device).open_ipc  # type: ignore[attr-defined]
                got = opener(entry.handle)
            except (AttributeError, TransferError, ValueError) as exc:
                raise NotSupportedError(f"cannot map the peer's {entry.device} memory "
                                        f"here: {exc}", peer=self.peer,
                                        transport="shm") from None
            if got[1] < entry.length:  # an announcement larger than its memory
                got[2]()
                raise InvalidDescriptorError(
                    f"announced device segment of {entry.length} bytes maps only "
                    f"{got[1]}", peer=self.peer, transport="shm")
            self._maps[key] = got
        return got[0]

    def close(self) -> None:
        for _, _, closer in self._maps.values():
            try:
                closer()
            except Exception:  # noqa: BLE001 - a mapping that will not close: logged
                log.exception("closing a device mapping of %s", self.peer)
        self._maps.clear()


def ipc_copy(views: Targets, theirs: list[tuple[int, int, str]], write_to_peer: bool,
             peer: str, op: str) -> None:
    """Copies between our ``views`` rows and the initiator's mapped rows, in byte order
    (one device copy per overlapping piece), with the initiator's device copier."""
    ours = views.iov.tolist()
    if sum(n for _, n in ours) != sum(n for _, n, _ in theirs):
        raise InvalidDescriptorError("shm request sizes disagree", peer=peer, op=op,
                                     transport="shm")
    pieces: list[devmem.Row] = []  # (destination, source, length)
    i = j = 0
    at_ours = at_theirs = 0
    while i < len(ours) and j < len(theirs):
        oa, on = ours[i]
        ta, tn, _ = theirs[j]
        n = min(on - at_ours, tn - at_theirs)
        mine, their = oa + at_ours, ta + at_theirs
        pieces.append((their, mine, n) if write_to_peer else (mine, their, n))
        at_ours += n
        at_theirs += n
        if at_ours == on:
            i, at_ours = i + 1, 0
        if at_theirs == tn:
            j, at_theirs = j + 1, 0
    device = theirs[0][2]
    on_device = (all(t[2] == device for t in theirs)
                 and all(seg.device == device for seg in views.segments.values()))
    try:
        devmem.copier(device).between(pieces, on_device)  # type: ignore[attr-defined]
    except TransferError as exc:
        raise exc.with_context(peer=peer, op=op, transport="shm") from None
    except AttributeError:
        raise NotSupportedError(f"{theirs[0][2]} has no device-to-device copy here",
                                peer=peer, op=op, transport="shm") from None

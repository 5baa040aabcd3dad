"""Where a served request's bytes land or come from: :class:`Targets`, and
:func:`stage`, which puts a host bounce in place of device memory.

A stream server moves bytes with system calls (``recvmsg``, ``sendmsg``,
``process_vm_readv``) that reach host memory only. A request whose target ranges lie in
device memory is served through a bounce buffer of its own: a READ's ranges are copied
off the device into it before the payload is sent, a WRITE's payload lands in it and is
copied onto the device before the answer (so the initiator's success means the bytes
are on the device), with the device's copier (:mod:`transfer_engine.devmem`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NoReturn

import numpy as np

from transfer_engine import devmem
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    BusyError,
    InvalidDescriptorError,
    NotSupportedError,
    TransferError,
)
from transfer_engine.segment import Segment
from transfer_engine.staging import STAGING_ENV, limit_bytes

__all__ = ["Targets", "check_entries", "pin", "refuse", "stage", "unstage"]

_budget = threading.Lock()
_held = [0]  # bytes of server bounces in use, all connections together


class Targets:
    """Where one request's bytes land (or come from) in the target's memory, checked
    and pinned: ``iov`` rows of (address, length) for gathered I/O, and the same ranges
    as memoryviews when iterated (made on demand: the fast paths never need them).
    ``headroom``, when set, is ``iov`` with a spare row in front (for an answer's head)."""

    __slots__ = ("iov", "nbytes", "headroom", "keep", "_segs", "_ids")

    def __init__(self, iov: np.ndarray, nbytes: int, segs: dict[int, Segment],
                 ids: np.ndarray | None = None, headroom: np.ndarray | None = None) -> None:
        self.iov = iov
        self.headroom = headroom
        self.keep: object = None  # what must live as long as the rows (a bounce)
        self.nbytes = nbytes
        self._segs = segs
        self._ids = ids  # each row's segment id; None: every row is in the one segment

    def __len__(self) -> int:
        return len(self.iov)

    @property
    def segments(self) -> dict[int, Segment]:
        """The request's segments by id."""
        return self._segs

    @property
    def ids(self) -> np.ndarray | None:
        """Each row's segment id; None when every row is in the one segment."""
        return self._ids

    def __iter__(self) -> Iterator[memoryview]:
        if not len(self.iov):
            return
        ids = ([next(iter(self._segs))] * len(self.iov) if self._ids is None
               else self._ids.tolist())
        bases = {i: (seg.view(), seg.address) for i, seg in self._segs.items()}
        for seg_id, (address, length) in zip(ids, self.iov.tolist(), strict=True):
            view, base = bases[seg_id]
            yield view[address - base:address - base + length]


def stage(views: Targets, op: Op, peer: str | None = None
          ) -> tuple[Targets, Callable[[], None] | None]:
    """``views`` itself when all of it is host memory; else the same bytes in a bounce
    and, for a WRITE, what copies them onto the device once they landed. A READ's bytes
    are in the bounce on return. The copier's ``TransferError`` names the peer."""
    segs = views.segments
    if all(seg.device == "cpu" for seg in segs.values()):
        return views, None
    nbytes = views.nbytes
    limit = limit_bytes()
    with _budget:  # a bounce per request: bounded, whatever the peers ask for
        if _held[0] + nbytes > limit:
            raise BusyError(f"device staging of {nbytes} bytes would pass "
                            f"${STAGING_ENV}={limit} (in use: {_held[0]})",
                            peer=peer, op=str(op))
        _held[0] += nbytes
    try:
        return _stage(views, op, peer)
    except BaseException:
        _give(nbytes)
        raise


def unstage(views: Targets) -> None:
    """Hands a staged request's bounce back (once); nothing for host memory."""
    if isinstance(views.keep, np.ndarray):
        size = views.nbytes
        views.keep = None
        _give(size)


def _give(nbytes: int) -> None:
    with _budget:
        _held[0] -= nbytes


def _stage(views: Targets, op: Op, peer: str | None
           ) -> tuple[Targets, Callable[[], None] | None]:
    segs = views.segments
    iov = views.iov
    lengths = iov[:, 1].astype(np.int64)
    bounce = np.empty(max(1, views.nbytes), dtype=np.uint8)
    base = bounce.ctypes.data
    ids = views.ids
    devices = ([next(iter(segs.values())).device] * len(lengths) if ids is None
               else [segs[i].device for i in ids.tolist()])
    starts, rows = devmem.bounce_rows(iov[:, 0].tolist(), lengths, devices, base)
    out = np.empty((len(lengths) + 1, 2), dtype=np.uint64)
    out[1:, 0] = starts + base
    out[1:, 1] = lengths
    staged = Targets(out[1:], views.nbytes, {}, headroom=out)
    staged.keep = bounce

    def copy(to_device: bool) -> None:
        try:
            devmem.move(rows, to_device)
        except TransferError as exc:
            raise exc.with_context(peer=peer, op=str(op)) from None
    if op is Op.READ:
        copy(False)
        return staged, None
    return staged, lambda: copy(True)


def check_entries(peer: str, seg: Segment, rows: np.ndarray, write: bool, op: str,
                  low: list[int] | None = None, high: list[int] | None = None) -> None:
    """Raises the segment's precise error for the first (segment, offset, length) row it
    may not serve; ``low``/``high`` are the rows' column minima and maxima if known.

    Rows are unsigned: each bound is checked before the sum that could wrap.
    """
    limit = seg.length
    low = rows.min(axis=0).tolist() if low is None else low
    high = rows.max(axis=0).tolist() if high is None else high
    if (seg.writable or not write) and low[2] > 0 and (
            high[1] + high[2] <= limit  # the largest offset and length still fit
            or (high[1] <= limit and high[2] <= limit
                and int((rows[:, 1] + rows[:, 2]).max()) <= limit)):
        return
    refuse(peer, seg, rows[:, 1:].tolist(), write, op)


def refuse(peer: str, seg: Segment, ranges: Iterable[Sequence[int]], write: bool,
           op: str) -> NoReturn:
    """Raises the segment's precise error for the first (offset, length) range it may not
    serve, once the fast bounds check has failed."""
    for offset, length in ranges:
        seg.check(offset, length, write=write, op=op, peer=peer)
    raise InvalidDescriptorError("request refused", peer=peer, op=op,
                                 segment=seg.name)


def pin(segs: dict[int, Segment], pinned: list[Segment], peer: str, op: str,
        transport: str, stages_device: bool) -> None:
    """Pins ``segs`` into ``pinned``, refusing device memory a transport that cannot
    stage it would serve; raises (nothing pinned) otherwise."""
    for seg in segs.values():
        if seg.device != "cpu" and not stages_device:
            raise NotSupportedError(f"{seg.device} memory is not reachable over {transport}",
                                    peer=peer, op=op, transport=transport, segment=seg.name)
    try:
        for seg in segs.values():
            seg.pin()
            pinned.append(seg)
    except TransferError:
        for seg in pinned:
            seg.unpin()
        pinned.clear()
        raise

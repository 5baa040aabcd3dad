"""Device memory over transports that reach host memory only: staging through host
bounce buffers.

The initiator's side (:class:`Staging`, one per engine): a transfer whose local segments
are device memory, going over a transport without ``device_memory`` (tcp, shm), is
rewritten to move the same bytes from (WRITE) or into (READ) a bounce segment, a host
buffer the engine registered for this; a WRITE's bytes are copied off the device in
pieces, each before it is sent (later pieces are copied while earlier ones are on the
wire), a READ's onto it after the last has landed and before the transfer counts as
done. Bounce segments (pinned where CUDA copies them, ``devmem.host_buffer``)
are kept for reuse by size (powers of two from 1 MiB)
up to ``$TE_STAGING_BYTES`` (default 1 GiB) in all; a transfer that would need more
fails with ``BusyError`` and moves nothing.

The target's side is :func:`transfer_engine.transport.stream.targets.stage` (a stream
server copies a request's device ranges through a buffer of its own).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer_engine import devmem
from transfer_engine.descriptor import Op
from transfer_engine.errors import BusyError, TransferError
from transfer_engine.planner import Columns
from transfer_engine.segment import Segment

__all__ = ["Staging", "Staged", "STAGING_ENV", "limit_bytes"]

STAGING_ENV = "TE_STAGING_BYTES"
_MIN_BOUNCE = 1 << 20
CHUNK = 4 << 20  # bytes per asynchronous copy off the device (see Staged.to_host)


def limit_bytes() -> int:
    """``$TE_STAGING_BYTES``: the bounce bytes in use an engine's staging, and a stream
    server's, may reach (default 1 GiB)."""
    return int(os.environ.get(STAGING_ENV, "") or (1 << 30))


def _once(wait: Callable[[], None]) -> Callable[[], None]:
    """``wait`` run at most once; later calls return, or raise its error again."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        if not outcome:
            try:
                wait()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)
        if outcome[0] is not None:
            raise outcome[0]
    return run


@dataclass
class Staged:
    """One transfer's staging: its bounce segment and the device ranges it stands for,
    one :data:`devmem.Row` list per device. A WRITE's copies off the device may still
    run: ``pending`` holds, by bounce offset, what waits for each piece."""

    bounce: Segment
    rows: dict[str, list[devmem.Row]]
    release: Callable[[], None]
    done: bool = field(default=False)
    pending: list[tuple[int, Callable[[], None]]] = field(default_factory=list)

    def to_host(self) -> None:
        """Starts the copies off the device: asynchronous pieces of ``CHUNK`` bytes
        where the copier can (so that the first piece is sent while later ones are
        copied), else all of them now."""
        base = self.bounce.address
        for device, rows in self.rows.items():
            mover = devmem.copier(device)
            start_async = getattr(mover, "to_host_async", None)
            if start_async is None:
                mover.to_host(rows)
                continue
            piece: list[devmem.Row] = []
            size = 0
            for dev, host, n in rows:  # pieces of CHUNK bytes, a long row cut up
                while n > 0:
                    take = min(n, CHUNK - size)
                    piece.append((dev, host, take))
                    dev, host, n, size = dev + take, host + take, n - take, size + take
                    if size >= CHUNK:
                        self.pending.append((piece[0][1] - base,
                                             _once(start_async(piece))))
                        piece, size = [], 0
            if piece:
                self.pending.append((piece[0][1] - base, _once(start_async(piece))))
        self.pending.sort(key=lambda p: p[0])

    def ready_for(self, local: Any) -> None:
        """Waits for the copies of the bounce bytes a work sends (its ``local``
        extents); raises the copier's ``TransferError``."""
        if not self.pending:
            return
        offset = getattr(local, "offset", None)
        if offset is not None:
            end = int((offset + local.length).max()) if len(offset) else 0
        else:
            end = max((off + n for _, off, n in local), default=0)
        for start, wait in self.pending:
            if start >= end:
                break
            wait()

    def to_device(self) -> None:
        """A READ's landed bytes onto the device (and host ranges); raises the
        copier's ``TransferError``."""
        devmem.move(self.rows, to_device=True)

    def finish(self) -> None:
        """Hands the bounce back (once), when no copy into it runs any more."""
        if not self.done:
            self.done = True
            for _, wait in self.pending:
                try:
                    wait()
                except TransferError:
                    pass  # the transfer failed already; the bounce is quiet now
            self.release()


class Staging:
    """The engine's bounce segments, made with ``register`` and kept for reuse."""

    def __init__(self, register: Callable[[np.ndarray, str], Segment],
                 limit: int | None = None) -> None:
        self._register = register
        self._limit = limit if limit is not None else limit_bytes()
        self._lock = threading.Lock()
        self._free: dict[int, list[Segment]] = {}
        self._total = 0
        self._count = 0
        self._closed = False

    @property
    def total_bytes(self) -> int:
        """Bytes of bounce segments made so far (free or in use)."""
        return self._total

    def stage(self, op: Op, extents: Columns, segments: Sequence[Segment]
              ) -> tuple[Columns, Staged]:
        """``extents`` moved to a bounce segment (the same remote side, the local side
        laid out back to back in the bounce), and the staging that stands for it. A
        WRITE's copies off the device are under way on return (``Staged.ready_for``
        waits for a work's). Raises ``BusyError`` (bounces full)
        or the copier's ``TransferError``; nothing is held then."""
        nbytes = extents.nbytes
        device = next((s.device for s in segments if s.device != "cpu"), "cpu")
        bounce = self._take(nbytes, device)
        staged: Staged | None = None
        try:
            lengths = extents.length.astype(np.int64, copy=False)
            by_id = {seg.id: seg for seg in segments}
            owners = [by_id[sid] for sid in extents.lseg.tolist()]  # host ones copied too
            starts, rows = devmem.bounce_rows(
                [seg.address + off for seg, off in zip(owners, extents.loff.tolist(),
                                                      strict=True)],
                lengths, [seg.device for seg in owners], bounce.address)
            staged = Staged(bounce, rows, lambda: self._give(bounce))
            if op is Op.WRITE:
                staged.to_host()
            local = np.full(len(lengths), bounce.id, dtype=np.int64)
            cols = Columns(local, starts, extents.rseg, extents.roff, extents.length,
                           single=bool(extents.single), nbytes=nbytes, block=extents.block)
            return cols, staged
        except BaseException:
            if staged is not None:
                staged.finish()  # once no copy into the bounce runs
            else:
                self._give(bounce)
            raise

    def _take(self, nbytes: int, device: str) -> Segment:
        size = max(_MIN_BOUNCE, 1 << max(0, (nbytes - 1).bit_length()))
        with self._lock:
            if self._closed:
                raise BusyError("staging is closed")
            free = self._free.get(size)
            if free:
                return free.pop()
            if self._total + size > self._limit:
                raise BusyError(f"staging {nbytes} bytes of device memory would take "
                                f"{self._total + size} bytes of bounce buffers, past "
                                f"${STAGING_ENV}={self._limit}")
            self._total += size
            self._count += 1
            name = f"te-staging-{self._count}"
        try:
            return self._register(devmem.host_buffer(size, device), name)
        except BaseException:
            with self._lock:
                self._total -= size
            raise

    def _give(self, bounce: Segment) -> None:
        with self._lock:
            if not self._closed and not bounce.closed:
                self._free.setdefault(bounce.length, []).append(bounce)
                return
        bounce.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs = [s for free in self._free.values() for s in free]
            self._free.clear()
        for seg in segs:
            seg.close()

"""How the kvstore client moves bytes: registered memory, staging, and one engine
WRITE or READ per storage node.

Values move between the caller's registered buffers (or the client's staging buffer,
for plain bytes) and the nodes' segments with the engine's one-sided operations: the
values of a batch on one node are one :class:`Blocks` transfer per local segment, all
nodes at once. A node on the client's own engine is copied in place. A node whose
transfer fails is skipped for a while, so the next reads go to other replicas.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.client_state import I64, ClientState, Job
from kvstore.errors import InvalidArgumentError, ObjectUnavailableError
from transfer_engine import Blocks
from transfer_engine.errors import TransferEngineError, TransferTimeout
from transfer_engine.handle import TransferHandle
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["Transfers", "memory_view", "buffer_span", "staging_pieces", "STAGING_KEEP"]

log = logging.getLogger("kvstore.client")  # the client's log, as its other lines

STAGING_KEEP = 64 << 20
"""Staging a client keeps between calls when its ``staging_bytes`` is smaller: gets of
more are read in pieces (see :func:`staging_pieces`)."""


def memory_view(address: int, length: int) -> memoryview:
    """A view of ``length`` bytes at ``address`` (registered memory we were given)."""
    return memoryview((ctypes.c_uint8 * length).from_address(address)).cast("B")


def buffer_span(obj: Any, writable: bool) -> tuple[int, int]:
    """``(address, length)`` of a contiguous buffer, without copying."""
    try:
        arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
    except (TypeError, ValueError, BufferError) as exc:
        raise InvalidArgumentError(f"not a contiguous buffer: {type(obj).__name__}") from exc
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError("buffers must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError("a get_into buffer must be writable")
    return int(arr.ctypes.data), int(arr.nbytes)


def staging_pieces(padded: I64, found: npt.NDArray[np.bool_], keep: int) -> list[I64]:
    """The found keys split into runs of at most ``keep`` bytes of ``padded`` sizes, in
    batch order: what one staging buffer holds. A value larger than ``keep`` is a run of
    its own, after the others and largest first, so they share one buffer."""
    idx = np.flatnonzero(found)
    sizes = padded[idx]
    if int(sizes.sum()) <= keep:  # the usual case: the whole batch at once
        return [idx] if idx.size else []
    pieces: list[I64] = []
    start, total = 0, 0
    small = idx[sizes <= keep]
    for j, size in enumerate(padded[small].tolist()):
        if total and total + size > keep:
            pieces.append(small[start:j])
            start, total = j, 0
        total += size
    if small.size:
        pieces.append(small[start:])
    big = idx[sizes > keep]
    return pieces + [big[k:k + 1] for k in np.argsort(-padded[big], kind="stable")]


class Transfers(ClientState):
    """Mixed into :class:`kvstore.client.Client`: connections to the nodes, registered
    memory, and the transfers themselves."""

    def _peer(self, row: list[Any]) -> tuple[Peer, RemoteSegment]:
        name, incarnation, control, segment = (str(v) for v in row)
        cached = self._peers.get(name)
        if cached is not None and cached[0] == incarnation and cached[1].lost is None:
            peer = cached[1]
        else:
            peer = self.engine.connect(control, timeout=min(self.timeout, 3.0))
            self._peers[name] = (incarnation, peer)
        return peer, peer.segment(segment)

    def _node_failed(self, name: str, exc: BaseException) -> None:
        log.info("kvstore client: node %s failed: %s", name, exc)
        self._bad[name] = time.monotonic() + 2.0
        self._peers.pop(name, None)
        try:
            self.engine.peer_lost(name, f"kvstore: {exc}")
        except TransferEngineError:
            pass

    def _usable(self, name: str) -> bool:
        until = self._bad.get(name)
        return until is None or until < time.monotonic()

    def register_buffer(self, obj: Any) -> Segment:
        """Registers memory for zero-copy ``put_from``/``get_into`` (a numpy array, a
        writable buffer or ``(address, length)``); closing the returned segment
        deregisters it. A :class:`Segment` the client's engine already registered is
        used as it is (memory registered once for other transfers, e.g. a KV cache)."""
        with self._lock:
            if isinstance(obj, Segment):
                if self.engine.segments.get(obj.name) is not obj or obj.closed:
                    raise InvalidArgumentError(f"segment {obj.name!r} is not an open "
                                               "segment of this client's engine")
                seg = obj
            else:
                seg = self.engine.register(obj)
            start = int(seg.address)
            self._buffers = [b for b in self._buffers if not b[2].closed]
            bisect.insort(self._buffers, (start, start + int(seg.length), seg),
                          key=lambda b: b[0])
            return seg

    def _local(self, addrs: I64, lens: I64) -> list[tuple[Segment, int]]:
        """For each address: the registered segment holding ``[addr, addr+len)``."""
        starts = [b[0] for b in self._buffers]
        out: list[tuple[Segment, int]] = []
        for a, n in zip(addrs.tolist(), lens.tolist(), strict=True):
            i = bisect.bisect_right(starts, a) - 1
            if i < 0 or a + n > self._buffers[i][1] or self._buffers[i][2].closed:
                raise InvalidArgumentError(f"[{a:#x}, +{n}) is not inside a registered buffer "
                                           "(register_buffer)")
            seg = self._buffers[i][2]
            out.append((seg, a - int(seg.address)))
        return out

    def _stage(self, nbytes: int) -> tuple[np.ndarray, int]:
        """The staging buffer (at least ``nbytes``) and its address. It grows in powers
        of two up to the size kept between calls; a larger request gets a buffer of its
        own size, which :meth:`_trim_staging` gives back, and one left over is replaced
        as soon as a request fits the kept size again."""
        keep = self._staging_keep
        cur = self._staging
        if cur is None or cur.nbytes < nbytes or (cur.nbytes > keep and nbytes <= keep):
            self._drop_staging()
            size = max(self._staging_min, 1 << max(0, nbytes - 1).bit_length())
            if size > keep:
                size = max(nbytes, keep)
            staging = np.empty(size, dtype=np.uint8)
            staging.fill(0)  # fault the pages in once, not on every first use
            self._staging_seg = self.register_buffer(staging)
            self._staging = cur = staging
        return cur, int(cur.ctypes.data)

    def _staged(self, offset: int, length: int) -> bytes:
        """Bytes of the staging buffer. Callers read through this rather than keep the
        buffer in a local: a failed read's traceback holds their frame (often in a
        cycle, freed only by the collector), and would hold a large buffer with it."""
        assert self._staging is not None
        return self._staging[offset:offset + length].tobytes()

    def _trim_staging(self) -> None:
        """Gives back a staging buffer grown past the size kept between calls."""
        if self._staging is not None and self._staging.nbytes > self._staging_keep:
            self._drop_staging()

    def _drop_staging(self) -> None:
        if self._staging_seg is not None:
            self._staging_seg.close()
            self._buffers = [b for b in self._buffers if not b[2].closed]
        self._staging = None
        self._staging_seg = None

    def _move(self, write: bool, jobs: dict[int, list[Job]], nodes: list[Any],
              deadline: float, start_by: float | None = None) -> dict[int, BaseException]:
        """Runs one engine WRITE/READ per node: ``jobs[node]`` rows are ``(local addr,
        remote offset, length, tag)``. Returns the nodes that failed, with why."""
        handles, failed = self._post_moves(write, jobs, nodes, start_by=start_by)
        failed.update(self._wait_moves(handles, nodes, deadline))
        return failed

    def _post_moves(self, write: bool, jobs: dict[int, list[Job]],
                    nodes: list[Any], blame: bool = True, start_by: float | None = None
                    ) -> tuple[list[tuple[int, TransferHandle]], dict[int, BaseException]]:
        """Starts :meth:`_move`'s transfers (copies to a node on our own engine happen
        now); returns their handles and the nodes that failed already. ``blame``: a
        failed node is skipped for a while (else only its connection is dropped).
        ``start_by``: a transfer not posted by then is not posted (a put's space may
        be another's by then): the check comes after connecting, so that rails opened
        later than the node fenced us off never carry it."""
        failed: dict[int, BaseException] = {}
        handles: list[tuple[int, TransferHandle]] = []
        for node, items in jobs.items():
            items = [it for it in items if it[2] > 0]
            if not items:
                continue
            name = str(nodes[node][0])
            if name == self.engine.name:  # a node on our own engine: copy in place
                try:
                    self._copy_local(write, str(nodes[node][3]), items)
                except TransferEngineError as exc:
                    failed[node] = exc
                continue
            try:
                peer, remote = self._peer(nodes[node])
                if start_by is not None and time.monotonic() >= start_by:
                    failed[node] = TransferTimeout(
                        "the put's time to write passed before its write began",
                        peer=name, op="write")
                    continue
                arr = np.array([it[:3] for it in items], dtype=np.int64)
                locs = self._local(arr[:, 0], arr[:, 2])
                by_seg: dict[int, list[int]] = {}
                for k, (seg, _) in enumerate(locs):
                    by_seg.setdefault(seg.id, []).append(k)
                blocks = []
                for ks in by_seg.values():
                    seg = locs[ks[0]][0]
                    idx = np.array(ks)
                    blocks.append(Blocks(seg, remote, np.array([locs[k][1] for k in ks]),
                                         arr[idx, 1], arr[idx, 2]))
                op = self.engine.write if write else self.engine.read
                handles.append((node, op(peer, blocks)))
            except InvalidArgumentError:
                for _, handle in handles:  # nothing started may outlive the error
                    handle.cancel()
                raise
            except TransferEngineError as exc:
                failed[node] = exc
                self._failed(name, exc, blame)
        return handles, failed

    def _wait_moves(self, handles: list[tuple[int, TransferHandle]], nodes: list[Any],
                    deadline: float, blame: bool = True) -> dict[int, BaseException]:
        failed: dict[int, BaseException] = {}
        for node, handle in handles:
            try:
                handle.wait(max(0.001, deadline - time.monotonic()))
            except TransferEngineError as exc:
                handle.cancel()  # a late transfer must not touch buffers given back
                failed[node] = exc
                self._failed(str(nodes[node][0]), exc, blame)
        return failed

    def _failed(self, name: str, exc: BaseException, blame: bool) -> None:
        if blame:
            self._node_failed(name, exc)
        else:  # a guess gone wrong (e.g. the node restarted): reconnect when asked
            self._peers.pop(name, None)

    def _copy_local(self, write: bool, segment: str,
                    items: list[Job]) -> None:
        seg = self.engine.segments.get(segment)
        if seg is None or seg.closed:
            raise ObjectUnavailableError(f"local segment {segment!r} is gone")
        base = int(seg.address)
        self._local(np.array([it[0] for it in items], dtype=np.int64),
                    np.array([it[2] for it in items], dtype=np.int64))
        for addr, off, length, _ in items:
            if off < 0 or off + length > int(seg.length):
                raise ObjectUnavailableError(f"[{off}, +{length}) is outside {segment!r}")
            if write:
                ctypes.memmove(base + off, addr, length)
            else:
                ctypes.memmove(addr, base + off, length)

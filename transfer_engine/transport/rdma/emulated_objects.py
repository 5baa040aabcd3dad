"""The objects of the emulated verbs provider a transport holds: memory regions,
protection domains, completion queues and RC queue pairs, with the verbs rules each
enforces when it is created, posted to or moved between states, and :class:`Wire`, the
connection a queue pair's requests travel on. The NIC that owns them
(:class:`~transfer_engine.transport.rdma.emulated.Nic`) moves their work; what they use
of it is :class:`NicPort`."""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from transfer_engine.transport import held
from transfer_engine.transport.rdma.batch import WrBatch
from transfer_engine.transport.rdma.emulated_types import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_WRITE,
    MAX_MSG,
    AsyncEvent,
    QpState,
    VerbsError,
    WorkCompletion,
    wc_opcode,
)
from transfer_engine.transport.rdma.plan import Opcode, WcOpcode, WcStatus, WrSpec
from transfer_engine.transport.shm import cross_copy

__all__ = ["NicPort", "MemoryRegion", "ProtectionDomain", "CompletionQueue", "QueuePair",
           "Wire"]


class NicPort(Protocol):
    """What memory regions, protection domains, completion queues and queue pairs use of
    the NIC that owns them (:class:`~.emulated_nic_base.NicBase` provides it)."""

    lock: threading.RLock
    qps: dict[int, QueuePair]
    pending: set[QueuePair]
    stalled: set[Wire]
    max_qp_wr: int
    max_sge: int
    max_sge_rd: int

    def new_key(self) -> int: ...

    def new_qp_num(self) -> int: ...

    def add_mr(self, mr: MemoryRegion) -> None: ...

    def remove_mr(self, mr: MemoryRegion) -> None: ...

    def add_qp(self, qp: QueuePair) -> None: ...

    def remove_qp(self, qp: QueuePair) -> None: ...

    def raise_event(self, kind: int, element: int | None) -> None: ...

    def doorbell(self) -> None: ...

    def drop_wire(self, wire: Wire) -> None: ...


class MemoryRegion:
    """Registered memory: ``addr``..``addr+length`` with ``access`` under ``lkey``/``rkey``.

    ``MemoryRegion(pd, length, access)`` without ``address`` allocates the buffer (as
    pyverbs does); ``buf``/``read``/``write`` reach it."""

    def __init__(self, pd: ProtectionDomain, length: int, access: int,
                 address: int | None = None) -> None:
        if length <= 0:
            raise VerbsError("ibv_reg_mr", errno.EINVAL)
        if access & ACCESS_REMOTE_WRITE and not access & ACCESS_LOCAL_WRITE:
            raise VerbsError("ibv_reg_mr (remote write needs local write)", errno.EINVAL)
        self._own: Any = None
        if address is None:
            self._own = mmap.mmap(-1, length)
            address = ctypes.addressof(ctypes.c_char.from_buffer(self._own))
        elif not _mapped(address, length):
            raise VerbsError("ibv_reg_mr (memory not mapped)", errno.EFAULT)
        self.pd, self.buf, self.length, self.access = pd, address, length, access
        self.lkey = self.rkey = pd.nic.new_key()
        self._closed = False
        pd.nic.add_mr(self)

    def read(self, length: int, offset: int) -> bytes:
        if offset < 0 or offset + length > self.length:
            raise VerbsError("mr.read", errno.EINVAL)
        return ctypes.string_at(self.buf + offset, length)

    def write(self, data: bytes, length: int, offset: int) -> None:
        if offset < 0 or offset + length > self.length:
            raise VerbsError("mr.write", errno.EINVAL)
        ctypes.memmove(self.buf + offset, data, length)

    def close(self) -> None:
        """Deregisters: requests that reach the key afterwards fail (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.pd.nic.remove_mr(self)
        if self._own is not None:
            self._own = None  # the mapping is freed with the last reference


def _mapped(address: int, length: int) -> bool:
    """Whether the first and last byte of a range are readable (``ibv_reg_mr`` pins the
    pages and fails with EFAULT otherwise)."""
    probe = ctypes.create_string_buffer(1)
    try:
        for at in (address, address + length - 1):
            cross_copy(os.getpid(), [(ctypes.addressof(probe), 1)], [(at, 1)], write=False)
    except OSError:
        return False
    return True


class ProtectionDomain:
    def __init__(self, nic: NicPort) -> None:
        self.nic = nic

    def close(self) -> None:
        """Nothing of its own to free: its memory regions and queue pairs are closed by
        their owners (the NIC refuses them once closed)."""


class CompletionQueue:
    """``cqe`` entries; a full queue that must take one more overruns (``CQ_ERR``)."""

    def __init__(self, nic: NicPort, cqe: int) -> None:
        if cqe < 1:
            raise VerbsError("ibv_create_cq", errno.EINVAL)
        self.nic, self.depth = nic, cqe
        self.entries: collections.deque[WorkCompletion] = collections.deque()
        self.overrun = False
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # completion channel
        self._dirty = False
        self._closed = False

    def push(self, wc: WorkCompletion) -> None:
        """Adds one CQE (NIC lock held)."""
        if self.overrun:
            return
        if len(self.entries) >= self.depth:
            self.overrun = True
            self.nic.raise_event(AsyncEvent.CQ_ERR, None)
            for qp in list(self.nic.qps.values()):
                if qp.cq is self:
                    qp.to_error(flush=False)
            return
        self.entries.append(wc)
        self._dirty = True

    def signal(self) -> None:
        """Wakes the completion channel once for the CQEs added since the last call."""
        if self._dirty and not self._closed:
            self._dirty = False
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:
                pass

    def poll(self, n: int) -> list[WorkCompletion]:
        """Up to ``n`` CQEs, oldest first. Raises ``VerbsError`` after an overrun."""
        with self.nic.lock:
            if self.overrun:
                raise VerbsError("ibv_poll_cq (completion queue overrun)", errno.EIO)
            k = min(n, len(self.entries))
            return [self.entries.popleft() for _ in range(k)]

    def clear_channel(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except OSError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)


@dataclass(slots=True)
class _SendEntry:
    wr_id: int
    spec: WrSpec


@dataclass(slots=True)
class _RecvEntry:
    wr_id: int
    sges: tuple[tuple[int, int, int], ...]  # (addr, length, lkey)


class QueuePair:
    """An RC queue pair. Creation leaves it in RESET; ``to_init``/``to_rtr``/``to_rts``
    move it on, ``to_error`` (or a failed request) to ERR."""

    def __init__(self, pd: ProtectionDomain, cq: CompletionQueue, *, max_send_wr: int,
                 max_recv_wr: int, max_send_sge: int, max_recv_sge: int = 1) -> None:
        nic = pd.nic
        if not (0 < max_send_wr <= nic.max_qp_wr and 0 < max_recv_wr <= nic.max_qp_wr
                and 0 < max_send_sge <= nic.max_sge and 0 < max_recv_sge <= nic.max_sge):
            raise VerbsError("ibv_create_qp", errno.EINVAL)
        self.nic, self.pd, self.cq = nic, pd, cq
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge = max_send_sge, max_recv_sge
        self.state = QpState.RESET
        self.qp_num = nic.new_qp_num()
        self.remote: tuple[str, int] | None = None  # (gid, qp number) after RTR
        self.access = 0
        # posted chains, expanded into per-request entries by the NIC (not the poster)
        self.posted: collections.deque[tuple[int, WrBatch]] = collections.deque()
        self.sq: collections.deque[_SendEntry] = collections.deque()  # not yet issued
        self.outstanding = 0  # posted send entries not yet completed (issued or not)
        self.inflight: collections.deque[_SendEntry] = collections.deque()  # issued
        self.rq: collections.deque[_RecvEntry] = collections.deque()
        self.wire: Wire | None = None  # our requests' connection to the responder
        self._closed = False
        nic.add_qp(self)

    # state machine

    def to_init(self, port: int, access: int) -> None:
        self._modify(QpState.RESET, QpState.INIT, "to INIT")
        self.access = access

    def to_rtr(self, gid: str, qp_num: int) -> None:
        self._modify(QpState.INIT, QpState.RTR, "to RTR", remote=(gid, qp_num))

    def to_rts(self) -> None:
        self._modify(QpState.RTR, QpState.RTS, "to RTS")

    def _modify(self, frm: int, to: int, what: str,
                remote: tuple[str, int] | None = None) -> None:
        with self.nic.lock:
            if self._closed or self.state != frm:
                raise VerbsError(f"ibv_modify_qp {what} from "
                                 f"{QpState.NAMES[self.state]}", errno.EINVAL)
            self.state = to
            if remote is not None:
                self.remote = remote
        if to == QpState.RTS:
            self.nic.doorbell()

    def to_error(self, flush: bool = True) -> None:
        """Moves to ERR (NIC lock held): outstanding work completes with
        ``WR_FLUSH_ERR`` (unless the CQ itself overran)."""
        if self.state == QpState.ERR:
            return
        self.state = QpState.ERR
        if flush:
            self._flush()

    def expand(self) -> None:
        """Posted chains into the send queue's per-request entries (NIC lock held)."""
        while self.posted:
            wr_id, batch = self.posted.popleft()
            self.sq.extend(_SendEntry(wr_id, spec) for spec in batch.specs())

    def _flush(self) -> None:
        self.expand()
        for entry in (*self.inflight, *self.sq):
            self.cq.push(WorkCompletion(entry.wr_id, WcStatus.WR_FLUSH_ERR,
                                        wc_opcode(entry.spec.opcode), qp_num=self.qp_num))
        self.inflight.clear()
        self.sq.clear()
        self.outstanding = 0
        for rentry in self.rq:
            self.cq.push(WorkCompletion(rentry.wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV,
                                        qp_num=self.qp_num))
        self.rq.clear()

    # posting

    def post_send(self, wr_id: int, specs: Sequence[WrSpec] | WrBatch) -> None:
        """Posts a chain of requests under one ``wr_id`` with one doorbell. All or
        nothing: a request the queue pair cannot take fails the call (``EINVAL`` for a
        bad state, opcode or SGE count, ``ENOMEM`` when the send queue is full)."""
        batch = specs if isinstance(specs, WrBatch) else WrBatch.from_specs(specs)
        n = len(batch)
        single = n and int(batch.sge_end[-1]) == n  # one SGE each: nothing to count
        with self.nic.lock:
            if self._closed:
                raise VerbsError("ibv_post_send (destroyed QP)", errno.EINVAL)
            if n and not single:
                counts = np.diff(batch.sge_end, prepend=0)
                reads = batch.opcode == int(Opcode.READ)
                if (int(counts.max()) > self.max_send_sge
                        or bool((counts[reads] > self.nic.max_sge_rd).any())):
                    raise VerbsError("ibv_post_send (num_sge)", errno.EINVAL)
            sizes = batch.length if single else batch.nbytes
            if n and int(sizes.max()) > MAX_MSG:
                raise VerbsError("ibv_post_send (message size)", errno.EINVAL)
            if self.state not in (QpState.RTS, QpState.ERR):
                raise VerbsError(f"ibv_post_send in {QpState.NAMES[self.state]}",
                                 errno.EINVAL)
            if self.outstanding + n > self.max_send_wr:
                raise VerbsError("ibv_post_send (send queue full)", errno.ENOMEM)
            if self.state == QpState.ERR:
                for op in batch.opcode.tolist():
                    self.cq.push(WorkCompletion(wr_id, WcStatus.WR_FLUSH_ERR,
                                                wc_opcode(Opcode(op)), qp_num=self.qp_num))
                self.cq.signal()
                return
            self.posted.append((wr_id, batch))
            self.outstanding += n
            self.nic.pending.add(self)
        self.nic.doorbell()

    def post_recv(self, wr_id: int, sges: Sequence[tuple[int, int, int]]) -> None:
        """Posts one receive of ``(addr, length, lkey)`` entries."""
        with self.nic.lock:
            if self._closed or self.state == QpState.RESET:
                raise VerbsError("ibv_post_recv in RESET", errno.EINVAL)
            if len(sges) > self.max_recv_sge:
                raise VerbsError("ibv_post_recv (num_sge)", errno.EINVAL)
            if len(self.rq) >= self.max_recv_wr:
                raise VerbsError("ibv_post_recv (receive queue full)", errno.ENOMEM)
            if self.state == QpState.ERR:
                self.cq.push(WorkCompletion(wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV,
                                            qp_num=self.qp_num))
                self.cq.signal()
                return
            self.rq.append(_RecvEntry(wr_id, tuple(sges)))
            stalled = bool(self.nic.stalled)
        if stalled:
            self.nic.doorbell()  # a request waiting for a receive may go on

    def close(self) -> None:
        """Destroys the queue pair; its connection closes (idempotent). As on hardware,
        nothing lands in our memory once it returned: with READs outstanding, the
        responder (which copies their bytes into us) is told we hung up, and waited for
        (up to 5 s) to close its end."""
        with self.nic.lock:
            if self._closed:
                return
            self._closed = True
            self.state = QpState.ERR
            reading = any(e.spec.opcode is Opcode.READ for e in self.inflight)
            self.posted.clear()
            self.sq.clear()
            self.inflight.clear()
            self.rq.clear()
            wire = self.wire
        if wire is not None and reading:
            held.hang_up(wire.sock, 5.0)
        with self.nic.lock:
            self.wire = None
            self.nic.remove_qp(self)
        if wire is not None:
            self.nic.drop_wire(wire)


class Wire:
    """One connection between a requester QP and a responder QP (non-blocking)."""

    __slots__ = ("sock", "qp", "responder", "out", "inbuf", "pid", "seq", "hello",
                 "stalled")

    def __init__(self, sock: socket.socket, qp: QueuePair | None, responder: bool) -> None:
        self.sock, self.qp, self.responder = sock, qp, responder
        self.out = bytearray()
        self.inbuf = bytearray()
        self.pid = 0
        self.seq = 0
        self.hello = not responder  # a responder waits for the requester's hello
        self.stalled: tuple[int, int, float] | None = None  # (offset, seq, since)

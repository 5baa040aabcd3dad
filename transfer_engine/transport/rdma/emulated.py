"""An emulated verbs provider: RDMA semantics in user space, for machines without a NIC.

This is a stand-in, and the only one in the project: no RDMA NIC (and no Soft-RoCE,
which needs kernel modules) exists on the machines that build and test this code, so
the RDMA transport would otherwise never run. It provides the objects the transport
uses — device, protection domain, memory region, completion queue, RC queue pair — and
enforces the verbs rules a first run on hardware would hold the transport to:

- memory regions: access flags (remote write needs local write; a read-only region
  refuses RDMA WRITE), lkey/rkey lookups and bounds at the moment bytes move, and
  deregistration that later requests see (``REM_ACCESS_ERR``);
- queue pairs: the RESET -> INIT -> RTR -> RTS state machine (posting in another state
  is ``EINVAL``; in ERR work is accepted and flushed), ``max_send_wr``/``max_recv_wr``
  (``ENOMEM`` when full), ``max_send_sge``/``max_recv_sge`` (``EINVAL``), work processed
  in order per queue pair, a request consuming a receive for SEND and
  RDMA_WRITE_WITH_IMM (the immediate arrives with that receive's completion, in network
  byte order as verbs hands it), receiver-not-ready retries bounded by ``rnr_timeout``;
- errors: the first failed request completes with its status, the queue pair moves to
  ERR, and every other outstanding request, signaled or not, and every posted receive
  completes with ``WR_FLUSH_ERR``; a responder that refuses a key moves to ERR too;
- completion queues: ``cqe`` entries; one more is an overrun: an asynchronous
  ``CQ_ERR`` event, and the queue pairs on that queue move to ERR, as on hardware;
- the device can be failed (``Nic.fail``): a ``DEVICE_FATAL`` event and every queue pair
  in ERR, which is how a test loses a NIC.

How bytes move: each emulated NIC is a thread (``te-rdma-emu-<name>``), its "hardware".
Queue pairs of two NICs talk over a Unix stream socket in the abstract namespace (named
after the responder's GID, so nothing is left in the file system); only request
headers and acknowledgements travel there. The responder's NIC checks the rkey, bounds
and access against its own memory-region table and then copies directly between the
requester's memory and its own with ``process_vm_readv``/``process_vm_writev``
(cross-memory attach, the mechanism of the shm transport), taking the requester's
process from the kernel (``SO_PEERCRED``). So the responder's table is authoritative
at the moment of the copy, as a responder NIC's is, any memory the user registered
works (no need to allocate it in shared memory), and two engines in two processes
exchange real bytes. The requester's NIC checks its own lkeys and bounds before a
request leaves. The fabric spans one host and trusts its processes as far as the
kernel's ptrace rules already do; it is a test and development device, not a
security boundary beyond the key checks.

``copy=False`` makes the NIC a counting device: every check and completion happens,
no byte moves (its requests carry a flag the responder honours, so the requester's
setting decides). The bench uses it to measure the CPU time of the transport alone.

Not emulated: timing (a NIC's bandwidth and latency), PSN sequencing and
retransmission (the socket is reliable), atomics, memory windows, SRQs, UD.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import itertools
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_engine.errors import TransferEngineError
from transfer_engine.transport.rdma.batch import WrBatch
from transfer_engine.transport.rdma.plan import Opcode, WcOpcode, WcStatus, WrSpec
from transfer_engine.transport.shm import cross_copy, grant_attach, peer_credentials

__all__ = ["ACCESS_LOCAL_WRITE", "ACCESS_REMOTE_WRITE", "ACCESS_REMOTE_READ", "QpState",
           "AsyncEvent", "VerbsError", "WorkCompletion", "Nic", "ProtectionDomain",
           "MemoryRegion", "CompletionQueue", "QueuePair"]

log = logging.getLogger("transfer_engine.transport.rdma")

# enum ibv_access_flags
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4


class QpState:
    """``enum ibv_qp_state`` values."""

    RESET, INIT, RTR, RTS, SQD, SQE, ERR = range(7)
    NAMES = ("RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR")


class AsyncEvent:
    """``enum ibv_event_type`` values the emulation raises."""

    CQ_ERR = 0
    QP_FATAL = 1
    PORT_ERR = 10
    DEVICE_FATAL = 8


class VerbsError(TransferEngineError):
    """A verbs call failed; ``errno`` as the C library would set it (the emulated
    counterpart of pyverbs' ``PyverbsRDMAError``). Nothing was posted or changed."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed. Errno: {code}, {os.strerror(code)}")
        self.error_code = code


@dataclass(slots=True)
class WorkCompletion:
    """One CQE, with the fields of ``struct ibv_wc`` the transport reads."""

    wr_id: int
    status: int
    opcode: int
    vendor_err: int = 0
    byte_len: int = 0
    imm_data: int = 0  # network byte order, as verbs delivers it
    qp_num: int = 0
    wc_flags: int = 0  # 2 = IBV_WC_WITH_IMM


_WC_WITH_IMM = 2
_MAX_MSG = 1 << 31
_ISSUE_BATCH = 256  # requests a NIC turns into packets per queue pair and round


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
    def __init__(self, nic: Nic) -> None:
        self.nic = nic

    def close(self) -> None:
        """Nothing of its own to free: its memory regions and queue pairs are closed by
        their owners (the NIC refuses them once closed)."""


class CompletionQueue:
    """``cqe`` entries; a full queue that must take one more overruns (``CQ_ERR``)."""

    def __init__(self, nic: Nic, cqe: int) -> None:
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
        self.wire: _Wire | None = None  # our requests' connection to the responder
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
                                        _wc_opcode(entry.spec.opcode), qp_num=self.qp_num))
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
            if n and int(sizes.max()) > _MAX_MSG:
                raise VerbsError("ibv_post_send (message size)", errno.EINVAL)
            if self.state not in (QpState.RTS, QpState.ERR):
                raise VerbsError(f"ibv_post_send in {QpState.NAMES[self.state]}",
                                 errno.EINVAL)
            if self.outstanding + n > self.max_send_wr:
                raise VerbsError("ibv_post_send (send queue full)", errno.ENOMEM)
            if self.state == QpState.ERR:
                for op in batch.opcode.tolist():
                    self.cq.push(WorkCompletion(wr_id, WcStatus.WR_FLUSH_ERR,
                                                _wc_opcode(Opcode(op)), qp_num=self.qp_num))
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
        """Destroys the queue pair; its connection closes (idempotent)."""
        with self.nic.lock:
            if self._closed:
                return
            self._closed = True
            self.state = QpState.ERR
            self.posted.clear()
            self.sq.clear()
            self.inflight.clear()
            self.rq.clear()
            wire, self.wire = self.wire, None
            self.nic.remove_qp(self)
        if wire is not None:
            self.nic.drop_wire(wire)


def _wc_opcode(op: Opcode) -> int:
    return {Opcode.WRITE: WcOpcode.RDMA_WRITE, Opcode.WRITE_WITH_IMM: WcOpcode.RDMA_WRITE,
            Opcode.SEND: WcOpcode.SEND, Opcode.SEND_WITH_IMM: WcOpcode.SEND,
            Opcode.READ: WcOpcode.RDMA_READ}[op]


# --- the wire --------------------------------------------------------------------------

_HELLO = struct.Struct("<4sII16s")  # magic, source QP, destination QP, source GID
_HELLO_MAGIC = b"TEQP"
_REQ = struct.Struct("<BBHIQIIII")  # kind, opcode, nsge, seq, raddr, rkey, len, imm, flags
_FLAG_COUNT = 1  # the requester's NIC counts: check everything, copy nothing
_SGE = struct.Struct("<QQ")
_ACK = struct.Struct("<BBHII")  # kind, status, pad, seq, byte_len
_KIND_REQ, _KIND_ACK = 1, 2


def _gid_bytes(gid: str) -> bytes:
    return bytes.fromhex(gid.replace(":", ""))


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def _wire_name(gid: str) -> bytes:
    return b"\0te-rdma-emu-" + gid.replace(":", "").encode()


class _Wire:
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


class Nic:
    """One emulated RDMA device and the thread that is its hardware.

    :param name: device name (``emu0``).
    :param copy: move bytes (False: a counting device, every check but no copy).
    :param rnr_timeout: seconds a request waits for the responder to post a receive
        before it fails with ``RNR_RETRY_EXC_ERR``.
    """

    max_qp_wr = 16384
    max_sge = 30
    max_sge_rd = 30
    max_cqe = 1 << 20
    max_msg_size = _MAX_MSG
    mtu = 4096

    def __init__(self, name: str, *, copy: bool = True, rnr_timeout: float = 2.0) -> None:
        self._copy_fn = cross_copy
        self.name, self.copy, self.rnr_timeout = name, copy, rnr_timeout
        self.gid = "fe80:0000:0000:0000:" + ":".join(secrets.token_hex(2) for _ in range(4))
        self.lock = threading.RLock()
        self.qps: dict[int, QueuePair] = {}
        self.mrs: dict[int, MemoryRegion] = {}
        self.pending: set[QueuePair] = set()
        self.stalled: set[_Wire] = set()
        self.events: collections.deque[tuple[int, int | None]] = collections.deque()
        self.on_event: Callable[[], None] | None = None
        self.failed = False
        self.bytes_moved = 0  # as responder (counted in counting mode too)
        self.wrs_issued = 0  # send requests this NIC sent as requester
        self._keys = itertools.count(secrets.randbelow(1 << 20) + 1)
        self._qpns = itertools.count(secrets.randbelow(1 << 16) + 16)
        self._wires: dict[int, _Wire] = {}  # fd -> wire
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_wire_name(self.gid))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._poller = select.poll()
        self._poller.register(self._bell, select.POLLIN)
        self._poller.register(self._listener, select.POLLIN)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"te-rdma-emu-{name}",
                                        daemon=True)
        self._thread.start()

    # tables (lock held by callers or taken here)

    def new_key(self) -> int:
        return next(self._keys) & 0xFFFFFFFF

    def new_qp_num(self) -> int:
        return next(self._qpns) & 0xFFFFFF

    def add_mr(self, mr: MemoryRegion) -> None:
        with self.lock:
            self.mrs[mr.lkey] = mr

    def remove_mr(self, mr: MemoryRegion) -> None:
        with self.lock:
            self.mrs.pop(mr.lkey, None)

    def add_qp(self, qp: QueuePair) -> None:
        with self.lock:
            if self.failed:
                raise VerbsError("ibv_create_qp (device failed)", errno.EIO)
            self.qps[qp.qp_num] = qp

    def remove_qp(self, qp: QueuePair) -> None:
        self.qps.pop(qp.qp_num, None)
        self.pending.discard(qp)

    def raise_event(self, kind: int, element: int | None) -> None:
        self.events.append((kind, element))
        if self.on_event is not None:
            self.on_event()

    def doorbell(self) -> None:
        try:
            os.eventfd_write(self._bell, 1)
        except OSError:
            pass

    def fail(self) -> None:
        """Loses the device (a NIC pulled, a fatal firmware error): ``DEVICE_FATAL``
        and every queue pair in ERR with its work flushed."""
        with self.lock:
            self.failed = True
            cqs = set()
            for qp in list(self.qps.values()):
                qp.to_error()
                cqs.add(qp.cq)
            for cq in cqs:
                cq.signal()
            self.raise_event(AsyncEvent.DEVICE_FATAL, None)
        self.doorbell()

    def cpu_seconds(self) -> float:
        """CPU time of this NIC's thread: the emulated hardware's, which a bench of the
        transport's own cost leaves out."""
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:
            return 0.0

    def close(self) -> None:
        self._stopping = True
        self.doorbell()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        for wire in list(self._wires.values()):
            wire.sock.close()
        self._wires.clear()
        self._listener.close()
        os.close(self._bell)

    def drop_wire(self, wire: _Wire) -> None:
        """Closes a wire from any thread: the NIC thread notices on its next round."""
        try:
            wire.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.doorbell()

    # the hardware

    def _run(self) -> None:
        while not self._stopping:
            timeout = 50 if self.stalled else 1000
            try:
                ready = self._poller.poll(timeout)
            except InterruptedError:
                continue
            try:
                self._round(ready)
            except Exception:  # the device must outlive one bad packet
                log.exception("emulated NIC %s", self.name)

    def _round(self, ready: list[tuple[int, int]]) -> None:
        touched: set[CompletionQueue] = set()
        for fd, mask in ready:
            if fd == self._bell:
                try:
                    os.eventfd_read(self._bell)
                except OSError:
                    pass
            elif fd == self._listener.fileno():
                self._accept()
            else:
                wire = self._wires.get(fd)
                if wire is None:
                    continue
                if mask & select.POLLOUT:
                    self._flush(wire)
                if mask & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._receive(wire, touched)
        with self.lock:
            for wire in list(self.stalled):
                self._serve(wire, touched)
            self._reap()
            for qp in list(self.pending):
                self._issue(qp, touched)
        for wire in list(self._wires.values()):
            if wire.out:
                self._flush(wire)
        for cq in touched:
            cq.signal()

    def _reap(self) -> None:
        """Closes wires of destroyed queue pairs (lock held)."""
        for wire in list(self._wires.values()):
            qp = wire.qp
            if qp is not None and qp.qp_num not in self.qps:
                self._close_wire(wire)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            wire = _Wire(sock, None, responder=True)
            wire.pid = peer_credentials(sock)[0]
            self._add_wire(wire)

    def _add_wire(self, wire: _Wire) -> None:
        self._wires[wire.sock.fileno()] = wire
        self._poller.register(wire.sock, select.POLLIN)

    def _close_wire(self, wire: _Wire) -> None:
        fd = wire.sock.fileno()
        if fd >= 0:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
            self._wires.pop(fd, None)
        wire.sock.close()
        self.stalled.discard(wire)

    def _flush(self, wire: _Wire) -> None:
        try:
            n = wire.sock.send(wire.out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            wire.out.clear()
            return
        del wire.out[:n]
        if wire.sock.fileno() >= 0:
            mask = select.POLLIN | (select.POLLOUT if wire.out else 0)
            try:
                self._poller.modify(wire.sock, mask)
            except (KeyError, ValueError, OSError):
                pass

    def _receive(self, wire: _Wire, touched: set[CompletionQueue]) -> None:
        try:
            data = wire.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        with self.lock:
            if not data:
                self._lost(wire, touched)
                return
            wire.inbuf += data
            if wire.responder:
                self._serve(wire, touched)
            else:
                self._acks(wire, touched)

    def _lost(self, wire: _Wire, touched: set[CompletionQueue]) -> None:
        """The other end closed: a requester's outstanding work cannot be acknowledged
        any more (retries exceeded on hardware). Lock held."""
        qp = wire.qp
        self._close_wire(wire)
        if wire.responder or qp is None or qp.wire is not wire:
            return
        qp.wire = None
        qp.expand()
        if qp.state != QpState.ERR and (qp.inflight or qp.sq):
            first = (qp.inflight or qp.sq).popleft()
            qp.outstanding -= 1
            qp.cq.push(WorkCompletion(first.wr_id, WcStatus.RETRY_EXC_ERR,
                                      _wc_opcode(first.spec.opcode), qp_num=qp.qp_num))
            qp.to_error()
            touched.add(qp.cq)
        elif qp.state != QpState.ERR:
            qp.to_error()
            touched.add(qp.cq)

    # requester side

    def _connect(self, qp: QueuePair) -> _Wire | None:
        assert qp.remote is not None
        gid, qpn = qp.remote
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_wire_name(gid))
        except OSError:
            sock.close()
            return None
        grant_attach(peer_credentials(sock)[0])  # the responder copies our memory
        sock.setblocking(False)
        wire = _Wire(sock, qp, responder=False)
        wire.out += _HELLO.pack(_HELLO_MAGIC, qp.qp_num, qpn, _gid_bytes(self.gid))
        self._add_wire(wire)
        return wire

    def _issue(self, qp: QueuePair, touched: set[CompletionQueue]) -> None:
        """Turns posted requests into packets, checking local keys first (lock held)."""
        if qp.state != QpState.RTS or self.failed:
            self.pending.discard(qp)
            return
        qp.expand()
        if qp.wire is None:
            qp.wire = self._connect(qp)
            if qp.wire is None:  # nobody at that address: retries exceeded
                first = qp.sq.popleft()
                qp.outstanding -= 1
                qp.cq.push(WorkCompletion(first.wr_id, WcStatus.RETRY_EXC_ERR,
                                          _wc_opcode(first.spec.opcode), qp_num=qp.qp_num))
                qp.to_error()
                touched.add(qp.cq)
                self.pending.discard(qp)
                return
        wire = qp.wire
        for _ in range(_ISSUE_BATCH):
            if not qp.sq:
                self.pending.discard(qp)
                return
            entry = qp.sq.popleft()
            spec = entry.spec
            need = ACCESS_LOCAL_WRITE if spec.opcode is Opcode.READ else 0
            for sge in spec.sges:
                mr = self.mrs.get(sge.lkey)
                if (mr is None or sge.addr < mr.buf or sge.addr + sge.length > mr.buf + mr.length
                        or (mr.access & need) != need):
                    qp.outstanding -= 1
                    qp.cq.push(WorkCompletion(entry.wr_id, WcStatus.LOC_PROT_ERR,
                                              _wc_opcode(spec.opcode), qp_num=qp.qp_num))
                    qp.to_error()
                    touched.add(qp.cq)
                    self.pending.discard(qp)
                    return
            wire.seq = (wire.seq + 1) & 0xFFFFFFFF
            wire.out += _REQ.pack(_KIND_REQ, int(spec.opcode), len(spec.sges), wire.seq,
                                  spec.remote_addr, spec.rkey, spec.nbytes, spec.imm or 0,
                                  0 if self.copy else _FLAG_COUNT)
            self.wrs_issued += 1
            for sge in spec.sges:
                wire.out += _SGE.pack(sge.addr, sge.length)
            qp.inflight.append(entry)

    def _acks(self, wire: _Wire, touched: set[CompletionQueue]) -> None:
        qp = wire.qp
        buf = wire.inbuf
        pos = 0
        while len(buf) - pos >= _ACK.size:
            _, status, _, _seq, byte_len = _ACK.unpack_from(buf, pos)
            pos += _ACK.size
            if qp is None or qp.state == QpState.ERR or not qp.inflight:
                continue
            entry = qp.inflight.popleft()
            qp.outstanding -= 1
            if status != WcStatus.SUCCESS:
                qp.cq.push(WorkCompletion(entry.wr_id, status,
                                          _wc_opcode(entry.spec.opcode), qp_num=qp.qp_num))
                qp.to_error()
                touched.add(qp.cq)
                continue
            if entry.spec.signaled:
                qp.cq.push(WorkCompletion(entry.wr_id, WcStatus.SUCCESS,
                                          _wc_opcode(entry.spec.opcode), byte_len=byte_len,
                                          qp_num=qp.qp_num))
                touched.add(qp.cq)
        del buf[:pos]

    # responder side

    def _serve(self, wire: _Wire, touched: set[CompletionQueue]) -> None:
        """Executes complete requests in order (lock held); stops at one waiting for a
        receive (receiver not ready) until one is posted or ``rnr_timeout`` passes."""
        buf = wire.inbuf
        pos = 0
        if not wire.hello:
            if len(buf) < _HELLO.size:
                return
            magic, src_qpn, dst_qpn, gid = _HELLO.unpack_from(buf)
            qp = self.qps.get(dst_qpn)
            # an RC queue pair takes packets only from the queue pair it was connected to
            if (magic != _HELLO_MAGIC or qp is None or qp.remote != (_gid_str(gid), src_qpn)
                    or qp.state not in (QpState.RTR, QpState.RTS)):
                self._close_wire(wire)
                return
            wire.qp, wire.hello = qp, True
            pos = _HELLO.size
        qp = wire.qp
        assert qp is not None
        while len(buf) - pos >= _REQ.size:
            _, opcode, nsge, seq, raddr, rkey, length, imm, flags = _REQ.unpack_from(buf, pos)
            end = pos + _REQ.size + nsge * _SGE.size
            if len(buf) < end:
                break
            sges = [_SGE.unpack_from(buf, pos + _REQ.size + i * _SGE.size)
                    for i in range(nsge)]
            status = self._execute(qp, wire, Opcode(opcode), raddr, rkey, length, imm,
                                   sges, touched, copy=not flags & _FLAG_COUNT)
            if status is None:  # receiver not ready
                since = wire.stalled[2] if wire.stalled and wire.stalled[1] == seq else (
                    time.monotonic())
                if time.monotonic() - since < self.rnr_timeout:
                    wire.stalled = (pos, seq, since)
                    self.stalled.add(wire)
                    break
                status = WcStatus.RNR_RETRY_EXC_ERR
            wire.stalled = None
            self.stalled.discard(wire)
            wire.out += _ACK.pack(_KIND_ACK, status, 0, seq, length)
            pos = end
        del buf[:pos]
        if wire.out:
            self._flush(wire)

    def _execute(self, qp: QueuePair, wire: _Wire, op: Opcode, raddr: int, rkey: int,
                 length: int, imm: int, sges: list[tuple[int, int]],
                 touched: set[CompletionQueue], copy: bool = True) -> int | None:
        """One request against our memory; its status (None: no receive posted yet)."""
        if qp.state not in (QpState.RTR, QpState.RTS) or self.failed:
            return WcStatus.RETRY_EXC_ERR  # an ERR responder answers nothing
        if op in (Opcode.SEND, Opcode.SEND_WITH_IMM, Opcode.WRITE_WITH_IMM) and not qp.rq:
            return None
        if op in (Opcode.WRITE, Opcode.WRITE_WITH_IMM, Opcode.READ):
            need = ACCESS_REMOTE_READ if op is Opcode.READ else ACCESS_REMOTE_WRITE
            mr = self.mrs.get(rkey)
            if (mr is None or mr.pd is not qp.pd or not qp.access & need
                    or not mr.access & need or raddr < mr.buf
                    or raddr + length > mr.buf + mr.length):
                qp.to_error()  # the responder of a refused key goes to ERR as well
                touched.add(qp.cq)
                return WcStatus.REM_ACCESS_ERR
            if length and not self._move(wire.pid, [(raddr, length)], sges,
                                         to_requester=op is Opcode.READ, copy=copy):
                return WcStatus.REM_OP_ERR
        if op in (Opcode.SEND, Opcode.SEND_WITH_IMM, Opcode.WRITE_WITH_IMM):
            recv = qp.rq.popleft()
            wc = WorkCompletion(recv.wr_id, WcStatus.SUCCESS, WcOpcode.RECV, byte_len=length,
                                qp_num=qp.qp_num)
            if op is Opcode.WRITE_WITH_IMM:
                wc.opcode = WcOpcode.RECV_RDMA_WITH_IMM
            else:
                room = sum(n for _, n, _ in recv.sges)
                ok = all((mr := self.mrs.get(k)) is not None and mr.pd is qp.pd
                         and mr.access & ACCESS_LOCAL_WRITE and a >= mr.buf
                         and a + n <= mr.buf + mr.length for a, n, k in recv.sges)
                if length > room or not ok:
                    wc.status = (WcStatus.LOC_LEN_ERR if length > room
                                 else WcStatus.LOC_PROT_ERR)
                    qp.cq.push(wc)
                    qp.to_error()
                    touched.add(qp.cq)
                    return WcStatus.REM_INV_REQ_ERR if length > room else (
                        WcStatus.REM_OP_ERR)
                if length and not self._move(wire.pid, _take(recv.sges, length), sges,
                                             to_requester=False, copy=copy):
                    return WcStatus.REM_OP_ERR
            if op is not Opcode.SEND:
                wc.imm_data = socket.htonl(imm)
                wc.wc_flags = _WC_WITH_IMM
            qp.cq.push(wc)
            touched.add(qp.cq)
        return WcStatus.SUCCESS

    def _move(self, pid: int, ours: list[tuple[int, int]], theirs: list[tuple[int, int]],
              *, to_requester: bool, copy: bool) -> bool:
        self.bytes_moved += sum(n for _, n in ours)
        if not (self.copy and copy):
            return True
        try:
            self._copy_fn(pid, ours, theirs, write=to_requester)
        except OSError as exc:
            log.warning("emulated NIC %s: cross-memory copy failed: %s", self.name, exc)
            return False
        return True


def _take(sges: Sequence[tuple[int, int, int]], length: int) -> list[tuple[int, int]]:
    """The first ``length`` bytes of a receive's entries as (addr, length) ranges."""
    out = []
    for addr, n, _ in sges:
        if length <= 0:
            break
        k = min(n, length)
        out.append((addr, k))
        length -= k
    return out

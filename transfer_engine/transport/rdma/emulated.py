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

Where it lives: :mod:`.emulated_types` (verbs values), :mod:`.emulated_objects` (memory
regions, protection domains, completion queues, queue pairs), :mod:`.emulated_wire`
(the wire format) and the NIC: :mod:`.emulated_nic_base` (tables, events, wires),
:mod:`.emulated_requester`, :mod:`.emulated_responder` and, here, :class:`Nic` with its
thread.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time

from transfer_engine.transport.rdma.emulated_objects import (
    CompletionQueue,
    MemoryRegion,
    ProtectionDomain,
    QueuePair,
    Wire,
)
from transfer_engine.transport.rdma.emulated_requester import RequesterSide
from transfer_engine.transport.rdma.emulated_responder import ResponderSide
from transfer_engine.transport.rdma.emulated_types import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    AsyncEvent,
    QpState,
    VerbsError,
    WorkCompletion,
    wc_opcode,
)
from transfer_engine.transport.rdma.plan import WcStatus

__all__ = ["ACCESS_LOCAL_WRITE", "ACCESS_REMOTE_WRITE", "ACCESS_REMOTE_READ", "QpState",
           "AsyncEvent", "VerbsError", "WorkCompletion", "Nic", "ProtectionDomain",
           "MemoryRegion", "CompletionQueue", "QueuePair"]

log = logging.getLogger("transfer_engine.transport.rdma")


class Nic(RequesterSide, ResponderSide):
    """One emulated RDMA device and the thread that is its hardware.

    :param name: device name (``emu0``).
    :param copy: move bytes (False: a counting device, every check but no copy).
    :param rnr_timeout: seconds a request waits for the responder to post a receive
        before it fails with ``RNR_RETRY_EXC_ERR``.
    """

    def __init__(self, name: str, *, copy: bool = True, rnr_timeout: float = 2.0) -> None:
        super().__init__(name, copy=copy, rnr_timeout=rnr_timeout)
        self._thread = threading.Thread(target=self._run, name=f"te-rdma-emu-{name}",
                                        daemon=True)
        self._thread.start()

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

    def _receive(self, wire: Wire, touched: set[CompletionQueue]) -> None:
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

    def _lost(self, wire: Wire, touched: set[CompletionQueue]) -> None:
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
                                      wc_opcode(first.spec.opcode), qp_num=qp.qp_num))
            qp.to_error()
            touched.add(qp.cq)
        elif qp.state != QpState.ERR:
            qp.to_error()
            touched.add(qp.cq)

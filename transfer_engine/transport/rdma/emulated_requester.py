"""The requester side of an emulated NIC: connecting a queue pair to its responder,
turning posted work into request packets after checking local keys, and completing
requests as acknowledgements arrive."""

from __future__ import annotations

import socket

from transfer_engine.transport.rdma.emulated_nic_base import NicBase
from transfer_engine.transport.rdma.emulated_objects import CompletionQueue, QueuePair, Wire
from transfer_engine.transport.rdma.emulated_types import (
    ACCESS_LOCAL_WRITE,
    QpState,
    WorkCompletion,
    wc_opcode,
)
from transfer_engine.transport.rdma.emulated_wire import (
    ACK,
    FLAG_COUNT,
    HELLO,
    HELLO_MAGIC,
    KIND_REQ,
    REQ,
    SGE,
    gid_bytes,
    wire_name,
)
from transfer_engine.transport.rdma.plan import Opcode, WcStatus
from transfer_engine.transport.shm import grant_attach, peer_credentials

__all__ = ["RequesterSide"]

_ISSUE_BATCH = 256  # requests a NIC turns into packets per queue pair and round


class RequesterSide(NicBase):
    """An emulated NIC's requests: issued in order per queue pair, completed by the
    responder's acknowledgements."""

    def _connect(self, qp: QueuePair) -> Wire | None:
        assert qp.remote is not None
        gid, qpn = qp.remote
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(wire_name(gid))
        except OSError:
            sock.close()
            return None
        grant_attach(peer_credentials(sock)[0])  # the responder copies our memory
        sock.setblocking(False)
        wire = Wire(sock, qp, responder=False)
        wire.out += HELLO.pack(HELLO_MAGIC, qp.qp_num, qpn, gid_bytes(self.gid))
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
                                          wc_opcode(first.spec.opcode), qp_num=qp.qp_num))
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
                                              wc_opcode(spec.opcode), qp_num=qp.qp_num))
                    qp.to_error()
                    touched.add(qp.cq)
                    self.pending.discard(qp)
                    return
            wire.seq = (wire.seq + 1) & 0xFFFFFFFF
            wire.out += REQ.pack(KIND_REQ, int(spec.opcode), len(spec.sges), wire.seq,
                                 spec.remote_addr, spec.rkey, spec.nbytes, spec.imm or 0,
                                 0 if self.copy else FLAG_COUNT)
            self.wrs_issued += 1
            for sge in spec.sges:
                wire.out += SGE.pack(sge.addr, sge.length)
            qp.inflight.append(entry)

    def _acks(self, wire: Wire, touched: set[CompletionQueue]) -> None:
        qp = wire.qp
        buf = wire.inbuf
        pos = 0
        while len(buf) - pos >= ACK.size:
            _, status, _, _seq, byte_len = ACK.unpack_from(buf, pos)
            pos += ACK.size
            if qp is None or qp.state == QpState.ERR or not qp.inflight:
                continue
            entry = qp.inflight.popleft()
            qp.outstanding -= 1
            if status != WcStatus.SUCCESS:
                qp.cq.push(WorkCompletion(entry.wr_id, status,
                                          wc_opcode(entry.spec.opcode), qp_num=qp.qp_num))
                qp.to_error()
                touched.add(qp.cq)
                continue
            if entry.spec.signaled:
                qp.cq.push(WorkCompletion(entry.wr_id, WcStatus.SUCCESS,
                                          wc_opcode(entry.spec.opcode), byte_len=byte_len,
                                          qp_num=qp.qp_num))
                touched.add(qp.cq)
        del buf[:pos]

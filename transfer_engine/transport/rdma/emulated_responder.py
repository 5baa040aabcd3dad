"""The responder side of an emulated NIC: executing requests in order against its own
memory-region table (keys, bounds and access checked at the moment bytes move),
consuming receives, waiting out receiver-not-ready, and copying by cross-memory attach
between the requester's memory and its own."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence

from transfer_engine.transport import held
from transfer_engine.transport.rdma.emulated_nic_base import NicBase
from transfer_engine.transport.rdma.emulated_objects import CompletionQueue, QueuePair, Wire
from transfer_engine.transport.rdma.emulated_types import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    WC_WITH_IMM,
    QpState,
    WorkCompletion,
)
from transfer_engine.transport.rdma.emulated_wire import (
    ACK,
    FLAG_COUNT,
    HELLO,
    HELLO_MAGIC,
    KIND_ACK,
    REQ,
    SGE,
    gid_str,
)
from transfer_engine.transport.rdma.plan import Opcode, WcOpcode, WcStatus

__all__ = ["ResponderSide"]

log = logging.getLogger("transfer_engine.transport.rdma")


class ResponderSide(NicBase):
    """An emulated NIC's answers to the requests its wires carry."""

    def _serve(self, wire: Wire, touched: set[CompletionQueue]) -> None:
        """Executes complete requests in order (lock held); stops at one waiting for a
        receive (receiver not ready) until one is posted or ``rnr_timeout`` passes."""
        buf = wire.inbuf
        pos = 0
        if not wire.hello:
            if len(buf) < HELLO.size:
                return
            magic, src_qpn, dst_qpn, gid = HELLO.unpack_from(buf)
            qp = self.qps.get(dst_qpn)
            # an RC queue pair takes packets only from the queue pair it was connected to
            if (magic != HELLO_MAGIC or qp is None or qp.remote != (gid_str(gid), src_qpn)
                    or qp.state not in (QpState.RTR, QpState.RTS)):
                self._close_wire(wire)
                return
            wire.qp, wire.hello = qp, True
            pos = HELLO.size
        qp = wire.qp
        assert qp is not None
        while len(buf) - pos >= REQ.size:
            if held.hung_up(wire.sock):  # its queue pair is gone: nothing more is served
                self._close_wire(wire)
                return
            _, opcode, nsge, seq, raddr, rkey, length, imm, flags = REQ.unpack_from(buf, pos)
            end = pos + REQ.size + nsge * SGE.size
            if len(buf) < end:
                break
            sges = [SGE.unpack_from(buf, pos + REQ.size + i * SGE.size)
                    for i in range(nsge)]
            status = self._execute(qp, wire, Opcode(opcode), raddr, rkey, length, imm,
                                   sges, touched, copy=not flags & FLAG_COUNT)
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
            wire.out += ACK.pack(KIND_ACK, status, 0, seq, length)
            pos = end
        del buf[:pos]
        if wire.out:
            self._flush(wire)

    def _execute(self, qp: QueuePair, wire: Wire, op: Opcode, raddr: int, rkey: int,
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
                wc.wc_flags = WC_WITH_IMM
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

"""The emulated verbs provider holds the transport to the rules a NIC would.

Each test drives the provider's objects directly (two emulated NICs in this process,
bytes moving between them through cross-memory attach, as between two processes),
checking one verbs rule: keys and bounds, access flags, queue-pair states, queue and
SGE limits, ordering, immediates with their receives, error flushes, CQ overrun and a
lost device.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from transfer_engine.transport.rdma.emulated import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    ACCESS_REMOTE_WRITE,
    AsyncEvent,
    CompletionQueue,
    MemoryRegion,
    Nic,
    ProtectionDomain,
    QpState,
    QueuePair,
    VerbsError,
    WorkCompletion,
)
from transfer_engine.transport.rdma.plan import Opcode, Sge, WcOpcode, WcStatus, WrSpec

ALL = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ


@dataclass
class Side:
    nic: Nic
    pd: ProtectionDomain
    cq: CompletionQueue
    qp: QueuePair
    mem: np.ndarray
    mr: MemoryRegion

    def poll(self, n: int, timeout: float = 5.0) -> list[WorkCompletion]:
        out: list[WorkCompletion] = []
        deadline = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            out += self.cq.poll(n - len(out))
            time.sleep(0.001)
        return out


def _side(name: str, *, cqe: int = 256, send_wr: int = 64, recv_wr: int = 16,
          access: int = ALL, rnr: float = 2.0) -> Side:
    nic = Nic(name, rnr_timeout=rnr)
    pd = ProtectionDomain(nic)
    cq = CompletionQueue(nic, cqe)
    qp = QueuePair(pd, cq, max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=4)
    mem = np.random.default_rng(len(name)).integers(0, 256, 1 << 20, dtype=np.uint8)
    mr = MemoryRegion(pd, mem.nbytes, access, address=mem.ctypes.data)
    return Side(nic, pd, cq, qp, mem, mr)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    a, b = _side("ea"), _side("eb")
    _connect(a, b)
    yield a, b
    for s in (a, b):
        s.qp.close()
        s.mr.close()
        s.nic.close()
        s.cq.close()


def _connect(a: Side, b: Side) -> None:
    for s in (a, b):
        s.qp.to_init(1, ALL)
    a.qp.to_rtr(b.nic.gid, b.qp.qp_num)
    b.qp.to_rtr(a.nic.gid, a.qp.qp_num)
    a.qp.to_rts()
    b.qp.to_rts()


def _write(a: Side, b: Side, loff: int, roff: int, n: int, *, signaled: bool = True,
           imm: int | None = None, rkey: int | None = None) -> WrSpec:
    op = Opcode.WRITE if imm is None else Opcode.WRITE_WITH_IMM
    return WrSpec(op, (Sge(a.mr.buf + loff, n, a.mr.lkey),), b.mr.buf + roff,
                  b.mr.rkey if rkey is None else rkey, signaled, imm)


def test_write_read_and_multi_sge_move_bytes(pair: tuple[Side, Side]) -> None:
    a, b = pair
    sges = tuple(Sge(a.mr.buf + off, 1000, a.mr.lkey) for off in (0, 5000, 9000))
    a.qp.post_send(1, [WrSpec(Opcode.WRITE, sges, b.mr.buf + 100, b.mr.rkey, True)])
    (wc,) = a.poll(1)
    assert (wc.wr_id, wc.status, wc.opcode) == (1, WcStatus.SUCCESS, WcOpcode.RDMA_WRITE)
    gathered = np.concatenate([a.mem[0:1000], a.mem[5000:6000], a.mem[9000:10000]])
    assert np.array_equal(b.mem[100:3100], gathered)
    a.qp.post_send(2, [WrSpec(Opcode.READ, (Sge(a.mr.buf + 50000, 4096, a.mr.lkey),),
                              b.mr.buf + 70000, b.mr.rkey, True)])
    (wc,) = a.poll(1)
    assert wc.status == WcStatus.SUCCESS and wc.opcode == WcOpcode.RDMA_READ
    assert np.array_equal(a.mem[50000:54096], b.mem[70000:74096])


def test_only_signaled_requests_complete_and_in_order(pair: tuple[Side, Side]) -> None:
    a, b = pair
    specs = [_write(a, b, i * 4096, i * 4096, 4096, signaled=i % 8 == 7) for i in range(32)]
    a.qp.post_send(9, specs)
    wcs = a.poll(4)
    assert [wc.status for wc in wcs] == [WcStatus.SUCCESS] * 4
    time.sleep(0.05)
    assert a.cq.poll(10) == []
    assert np.array_equal(a.mem[:32 * 4096], b.mem[:32 * 4096])


def test_write_with_imm_consumes_a_receive_and_carries_the_immediate(
        pair: tuple[Side, Side]) -> None:
    a, b = pair
    b.qp.post_recv(77, [(b.mr.buf, 64, b.mr.lkey)])
    a.qp.post_send(1, [_write(a, b, 0, 4096, 512, imm=0x12345678)])
    (rwc,) = b.poll(1)
    assert (rwc.wr_id, rwc.opcode, rwc.byte_len) == (77, WcOpcode.RECV_RDMA_WITH_IMM, 512)
    assert socket.ntohl(rwc.imm_data) == 0x12345678  # network order, as verbs gives it
    assert a.poll(1)[0].status == WcStatus.SUCCESS


def test_send_lands_in_the_receive_buffer(pair: tuple[Side, Side]) -> None:
    a, b = pair
    b.qp.post_recv(5, [(b.mr.buf + 8192, 4096, b.mr.lkey)])
    a.qp.post_send(1, [WrSpec(Opcode.SEND_WITH_IMM, (Sge(a.mr.buf, 300, a.mr.lkey),), 0, 0,
                              True, 9)])
    (rwc,) = b.poll(1)
    assert rwc.opcode == WcOpcode.RECV and rwc.byte_len == 300
    assert socket.ntohl(rwc.imm_data) == 9
    assert np.array_equal(b.mem[8192:8492], a.mem[:300])


def test_receiver_not_ready_waits_for_a_receive_then_gives_up() -> None:
    a, b = _side("ra", rnr=0.3), _side("rb", rnr=0.3)
    try:
        _connect(a, b)
        a.qp.post_send(1, [_write(a, b, 0, 0, 8, imm=1)])
        time.sleep(0.1)
        b.qp.post_recv(3, [(b.mr.buf, 8, b.mr.lkey)])  # in time: it goes on
        assert b.poll(1)[0].wr_id == 3 and a.poll(1)[0].status == WcStatus.SUCCESS
        a.qp.post_send(2, [_write(a, b, 0, 0, 8, imm=2)])  # never a receive
        (wc,) = a.poll(1, timeout=5)
        assert wc.status == WcStatus.RNR_RETRY_EXC_ERR and a.qp.state == QpState.ERR
    finally:
        for s in (a, b):
            s.qp.close()
            s.nic.close()
            s.cq.close()


@pytest.mark.parametrize("case", ["bad_rkey", "out_of_bounds", "read_only", "deregistered"])
def test_remote_access_errors_flush_the_rest(pair: tuple[Side, Side], case: str) -> None:
    a, b = pair
    before = b.mem.copy()
    bad = {"bad_rkey": _write(a, b, 0, 0, 64, rkey=b.mr.rkey ^ 0x5A5A),
           "out_of_bounds": _write(a, b, 0, b.mem.nbytes - 10, 64),
           "read_only": None, "deregistered": None}[case]
    if case == "read_only":
        ro = MemoryRegion(b.pd, 4096, ACCESS_REMOTE_READ, address=b.mem.ctypes.data)
        bad = WrSpec(Opcode.WRITE, (Sge(a.mr.buf, 64, a.mr.lkey),), ro.buf, ro.rkey, True)
    if case == "deregistered":
        b.mr.close()
        bad = _write(a, b, 0, 0, 64)
    assert bad is not None
    b.qp.post_recv(1, [(b.mr.buf, 8, b.mr.lkey)])
    a.qp.post_send(1, [bad, _write(a, b, 0, 4096, 64, signaled=False),
                       _write(a, b, 0, 8192, 64)])
    wcs = a.poll(3)
    assert [wc.status for wc in wcs] == [WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR,
                                         WcStatus.WR_FLUSH_ERR]
    assert a.qp.state == QpState.ERR and b.qp.state == QpState.ERR
    assert [wc.status for wc in b.poll(1)] == [WcStatus.WR_FLUSH_ERR]  # its receive
    assert np.array_equal(b.mem, before)
    a.qp.post_send(2, [_write(a, b, 0, 0, 8)])  # ERR takes work and flushes it
    assert a.poll(1)[0].status == WcStatus.WR_FLUSH_ERR


def test_local_key_checked_before_the_request_leaves(pair: tuple[Side, Side]) -> None:
    a, b = pair
    before = b.mem.copy()
    a.qp.post_send(1, [WrSpec(Opcode.WRITE, (Sge(a.mr.buf, 64, a.mr.lkey + 1),),
                              b.mr.buf, b.mr.rkey, True)])
    assert a.poll(1)[0].status == WcStatus.LOC_PROT_ERR
    assert np.array_equal(b.mem, before)


def test_limits_and_states_refuse_at_post_time() -> None:
    a, b = _side("la", send_wr=4), _side("lb")
    try:
        with pytest.raises(VerbsError) as info:  # RESET: not yet connected
            a.qp.post_send(1, [_write(a, b, 0, 0, 8)])
        assert info.value.error_code == 22
        with pytest.raises(VerbsError):
            a.qp.to_rts()  # INIT -> RTS skips RTR
        _connect(a, b)
        with pytest.raises(VerbsError) as info:
            a.qp.post_send(1, [_write(a, b, 0, 0, 8)] * 5)  # max_send_wr = 4
        assert info.value.error_code == 12
        five = WrSpec(Opcode.WRITE, tuple(Sge(a.mr.buf, 8, a.mr.lkey) for _ in range(5)),
                      b.mr.buf, b.mr.rkey, True)
        with pytest.raises(VerbsError):
            a.qp.post_send(1, [five])  # max_send_sge = 4
        with pytest.raises(VerbsError):
            MemoryRegion(a.pd, 64, ACCESS_REMOTE_WRITE, address=a.mem.ctypes.data)
        for _ in range(16):
            b.qp.post_recv(1, [(b.mr.buf, 8, b.mr.lkey)])
        with pytest.raises(VerbsError):
            b.qp.post_recv(1, [(b.mr.buf, 8, b.mr.lkey)])  # max_recv_wr = 16
    finally:
        for s in (a, b):
            s.qp.close()
            s.nic.close()
            s.cq.close()


def test_completion_queue_overrun_is_an_error_event() -> None:
    a, b = _side("oa", cqe=4), _side("ob")
    try:
        _connect(a, b)
        a.qp.post_send(1, [_write(a, b, 0, i * 64, 64) for i in range(6)])  # 6 CQEs > 4
        deadline = time.monotonic() + 5
        while not a.cq.overrun and time.monotonic() < deadline:
            time.sleep(0.005)
        assert a.cq.overrun and (AsyncEvent.CQ_ERR, None) in a.nic.events
        assert a.qp.state == QpState.ERR
        with pytest.raises(VerbsError):
            a.cq.poll(1)
    finally:
        for s in (a, b):
            s.qp.close()
            s.nic.close()
            s.cq.close()


def test_a_failed_device_flushes_everything(pair: tuple[Side, Side]) -> None:
    a, b = pair
    b.qp.post_recv(4, [(b.mr.buf, 8, b.mr.lkey)])
    b.nic.fail()
    assert b.qp.state == QpState.ERR and (AsyncEvent.DEVICE_FATAL, None) in b.nic.events
    assert b.poll(1)[0].status == WcStatus.WR_FLUSH_ERR
    a.qp.post_send(1, [_write(a, b, 0, 0, 64)])
    assert a.poll(1)[0].status != WcStatus.SUCCESS  # the peer answers nothing


def test_only_the_connected_queue_pair_is_served(pair: tuple[Side, Side]) -> None:
    a, b = pair
    c = _side("ec")
    try:
        c.qp.to_init(1, ALL)
        c.qp.to_rtr(b.nic.gid, b.qp.qp_num)  # b is connected to a, not to c
        c.qp.to_rts()
        before = b.mem.copy()
        c.qp.post_send(1, [_write(c, b, 0, 0, 64)])
        assert c.poll(1)[0].status == WcStatus.RETRY_EXC_ERR
        assert np.array_equal(b.mem, before)
    finally:
        c.qp.close()
        c.mr.close()
        c.nic.close()
        c.cq.close()


def test_counting_device_checks_but_moves_nothing() -> None:
    a, b = _side("ca"), _side("cb")
    b.nic.copy = False
    try:
        _connect(a, b)
        before = b.mem.copy()
        a.qp.post_send(1, [_write(a, b, 0, 0, 4096)])
        assert a.poll(1)[0].status == WcStatus.SUCCESS
        assert np.array_equal(b.mem, before) and b.nic.bytes_moved == 4096
        a.qp.post_send(2, [_write(a, b, 0, b.mem.nbytes, 1)])
        assert a.poll(1)[0].status == WcStatus.REM_ACCESS_ERR
    finally:
        for s in (a, b):
            s.qp.close()
            s.nic.close()
            s.cq.close()

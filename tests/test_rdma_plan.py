"""The RDMA transport's pure half: immediates, work-request building, errors, QP info."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from transfer_engine.descriptor import Extent, Op
from transfer_engine.errors import (
    ClosedError,
    InvalidDescriptorError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from transfer_engine.planner import plan_transfer
from transfer_engine.transport.rdma.plan import (
    IMM_ID_BITS,
    MAX_EXPECTED,
    ImmUnwrapper,
    MrKey,
    Opcode,
    QpInfo,
    WcStatus,
    build_work_requests,
    decode_imm,
    encode_imm,
    mtu_bytes,
    mtu_enum,
    negotiate_mtu,
    pack_notify,
    random_psn,
    stripe_pairs,
    unpack_notify,
    unwrap_transfer_id,
    wc_error,
    wc_retryable,
)

MOD = 1 << IMM_ID_BITS


def test_module_does_not_import_pyverbs() -> None:
    """In a fresh interpreter: in this one, any test that looked for a device (or the
    hardware skip check) may already have imported pyverbs."""
    code = ("import sys, transfer_engine.transport.rdma.plan, transfer_engine.transport.rdma; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyverbs'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --- immediates -----------------------------------------------------------------------

@pytest.mark.parametrize("tid,expected", [(0, 1), (1, 2), (MOD - 1, MAX_EXPECTED),
                                          (MOD, 3), (5 * MOD + 17, 8)])
def test_imm_round_trip_keeps_low_bits(tid: int, expected: int) -> None:
    value = encode_imm(tid, expected)
    assert 0 <= value < 1 << 32
    assert decode_imm(value) == (tid % MOD, expected)


@pytest.mark.parametrize("expected", [0, MAX_EXPECTED + 1, -1])
def test_imm_rejects_bad_expected(expected: int) -> None:
    with pytest.raises(ValueError, match="expected"):
        encode_imm(1, expected)


def test_imm_rejects_negative_id_and_wide_value() -> None:
    with pytest.raises(ValueError):
        encode_imm(-1, 1)
    with pytest.raises(ValueError):
        decode_imm(1 << 32)


@pytest.mark.parametrize("reference,full", [
    (0, 5), (MOD - 3, MOD + 2), (MOD + 2, MOD - 3), (10 * MOD, 10 * MOD - 1),
    (3 * MOD + 100, 3 * MOD + 100 + (MOD // 2) - 1), (7, 0)])
def test_unwrap_finds_nearest_full_id(reference: int, full: int) -> None:
    assert unwrap_transfer_id(full % MOD, reference) == full


def test_unwrap_never_negative() -> None:
    assert unwrap_transfer_id(MOD - 1, 0) == MOD - 1


def test_unwrapper_follows_ids_across_many_wraps() -> None:
    rng = random.Random(7)
    unwrapper = ImmUnwrapper()
    tid = 0
    for _ in range(2000):
        tid += rng.randrange(1, MOD // 8)  # monotonic, big jumps, many wraps
        jitter = tid - rng.randrange(0, 1000) if tid > 1000 else tid  # out of order
        for t in (tid, jitter):
            wrapped, _ = decode_imm(encode_imm(t, 2))
            assert unwrapper.full_id("p", wrapped) == t
    assert unwrapper.full_id("other", 3) == 3  # per-peer reference
    unwrapper.observe("q", 5 * MOD)
    assert unwrapper.full_id("q", 1) == 5 * MOD + 1
    unwrapper.forget("q")
    assert unwrapper.full_id("q", 1) == 1


# --- work requests --------------------------------------------------------------------

LOCAL = {1: MrKey(0x10000, 1 << 20, 0x11), 2: MrKey(0x900000, 1 << 20, 0x22)}
REMOTE = {7: MrKey(0x7000000, 1 << 20, 0x77), 8: MrKey(0x8000000, 1 << 20, 0x88)}


def _bytes_map(specs: list, op: Op = Op.WRITE) -> list[tuple[int, int]]:
    """(local address, remote address) for every byte, in order."""
    out = []
    for spec in specs:
        raddr = spec.remote_addr
        for sge in spec.sges:
            for k in range(sge.length):
                out.append((sge.addr + k, raddr))
                raddr += 1
    return out


def test_single_contiguous_write_is_one_request() -> None:
    specs = build_work_requests(Op.WRITE, [Extent(1, 64, 4096)], [Extent(7, 128, 4096)],
                                local_keys=LOCAL, remote_keys=REMOTE, max_sge=4,
                                max_msg_size=1 << 30)
    assert len(specs) == 1
    (spec,) = specs
    assert spec.opcode is Opcode.WRITE and spec.signaled and spec.imm is None
    assert spec.sges[0].addr == 0x10000 + 64 and spec.sges[0].lkey == 0x11
    assert spec.remote_addr == 0x7000000 + 128 and spec.rkey == 0x77


def test_last_request_carries_imm_and_only_it_is_signaled() -> None:
    local = [Extent(1, i * 100, 50) for i in range(10)]
    specs = build_work_requests(Op.WRITE, local, [Extent(7, 0, 500)], local_keys=LOCAL,
                                remote_keys=REMOTE, max_sge=3, max_msg_size=1 << 30,
                                imm=encode_imm(9, 2))
    assert [len(s.sges) for s in specs] == [3, 3, 3, 1]
    assert [s.opcode for s in specs] == [Opcode.WRITE] * 3 + [Opcode.WRITE_WITH_IMM]
    assert [s.signaled for s in specs] == [False, False, False, True]
    assert specs[-1].imm == encode_imm(9, 2)
    assert specs[1].remote_addr == REMOTE[7].base + 150  # continues where the first ended


def test_adjacent_local_pieces_merge_into_one_sge() -> None:
    local = [Extent(1, 0, 100), Extent(1, 100, 100), Extent(2, 200, 100)]
    (spec,) = build_work_requests(Op.WRITE, local, [Extent(7, 0, 300)], local_keys=LOCAL,
                                  remote_keys=REMOTE, max_sge=2, max_msg_size=1 << 20)
    assert [(s.addr, s.length, s.lkey) for s in spec.sges] == [
        (0x10000, 200, 0x11), (0x900000 + 200, 100, 0x22)]


def test_split_by_max_message_size() -> None:
    specs = build_work_requests(Op.WRITE, [Extent(1, 0, 10_000)], [Extent(7, 0, 10_000)],
                                local_keys=LOCAL, remote_keys=REMOTE, max_sge=4,
                                max_msg_size=4096, imm=5)
    assert [s.nbytes for s in specs] == [4096, 4096, 1808]
    assert all(s.nbytes <= 4096 for s in specs)
    assert specs[-1].imm == 5 and specs[0].imm is None


def test_remote_gap_starts_a_new_request() -> None:
    specs = build_work_requests(
        Op.WRITE, [Extent(1, 0, 100), Extent(1, 100, 100)],
        [Extent(7, 0, 100), Extent(8, 0, 100)], local_keys=LOCAL, remote_keys=REMOTE,
        max_sge=8, max_msg_size=1 << 20)
    assert [(s.rkey, s.remote_addr) for s in specs] == [(0x77, REMOTE[7].base),
                                                         (0x88, REMOTE[8].base)]


def test_read_uses_read_opcode_and_refuses_imm() -> None:
    specs = build_work_requests(Op.READ, [Extent(1, 0, 64)], [Extent(7, 0, 64)],
                                local_keys=LOCAL, remote_keys=REMOTE, max_sge=1,
                                max_msg_size=1 << 20)
    assert specs[0].opcode is Opcode.READ
    with pytest.raises(ValueError, match="READ"):
        build_work_requests(Op.READ, [Extent(1, 0, 64)], [Extent(7, 0, 64)],
                            local_keys=LOCAL, remote_keys=REMOTE, max_sge=1,
                            max_msg_size=1 << 20, imm=1)


def test_signal_every_bounds_unsignaled_runs() -> None:
    specs = build_work_requests(Op.WRITE, [Extent(1, 0, 1000)], [Extent(7, 0, 1000)],
                                local_keys=LOCAL, remote_keys=REMOTE, max_sge=1,
                                max_msg_size=100, signal_every=4)
    assert [i for i, s in enumerate(specs) if s.signaled] == [3, 7, 9]


def test_unregistered_and_out_of_bounds_extents_are_rejected() -> None:
    with pytest.raises(InvalidDescriptorError, match="not registered") as info:
        build_work_requests(Op.WRITE, [Extent(3, 0, 8)], [Extent(7, 0, 8)],
                            local_keys=LOCAL, remote_keys=REMOTE, max_sge=1,
                            max_msg_size=64, peer="decode-1")
    assert info.value.peer == "decode-1" and info.value.segment == 3
    with pytest.raises(InvalidDescriptorError, match="out of bounds"):
        build_work_requests(Op.WRITE, [Extent(1, 0, 8)], [Extent(7, (1 << 20) - 4, 8)],
                            local_keys=LOCAL, remote_keys=REMOTE, max_sge=1,
                            max_msg_size=64)
    with pytest.raises(InvalidDescriptorError, match="differ"):
        build_work_requests(Op.WRITE, [Extent(1, 0, 8)], [Extent(7, 0, 9)],
                            local_keys=LOCAL, remote_keys=REMOTE, max_sge=1,
                            max_msg_size=64)
    with pytest.raises(ValueError):
        build_work_requests(Op.WRITE, [Extent(1, 0, 8)], [Extent(7, 0, 8)],
                            local_keys=LOCAL, remote_keys=REMOTE, max_sge=0,
                            max_msg_size=64)


@pytest.mark.parametrize("seed", range(25))
def test_random_plans_map_every_byte_exactly_once(seed: int) -> None:
    """Planner output through the builder: bounds hold and bytes map like the pairs."""
    rng = random.Random(seed)
    pairs = []
    loff, roff = 0, 0
    for _ in range(rng.randrange(1, 12)):
        n = rng.randrange(1, 3000)
        loff += rng.choice([0, 0, rng.randrange(1, 500)])
        roff += rng.choice([0, rng.randrange(1, 500)])
        pairs.append((Extent(1, loff, n), Extent(7, roff, n)))
        loff += n
        roff += n
    max_sge = rng.randrange(1, 5)
    max_msg = rng.randrange(64, 5000)
    plan = plan_transfer(pairs, num_rails=rng.randrange(1, 4), slice_size=2048,
                         max_sge=max_sge, max_wr_bytes=1 << 30, remote_scatter=False,
                         min_split=256)
    got = []
    for wr in plan.requests:
        specs = build_work_requests(Op.WRITE, wr.local, wr.remote, local_keys=LOCAL,
                                    remote_keys=REMOTE, max_sge=max_sge,
                                    max_msg_size=max_msg, imm=1 if wr.imm else None)
        assert all(len(s.sges) <= max_sge and 0 < s.nbytes <= max_msg for s in specs)
        assert specs[-1].signaled and (specs[-1].imm == 1) == wr.imm
        assert all(s.imm is None for s in specs[:-1])
        got.extend(_bytes_map(specs))
    want = [(LOCAL[1].base + loc.offset + k, REMOTE[7].base + rem.offset + k)
            for loc, rem in pairs for k in range(loc.length)]
    assert sorted(got) == sorted(want)


def test_dmabuf_style_base_is_used_for_addresses() -> None:
    """A dma-buf MR is addressed from its iova (the dma-buf offset), not the VA."""
    (spec,) = build_work_requests(Op.WRITE, [Extent(1, 10, 5)], [Extent(9, 20, 5)],
                                  local_keys=LOCAL, remote_keys={9: MrKey(4096, 100, 5)},
                                  max_sge=1, max_msg_size=64)
    assert spec.remote_addr == 4096 + 20


def test_stripe_pairs_cycles_over_nics() -> None:
    assert [stripe_pairs(2, 2, r) for r in range(4)] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert [stripe_pairs(2, 1, r) for r in range(3)] == [(0, 0), (1, 0), (0, 0)]
    with pytest.raises(ValueError):
        stripe_pairs(0, 1, 0)


# --- completion errors ----------------------------------------------------------------

def test_wc_errors_are_precise_and_carry_context() -> None:
    err = wc_error(WcStatus.REM_ACCESS_ERR, 0x88, peer="d", op="write", transport="rdma",
                   segment=7, offset=0, length=64)
    assert isinstance(err, InvalidDescriptorError)
    assert "REM_ACCESS_ERR" in str(err) and "vendor_err=0x88" in str(err)
    assert err.peer == "d" and err.segment == 7
    assert isinstance(wc_error(WcStatus.RETRY_EXC_ERR), PeerLostError)
    assert isinstance(wc_error(WcStatus.LOC_LEN_ERR), ProtocolError)
    assert isinstance(wc_error(WcStatus.WR_FLUSH_ERR, closing=True), ClosedError)
    assert isinstance(wc_error(WcStatus.WR_FLUSH_ERR), PeerLostError)
    assert isinstance(wc_error(999), RemoteError)
    assert "status 999" in str(wc_error(999))


def test_retryable_blames_the_path_not_the_request() -> None:
    assert wc_retryable(WcStatus.RETRY_EXC_ERR)
    assert wc_retryable(WcStatus.WR_FLUSH_ERR)
    assert not wc_retryable(WcStatus.REM_ACCESS_ERR)
    assert not wc_retryable(WcStatus.LOC_PROT_ERR)


# --- QP info, MTU, PSN, notify framing ------------------------------------------------

GID = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"


def test_qp_info_round_trips_and_validates() -> None:
    info = QpInfo(qp_num=0x1234, lid=3, gid=GID.upper(), gid_index=1, psn=77, mtu=4096,
                  device="mlx5_0")
    back = QpInfo.from_wire(info.to_wire())
    assert back.qp_num == 0x1234 and back.gid == GID and back.port == 1
    for key, value in [("qp_num", -1), ("qp_num", "x"), ("psn", 1 << 24), ("mtu", 1500),
                       ("gid", "fe80::1"), ("device", ""), ("lid", True)]:
        wire = info.to_wire()
        wire[key] = value
        with pytest.raises(ProtocolError, match=key) as exc:
            QpInfo.from_wire(wire, peer="p")
        assert exc.value.peer == "p" and exc.value.op == "connect"
    with pytest.raises(ProtocolError, match="map"):
        QpInfo.from_wire([1, 2], peer="p")


def test_mtu_helpers() -> None:
    assert mtu_enum(4096) == 5 and mtu_bytes(3) == 1024
    assert negotiate_mtu(4096, 1024) == 1024
    with pytest.raises(ValueError):
        mtu_enum(1500)
    with pytest.raises(ValueError):
        mtu_bytes(9)


def test_random_psn_is_24_bits() -> None:
    rng = random.Random(1)
    assert all(0 <= random_psn(rng) < 1 << 24 for _ in range(100))
    assert 0 <= random_psn() < 1 << 24


def test_notify_framing() -> None:
    data = pack_notify(1 << 40, 3, 2, b"done")
    assert unpack_notify(data) == (1 << 40, 3, 2, b"done", None)
    assert unpack_notify(memoryview(pack_notify(1, 1, 0, b""))) == (1, 1, 0, b"", None)
    assert unpack_notify(pack_notify(9, 2, 1, b"x", first=7)) == (9, 2, 1, b"x", 7)
    # an immediate moved to a SEND carries no notification: not an empty one
    assert unpack_notify(pack_notify(1, 2, 3, None)) == (1, 2, 3, None, None)
    with pytest.raises(ProtocolError, match="shorter"):
        unpack_notify(b"abc", peer="p")
    with pytest.raises(ProtocolError, match="expects no"):
        unpack_notify(pack_notify(1, 0, 0, b""))

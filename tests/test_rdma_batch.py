"""``build_wr_batch`` makes the requests ``build_work_requests`` makes, as columns."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_engine.descriptor import Op
from transfer_engine.errors import InvalidDescriptorError
from transfer_engine.planner import Extents
from transfer_engine.transport.rdma.batch import WrBatch, build_wr_batch, empty_batch
from transfer_engine.transport.rdma.plan import MrKey, Opcode, Sge, WrSpec, build_work_requests

LOCAL = {1: MrKey(1 << 40, 1 << 24, 0x11), 3: MrKey(1 << 41, 1 << 20, 0x33)}
REMOTE = {2: MrKey(1 << 42, 1 << 24, 0x22), 4: MrKey(1 << 43, 1 << 20, 0x44)}


def _spans(seg: list[int], off: list[int], length: list[int]) -> Extents:
    return Extents(np.array(seg, dtype=np.int64), np.array(off, dtype=np.int64),
                 np.array(length, dtype=np.int64))


def _both(op: Op, local: Extents, remote: Extents, **kw: object) -> tuple[list[WrSpec],
                                                                     list[WrSpec]]:
    args = {"local_keys": LOCAL, "remote_keys": REMOTE, "max_sge": 4,
            "max_msg_size": 1 << 20, **kw}
    want = build_work_requests(op, local, remote, **args)  # type: ignore[arg-type]
    got = build_wr_batch(op, local, remote, **args)  # type: ignore[arg-type]
    return want, got.specs()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_same_requests_as_the_object_builder(seed: int, op: Op) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    slots = rng.permutation(4096)[:n]
    rslots = rng.permutation(4096)[:n] if seed % 3 else np.arange(n)  # some contiguous
    lseg = rng.choice([1, 3], n) if seed % 2 else np.full(n, 1)
    rseg = np.full(n, 2) if seed < 4 else rng.choice([2, 4], n)
    length = np.full(n, 256) if seed % 2 else rng.integers(1, 257, n)
    local = _spans(lseg.tolist(), (slots * 256).tolist(), length.tolist())
    remote = _spans(rseg.tolist(), (rslots * 256).tolist(), length.tolist())
    imm = 0x1234 if op is Op.WRITE else None
    want, got = _both(op, local, remote, imm=imm, signal_every=7)
    assert got == want


def test_errors_are_the_object_builders() -> None:
    with pytest.raises(InvalidDescriptorError, match="out of bounds") as info:
        build_wr_batch(Op.WRITE, _spans([1], [0], [64]), _spans([2], [(1 << 24) - 10], [64]),
                       local_keys=LOCAL, remote_keys=REMOTE, max_sge=4,
                       max_msg_size=1 << 20)
    assert info.value.offset == (1 << 24) - 10
    with pytest.raises(InvalidDescriptorError, match="not registered"):
        build_wr_batch(Op.WRITE, _spans([9], [0], [64]), _spans([2], [0], [64]),
                       local_keys=LOCAL, remote_keys=REMOTE, max_sge=4,
                       max_msg_size=1 << 20)


def test_tuples_long_pieces_and_the_notification_send() -> None:
    want, got = _both(Op.WRITE, [(1, 0, 3 << 20)], [(2, 0, 3 << 20)],  # type: ignore[arg-type]
                      imm=5)
    assert got == want and len(got) == 3  # cut at max_msg_size
    batch = build_wr_batch(Op.WRITE, _spans([1, 1], [0, 8192], [4096, 4096]),
                           _spans([2, 2], [65536, 0], [4096, 4096]), local_keys=LOCAL,
                           remote_keys=REMOTE, max_sge=4, max_msg_size=1 << 20)
    batch.unsignal_last()
    send = WrSpec(Opcode.SEND_WITH_IMM, (Sge(7, 40, 9),), 0, 0, True, 77)
    full = batch.append(send)
    assert len(full) == 3 and full.specs()[-1] == send
    assert full.signaled.tolist() == [False, False, True]
    assert full.nbytes.tolist() == [4096, 4096, 40]
    assert WrBatch.from_specs(full.specs()).specs() == full.specs()
    assert empty_batch().append(send).specs() == [send]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_runs_of_remote_ranges_share_a_request_without_the_object_builder(
        seed: int, op: Op, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of one length (the planner's ``uniform`` extents) whose remote slots run
    on in places: one request per run of at most ``max_sge`` rows, built as columns."""
    rng = np.random.default_rng(100 + seed)
    n, block = int(rng.integers(2, 300)), 4096
    rslots = np.sort(rng.choice(2048, n, replace=False))  # sorted: many runs
    if seed % 2:
        rslots = rng.permutation(rslots)
    lslots = rng.permutation(2048)[:n] * 2  # never adjacent locally
    uniform = seed % 4 < 2
    local = Extents(np.full(n, 1), lslots * block, np.full(n, block),
                    (1, block) if uniform else None)
    remote = Extents(np.full(n, 2), rslots * block, np.full(n, block),
                     (2, block) if uniform else None)
    imm = 0x77 if op is Op.WRITE else None
    args = {"local_keys": LOCAL, "remote_keys": REMOTE, "max_sge": int(rng.integers(1, 6)),
            "max_msg_size": 1 << 20, "imm": imm, "signal_every": 5}
    want = build_work_requests(op, local, remote, **args)  # type: ignore[arg-type]
    import transfer_engine.transport.rdma.batch as batch_module

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the object builder was used")
    monkeypatch.setattr(batch_module, "build_work_requests", refuse)
    got = build_wr_batch(op, local, remote, **args)  # type: ignore[arg-type]
    assert got.specs() == want
    assert len(want) < n or args["max_sge"] == 1 or seed % 2


def test_runs_past_max_msg_size_or_with_local_neighbours_are_the_object_builders() -> None:
    # three remote-adjacent 4 KiB rows against a 10 KiB message cap: cut inside a row
    local = _spans([1, 1, 1], [0, 40960, 81920], [4096] * 3)
    remote = _spans([2, 2, 2], [0, 4096, 8192], [4096] * 3)
    want, got = _both(Op.WRITE, local, remote, max_msg_size=10240)
    assert got == want and [s.nbytes for s in got] == [10240, 2048]
    # adjacent on both sides (not merged by a planner): one entry, as the builder makes
    local = _spans([1, 1, 3], [0, 4096, 0], [4096] * 3)
    want, got = _both(Op.READ, local, remote)
    assert got == want and len(got) == 1 and len(got[0].sges) == 2

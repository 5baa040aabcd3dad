"""Transfers described as Blocks (arrays of offsets) instead of descriptor pairs: the
same bytes land, over tcp and shm, for WRITE and READ; bad arrays are refused with the
same precise errors as bad descriptors, and nothing moves."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.helpers.transport_contract import random_bytes
from transfer_engine import Blocks, Descriptor, Engine, InvalidDescriptorError
from transfer_engine.transport.tcp import TcpTransport

KiB = 1 << 10
MiB = 1 << 20


def _pair(make_engine: Callable[..., Engine], transport: str, size: int = 4 * MiB
          ) -> tuple[Engine, Engine, np.ndarray, np.ndarray]:
    a = make_engine("a", transports=[transport])
    b = make_engine("b", transports=[transport])
    src = random_bytes(size, 11)
    dst = random_bytes(size, 12)
    a.register(src, name="src")
    b.register(dst, name="dst")
    return a, b, src, dst


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_scattered_blocks_land_byte_exact(make_engine: Callable[..., Engine], transport: str,
                                          op: str) -> None:
    a, b, src, dst = _pair(make_engine, transport)
    peer = a.connect(b.endpoint)
    local, remote = a.segments["src"], peer.segment("dst")
    rng = np.random.default_rng(3)
    slots = 4 * MiB // (4 * KiB)
    lo = rng.permutation(slots)[:300] * 4 * KiB
    ro = rng.permutation(slots)[:300] * 4 * KiB
    want_src, want_dst = src.copy(), dst.copy()
    blocks = Blocks(local, remote, lo, ro, 4 * KiB)
    assert len(blocks) == 300 and blocks.nbytes == 300 * 4 * KiB
    if op == "write":
        a.write(peer, blocks, notify=b"blocks").wait(10)
        for x, y in zip(lo, ro, strict=True):
            want_dst[y:y + 4 * KiB] = want_src[x:x + 4 * KiB]
        assert [n.payload for n in b.notifications(timeout=5)] == [b"blocks"]
    else:
        a.read(peer, blocks).wait(10)
        for x, y in zip(lo, ro, strict=True):
            want_src[x:x + 4 * KiB] = want_dst[y:y + 4 * KiB]
    assert np.array_equal(src, want_src) and np.array_equal(dst, want_dst)


def test_list_of_blocks_across_segments_and_varied_lengths(
        make_engine: Callable[..., Engine]) -> None:
    """One transfer over two segment pairs (as a per-layer KV copy is), lengths varying."""
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    srcs = [random_bytes(MiB, 20 + i) for i in range(2)]
    dsts = [random_bytes(MiB, 30 + i) for i in range(2)]
    lsegs = [a.register(s, name=f"l{i}") for i, s in enumerate(srcs)]
    for i, d in enumerate(dsts):
        b.register(d, name=f"r{i}")
    peer = a.connect(b.endpoint)
    lengths = np.array([1, 100, 4096, 65536, 7])
    lo = np.array([0, 10, 5000, 200000, 999000])
    ro = np.array([900000, 3, 20000, 300000, 123])
    groups = [Blocks(lsegs[i], peer.segment(f"r{i}"), lo, ro, lengths) for i in range(2)]
    want = [d.copy() for d in dsts]
    a.write(peer, groups).wait(10)
    for i in range(2):
        for x, y, n in zip(lo, ro, lengths, strict=True):
            want[i][y:y + n] = srcs[i][x:x + n]
        assert np.array_equal(dsts[i], want[i])


def test_blocks_equal_descriptor_pairs(make_engine: Callable[..., Engine]) -> None:
    a, b, _, _ = _pair(make_engine, "tcp", MiB)
    peer = a.connect(b.endpoint)
    blocks = Blocks(a.segments["src"], peer.segment("dst"), [0, 8192], [4096, 0], [100, 200])
    assert list(blocks) == [
        (Descriptor(a.segments["src"], 0, 100), Descriptor(peer.segment("dst"), 4096, 100)),
        (Descriptor(a.segments["src"], 8192, 200), Descriptor(peer.segment("dst"), 0, 200))]
    assert "2 pairs 300 bytes" in repr(blocks)


def test_arrays_are_copied(make_engine: Callable[..., Engine]) -> None:
    a, b, src, dst = _pair(make_engine, "tcp", MiB)
    peer = a.connect(b.endpoint)
    lo = np.array([0, 4096])
    ro = np.array([8192, 12288])
    blocks = Blocks(a.segments["src"], peer.segment("dst"), lo, ro, 4096)
    lo[:] = 65536  # the caller reuses its arrays at once
    ro[:] = 65536
    want = dst.copy()
    want[8192:16384] = src[0:8192]
    a.write(peer, blocks).wait(10)
    assert np.array_equal(dst, want)
    with pytest.raises(ValueError):
        blocks.local_offsets[0] = 1  # read-only


def test_kept_blocks_move_again_and_are_rechecked(make_engine: Callable[..., Engine]
                                                   ) -> None:
    """A Blocks is checked and laid out once, when built; each transfer of it still moves
    the bytes the memory holds then, and still checks that its segments are live."""
    a, b, src, dst = _pair(make_engine, "tcp", MiB)
    peer = a.connect(b.endpoint)
    rng = np.random.default_rng(5)
    lo = rng.permutation(MiB // (4 * KiB))[:64] * 4 * KiB
    ro = rng.permutation(MiB // (4 * KiB))[:64] * 4 * KiB
    blocks = Blocks(a.segments["src"], peer.segment("dst"), lo, ro, 4 * KiB)
    for round_ in range(3):
        src[:] = random_bytes(MiB, 50 + round_)
        a.write(peer, blocks).wait(10)
        for x, y in zip(lo, ro, strict=True):
            assert np.array_equal(dst[y:y + 4 * KiB], src[x:x + 4 * KiB])
        dst[:] = random_bytes(MiB, 60 + round_)
        a.read(peer, blocks).wait(10)
        for x, y in zip(lo, ro, strict=True):
            assert np.array_equal(src[x:x + 4 * KiB], dst[y:y + 4 * KiB])
    a.segments["src"].close()
    with pytest.raises(InvalidDescriptorError, match="registered with this engine"):
        a.write(peer, blocks)


@pytest.mark.parametrize("rails", [2, 4])
@pytest.mark.parametrize("op", ["write", "read"])
def test_blocks_cut_into_several_requests_move_their_own_rows(
        make_engine: Callable[..., Engine], op: str, rails: int) -> None:
    """A Blocks lays out its local (address, length) rows when built; a transfer cut into
    several requests hands each its own slice of them (over 4 rails here), unless the
    planner merges neighbouring blocks first and lays the rows out anew (over 2)."""
    a = make_engine("a", transports=[TcpTransport(rails=rails, spread=rails)])
    b = make_engine("b", transports=["tcp"])
    src, dst = random_bytes(16 * MiB, 21), random_bytes(16 * MiB, 22)
    local, remote = a.register(src), a.connect(b.endpoint).segment(b.register(dst).name)
    peer = a.peer(b.name)
    rng = np.random.default_rng(7)
    slots = 16 * MiB // (4 * KiB)
    lo = rng.permutation(slots)[:3000] * 4 * KiB  # over max_sge: several requests
    ro = rng.permutation(slots)[:3000] * 4 * KiB
    blocks = Blocks(local, remote, lo, ro, 4 * KiB)
    rows = blocks.local_iov
    assert rows is not None and not rows.flags.writeable
    assert rows[:, 0].tolist() == (lo + local.address).tolist()
    assert set(rows[:, 1].tolist()) == {4 * KiB}
    want_src, want_dst = src.copy(), dst.copy()
    if op == "write":
        a.write(peer, blocks).wait(10)
        for x, y in zip(lo, ro, strict=True):
            want_dst[y:y + 4 * KiB] = want_src[x:x + 4 * KiB]
    else:
        a.read(peer, blocks).wait(10)
        for x, y in zip(lo, ro, strict=True):
            want_src[x:x + 4 * KiB] = want_dst[y:y + 4 * KiB]
    assert np.array_equal(src, want_src) and np.array_equal(dst, want_dst)
    assert all(rail.bytes_sent for rail in peer.rails["tcp"])


@pytest.mark.parametrize("bad, words", [
    (dict(ro=[1 * MiB - 10]), "out of bounds"),
    (dict(lo=[-1]), "out of bounds"),
    (dict(n=[0]), "zero or negative length"),
    (dict(ro=[2**62]), "out of bounds"),
])
def test_bad_blocks_are_refused_and_nothing_moves(make_engine: Callable[..., Engine],
                                                  bad: dict[str, list[int]],
                                                  words: str) -> None:
    a, b, _, dst = _pair(make_engine, "tcp", MiB)
    peer = a.connect(b.endpoint)
    before = dst.copy()
    lo = [0, 4096, *bad.get("lo", [8192])]
    ro = [0, 4096, *bad.get("ro", [8192])]
    n = [4096, 4096, *bad.get("n", [4096])]
    with pytest.raises(InvalidDescriptorError) as info:
        a.write(peer, Blocks(a.segments["src"], peer.segment("dst"), lo, ro, n))
    err = info.value
    assert words in str(err) and err.peer == "b" and err.op == "write"
    assert err.offset == (lo[2] if "lo" in bad or "n" in bad else ro[2])
    assert np.array_equal(dst, before)


def test_malformed_arrays_and_foreign_segments(make_engine: Callable[..., Engine]) -> None:
    a, b, _, _ = _pair(make_engine, "tcp", MiB)
    c = make_engine("c", transports=["tcp"])
    c.register(random_bytes(MiB, 40), name="dst")
    peer = a.connect(b.endpoint)
    other = a.connect(c.endpoint)
    local, remote = a.segments["src"], peer.segment("dst")
    with pytest.raises(ValueError, match="1-D array of integers"):
        Blocks(local, remote, [0.5], [0], 1)
    with pytest.raises(ValueError, match="remote offsets"):
        Blocks(local, remote, [0, 1], [0], 1)
    with pytest.raises(ValueError, match="lengths"):
        Blocks(local, remote, [0, 1], [0, 1], [1])
    with pytest.raises(InvalidDescriptorError, match="at least one pair"):
        a.write(peer, Blocks(local, remote, [], [], 1))
    with pytest.raises(InvalidDescriptorError, match="segment of this peer"):
        a.write(peer, Blocks(local, other.segment("dst"), [0], [0], 16))
    with pytest.raises(InvalidDescriptorError, match="registered with this engine"):
        c.write(c.connect(b.endpoint), Blocks(local, remote, [0], [0], 16))

"""Gathered socket I/O from iovec arrays: real sockets, seeded random data, byte for byte."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_engine.planner import iovec_array
from transfer_engine.transport import iovec
from transfer_engine.transport.iovec import IOV_MAX, iov_views, recv_iov, send_iov

pytestmark = pytest.mark.skipif(not iovec.IOVEC_IO, reason="iovec I/O needs 64-bit Linux")


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname(), timeout=5)
        b, _ = listener.accept()
    a.settimeout(None)
    b.settimeout(None)
    with a, b:
        yield a, b


def scattered(buf: np.ndarray, rng: random.Random, count: int, max_len: int
              ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``count`` disjoint (offset, length) ranges of ``buf`` in random order, as an iovec
    array and as a list."""
    slot = max_len * 2
    slots = rng.sample(range(len(buf) // slot), count)
    ranges = [(s * slot + rng.randrange(max_len), rng.randint(1, max_len)) for s in slots]
    base = buf.ctypes.data
    iov = iovec_array(np.array([base + o for o, _ in ranges], dtype=np.uint64),
                      np.array([n for _, n in ranges], dtype=np.uint64))
    return iov, ranges


def gathered(buf: np.ndarray, ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(buf[o:o + n].tobytes() for o, n in ranges)


def move(a: socket.socket, b: socket.socket, siov: np.ndarray, diov: np.ndarray,
         nbytes: int) -> None:
    """Sends what ``siov`` describes from ``a`` and receives it into ``diov`` on ``b``."""
    receiver = threading.Thread(target=recv_iov, args=(b, diov, nbytes))
    receiver.start()
    send_iov(a, siov, nbytes)
    receiver.join(10)
    assert not receiver.is_alive()


@pytest.mark.parametrize("count,max_len", [(1, 1), (128, 4096), (3000, 64)])
def test_scatter_gather_round_trip(tcp_pair: tuple[socket.socket, socket.socket],
                                   count: int, max_len: int) -> None:
    """More rows than IOV_MAX take several system calls; every byte lands in place."""
    a, b = tcp_pair
    rng = random.Random(count)
    src = np.random.default_rng(count).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)
    siov, sranges = scattered(src, rng, count, max_len)
    rng2 = random.Random(count + 1)
    # destination ranges of the same sizes, elsewhere
    slot = max_len * 2
    slots = rng2.sample(range(len(dst) // slot), count)
    dranges = [(s * slot, n) for s, (_, n) in zip(slots, sranges, strict=True)]
    diov = iovec_array(np.array([dst.ctypes.data + o for o, _ in dranges], dtype=np.uint64),
                       np.array([n for _, n in dranges], dtype=np.uint64))
    nbytes = sum(n for _, n in sranges)
    move(a, b, siov, diov, nbytes)
    assert gathered(dst, dranges) == gathered(src, sranges)
    untouched = np.ones(len(dst), dtype=bool)
    for o, n in dranges:
        untouched[o:o + n] = False
    assert not dst[untouched].any()
    assert count <= IOV_MAX or len(siov) > IOV_MAX


def test_short_sends_and_receives_resume_mid_row(tcp_pair: tuple[socket.socket,
                                                                 socket.socket]) -> None:
    """A small send buffer and a reader taking odd-sized bites force partial calls on
    both sides; the cursor resumes inside a row."""
    a, b = tcp_pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    src = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    iov, ranges = scattered(src, random.Random(3), 100, 20000)
    nbytes = sum(n for _, n in ranges)
    got = bytearray()

    def read() -> None:
        while len(got) < nbytes:
            chunk = b.recv(min(7919, nbytes - len(got)))
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    send_iov(a, iov, nbytes)
    reader.join(10)
    assert bytes(got) == gathered(src, ranges)
    # and the other way round: the sender dribbles, recv_iov resumes mid-row
    dst = np.zeros(4 << 20, dtype=np.uint8)
    diov, dranges = scattered(dst, random.Random(4), 50, 3000)
    total = sum(n for _, n in dranges)
    payload = np.random.default_rng(5).integers(0, 256, total, dtype=np.uint8).tobytes()

    def dribble() -> None:
        for k in range(0, total, 1000):
            a.sendall(payload[k:k + 1000])

    writer = threading.Thread(target=dribble)
    writer.start()
    recv_iov(b, diov, total)
    writer.join(10)
    assert gathered(dst, dranges) == payload


def test_end_of_stream_mid_receive_raises(tcp_pair: tuple[socket.socket,
                                                           socket.socket]) -> None:
    a, b = tcp_pair
    dst = np.zeros(1 << 20, dtype=np.uint8)
    iov, ranges = scattered(dst, random.Random(6), 10, 1000)
    a.sendall(b"x" * 5)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError):
        recv_iov(b, iov, sum(n for _, n in ranges))


def test_closed_socket_raises_oserror(tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp_pair
    b.close()
    src = np.ones(1 << 20, dtype=np.uint8)
    iov, ranges = scattered(src, random.Random(7), 8, 65536)
    with pytest.raises(OSError):
        for _ in range(100):  # the peer's reset shows on a later call
            send_iov(a, iov, sum(n for _, n in ranges))


def test_iov_views_cover_the_same_bytes() -> None:
    buf = np.random.default_rng(8).integers(0, 256, 1 << 16, dtype=np.uint8)
    iov, ranges = scattered(buf, random.Random(8), 20, 100)
    views = iov_views(iov)
    assert [len(v) for v in views] == [n for _, n in ranges]
    assert b"".join(bytes(v) for v in views) == gathered(buf, ranges)


@pytest.mark.parametrize("count,max_len", [(5, 3 << 20), (400, 40000)])
def test_large_receives_arrive_whole_in_chunks(tcp_pair: tuple[socket.socket, socket.socket],
                                                count: int, max_len: int) -> None:
    """Megabytes are received in chunks of about RECV_CHUNK (long rows split); every byte
    still lands in place."""
    a, b = tcp_pair
    rng = random.Random(max_len)
    src = np.random.default_rng(max_len).integers(0, 256, 32 << 20, dtype=np.uint8)
    dst = np.zeros(32 << 20, dtype=np.uint8)
    siov, sranges = scattered(src, rng, count, max_len)
    diov, dranges = scattered(dst, random.Random(max_len + 1), count, max_len)
    # the same sizes on both sides
    diov[:, 1] = siov[:, 1]
    dranges = [(o, n) for (o, _), (_, n) in zip(dranges, sranges, strict=True)]
    nbytes = sum(n for _, n in sranges)
    assert nbytes > 2 * iovec.RECV_CHUNK
    move(a, b, siov, diov, nbytes)
    assert gathered(dst, dranges) == gathered(src, sranges)


def test_chunks_cover_the_rows_in_order() -> None:
    rng = np.random.default_rng(3)
    chunk = iovec.RECV_CHUNK
    for _ in range(300):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(1, 3 * chunk, n).astype(np.uint64)
        addresses = (rng.permutation(1 << 16)[:n] * (4 * chunk)).astype(np.uint64)
        iov = iovec_array(addresses, lengths)
        parts = iovec._chunks(iov, int(lengths.sum()))
        rows = np.concatenate([p for p, _ in parts])
        assert all(int(p[:, 1].sum()) == size and size <= 2 * chunk for p, size in parts)
        # the same bytes in the same order: rows only split, never moved
        ends = np.cumsum(rows[:, 1])
        starts = ends - rows[:, 1]
        for (address, length), begin in zip(iov.tolist(),
                                            np.concatenate(([0], np.cumsum(lengths)[:-1])),
                                            strict=True):
            inside = (starts >= begin) & (ends <= begin + length)
            assert int(rows[inside, 1].sum()) == length
            assert rows[inside, 0].tolist() == (address + starts[inside] - begin).tolist()

"""Transfers while a Python thread of the process is busy: bytes exact, notifications
exactly once. Behaviour only; the speed is bench.contention's business.

Both engines live in this process, so the busy thread holds the GIL against the
initiator's threads and the target's at once. Also the GIL-holding socket helpers
(:func:`recv_ready`, :func:`send_ready`, :func:`recv_iov_ready`) at their edges.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tests.helpers.transport_contract import random_bytes
from transfer_engine import Blocks, Descriptor, Engine
from transfer_engine.notify import Notification
from transfer_engine.transport.iovec import (
    IOVEC_IO,
    recv_iov_ready,
    recv_ready,
    send_ready,
)

MiB = 1 << 20


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
@pytest.mark.parametrize("block,count", [(4096, 128), (MiB, 16), (3 * MiB + 5, 7)])
def test_writes_and_reads_are_exact_with_a_busy_thread(
        make_engine: Callable[..., Engine], busy_python: None, protocol: str, block: int,
        count: int) -> None:
    transports = ["tcp"] if protocol == "tcp" else ["shm", "tcp"]
    a = make_engine("a", transports=transports)
    b = make_engine("b", transports=transports)
    size = block * count
    src = random_bytes(size, seed=block)
    dst = np.zeros(size, dtype=np.uint8)
    back = np.zeros(size, dtype=np.uint8)
    seg = a.register(src, name="src")
    bseg = a.register(back, name="back")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    assert peer.transport == protocol
    remote = peer.segment("dst")
    # scattered on the target: block k lands in slot perm[k]
    perm = np.random.default_rng(count).permutation(count)
    transfers = 6
    for t in range(transfers):
        a.write(peer, Blocks(seg, remote, np.arange(count) * block, perm * block, block),
                notify=f"w{t}".encode()).wait(30)
    want = src.reshape(count, block)
    assert np.array_equal(dst.reshape(count, block)[perm], want)
    a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back, dst)
    notes = b.notifications(timeout=5)
    while len(notes) < transfers:
        more = b.notifications(timeout=5)
        if not more:
            break
        notes += more
    notes += b.notifications(timeout=0.2)
    assert sorted(n.payload for n in notes) == sorted(f"w{t}".encode()
                                                       for t in range(transfers))
    assert all(n.peer == "a" for n in notes)


def test_concurrent_writers_with_a_busy_thread_each_notify_once(
        make_engine: Callable[..., Engine], busy_python: None) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    block, count, writers, rounds = 65536, 32, 3, 4
    src = random_bytes(block * count * writers, seed=5)
    dst = np.zeros_like(src)
    seg = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    remote = peer.segment("dst")
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            base = w * block * count
            offsets = base + np.arange(count) * block
            for r in range(rounds):
                a.write(peer, Blocks(seg, remote, offsets, offsets, block),
                        notify=f"{w}.{r}".encode()).wait(30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    assert np.array_equal(dst, src)
    want = sorted(f"{w}.{r}".encode() for w in range(writers) for r in range(rounds))
    notes: list[Notification] = []
    while len(notes) < len(want):
        more = b.notifications(timeout=5)
        if not more:
            break
        notes += more
    notes += b.notifications(timeout=0.2)
    assert sorted(n.payload for n in notes) == want


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.skipif(not IOVEC_IO, reason="no iovec socket calls on this platform")
def test_held_calls_take_only_what_is_there(pair: tuple[socket.socket, socket.socket]
                                            ) -> None:
    a, b = pair
    buf = bytearray(64)
    assert recv_ready(b, buf, 64) == -1  # nothing yet: no wait
    assert send_ready(a, b"hello world") == 11
    assert recv_ready(b, buf, 5) == 5 and bytes(buf[:5]) == b"hello"
    data = np.zeros(100, dtype=np.uint8)
    iov = np.array([[data.ctypes.data + 50, 3], [data.ctypes.data, 40]], dtype=np.uint64)
    assert recv_iov_ready(b, iov) == 6  # " world": 3 + 3, scattered in row order
    assert bytes(data[50:53]) == b" wo" and bytes(data[:3]) == b"rld"
    assert recv_iov_ready(b, iov) == -1
    a.shutdown(socket.SHUT_WR)
    assert recv_ready(b, buf, 64) == 0  # end of stream


@pytest.mark.skipif(not IOVEC_IO, reason="no iovec socket calls on this platform")
def test_held_scatter_stops_at_its_limit(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payload = random_bytes(5000, seed=3).tobytes()
    a.sendall(payload)
    data = np.zeros(6000, dtype=np.uint8)
    iov = np.array([[data.ctypes.data, 1000], [data.ctypes.data + 2000, 4000]],
                   dtype=np.uint64)
    assert recv_iov_ready(b, iov, limit=1500) == 1500
    assert bytes(data[:1000]) == payload[:1000]
    assert bytes(data[2000:2500]) == payload[1000:1500]
    assert not data[2500:].any()
    rest = bytearray(3500)
    assert recv_ready(b, rest, 3500) == 3500 and bytes(rest) == payload[1500:]

"""The tcp serving process (``TcpTransport(serve="process")``): peers' requests served
outside the application, over its memory shared in place.

Real engines, real sockets, a real child process; random bytes checked byte for byte.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.rails import RawRail, handshake, hello_frame
from tests.helpers.serving import fd_target
from tests.helpers.serving import target as _target
from tests.helpers.transport_contract import MiB, TransportContract, random_bytes
from transfer_engine import (
    Descriptor,
    Engine,
    InvalidDescriptorError,
)
from transfer_engine.transport.shm import ShmTransport
from transfer_engine.transport.stream import KIND_WRITE, shared
from transfer_engine.transport.tcp import TcpTransport

# Large enough that malloc maps it for itself (above glibc's largest mmap threshold, and
# beyond any free chunk a long test run may have left in the heap)
MAPPED = 160 * MiB


class TestServeProcessContract(TransportContract):
    """The whole transport contract, served by the serving process."""

    transports = ["tcp"]

    def transports_for(self, role: str) -> list[TcpTransport]:
        return [TcpTransport(rails=2, spread=2, serve="process")]


def test_bytes_exact_across_shared_pages_edges_and_unshared_memory(
        make_engine: Callable[..., Engine], busy_python: None) -> None:
    """One request spans a tensor's shared pages and its partial end pages, a small
    bytearray (never shared) and a numpy view at an odd address; WRITE then READ back,
    with a busy thread in the process; one notification per transfer."""
    t = _target(make_engine)
    a = make_engine("a", transports=["tcp"])
    big = torch.zeros(40 * MiB + 123, dtype=torch.uint8)  # above malloc's mmap threshold
    small = bytearray(9000)
    odd = np.zeros(3 * MiB + 8, dtype=np.uint8)[3:3 * MiB + 3]
    segs = [t.register(big, name="big"), t.register(small, name="small"),
            t.register(odd, name="odd")]
    assert all(s.address for s in segs)
    src = random_bytes(8 * MiB, 11)
    src_seg = a.register(src)
    peer = a.connect(t.endpoint)
    remote = {n: peer.segment(n) for n in ("big", "small", "odd")}
    layout = [("big", 0, 0, 5000), ("big", 4096 * 3 + 17, 5000, 2 * MiB),
              ("big", 40 * MiB + 123 - 7000, 5000 + 2 * MiB, 7000),
              ("small", 100, 3 * MiB, 8000), ("odd", 1, 4 * MiB, 3 * MiB - 2)]
    pairs = [(Descriptor(src_seg, s_off, n), Descriptor(remote[name], r_off, n))
             for name, r_off, s_off, n in layout]
    for rnd in range(3):
        src[:] = random_bytes(src.size, 100 + rnd)
        a.write(peer, pairs, notify=f"w{rnd}".encode()).wait(30)
        views = {"big": big.numpy(), "small": np.frombuffer(small, np.uint8), "odd": odd}
        for name, r_off, s_off, n in layout:
            assert np.array_equal(views[name][r_off:r_off + n], src[s_off:s_off + n]), name
        back = np.zeros_like(src)
        with a.register(back) as back_seg:
            a.read(peer, [(Descriptor(back_seg, s_off, n), Descriptor(remote[name], r_off, n))
                          for name, r_off, s_off, n in layout]).wait(30)
        for name, _, s_off, n in layout:
            assert np.array_equal(back[s_off:s_off + n], src[s_off:s_off + n]), name
    got = t.notifications(timeout=5, max_count=3)
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        got += t.notifications(timeout=0.5)
    assert sorted(n.payload for n in got) == [b"w0", b"w1", b"w2"]
    assert t.notifications(timeout=0.2) == []


def test_registration_keeps_the_memory_and_its_address(
        make_engine: Callable[..., Engine]) -> None:
    """The moved pages hold what they held, at the same address; what the application
    writes afterwards is what a peer READs."""
    t = _target(make_engine)
    data = torch.from_numpy(random_bytes(4 * MiB + 999, 5))
    before = data.clone()
    ptr = data.data_ptr()
    seg = t.register(data, name="kv")
    assert data.data_ptr() == ptr and torch.equal(data, before)
    data[:] = torch.from_numpy(random_bytes(data.numel(), 6))  # the app writes after
    a = make_engine("a", transports=["tcp"])
    back = np.zeros(data.numel(), dtype=np.uint8)
    peer = a.connect(t.endpoint)
    with a.register(back) as back_seg:
        a.read(peer, [(Descriptor(back_seg, 0, back.size),
                       Descriptor(peer.segment("kv"), 0, back.size))]).wait(30)
    assert np.array_equal(back, data.numpy())
    seg.close()
    data[:7] = 1  # still ordinary memory of the application's
    assert int(data[:7].sum()) == 7


def test_deregistered_segment_is_refused_precisely(make_engine: Callable[..., Engine]
                                                   ) -> None:
    t = _target(make_engine)
    a = make_engine("a", transports=["tcp"])
    buf = torch.zeros(MiB, dtype=torch.uint8)
    seg = t.register(buf, name="gone")
    src = random_bytes(MiB, 3)
    src_seg = a.register(src)
    peer = a.connect(t.endpoint)
    remote = peer.segment("gone")
    seg.close()
    with pytest.raises(InvalidDescriptorError, match="deregistered"):
        a.write(peer, [(Descriptor(src_seg, 0, MiB), Descriptor(remote, 0, MiB))]).wait(10)
    assert int(buf.sum()) == 0  # no byte landed


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_shared_pages_cannot_be_opened_by_another_user(
        make_engine: Callable[..., Engine]) -> None:
    """The memfd has no name in any file system; through /proc it takes the owner's
    rights (another user's process is refused)."""
    t = _target(make_engine)
    t.register(torch.empty(MAPPED, dtype=torch.uint8), name="kv")
    fds = [fd for fd in os.listdir("/proc/self/fd") if "te-serve" in fd_target(fd)]
    assert fds, "the registered pages are shared through a memfd"
    path = f"/proc/{os.getpid()}/fd/{fds[0]}"
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                open(path, "rb").close()
                code = 1
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_rails_still_need_a_ticket(make_engine: Callable[..., Engine]) -> None:
    """A forged opening is refused before any memory is reachable; a real ticket opens
    a rail whose WRITE lands (the rail's peer is the ticket's, as in-process)."""
    t = _target(make_engine)
    buf = torch.zeros(MiB, dtype=torch.uint8)
    seg = t.register(buf, name="kv")
    forged = RawRail(t, None)
    try:
        forged.sock.sendall(hello_frame(None, "tcp", forged.challenge))
        status, _ = forged.answer()
        assert status != 0
    except ConnectionResetError:
        pass  # refused by closing
    finally:
        forged.sock.close()
    assert int(buf.sum()) == 0
    _, credential = handshake(t, name="hand")
    rail = RawRail(t, credential)
    try:
        assert rail.status == 0
        payload = random_bytes(4096, 21).tobytes()
        status, _ = rail.request(KIND_WRITE, [(seg.id, 100, len(payload))], payload)
        assert status == 0
        assert bytes(buf[100:100 + len(payload)].numpy()) == payload
        status, _ = rail.request(KIND_WRITE, [(seg.id, MiB - 10, len(payload))], payload)
        assert status != 0  # out of bounds: refused, nothing written past the end
    finally:
        rail.sock.close()


def test_share_body_moves_only_whole_private_pages() -> None:
    buf = np.empty(MAPPED, dtype=np.uint8)
    buf[:] = np.resize(random_bytes(MiB, 8), MAPPED)
    want = buf.copy()
    body = shared.share_body(buf.ctypes.data + 10, buf.size - 20)
    assert body is not None
    try:
        assert body.start % shared.PAGE == 0 and body.end % shared.PAGE == 0
        assert buf.ctypes.data + 10 <= body.start < body.end <= buf.ctypes.data + buf.size
        assert np.array_equal(buf, want)
        again = shared.share_body(body.start, body.end - body.start)
        assert again is not None and again.inode == body.inode
        os.close(again.fd)
        shared.release(again)
    finally:
        os.close(body.fd)
        shared.release(body)
    assert shared.share_body(buf.ctypes.data, 1000) is None  # too small to move


class TestShmServeProcessContract(TransportContract):
    """The whole transport contract over shm, served by the serving process."""

    transports = ["shm"]

    def transports_for(self, role: str) -> list[Any]:
        return [ShmTransport(serve="process"), TcpTransport(serve="process")]


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_busy_target_and_initiator_move_exact_bytes(
        make_engine: Callable[..., Engine], busy_python: None, protocol: str) -> None:
    """Both engines in this process, a busy thread holding the GIL against both: WRITE
    and READ of 1 MiB x 16 at random places, byte for byte, over each transport."""
    shm = [ShmTransport(serve="process")] if protocol == "shm" else []
    t = make_engine("t", transports=[*shm, TcpTransport(serve="process")])
    a = make_engine("a", transports=["shm", "tcp"] if shm else ["tcp"])
    dst = torch.zeros(32 * MiB, dtype=torch.uint8)
    t.register(dst, name="dst")
    src = random_bytes(16 * MiB, 31)
    src_seg = a.register(src)
    peer = a.connect(t.endpoint)
    assert peer.transport == protocol
    remote = peer.segment("dst")
    rng = np.random.default_rng(5)
    for rnd in range(3):
        slots = rng.permutation(32)[:16]
        pairs = [(Descriptor(src_seg, i * MiB, MiB), Descriptor(remote, int(s) * MiB, MiB))
                 for i, s in enumerate(slots)]
        a.write(peer, pairs, notify=b"n%d" % rnd).wait(30)
        for i, s in enumerate(slots.tolist()):
            assert np.array_equal(dst[s * MiB:(s + 1) * MiB].numpy(),
                                  src[i * MiB:(i + 1) * MiB])
        back = np.zeros(16 * MiB, dtype=np.uint8)
        with a.register(back) as back_seg:
            a.read(peer, [(Descriptor(back_seg, i * MiB, MiB), Descriptor(remote, int(s) * MiB,
                                                                         MiB))
                          for i, s in enumerate(slots)]).wait(30)
        assert np.array_equal(back, src)
    got: list[Any] = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got += t.notifications(timeout=0.5)
    assert sorted(n.payload for n in got) == [b"n0", b"n1", b"n2"]


def test_share_body_moves_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment larger than a chunk is moved a chunk at a time, bytes intact, and
    shared again as one body."""
    monkeypatch.setattr(shared, "MOVE_CHUNK", 4 * MiB)
    buf = np.empty(MAPPED + 12345, dtype=np.uint8)
    buf[:] = np.resize(random_bytes(MiB, 4), buf.size)
    want = buf.copy()
    body = shared.share_body(buf.ctypes.data, buf.size)
    assert body is not None
    try:
        assert np.array_equal(buf, want)
        buf[body.start - buf.ctypes.data] ^= 0xFF  # still ordinary, writable memory
        assert buf[body.start - buf.ctypes.data] != want[body.start - buf.ctypes.data]
        again = shared.share_body(body.start, body.end - body.start)
        assert again is not None and (again.start, again.end) == (body.start, body.end)
        os.close(again.fd)
        shared.release(again)
    finally:
        os.close(body.fd)
        shared.release(body)


def test_a_notification_callback_may_register_and_close_segments(
        make_engine: Callable[..., Engine]) -> None:
    """Callbacks run off the link to the serving process: one that registers and closes
    a segment (which asks the serving process and waits) neither deadlocks nor stalls."""
    t = _target(make_engine)
    a = make_engine("a", transports=["tcp"])
    t.register(torch.zeros(MiB, dtype=torch.uint8), name="kv")
    done = threading.Event()
    seen: list[bytes] = []

    def callback(note: Any) -> None:
        with t.register(torch.zeros(MiB, dtype=torch.uint8)):
            pass
        seen.append(note.payload)
        done.set()

    t.on_notify(callback)
    src = random_bytes(MiB, 2)
    src_seg = a.register(src)
    peer = a.connect(t.endpoint)
    start = time.monotonic()
    a.write(peer, [(Descriptor(src_seg, 0, MiB), Descriptor(peer.segment("kv"), 0, MiB))],
            notify=b"cb").wait(10)
    assert done.wait(8) and seen == [b"cb"]
    assert time.monotonic() - start < 8


def test_heap_memory_is_never_moved() -> None:
    """Pages malloc may hand out again (the heap) stay private: once freed, a forked child
    would otherwise share, and overwrite, the parent's later allocations."""
    small = np.zeros(100 << 10, dtype=np.uint8)  # from the heap
    assert shared.share_body(small.ctypes.data, small.nbytes) is None
    big = np.empty(MAPPED, dtype=np.uint8)
    body = shared.share_body(big.ctypes.data, big.nbytes)
    assert body is not None
    os.close(body.fd)
    shared.release(body)


def test_a_message_over_the_links_frame_bound_is_refused_and_the_link_stays() -> None:
    """The other end takes a frame over MAX_FRAME for the link closing: the sender
    refuses it instead, and later messages still go through."""
    from transfer_engine.transport.stream.channel import (
        MAX_FRAME,
        Channel,
        FrameTooLarge,
    )

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = Channel(left), Channel(right)
    try:
        with pytest.raises(FrameTooLarge, match="imm message"):
            a.send({"op": "imm", "notify": b"x" * (MAX_FRAME + 1)})
        a.send({"op": "imm", "notify": b"y" * 1024})
        msg, fds = b.recv()
        assert msg == {"op": "imm", "notify": b"y" * 1024} and fds == []
    finally:
        a.close()
        b.close()


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_memory_reached_through_the_mem_file_moves_through_a_bounded_bounce(
        make_engine: Callable[..., Engine], transport: str) -> None:
    """Memory the serving process reaches through the mem file (an mmap here) moves
    through one bounce of a bounded size, whatever the request: pieces larger than it
    arrive exact, and one READ naming the same MiB 96 times costs the serving process
    no more than a few MiB (it once allocated every piece of a request at once: a
    READ of 1 GiB cost 1 GiB)."""
    import mmap

    kind = TcpTransport if transport == "tcp" else ShmTransport
    t = make_engine("t", transports=[kind(serve="process")])
    a = make_engine("a", transports=[kind(rails=1, slice_size=128 * MiB)])  # one request
    size = 3 * MiB + 5
    area = mmap.mmap(-1, size)
    try:
        mem = np.frombuffer(area, dtype=np.uint8)
        seg_t = t.register(mem, name="m")
        src = random_bytes(size, 41)
        src_seg = a.register(src)
        peer = a.connect(t.endpoint)
        remote = peer.segment("m")
        a.write(peer, [(Descriptor(src_seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
        assert np.array_equal(mem, src)
        pid = t.transports[transport].info("serve_pid")
        assert isinstance(pid, int)
        before = _peak_rss(pid)
        copies = 96
        back = np.zeros(copies * MiB, dtype=np.uint8)
        with a.register(back) as back_seg:
            a.read(peer, [(Descriptor(back_seg, i * MiB, MiB), Descriptor(remote, 7, MiB))
                          for i in range(copies)]).wait(60)
        assert np.array_equal(back.reshape(copies, MiB),
                              np.broadcast_to(src[7:7 + MiB], (copies, MiB)))
        assert _peak_rss(pid) - before < 24 * MiB
        seg_t.close()
        del mem
    finally:
        area.close()


@pytest.mark.parametrize("serve", ["thread", "process"])
def test_closing_a_segment_a_stalled_peer_writes_into_keeps_to_its_timeout(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """A peer stops in the middle of a WRITE's payload: ``close(timeout=1)`` tears its
    rail down and returns within about that (the serving process once waited 5 s
    whatever the caller asked), and nothing the peer sends later lands."""
    from transfer_engine.transport.stream import HEADER

    b = make_engine("victim", transports=[TcpTransport(stall_timeout=20, serve=serve)])
    mem = random_bytes(MiB, 12)
    seg = b.register(mem, name="kv")
    _, credential = handshake(b)
    rail = RawRail(b, credential)
    try:
        rail.sock.sendall(HEADER.pack(KIND_WRITE, 0, 1, 0, 0, 0, 1, 0, 0)
                          + np.array([seg.id, 0, MiB], dtype="<u8").tobytes() + b"\x01" * 1000)
        time.sleep(0.3)
        started = time.monotonic()
        seg.close(timeout=1.0)
        assert time.monotonic() - started < 3
        snapshot = mem.copy()
        try:
            for _ in range(20):
                rail.sock.sendall(b"\x02" * 65536)
        except OSError:
            pass
        assert rail.closed_by_target(timeout=5)
        assert np.array_equal(mem, snapshot)
    finally:
        rail.close()

"""Faults: killed peers, dropped connections, refused paths, malformed messages."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from tests.helpers.faults import (
    AnswerLosingShmTransport,
    BrokenPostTcpTransport,
    DroppingTcpTransport,
    RefusingShmTransport,
    StallingTcpTransport,
)
from tests.helpers.transport_contract import random_bytes
from transfer_engine import (
    ClosedError,
    Descriptor,
    Engine,
    PeerLostError,
    TransferState,
)
from transfer_engine.transport.shm import ShmTransport
from transfer_engine.transport.tcp import TcpTransport

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("transports", ["tcp", "shm"])
def test_cross_process_roundtrip(make_engine: Callable[..., Engine],
                                 spawn_peer: Callable[..., tuple[subprocess.Popen[str], str]],
                                 transports: str) -> None:
    size = 16 * MiB
    _, endpoint = spawn_peer("remote", size, 7, transports)
    a = make_engine("a", transports=[transports])
    src = random_bytes(size, 8)
    seg = a.register(src)
    peer = a.connect(endpoint)
    assert peer.transport == transports
    remote = peer.segment("dst")
    expected_remote = random_bytes(size, 7)
    back = np.zeros(size, dtype=np.uint8)
    back_seg = a.register(back)
    a.read(peer, [(Descriptor(back_seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back, expected_remote)
    a.write(peer, [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    a.read(peer, [(Descriptor(back_seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back, src)


@pytest.mark.parametrize("transports", ["tcp", "shm"])
def test_peer_killed_mid_transfer(make_engine: Callable[..., Engine],
                                  spawn_peer: Callable[..., tuple[subprocess.Popen[str], str]],
                                  transports: str) -> None:
    size = 64 * MiB
    proc, endpoint = spawn_peer("victim", size, 3, transports)
    _, endpoint2 = spawn_peer("survivor", 1 * MiB, 4, "tcp")
    a = make_engine("a", transports=[transports, "tcp"] if transports != "tcp" else ["tcp"])
    src = random_bytes(size, 5)
    seg = a.register(src)
    victim = a.connect(endpoint)
    survivor = a.connect(endpoint2)
    remote = victim.segment("dst")
    pairs = [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))]
    handles = [a.write(victim, pairs) for _ in range(16)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    started = time.monotonic()
    failures = 0
    for h in handles:
        try:
            h.wait(10)
        except PeerLostError as exc:
            failures += 1
            assert exc.peer == "victim"
    assert failures >= 1, "16 x 64 MiB cannot all land before the kill"
    assert time.monotonic() - started < 10
    assert all(h.state is not TransferState.PENDING for h in handles)
    with pytest.raises(PeerLostError):
        a.write(victim, pairs).wait(10)
    # the engine keeps serving other peers
    rs = survivor.segment("dst")
    a.write(survivor, [(Descriptor(seg, 0, MiB), Descriptor(rs, 0, MiB))]).wait(10)
    back = np.zeros(MiB, dtype=np.uint8)
    bseg = a.register(back)
    a.read(survivor, [(Descriptor(bseg, 0, MiB), Descriptor(rs, 0, MiB))]).wait(10)
    assert np.array_equal(back, src[:MiB])


def test_close_with_transfers_to_a_hung_peer(
        spawn_peer: Callable[..., tuple[subprocess.Popen[str], str]]) -> None:
    """A peer that stops answering (SIGSTOP: its sockets stay open) holds transfers in
    flight; closing the engine fails them with ClosedError and returns promptly, also
    when the segment they use was registered after the peer was connected."""
    size = 64 * MiB
    proc, endpoint = spawn_peer("hung", size, 3)
    a = Engine("a", transports=["tcp"], timeout=5.0)
    try:
        peer = a.connect(endpoint)
        seg = a.register(random_bytes(size, 5))  # after connect: closed before the peer
        pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
        os.kill(proc.pid, signal.SIGSTOP)
        handles = [a.write(peer, pairs) for _ in range(4)]
        time.sleep(0.2)
        assert any(h.state is TransferState.PENDING for h in handles)
        started = time.monotonic()
        a.close()
        assert time.monotonic() - started < 3
        for h in handles:
            assert h.state is not TransferState.PENDING
            if h.state is TransferState.FAILED:
                with pytest.raises(ClosedError):
                    h.wait(1)
        assert seg.closed
    finally:
        a.close()
        os.kill(proc.pid, signal.SIGCONT)


def test_a_transfer_that_cannot_start_leaves_nothing_behind(
        make_engine: Callable[..., Engine]) -> None:
    """An unexpected error while posting (a bug, injected) reaches the caller, and the
    transfer leaves no pinned segment and nothing in flight."""
    a = make_engine("a", transports=[BrokenPostTcpTransport()])
    b = make_engine("b", transports=["tcp"])
    b.register(np.zeros(MiB, dtype=np.uint8), name="dst")
    seg = a.register(random_bytes(MiB, 2))
    peer = a.connect(b.endpoint)
    pairs = [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))]
    with pytest.raises(RuntimeError, match="fault injected"):
        a.write(peer, pairs)
    assert a.stats["transfers_failed"] == 1 and a.in_flight == 0
    seg.close(timeout=0.5)  # not pinned: deregisters at once


def test_connection_reset_mid_transfer(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=[DroppingTcpTransport()])
    other = make_engine("c", transports=["tcp"])
    src = random_bytes(8 * MiB, 1)
    seg = a.register(src)
    b.register(np.zeros(8 * MiB, dtype=np.uint8), name="dst")
    other_dst = np.zeros(MiB, dtype=np.uint8)
    other.register(other_dst, name="dst")
    peer = a.connect(b.endpoint)
    h = a.write(peer, [(Descriptor(seg, 0, 8 * MiB), Descriptor(peer.segment("dst"), 0, 8 * MiB))],
                notify=b"never")
    with pytest.raises(PeerLostError) as info:
        h.wait(10)
    assert info.value.peer == "b" and info.value.transport == "tcp"
    assert b.notifications(timeout=0.2) == []
    p2 = a.connect(other.endpoint)
    a.write(p2, [(Descriptor(seg, 0, MiB), Descriptor(p2.segment("dst"), 0, MiB))]).wait(10)
    assert np.array_equal(other_dst, src[:MiB])


def test_a_read_whose_target_stops_midway_fails_at_its_pace(
        make_engine: Callable[..., Engine]) -> None:
    """A target whose control plane answers on while its READ answer stops after 64
    KiB once held the initiator's reader for ever (a transfer has no deadline by
    default, and the peer answers its probes): the answer now keeps a pace, so the
    transfer fails after about a stall and a second (64 KiB at 64 KiB/s), and the
    initiator's other transfers go on."""
    a = make_engine("a", transports=[TcpTransport(stall_timeout=1.0)])
    b = make_engine("b", transports=[StallingTcpTransport()])
    other = make_engine("c", transports=["tcp"])
    b.register(random_bytes(8 * MiB, 3), name="src")
    src = random_bytes(MiB, 4)
    other.register(src, name="src")
    seg = a.register(np.zeros(8 * MiB, dtype=np.uint8))
    peer = a.connect(b.endpoint)
    started = time.monotonic()
    h = a.read(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("src"), 0, MiB))])
    with pytest.raises(PeerLostError) as info:
        h.wait(30)
    assert time.monotonic() - started < 6
    assert info.value.peer == "b" and info.value.transport == "tcp"
    p2 = a.connect(other.endpoint)
    a.read(p2, [(Descriptor(seg, MiB, MiB), Descriptor(p2.segment("src"), 0, MiB))]).wait(10)
    assert bytes(seg.view()[MiB:2 * MiB]) == src.tobytes()


def test_shm_refused_falls_back_to_tcp(make_engine: Callable[..., Engine]) -> None:
    """The same-host path fails mid-transfer: the transfer completes over TCP, byte-exact,
    with exactly one notification."""
    a = make_engine("a", transports=["shm", "tcp"])
    b = make_engine("b", transports=[RefusingShmTransport(), TcpTransport()])
    size = 16 * MiB
    src = random_bytes(size, 11)
    dst = random_bytes(size, 12)
    seg = a.register(src)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    assert peer.transport == "shm"
    remote = peer.segment("dst")
    pairs = [(Descriptor(seg, k, 65536), Descriptor(remote, k, 65536))
             for k in range(0, size, 65536)]
    h = a.write(peer, pairs, notify=b"once")
    h.wait(20)
    assert h.transport == "tcp" and h.bytes_done == size
    assert np.array_equal(dst, src)
    notes = b.notifications(timeout=2)
    time.sleep(0.2)
    notes += b.notifications(timeout=0)
    assert [n.payload for n in notes] == [b"once"]
    assert peer.transport == "tcp" and a.stats["fallback_shm"] == 1


@pytest.mark.parametrize("serve", ["thread", "process"])
def test_a_write_that_landed_but_lost_its_answer_notifies_once(
        make_engine: Callable[..., Engine], serve: str) -> None:
    """The target counts a WRITE's immediate (and notifies), then its shm connection
    drops before the answer: the initiator cannot know the bytes landed, so the WRITE
    is made again over tcp (served from threads or a serving process) as a later
    attempt naming its first. Bytes exact, one notification (two before attempts named
    their first)."""
    a = make_engine("a", transports=[ShmTransport(rails=1), TcpTransport()])
    b = make_engine("b", transports=[AnswerLosingShmTransport(), TcpTransport(serve=serve)])
    size = 4 * MiB
    src = random_bytes(size, 21)
    dst = random_bytes(size, 22)
    seg = a.register(src)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    assert peer.transport == "shm"
    remote = peer.segment("dst")
    h = a.write(peer, [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))],
                notify=b"once")
    h.wait(20)
    assert h.transport == "tcp" and a.stats["fallback_shm"] == 1
    assert np.array_equal(dst, src)
    notes = b.notifications(timeout=2)
    time.sleep(0.3)
    notes += b.notifications(timeout=0)
    assert [n.payload for n in notes] == [b"once"]
    assert b.stats["notify_duplicates"] == 1
    # the next transfers notify as usual, each once
    for k in range(3):
        a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(remote, 0, MiB))],
                notify=b"n%d" % k).wait(10)
    notes = b.notifications(timeout=2)
    deadline = time.monotonic() + 5
    while len(notes) < 3 and time.monotonic() < deadline:
        notes += b.notifications(timeout=0.5)
    assert [n.payload for n in notes] == [b"n0", b"n1", b"n2"]


def test_malformed_rail_bytes_do_not_stop_the_target(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    dst = random_bytes(MiB, 2)
    b.register(dst, name="dst")
    snapshot = dst.copy()
    info = b.metadata()["transports"]["tcp"]
    rng = np.random.default_rng(0)
    for _ in range(50):
        with socket.create_connection((info["host"], info["port"]), timeout=5) as s:
            s.sendall(rng.integers(0, 256, int(rng.integers(1, 4096)), dtype=np.uint8).tobytes())
    assert np.array_equal(dst, snapshot)
    src = random_bytes(MiB, 3)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))]).wait(10)
    assert np.array_equal(dst, src)


def test_malformed_control_messages_are_answered_not_fatal(
        make_engine: Callable[..., Engine]) -> None:
    b = make_engine("b", transports=["tcp"])
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(b.endpoint)
        rng = np.random.default_rng(1)
        for _ in range(300):
            sock.send(rng.integers(0, 256, int(rng.integers(0, 512)), dtype=np.uint8).tobytes())
        answered = 0
        while sock.poll(2000):
            sock.recv()
            answered += 1
            if answered == 300:
                break
        assert answered == 300
        sock.close()
    finally:
        ctx.term()
    assert b.stats["control_rejected"] >= 300
    a = make_engine("a", transports=["tcp"])
    assert a.connect(b.endpoint).name == "b"

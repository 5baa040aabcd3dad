"""Waiting for a peer holding the GIL (``Engine(hold_gil=)``, transport/held.py).

The target engine runs in a process of its own (``spawn_peer``): only then does the
initiator hold the GIL while it waits, and only while the process's GIL is seen
contended, which the ``contended`` fixture declares for every test here but the one
that watches the detector itself. Behaviour only: bytes exact, answers never left
unread, failures precise and bounded, the budget respected; the speed under a busy
thread is bench.contention's business.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tests.helpers.transport_contract import random_bytes
from transfer_engine import Blocks, Descriptor, Engine
from transfer_engine.errors import PeerLostError, TransferError, TransferTimeout
from transfer_engine.handle import TransferState
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment
from transfer_engine.transport import held
from transfer_engine.transport.iovec import _advance

pytestmark = pytest.mark.skipif(not held.AVAILABLE, reason="no held socket calls here")

MiB = 1 << 20
Spawn = Callable[..., tuple[subprocess.Popen[str], str]]


@pytest.fixture(autouse=True)
def contended(request: pytest.FixtureRequest) -> Iterator[None]:
    if "detector" not in request.node.name:
        held.contention.until = math.inf
    yield
    held.contention.until = 0.0


def test_detector_sees_a_busy_thread_and_then_holds(make_engine: Callable[..., Engine],
                                                 spawn_peer: Spawn,
                                                 busy_python: None) -> None:
    """The detector: waiters that wake late (a busy thread holds the GIL) turn holding
    on for the transfers that follow."""
    _, endpoint = spawn_peer("far", 4 * MiB, 2)
    a = make_engine("a", transports=["tcp"])
    back = np.zeros(4 * MiB, dtype=np.uint8)
    seg = a.register(back, name="back")
    peer = a.connect(endpoint)
    pair = [(Descriptor(seg, 0, 4 * MiB), Descriptor(peer.segment("dst"), 0, 4 * MiB))]
    assert not held.contention.now()
    first = a.read(peer, pair)
    assert first._assist is None and first._lagged is not None
    first.wait(10)
    for _ in range(50):
        if held.contention.now():
            break
        a.read(peer, pair).wait(10)
    assert held.contention.now()
    handle = a.read(peer, pair)
    assert handle._assist is not None
    handle.wait(10)
    assert np.array_equal(back, _peer_bytes(4 * MiB, 2))


def _far(make_engine: Callable[..., Engine], spawn_peer: Spawn, size: int, seed: int,
         data_seed: int, transports: str = "tcp", **engine_kw: object
         ) -> tuple[subprocess.Popen[str], Engine, np.ndarray, Segment, Peer, RemoteSegment]:
    """A peer process serving ``size`` bytes (``seed``) over ``transports``, and an
    engine connected to it with ``size`` random bytes (``data_seed``) registered: (peer
    process, engine, those bytes, their segment, the peer, its ``dst``)."""
    proc, endpoint = spawn_peer("far", size, seed, transports)
    a = make_engine("a", transports=transports.split(","), **engine_kw)
    src = random_bytes(size, seed=data_seed)
    seg = a.register(src, name="src")
    peer = a.connect(endpoint)
    return proc, a, src, seg, peer, peer.segment("dst")


def _peer_bytes(size: int, seed: int) -> np.ndarray:
    """What ``tests.helpers.peer_process`` fills its ``dst`` segment with."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
@pytest.mark.parametrize("block,count", [(4096, 128), (MiB, 16), (3 * MiB + 5, 7)])
def test_transfers_to_another_process_are_exact_held(
        make_engine: Callable[..., Engine], spawn_peer: Spawn, busy_python: None,
        protocol: str, block: int, count: int) -> None:
    size = block * count
    _, a, src, seg, peer, remote = _far(make_engine, spawn_peer, size, 3, block,
                                        "tcp" if protocol == "tcp" else "shm,tcp")
    back = np.zeros(size, dtype=np.uint8)
    bseg = a.register(back, name="back")
    assert peer.transport == protocol
    # what the peer holds before: read it back whole, held
    handle = a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(remote, 0, size))])
    assert handle._assist is not None  # held: the peer is another process
    handle.wait(30)
    assert np.array_equal(back, _peer_bytes(size, 3))
    perm = np.random.default_rng(count).permutation(count)
    for _ in range(4):
        a.write(peer, Blocks(seg, remote, np.arange(count) * block, perm * block, block)
                ).wait(30)
    back[:] = 0
    a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back.reshape(count, block)[perm], src.reshape(count, block))


def test_a_peer_in_this_process_is_never_held(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    src = random_bytes(MiB, seed=1)
    dst = np.zeros(MiB, dtype=np.uint8)
    seg = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    handle = a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))])
    assert handle._assist is None  # its target needs this GIL to take the bytes
    handle.wait(10)
    assert np.array_equal(dst, src)


def test_hold_gil_zero_turns_holding_off(make_engine: Callable[..., Engine],
                                         spawn_peer: Spawn) -> None:
    _, endpoint = spawn_peer("far", MiB, 4)
    a = make_engine("a", transports=["tcp"], hold_gil=0)
    back = np.zeros(MiB, dtype=np.uint8)
    seg = a.register(back, name="back")
    peer = a.connect(endpoint)
    handle = a.read(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))])
    assert handle._assist is None
    handle.wait(10)
    assert np.array_equal(back, _peer_bytes(MiB, 4))


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, True, "5"])
def test_hold_gil_must_be_seconds(value: object) -> None:
    with pytest.raises(ValueError, match="hold_gil"):
        Engine("bad", hold_gil=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_te_hold_gil_must_be_seconds(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TE_HOLD_GIL", value)
    with pytest.raises(ValueError, match="TE_HOLD_GIL"):
        held.default_budget()


def test_an_answer_nobody_waits_for_is_taken_after_the_grace(
        make_engine: Callable[..., Engine], spawn_peer: Spawn) -> None:
    """The caller sent holding the GIL, so the pump left the socket to it; it never
    waits, so the pump takes the answer back after the grace and completes the work."""
    _, a, src, seg, peer, remote = _far(make_engine, spawn_peer, 4 * MiB, 5, 6,
                                        hold_gil=0.01)
    handles = [a.write(peer, [(Descriptor(seg, i * MiB, MiB), Descriptor(remote, i * MiB, MiB))])
               for i in range(4)]
    deadline = time.monotonic() + 10
    while (any(h.state is TransferState.PENDING for h in handles)
           and time.monotonic() < deadline):
        time.sleep(0.005)  # .state takes nothing itself, unlike done() and wait()
    assert all(h.state is TransferState.DONE for h in handles)
    back = np.zeros(4 * MiB, dtype=np.uint8)
    bseg = a.register(back, name="back")
    a.read(peer, [(Descriptor(bseg, 0, 4 * MiB), Descriptor(remote, 0, 4 * MiB))]).wait(10)
    assert np.array_equal(back, src)


def test_done_takes_the_answer_itself(make_engine: Callable[..., Engine],
                                      spawn_peer: Spawn, busy_python: None) -> None:
    _, a, src, seg, peer, remote = _far(make_engine, spawn_peer, 8 * MiB, 7, 8)
    for _ in range(5):
        handle = a.write(peer, [(Descriptor(seg, 0, 8 * MiB), Descriptor(remote, 0, 8 * MiB))])
        deadline = time.monotonic() + 10
        while not handle.done() and time.monotonic() < deadline:
            pass  # polled as Mooncake's getTransferStatus callers do
        assert handle.state is TransferState.DONE
    back = np.zeros(8 * MiB, dtype=np.uint8)
    bseg = a.register(back, name="back")
    a.read(peer, [(Descriptor(bseg, 0, 8 * MiB), Descriptor(remote, 0, 8 * MiB))]).wait(10)
    assert np.array_equal(back, src)


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_stopped_peer_never_blocks_write_done_or_wait(
        make_engine: Callable[..., Engine], spawn_peer: Spawn, op: str) -> None:
    """What the socket cannot take (or has not brought) within the budget goes on in a
    worker: write() returns at once, done() at once, wait(timeout) after its timeout,
    and the peer killed meanwhile fails the transfer with PeerLostError."""
    proc, a, _, seg, peer, remote = _far(make_engine, spawn_peer, 64 * MiB, 9, 10,
                                         peer_timeout=None)
    pair = [(Descriptor(seg, 0, 64 * MiB), Descriptor(remote, 0, 64 * MiB))]
    submit = a.write if op == "write" else a.read
    submit(peer, pair).wait(30)  # the pump's workers are up: a worker may drain
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        handle = submit(peer, pair)
        assert time.monotonic() - start < 2
        time.sleep(0.05)
        start = time.monotonic()
        assert not handle.done()
        assert time.monotonic() - start < 0.5
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            handle.wait(0.3)
        assert time.monotonic() - start < 1.5
        assert handle.state is TransferState.PENDING
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
    with pytest.raises(PeerLostError):
        handle.wait(30)


def test_a_killed_peer_fails_the_held_wait(make_engine: Callable[..., Engine],
                                           spawn_peer: Spawn, busy_python: None) -> None:
    proc, a, _, seg, peer, remote = _far(make_engine, spawn_peer, 16 * MiB, 11, 12)
    pair = [(Descriptor(seg, 0, 16 * MiB), Descriptor(remote, 0, 16 * MiB))]
    a.write(peer, pair).wait(10)
    proc.kill()
    proc.wait(10)
    start = time.monotonic()
    with pytest.raises(TransferError):
        for _ in range(50):  # the rail's end is seen at the latest by the next send
            a.write(peer, pair).wait(10)
    assert time.monotonic() - start < 15


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(True)
    yield a, b
    a.close()
    b.close()


def test_held_send_stops_at_its_budget_and_says_how_much(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = random_bytes(16 * MiB, seed=13).tobytes()
    rows = held.buffer_rows(data)
    start = time.monotonic()
    sent = held.send_rows(a, rows, len(data), time.monotonic() + 0.05)
    assert 0 < sent < len(data)  # nobody reads: the buffer fills, the budget ends it
    assert time.monotonic() - start < 1
    # the reader is another process: held, this one lets no thread of its own run
    reader = subprocess.Popen(
        [sys.executable, "-c", _DIGEST, str(len(data))], pass_fds=(b.fileno(),),
        env={**os.environ, "FD": str(b.fileno())}, stdout=subprocess.PIPE, text=True)
    try:
        more = held.send_rows(a, _advance(rows, sent), len(data) - sent,
                              time.monotonic() + 10)
        out, _ = reader.communicate(timeout=30)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert sent + more == len(data)
    assert out.strip() == hashlib.sha256(data).hexdigest()


_DIGEST = """
import hashlib, os, socket, sys
s = socket.socket(fileno=int(os.environ["FD"]))
n, h = int(sys.argv[1]), hashlib.sha256()
while n:
    chunk = s.recv(min(n, 1 << 20))
    if not chunk:
        break
    h.update(chunk)
    n -= len(chunk)
print(h.hexdigest())
"""


def test_held_receive_takes_what_comes_and_reports_the_end(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    buf = bytearray(100)
    rows = held.buffer_rows(buf)
    assert held.recv_rows(b, rows, 100, time.monotonic()) == 0  # nothing yet, no wait
    a.sendall(b"x" * 40)
    assert held.recv_rows(b, rows, 100, time.monotonic() + 0.05) == 40
    assert bytes(buf[:40]) == b"x" * 40
    a.close()
    with pytest.raises(ConnectionResetError):
        held.recv_rows(b, held.buffer_rows(memoryview(buf)[40:]), 60, time.monotonic() + 1)


def test_windows_nest_to_the_shorter_and_end(pair: tuple[socket.socket, socket.socket]
                                             ) -> None:
    assert held.until() is None
    with held.window(1.0):
        first = held.until()
        assert first is not None and first - time.monotonic() > 0.5
        with held.window(0.01):
            inner = held.until()
            assert inner is not None and inner - time.monotonic() < 0.02
        assert (held.until() or 0) - time.monotonic() > 0.5
        start = time.monotonic()
        assert not held.wait_for(pair[1], 1, time.monotonic() + 0.02)
        assert 0.015 < time.monotonic() - start < 0.5
    assert held.until() is None
    with held.window(0):  # takes what is there, never waits
        until = held.until()
        assert until is not None
        assert not held.wait_for(pair[1], 1, until)


def test_a_turn_begins_again_after_time_off_the_cpu_or_a_long_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """held.Turn: time between the engine's calls spent running (CPU time grows with
    the clock) is one turn; more than GAP off the CPU (switched out), or a held wait
    longer than the switch interval, starts a new one."""
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    turn = held.Turn()
    turn.resume(10.0, cpu=1.0)
    assert turn.began == 10.0 and turn.left(10.0) == pytest.approx(0.005)
    turn.resume(10.0025, cpu=1.0024)  # 2.5 ms of the application's Python: same turn
    turn.pause(10.0035, 0.001, cpu=1.0025)  # a held wait shorter than a turn
    turn.resume(10.0036, cpu=1.0026)
    assert turn.began == 10.0 and turn.left(10.004) == pytest.approx(0.001)
    turn.resume(10.0066, cpu=1.0027)  # 3 ms off the CPU: switched out meanwhile
    assert turn.began == 10.0066
    turn.pause(10.02, 0.0134, cpu=1.003)  # a wait longer than a turn
    assert turn.began == 10.02
    assert turn.expect("shm", 4096) is None
    turn.learned("shm", 4096, 0.002)
    turn.learned("shm", 5000, 0.004)  # same size class (13 bits)
    turn.learned("tcp", 5000, 0.003)  # another kind: kept apart
    assert turn.expect("shm", 8191) == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    assert turn.expect("shm", 8192) is None
    assert turn.expect("tcp", 4096) == 0.003
    # waits longer than a turn: expected long (kept as two turns) once at least three
    # quarters of the last KEEP were, and then one wait in PROBE holds to measure again
    big = 1 << 24
    for _ in range(3):
        turn.learned("shm", big, 0.030)
    assert turn.expect("shm", big) is None and not turn.probe("shm", big)  # too few yet
    turn.learned("shm", big, 0.030)
    assert turn.expect("shm", big) == pytest.approx(0.010)
    assert [turn.probe("shm", big) for _ in range(2 * held.Turn.PROBE)].count(True) == 2
    for seconds in [0.002] * 3 + [0.030] * 5:  # 3 of the last 8 fitted: short again
        turn.learned("shm", big, seconds)
    assert turn.expect("shm", big) == pytest.approx(0.002)
    assert not turn.probe("shm", big)
    for seconds in [0.001] * 6 + [0.030] * 2:  # a few slowed by the host: still short
        turn.learned("tcp", big, seconds)
    assert turn.expect("tcp", big) == pytest.approx(0.001)
    before = time.monotonic()
    turn.give()  # nobody wants the GIL: back at once, a new turn
    assert before <= turn.began == turn.last <= time.monotonic()
    assert held.turn() is held.turn()


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_a_waiter_gives_its_turn_only_while_the_peer_works(
        make_engine: Callable[..., Engine], spawn_peer: Spawn, protocol: str) -> None:
    """Back-to-back transfers, in a process declared contended, fill a turn with the
    GIL (no other thread takes it here, so the turn only ends by the clock). Once a
    WRITE is sent whole (and over shm, where the target copies, for READs too) only
    the peer has work left, so the waiter gives the GIL up before a wait that would
    outlast the turn (held.Turn); a tcp READ, whose bytes this thread receives, never
    does. Bytes exact either way."""
    block, count = 4096, 128
    size = block * count
    _, a, src, seg, peer, remote = _far(make_engine, spawn_peer, size, 4, 9,
                                        "tcp" if protocol == "tcp" else "shm,tcp")
    back = np.zeros(size, dtype=np.uint8)
    bseg = a.register(back, name="back")
    assert peer.transport == protocol
    rng = np.random.default_rng(5)
    model = np.zeros((count, block), dtype=np.uint8)  # what the peer's dst holds
    rows = src.reshape(count, block)

    def rounds(op: str, notify: bytes | None = None) -> int:
        """Transfers until one gave its turn (at least 50, at most 400 or 20 s), each
        WRITE's blocks to a new order, each READ's back to a new order."""
        given = a.stats["gil_given"]
        deadline = time.monotonic() + 20
        done = 0
        while time.monotonic() < deadline and done < 400 and (
                done < 50 or a.stats["gil_given"] == given):
            perm = rng.permutation(count)
            if op == "write":
                a.write(peer, Blocks(seg, remote, np.arange(count) * block, perm * block,
                                     block)).wait(30)
                model[perm] = rows
            else:
                back[:] = 0
                a.read(peer, Blocks(bseg, remote, perm * block, np.arange(count) * block,
                                    block), notify=notify).wait(30)
                assert np.array_equal(back.reshape(count, block)[perm], model)
            done += 1
        assert done >= 50
        return a.stats["gil_given"] - given

    assert rounds("write") > 0
    given = rounds("read")
    assert given > 0 if protocol == "shm" else given == 0
    if protocol == "tcp":  # nor for the notification's answer, a small WRITE's
        assert rounds("read", notify=b"read") == 0


def test_a_waiter_sends_a_large_payload_first_and_then_gives_its_turn(
        make_engine: Callable[..., Engine], spawn_peer: Spawn, busy_python: None) -> None:
    """A tcp WRITE above the size sent inline is queued for a worker, which a busy
    thread keeps waiting for the GIL: the waiter sends the payload itself, and once it
    is sent only the peer's part is left, so the waiter may give its turn up as over
    shm (before, it never did for such a WRITE). Bytes exact at the peer."""
    block, count = MiB, 8
    size = block * count
    _, a, src, seg, peer, remote = _far(make_engine, spawn_peer, size, 4, 11, "tcp")
    rng = np.random.default_rng(6)
    model = np.zeros((count, block), dtype=np.uint8)
    rows = src.reshape(count, block)
    deadline = time.monotonic() + 30
    done = 0
    while time.monotonic() < deadline and done < 300 and (
            done < 30 or a.stats["gil_given"] == 0):
        perm = rng.permutation(count)
        a.write(peer, Blocks(seg, remote, np.arange(count) * block, perm * block, block)
                ).wait(30)
        model[perm] = rows
        done += 1
    assert a.stats["gil_given"] > 0, done
    back = np.zeros(size, dtype=np.uint8)
    bseg = a.register(back, name="back")
    a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back.reshape(count, block), model)

"""Every wait ends: cancel, deadlines, silent peers, stuck segments, immediate floods.

Stalled peers are real processes stopped with SIGSTOP (their sockets stay open and
answer nothing); every test resumes or kills what it stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest

from tests.helpers.faults import finish_as_engine, rail_socket, stopped
from tests.helpers.transport_contract import random_bytes
from transfer_engine import (
    Blocks,
    ClosedError,
    Descriptor,
    Engine,
    PeerLostError,
    TransferCancelled,
    TransferState,
    TransferTimeout,
)
from transfer_engine.descriptor import Op
from transfer_engine.handle import TransferHandle
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment
from transfer_engine.transport.base import Immediate
from transfer_engine.transport.tcp import TcpTransport

MiB = 1 << 20
Spawn = Callable[..., tuple[subprocess.Popen[str], str]]
STALLED = 16 * MiB  # what a peer to stall serves, and what fills its sockets


class OneRail(NamedTuple):
    proc: subprocess.Popen[str]  # the peer process, to stop
    endpoint: str
    engine: Engine
    peer: Peer
    seg: Segment  # STALLED random bytes of the engine's
    remote: RemoteSegment  # the peer's dst


@contextlib.contextmanager
def one_rail_to_a_peer(spawn_peer: Spawn, timeout: float = 5.0) -> Iterator[OneRail]:
    """An engine with one tcp rail to a peer process serving STALLED bytes, closed
    after the block."""
    proc, endpoint = spawn_peer("stalled", STALLED, 3)
    a = Engine("a", transports=[TcpTransport(rails=1)], timeout=timeout, peer_timeout=None)
    try:
        peer = a.connect(endpoint)
        yield OneRail(proc, endpoint, a, peer, a.register(random_bytes(STALLED, 5)),
                      peer.segment("dst"))
    finally:
        a.close()


def open_sockets(peer: Any) -> list[Any]:
    """The rails to ``peer`` that still hold a socket (rails have no threads of their
    own: the process's pump serves them all)."""
    return [rail for rails in peer.rails.values() for rail in rails
            if rail_socket(rail).fileno() != -1]


def test_cancel_of_a_handle_without_engine_and_of_a_finished_one() -> None:
    h = TransferHandle(1, Op.WRITE, "b", 10)
    assert h.cancel() and h.state is TransferState.FAILED
    with pytest.raises(TransferCancelled, match="cancelled") as info:
        h.wait(0)
    assert info.value.peer == "b" and info.value.op == "write"
    assert not h.cancel()
    done = TransferHandle(2, Op.READ, "b", 10)
    finish_as_engine(done)
    assert not done.cancel() and done.state is TransferState.DONE


def test_cancel_after_completion_is_a_no_op(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    dst = np.zeros(MiB, dtype=np.uint8)
    b.register(dst, name="dst")
    src = a.register(random_bytes(MiB, 1))
    peer = a.connect(b.endpoint)
    h = a.write(peer, [(Descriptor(src, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))],
                timeout=30)
    h.wait(10)
    assert not h.cancel() and h.state is TransferState.DONE
    assert dst.tobytes() == bytes(src.view())
    assert a.probing == 0  # idle: no probes


def test_cancel_withdraws_queued_work_and_tears_down_a_rail_only_for_work_on_the_wire(
        spawn_peer: Spawn) -> None:  # noqa: F811
    size = STALLED
    with one_rail_to_a_peer(spawn_peer) as (proc, endpoint, a, peer, seg, remote):
        with stopped(proc):
            first = a.write(peer, [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))])
            queued = a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(remote, 0, MiB))])
            time.sleep(0.2)  # the first fills the socket buffers and blocks the sender
            assert queued.cancel()
            with pytest.raises(TransferCancelled):
                queued.wait(0)
            assert a.stats["rails_torn_down"] == 0 and not first.done()
            started = time.monotonic()
            assert first.cancel()
            assert time.monotonic() - started < 4
            assert first.state is TransferState.FAILED
            with pytest.raises(TransferCancelled):
                first.wait(0)
            assert a.stats["rails_torn_down"] == 1 and a.in_flight == 0
            seg.close(timeout=0.1)  # nothing pins it any more
            assert not first.cancel()
        # a connect again finds the peer as it was (a prefix of the cancelled write may
        # land at the start of dst: test the end)
        peer = a.connect(endpoint)
        data = a.register(random_bytes(MiB, 9))
        back = a.register(np.zeros(MiB, dtype=np.uint8))
        pairs = [(Descriptor(data, 0, MiB),
                  Descriptor(peer.segment("dst"), size - MiB, MiB))]
        a.write(peer, pairs).wait(10)
        a.read(peer, [(Descriptor(back, 0, MiB), pairs[0][1])]).wait(10)
        assert back.view().tobytes() == data.view().tobytes()


def test_a_deadline_fails_a_stalled_transfer_with_transfer_timeout(
        spawn_peer: Spawn) -> None:  # noqa: F811
    size = 8 * MiB
    proc, endpoint = spawn_peer("slow", size, 4)
    a = Engine("a", transports=["tcp"], timeout=5.0, peer_timeout=None,
               transfer_timeout=30.0)
    try:
        peer = a.connect(endpoint)
        dst = a.register(np.zeros(size, dtype=np.uint8))
        pairs = [(Descriptor(dst, 0, size), Descriptor(peer.segment("dst"), 0, size))]
        with stopped(proc):
            started = time.monotonic()
            h = a.read(peer, pairs, timeout=0.3)
            with pytest.raises(TransferTimeout, match="deadline of 0.3s") as info:
                h.wait(5)
            assert 0.25 < time.monotonic() - started < 4
            assert info.value.peer == "slow" and info.value.op == "read"
            assert h.state is TransferState.FAILED and not h.cancel()
            assert a.stats["transfers_timed_out"] == 1
            dst.close(timeout=0.1)  # unpinned
    finally:
        a.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_silent_peer_is_declared_lost_and_its_sockets_go(
        spawn_peer: Spawn, transport: str) -> None:  # noqa: F811
    size = 8 * MiB
    proc, endpoint = spawn_peer("frozen", size, 6, "shm,tcp")
    a = Engine("a", transports=[transport], timeout=5.0, peer_timeout=1.0)
    try:
        peer = a.connect(endpoint)
        seg = a.register(random_bytes(size, 7))
        pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
        a.write(peer, pairs).wait(10)  # a live peer answers its probes: nothing happens
        assert open_sockets(peer)
        with stopped(proc):
            started = time.monotonic()
            h = a.write(peer, pairs)
            with pytest.raises(PeerLostError, match="no answer to control probes"):
                h.wait(10)
            assert time.monotonic() - started < 6  # grace 0.2 s + 1 s + a tick, on a loaded host
            assert peer.lost is not None and a.stats["peers_lost"] == 1
            deadline = time.monotonic() + 5
            while open_sockets(peer) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert open_sockets(peer) == []
            assert all(rail.closed for rails in peer.rails.values() for rail in rails)
            assert a.probing == 0
            with pytest.raises(PeerLostError):
                a.write(peer, pairs)
        peer = a.connect(endpoint)  # resumed: a fresh connect works
        a.write(peer, pairs).wait(10)
    finally:
        a.close()


def test_closing_a_segment_a_stalled_read_lands_in_returns_within_the_bound(
        spawn_peer: Spawn) -> None:  # noqa: F811
    size = 8 * MiB
    proc, endpoint = spawn_peer("stuck", size, 8)
    a = Engine("a", transports=["tcp"], timeout=5.0, peer_timeout=None)
    try:
        peer = a.connect(endpoint)
        dst = a.register(np.zeros(size, dtype=np.uint8))
        pairs = [(Descriptor(dst, 0, size), Descriptor(peer.segment("dst"), 0, size))]
        with stopped(proc):
            h = a.read(peer, pairs)
            time.sleep(0.1)
            started = time.monotonic()
            dst.close(timeout=0.3)
            assert time.monotonic() - started < 4
            assert dst.closed
            with pytest.raises(ClosedError, match="segment deregistered") as info:
                h.wait(1)
            assert info.value.segment == dst.name
    finally:
        a.close()


def test_a_flood_of_partial_immediates_spares_another_peers_notification(
        make_engine: Callable[..., Engine]) -> None:
    b = make_engine("b", transports=["tcp"])
    b.deliver_immediate("good", Immediate(7, 2, b"req-17"))  # one rail of two landed
    for tid in range(70_000):
        b.deliver_immediate("evil", Immediate(tid, 2, b"junk"))
    assert b.notifications(timeout=0) == []
    b.deliver_immediate("good", Immediate(7, 2))
    notes = b.notifications(timeout=0)
    assert [(n.peer, n.payload) for n in notes] == [("good", b"req-17")]
    b.deliver_immediate("good", Immediate(7, 2))  # a replay starts over: not twice
    assert b.notifications(timeout=0) == []


def test_a_work_sent_again_notifies_once_and_after_every_rail(
        make_engine: Callable[..., Engine]) -> None:
    """A NIC rail that broke after its work landed (the answer lost) has the work sent
    again on another rail: the target counts it once, so the notification waits for
    the other rail and fires once."""
    b = make_engine("b", transports=["tcp"])
    b.deliver_immediate("a", Immediate(3, 2, b"req-3"), b"ticket", 40)  # rail A landed
    b.deliver_immediate("a", Immediate(3, 2, b"req-3"), b"ticket", 40, True)  # again, B
    assert b.notifications(timeout=0) == []
    b.deliver_immediate("a", Immediate(3, 2), b"ticket", 41)  # rail B
    assert [n.payload for n in b.notifications(timeout=0)] == [b"req-3"]
    b.deliver_immediate("a", Immediate(3, 2), b"ticket", 41, True)
    assert b.notifications(timeout=0) == []
    assert b.stats["notify_duplicates"] == 2 and b.stats["notifications"] == 1


def test_a_rail_torn_down_by_a_cancel_is_reopened_for_the_next_transfer(
        spawn_peer: Spawn) -> None:  # noqa: F811
    """A cancel tears down the tcp rail its work is on; the next transfer to the peer
    opens a new one with the same ticket instead of finding none."""
    size = STALLED
    with one_rail_to_a_peer(spawn_peer) as (proc, _, a, peer, seg, remote):
        for round_ in range(2):
            with stopped(proc):
                first = a.write(peer, [(Descriptor(seg, 0, size),
                                        Descriptor(remote, 0, size))])
                time.sleep(0.2)  # it fills the socket buffers: on the wire
                assert first.cancel()
            assert a.stats["rails_torn_down"] == round_ + 1
            data = a.register(random_bytes(MiB, 9 + round_))
            back = a.register(np.zeros(MiB, dtype=np.uint8))
            pairs = [(Descriptor(data, 0, MiB), Descriptor(remote, size - MiB, MiB))]
            a.write(peer, pairs).wait(10)  # no connect() in between
            a.read(peer, [(Descriptor(back, 0, MiB), pairs[0][1])]).wait(10)
            assert back.view().tobytes() == data.view().tobytes()


@pytest.mark.parametrize("posted", [0, 1])
def test_a_rail_closed_between_being_chosen_and_posted_to_hands_its_work_on(
        spawn_peer: Spawn, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        posted: int) -> None:
    """Another transfer's cancel can tear a rail down after a transfer chose it and
    before it posted to it: the work goes to another open rail of the peer (or to the
    same one, reopened) instead of failing with "rail is closed". The cancel's timing
    is made certain by tearing the rail down as the transfer posts its ``posted``-th
    work (over one rail: its only one, reopened; over two: the second's)."""
    size = 16 * MiB
    _, endpoint = spawn_peer("far", size, 3)
    a = Engine("a", transports=[TcpTransport(rails=posted + 1, spread=posted + 1,
                                             slice_size=4 * MiB)], timeout=10.0)
    try:
        peer = a.connect(endpoint)
        data = random_bytes(size, 7)
        got = np.zeros(size, dtype=np.uint8)
        src, back = a.register(data), a.register(got)
        remote = peer.segment("dst")
        posts: list[Any] = []
        for rail in list(peer.rails["tcp"]):
            def post(work: Any, rail: Any = rail, post: Any = rail.post) -> None:
                posts.append(rail)
                if len(posts) == posted + 1:  # what a cancel's teardown does to it
                    rail.abort(PeerLostError("torn down to stop another transfer",
                                             peer="far"))
                post(work)
            monkeypatch.setattr(rail, "post", post)
        pairs = Blocks(src, remote, np.arange(16) * MiB, np.arange(16)[::-1] * MiB, MiB)
        a.write(peer, pairs).wait(10)
        assert len(posts) > posted and posts[posted].closed
        a.read(peer, [(Descriptor(back, 0, size), Descriptor(remote, 0, size))]).wait(10)
        assert np.array_equal(got.reshape(16, MiB), data.reshape(16, MiB)[::-1])
    finally:
        a.close()


def test_a_cancel_that_tears_a_rail_down_costs_the_other_transfers_on_it_nothing(
        spawn_peer: Spawn) -> None:  # noqa: F811
    """Transfers that shared the torn-down rail with a cancelled one are posted again
    (over a reopened rail) and land byte for byte; only the cancelled one fails."""
    size = STALLED
    with one_rail_to_a_peer(spawn_peer, timeout=10.0) as (proc, _, a, peer, big, remote):
        data = random_bytes(2 * MiB, 11)
        small = a.register(data)
        got = np.zeros(2 * MiB, dtype=np.uint8)
        back = a.register(got)
        near_end = Descriptor(remote, size - 2 * MiB, 2 * MiB)
        with stopped(proc):
            first = a.write(peer, [(Descriptor(big, 0, size - 2 * MiB),
                                    Descriptor(remote, 0, size - 2 * MiB))])
            time.sleep(0.2)  # it fills the socket buffers: on the wire
            second = a.write(peer, [(Descriptor(small, 0, 2 * MiB), near_end)])
            time.sleep(0.1)
            assert first.cancel()
        assert a.stats["rails_torn_down"] == 1
        second.wait(10)
        assert a.stats["retries_torn_down"] >= 1
        with pytest.raises(TransferCancelled):
            first.wait(1)
        a.read(peer, [(Descriptor(back, 0, 2 * MiB), near_end)]).wait(10)
        assert np.array_equal(got, data)


def test_a_reads_notification_on_a_rail_torn_down_by_a_cancel_comes_once(
        make_engine: Callable[..., Engine]) -> None:
    """A READ's notification sits behind another transfer's WRITE on the only rail
    (the target's serving process stopped) when that WRITE is cancelled and tears the
    rail down: the notification is posted again on a reopened rail, the READ succeeds
    and the target is told exactly once."""
    size = 16 * MiB
    b = make_engine("b", transports=["tcp"], serve="process")
    b.register(random_bytes(size, seed=3), name="dst")
    a = make_engine("a", transports=[TcpTransport(rails=1)], peer_timeout=None)
    seg = a.register(random_bytes(size, seed=5), name="src")
    peer = a.connect(b.endpoint)
    dst = peer.segment("dst")
    serving = b.transports["tcp"].info("serve_pid")
    assert serving is not None
    notify = a._notify
    cancelled: list[TransferHandle] = []

    def resume() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serving, signal.SIGCONT)

    def stall_then_notify(xfer: Any, work: Any) -> None:
        if cancelled:  # posted again: as it is
            notify(xfer, work)
            return
        os.kill(serving, signal.SIGSTOP)
        big = a.write(peer, [(Descriptor(seg, 0, size), Descriptor(dst, 0, size))])
        cancelled.append(big)
        time.sleep(0.3)  # it fills the socket buffers: on the wire
        notify(xfer, work)  # queued behind it
        threading.Timer(0.3, resume).start()
        assert big.cancel()

    a._notify = stall_then_notify  # type: ignore[method-assign]
    try:
        back = a.register(np.zeros(4096, dtype=np.uint8), name="back")
        read = a.read(peer, [(Descriptor(back, 0, 4096), Descriptor(dst, 0, 4096))],
                      notify=b"once")
        read.wait(20)
    finally:
        resume()
    assert cancelled and a.stats["retries_torn_down"] >= 1
    got = b.notifications(timeout=5)
    time.sleep(0.5)
    got += b.notifications(timeout=0)
    assert [n.payload for n in got] == [b"once"]
    assert back.view().tobytes() == random_bytes(size, seed=3)[:4096].tobytes()

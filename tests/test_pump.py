"""The process's data plane (:mod:`transfer_engine.transport.stream.pump`): a fixed
number of threads whatever the peers, every rail served, no thread or descriptor left
once the last rail closes, and no deadlock when every worker waits on a peer that the
same pump serves (two engines in one process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.helpers.faults import stopped
from tests.helpers.transport_contract import random_bytes
from transfer_engine import Descriptor, Engine, PeerLostError
from transfer_engine.transport.stream import pump

MiB = 1 << 20


def pump_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("te-pump")]


def test_threads_do_not_grow_with_peers(make_engine: Callable[..., Engine]) -> None:
    size = 256 << 10
    a = make_engine("fan", transports=["tcp"])
    src_buf = random_bytes(size, 11)
    src = a.register(src_buf)
    targets = [make_engine(f"fan-t{i}", transports=["tcp"]) for i in range(12)]
    bufs = [np.zeros(size, dtype=np.uint8) for _ in targets]
    for t, buf in zip(targets, bufs, strict=True):
        t.register(buf, name="dst")
    counts = []
    peers = []
    for t in targets:
        peer = a.connect(t.endpoint)
        peers.append(peer)
        counts.append(len(pump_threads()))
    # every peer at once: both rails of each, WRITE with a notification and READ back
    back = [np.zeros(size, dtype=np.uint8) for _ in targets]
    backs = [a.register(buf) for buf in back]
    handles = [a.write(peer, [(Descriptor(src, 0, size), Descriptor(peer.segment("dst"), 0,
                                                                     size))], notify=b"n")
               for peer in peers]
    for h in handles:
        h.wait(20)
    for peer, seg in zip(peers, backs, strict=True):
        a.read(peer, [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
               ).wait(20)
    counts.append(len(pump_threads()))
    limit = pump.worker_count() + 1  # the workers and the poller
    assert max(counts) <= limit, counts
    for buf, got in zip(bufs, back, strict=True):
        assert np.array_equal(buf, src_buf) and np.array_equal(got, src_buf)
    for t in targets:
        assert [n.payload for n in t.notifications(timeout=5)] == [b"n"]
    # no thread per rail on either side (the openings' threads have ended)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        per_rail = [t.name for t in threading.enumerate()
                    if t.name.startswith(("te-tcp-serve", "te-tcp-send", "te-tcp-read"))]
        if not per_rail:
            break
        time.sleep(0.02)
    assert not per_rail


def test_worker_count_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_DATA_THREADS", "3")
    assert pump.worker_count() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("TE_DATA_THREADS", bad)
        with pytest.raises(ValueError, match="TE_DATA_THREADS"):
            pump.worker_count()
    monkeypatch.delenv("TE_DATA_THREADS")
    assert pump.worker_count() >= 3


def test_the_pump_ends_with_the_last_rail(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("end-a", transports=["tcp"])
    b = make_engine("end-b", transports=["tcp"])
    b.register(np.zeros(MiB, dtype=np.uint8), name="dst")
    src = a.register(random_bytes(MiB, 3))
    peer = a.connect(b.endpoint)
    a.write(peer, [(Descriptor(src, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))]
            ).wait(10)
    assert pump_threads() and pump.current() is not None
    a.close()
    b.close()
    deadline = time.monotonic() + 5
    while pump_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pump_threads() and pump.current() is None


def test_work_that_waits_on_its_own_pump_gets_a_worker(
        monkeypatch: pytest.MonkeyPatch, make_engine: Callable[..., Engine]) -> None:
    """One worker: a's large WRITE to b (same process) fills b's socket and blocks that
    worker in its send, while b's server needs a worker to drain it; and b writes to a
    at the same time. A worker more must start, and both land byte for byte."""
    monkeypatch.setenv("TE_DATA_THREADS", "1")
    size = 48 * MiB
    a = make_engine("starve-a", transports=["tcp"])
    b = make_engine("starve-b", transports=["tcp"])
    bufs = {"a": np.zeros(size, dtype=np.uint8), "b": np.zeros(size, dtype=np.uint8)}
    a.register(bufs["a"], name="dst")
    b.register(bufs["b"], name="dst")
    src_a, src_b = random_bytes(size, 21), random_bytes(size, 22)
    seg_a, seg_b = a.register(src_a), b.register(src_b)
    to_b, to_a = a.connect(b.endpoint), b.connect(a.endpoint)
    started = time.monotonic()
    h1 = a.write(to_b, [(Descriptor(seg_a, 0, size), Descriptor(to_b.segment("dst"), 0,
                                                                size))])
    h2 = b.write(to_a, [(Descriptor(seg_b, 0, size), Descriptor(to_a.segment("dst"), 0,
                                                                size))])
    h1.wait(30)
    h2.wait(30)
    assert time.monotonic() - started < 30
    assert np.array_equal(bufs["b"], src_a) and np.array_equal(bufs["a"], src_b)


def test_a_job_queued_behind_a_woken_worker_is_not_forgotten() -> None:
    """One worker, idle: job A (which waits for job B) and job B are submitted back to
    back, before the woken worker runs. A takes the worker, so B needs another: it
    must get one (the pump counts B as waiting) rather than wait behind A forever."""
    p = pump.Pump(1)
    try:
        warm = threading.Event()
        p.submit(warm.set)
        assert warm.wait(5)
        deadline = time.monotonic() + 5
        while p._idle < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        released, finished = threading.Event(), threading.Event()

        def a() -> None:
            if released.wait(5):
                finished.set()

        p.submit(a)
        p.submit(released.set)
        assert finished.wait(5), "the second job waited behind the first"
    finally:
        p.stop()


def test_a_stalled_peer_does_not_stop_the_others(
        monkeypatch: pytest.MonkeyPatch, spawn_peer: Callable[..., tuple[Any, str]],
        make_engine: Callable[..., Engine]) -> None:
    """One worker, held by a WRITE into a frozen peer's full socket: a transfer to
    another peer still lands (a worker more starts), and the frozen one fails once its
    peer is declared lost."""
    monkeypatch.setenv("TE_DATA_THREADS", "1")
    size = 64 * MiB
    frozen_proc, frozen_ep = spawn_peer("frozen", size, 4)
    _, live_ep = spawn_peer("live", MiB, 5)
    a = make_engine("stall-a", transports=["tcp"], peer_timeout=4.0)
    src_buf = random_bytes(size, 6)
    src = a.register(src_buf)
    frozen, live = a.connect(frozen_ep), a.connect(live_ep)
    with stopped(frozen_proc):
        stuck = a.write(frozen, [(Descriptor(src, 0, size),
                                  Descriptor(frozen.segment("dst"), 0, size))])
        time.sleep(0.2)  # its worker is in the send now, the peer's buffers full
        back = np.zeros(MiB, dtype=np.uint8)
        seg = a.register(back)
        started = time.monotonic()
        a.write(live, [(Descriptor(src, 0, MiB), Descriptor(live.segment("dst"), 0, MiB))]
                ).wait(10)
        a.read(live, [(Descriptor(seg, 0, MiB), Descriptor(live.segment("dst"), 0, MiB))]
               ).wait(10)
        assert time.monotonic() - started < 2  # long before the frozen peer is lost
        assert np.array_equal(back, src_buf[:MiB])
        with pytest.raises(PeerLostError):
            stuck.wait(15)

"""Ctrl-C in the thread that submits and waits (``transfer_engine.interrupts``).

A caller's thread does part of the engine's bookkeeping itself: it sends small work
inline, and while it waits holding the GIL it takes answers and finishes transfers. A
KeyboardInterrupt raised midway must cost nothing else: no handle left pending, no
segment left pinned, no peer left without rails, no wrong byte. Real SIGINTs, sent to
the main thread (pytest's) from another thread, every couple of milliseconds.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers.faults import stopped
from tests.helpers.transport_contract import random_bytes
from tests.test_bounds import STALLED, one_rail_to_a_peer
from transfer_engine import Descriptor, Engine
from transfer_engine.errors import TransferCancelled
from transfer_engine.handle import TransferHandle
from transfer_engine.interrupts import Deferred, allowed, blocking
from transfer_engine.transport import held

MiB = 1 << 20
Spawn = Callable[..., tuple[subprocess.Popen[str], str]]


class _Armed:
    """SIGINT's handler for a test: raises KeyboardInterrupt only while armed (so the
    test's own code is never hit), and a thread that sends SIGINT to the main thread
    every ``period`` seconds."""

    def __init__(self, period: float) -> None:
        self.armed = False
        self.raised = 0
        self._stop = threading.Event()
        self._period = period
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._kick, daemon=True, name="ctrl-c")

    def _handler(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            self.raised += 1
            raise KeyboardInterrupt

    def _kick(self) -> None:
        assert self._main is not None
        while not self._stop.wait(self._period):
            signal.pthread_kill(self._main, signal.SIGINT)

    def __enter__(self) -> _Armed:
        self._before = signal.signal(signal.SIGINT, self._handler)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        time.sleep(0.01)  # a signal sent last is handled (unarmed) before the swap
        signal.signal(signal.SIGINT, self._before)


@pytest.fixture
def contended() -> Iterator[None]:
    """The waits hold the GIL (as under a busy thread) from the first transfer on."""
    held.contention.until = math.inf
    yield
    held.contention.until = 0.0


def test_a_deferred_block_runs_the_handler_once_at_its_end() -> None:
    """Inside the block a SIGINT only notes itself; the handler runs once on leaving,
    with the signal's number, and not at all when none came. Outside the main thread
    the block changes nothing."""
    seen: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with Deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
        with Deferred():
            pass
        assert seen == [signal.SIGINT]
        reached = []
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):  # the default handler raises at the end
            with Deferred():
                signal.raise_signal(signal.SIGINT)
                reached.append(True)
        assert reached == [True]

        def elsewhere() -> None:
            with Deferred():
                handlers.append(signal.getsignal(signal.SIGINT))

        handlers: list[Any] = []
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(5)
        assert handlers == [signal.default_int_handler]
    finally:
        signal.signal(signal.SIGINT, before)


def _storm(a: Engine, peer: Any, seg: Any, dst: Any, seconds: float, cancel: float
           ) -> tuple[list[TransferHandle], int]:
    """Submits and waits for WRITEs and READs (some with a notification, some cancelled)
    for ``seconds`` under a Ctrl-C every 2 ms; (the handles, interrupts raised)."""
    rng = np.random.default_rng(7)
    handles: list[TransferHandle] = []
    with _Armed(0.002) as ctrl_c:
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(handles) < 5000:
            n = int(rng.choice([4096, MiB, 4 * MiB]))
            pairs = [(Descriptor(seg, i * n, n), Descriptor(dst, i * n, n))
                     for i in range(min(16, (16 * MiB) // n))]
            kind = rng.random()
            try:
                ctrl_c.armed = True
                handle = (a.read(peer, pairs) if kind < 0.4 else
                          a.write(peer, pairs, notify=b"n" if kind < 0.5 else None))
                handles.append(handle)
                if rng.random() < cancel:
                    handle.cancel()
                handle.wait(10)
            except (KeyboardInterrupt, TransferCancelled):
                pass
            finally:
                ctrl_c.armed = False
    return handles, ctrl_c.raised


@pytest.mark.parametrize("transports", ["tcp", "shm", "shm,tcp"])
def test_ctrl_c_while_submitting_and_waiting_costs_nothing(
        make_engine: Callable[..., Engine], spawn_peer: Spawn, busy_python: None,
        contended: None, transports: str) -> None:
    """Every transfer still ends (done, or cancelled when its caller cancelled it),
    nothing stays pinned, the peer keeps its rails (those a Ctrl-C broke are opened
    again), and a READ afterwards brings the peer's bytes exactly."""
    size = 16 * MiB
    _, endpoint = spawn_peer("far", size, 3, transports)
    a = make_engine("a", transports=transports.split(","))
    src = random_bytes(size, seed=5)
    seg = a.register(src, name="src")
    peer = a.connect(endpoint)
    dst = peer.segment("dst")
    handles, raised = _storm(a, peer, seg, dst, 2.0, cancel=0.1)
    assert raised > 20  # the storm did interrupt
    for handle in handles:
        try:
            handle.wait(10)
        except TransferCancelled:
            pass
    assert all(h.done() for h in handles)
    assert not [h for h in handles if h.error is not None
                and not isinstance(h.error, TransferCancelled)]
    end = time.monotonic() + 10  # those whose handle a Ctrl-C kept from its caller
    while a._live and time.monotonic() < end:
        time.sleep(0.01)
    assert not a._live and seg._pins == 0
    # the peer is fully usable: what we wrote last comes back whole
    a.write(peer, [(Descriptor(seg, 0, size), Descriptor(dst, 0, size))]).wait(10)
    back = np.zeros(size, dtype=np.uint8)
    bseg = a.register(back, name="back")
    a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(dst, 0, size))]).wait(10)
    assert np.array_equal(back, src)


def test_ctrl_c_while_closing_still_closes_everything(
        make_engine: Callable[..., Engine], spawn_peer: Spawn) -> None:
    """A close that Ctrl-C hits midway goes on to its end (a second close would do
    nothing): transfers failed, serving process gone, no thread or descriptor left
    (the fixtures check those)."""
    size = 16 * MiB
    _, endpoint = spawn_peer("far", size, 3, "shm,tcp")
    a = make_engine("a", transports=["shm", "tcp"])
    seg = a.register(random_bytes(size, seed=5), name="src")
    peer = a.connect(endpoint)
    dst = peer.segment("dst")
    serving = a.transports["shm"].info("serve_pid")
    handles = [a.write(peer, [(Descriptor(seg, 0, size), Descriptor(dst, 0, size))])
               for _ in range(4)]
    with _Armed(0.0005) as ctrl_c:
        ctrl_c.armed = True
        try:
            a.close()
        except KeyboardInterrupt:
            pass
        finally:
            ctrl_c.armed = False
    assert a.closed and all(h.done() for h in handles) and not a._live
    if serving is not None:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                os.kill(serving, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"serving process {serving} outlived the close")


def test_a_block_whose_exit_was_cut_short_heals_at_the_next_ctrl_c() -> None:
    """Another signal's handler raising in a block's exit can leave the block's note
    installed. The next SIGINT, once the guarded function has returned, puts the
    original handler back and runs it; a block entered meanwhile restores the original
    too, not the note."""

    def cut_short() -> None:  # a guarded function whose block's exit never ran
        Deferred().__enter__()

    def guarded() -> None:
        with Deferred():
            signal.raise_signal(signal.SIGINT)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cut_short()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        cut_short()
        with pytest.raises(KeyboardInterrupt):
            guarded()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_blocking_call_where_allowed_lets_ctrl_c_through_at_once() -> None:
    """Inside a block, a call that may block for long (reopening a rail) lets Ctrl-C
    act at once, one noted before included, where its caller allowed it; elsewhere it
    waits for the block's end. The block's note comes back after."""
    reached: list[str] = []

    def guarded(early: bool, allow: bool) -> None:
        with Deferred():
            if early:
                signal.raise_signal(signal.SIGINT)
            with allowed() if allow else contextlib.nullcontext(), blocking():
                reached.append("in")
                signal.raise_signal(signal.SIGINT)
                reached.append("past")

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            guarded(False, True)
        assert reached == ["in"]
        with pytest.raises(KeyboardInterrupt):
            guarded(True, True)
        assert reached == ["in"]  # the noted one was raised on entering
        with pytest.raises(KeyboardInterrupt):
            guarded(False, False)
        assert reached == ["in", "in", "past"]  # raised at the block's end only
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_a_write_reopens_a_rail_to_a_stopped_peer(spawn_peer: Spawn) -> None:
    """A cancel tore the only rail down; the next write reopens it, and the stopped
    peer never answers the handshake. Ctrl-C ends that write at once (not after the
    connect timeout), its transfer ends too, and once the peer resumes the next
    transfer reopens the rail and moves its bytes exactly."""
    with one_rail_to_a_peer(spawn_peer) as (proc, _, a, peer, seg, remote):
        size = STALLED
        with stopped(proc):
            first = a.write(peer, [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))])
            time.sleep(0.2)  # it fills the socket buffers: on the wire
            assert first.cancel()
            main = threading.main_thread().ident
            assert main is not None
            sent: list[float] = []
            timer = threading.Timer(0.3, lambda: (sent.append(time.monotonic()),
                                                  signal.pthread_kill(main, signal.SIGINT)))
            before = signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                timer.start()
                with pytest.raises(KeyboardInterrupt):
                    a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(remote, 0, 4096))])
                late = time.monotonic() - sent[0]
            finally:
                timer.cancel()
                signal.signal(signal.SIGINT, before)
            assert late < 1.0  # the connect timeout is 5 s
            assert not a._live and seg._pins == 0
        data = a.register(random_bytes(MiB, 9))
        back = a.register(np.zeros(MiB, dtype=np.uint8))
        pairs = [(Descriptor(data, 0, MiB), Descriptor(remote, 0, MiB))]
        a.write(peer, pairs).wait(10)
        a.read(peer, [(Descriptor(back, 0, MiB), pairs[0][1])]).wait(10)
        assert back.view().tobytes() == data.view().tobytes()


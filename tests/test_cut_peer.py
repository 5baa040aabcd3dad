"""``Engine.cut_peer``: a fence that ends one peer's access to our memory now, so that
a store can give that peer's space to someone else without a late WRITE landing in it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest

from tests.helpers.transport_contract import random_bytes
from transfer_engine import Descriptor, Engine
from transfer_engine.errors import TransferEngineError
from transfer_engine.transport.rdma import RdmaTransport

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [("tcp", "thread"), ("tcp", "process"), ("shm", "thread"), ("shm", "process")]


def _transport(name: str) -> str | RdmaTransport:
    return RdmaTransport(provider="emulated") if name == "rdma" else name


@pytest.mark.parametrize(("transport", "serve"), [*CASES, ("rdma", "thread")])
def test_a_cut_peer_moves_nothing_more_until_it_says_hello_again(
        make_engine: Callable[..., Engine], transport: str, serve: str) -> None:
    """Over rdma (the emulated provider) the cut destroys the peer's queue pairs."""
    size = 4 * MiB
    a = make_engine("a", transports=[_transport(transport)])
    b = make_engine("b", transports=[_transport(transport)], serve=serve)
    other = make_engine("other", transports=[_transport(transport)])
    dst = np.zeros(size, dtype=np.uint8)
    b.register(dst, name="dst")
    src = random_bytes(size, 3)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
    a.write(peer, pairs).wait(10)
    assert np.array_equal(dst, src)
    by_other = other.connect(b.endpoint)  # a bystander keeps its rails

    assert b.cut_peer("a", timeout=5.0)
    dst[:] = 0x5A
    started = time.monotonic()
    with pytest.raises(TransferEngineError):
        a.write(peer, pairs).wait(10)
    assert time.monotonic() - started < 10
    time.sleep(0.05)
    assert (dst == 0x5A).all(), "a WRITE landed after its peer was cut"

    oseg = other.register(random_bytes(MiB, 4))
    other.write(by_other, [(Descriptor(oseg, 0, MiB),
                            Descriptor(by_other.segment("dst"), 0, MiB))]).wait(10)
    assert np.array_equal(dst[:MiB], random_bytes(MiB, 4))

    again = a.connect(b.endpoint)  # a new hello: a new ticket, new rails
    a.write(again, [(Descriptor(seg, 0, size),
                     Descriptor(again.segment("dst"), 0, size))]).wait(10)
    assert np.array_equal(dst, src)


def test_cutting_a_peer_never_seen_is_a_no_op(make_engine: Callable[..., Engine]) -> None:
    b = make_engine("b", transports=["tcp", "shm"])
    assert b.cut_peer("nobody", timeout=0.0)


def test_cut_covers_names_the_tickets_a_cut_that_stood_fenced(
        make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    b.register(np.zeros(MiB, dtype=np.uint8), name="dst")
    first = a.connect(b.endpoint)
    assert len(first.ticket) == 16
    assert not b.cut_covers("a", first.ticket)  # never cut
    assert b.cut_peer("a", timeout=5.0)
    assert b.cut_covers("a", first.ticket)
    assert not b.cut_covers("other", first.ticket)  # the ticket is a's
    assert not b.cut_covers("a", os.urandom(16))  # never issued here
    assert not b.cut_covers("a", "not bytes")  # type: ignore[arg-type]
    seg = a.register(random_bytes(MiB, 6))
    with pytest.raises(TransferEngineError):  # a learns it was cut
        a.write(first, [(Descriptor(seg, 0, MiB),
                         Descriptor(first.segment("dst"), 0, MiB))]).wait(10)
    second = a.connect(b.endpoint)  # a new hello after the cut: a new ticket
    assert second.ticket != first.ticket
    assert not b.cut_covers("a", second.ticket)
    assert b.cut_covers("a", first.ticket)


@pytest.mark.parametrize("bad", [("", 1.0), ("x" * 1025, 1.0), ("a", -1.0),
                                 ("a", float("nan")), ("a", "1")])
def test_cut_peer_checks_its_arguments(make_engine: Callable[..., Engine],
                                       bad: tuple[object, object]) -> None:
    b = make_engine("b", transports=["tcp"])
    with pytest.raises(ValueError):
        b.cut_peer(*bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("transport", "serve"), CASES)
def test_a_stopped_writer_lands_nothing_after_the_cut(
        make_engine: Callable[..., Engine], transport: str, serve: str) -> None:
    """The writer is stopped (SIGSTOP) while it WRITEs 32 MiB after 32 MiB, cut off,
    the target's bytes are overwritten, and the writer resumed: the bytes stay ours,
    and its transfer fails."""
    size = 32 * MiB
    b = make_engine("b", transports=[transport], serve=serve)
    dst = np.zeros(size, dtype=np.uint8)
    b.register(dst, name="dst")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.late_writer", "writer", b.endpoint, str(size),
         transport], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "WROTE"
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.1)  # what its socket buffers held lands now, or during the cut
        assert b.cut_peer("writer", timeout=5.0)
        dst[:] = 0xA5
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
        assert out.split()[:1] == ["FAILED"], out
        assert (dst == 0xA5).all(), "a stopped writer's WRITE landed after the cut"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()

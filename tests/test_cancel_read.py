"""A cancelled READ lands nothing in our memory once ``cancel()`` returned.

Over shm the target copies a READ's bytes into the initiator itself
(``process_vm_writev``), and so does the responder of the emulated RDMA provider (a NIC
DMA-ing READ responses on hardware): tearing our end down is not enough, requests
already queued at the target would still be served into memory the application took
back. The shm rail tells the target it hung up and waits for it to let go; the RDMA
rail destroys its queue pair before it fails the work, and the emulated queue pair
waits for its responder the same way."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from transfer_engine import Descriptor, Engine

MiB = 1 << 20
Spawn = Callable[..., tuple[subprocess.Popen[str], str]]


def _family(pid: int) -> list[int]:
    """``pid`` and its children (a serving process)."""
    out = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(child) for child in f.read().split()]
    return out


@contextmanager
def frozen(pids: list[int], thaw_after: float) -> Iterator[None]:
    """The processes stopped (SIGSTOP) now, and resumed ``thaw_after`` seconds later
    (at the latest when the block ends)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:  # the signal is delivered asynchronously
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                    break
            time.sleep(0.005)

    def thaw() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    timer = threading.Timer(thaw_after, thaw)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        thaw()


@pytest.mark.parametrize(("transport", "serve"),
                         [("shm", "thread"), ("shm", "process"), ("rdma", "thread")])
def test_a_cancelled_read_lands_nothing_after_cancel_returns(
        spawn_peer: Spawn, monkeypatch: pytest.MonkeyPatch, transport: str,
        serve: str) -> None:
    """The target, a process of its own (and its serving process), is stopped with the
    READ's requests queued at it, and resumed 0.3 s into the cancel. RDMA runs on the
    emulated provider (no NIC here)."""
    monkeypatch.setenv("TE_SERVE", serve)
    monkeypatch.setenv("TE_RDMA_PROVIDER", "emulated")
    size = 16 * MiB
    proc, endpoint = spawn_peer("src", size, 5, transport)
    want = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    with Engine("a", transports=[transport], timeout=5.0) as a:
        dst = np.zeros(size, dtype=np.uint8)
        seg = a.register(dst)
        peer = a.connect(endpoint)
        assert peer.transport == transport
        remote = peer.segment("dst")
        pairs = [(Descriptor(seg, i * MiB, MiB), Descriptor(remote, i * MiB, MiB))
                 for i in range(16)]
        with frozen(_family(proc.pid), thaw_after=0.3):
            handle = a.read(peer, pairs)
            time.sleep(0.1)  # the requests reach the stopped target
            started = time.monotonic()
            assert handle.cancel()
            waited = time.monotonic() - started
            dst[:] = 0x5A  # the application takes its memory back
            time.sleep(0.6)  # the target runs again meanwhile
        assert (dst == 0x5A).all(), "a cancelled READ's bytes landed after cancel()"
        assert waited < 5.5
        again = a.connect(endpoint)  # the target serves a new READ as before
        a.read(again, pairs).wait(10)
        assert np.array_equal(dst, want)

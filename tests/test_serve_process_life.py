"""The serving process's life: started again after it dies, killed when it hangs,
gone with its engine or its application, and threads serving where it cannot start.

Real engines, real sockets, real child processes; random bytes checked byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.faults import serving_process_boots_with
from tests.helpers.serving import fd_target, serve_pid, target, zombie
from tests.helpers.transport_contract import MiB, random_bytes
from transfer_engine import Descriptor, Engine, PeerLostError, TransferError
from transfer_engine.transport.shm import ShmTransport
from transfer_engine.transport.tcp import TcpTransport


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_killed_serving_process_is_started_again_then_stays_down(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, transport: str) -> None:
    """SIGKILL of the serving process: a new one serves the same address and segments
    (a peer that connects again, as after any lost peer, writes byte for byte
    again); past ``RESPAWNS`` deaths in its
    window it stays down, transfers fail with an error (no hang), and closing leaves
    no process."""
    from transfer_engine.transport.stream.process import ServeProcess

    monkeypatch.setattr(ServeProcess, "RESPAWNS", 1)
    kind = TcpTransport if transport == "tcp" else ShmTransport
    t = make_engine("t", transports=[kind(serve="process")])
    a = make_engine("a", transports=[transport])
    dst = torch.zeros(4 * MiB, dtype=torch.uint8)
    t.register(dst, name="kv")
    src = random_bytes(4 * MiB, 9)
    src_seg = a.register(src)
    def write() -> None:
        peer = a.connect(t.endpoint)  # the peer as it is, or anew once its rails broke
        a.write(peer, [(Descriptor(src_seg, 0, 4 * MiB),
                        Descriptor(peer.segment("kv"), 0, 4 * MiB))]).wait(10)

    write()
    first = t.transports[transport].info("serve_pid")
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "started again" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)  # said once its segments are registered again
    second = t.transports[transport].info("serve_pid")
    assert second != first and "started again" in caplog.text
    dst.zero_()
    for _ in range(5):  # the first may still find its rail half-closed
        with contextlib.suppress(TransferError):
            write()
            break
    assert np.array_equal(dst.numpy(), src)

    os.kill(second, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TransferError):
        for _ in range(5):
            write()
    assert time.monotonic() - start < 30
    while "stays down" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "stays down" in caplog.text
    assert t.transports[transport].info("serve_pid") == second
    t.close()  # no hang
    for pid in (first, second):
        assert not os.path.exists(f"/proc/{pid}") or zombie(pid)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_stopped_serving_process_is_killed_and_its_transfers_fail(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, transport: str) -> None:
    """The serving process stops (SIGSTOP) while the application still answers its
    peers' control probes: the application finds it answers no ping and kills it, and
    a WRITE in flight fails with PeerLostError instead of waiting for ever."""
    from transfer_engine.transport.stream.process import ServeProcess

    monkeypatch.setattr(ServeProcess, "PULSE", 0.2)
    monkeypatch.setattr(ServeProcess, "HUNG_AFTER", 1.5)
    kind = TcpTransport if transport == "tcp" else ShmTransport
    t = make_engine("t", transports=[kind(serve="process")])
    a = make_engine("a", transports=[transport])
    t.register(torch.zeros(64 * MiB, dtype=torch.uint8), name="kv")
    src = random_bytes(64 * MiB, 9)
    src_seg = a.register(src)
    peer = a.connect(t.endpoint)
    remote = peer.segment("kv")
    a.write(peer, [(Descriptor(src_seg, 0, MiB), Descriptor(remote, 0, MiB))]).wait(10)
    pid = t.transports[transport].info("serve_pid")
    assert isinstance(pid, int)
    time.sleep(1.0)  # pings answered meanwhile: it stays
    assert not zombie(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        handle = a.write(peer, [(Descriptor(src_seg, 0, 64 * MiB),
                                 Descriptor(remote, 0, 64 * MiB))])
        with pytest.raises(PeerLostError):
            handle.wait(20)
        assert time.monotonic() - start < 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert zombie(pid)
    assert "answered nothing" in caplog.text


def test_closing_the_engine_leaves_no_process_or_file(make_engine: Callable[..., Engine]
                                                      ) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    t = target(make_engine)
    seg = t.register(torch.zeros(2 * MiB, dtype=torch.uint8), name="kv")
    pid = serve_pid(t)
    assert os.path.exists(f"/proc/{pid}")
    seg.close()
    t.close()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and not zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or zombie(pid)
    assert set(os.listdir("/dev/shm")) == shm_before
    assert not [fd for fd in os.listdir("/proc/self/fd") if "te-serve" in fd_target(fd)]


def test_the_serving_process_outlives_the_thread_that_started_it(
        make_engine: Callable[..., Engine]) -> None:
    made: list[Engine] = []
    thread = threading.Thread(target=lambda: made.append(target(make_engine)))
    thread.start()
    thread.join(60)
    t = made[0]
    t.register(torch.zeros(MiB, dtype=torch.uint8), name="kv")
    time.sleep(0.3)
    assert os.path.exists(f"/proc/{serve_pid(t)}") and not zombie(serve_pid(t))
    a = make_engine("a", transports=["tcp"])
    src = random_bytes(MiB, 3)
    peer = a.connect(t.endpoint)
    a.write(peer, [(Descriptor(a.register(src), 0, MiB),
                    Descriptor(peer.segment("kv"), 0, MiB))]).wait(10)


def test_the_serving_process_exits_with_a_killed_application() -> None:
    code = ("import os, sys, time; from transfer_engine import Engine; "
            "from transfer_engine.transport.tcp import TcpTransport; "
            "e = Engine('app', transports=[TcpTransport(serve='process')]); "
            "print(e.transports['tcp'].info('serve_pid'), flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    app = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                           env=env)
    try:
        assert app.stdout is not None
        child = int(app.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
        app.kill()
        app.wait(10)
        deadline = time.monotonic() + 10
        while (os.path.exists(f"/proc/{child}") and not zombie(child)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}") or zombie(child)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
        if app.stdout is not None:
            app.stdout.close()


def test_a_serving_process_that_cannot_start_leaves_threads_serving(
        make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Where the serving process cannot run, the transport serves from threads, says so
    once, and moves the same bytes."""
    serving_process_boots_with(monkeypatch, "import sys; sys.exit(3)")
    t = make_engine("t", transports=[TcpTransport(serve="process")])
    assert t.transports["tcp"].info("serve") == "thread"
    assert "serving tcp from threads" in caplog.text
    dst = np.zeros(MiB, dtype=np.uint8)
    t.register(dst, name="kv")
    a = make_engine("a", transports=["tcp"])
    src = random_bytes(MiB, 12)
    peer = a.connect(t.endpoint)
    a.write(peer, [(Descriptor(a.register(src), 0, MiB),
                    Descriptor(peer.segment("kv"), 0, MiB))]).wait(10)
    assert np.array_equal(dst, src)

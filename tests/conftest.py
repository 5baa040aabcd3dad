"""Shared fixtures: loopback engine pairs, resource tracking, hardware skips."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers.sglang_fixtures import ranks, sg, te  # noqa: F401 - SGLang's fixtures
from transfer_engine import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hardware_reasons() -> dict[str, Callable[[], str | None]]:
    try:
        from tests.helpers import hardware  # noqa: PLC0415
    except ImportError:
        return {}
    return {"rdma": hardware.rdma_skip_reason, "gpu": hardware.gpu_skip_reason}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons: dict[str, str | None] = {}
    checks = _hardware_reasons()
    for item in items:
        for marker in ("rdma", "gpu"):
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in reasons:
                check = checks.get(marker)
                reasons[marker] = check() if check else f"no {marker} device check available"
            if reasons[marker]:
                item.add_marker(pytest.mark.skip(reason=reasons[marker]))
    if "gpu" in reasons and reasons["gpu"] is None:
        _start_cuda()


def _start_cuda() -> None:
    """CUDA's driver opens descriptors of its own (eventfds, a pipe) the first time a
    process uses a device, pinned memory or a stream, and keeps them: opened here,
    before the first test, the leak check does not count them as a test's."""
    try:
        import cupy as cp  # noqa: PLC0415

        cp.zeros(1, dtype=cp.uint8).get()
        cp.cuda.Stream(non_blocking=True).synchronize()
        cp.cuda.alloc_pinned_memory(1 << 12)
    except Exception:  # noqa: BLE001 - cupy absent or failing: its tests say why
        pass
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            pinned = torch.ones(1 << 12, dtype=torch.uint8, pin_memory=True)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                pinned.to("cuda", non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            event.synchronize()
    except Exception:  # noqa: BLE001 - torch absent or without CUDA
        pass


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("te-") and t.is_alive()]


def _open_fds() -> set[str]:
    """Sockets, pipes and /dev/shm files this process holds open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "pipe:", "/dev/shm", "anon_inode:[eventfd]")):
            out.add(f"{fd}->{target}")
    return out


@pytest.fixture(autouse=True)
def no_leaked_resources() -> Iterator[None]:
    """Every engine thread, socket and pipe a test opened must be gone once its engines
    are closed."""
    before = set(_engine_threads())
    fds_before = _open_fds()
    yield
    deadline = time.monotonic() + 5
    while True:
        leaked = [t.name for t in _engine_threads() if t not in before]
        fds = sorted(_open_fds() - fds_before)
        if not leaked and not fds:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    pytest.fail(f"left behind after the test: threads {leaked}, descriptors {fds}")


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Builds engines on 127.0.0.1 with free ports and closes all of them afterwards."""
    engines: list[Engine] = []

    def make(name: str, **kwargs: Any) -> Engine:
        kwargs.setdefault("timeout", 5.0)
        engine = Engine(name, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in reversed(engines):
        engine.close()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    """Starts engines in processes of their own (``tests.helpers.peer_process``): ``spawn(name,
    size, seed, transports)`` -> (process, control endpoint); all are stopped after."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(name: str, size: int, seed: int, transports: str = "tcp"
              ) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.peer_process", name, str(size), str(seed),
             transports], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test timeout
        assert line.startswith("ENDPOINT "), line
        return proc, line.split()[1]

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        else:
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


@pytest.fixture
def busy_python() -> Iterator[None]:
    """A thread that runs pure bytecode (holding the GIL) for the whole test."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            for _ in range(10000):
                n += 1

    thread = threading.Thread(target=spin, daemon=True, name="busy-python")
    thread.start()
    yield
    stop.set()
    thread.join(5)


@pytest.fixture
def victim(make_engine: Callable[..., Engine]) -> Iterator[tuple[Engine, np.ndarray, int]]:
    """An engine serving shm and tcp with one random 1 MiB segment, ``kv``: (engine,
    its bytes, the segment's id)."""
    from tests.helpers.rails import SIZE  # noqa: PLC0415
    from tests.helpers.transport_contract import random_bytes  # noqa: PLC0415

    b = make_engine("victim", transports=["shm", "tcp"])
    mem = random_bytes(SIZE, 11)
    seg = b.register(mem, name="kv")
    yield b, mem, seg.id

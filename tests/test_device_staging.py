"""Device memory over the host-memory transports (tcp, shm): staged through bounces
(over shm, device memory on both ends goes by device IPC instead: see
``test_shm_device_ipc.py``).

No GPU here: a stand-in device (``tests/helpers/standin_device.py``) plays it. Its
memory is an address range the host cannot touch (a system call on it fails with
EFAULT), so every byte that arrives went through the device's own copies, on the
initiator's side (the engine's bounce segments) and on the target's (the stream
server's). A GPU machine runs the same paths with CUDA in ``tests/test_gpu.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from tests.helpers.standin_device import StandInGpu
from tests.helpers.transport_contract import MiB, random_bytes
from transfer_engine import Blocks, Descriptor, Engine, devmem
from transfer_engine.errors import BusyError, NotSupportedError, TransferError

BLOCK = 16384


@pytest.fixture
def gpu() -> Iterator[StandInGpu]:
    with StandInGpu().installed() as g:
        yield g


def _blocks(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(n) * BLOCK, rng.permutation(n) * BLOCK


def _same_blocks(dst: np.ndarray, doff: np.ndarray, src: np.ndarray, soff: np.ndarray
                 ) -> bool:
    return all(np.array_equal(dst[d:d + BLOCK], src[s:s + BLOCK])
               for d, s in zip(doff.tolist(), soff.tolist(), strict=True))


def _device_to_host(gpu: StandInGpu, make_engine: Callable[..., Engine], size: int,
                    seed: int) -> tuple[Engine, Any, Any, Any, Any, np.ndarray, np.ndarray]:
    """Engines a and b over tcp: a's device segment ``d`` (random bytes ``data``), b's
    host segment ``dst``; returns a, the peer, ``d``, ``dst`` as a's peer sees it, the
    device array, ``data`` and ``dst``."""
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    dev = gpu.alloc(size)
    data = random_bytes(size, seed)
    dev.upload(data)
    dst = np.zeros(size, dtype=np.uint8)
    seg = a.register(dev, name="d")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    return a, peer, seg, peer.segment("dst"), dev, data, dst


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_device_to_device_both_ways_byte_exact_one_notification(
        gpu: StandInGpu, make_engine: Callable[..., Engine], transport: str) -> None:
    size = 4 * MiB
    a = make_engine("a", transports=[transport])
    b = make_engine("b", transports=[transport])
    src, there, back = gpu.alloc(size), gpu.alloc(size), gpu.alloc(size)
    data = random_bytes(size, 11)
    src.upload(data)
    seg, bseg = a.register(src, name="src"), a.register(back, name="back")
    b.register(there, name="there")
    peer = a.connect(b.endpoint)
    remote = peer.segment("there")
    assert seg.device == "cuda:0" and remote.device == "cuda:0"
    loffs, roffs = _blocks(size // BLOCK, 3)
    a.write(peer, Blocks(seg, remote, loffs, roffs, BLOCK), notify=b"kv").wait(30)
    assert _same_blocks(there.download(), roffs, data, loffs)
    notes = b.notifications(timeout=5)
    assert [n.payload for n in notes] == [b"kv"]
    a.read(peer, Blocks(bseg, remote, roffs, roffs, BLOCK)).wait(30)
    assert _same_blocks(back.download(), roffs, data, loffs)
    assert b.notifications(timeout=0.2) == []


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_host_and_device_sides_mixed(gpu: StandInGpu, make_engine: Callable[..., Engine],
                                     transport: str) -> None:
    """Host memory on one side, device memory on the other, in both directions, and a
    transfer whose local side is partly host, partly device memory."""
    a = make_engine("a", transports=[transport])
    b = make_engine("b", transports=[transport])
    host, dev = random_bytes(2 * MiB, 5), gpu.alloc(2 * MiB)
    far_host, far_dev = np.zeros(2 * MiB, dtype=np.uint8), gpu.alloc(2 * MiB)
    hseg, dseg = a.register(host, name="h"), a.register(dev, name="d")
    b.register(far_host, name="fh")
    b.register(far_dev, name="fd")
    peer = a.connect(b.endpoint)
    fh, fd = peer.segment("fh"), peer.segment("fd")
    a.write(peer, [(Descriptor(hseg, 0, MiB), Descriptor(fd, MiB, MiB))]).wait(30)
    assert np.array_equal(far_dev.download()[MiB:], host[:MiB])
    a.read(peer, [(Descriptor(dseg, 0, MiB), Descriptor(fd, MiB, MiB))]).wait(30)
    assert np.array_equal(dev.download()[:MiB], host[:MiB])
    a.write(peer, [(Descriptor(hseg, MiB, 4096), Descriptor(fh, 0, 4096)),
                   (Descriptor(dseg, 0, 8192), Descriptor(fh, 65536, 8192))]).wait(30)
    assert np.array_equal(far_host[:4096], host[MiB:MiB + 4096])
    assert np.array_equal(far_host[65536:65536 + 8192], host[:8192])


def test_bounces_are_reused_and_bounded(gpu: StandInGpu, make_engine: Callable[..., Engine],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_STAGING_BYTES", str(4 * MiB))
    a, peer, seg, remote, _, data, dst = _device_to_host(gpu, make_engine, 8 * MiB, 9)
    for i in range(12):
        off = (i % 4) * MiB
        a.write(peer, [(Descriptor(seg, off, MiB), Descriptor(remote, off, MiB))]).wait(30)
    assert np.array_equal(dst[:4 * MiB], data[:4 * MiB])
    staging = a._staging_area
    assert staging is not None and staging.total_bytes == MiB  # one bounce, reused
    names = [n for n in a.segments if n.startswith("te-staging-")]
    assert len(names) == 1
    with pytest.raises(BusyError, match="TE_STAGING_BYTES"):
        a.write(peer, [(Descriptor(seg, 0, 8 * MiB), Descriptor(remote, 0, 8 * MiB))]
                ).wait(30)
    h = a.write(peer, [(Descriptor(seg, MiB, MiB), Descriptor(remote, 0, MiB))])
    h.wait(30)  # the refused one held nothing
    assert np.array_equal(dst[:MiB], data[MiB:2 * MiB])


class _Failing:
    """A copier whose copies fail (a device error)."""

    def __init__(self) -> None:
        self.calls = 0

    def to_host(self, rows: Sequence[devmem.Row]) -> None:
        self.calls += 1
        raise TransferError("device copy failed: injected")

    to_device = to_host


def test_a_failed_device_copy_fails_that_transfer_precisely(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    dev, far = gpu.alloc(MiB), gpu.alloc(MiB)
    host = random_bytes(MiB, 4)
    seg, hseg = a.register(dev, name="d"), a.register(host, name="h")
    b.register(far, name="far")
    peer = a.connect(b.endpoint)
    remote = peer.segment("far")
    failing = _Failing()
    undo = devmem.install("cuda:0", failing)
    try:
        with pytest.raises(TransferError, match="injected") as info:  # ours: no byte sent
            a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(remote, 0, 4096))]).wait(10)
        assert info.value.peer == "b" and info.value.op == "write"
        with pytest.raises(TransferError, match="injected"):  # the target's: answered
            a.write(peer, [(Descriptor(hseg, 0, 4096), Descriptor(remote, 0, 4096))]
                    ).wait(10)
        with pytest.raises(TransferError, match="injected"):
            a.read(peer, [(Descriptor(hseg, 0, 4096), Descriptor(remote, 0, 4096))]).wait(10)
        assert failing.calls == 3
    finally:
        undo()
    a.write(peer, [(Descriptor(hseg, 0, MiB), Descriptor(remote, 0, MiB))]).wait(10)
    assert np.array_equal(far.download(), host)  # the rails and bounces carry on


def test_without_a_device_runtime_the_error_says_what_is_missing(
        make_engine: Callable[..., Engine]) -> None:
    """A CUDA segment on a host without cupy/CUDA: a precise error, no crash (the
    stand-in's memory is never touched by the host)."""
    gpu = StandInGpu()  # not installed: cuda:0 copies go to CUDA, which is absent
    try:
        from transfer_engine import gpu as cuda
        if cuda.cuda_unavailable_reason() is None:
            pytest.skip("CUDA is usable here: tests/test_gpu.py covers it")
        a = make_engine("a", transports=["tcp"])
        b = make_engine("b", transports=["tcp"])
        dev = gpu.alloc(MiB)
        host = random_bytes(MiB, 2)
        seg, hseg = a.register(dev, name="d"), a.register(host, name="h")
        b.register(gpu.alloc(MiB), name="far")
        b.register(np.zeros(MiB, dtype=np.uint8), name="plain")
        peer = a.connect(b.endpoint)
        with pytest.raises(NotSupportedError, match="cupy"):
            a.write(peer, [(Descriptor(seg, 0, 4096),
                            Descriptor(peer.segment("plain"), 0, 4096))]).wait(10)
        with pytest.raises(NotSupportedError, match="cupy"):
            a.write(peer, [(Descriptor(hseg, 0, 4096),
                            Descriptor(peer.segment("far"), 0, 4096))]).wait(10)
    finally:
        gpu.close()


def test_serving_process_refuses_device_segments(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"], serve="process")
    host = random_bytes(MiB, 6)
    hseg = a.register(host, name="h")
    b.register(gpu.alloc(MiB), name="far")
    peer = a.connect(b.endpoint)
    with pytest.raises(NotSupportedError, match="cuda:0 memory is not reachable"):
        a.write(peer, [(Descriptor(hseg, 0, 4096),
                        Descriptor(peer.segment("far"), 0, 4096))]).wait(10)


def test_raw_device_memory_registers_with_its_device(gpu: StandInGpu,
                                                     make_engine: Callable[..., Engine]
                                                     ) -> None:
    from transfer_engine.errors import RegistrationError

    a = make_engine("a", transports=["tcp"])
    dev = gpu.alloc(MiB)
    seg = a.register((dev.address, MiB, "cuda:0"), name="raw")
    assert seg.device == "cuda:0"
    with pytest.raises(RegistrationError, match="'cpu' or 'cuda:N'"):
        a.register((dev.address, MiB, "npu"), name="odd")


def test_a_peer_cannot_make_the_server_stage_past_its_budget(
        gpu: StandInGpu, make_engine: Callable[..., Engine],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Server bounces are bounded for all connections together: a request past the
    budget is answered BusyError (its payload consumed), later ones are served."""
    from transfer_engine.transport.stream import targets

    def quiet() -> None:  # the servers hand a bounce back after answering
        deadline = time.monotonic() + 5
        while targets._held[0] and time.monotonic() < deadline:
            time.sleep(0.01)
    quiet()  # no other test's bounce still counted
    monkeypatch.setenv("TE_STAGING_BYTES", str(MiB // 2))  # requests are >= 1 MiB
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    host = random_bytes(4 * MiB, 3)
    far = gpu.alloc(4 * MiB)
    hseg = a.register(host, name="h")
    b.register(far, name="far")
    peer = a.connect(b.endpoint)
    remote = peer.segment("far")
    with pytest.raises(BusyError, match="TE_STAGING_BYTES"):
        a.write(peer, [(Descriptor(hseg, 0, 4 * MiB), Descriptor(remote, 0, 4 * MiB))],
                ).wait(10)
    q = MiB // 4
    for _ in range(3):
        a.write(peer, [(Descriptor(hseg, 0, q), Descriptor(remote, 0, q))]).wait(10)
    a.read(peer, [(Descriptor(hseg, MiB, q), Descriptor(remote, 0, q))]).wait(10)
    assert np.array_equal(far.download()[:q], host[:q])
    assert np.array_equal(host[MiB:MiB + q], host[:q])
    quiet()
    assert targets._held[0] == 0


class _Async:
    """The stand-in with copies off the device that run on a thread of their own, one
    piece at a time, each taking ``delay``: what a CUDA stream does."""

    def __init__(self, gpu: StandInGpu, delay: float, fail_at: int | None = None) -> None:
        import threading
        self.gpu, self.delay, self.fail_at = gpu, delay, fail_at
        self.log: list[tuple[str, int]] = []  # ("copied", piece) / ("waited", piece)
        self._lock = threading.Lock()
        self._queue: list[Any] = []
        self.pieces = 0

    def to_host(self, rows: Sequence[devmem.Row]) -> None:
        self.gpu.to_host(rows)

    to_device = StandInGpu.to_device

    def to_host_async(self, rows: Sequence[devmem.Row]) -> Callable[[], None]:
        import threading
        import time
        with self._lock:
            piece = self.pieces
            self.pieces += 1
            before = self._queue[-1] if self._queue else None
            done = threading.Event()
            self._queue.append(done)
        error: list[TransferError] = []

        def run() -> None:  # in order, as on one stream
            if before is not None:
                before.wait(10)
            time.sleep(self.delay)
            if piece == self.fail_at:
                error.append(TransferError("device copy failed: injected"))
            else:
                self.gpu.to_host(rows)
            with self._lock:
                self.log.append(("copied", piece))
            done.set()
        threading.Thread(target=run, daemon=True).start()

        def wait() -> None:
            done.wait(10)
            with self._lock:
                self.log.append(("waited", piece))
            if error:
                raise error[0]
        return wait


def test_copies_off_the_device_overlap_the_sends(gpu: StandInGpu,
                                                 make_engine: Callable[..., Engine]
                                                 ) -> None:
    """A staged 16 MiB WRITE over tcp: the first 4 MiB piece is sent while later ones
    are still being copied off the device; the bytes are exact."""
    slow = _Async(gpu, delay=0.05)
    undo = devmem.install("cuda:0", slow)  # type: ignore[arg-type]
    try:
        a, peer, seg, remote, _, data, dst = _device_to_host(gpu, make_engine, 16 * MiB,
                                                             12)
        a.write(peer, [(Descriptor(seg, 0, 16 * MiB), Descriptor(remote, 0, 16 * MiB))]
                ).wait(30)
        assert np.array_equal(dst, data)
        assert slow.pieces == 4
        first_sent = slow.log.index(("waited", 0))
        assert first_sent < slow.log.index(("copied", 3))  # sent before the last copy
    finally:
        undo()


def test_a_failed_asynchronous_copy_fails_the_write_and_frees_its_bounce(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    slow = _Async(gpu, delay=0.01, fail_at=2)
    undo = devmem.install("cuda:0", slow)  # type: ignore[arg-type]
    try:
        a, peer, seg, remote, dev, _, dst = _device_to_host(gpu, make_engine, 16 * MiB, 14)
        with pytest.raises(TransferError, match="injected"):
            a.write(peer, [(Descriptor(seg, 0, 16 * MiB), Descriptor(remote, 0, 16 * MiB))]
                    ).wait(30)
        assert ("copied", 3) in slow.log  # the bounce went back once all copies ended
    finally:
        undo()
    data = random_bytes(16 * MiB, 13)
    dev.upload(data)
    a.write(peer, [(Descriptor(seg, 0, 16 * MiB), Descriptor(remote, 0, 16 * MiB))]
            ).wait(30)
    assert np.array_equal(dst, data)
    assert a._staging_area is not None and a._staging_area.total_bytes == 16 * MiB

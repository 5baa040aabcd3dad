"""GPU helpers: the overlap schedule everywhere, byte-exact CUDA round trips on a GPU.

Tests marked ``gpu`` skip with the reason from ``tests.helpers.hardware.gpu_skip_reason``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from transfer_engine.errors import NotSupportedError
from transfer_engine.gpu import (
    IpcHandle,
    StagingPool,
    chunks,
    cuda_unavailable_reason,
    dmabuf_fd,
    overlapped,
    recv_device_memory,
    send_device_memory,
)


def test_chunks_cover_the_range() -> None:
    assert list(chunks(10, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(chunks(0, 4)) == []
    with pytest.raises(ValueError):
        list(chunks(10, 0))


def test_overlap_starts_next_copy_before_consuming_current() -> None:
    log: list[tuple[str, int]] = []
    pieces = list(chunks(10, 3))

    def start(buf: int, off: int, size: int) -> int:
        log.append(("copy", off))
        return off

    def consume(buf: int, off: int, size: int) -> None:
        log.append(("send", off))

    overlapped(pieces, start, lambda token: log.append(("wait", token)), consume)
    assert log[:3] == [("copy", 0), ("copy", 3), ("wait", 0)]
    assert log.index(("copy", 6)) < log.index(("send", 3))  # copy k+1 runs before send k
    assert [e for e in log if e[0] == "send"] == [("send", o) for o, _ in pieces]
    for off, _ in pieces:  # every copy is waited for before its send
        assert log.index(("wait", off)) < log.index(("send", off))
    with pytest.raises(ValueError):
        overlapped(pieces, start, lambda t: None, consume, depth=0)


def test_overlap_reuses_buffers_round_robin() -> None:
    used: list[int] = []
    overlapped(list(chunks(50, 10)), lambda b, o, n: b, lambda t: None,
               lambda b, o, n: used.append(b), depth=2)
    assert used == [0, 1, 0, 1, 0]


def test_ipc_handle_wire_round_trip() -> None:
    handle = IpcHandle(b"\x01" * 64, 128, 4096, 1)
    assert IpcHandle.from_wire(handle.to_wire()) == handle


def test_without_cuda_helpers_say_why() -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(NotSupportedError, match="no CUDA GPU"):
        dmabuf_fd(0x1000, 4096)
    with pytest.raises(NotSupportedError, match="no CUDA GPU"):
        StagingPool()


@pytest.mark.gpu
def test_staged_send_and_receive_are_byte_exact() -> None:
    import cupy as cp

    rng = np.random.default_rng(5)
    host = rng.integers(0, 256, (3 << 20) + 17, dtype=np.uint8)
    src = cp.asarray(host)
    dst = cp.zeros_like(src)
    sent: list[bytes] = []
    with StagingPool(buffer_bytes=1 << 20, count=2) as pool:
        send_device_memory(src.data.ptr, src.nbytes, lambda v: sent.append(bytes(v)), pool)
        stream = iter(sent)

        def recv_into(view: memoryview) -> None:
            view[:] = next(stream)

        recv_device_memory(dst.data.ptr, dst.nbytes, recv_into, pool)
    assert b"".join(sent) == host.tobytes()
    assert np.array_equal(cp.asnumpy(dst), host)


@pytest.mark.gpu
def test_ipc_handle_export() -> None:
    """CUDA refuses to open a handle in the process that exported it, so this checks
    export and the offset into the allocation; the shm transport maps it across
    processes."""
    import cupy as cp

    from transfer_engine.gpu import export_ipc

    buf = cp.arange(1 << 16, dtype=cp.uint8)
    handle = export_ipc(buf.data.ptr + 256, 1024, buf.device.id)
    assert handle.offset == 256 and handle.length == 1024 and len(handle.handle) == 64


@pytest.mark.gpu
def test_dmabuf_export_where_supported() -> None:
    import os

    import cupy as cp

    buf = cp.zeros(1 << 21, dtype=cp.uint8)
    try:
        fd, offset = dmabuf_fd(buf.data.ptr + 100, 4096)
    except NotSupportedError as exc:
        pytest.skip(f"no dma-buf export on this driver: {exc}")
    os.close(fd)
    assert offset % 4096 == 100 % 4096


@pytest.mark.gpu
@pytest.mark.rdma
def test_gpu_memory_registers_with_rdma() -> None:
    import cupy as cp

    from transfer_engine.segment import Segment, describe_memory
    from transfer_engine.transport import load_transport

    buf = cp.zeros(1 << 20, dtype=cp.uint8)
    with load_transport("rdma", host="127.0.0.1") as transport:
        seg = Segment(1, "gpu", describe_memory(buf))
        keys: dict[str, Any] = transport.register(seg)
        assert keys["mrs"]
        transport.deregister(seg)



@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["cupy", "torch"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_gpu_kv_over_host_transports_is_staged_byte_exact(transport: str,
                                                          copies: str) -> None:
    """CUDA memory on both sides over tcp and shm: the engine's bounces on the
    initiator, the stream server's on the target, cupy's copies in between (or torch's,
    as in a server without cupy)."""
    import cupy as cp

    from transfer_engine import Blocks, Engine, devmem

    undo = (devmem.install("cuda:0", devmem.TorchCopier("cuda:0")) if copies == "torch"
            else (lambda: None))
    rng = np.random.default_rng(7)
    host = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    src, there, back = cp.asarray(host), cp.zeros(8 << 20, cp.uint8), cp.zeros(8 << 20,
                                                                             cp.uint8)
    try:
        with Engine("gpu-a", transports=[transport]) as a, \
                Engine("gpu-b", transports=[transport]) as b:
            seg, bseg = a.register(src, name="src"), a.register(back, name="back")
            b.register(there, name="there")
            peer = a.connect(b.endpoint)
            remote = peer.segment("there")
            offs = rng.permutation(512) * 16384
            a.write(peer, Blocks(seg, remote, offs, offs[::-1].copy(), 16384),
                    notify=b"kv").wait(60)
            a.read(peer, Blocks(bseg, remote, offs, offs[::-1].copy(), 16384)).wait(60)
            assert np.array_equal(cp.asnumpy(back), host)
            moved = cp.asnumpy(there)
            for lo, ro in zip(offs.tolist(), offs[::-1].tolist(), strict=True):
                assert np.array_equal(moved[ro:ro + 16384], host[lo:lo + 16384])
    finally:
        undo()


@pytest.mark.gpu
def test_gpu_memory_between_processes_by_device_ipc(
        spawn_peer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our CUDA memory and a peer process's, over shm: the peer maps ours by CUDA IPC
    (no bounce on our side), byte-exact both ways."""
    import cupy as cp

    from transfer_engine import Descriptor, Engine

    size = 8 << 20
    monkeypatch.setenv("TE_PEER_DEVICE", "cuda")
    _, endpoint = spawn_peer("gpu-peer", size, 31, "shm")
    theirs = np.random.default_rng(31).integers(0, 256, size, dtype=np.uint8)
    ours = np.random.default_rng(32).integers(0, 256, size, dtype=np.uint8)
    src, back = cp.asarray(ours), cp.zeros(size, cp.uint8)
    with Engine("gpu-a", transports=["shm"]) as a:
        seg, bseg = a.register(src, name="src"), a.register(back, name="back")
        peer = a.connect(endpoint)
        remote = peer.segment("dst")
        a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(remote, 0, size))]).wait(60)
        assert np.array_equal(cp.asnumpy(back), theirs)
        a.write(peer, [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))]).wait(60)
        a.read(peer, [(Descriptor(bseg, 0, size), Descriptor(remote, 0, size))]).wait(60)
        assert np.array_equal(cp.asnumpy(back), ours)
        assert a._staging_area is None  # by IPC, no bounce here


@pytest.mark.gpu
def test_batched_device_copies_are_byte_exact() -> None:
    """Many small device-to-device rows in one launch: rows aligned to 16 bytes and rows
    that are not, each landing exactly where it should and nowhere else."""
    import cupy as cp

    from transfer_engine.devmem import CudaCopier

    rng = np.random.default_rng(11)
    host = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    src, dst = cp.asarray(host), cp.zeros(4 << 20, cp.uint8)
    want = np.zeros_like(host)
    rows, at = [], 0
    for i in range(300):
        n = int(rng.integers(1, 8192)) if i % 2 else 4096
        s_off = int(rng.integers(0, (4 << 20) - n))
        if i % 2 == 0:
            s_off -= s_off % 16
        rows.append((dst.data.ptr + at, src.data.ptr + s_off, n))
        want[at:at + n] = host[s_off:s_off + n]
        at += n + (i % 3)  # gaps stay zero
    CudaCopier("cuda:0").between(rows, on_device=True)
    assert CudaCopier._gather not in (None, False)  # the kernel ran, not the fallback
    assert np.array_equal(cp.asnumpy(dst), want)


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not importable")
    if not torch.cuda.is_available():
        pytest.skip("torch finds no CUDA device (the torch copier needs one)")
    return torch


def test_torch_copier_round_trip_where_torch_has_cuda() -> None:
    """Without cupy (a vLLM server's usual set-up) device copies go through torch;
    runs wherever torch sees a GPU, with or without cupy."""
    torch = _torch_cuda()
    from transfer_engine.devmem import TorchCopier

    rng = np.random.default_rng(9)
    host = rng.integers(0, 256, (4 << 20) + 3, dtype=np.uint8)
    back = np.zeros_like(host)
    dev = torch.zeros(host.nbytes, dtype=torch.uint8, device="cuda:0")
    copier = TorchCopier("cuda:0")
    copier.to_device([(dev.data_ptr(), host.ctypes.data, host.nbytes)])
    half = host.nbytes // 2
    wait = copier.to_host_async([(dev.data_ptr(), back.ctypes.data, half)])
    copier.to_host([(dev.data_ptr() + half, back.ctypes.data + half, host.nbytes - half)])
    wait()
    assert np.array_equal(back, host)

"""The Mooncake-compatible TransferEngine, checked against Mooncake's documented Python
behaviour: 0 / negative return codes, sync and async calls, batch calls, status codes
(1 done, 0 pending, -1 failed, -2 timed out), managed buffers, notifications.

Written the way a Mooncake user writes it (raw addresses from ``ndarray.ctypes.data``,
sessions as ``"host:rpc_port"``), so it would run against ``mooncake.engine`` by
swapping the import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_engine.connectors import mooncake_compat
from transfer_engine.connectors.mooncake_compat import (
    TransferEngine,
    TransferNotify,
    TransferOpcode,
)

# Every public method of mooncake.engine.TransferEngine in its Python API reference.
MOONCAKE_METHODS = """
initialize initialize_ext get_engine get_rpc_port allocate_managed_buffer
free_managed_buffer get_first_buffer_address transfer_sync_write transfer_sync_read
transfer_sync transfer_submit_write transfer_check_status transfer_write_on_cuda
transfer_read_on_cuda batch_transfer_sync_write batch_transfer_sync_read
batch_transfer_sync batch_transfer_async_write batch_transfer_async_read
batch_transfer_async get_batch_transfer_status batch_transfer_write_on_cuda
batch_transfer_read_on_cuda write_bytes_to_buffer read_bytes_from_buffer register_memory
unregister_memory batch_register_memory batch_unregister_memory get_local_topology
get_notifies send_probe
""".split()

KiB = 1024


@pytest.fixture(autouse=True)
def quiet_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=mooncake_compat.__name__)


def _start(protocol: str = "tcp") -> TransferEngine:
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    return engine


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    client, server = _start(), _start()
    yield client, server
    client.close()
    server.close()


def _session(engine: TransferEngine) -> str:
    return f"127.0.0.1:{engine.get_rpc_port()}"


def test_every_documented_method_exists() -> None:
    missing = [m for m in MOONCAKE_METHODS if not callable(getattr(TransferEngine, m, None))]
    assert missing == []
    assert int(TransferOpcode.READ) == 0 and int(TransferOpcode.WRITE) == 1
    note = TransferNotify("n", "m")
    assert (note.name, note.msg) == ("n", "m") and TransferNotify().name == ""


def test_initialize_return_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = TransferEngine()
    assert engine.get_rpc_port() < 0
    assert engine.register_memory(4096, 4096) < 0  # before initialize
    assert engine.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == \
        mooncake_compat.ERR_METADATA
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") < 0
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert engine.get_rpc_port() > 0
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") < 0  # twice
        assert '"tcp"' in engine.get_local_topology()
    finally:
        engine.close()
        engine.close()
    rdma = TransferEngine()
    ret = rdma.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "rdma", "", "p2p")
    rdma.close()
    assert ret in (0, mooncake_compat.ERR_DEVICE_NOT_FOUND)


def test_sync_write_and_read(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    rng = np.random.default_rng(1)
    target = np.zeros(1 << 20, dtype=np.uint8)
    assert server.register_memory(target.ctypes.data, target.nbytes) == 0
    src = rng.integers(0, 256, 256 * KiB, dtype=np.uint8)
    assert client.register_memory(src.ctypes.data, src.nbytes) == 0
    # into the middle of the peer's region, by raw address
    ret = client.transfer_sync_write(_session(server), src.ctypes.data,
                                     target.ctypes.data + 4096, src.nbytes)
    assert ret == 0
    assert np.array_equal(target[4096:4096 + src.nbytes], src)
    back = np.zeros(64 * KiB, dtype=np.uint8)  # never registered: allowed, as on TCP
    assert client.transfer_sync_read(_session(server), back.ctypes.data,
                                     target.ctypes.data + 8192, back.nbytes) == 0
    assert np.array_equal(back, src[4096:4096 + back.nbytes])
    assert client.unregister_memory(src.ctypes.data) == 0
    assert server.unregister_memory(target.ctypes.data) == 0


def test_transfer_errors_are_negative(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    target = np.zeros(64 * KiB, dtype=np.uint8)
    src = np.ones(8 * KiB, dtype=np.uint8)
    assert server.register_memory(target.ctypes.data, target.nbytes) == 0
    session = _session(server)
    # beyond the end of the peer's region / an address it never registered
    assert client.transfer_sync_write(session, src.ctypes.data,
                                      target.ctypes.data + 60 * KiB, 8 * KiB) < 0
    assert client.transfer_sync_write(session, src.ctypes.data, 4096, 8) < 0
    assert client.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 0) < 0
    assert client.batch_transfer_sync_write(session, [src.ctypes.data], [], [8]) < 0
    assert client.transfer_sync_write("127.0.0.1", src.ctypes.data, target.ctypes.data, 8) < 0
    # after the peer unregisters, its memory is out of reach
    assert server.unregister_memory(target.ctypes.data) == 0
    assert server.unregister_memory(target.ctypes.data) == \
        mooncake_compat.ERR_ADDRESS_NOT_REGISTERED
    assert client.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 8) < 0
    # a peer registering later is found without reconnecting
    assert server.register_memory(target.ctypes.data, target.nbytes) == 0
    assert client.transfer_sync_write(session, src.ctypes.data, target.ctypes.data,
                                      src.nbytes) == 0
    assert target[:src.nbytes].all()


def test_unreachable_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "0.5")
    client = _start()
    try:
        buf = np.ones(16, dtype=np.uint8)
        assert client.transfer_sync_write("127.0.0.1:9", buf.ctypes.data, 4096, 16) < 0
        assert client.send_probe("127.0.0.1:9") != 0
        assert client.batch_transfer_async_write("127.0.0.1:9", [buf.ctypes.data], [4096],
                                                 [16]) == 0
    finally:
        client.close()


def test_overlapping_registration(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, _ = pair
    buf = np.zeros(64 * KiB, dtype=np.uint8)
    base = buf.ctypes.data
    assert client.register_memory(base, 32 * KiB) == 0
    assert client.register_memory(base + 16 * KiB, 32 * KiB) == \
        mooncake_compat.ERR_ADDRESS_OVERLAPPED
    assert client.register_memory(base + 32 * KiB, 32 * KiB) == 0  # adjacent is fine
    assert client.batch_unregister_memory([base, base + 32 * KiB]) == 0
    assert client.batch_register_memory([base, base + 32 * KiB], [32 * KiB, 32 * KiB]) == 0
    assert client.batch_register_memory([base], [1]) < 0  # all or nothing
    assert client.batch_unregister_memory([base, base + 32 * KiB]) == 0


def test_async_submit_and_check_status(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    target = np.zeros(1 << 20, dtype=np.uint8)
    server.register_memory(target.ctypes.data, target.nbytes)
    src = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    client.register_memory(src.ctypes.data, src.nbytes)
    batch_id = client.transfer_submit_write(_session(server), src.ctypes.data,
                                            target.ctypes.data, src.nbytes)
    assert batch_id > 0
    deadline = time.monotonic() + 10
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = client.transfer_check_status(batch_id)
        time.sleep(0.001)
    assert status == 1
    assert np.array_equal(target, src)
    assert client.transfer_check_status(batch_id) == -1  # forgotten after a final status
    assert client.transfer_check_status(12345) == -1
    # a failing submission returns a negative code, not an id
    assert client.transfer_submit_write(_session(server), src.ctypes.data, 4096, 8) < 0


def test_batch_sync_and_async(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    chunk, n = 64 * KiB, 8
    target = np.zeros(chunk * n, dtype=np.uint8)
    server.register_memory(target.ctypes.data, target.nbytes)
    rng = np.random.default_rng(3)
    locals_ = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(n)]
    for buf in locals_:
        assert client.register_memory(buf.ctypes.data, chunk) == 0
    session = _session(server)
    # scattered: chunk i goes to slot n-1-i
    remote = [target.ctypes.data + (n - 1 - i) * chunk for i in range(n)]
    assert client.batch_transfer_sync_write(session, [b.ctypes.data for b in locals_],
                                            remote, [chunk] * n) == 0
    for i, buf in enumerate(locals_):
        assert np.array_equal(target[(n - 1 - i) * chunk:(n - i) * chunk], buf)
    target[:] = 0
    ids = [client.batch_transfer_async_write(session, [locals_[i].ctypes.data],
                                             [remote[i]], [chunk]) for i in range(n)]
    assert all(i > 0 for i in ids) and len(set(ids)) == n
    assert client.get_batch_transfer_status(ids) == 0
    for i, buf in enumerate(locals_):
        assert np.array_equal(target[(n - 1 - i) * chunk:(n - i) * chunk], buf)
    # reads back, async and generic-opcode flavours
    backs = [np.zeros(chunk, dtype=np.uint8) for _ in range(n)]
    bid = client.batch_transfer_async_read(session, [b.ctypes.data for b in backs], remote,
                                           [chunk] * n)
    assert bid > 0 and client.get_batch_transfer_status([bid]) == 0
    assert all(np.array_equal(b, s) for b, s in zip(backs, locals_, strict=True))
    bid = client.batch_transfer_async(session, [backs[0].ctypes.data], [remote[0]], [chunk],
                                      TransferOpcode.WRITE)
    assert bid > 0 and client.get_batch_transfer_status([bid]) == 0
    assert client.batch_transfer_sync(session, [backs[1].ctypes.data], [remote[1]], [chunk],
                                      TransferOpcode.READ) == 0
    bad = client.batch_transfer_async_write(session, [backs[0].ctypes.data], [4096], [8])
    assert bad == 0  # failed to submit
    assert client.get_batch_transfer_status([ids[0]]) == -1  # already collected


def test_timeout_status(pair: tuple[TransferEngine, TransferEngine],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    client, server = pair
    target = np.zeros(4 * KiB, dtype=np.uint8)
    server.register_memory(target.ctypes.data, target.nbytes)
    src = np.ones(4 * KiB, dtype=np.uint8)
    bid = client.transfer_submit_write(_session(server), src.ctypes.data,
                                       target.ctypes.data, src.nbytes)
    assert bid > 0
    monkeypatch.setattr(client._batches[bid], "deadline", 0.0)
    handle = client._batches[bid].handle
    assert handle is not None
    handle.wait(5)
    # finished transfers report their real result even past the deadline
    assert client.transfer_check_status(bid) == 1
    # a transfer still pending past its deadline reports -2
    bid = client.transfer_submit_write(_session(server), src.ctypes.data,
                                       target.ctypes.data, src.nbytes)
    batch = client._batches[bid]
    monkeypatch.setattr(batch, "deadline", 0.0)
    real = batch.handle
    assert real is not None

    class Stuck:
        state = mooncake_compat.TransferState.PENDING

    batch.handle = Stuck()  # type: ignore[assignment]
    assert client.transfer_check_status(bid) == -2
    batch.handle = real
    real.wait(5)


def test_notifications(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    target = np.zeros(16 * KiB, dtype=np.uint8)
    server.register_memory(target.ctypes.data, target.nbytes)
    src = np.full(16 * KiB, 7, dtype=np.uint8)
    session = _session(server)
    assert server.get_notifies() == []
    assert client.transfer_sync(session, src.ctypes.data, target.ctypes.data, src.nbytes,
                                TransferOpcode.WRITE, TransferNotify("req-1", "done")) == 0
    assert (target == 7).all()  # the bytes landed before the notification
    deadline = time.monotonic() + 5
    notes: list[TransferNotify] = []
    while not notes and time.monotonic() < deadline:
        notes = server.get_notifies()
        time.sleep(0.005)
    assert notes == [TransferNotify("req-1", "done")]
    assert server.get_notifies() == []  # each exactly once
    assert client.batch_transfer_sync(session, [src.ctypes.data], [target.ctypes.data],
                                      [4096], TransferOpcode.READ,
                                      TransferNotify("req-2", "read")) == 0
    deadline = time.monotonic() + 5
    while not notes[1:] and time.monotonic() < deadline:
        notes += server.get_notifies()
        time.sleep(0.005)
    assert notes[1:] == [TransferNotify("req-2", "read")]


def test_managed_buffers_and_first_address(pair: tuple[TransferEngine, TransferEngine]
                                           ) -> None:
    client, server = pair
    assert server.allocate_managed_buffer(0) == 0
    addr = server.allocate_managed_buffer(1 << 20)
    assert addr != 0
    assert server.write_bytes_to_buffer(addr, b"hello mooncake", 14) == 0
    assert server.read_bytes_from_buffer(addr, 14) == b"hello mooncake"
    second = server.allocate_managed_buffer(4096)
    session = _session(server)
    assert client.get_first_buffer_address(session) == addr
    assert server.get_first_buffer_address(session) == addr
    local = client.allocate_managed_buffer(4096)
    client.write_bytes_to_buffer(local, b"x" * 4096, 4096)
    assert client.transfer_sync_write(session, local, second, 4096) == 0
    assert server.read_bytes_from_buffer(second, 4096) == b"x" * 4096
    assert client.transfer_sync_read(session, local, addr, 14) == 0
    assert client.read_bytes_from_buffer(local, 14) == b"hello mooncake"
    assert server.free_managed_buffer(addr, 1 << 20) == 0
    assert server.free_managed_buffer(addr, 1 << 20) < 0
    assert client.transfer_sync_read(session, local, addr, 14) < 0  # gone
    assert server.free_managed_buffer(second, 4096) == 0
    assert client.free_managed_buffer(local, 4096) == 0
    assert "127.0.0.1" in repr(client)


def test_cuda_calls_raise_like_a_build_without_cuda(
        pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    with pytest.raises(RuntimeError):
        client.transfer_write_on_cuda(_session(server), 0, 0, 0)

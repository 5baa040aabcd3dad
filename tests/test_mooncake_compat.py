"""Mooncake's ``mooncake.engine.TransferEngine`` API on our engine, P2P handshake mode:
every row of the return-value table in docs/mooncake.md, fast failures, the rdma
fallback, notifications, and concurrent first contact.

Written the way a Mooncake user writes it (raw addresses from ``ndarray.ctypes.data``,
sessions as ``"host:rpc_port"``), so each test would run against ``mooncake.engine``
by swapping the import; where Mooncake differs on purpose, the docs say so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.helpers.faults import mooncake_batch
from transfer_engine.connectors import mooncake_compat
from transfer_engine.connectors.mooncake import (
    TransferEngine,
    TransferNotify,
    TransferOpcode,
)
from transfer_engine.connectors.mooncake import engine as mc_engine

# Every public method of mooncake.engine.TransferEngine (its pybind11 class, non-CUDA).
MOONCAKE_METHODS = """
initialize initialize_ext get_rpc_port allocate_managed_buffer free_managed_buffer
transfer_sync_write transfer_sync_read batch_transfer_sync_write batch_transfer_sync_read
batch_transfer_async_write batch_transfer_async_read transfer_sync batch_transfer_sync
batch_transfer_async get_batch_transfer_status transfer_submit_write transfer_check_status
write_bytes_to_buffer read_bytes_from_buffer register_memory unregister_memory
batch_register_memory batch_unregister_memory get_local_topology get_first_buffer_address
warmup_efa_segment get_notifies send_probe get_engine get_engine_ptr
""".split()

KiB = 1024
FAST = 0.5  # seconds: failing calls to an unknown host or a refused port end sooner


@pytest.fixture(autouse=True)
def quiet_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=mc_engine.__name__)


def _start(protocol: str = "tcp", host: str = "127.0.0.1") -> TransferEngine:
    engine = TransferEngine()
    assert engine.initialize(host, "P2PHANDSHAKE", protocol, "") == 0
    return engine


@pytest.fixture
def pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    client, server = _start(), _start()
    yield client, server
    client.close()
    server.close()


def _session(engine: TransferEngine) -> str:
    return f"127.0.0.1:{engine.get_rpc_port()}"


def _timed(fn, *args):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


def test_every_method_and_name_exists() -> None:
    missing = [m for m in MOONCAKE_METHODS if not callable(getattr(TransferEngine, m, None))]
    assert missing == []
    assert int(TransferOpcode.Read) == 0 and int(TransferOpcode.Write) == 1
    assert TransferOpcode.READ is TransferOpcode.Read  # the older spelling still works
    assert TransferEngine.TransferOpcode is TransferOpcode  # type: ignore[attr-defined]
    note = TransferNotify("n", "m")
    assert (note.name, note.msg) == ("n", "m") and TransferNotify().name == ""
    note.msg = "changed"
    assert note == TransferNotify("n", "changed")
    assert mooncake_compat.TransferEngine is TransferEngine  # the old import path


def test_initialize_return_values(caplog: pytest.LogCaptureFixture) -> None:
    engine = TransferEngine()
    assert engine.get_rpc_port() == -1 and engine.get_engine_ptr() == 0
    assert engine.register_memory(4096, 4096) == -1  # before initialize
    assert engine.transfer_submit_write("127.0.0.1:1", 0, 0, 8) == 0
    # etcd (a bare host:port is etcd for Mooncake), redis, unknown schemes: -1, at once
    for server in ("127.0.0.1:2379", "etcd://127.0.0.1:2379", "redis://127.0.0.1:6379",
                   "bogus://x"):
        ret, took = _timed(engine.initialize, "127.0.0.1", server, "tcp", "")
        assert (ret, took < FAST) == (-1, True), server
    assert engine.initialize_ext("127.0.0.1", "127.0.0.1:2379", "tcp", "", "redis") == -1
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "xgmi", "") == -1
    # an HTTP metadata server nobody serves
    assert engine.initialize("127.0.0.1", "http://127.0.0.1:9/metadata", "tcp", "") == -1
    # the engine picks its own port, whatever local_hostname says (as Mooncake)
    assert engine.initialize("127.0.0.1:1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert engine.get_rpc_port() > 1 and engine.get_engine_ptr() != 0
        assert engine.get_engine() is not None
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # twice
        assert '"cpu:0"' in engine.get_local_topology()
    finally:
        engine.close()
        engine.close()
    p2p = TransferEngine()
    assert p2p.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    p2p.close()


def test_rdma_without_a_device_runs_over_tcp(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=mc_engine.__name__)
    rdma, tcp = _start("rdma"), _start("tcp")
    try:
        transports = rdma.get_engine().metadata()["transports"]  # type: ignore[union-attr]
        warned = [r for r in caplog.records if "no RDMA device" in r.getMessage()]
        if "rdma" in transports:
            assert warned == []
        else:
            assert "tcp" in transports and len(warned) == 1
        target = np.zeros(4 * KiB, dtype=np.uint8)
        assert tcp.register_memory(target.ctypes.data, target.nbytes) == 0
        src = np.full(4 * KiB, 9, dtype=np.uint8)
        assert rdma.transfer_sync_write(_session(tcp), src.ctypes.data, target.ctypes.data,
                                        src.nbytes) == 0
        assert (target == 9).all()
    finally:
        rdma.close()
        tcp.close()
    # Mooncake's other fabric names and unknown protocols start too (0), as Mooncake
    for protocol in ("efa", "carrier-pigeon"):
        other = TransferEngine()
        assert other.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
        other.close()


def test_sync_write_and_read(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    rng = np.random.default_rng(1)
    target = np.zeros(1 << 20, dtype=np.uint8)
    assert server.register_memory(target.ctypes.data, target.nbytes) == 0
    src = rng.integers(0, 256, 256 * KiB, dtype=np.uint8)
    assert client.register_memory(src.ctypes.data, src.nbytes) == 0
    # into the middle of the peer's region, by raw address
    assert client.transfer_sync_write(_session(server), src.ctypes.data,
                                      target.ctypes.data + 4096, src.nbytes) == 0
    assert np.array_equal(target[4096:4096 + src.nbytes], src)
    back = np.zeros(64 * KiB, dtype=np.uint8)  # never registered: allowed, as on TCP
    assert client.transfer_sync_read(_session(server), back.ctypes.data,
                                     target.ctypes.data + 8192, back.nbytes) == 0
    assert np.array_equal(back, src[4096:4096 + back.nbytes])
    assert client.unregister_memory(src.ctypes.data) == 0
    assert server.unregister_memory(target.ctypes.data) == 0


def test_transfer_failures_are_mooncakes(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    target = np.zeros(64 * KiB, dtype=np.uint8)
    src = np.ones(8 * KiB, dtype=np.uint8)
    assert server.register_memory(target.ctypes.data, target.nbytes) == 0
    session = _session(server)
    # beyond the end of the peer's region / an address it never registered: -1
    assert client.transfer_sync_write(session, src.ctypes.data,
                                      target.ctypes.data + 60 * KiB, 8 * KiB) == -1
    assert client.transfer_sync_write(session, src.ctypes.data, 4096, 8) == -1
    # zero bytes and empty batches succeed without moving anything
    assert client.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 0) == 0
    assert client.batch_transfer_sync_write(session, [], [], []) == 0
    # lists of different lengths
    assert client.batch_transfer_sync_write(session, [src.ctypes.data], [], [8]) == -1
    assert client.batch_transfer_async_write(session, [src.ctypes.data], [], [8]) == 0
    # a session without the port
    assert client.transfer_sync_write("127.0.0.1", src.ctypes.data, target.ctypes.data,
                                      8) == -1
    # after the peer unregisters, its memory is out of reach
    assert server.unregister_memory(target.ctypes.data) == 0
    assert server.unregister_memory(target.ctypes.data) == -3
    assert server.batch_unregister_memory([target.ctypes.data]) == -3
    assert client.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 8) == -1
    # a peer registering later is found without reconnecting
    assert server.register_memory(target.ctypes.data, target.nbytes) == 0
    assert client.transfer_sync_write(session, src.ctypes.data, target.ctypes.data,
                                      src.nbytes) == 0
    assert target[:src.nbytes].all()


def test_unknown_host_and_refused_port_fail_at_once() -> None:
    client = _start()
    try:
        buf = np.ones(16, dtype=np.uint8)
        for target, probe_code in (("unreachable-peer.invalid:9", -101),
                                   ("127.0.0.1:9", -102)):
            for call, args, failure in (
                    (client.transfer_sync_write, (buf.ctypes.data, 4096, 16), -1),
                    (client.transfer_sync_read, (buf.ctypes.data, 4096, 16), -1),
                    (client.batch_transfer_sync_write, ([buf.ctypes.data], [4096], [16]), -1),
                    (client.transfer_submit_write, (buf.ctypes.data, 4096, 16), 0),
                    (client.batch_transfer_async_write, ([0], [0], [16]), 0),
                    (client.batch_transfer_async_read, ([0], [0], [16]), 0),
                    (client.get_first_buffer_address, (), 0),
                    (client.warmup_efa_segment, (), -1),
                    (client.send_probe, (), probe_code)):
                ret, took = _timed(call, target, *args)
                assert ret == failure, (call.__name__, target)
                assert took < FAST, (call.__name__, target, took)
    finally:
        client.close()


def test_overlapping_and_bad_registration(pair: tuple[TransferEngine, TransferEngine]
                                          ) -> None:
    client, _ = pair
    buf = np.zeros(64 * KiB, dtype=np.uint8)
    base = buf.ctypes.data
    assert client.register_memory(base, 32 * KiB) == 0
    assert client.register_memory(base, 32 * KiB) == -7  # the same region twice
    assert client.register_memory(base + 16 * KiB, 32 * KiB) == -7
    assert client.register_memory(base + 32 * KiB, 32 * KiB, "cpu:0") == 0  # adjacent
    assert client.register_memory(base, 0) == -1
    assert client.batch_unregister_memory([base, base + 32 * KiB]) == 0
    assert client.batch_register_memory([base, base + 32 * KiB], [32 * KiB, 32 * KiB]) == 0
    assert client.batch_register_memory([base], [1]) == -7  # all or nothing
    assert client.batch_register_memory([base], [1, 2]) == -1
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
    # a submission the peer refuses: an id whose status is -1, as Mooncake
    assert client.transfer_submit_write(_session(server), src.ctypes.data, 4096, 8) == 0


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
    backs = [np.zeros(chunk, dtype=np.uint8) for _ in range(n)]
    bid = client.batch_transfer_async_read(session, [b.ctypes.data for b in backs], remote,
                                           [chunk] * n)
    assert bid > 0 and client.get_batch_transfer_status([bid]) == 0
    assert all(np.array_equal(b, s) for b, s in zip(backs, locals_, strict=True))
    bid = client.batch_transfer_async(session, [backs[0].ctypes.data], [remote[0]], [chunk],
                                      TransferOpcode.Write)
    assert bid > 0 and client.get_batch_transfer_status([bid]) == 0
    assert client.batch_transfer_sync(session, [backs[1].ctypes.data], [remote[1]], [chunk],
                                      TransferOpcode.Read) == 0
    empty = client.batch_transfer_async_write(session, [], [], [])
    assert empty > 0 and client.get_batch_transfer_status([empty]) == 0
    assert client.batch_transfer_async_write(session, [backs[0].ctypes.data], [4096],
                                             [8]) == 0
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
    monkeypatch.setattr(mooncake_batch(client, bid), "deadline", 0.0)
    handle = mooncake_batch(client, bid).handle
    assert handle is not None
    handle.wait(5)
    # finished transfers report their real result even past the deadline
    assert client.transfer_check_status(bid) == 1
    # a transfer still pending past its deadline reports -2
    bid = client.transfer_submit_write(_session(server), src.ctypes.data,
                                       target.ctypes.data, src.nbytes)
    batch = mooncake_batch(client, bid)
    monkeypatch.setattr(batch, "deadline", 0.0)
    real = batch.handle
    assert real is not None
    real.wait(5)

    class Stuck:
        state = mc_engine.TransferState.PENDING

        def cancel(self) -> bool:
            return False

    batch.handle = Stuck()  # type: ignore[assignment]
    assert client.transfer_check_status(bid) == -2
    batch.handle = real


def test_transfer_timeout_follows_mooncakes_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    assert mc_engine._timeout() == 5.0  # at least 5 s, as Mooncake
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "12")
    assert mc_engine._timeout() == 12.0
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT")
    assert mc_engine._timeout() == 30.0


def test_notifications(pair: tuple[TransferEngine, TransferEngine]) -> None:
    client, server = pair
    target = np.zeros(16 * KiB, dtype=np.uint8)
    server.register_memory(target.ctypes.data, target.nbytes)
    src = np.full(16 * KiB, 7, dtype=np.uint8)
    session = _session(server)
    assert server.get_notifies() == []
    assert client.transfer_sync(session, src.ctypes.data, target.ctypes.data, src.nbytes,
                                TransferOpcode.Write, TransferNotify("req-1", "done")) == 0
    assert (target == 7).all()  # the bytes landed before the notification
    deadline = time.monotonic() + 5
    notes: list[TransferNotify] = []
    while not notes and time.monotonic() < deadline:
        notes = server.get_notifies()
        time.sleep(0.005)
    assert notes == [TransferNotify("req-1", "done")]
    assert server.get_notifies() == []  # each exactly once
    assert client.batch_transfer_sync(session, [src.ctypes.data], [target.ctypes.data],
                                      [4096], TransferOpcode.Read,
                                      TransferNotify("req-2", "read")) == 0
    deadline = time.monotonic() + 5
    while not notes[1:] and time.monotonic() < deadline:
        notes += server.get_notifies()
        time.sleep(0.005)
    assert notes[1:] == [TransferNotify("req-2", "read")]


def test_managed_buffers_and_first_address(pair: tuple[TransferEngine, TransferEngine]
                                           ) -> None:
    client, server = pair
    session = _session(server)
    assert server.get_first_buffer_address(session) == 0  # nothing registered yet
    assert client.get_first_buffer_address(session) == 0
    addr = server.allocate_managed_buffer(1 << 20)
    assert addr != 0
    assert server.write_bytes_to_buffer(addr, b"hello mooncake", 14) == 0
    assert server.read_bytes_from_buffer(addr, 14) == b"hello mooncake"
    second = server.allocate_managed_buffer(4096)
    assert client.get_first_buffer_address(session) == addr
    assert server.get_first_buffer_address(session) == addr
    local = client.allocate_managed_buffer(4096)
    client.write_bytes_to_buffer(local, b"x" * 4096, 4096)
    assert client.transfer_sync_write(session, local, second, 4096) == 0
    assert server.read_bytes_from_buffer(second, 4096) == b"x" * 4096
    assert client.transfer_sync_read(session, local, addr, 14) == 0
    assert client.read_bytes_from_buffer(local, 14) == b"hello mooncake"
    assert server.free_managed_buffer(addr, 1 << 20) == 0
    assert server.free_managed_buffer(addr, 1 << 20) == -1  # Mooncake does not check
    assert client.transfer_sync_read(session, local, addr, 14) == -1  # gone
    empty = client.allocate_managed_buffer(0)  # Mooncake hands out an address too
    assert empty != 0 and client.free_managed_buffer(empty, 0) == 0
    assert server.free_managed_buffer(second, 4096) == 0
    assert client.free_managed_buffer(local, 4096) == 0
    assert "127.0.0.1" in repr(client) and "p2p" in repr(client)


def test_cuda_calls_are_absent_as_in_a_build_without_cuda() -> None:
    assert not hasattr(TransferEngine, "transfer_write_on_cuda")
    assert mc_engine.SUPPORT_CUDA is False


def _first_contact_round(rep: int, threads: int = 10, chunk: int = 8 * KiB) -> None:
    client, server = _start(), _start()
    try:
        target = np.zeros(chunk * threads * 4, dtype=np.uint8)
        assert server.register_memory(target.ctypes.data, target.nbytes) == 0
        rng = np.random.default_rng(rep)
        srcs = [rng.integers(0, 256, chunk * 4, dtype=np.uint8) for _ in range(threads)]
        results: list[int] = []
        start = threading.Barrier(threads)

        def send(i: int) -> None:
            base = target.ctypes.data + i * chunk * 4
            start.wait()
            results.append(client.batch_transfer_sync_write(
                _session(server), [srcs[i].ctypes.data + k * chunk for k in range(4)],
                [base + k * chunk for k in range(4)], [chunk] * 4))

        workers = [threading.Thread(target=send, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert results == [0] * threads, rep
        assert np.array_equal(target, np.concatenate(srcs)), rep
    finally:
        client.close()
        server.close()


def test_concurrent_first_contact_lands_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """10 threads of batch_transfer_sync_write into a never-contacted peer, 20 times:
    the first 4 served by the drop-in's default serving process, the rest (the race is
    the initiator's) from threads, which start in a fraction of the time."""
    for rep in range(20):
        if rep == 4:
            monkeypatch.setenv("TE_SERVE", "thread")
        _first_contact_round(rep)


def test_the_drop_in_serves_from_a_serving_process_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's engine moves bytes without the caller's Python; so does the drop-in,
    by default (a busy target thread: `python -m bench.mooncake_busy`)."""
    monkeypatch.delenv("TE_SERVE", raising=False)
    with TransferEngine() as engine:
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        inner = engine.get_engine()
        assert inner is not None and inner.transports["tcp"].info("serve") == "process"
    monkeypatch.setenv("TE_SERVE", "thread")
    with TransferEngine() as engine:
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        inner = engine.get_engine()
        assert inner is not None and inner.transports["tcp"].info("serve") == "thread"

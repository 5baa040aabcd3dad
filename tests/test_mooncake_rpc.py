"""``RpcInterface`` / ``CoroRPCInterface``: Mooncake's message API between processes,
over real loopback sockets, with its return values, the project's exposure rules and
authentication by the control secret."""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import socket
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.rails import recv_all
from transfer_engine.connectors.mooncake import (
    CoroRPCInterface,
    ReceivedTensor,
    RpcInterface,
    create_rpc_client,
)
from transfer_engine.connectors.mooncake import rpc as mc_rpc

SECRET = "a-test-secret-of-32-bytes-length"


@pytest.fixture(autouse=True)
def quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger=mc_rpc.__name__)


@pytest.fixture
def server() -> Iterator[tuple[RpcInterface, queue.Queue[dict[str, Any]]]]:
    srv = RpcInterface()
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    assert srv.initialize_server("127.0.0.1:0", thread_count=8) is True
    srv.set_data_receive_callback(got.put)
    assert srv.start_server_async() is True
    yield srv, got
    srv.close()


def test_names_match_mooncake() -> None:
    assert CoroRPCInterface is RpcInterface
    for name in ("initialize", "initialize_client", "initialize_server", "start_server",
                 "start_server_async", "stop_server", "send_data", "send_data_async",
                 "send_tensor", "send_tensor_async", "set_data_receive_callback",
                 "set_tensor_receive_callback"):
        assert callable(getattr(RpcInterface, name)), name


def test_send_data(server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    srv, got = server
    client = RpcInterface()
    assert client.initialize_client(pool_size=2) is True
    try:
        target = f"127.0.0.1:{srv.port}"
        payload = bytes(range(256)) * 4096  # 1 MiB
        for _ in range(5):  # one pooled connection, reused
            assert client.send_data(target, payload) == 0
        for _ in range(5):
            msg = got.get(timeout=5)
            assert msg["data"] == payload and msg["source"].startswith("127.0.0.1:")
        assert client.send_data(target, b"") == 0
        assert got.get(timeout=5)["data"] == b""
        assert client.send_data(target, memoryview(b"view")) == 0
        assert got.get(timeout=5)["data"] == b"view"
        assert client.send_data("127.0.0.1:9", b"x") == -1  # refused
    finally:
        client.close()
    assert RpcInterface().send_data(target, b"x") == -1  # not initialised


def test_server_restart_is_survived_by_pooled_connections() -> None:
    srv = RpcInterface()
    assert srv.initialize_server("127.0.0.1:0")
    assert srv.start_server_async()
    port = srv.port
    client = create_rpc_client()
    try:
        assert client.send_data(f"127.0.0.1:{port}", b"one") == 0
        srv.stop_server()
        srv.stop_server()  # idempotent
        assert client.send_data(f"127.0.0.1:{port}", b"two") == -1
        again = RpcInterface()
        assert again.initialize_server(f"127.0.0.1:{port}")
        assert again.start_server_async()
        try:
            assert client.send_data(f"127.0.0.1:{port}", b"three") == 0
        finally:
            again.close()
    finally:
        client.close()
        srv.close()


def test_send_tensor(server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    torch = pytest.importorskip("torch")
    srv, _ = server
    tensors: queue.Queue[ReceivedTensor] = queue.Queue()
    srv.set_tensor_receive_callback(tensors.put)
    client = create_rpc_client()
    try:
        t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
        assert client.send_tensor(f"127.0.0.1:{srv.port}", t) == 0
        got = tensors.get(timeout=5)
        assert (got.shape, got.dtype, got.total_bytes) == ([2, 3, 4], "float32", 96)
        back = torch.frombuffer(bytearray(got.get_data_as_bytes()), dtype=torch.float32)
        assert torch.equal(back.reshape(2, 3, 4), t)
        assert client.send_tensor(f"127.0.0.1:{srv.port}", b"not a tensor") == -1
    finally:
        client.close()


def test_async_sends(server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    srv, got = server
    client = create_rpc_client()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert await client.send_data_async(f"127.0.0.1:{srv.port}", b"async", loop) == 0
        with pytest.raises(RuntimeError, match="Send data failed"):
            await client.send_data_async("127.0.0.1:9", b"x", loop)

    try:
        asyncio.run(main())
        assert got.get(timeout=5)["data"] == b"async"
    finally:
        client.close()


def test_exposure_without_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TE_CONTROL_SECRET", raising=False)
    monkeypatch.delenv("TE_ALLOW_INSECURE", raising=False)
    srv = RpcInterface()
    assert srv.initialize_server("0.0.0.0:0") is True  # Mooncake's habit: loopback here
    assert srv.start_server_async() is True
    try:
        assert srv.port != 0
        assert srv.host == "127.0.0.1"
    finally:
        srv.close()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            addr = s.getsockname()[0]
    except OSError:
        pytest.skip("no network address")
    if addr.startswith("127."):
        pytest.skip("no network address")
    assert RpcInterface().initialize_server(f"{addr}:0") is False


def test_a_secret_authenticates_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_CONTROL_SECRET", SECRET)
    srv = RpcInterface()
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    srv.set_data_receive_callback(got.put)
    assert srv.initialize_server("127.0.0.1:0") and srv.start_server_async()
    good = create_rpc_client()
    monkeypatch.setenv("TE_CONTROL_SECRET", "another-secret-of-enough-length!")
    bad = create_rpc_client()
    monkeypatch.delenv("TE_CONTROL_SECRET")
    none = create_rpc_client()
    try:
        target = f"127.0.0.1:{srv.port}"
        assert good.send_data(target, b"ok") == 0
        assert bad.send_data(target, b"forged") == -1
        assert none.send_data(target, b"unsigned") == -1
        assert got.get(timeout=5)["data"] == b"ok" and got.empty()
    finally:
        for rpc in (good, bad, none, srv):
            rpc.close()


def test_oversize_messages_are_refused(server: tuple[RpcInterface,
                                                     queue.Queue[dict[str, Any]]]) -> None:
    srv, got = server
    srv.max_message = 1024
    client = create_rpc_client()
    try:
        assert client.send_data(f"127.0.0.1:{srv.port}", bytes(2048)) == -1
        assert client.send_data(f"127.0.0.1:{srv.port}", bytes(512)) == 0
        assert got.get(timeout=5)["data"] == bytes(512)
    finally:
        client.close()


# --- the wire by hand ------------------------------------------------------------------

_HEAD = struct.Struct("!II4q")


def _raw(srv: RpcInterface, prove: bool = True) -> socket.socket:
    """A connection to ``srv``, past the handshake unless ``prove`` is False."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    if prove:
        sock.sendall(mc_rpc._proof(srv._key, recv_all(sock, 16)))
    return sock


def _message(sock: socket.socket, kind: int, payload: bytes) -> int:
    sock.sendall(struct.pack("!BQ", kind, len(payload)) + payload)
    return int(struct.unpack("!i", recv_all(sock, 4))[0])


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _closed_by_server(sock: socket.socket, trickle: bytes, within: float) -> float:
    """Seconds until the server closes ``sock`` while a byte of ``trickle`` goes every
    0.2 s; fails past ``within``."""
    start, sent = time.monotonic(), 0
    sock.settimeout(0.2)
    while time.monotonic() - start < within:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            if sock.recv(4) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    raise AssertionError(f"still open after {within} s")


def test_send_tensor_sends_the_logical_contents(
        server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    torch = pytest.importorskip("torch")
    srv, _ = server
    tensors: queue.Queue[ReceivedTensor] = queue.Queue()
    srv.set_tensor_receive_callback(tensors.put)
    client = create_rpc_client()
    target = f"127.0.0.1:{srv.port}"
    base = torch.randint(-1000, 1000, (6, 8), dtype=torch.int32)
    cases = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([7], dtype=torch.int32).expand(1 << 16),  # stride 0
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "offset": base[3:],
        "conjugate": torch.randn(3, 4, dtype=torch.complex64).conj(),  # a lazy view
    }
    try:
        for name, t in cases.items():
            assert client.send_tensor(target, t) == 0, name
            got = tensors.get(timeout=5)
            want = t.resolve_conj().contiguous()
            assert got.shape == list(t.shape), name
            back = torch.frombuffer(got.get_memory_view(), dtype=t.dtype).reshape(t.shape)
            assert torch.equal(back, want), name
        assert client.send_tensor(target, torch.empty(3, device="meta")) == -1
        assert client.send_tensor(target, torch.eye(3).to_sparse()) == -1
        assert tensors.empty()
    finally:
        client.close()


def test_send_tensor_dtypes(server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]
                            ) -> None:
    torch = pytest.importorskip("torch")
    srv, _ = server
    tensors: queue.Queue[ReceivedTensor] = queue.Queue()
    srv.set_tensor_receive_callback(tensors.put)
    client = create_rpc_client()
    target = f"127.0.0.1:{srv.port}"
    # the wire ids of old are kept: peers of another version agree on them
    assert [mc_rpc._DTYPE_IDS[n] for n in ("float16", "float32", "float64", "int8",
            "int16", "int32", "int64", "uint8", "bool")] == list(range(1, 10))
    try:
        for name in ("bfloat16", "uint16", "uint32", "uint64", "float8_e4m3fn",
                     "float8_e5m2", "complex64", "complex128", "float32", "bool"):
            dtype = getattr(torch, name, None)
            if dtype is None:  # an older torch
                continue
            t = (torch.randint(0, 100, (3, 5)) % 7).to(dtype)
            assert client.send_tensor(target, t) == 0, name
            got = tensors.get(timeout=5)
            assert (got.dtype, got.shape) == (name, [3, 5]), name
            assert got.get_data_as_bytes() == t.view(torch.uint8).numpy().tobytes(), name
        for name in ("float8_e4m3fnuz", "float8_e5m2fnuz"):  # no wire id: refused
            dtype = getattr(torch, name, None)
            if dtype is not None:
                assert client.send_tensor(target, torch.empty(4, dtype=dtype)) == -1, name
        assert client.send_tensor(target, torch.empty(4).view(torch.uint8)[:4]) == 0
        tensors.get(timeout=5)

        class Odd:  # a tensor-like with a dtype of no wire id
            shape, dtype = (4,), "mine.int4"

            def contiguous(self) -> Any:
                return self

            def element_size(self) -> int:
                return 1

        assert client.send_tensor(target, Odd()) == -1
        assert tensors.empty()
    finally:
        client.close()


def test_malformed_tensor_messages_are_refused_before_an_answer(
        server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    srv, _ = server
    tensors: queue.Queue[ReceivedTensor] = queue.Queue()
    srv.set_tensor_receive_callback(tensors.put)
    rng = random.Random(7)
    bad = [rng.randbytes(rng.randrange(48)) for _ in range(5)]  # short of a header
    bad += [_HEAD.pack(2, rng.randrange(5, 1 << 32), 1, 1, 1, 1) + bytes(4),  # ndim
            _HEAD.pack(2, 2, -5, 7, 0, 0) + bytes(8),  # negative
            _HEAD.pack(2, 2, 10**12, 10**6, 0, 0) + bytes(4),  # no overflow to 4 bytes
            _HEAD.pack(2, 4, 1 << 62, 1 << 62, 1 << 62, 4) + bytes(16),
            _HEAD.pack(2, 2, 3, 4, 0, 0) + bytes(47),  # one byte short
            _HEAD.pack(2, 2, 3, 4, 0, 0) + bytes(49)]  # one byte over
    bad += [_HEAD.pack(i, 1, 4, 0, 0, 0) + bytes(4) for i in (0, 18, 77, (1 << 32) - 1)]
    sock = _raw(srv)
    try:
        for payload in bad:
            assert _message(sock, 2, payload) == -1, payload[:16]
        data = rng.randbytes(3 * 4 * 2)
        assert _message(sock, 2, _HEAD.pack(1, 2, 3, 4, 0, 0) + data) == 0  # same link
        assert _message(sock, 2, _HEAD.pack(2, 2, 0, 9, 0, 0)) == 0  # empty
        got = tensors.get(timeout=5)
        assert (got.dtype, got.shape, got.get_data_as_bytes()) == ("float16", [3, 4], data)
        assert tensors.get(timeout=5).shape == [0, 9]
        assert tensors.empty()
    finally:
        sock.close()


def test_memory_follows_the_bytes_that_arrive(
        server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    srv, got = server
    declared = 512 << 20
    tracemalloc.start()
    try:
        sock = _raw(srv)
        sock.sendall(struct.pack("!BQ", 1, declared) + bytes(100 << 10))
        assert _wait(lambda: srv._buffered == declared)
        time.sleep(0.2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    sock.close()
    assert peak < 64 << 20, f"{peak >> 20} MiB for a {declared >> 20} MiB claim"
    assert _wait(lambda: srv._buffered == 0) and got.empty()


def test_a_trickled_message_is_cut_off() -> None:
    srv = RpcInterface()
    assert srv.initialize_server("127.0.0.1:0", timeout_seconds=1)
    assert srv.start_server_async()
    try:
        sock = _raw(srv)
        # 1 MiB would be due in 1 s + 16 s, but each byte is due in its turn: a trickle
        # falls behind 64 KiB/s after the first second
        sock.sendall(struct.pack("!BQ", 1, 1 << 20))
        took = _closed_by_server(sock, bytes(64), within=4.5)
        sock.close()
        assert took > 0.5
        sock = _raw(srv, prove=False)  # and the handshake has one deadline, too
        recv_all(sock, 16)
        took = _closed_by_server(sock, bytes(32), within=4.5)
        sock.close()
        assert took > 0.5
    finally:
        srv.close()


def test_messages_in_flight_share_a_byte_budget(
        server: tuple[RpcInterface, queue.Queue[dict[str, Any]]]) -> None:
    srv, got = server
    srv.max_message = srv.max_buffered = 1 << 20
    client = create_rpc_client()
    target = f"127.0.0.1:{srv.port}"
    payload = random.Random(3).randbytes(1 << 20)
    sock = _raw(srv)
    try:
        sock.sendall(struct.pack("!BQ", 1, len(payload)) + payload[:1000])
        assert _wait(lambda: srv._buffered == len(payload))
        assert client.send_data(target, payload) == -1
        assert client.send_data(target, b"small") == -1
        sock.sendall(payload[1000:])
        assert struct.unpack("!i", recv_all(sock, 4))[0] == 0
        assert got.get(timeout=5)["data"] == payload
        assert _wait(lambda: srv._buffered == 0)
        assert client.send_data(target, payload) == 0
        assert got.get(timeout=5)["data"] == payload
    finally:
        sock.close()
        client.close()


def test_strangers_cannot_lock_out_signed_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_CONTROL_SECRET", SECRET)
    srv = RpcInterface()
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    srv.set_data_receive_callback(got.put)
    assert srv.initialize_server("127.0.0.1:0") and srv.start_server_async()
    srv.max_unauthenticated = 4
    client = create_rpc_client()
    flood = [_raw(srv, prove=False) for _ in range(40)]  # never answer the challenge
    try:
        assert _wait(lambda: len(srv._conns) <= 4 + 1)
        start = time.monotonic()
        assert client.send_data(f"127.0.0.1:{srv.port}", b"signed") == 0
        assert time.monotonic() - start < 3
        assert got.get(timeout=5)["data"] == b"signed"
        assert len(srv._pending) <= 4
    finally:
        for sock in flood:
            sock.close()
        client.close()
        srv.close()


def test_idle_connections_close_and_clients_reconnect(
        server: tuple[RpcInterface, queue.Queue[dict[str, Any]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    srv, got = server
    srv.idle_timeout = 0.3
    client = create_rpc_client()
    target = f"127.0.0.1:{srv.port}"
    try:
        for word in (b"one", b"two"):  # the stale pooled connection is seen and dropped
            assert client.send_data(target, word) == 0
            assert got.get(timeout=5)["data"] == word
            assert _wait(lambda: not srv._authed)

        class Blind:  # the server closes just as the client picks the connection up
            def register(self, *args: Any) -> None:
                pass

            def poll(self, *args: Any) -> list[Any]:
                return []

        monkeypatch.setattr(mc_rpc, "select", SimpleNamespace(poll=Blind, POLLIN=1))
        assert _wait(lambda: client._pool.get(target) is not None)
        assert client.send_data(target, b"three") == 0  # retried on a new connection
        assert got.get(timeout=5)["data"] == b"three"
        assert len(client._pool[target]) == 1
    finally:
        client.close()

"""``RpcInterface`` / ``CoroRPCInterface``: Mooncake's message API between processes,
over real loopback sockets, with its return values, the project's exposure rules and
authentication by the control secret."""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
from collections.abc import Iterator
from typing import Any

import pytest

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

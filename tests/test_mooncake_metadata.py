"""The HTTP metadata mode: our server speaks Mooncake's protocol (and is authenticated
like every other port), engines find each other by name through it (ours, or
Mooncake's own ``mooncake_http_metadata_server`` where installed), and lookups fail
with Mooncake's values at once."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator

import numpy as np
import pytest

from bench.fleet import free_port
from transfer_engine.connectors.mooncake import TransferEngine
from transfer_engine.connectors.mooncake import engine as mc_engine
from transfer_engine.connectors.mooncake import metadata as mc_metadata
from transfer_engine.connectors.mooncake.metadata import (
    SIGNATURE_HEADER,
    HttpDirectory,
    Location,
    MetadataServer,
    sign_request,
)
from transfer_engine.control.auth import AuthConfig

SECRET = "a-test-secret-of-32-bytes-length"


@pytest.fixture(autouse=True)
def quiet_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger=mc_engine.__name__)
    caplog.set_level(logging.CRITICAL, logger=mc_metadata.__name__)


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    with MetadataServer("127.0.0.1", 0) as srv:
        yield srv


def _http(url: str, method: str, key: str, body: bytes = b"",
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        query = f"?key={urllib.parse.quote(key, safe='')}" if key else ""
        conn.request(method, parts.path + query, body=body or None, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_server_speaks_mooncakes_protocol(server: MetadataServer) -> None:
    url = server.url
    assert url.endswith("/metadata")
    assert _http(url, "GET", "mooncake/ram/a") == (404, b"metadata not found")
    assert _http(url, "PUT", "mooncake/ram/a", b'{"x":1}')[0] == 200
    assert _http(url, "PUT", "mooncake/ram/a", b'{"x":2}')[0] == 200  # ram: overwritten
    assert _http(url, "GET", "mooncake/ram/a") == (200, b'{"x":2}')
    assert _http(url, "PUT", "mooncake/rpc_meta/a", b"{}")[0] == 200
    assert _http(url, "PUT", "mooncake/rpc_meta/a", b"{}")[0] == 400  # no duplicates
    assert _http(url, "DELETE", "mooncake/rpc_meta/a")[0] == 200
    assert _http(url, "DELETE", "mooncake/rpc_meta/a")[0] == 404
    assert _http(url, "GET", "")[0] == 400  # a key is required
    assert _http(url, "POST", "k")[0] == 405
    assert _http(url.replace("/metadata", "/other"), "GET", "k")[0] == 404
    assert server.keys() == ["mooncake/ram/a"] and "SERVING" in repr(server)


def test_server_bounds() -> None:
    with MetadataServer("127.0.0.1", 0, max_keys=2, max_value=8) as srv:
        assert _http(srv.url, "PUT", "k", b"123456789")[0] == 413
        assert _http(srv.url, "PUT", "k1", b"1")[0] == 200
        assert _http(srv.url, "PUT", "k2", b"1")[0] == 200
        assert _http(srv.url, "PUT", "k3", b"1")[0] == 507
        assert _http(srv.url, "PUT", "k1", b"2")[0] == 200  # replacing still works


def test_server_stores_only_whole_bodies_under_exact_keys(server: MetadataServer) -> None:
    """A body cut short (the client went away), a chunked body (no length) and keys
    that are not UTF-8 are refused; keys differing in bytes or spaces stay distinct."""
    parts = urllib.parse.urlsplit(server.url)

    def raw(request: bytes) -> bytes:
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            return s.recv(4096)

    head = f"PUT {parts.path}?key=half HTTP/1.1\r\nHost: x\r\n".encode()
    assert raw(head + b"Content-Length: 100\r\n\r\n" + b"A" * 40).startswith(
        b"HTTP/1.1 400")
    assert raw(head.replace(b"half", b"chunked") + b"Transfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n0\r\n\r\n").startswith(b"HTTP/1.1 411")
    assert raw(f"PUT {parts.path}?key=%FF HTTP/1.1\r\nHost: x\r\nContent-Length: 1"
               "\r\n\r\nx".encode()).startswith(b"HTTP/1.1 400")
    assert _http(server.url, "PUT", " spaced", b"1")[0] == 200
    assert _http(server.url, "GET", "spaced")[0] == 404
    assert _http(server.url, "GET", " spaced") == (200, b"1")
    assert server.keys() == [" spaced"]


def test_server_binds_loopback_without_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TE_CONTROL_SECRET", raising=False)
    monkeypatch.delenv("TE_ALLOW_INSECURE", raising=False)
    with MetadataServer("0.0.0.0", 0) as srv:  # Mooncake's default host
        assert srv.host == "127.0.0.1"
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("no non-loopback address on this host")
    with pytest.raises(ValueError, match="without a control secret"):
        MetadataServer(addr, 0)


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_server_with_a_secret_answers_signed_requests_only() -> None:
    signer = AuthConfig(secret=SECRET).signer()
    other = AuthConfig(secret="another-secret-of-enough-length!").signer()
    assert signer is not None and other is not None
    with MetadataServer("127.0.0.1", 0, auth=SECRET) as srv:
        key = "mooncake/ram/a"
        assert _http(srv.url, "PUT", key, b"v")[0] == 401  # unsigned
        head = {SIGNATURE_HEADER: sign_request(other, "PUT", key, b"v")}
        assert _http(srv.url, "PUT", key, b"v", head)[0] == 401  # another secret
        head = {SIGNATURE_HEADER: sign_request(signer, "PUT", key, b"v")}
        assert _http(srv.url, "PUT", key, b"changed", head)[0] == 401  # another body
        assert _http(srv.url, "PUT", key, b"v", head)[0] == 200
        assert _http(srv.url, "PUT", key, b"v", head)[0] == 401  # replayed
        assert _http(srv.url, "GET", key, headers={SIGNATURE_HEADER: "bm90IGEgc2ln"}
                     )[0] == 401
        client = HttpDirectory(srv.url, signer)
        assert client.get(key) == b"v"
        client.publish("peer", Location("127.0.0.1", 5))
        assert client.lookup("peer") == Location("127.0.0.1", 5)


def test_engines_find_each_other_by_name(server: MetadataServer) -> None:
    url = server.url
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("prefill-0", url, "tcp", "") == 0
        assert b.initialize("127.0.0.1:12346", url, "tcp", "") == 0
        rpc = json.loads(_http(url, "GET", "mooncake/rpc_meta/prefill-0")[1])
        assert rpc == {"ip_or_host_name": "127.0.0.1", "rpc_port": a.get_rpc_port()}
        # a second engine may not take a live engine's name
        late = TransferEngine()
        assert late.initialize("prefill-0", url, "tcp", "") == -1
        assert json.loads(_http(url, "GET", "mooncake/rpc_meta/prefill-0")[1]) == rpc
        target = np.zeros(64 * 1024, dtype=np.uint8)
        assert b.register_memory(target.ctypes.data, target.nbytes) == 0
        ram = json.loads(_http(url, "GET", "mooncake/ram/127.0.0.1:12346")[1])
        assert ram["buffers"] == [{"name": "127.0.0.1:12346", "addr": target.ctypes.data,
                                   "length": target.nbytes}]
        assert a.get_first_buffer_address("127.0.0.1:12346") == target.ctypes.data
        src = np.full(1024, 5, dtype=np.uint8)
        assert a.transfer_sync_write("127.0.0.1:12346", src.ctypes.data,
                                     target.ctypes.data, src.nbytes) == 0
        assert (target[:1024] == 5).all()
        assert a.send_probe("127.0.0.1:12346") == 0
        # names the server does not know fail at once, with Mooncake's values
        for call, args, failure in (
                (a.send_probe, (), -200),
                (a.transfer_sync_write, (src.ctypes.data, 0, 16), -1),
                (a.transfer_submit_write, (src.ctypes.data, 0, 16), 0),
                (a.batch_transfer_async_write, ([0], [0], [16]), 0),
                (a.get_first_buffer_address, (), 0)):
            started = time.monotonic()
            assert call("unreachable_peer:9", *args) == failure, call.__name__
            assert time.monotonic() - started < 2  # not the 10 s timeout
    finally:
        a.close()
        b.close()
    assert server.keys() == []  # closing withdraws every key


def test_a_dead_engines_name_is_taken_over(server: MetadataServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nobody listens there once closed
    client = HttpDirectory(server.url)
    client.publish("decode-0", Location("127.0.0.1", dead_port))
    engine = TransferEngine()
    try:
        assert engine.initialize("decode-0", server.url, "tcp", "") == 0
        assert client.lookup("decode-0").port == engine.get_rpc_port()
    finally:
        engine.close()


def test_engines_authenticate_to_the_metadata_server(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    with MetadataServer("127.0.0.1", 0, auth=SECRET) as srv:
        engine = TransferEngine()
        assert engine.initialize("x", srv.url, "tcp", "") == -1  # no secret here
        monkeypatch.setenv("TE_CONTROL_SECRET", SECRET)
        a, b = TransferEngine(), TransferEngine()
        try:
            assert a.initialize("a", srv.url, "tcp", "") == 0
            assert b.initialize("b", srv.url, "tcp", "") == 0
            buf = b.allocate_managed_buffer(4096)
            assert a.get_first_buffer_address("b") == buf
        finally:
            a.close()
            b.close()
        assert srv.keys() == []


def test_metadata_server_command_starts_and_stops() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "transfer_engine.connectors.mooncake", "metadata-server",
         "--port", str(port), "--host", "0.0.0.0"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{port}/metadata"
        lines = [proc.stdout.readline() for _ in range(2)]  # a warning, then the url
        assert any(f"metadata server at {url}" in line for line in lines), lines
        assert any("serving 127.0.0.1 instead of '0.0.0.0'" in line for line in lines)
        assert _http(url, "PUT", "k", b"v")[0] == 200 and _http(url, "GET", "k")[1] == b"v"
    finally:
        proc.terminate()
        code = proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == 0


def _mooncake_server_program() -> str | None:
    return os.environ.get("MOONCAKE_HTTP_METADATA_SERVER") or shutil.which(
        "mooncake_http_metadata_server")


@pytest.mark.skipif(_mooncake_server_program() is None,
                    reason="Mooncake's mooncake_http_metadata_server is not installed "
                           "(set MOONCAKE_HTTP_METADATA_SERVER to its path)")
def test_engines_work_with_mooncakes_own_metadata_server() -> None:
    program = _mooncake_server_program()
    assert program is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([program, "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metadata"
    a, b = TransferEngine(), TransferEngine()
    try:
        deadline = time.monotonic() + 20
        while a.initialize("a", url, "tcp", "") != 0:
            assert time.monotonic() < deadline, "Mooncake's server did not start"
            time.sleep(0.2)
        assert b.initialize("b", url, "tcp", "") == 0
        buf = b.allocate_managed_buffer(4096)
        b.write_bytes_to_buffer(buf, b"mooncake", 8)
        local = a.allocate_managed_buffer(4096)
        assert a.transfer_sync_read("b", local, buf, 8) == 0
        assert a.read_bytes_from_buffer(local, 8) == b"mooncake"
        assert a.send_probe("nobody") == -200
    finally:
        a.close()
        b.close()
        proc.terminate()
        proc.wait(10)


MOONCAKE_PYTHON = os.environ.get("MOONCAKE_PYTHON", "")

MOONCAKE_CLIENTS = """
import sys
import numpy as np
from mooncake.engine import TransferEngine
url = sys.argv[1]
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1:1", url, "tcp", "") == 0
assert b.initialize("127.0.0.1:2", url, "tcp", "") == 0
dst = np.zeros(4096, dtype=np.uint8)
assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
src = np.full(64, 3, dtype=np.uint8)
assert a.transfer_sync_write("127.0.0.1:2", src.ctypes.data, dst.ctypes.data, 64) == 0
assert (dst[:64] == 3).all()
print("probe", a.send_probe("nobody:9"))
"""


@pytest.mark.skipif(not MOONCAKE_PYTHON, reason="set MOONCAKE_PYTHON to a python that "
                    "imports Mooncake's wheel (mooncake-transfer-engine-non-cuda)")
def test_mooncakes_engines_work_with_our_metadata_server(server: MetadataServer) -> None:
    done = subprocess.run([MOONCAKE_PYTHON, "-c", MOONCAKE_CLIENTS, server.url],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "probe -200" in done.stdout
    assert [k for k in server.keys() if "rpc_meta" in k] == []  # withdrawn at exit


# --- etcd and redis -----------------------------------------------------------------

from bench.etcd_server import etcd_server, etcd_skip_reason  # noqa: E402
from tests.helpers.redis_helpers import redis_server, redis_skip_reason  # noqa: E402
from transfer_engine.connectors.mooncake.metadata import (  # noqa: E402
    DirectoryError,
    EtcdDirectory,
    RedisDirectory,
    mooncake_json,
    open_directory,
)


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    reason = redis_skip_reason()
    if reason:
        pytest.skip(reason)
    with redis_server() as url:
        yield url


@pytest.fixture(params=["etcd", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


def _name(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{time.monotonic_ns()}"


def test_store_directories_write_mooncakes_keys_and_bytes(store_url: str) -> None:
    directory = open_directory(store_url, None)
    assert isinstance(directory, EtcdDirectory | RedisDirectory)
    name = _name("d")
    directory.publish(name, Location("127.0.0.1", 4567))
    # byte for byte what Mooncake's plugins write (jsoncpp's FastWriter)
    assert directory.get(f"mooncake/rpc_meta/{name}") == \
        b'{"ip_or_host_name":"127.0.0.1","rpc_port":4567}\n'
    directory.publish_buffers(name, [(4096, 8192)])
    assert json.loads(directory.get(f"mooncake/ram/{name}") or b"") == {
        "name": name, "protocol": "transfer_engine",
        "buffers": [{"name": name, "addr": 4096, "length": 8192}]}
    assert directory.lookup(name) == Location("127.0.0.1", 4567)
    other = open_directory(store_url, None)
    with pytest.raises(DirectoryError) as err:
        other.lookup(_name("absent"))
    assert err.value.code == -200
    directory.withdraw(name)
    assert other.get(f"mooncake/rpc_meta/{name}") is None
    assert other.get(f"mooncake/ram/{name}") is None
    other.close()


def test_store_names_are_kept_by_live_engines_and_taken_from_dead_ones(store_url: str
                                                                      ) -> None:
    name = _name("n")
    first, second = open_directory(store_url, None), open_directory(store_url, None)
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        first.publish(name, Location("127.0.0.1", live.getsockname()[1]))
        with pytest.raises(DirectoryError, match="live engine"):
            second.publish(name, Location("127.0.0.1", 9))
    # nobody listens there now: the name is taken over, and the first's withdraw
    # leaves the new owner's entry alone
    second.publish(name, Location("127.0.0.1", 9))
    first.withdraw(name)
    assert second.lookup(name) == Location("127.0.0.1", 9)
    second.withdraw(name)
    assert second.get(f"mooncake/rpc_meta/{name}") is None
    second.close()


def test_store_keys_carry_the_cluster_id(store_url: str, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "fleet-a")
    directory = open_directory(store_url, None)
    name = _name("c")
    directory.publish(name, Location("127.0.0.1", 5))
    assert directory.get(f"mooncake/fleet-a/rpc_meta/{name}") is not None
    assert directory.get(f"mooncake/rpc_meta/{name}") is None
    directory.withdraw(name)


@pytest.mark.parametrize("size", [1, 3 << 20])
def test_engines_move_bytes_through_a_store(store_url: str, size: int) -> None:
    a, b = TransferEngine(), TransferEngine()
    name_a, name_b = _name("prefill"), _name("decode")
    probe = open_directory(store_url, None)
    try:
        assert a.initialize(name_a, store_url, "tcp", "") == 0
        assert b.initialize(name_b, store_url, "tcp", "") == 0
        assert probe.lookup(name_a) == Location("127.0.0.1", a.get_rpc_port())
        assert TransferEngine().initialize(name_a, store_url, "tcp", "") == -1  # taken
        rng = np.random.default_rng(size)
        src = rng.integers(0, 256, size, dtype=np.uint8)
        remote = np.zeros(size, dtype=np.uint8)
        back = np.zeros(size, dtype=np.uint8)
        for buf, engine in ((src, a), (back, a), (remote, b)):
            assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
        ram = json.loads(probe.get(f"mooncake/ram/{name_b}") or b"")
        assert ram["buffers"] == [{"name": name_b, "addr": remote.ctypes.data,
                                   "length": size}]
        assert a.get_first_buffer_address(name_b) == remote.ctypes.data
        assert a.transfer_sync_write(name_b, src.ctypes.data, remote.ctypes.data,
                                     size) == 0
        assert np.array_equal(remote, src)
        assert a.transfer_sync_read(name_b, back.ctypes.data, remote.ctypes.data,
                                    size) == 0
        assert np.array_equal(back, src)
        started = time.monotonic()
        assert a.send_probe(_name("nobody")) == -200
        assert a.transfer_sync_write(_name("nobody"), src.ctypes.data, 0, 1) == -1
        assert time.monotonic() - started < 2
    finally:
        a.close()
        b.close()
    for name in (name_a, name_b):  # closing removes the keys, as Mooncake's engine
        assert probe.get(f"mooncake/rpc_meta/{name}") is None
        assert probe.get(f"mooncake/ram/{name}") is None
    probe.close()


def test_initialize_takes_mooncakes_spellings_of_a_store(etcd_url: str, redis_url: str
                                                         ) -> None:
    bare_etcd = etcd_url.removeprefix("etcd://")  # Mooncake: a bare host:port is etcd
    for call in (lambda e: e.initialize(_name("x"), bare_etcd, "tcp", ""),
                 lambda e: e.initialize_ext(_name("x"), bare_etcd, "tcp", "", "etcd"),
                 lambda e: e.initialize_ext(_name("x"), redis_url.removeprefix(
                     "redis://"), "tcp", "", "redis"),
                 lambda e: e.initialize(_name("x"), f"etcd://127.0.0.1:{free_port()},"
                                        f"{bare_etcd}", "tcp", "")):  # a dead endpoint
        engine = TransferEngine()
        try:
            assert call(engine) == 0
        finally:
            engine.close()


def test_an_unreachable_store_fails_at_once() -> None:
    for url in (f"etcd://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}",
                f"redis://127.0.0.1:{free_port()}", "redis://127.0.0.1:99999",
                "etcd://https://127.0.0.1:2379", "zookeeper://127.0.0.1:2181"):
        engine = TransferEngine()
        started = time.monotonic()
        assert engine.initialize("x", url, "tcp", "") == -1, url
        assert time.monotonic() - started < 0.5, url
        assert engine.get_rpc_port() == -1


@pytest.mark.skipif(redis_skip_reason() is not None, reason=str(redis_skip_reason()))
def test_redis_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    with redis_server(password="s3cret:/@") as url:
        assert TransferEngine().initialize("x", url, "tcp", "") == -1  # NOAUTH
        quoted = urllib.parse.quote("s3cret:/@", safe="")
        hostport = url.removeprefix("redis://")
        assert TransferEngine().initialize("x", f"redis://:wrong@{hostport}", "tcp",
                                           "") == -1
        for conn, env in ((f"redis://:{quoted}@{hostport}", {}),
                          (f"redis://default:{quoted}@{hostport}/3", {}),
                          (url, {"MC_REDIS_PASSWORD": "s3cret:/@",
                                 "MC_REDIS_DB_INDEX": "2"})):
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            engine = TransferEngine()
            try:
                assert engine.initialize("x", conn, "tcp", "") == 0, conn
            finally:
                engine.close()
        directory = RedisDirectory(f"redis://:{quoted}@{hostport}/2")
        assert directory.get("mooncake/rpc_meta/x") is None  # withdrawn on close
        directory.close()


def test_redis_connection_dropped_by_the_server_is_opened_again(redis_url: str) -> None:
    directory = RedisDirectory(redis_url)
    name = _name("r")
    directory.publish(name, Location("127.0.0.1", 5))
    killer = mc_metadata.RespConnection("127.0.0.1", int(redis_url.rsplit(":", 1)[1]), 3)
    try:
        assert killer.command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") >= 1
    finally:
        killer.close()
    assert directory.lookup(name) == Location("127.0.0.1", 5)  # on a new connection
    directory.withdraw(name)


def test_a_store_that_never_answers_fails_within_its_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        for directory in (RedisDirectory(f"redis://127.0.0.1:{port}", timeout=0.3),
                          EtcdDirectory(f"127.0.0.1:{port}", timeout=0.3)):
            started = time.monotonic()
            with pytest.raises(DirectoryError) as err:
                directory.lookup("x")
            assert err.value.code == -200
            assert time.monotonic() - started < 1.5
            directory.close()


MOONCAKE_ETCD_ENGINE = """
import sys
from mooncake.engine import TransferEngine
engine = TransferEngine()
assert engine.initialize("mooncake-real", sys.argv[1], "tcp", "") == 0
print(engine.get_rpc_port(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not MOONCAKE_PYTHON, reason="set MOONCAKE_PYTHON to a python that "
                    "imports Mooncake's wheel (mooncake-transfer-engine-non-cuda)")
def test_mooncakes_engine_and_ours_share_an_etcd(etcd_url: str) -> None:
    proc = subprocess.Popen([MOONCAKE_PYTHON, "-c", MOONCAKE_ETCD_ENGINE, etcd_url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    ours = TransferEngine()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        directory = EtcdDirectory(etcd_url)
        location = directory.lookup("mooncake-real")  # Mooncake's entry, read by us
        assert directory.get("mooncake/ram/mooncake-real") is not None
        assert location.port == port
        assert directory.get("mooncake/rpc_meta/mooncake-real") == mooncake_json(
            {"ip_or_host_name": location.host, "rpc_port": port})
        assert ours.initialize("ours", etcd_url, "tcp", "") == 0
        assert directory.lookup("ours").port == ours.get_rpc_port()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
        assert directory.get("mooncake/rpc_meta/mooncake-real") is None  # Mooncake's too
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

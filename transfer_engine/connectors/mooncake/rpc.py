"""Mooncake's ``RpcInterface`` (alias ``CoroRPCInterface``): byte messages and tensors
between processes, over our TCP framing.

Protocol, as Mooncake's Python API presents it::

    server = RpcInterface()
    server.initialize_server("0.0.0.0:9004", thread_count=8)   # -> True
    server.set_data_receive_callback(lambda d: ...)   # d = {"source": str, "data": bytes}
    server.start_server_async()                        # -> True once listening
    client = RpcInterface()
    client.initialize_client(pool_size=100)            # -> True
    client.send_data("127.0.0.1:9004", b"...")         # -> 0, or -1

``send_data`` returns once the server has the message (its callback runs after the
reply, so a slow callback does not hold the sender). ``send_tensor`` carries a CPU
tensor's bytes with its shape and dtype; the tensor callback gets a
:class:`ReceivedTensor`.

Wire (ours, not Mooncake's coro_rpc): on connect the server sends a 16-byte challenge;
the client answers with ``HMAC-SHA256(secret, "te-mc-rpc" | challenge)`` (32 zero bytes
without a secret), and the server drops a connection whose answer is wrong. Then each
message is ``kind (u8) | length (u64) | payload`` and is answered by ``status (i32)``.

Security, as every port of the project: without a control secret a wildcard listen
address serves loopback only (with a warning) and any other non-loopback address is
refused (``TE_ALLOW_INSECURE=1`` opts out). Bounded: connections served at once
(``max_connections``), message size (``max_message``), and a stalled connection is
dropped after ``timeout_seconds``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from transfer_engine.control.auth import AuthConfig, check_exposure

from .metadata import split_hostport

__all__ = ["RpcInterface", "CoroRPCInterface", "ReceivedData", "ReceivedTensor",
           "create_rpc_client", "create_rpc_server"]

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!BQ")
_STATUS = struct.Struct("!i")
_TENSOR_HEAD = struct.Struct("!II4q")  # dtype id, ndim, shape (up to 4 dimensions)
_KIND_DATA, _KIND_TENSOR = 1, 2
_CHALLENGE = 16
_PROOF = 32
_DTYPES = {1: "float16", 2: "float32", 3: "float64", 4: "int8", 5: "int16", 6: "int32",
           7: "int64", 8: "uint8", 9: "bool"}
_DTYPE_IDS = {name: i for i, name in _DTYPES.items()}


def _proof(key: bytes, challenge: bytes) -> bytes:
    if not key:
        return bytes(_PROOF)
    return hmac.digest(key, b"te-mc-rpc" + challenge, hashlib.sha256)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return buf


class ReceivedData:
    """Mooncake's ``ReceivedData``: a received message."""

    def __init__(self, source_address: str, data: bytes) -> None:
        self.source_address = source_address
        self._data = data

    @property
    def data_size(self) -> int:
        return len(self._data)

    def get_bytes(self) -> bytes:
        return self._data

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)


class ReceivedTensor:
    """Mooncake's ``ReceivedTensor``: a received tensor's bytes, shape and dtype name."""

    def __init__(self, source_address: str, data: bytes, shape: list[int],
                 dtype: str) -> None:
        self.source_address = source_address
        self.shape = shape
        self.dtype = dtype
        self._data = data

    @property
    def total_bytes(self) -> int:
        return len(self._data)

    def get_data_size(self) -> int:
        return len(self._data)

    def get_data_as_bytes(self) -> bytes:
        return self._data

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)


class RpcInterface:
    """Mooncake's ``RpcInterface``: a server, a client, or both in one object.

    Methods return Mooncake's values: ``initialize*``/``start_server*`` ``True``/
    ``False``, ``send_*`` ``0``/``-1``; failures are logged, never raised (the
    ``*_async`` calls set the exception on their future, as Mooncake's).
    """

    def __init__(self) -> None:
        self._listen = ""
        self._timeout = 30.0
        self._pool_size = 100
        self._max_connections = 256
        self.max_message = 1 << 30  # bytes per message a server accepts
        self._key = b""
        self._initialized = False
        self._lock = threading.Lock()
        self._pool: dict[str, list[socket.socket]] = {}
        self._data_cb: Callable[[dict[str, Any]], Any] | None = None
        self._tensor_cb: Callable[[ReceivedTensor], Any] | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._stopped = threading.Event()

    # --- set-up -----------------------------------------------------------------------

    def initialize(self, listen_address: str = "", thread_count: int = 0,
                   timeout_seconds: int = 30, pool_size: int = 100) -> bool:
        """Configures a client (and a server when ``listen_address`` is given)."""
        try:
            auth = AuthConfig.from_env()
        except (ValueError, OSError) as exc:
            log.warning("RpcInterface: %s", exc)
            return False
        self._key = auth.key if auth.secret is not None else b""
        self._timeout = float(timeout_seconds) if timeout_seconds > 0 else 30.0
        self._pool_size = max(1, int(pool_size))
        if listen_address:
            try:
                host, port = split_hostport(listen_address)
            except ValueError as exc:
                log.warning("RpcInterface: bad listen address %r: %s", listen_address, exc)
                return False
            if host in ("", "0.0.0.0", "::") and not self._key:
                log.warning("RpcInterface: no control secret, serving 127.0.0.1 instead of "
                            "%r (set TE_CONTROL_SECRET to serve the network)", host or "*")
                host = "127.0.0.1"
            try:
                check_exposure(host, bool(self._key), None, what="RpcInterface server")
            except ValueError as exc:
                log.warning("%s", exc)
                return False
            self._listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._initialized = True
        return True

    def initialize_client(self, pool_size: int = 100, timeout_seconds: int = 30) -> bool:
        """A client only; ``pool_size`` connections per target are kept for reuse."""
        return self.initialize("", 0, timeout_seconds, pool_size)

    def initialize_server(self, listen_address: str, thread_count: int = 8,
                          timeout_seconds: int = 30) -> bool:
        """A server on ``listen_address`` (``host:port``); start it with
        :meth:`start_server_async` or :meth:`start_server`."""
        return self.initialize(listen_address, thread_count, timeout_seconds, 100)

    def set_data_receive_callback(self, callback: Callable[[dict[str, Any]], Any]) -> None:
        """``callback({"source": "host:port", "data": bytes})`` for each message."""
        self._data_cb = callback

    def set_tensor_receive_callback(self, callback: Callable[[ReceivedTensor], Any]) -> None:
        """``callback(ReceivedTensor)`` for each tensor."""
        self._tensor_cb = callback

    # --- server -----------------------------------------------------------------------

    def start_server_async(self) -> bool:
        """Starts listening and serving from threads; ``True`` once listening."""
        if not self._listen or self._listener is not None:
            return False
        host, port = split_hostport(self._listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            log.warning("RpcInterface: cannot listen on %s: %s", self._listen, exc)
            return False
        self._listener = sock
        self._stopped.clear()
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"te-mc-rpc-{port}")
        self._accept_thread.start()
        return True

    def start_server(self) -> bool:
        """Serves until :meth:`stop_server` (from another thread)."""
        if not self.start_server_async():
            return False
        self._stopped.wait()
        return True

    @property
    def port(self) -> int:
        """The port the server listens on (0 when it does not)."""
        return int(self._listener.getsockname()[1]) if self._listener is not None else 0

    @property
    def host(self) -> str:
        """The address the server listens on ("" when it does not)."""
        return str(self._listener.getsockname()[0]) if self._listener is not None else ""

    def stop_server(self) -> None:
        """Stops serving, closes every connection and joins the threads. Idempotent."""
        listener, self._listener = self._listener, None
        self._stopped.set()
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(5)
            self._accept_thread = None
        for thread in threads:
            thread.join(5)

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._stopped.is_set():
            try:
                conn, addr = listener.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                log.warning("RpcInterface: %d connections open; refusing %s",
                            self._max_connections, addr)
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                      name="te-mc-rpc-conn")
            with self._lock:
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        source = f"{addr[0]}:{addr[1]}"
        try:
            conn.settimeout(self._timeout)
            challenge = os.urandom(_CHALLENGE)
            conn.sendall(challenge)
            answer = bytes(_recv_exact(conn, _PROOF))
            if not hmac.compare_digest(answer, _proof(self._key, challenge)):
                log.warning("RpcInterface: %s failed to authenticate", source)
                return
            while not self._stopped.is_set():
                conn.settimeout(None)  # an idle connection may stay
                head = _recv_exact(conn, 1)
                conn.settimeout(self._timeout)
                kind, length = _FRAME.unpack(bytes(head + _recv_exact(conn, _FRAME.size - 1)))
                if kind not in (_KIND_DATA, _KIND_TENSOR) or length > self.max_message:
                    log.warning("RpcInterface: %s sent a bad frame (kind %d, %d bytes)",
                                source, kind, length)
                    conn.sendall(_STATUS.pack(-1))
                    return
                payload = bytes(_recv_exact(conn, length))
                conn.sendall(_STATUS.pack(0))
                self._deliver(source, kind, payload)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _deliver(self, source: str, kind: int, payload: bytes) -> None:
        try:
            if kind == _KIND_DATA:
                if self._data_cb is not None:
                    self._data_cb({"source": source, "data": payload})
            elif self._tensor_cb is not None:
                dtype, ndim, *shape = _TENSOR_HEAD.unpack_from(payload)
                self._tensor_cb(ReceivedTensor(source, payload[_TENSOR_HEAD.size:],
                                               list(shape[:ndim]),
                                               _DTYPES.get(dtype, "unknown")))
        except Exception:
            log.exception("RpcInterface: receive callback failed")

    # --- client -----------------------------------------------------------------------

    def _connect(self, target: str) -> socket.socket:
        host, port = split_hostport(target)
        sock = socket.create_connection((host, port), timeout=self._timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = bytes(_recv_exact(sock, _CHALLENGE))
            sock.sendall(_proof(self._key, challenge))
        except BaseException:
            sock.close()
            raise
        return sock

    def _send(self, target: str, kind: int, parts: list[bytes | memoryview]) -> int:
        if not self._initialized:
            log.warning("RpcInterface: send before initialize")
            return -1
        length = sum(len(p) for p in parts)
        with self._lock:
            idle = self._pool.get(target)
            sock = idle.pop() if idle else None
        for attempt in (0, 1):  # a pooled connection may have been closed meanwhile
            try:
                if sock is None:
                    sock = self._connect(target)
                sock.sendall(_FRAME.pack(kind, length))
                for part in parts:
                    sock.sendall(part)
                (status,) = _STATUS.unpack(bytes(_recv_exact(sock, _STATUS.size)))
            except (OSError, ConnectionError, ValueError) as exc:
                if sock is not None:
                    sock.close()
                    sock = None
                if attempt == 0 and not isinstance(exc, ValueError):
                    continue
                log.warning("RpcInterface: send to %s failed: %s", target, exc)
                return -1
            with self._lock:
                idle = self._pool.setdefault(target, [])
                if len(idle) < self._pool_size:
                    idle.append(sock)
                    sock = None
            if sock is not None:
                sock.close()
            return 0 if status >= 0 else -1
        return -1

    def send_data(self, target_address: str, data: bytes | bytearray | memoryview) -> int:
        """Sends ``data`` to the server at ``target_address``; 0 once it has it, -1."""
        return self._send(target_address, _KIND_DATA, [memoryview(data).cast("B")])

    def send_tensor(self, target_address: str, tensor: Any) -> int:
        """Sends a CPU tensor (torch, or anything with ``data_ptr``, ``numel``,
        ``element_size``, ``shape``, ``dtype``) of at most 4 dimensions; 0 or -1."""
        try:
            import ctypes
            shape = [int(d) for d in tensor.shape]
            nbytes = int(tensor.numel()) * int(tensor.element_size())
            dtype = str(tensor.dtype).rsplit(".", 1)[-1]
            if len(shape) > 4 or getattr(tensor, "is_cuda", False):
                raise ValueError("only CPU tensors of up to 4 dimensions")
            data = ctypes.string_at(int(tensor.data_ptr()), nbytes) if nbytes else b""
        except (AttributeError, TypeError, ValueError) as exc:
            log.warning("RpcInterface: send_tensor: not a tensor: %s", exc)
            return -1
        head = _TENSOR_HEAD.pack(_DTYPE_IDS.get(dtype, 0), len(shape),
                                 *(shape + [0] * (4 - len(shape))))
        return self._send(target_address, _KIND_TENSOR, [head, data])

    def send_data_async(self, target_address: str, data: bytes, loop: Any) -> Any:
        """An ``asyncio`` future on ``loop`` that resolves to 0 (or raises
        ``RuntimeError``) once the server has ``data``."""
        return self._in_thread(loop, self.send_data, target_address, bytes(data),
                               "Send data failed")

    def send_tensor_async(self, target_address: str, tensor: Any, loop: Any) -> Any:
        """:meth:`send_tensor` as an ``asyncio`` future on ``loop``."""
        return self._in_thread(loop, self.send_tensor, target_address, tensor,
                               "Send tensor failed")

    @staticmethod
    def _in_thread(loop: Any, fn: Callable[[str, Any], int], target: str, what: Any,
                   failure: str) -> Any:
        future = loop.create_future()

        def settle(code: int) -> None:
            if not future.done():
                if code >= 0:
                    future.set_result(code)
                else:
                    future.set_exception(RuntimeError(failure))

        def run() -> None:
            loop.call_soon_threadsafe(settle, fn(target, what))

        threading.Thread(target=run, daemon=True, name="te-mc-rpc-send").start()
        return future

    def close(self) -> None:
        """Stops the server and closes pooled connections. Idempotent."""
        self.stop_server()
        with self._lock:
            pooled = [s for conns in self._pool.values() for s in conns]
            self._pool.clear()
        for sock in pooled:
            sock.close()

    def __enter__(self) -> RpcInterface:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = f"server {self._listen}" if self._listen else "client"
        return f"<RpcInterface {role} pooled={sum(map(len, self._pool.values()))}>"


CoroRPCInterface = RpcInterface


def create_rpc_client(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """A client with Mooncake's defaults."""
    client = RpcInterface()
    client.initialize("", 0, 30, 10)
    return client


def create_rpc_server(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """A server on ``0.0.0.0:8080`` (loopback without a secret), not yet started."""
    server = RpcInterface()
    server.initialize("0.0.0.0:8080", 0, 30, 10)
    return server

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
tensor's contents, shape and dtype (-1 for a dtype without a wire id); the tensor
callback gets a :class:`ReceivedTensor`.

Wire (ours, not Mooncake's coro_rpc): on connect the server sends a 16-byte challenge;
the client answers with ``HMAC-SHA256(secret, "te-mc-rpc" | challenge)`` (32 zero bytes
without a secret), and the server drops a connection whose answer is wrong. Then each
message is ``kind (u8) | length (u64) | payload`` and is answered by ``status (i32)``;
a tensor's payload starts with ``dtype id (u32) | ndim (u32) | 4 x dim (i64)``, checked
against its byte count before the server answers.

Security, as every port of the project: without a control secret a wildcard listen
address serves loopback only (with a warning) and any other non-loopback address is
refused (``TE_ALLOW_INSECURE=1`` opts out). Bounded (server attributes): handshakes
under way (``max_unauthenticated``, the oldest goes for a newcomer: strangers cannot
lock signed clients out), authenticated connections (256) and idle time
(``idle_timeout``), a message's size (``max_message``) and time (``timeout_seconds`` +
size at 64 KiB/s), bytes of all messages in flight (``max_buffered``, held as they come).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from transfer_engine.control.auth import AuthConfig, check_exposure
from transfer_engine.transport.iovec import MIN_PAYLOAD_RATE

from .metadata import split_hostport

__all__ = ["RpcInterface", "CoroRPCInterface", "ReceivedData", "ReceivedTensor",
           "create_rpc_client", "create_rpc_server"]

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!BQ")
_STATUS = struct.Struct("!i")
_MAX_DIMS = 4
_TENSOR_HEAD = struct.Struct(f"!II{_MAX_DIMS}q")  # dtype id, ndim, shape
_KIND_DATA, _KIND_TENSOR = 1, 2
_CHALLENGE = 16
_PROOF = 32
_HANDSHAKE_SECONDS = 10.0  # challenge to proof, at most (a signed client takes an RTT)
_CHUNK = 1 << 20  # a payload's buffer grows by this much, as its bytes arrive
# Wire id -> (torch dtype name, bytes per element). Ids are the wire format: never
# renumber, only append.
_DTYPES = {1: ("float16", 2), 2: ("float32", 4), 3: ("float64", 8), 4: ("int8", 1),
           5: ("int16", 2), 6: ("int32", 4), 7: ("int64", 8), 8: ("uint8", 1),
           9: ("bool", 1), 10: ("bfloat16", 2), 11: ("uint16", 2), 12: ("uint32", 4),
           13: ("uint64", 8), 14: ("float8_e4m3fn", 1), 15: ("float8_e5m2", 1),
           16: ("complex64", 8), 17: ("complex128", 16)}
_DTYPE_IDS = {name: i for i, (name, _) in _DTYPES.items()}


def _proof(key: bytes, challenge: bytes) -> bytes:
    if not key:
        return bytes(_PROOF)
    return hmac.digest(key, b"te-mc-rpc" + challenge, hashlib.sha256)


def _fill(sock: socket.socket, view: memoryview, due: float | Callable[[int], float],
          skip: int = 0) -> None:
    """Fills ``view``, byte k by ``due(skip + k)`` (or all by ``due``): a per-receive
    timeout would let a trickle hold on."""
    got, n = 0, len(view)
    while got < n:
        left = (due(skip + got + 1) if callable(due) else due) - time.monotonic()
        if left <= 0:
            raise TimeoutError("peer too slow")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    _fill(sock, memoryview(buf), deadline)
    return buf


def _recv_growing(sock: socket.socket, n: int, due: Callable[[int], float],
                  skip: int) -> bytearray:
    """``n`` bytes as :func:`_fill`, in a buffer grown a chunk at a time: a declared
    length costs memory only as its bytes arrive, and a trickle is cut off."""
    buf = bytearray()
    while len(buf) < n:
        start = len(buf)
        buf.extend(bytes(min(_CHUNK, n - start)))
        _fill(sock, memoryview(buf)[start:], due, skip + start)  # view freed before extend
    return buf


def _drain(sock: socket.socket, n: int, due: Callable[[int], float], skip: int) -> None:
    """Reads and drops ``n`` bytes, so a refused message leaves the stream in step."""
    done = 0
    while done < n:
        done += len(_recv_growing(sock, min(_CHUNK, n - done), due, skip + done))


def _tensor_meta(head: bytes | bytearray, nbytes: int) -> tuple[list[int], str]:
    """A tensor header's shape and dtype name; ``ValueError`` unless exactly ``nbytes``."""
    dtype_id, ndim, *dims = _TENSOR_HEAD.unpack(head)
    shape = dims[:ndim]
    if dtype_id not in _DTYPES or ndim > _MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"dtype id {dtype_id}, {ndim} dimensions {shape}")
    name, itemsize = _DTYPES[dtype_id]
    if math.prod(shape) * itemsize != nbytes:  # Python ints: no overflow
        raise ValueError(f"shape {shape} of {name} is not {nbytes} bytes")
    return shape, name


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class ReceivedData:
    """Mooncake's ``ReceivedData``: a received message."""

    def __init__(self, source_address: str, data: bytes | bytearray) -> None:
        self.source_address = source_address
        self._data = data

    @property
    def data_size(self) -> int:
        return len(self._data)

    def get_bytes(self) -> bytes:
        return bytes(self._data)

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)


class ReceivedTensor(ReceivedData):
    """Mooncake's ``ReceivedTensor``: a received tensor's bytes, shape and dtype name.
    :meth:`get_memory_view` is the receive buffer itself (writable, not copied)."""

    def __init__(self, source_address: str, data: bytes | bytearray, shape: list[int],
                 dtype: str) -> None:
        super().__init__(source_address, data)
        self.shape = shape
        self.dtype = dtype

    total_bytes = ReceivedData.data_size
    get_data_as_bytes = ReceivedData.get_bytes

    def get_data_size(self) -> int:
        return len(self._data)


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
        self._max_connections = 256  # authenticated connections served at once
        self.max_unauthenticated = 32  # connections in their handshake; oldest dropped
        self.idle_timeout = 300.0  # seconds an authenticated connection may idle
        self.max_message = 1 << 30  # bytes per message a server accepts
        self.max_buffered = 2 << 30  # bytes of messages all connections receive at once
        self._key = b""
        self._initialized = False
        self._lock = threading.Lock()
        self._pool: dict[str, list[socket.socket]] = {}
        self._data_cb: Callable[[dict[str, Any]], Any] | None = None
        self._tensor_cb: Callable[[ReceivedTensor], Any] | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()  # every connection, for stop_server
        self._pending: dict[socket.socket, None] = {}  # in their handshake, oldest first
        self._authed: set[socket.socket] = set()
        self._buffered = 0  # bytes reserved by messages being received or delivered
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
            _shutdown(listener)
            listener.close()
        with self._lock:  # under the lock: a serving thread closes its socket after it
            threads = list(self._threads)
            for conn in self._conns:
                _shutdown(conn)
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
                if len(self._pending) >= max(1, self.max_unauthenticated):
                    # The oldest goes, not the newcomer: a signed client answers at once.
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    _shutdown(oldest)
                self._pending[conn] = None
                self._conns.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn, addr),
                                          daemon=True, name="te-mc-rpc-conn")
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        source = f"{addr[0]}:{addr[1]}"
        try:
            if self._handshake(conn, source):
                while not self._stopped.is_set() and self._serve_message(conn, source):
                    pass
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            with self._lock:  # before close: the accept loop may shut it down meanwhile
                self._pending.pop(conn, None)
                self._authed.discard(conn)
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _handshake(self, conn: socket.socket, source: str) -> bool:
        """Challenge to proof within one deadline, then a place among authenticated."""
        deadline = time.monotonic() + min(self._timeout, _HANDSHAKE_SECONDS)
        conn.sendall(challenge := os.urandom(_CHALLENGE))  # 16 bytes to an empty buffer
        answer = bytes(_recv_exact(conn, _PROOF, deadline))
        if not hmac.compare_digest(answer, _proof(self._key, challenge)):
            log.warning("RpcInterface: %s failed to authenticate", source)
            return False
        with self._lock:
            if conn not in self._pending:  # dropped for a newcomer meanwhile
                return False
            del self._pending[conn]
            if len(self._authed) < self._max_connections:
                self._authed.add(conn)
                return True
        log.warning("RpcInterface: %d connections open; refusing %s",
                    self._max_connections, source)
        return False

    def _serve_message(self, conn: socket.socket, source: str) -> bool:
        """Receives, answers and delivers one message; ``False`` to close."""
        head = bytearray(_FRAME.size)
        conn.settimeout(self.idle_timeout if self.idle_timeout > 0 else None)
        if conn.recv_into(head, 1) == 0:  # idle too long raises: the client reconnects
            return False
        start = time.monotonic()
        _fill(conn, memoryview(head)[1:], start + self._timeout)
        kind, length = _FRAME.unpack(head)
        if kind not in (_KIND_DATA, _KIND_TENSOR) or length > self.max_message:
            log.warning("RpcInterface: %s sent a bad frame (kind %d, %d bytes)",
                        source, kind, length)
            return self._reply(conn, -1, keep=False)
        skip = 0  # a tensor's header, before its body

        def due(k: int) -> float:  # payload byte k: timeout + k at the minimum rate
            return start + self._timeout + k / MIN_PAYLOAD_RATE

        meta: tuple[list[int], str] | None = None
        if kind == _KIND_TENSOR:
            try:
                if length < _TENSOR_HEAD.size:
                    raise ValueError(f"{length} bytes, short of a tensor header")
                skip = _TENSOR_HEAD.size
                meta = _tensor_meta(_recv_exact(conn, skip, due(skip)), length - skip)
            except ValueError as exc:  # answered only once the stream is in step again
                log.warning("RpcInterface: %s sent a bad tensor: %s", source, exc)
                _drain(conn, length - skip, due, skip)
                return self._reply(conn, -1)
        body = length - skip
        with self._lock:
            fits = self._buffered + body <= max(self.max_buffered, self.max_message)
            self._buffered += body if fits else 0
        if not fits:
            log.warning("RpcInterface: %d bytes being received; refusing %d more from %s",
                        self._buffered, body, source)
            return self._reply(conn, -1, keep=False)
        try:
            payload = _recv_growing(conn, body, due, skip)
            self._reply(conn, 0)
            self._deliver(source, payload, meta)
        finally:
            with self._lock:
                self._buffered -= body
        return True

    def _reply(self, conn: socket.socket, status: int, keep: bool = True) -> bool:
        """Answers a message; ``keep``: whether the connection serves the next one."""
        conn.settimeout(self._timeout)
        conn.sendall(_STATUS.pack(status))
        return keep

    def _deliver(self, source: str, payload: bytearray,
                 meta: tuple[list[int], str] | None) -> None:
        try:
            if meta is None:
                if self._data_cb is not None:
                    self._data_cb({"source": source, "data": bytes(payload)})
            elif self._tensor_cb is not None:
                self._tensor_cb(ReceivedTensor(source, payload, meta[0], meta[1]))
        except Exception:
            log.exception("RpcInterface: receive callback failed")

    # --- client -----------------------------------------------------------------------

    def _connect(self, target: str) -> socket.socket:
        host, port = split_hostport(target)
        sock = socket.create_connection((host, port), timeout=self._timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = bytes(_recv_exact(sock, _CHALLENGE, time.monotonic() + self._timeout))
            sock.sendall(_proof(self._key, challenge))
        except BaseException:
            sock.close()
            raise
        return sock

    def _pooled(self, target: str) -> socket.socket | None:
        """A pooled connection to ``target`` the server has not closed (idle: none readable)."""
        while True:
            with self._lock:
                idle = self._pool.get(target)
                sock = idle.pop() if idle else None
            if sock is None:
                return None
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            if not poller.poll(0):
                return sock
            sock.close()

    def _send(self, target: str, kind: int, parts: list[bytes | memoryview]) -> int:
        if not self._initialized:
            log.warning("RpcInterface: send before initialize")
            return -1
        length = sum(len(p) for p in parts)
        sock = self._pooled(target)
        pooled = sock is not None
        while True:
            try:
                sock = sock or self._connect(target)
                sock.settimeout(self._timeout)  # _recv_exact leaves what its deadline left
                sock.sendall(_FRAME.pack(kind, length))
                for part in parts:
                    sock.sendall(part)
                reply = _recv_exact(sock, _STATUS.size, time.monotonic() + self._timeout)
                (status,) = _STATUS.unpack(reply)
            except (OSError, ConnectionError, ValueError) as exc:
                if sock is not None:
                    sock.close()
                    sock = None
                # A pooled connection the server closed meanwhile (idle, restarted) is
                # retried once on a new one; a timeout is not: the server may have it.
                if pooled and not isinstance(exc, (ValueError, TimeoutError)):
                    pooled = False
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

    def send_data(self, target_address: str, data: bytes | bytearray | memoryview) -> int:
        """Sends ``data`` to the server at ``target_address``; 0 once it has it, -1."""
        return self._send(target_address, _KIND_DATA, [memoryview(data).cast("B")])

    def send_tensor(self, target_address: str, tensor: Any) -> int:
        """Sends a CPU tensor (torch, or anything with ``data_ptr``, ``numel``,
        ``element_size``, ``shape``, ``dtype``, ``contiguous``) of at most 4 dimensions
        and a dtype the wire names; 0 or -1. A strided view is sent as its contents."""
        try:
            import ctypes
            where = (getattr(getattr(tensor, "device", None), "type", "cpu"),
                     str(getattr(tensor, "layout", "torch.strided")))
            if getattr(tensor, "is_cuda", False) or where != ("cpu", "torch.strided"):
                raise ValueError(f"only CPU strided tensors, not {where}")
            for lazy in ("resolve_conj", "resolve_neg"):  # a view whose flag, not its
                if hasattr(tensor, lazy):  # bytes, says it is conjugated or negated
                    tensor = getattr(tensor, lazy)()
            tensor = tensor.contiguous()  # itself when already contiguous: no copy
            shape = [int(d) for d in tensor.shape]
            dtype, itemsize = str(tensor.dtype).rsplit(".", 1)[-1], int(tensor.element_size())
            if (dtype, itemsize) not in _DTYPES.values() or len(shape) > _MAX_DIMS:
                raise ValueError(f"{dtype} ({itemsize} bytes) in {len(shape)} dimensions: "
                                 f"no wire id, or over {_MAX_DIMS} dimensions")
            nbytes = int(tensor.numel()) * itemsize
            # A view of the tensor's memory, sent while ``tensor`` is alive (this frame).
            data = memoryview((ctypes.c_ubyte * nbytes).from_address(
                int(tensor.data_ptr()))).cast("B") if nbytes else memoryview(b"")
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            log.warning("RpcInterface: send_tensor: cannot send %s: %s",
                        type(tensor).__name__, exc)
            return -1
        head = _TENSOR_HEAD.pack(_DTYPE_IDS[dtype], len(shape),
                                 *(shape + [0] * (_MAX_DIMS - len(shape))))
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

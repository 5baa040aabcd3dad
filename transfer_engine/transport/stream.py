"""What the stream transports (tcp, shm) share: framing, rails and the target's server.

One rail is one stream connection. The initiator's rail has a sender thread (posting
never blocks the caller on the network) and a reader thread that takes the target's
answers in order. The target runs one thread per connection that validates each
request against its segment table *before* touching memory, moves the bytes, counts
the immediate after the bytes, and answers.

Wire format (little-endian; one request, one answer, in order on each connection):

    request  = header(32) remote[n_remote](20 each) local[n_local](16 each)
               body[body_len] payload
    header   = kind u8, flags u8, n_remote u16, n_local u16, pad u16, body_len u32,
               wr_id u64, transfer_id u64, expected u32
    remote   = segment u32, offset u64, length u64        (target memory)
    local    = address u64, length u64                    (initiator memory, shm only)
    body     = HELLO: msgpack {name, version, pid}; WRITE with immediate: notify bytes
    payload  = the bytes (tcp WRITE only)
    answer   = kind u8 (0x81), status u8 (0 ok, else an error code), pad u16,
               body_len u32, wr_id u64; body = msgpack error details; then, for a tcp
               READ that succeeded, the bytes.

Subclasses say only how the payload moves (:meth:`_Server.land` / :meth:`_Server.serve`
on the target, :meth:`StreamRail._request_parts` / :meth:`StreamRail._take_read` on the
initiator).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import numpy as np

from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    TransferError,
    error_code,
    error_from_wire,
)
from transfer_engine.transport.base import Completion, Host, Immediate, OnComplete, Rail, Work

log = logging.getLogger(__name__)

WIRE_VERSION = 1
KIND_HELLO, KIND_WRITE, KIND_READ, KIND_ANSWER = 1, 2, 3, 0x81
FLAG_IMM = 1
HEADER = struct.Struct("<BBHHHIQQI")
ANSWER = struct.Struct("<BBHIQ")
REMOTE_DT = np.dtype([("segment", "<u4"), ("offset", "<u8"), ("length", "<u8")])
LOCAL_DT = np.dtype([("address", "<u8"), ("length", "<u8")])
MAX_ENTRIES = 1024  # IOV_MAX: one request is one gathered system call
MAX_BODY = 1 << 20
MAX_REQUEST_BYTES = 1 << 30
_IOV_CHUNK = 1000  # sendmsg/recvmsg_into take at most IOV_MAX buffers


class PeerClosed(Exception):
    """The stream ended (EOF or reset); translated where the peer's name is known."""


# --- byte moving helpers -------------------------------------------------------------

def recv_into_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fills ``views`` in order from ``sock``, scattering with recvmsg_into."""
    bufs = [v for v in views if len(v)]
    i = 0
    while i < len(bufs):
        try:
            n = sock.recvmsg_into(bufs[i:i + _IOV_CHUNK])[0]
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
        if n == 0:
            raise PeerClosed("connection closed by peer")
        while n:
            size = len(bufs[i])
            if n >= size:
                n -= size
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        recv_into_views(sock, [memoryview(buf)])
    return buf


def send_views(sock: socket.socket, bufs: Iterable[Any]) -> None:
    """Sends every buffer in order, gathering with sendmsg (no concatenation copies).

    Buffers are bytes or byte-format memoryviews (``len`` is their size in bytes).
    """
    pending = [b for b in bufs if len(b)]
    i = 0
    while i < len(pending):
        try:
            n = sock.sendmsg(pending[i:i + _IOV_CHUNK])
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
        while n:
            size = len(pending[i])
            if n >= size:
                n -= size
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0


def drain(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        chunk = scratch[:min(nbytes, len(scratch))]
        recv_into_views(sock, [chunk])
        nbytes -= len(chunk)


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def encode_request(kind: int, work: Work | None, body: bytes = b"",
                   local: np.ndarray | None = None) -> list[Any]:
    """Header and entries of one request, as buffers for a gathered send."""
    if work is None:
        return [HEADER.pack(kind, 0, 0, 0, 0, len(body), 0, 0, 0), body]
    remote = np.array(work.remote, dtype=REMOTE_DT)
    imm = work.imm
    flags = FLAG_IMM if imm is not None else 0
    if imm is not None and imm.notify:
        body = imm.notify
    n_local = 0 if local is None else len(local)
    header = HEADER.pack(kind, flags, len(remote), n_local, 0, len(body), work.wr_id,
                         imm.transfer_id if imm else 0, imm.expected if imm else 0)
    parts: list[Any] = [header, remote.tobytes()]
    if local is not None:
        parts.append(local.tobytes())
    if body:
        parts.append(body)
    return parts


def pack_error(exc: TransferError) -> bytes:
    data: bytes = msgpack.packb({"code": error_code(exc), "message": exc.message,
                                 "segment": exc.segment, "offset": exc.offset,
                                 "length": exc.length}, default=str)
    return data


def unpack_error(body: bytes, status: int, peer: str, op: str, transport: str) -> TransferError:
    try:
        info = msgpack.unpackb(body)
        return error_from_wire(int(info.get("code", status)), str(info.get("message")),
                               peer=peer, op=op, transport=transport,
                               segment=info.get("segment"), offset=info.get("offset"),
                               length=info.get("length"))
    except Exception:  # a garbled error report is still an error report
        return error_from_wire(status, "peer reported an error", peer=peer, op=op,
                               transport=transport)


# --- initiator side -------------------------------------------------------------------

class StreamRail(Rail):
    """One connection to a peer's stream server."""

    transport_name = "stream"
    inline_bytes = 512 << 10  # largest work an idle rail sends in the caller's thread

    def __init__(self, sock: socket.socket, peer: str, index: int, on_complete: OnComplete,
                 host: Host) -> None:
        self._sock = sock
        self.peer = peer
        self.index = index
        self._on_complete = on_complete
        self._host = host
        self._lock = threading.Lock()
        self._pending: collections.deque[Work] = collections.deque()
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._closed = False
        self._failure: TransferError | None = None
        self._send_lock = threading.Lock()
        self._busy = 0  # work queued or being sent
        self.bytes_sent = 0
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"te-{self.transport_name}-send-{peer}#{index}")
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"te-{self.transport_name}-read-{peer}#{index}")
        self._sender.start()
        self._reader.start()

    # hooks for subclasses
    def _request_parts(self, work: Work) -> list[Any]:
        raise NotImplementedError

    def _take_read(self, work: Work) -> None:
        """Called after a successful READ answer; the bytes may follow on the stream."""

    # Rail API
    @property
    def closed(self) -> bool:
        return self._closed or self._failure is not None

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._pending) + self._queue.qsize()

    def post(self, work: Work) -> None:
        # An idle rail sends small work in the caller's thread: a thread hand-off costs
        # more than sending a few hundred KiB. Busy rails queue, keeping order.
        with self._lock:
            if self._closed:
                raise ClosedError("rail is closed", peer=self.peer, op=str(work.op),
                                  transport=self.transport_name)
            if self._failure is not None:
                raise self._failure
            inline = self._busy == 0 and work.nbytes <= self.inline_bytes
            self._busy += 1
            if inline:
                self._send_lock.acquire()  # free: nothing queued or being sent
            else:
                self._queue.put(work)
        if inline:
            try:
                self._send_one(work)
            finally:
                self._send_lock.release()
                with self._lock:
                    self._busy -= 1

    def _error(self, exc_type: type[TransferError], message: str, work: Work | None = None
               ) -> TransferError:
        return exc_type(message, peer=self.peer, transport=self.transport_name,
                        op=str(work.op) if work else None)

    def _send_loop(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                with self._send_lock:
                    self._send_one(work)
            finally:
                with self._lock:
                    self._busy -= 1

    def _send_one(self, work: Work) -> None:
        with self._lock:
            if self._failure is not None or self._closed:
                failed = self._failure or self._error(ClosedError, "rail is closed", work)
            else:
                failed = None
                self._pending.append(work)
        if failed is not None:
            self._complete(work, failed)
            return
        try:
            send_views(self._sock, self._request_parts(work))
            self.bytes_sent += work.nbytes
        except PeerClosed as exc:
            self._fail_all(self._error(PeerLostError, f"connection lost while sending: {exc}"))
        except Exception as exc:  # a bug must not leave a handle waiting forever
            log.exception("rail %s#%d send failed", self.peer, self.index)
            self._fail_all(self._error(ProtocolError, f"send failed: {exc!r}"))

    def _read_loop(self) -> None:
        try:
            while True:
                kind, status, _, body_len, wr_id = ANSWER.unpack(
                    recv_exact(self._sock, ANSWER.size))
                if kind != KIND_ANSWER or body_len > MAX_BODY:
                    raise ProtocolError("malformed answer", peer=self.peer,
                                        transport=self.transport_name)
                body = bytes(recv_exact(self._sock, body_len))
                with self._lock:
                    work = self._pending[0] if self._pending else None
                if work is None or work.wr_id != wr_id:
                    raise ProtocolError(f"answer for unknown work request {wr_id}",
                                        peer=self.peer, transport=self.transport_name)
                error = None
                if status:
                    error = unpack_error(body, status, self.peer, str(work.op),
                                         self.transport_name)
                elif work.op is Op.READ:
                    self._take_read(work)
                with self._lock:
                    self._pending.popleft()
                self._complete(work, error)
        except PeerClosed as exc:
            if not self._closed:
                self._fail_all(self._error(PeerLostError, f"connection lost: {exc}"))
        except TransferError as exc:
            self._fail_all(exc)
        except Exception as exc:
            log.exception("rail %s#%d reader failed", self.peer, self.index)
            self._fail_all(self._error(ProtocolError, f"reader failed: {exc!r}"))
        finally:
            if not self._closed:
                self._fail_all(self._error(PeerLostError, "connection lost"))

    def _complete(self, work: Work, error: TransferError | None) -> None:
        try:
            self._on_complete(Completion(work, error))
        except Exception:
            log.exception("completion callback failed")

    def _fail_all(self, error: TransferError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
            error = self._failure  # the first cause wins: a later close keeps it
            pending = list(self._pending)
            self._pending.clear()
        for work in pending:
            self._complete(work, error)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        # fail queued work, then wake the sender so that it ends
        while True:
            try:
                queued = self._queue.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                self._complete(queued, error)
        self._queue.put(None)

    def abort(self, error: TransferError) -> None:
        with self._lock:
            if self._failure is None and not self._closed:
                self._failure = error
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_all(self._error(ClosedError, "rail is closed"))
        for thread in (self._sender, self._reader):
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._sock.close()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else ("FAILED" if self._failure else "OPEN")
        return (f"<Rail {self.transport_name}\u2192{self.peer}#{self.index} {state} "
                f"inflight={self.inflight}>")


def hello(sock: socket.socket, name: str, timeout: float | None) -> None:
    """First message of a rail: who we are. The target answers once it accepted us."""
    body = msgpack.packb({"name": name, "version": WIRE_VERSION, "pid": os.getpid()})
    sock.settimeout(timeout)
    try:
        send_views(sock, encode_request(KIND_HELLO, None, body))
        kind, status, _, body_len, _ = ANSWER.unpack(recv_exact(sock, ANSWER.size))
        answer = bytes(recv_exact(sock, body_len))
    finally:
        sock.settimeout(None)
    if kind != KIND_ANSWER or status:
        raise unpack_error(answer, status or 2, "?", "connect", "stream")


# --- target side ----------------------------------------------------------------------

class Connection:
    """What the target knows of one accepted rail."""

    __slots__ = ("sock", "peer", "pid")

    def __init__(self, sock: socket.socket, peer: str, pid: int) -> None:
        self.sock = sock
        self.peer = peer
        self.pid = pid


class StreamServer:
    """Accepts rails and serves their requests against the host's segments."""

    transport_name = "stream"

    def __init__(self, listener: socket.socket, host: Host, buffer_bytes: int) -> None:
        self._listener = listener
        self._host = host
        self._buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self.bytes_received = 0
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"te-{self.transport_name}-accept")
        self._acceptor.start()

    # hooks
    def land(self, conn: Connection, views: list[memoryview], remote: np.ndarray,
             local: np.ndarray | None) -> None:
        """Moves a WRITE's bytes into ``views`` (already checked and pinned)."""
        raise NotImplementedError

    def serve(self, conn: Connection, wr_id: int, views: list[memoryview],
              remote: np.ndarray, local: np.ndarray | None) -> None:
        """Moves a READ's bytes to the initiator and answers."""
        raise NotImplementedError

    def refuse_write(self, conn: Connection, nbytes: int) -> None:
        """Consumes the payload of a refused WRITE so the stream stays in step."""

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                tune_socket(sock, self._buffer_bytes)
                thread = threading.Thread(target=self._serve_conn, args=(sock,), daemon=True,
                                          name=f"te-{self.transport_name}-serve")
                self._conns[sock] = thread
            thread.start()

    def _serve_conn(self, sock: socket.socket) -> None:
        conn: Connection | None = None
        try:
            sock.settimeout(10.0)  # the hello must come promptly
            kind, _, _, _, _, body_len, _, _, _ = HEADER.unpack(recv_exact(sock, HEADER.size))
            if kind != KIND_HELLO or body_len > MAX_BODY:
                raise ProtocolError("rail must start with a hello")
            info = msgpack.unpackb(bytes(recv_exact(sock, body_len)))
            if not isinstance(info, dict) or info.get("version") != WIRE_VERSION:
                raise ProtocolError(f"unsupported rail version {info!r:.80}")
            conn = Connection(sock, str(info["name"]), int(info.get("pid", 0)))
            sock.settimeout(None)
            send_views(sock, [ANSWER.pack(KIND_ANSWER, 0, 0, 0, 0)])
            while True:
                self._serve_one(conn)
        except (PeerClosed, TimeoutError):
            pass
        except TransferError as exc:
            log.warning("%s rail from %s dropped: %s", self.transport_name,
                        conn.peer if conn else "?", exc)
        except Exception:
            log.exception("%s server failed", self.transport_name)
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _serve_one(self, conn: Connection) -> None:
        sock = conn.sock
        (kind, flags, n_remote, n_local, _, body_len, wr_id, transfer_id,
         expected) = HEADER.unpack(recv_exact(sock, HEADER.size))
        if kind not in (KIND_WRITE, KIND_READ):
            raise ProtocolError(f"unknown request kind {kind}", peer=conn.peer)
        if n_remote > MAX_ENTRIES or n_local > MAX_ENTRIES or body_len > MAX_BODY:
            raise ProtocolError("request too large", peer=conn.peer)
        remote = np.frombuffer(recv_exact(sock, n_remote * REMOTE_DT.itemsize), REMOTE_DT)
        local = (np.frombuffer(recv_exact(sock, n_local * LOCAL_DT.itemsize), LOCAL_DT)
                 if n_local else None)
        body = bytes(recv_exact(sock, body_len)) if body_len else b""
        nbytes = int(remote["length"].sum()) if n_remote else 0
        if nbytes > MAX_REQUEST_BYTES:
            raise ProtocolError("request too large", peer=conn.peer, length=nbytes)
        op = Op.WRITE if kind == KIND_WRITE else Op.READ
        pinned: list[Any] = []
        try:
            views = self._resolve(conn, op, remote, pinned)
        except TransferError as exc:
            if op is Op.WRITE:
                self.refuse_write(conn, nbytes)
            send_views(sock, self._answer(wr_id, exc))
            return
        try:
            if op is Op.WRITE:
                try:
                    if nbytes:
                        self.land(conn, views, remote, local)
                except TransferError as exc:
                    send_views(sock, self._answer(wr_id, exc))
                    return
                self.bytes_received += nbytes
                if flags & FLAG_IMM:
                    self._host.deliver_immediate(
                        conn.peer, Immediate(transfer_id, expected, body or None))
                send_views(sock, self._answer(wr_id, None))
            else:
                self.serve(conn, wr_id, views, remote, local)
        finally:
            for seg in pinned:
                seg.unpin()

    def _resolve(self, conn: Connection, op: Op, remote: np.ndarray,
                 pinned: list[Any]) -> list[memoryview]:
        """Checks every entry before any byte moves; pins the segments."""
        write = op is Op.WRITE
        opname = str(op)
        views: list[memoryview] = []
        ids = remote["segment"]
        offsets = remote["offset"].astype(np.int64)
        lengths = remote["length"].astype(np.int64)
        segs: dict[int, Any] = {}
        for seg_id in np.unique(ids).tolist() if len(ids) else ():
            seg = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
            mask = ids == seg_id
            ok = (lengths[mask] > 0) & (offsets[mask] + lengths[mask] <= seg.length)
            if write and not seg.writable or not bool(ok.all()):
                bad = int(np.flatnonzero(~ok)[0]) if not bool(ok.all()) else 0
                seg.check(int(offsets[mask][bad]), int(lengths[mask][bad]), write=write,
                          op=opname, peer=conn.peer)
            segs[seg_id] = seg
        try:
            for seg in segs.values():
                seg.pin()
                pinned.append(seg)
        except TransferError:
            for seg in pinned:
                seg.unpin()
            pinned.clear()
            raise
        if len(segs) == 1:
            base = next(iter(segs.values())).view()
            views = [base[o:o + n]
                     for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]
        else:
            bases = {i: seg.view() for i, seg in segs.items()}
            views = [bases[i][o:o + n] for i, o, n in zip(ids.tolist(), offsets.tolist(),
                                                          lengths.tolist(), strict=True)]
        return views

    def _answer(self, wr_id: int, exc: TransferError | None) -> list[Any]:
        if exc is None:
            return [ANSWER.pack(KIND_ANSWER, 0, 0, 0, wr_id)]
        body = pack_error(exc)
        return [ANSWER.pack(KIND_ANSWER, error_code(exc), 0, len(body), wr_id), body]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.items())
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=5)
        for _, thread in conns:
            thread.join(timeout=5)

"""What the stream transports (tcp, shm) share: framing, rails and the target's server.

One rail is one stream connection. The initiator's rail has a sender thread (posting
never blocks the caller on the network) and a reader thread that takes the target's
answers in order. The target runs one thread per connection that validates each
request against its segment table *before* touching memory, moves the bytes, counts
the immediate after the bytes, and answers.

Wire format (little-endian; one request, one answer, in order on each connection):

    request  = header(32) remote local[n_local](16 each) body[body_len] payload
    header   = kind u8, flags u8, n_remote u16, n_local u16, pad u16, body_len u32,
               wr_id u64, transfer_id u64, expected u32
    flags    = 1: with immediate; 2: uniform remote entries
    remote   = n_remote of (segment u64, offset u64, length u64)   (target memory)
             | uniform: segment u64, length u64, then n_remote offsets u64
    local    = address u64, length u64                    (initiator memory, shm only)
    body     = HELLO: msgpack {name, version, pid}; WRITE with immediate: notify bytes
    payload  = the bytes (tcp WRITE only)
    answer   = kind u8 (0x81), status u8 (0 ok, else an error code), pad u16,
               body_len u32, wr_id u64; body = msgpack error details; then, for a tcp
               READ that succeeded, the bytes.

Entries are whole 64-bit words, so the target reads them as one aligned ``(n, 3)``
array and checks a request of a thousand blocks with a handful of array operations.
Blocks of one length in one segment (the paged-KV case) travel as their offsets alone:
a third of the bytes, and one reduction to check them all. Each NumPy call counts here:
the kernel's copy of a batch evicts the caches, so a call costs 10-15 us when the next
request comes, several times its warm cost.
Versions (``version`` in the HELLO): 1, 20-byte remote entries (segment u32); 2, 24-byte
entries; 3, uniform entries added.

Subclasses say only how the payload moves (:meth:`StreamServer.land` /
:meth:`StreamServer.serve` on the target, :meth:`StreamRail._send_request` /
:meth:`StreamRail._take_read` on the initiator).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import queue
import socket
import struct
import threading
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, chain
from typing import Any, NoReturn

import msgpack
import numpy as np

from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    InvalidDescriptorError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    TransferError,
    error_code,
    error_from_wire,
)
from transfer_engine.planner import Spans
from transfer_engine.segment import Segment
from transfer_engine.transport.base import Completion, Host, Immediate, OnComplete, Rail, Work
from transfer_engine.transport.iovec import IOVEC_IO, iov_views, recv_iov, send_iov

log = logging.getLogger(__name__)

WIRE_VERSION = 3
KIND_HELLO, KIND_WRITE, KIND_READ, KIND_ANSWER = 1, 2, 3, 0x81
FLAG_IMM, FLAG_UNIFORM = 1, 2
HEADER = struct.Struct("<BBHHHIQQI")
UNIFORM = struct.Struct("<QQ")  # segment, length of every entry
ANSWER = struct.Struct("<BBHIQ")
REMOTE_WORDS = 3  # segment, offset, length: u64 each
LOCAL_DT = np.dtype([("address", "<u8"), ("length", "<u8")])
MAX_ENTRIES = 1024  # IOV_MAX: one request is one gathered system call
MAX_BODY = 1 << 20
MAX_REQUEST_BYTES = 1 << 30
_IOV_CHUNK = 1000  # sendmsg/recvmsg_into take at most IOV_MAX buffers
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
EARLY_HEAD_BYTES = 256 << 10


class PeerClosed(Exception):
    """The stream ended (EOF or reset); translated where the peer's name is known."""


# --- byte moving helpers -------------------------------------------------------------
# Byte buffers are bytes or byte-format memoryviews (``len`` is their size in bytes).
# Each helper makes one system call in the common case, for any number of buffers:
# MSG_WAITALL lets the kernel fill a whole scatter list before waking us, and the
# cursor arithmetic after a short call runs only when one happened.

def _recv_into(sock: socket.socket, bufs: Sequence[Any]) -> int:
    try:
        n = sock.recvmsg_into(bufs, 0, _WAITALL)[0]
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc
    if n == 0:
        raise PeerClosed("connection closed by peer")
    return n


def _rest(bufs: Sequence[Any], ends: list[int], done: int) -> list[Any]:
    """The buffers still to be filled (or sent) after the first ``done`` bytes."""
    i = bisect_right(ends, done)
    head = memoryview(bufs[i])[done - ends[i] + len(bufs[i]):]
    return [head, *bufs[i + 1:i + _IOV_CHUNK]]


def recv_into_views(sock: socket.socket, views: Sequence[Any],
                    nbytes: int | None = None) -> None:
    """Fills ``views`` in order from ``sock``, scattering with recvmsg_into.

    ``nbytes`` is their total size when the caller knows it.
    """
    if nbytes is None:
        nbytes = sum(map(len, views))
    if nbytes <= 0:
        return
    got = _recv_into(sock, views[:_IOV_CHUNK] if len(views) > _IOV_CHUNK else views)
    if got == nbytes:
        return
    ends = list(accumulate(map(len, views)))
    while got < nbytes:
        got += _recv_into(sock, _rest(views, ends, got))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """The next ``n`` bytes of the stream."""
    if n <= 0:
        return b""
    try:
        data = sock.recv(n, _WAITALL)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc
    if len(data) == n:
        return data
    if not data:
        raise PeerClosed("connection closed by peer")
    buf = bytearray(n)
    buf[:len(data)] = data
    recv_into_views(sock, [memoryview(buf)[len(data):]], n - len(data))
    return bytes(buf)


def send_views(sock: socket.socket, bufs: Sequence[Any], nbytes: int | None = None) -> None:
    """Sends every buffer in order, gathering with sendmsg (no concatenation copies).

    ``nbytes`` is their total size when the caller knows it.
    """
    if nbytes is None:
        nbytes = sum(map(len, bufs))
    try:
        sent = sock.sendmsg(bufs[:_IOV_CHUNK] if len(bufs) > _IOV_CHUNK else bufs)
        if sent == nbytes:
            return
        ends = list(accumulate(map(len, bufs)))
        while sent < nbytes:
            sent += sock.sendmsg(_rest(bufs, ends, sent))
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


def send_bytes(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


def send_gather(sock: socket.socket, head: bytes, iov: np.ndarray | None, nbytes: int,
                headroom: np.ndarray | None = None) -> None:
    """Sends ``head`` and then the ``nbytes`` bytes ``iov`` describes.

    Above ``EARLY_HEAD_BYTES`` the head goes in a call of its own: with TCP_NODELAY it
    leaves at once, so the target checks the entries while the payload is still being
    copied in, rather than after the sender's first 64 KiB segment. ``headroom``, if
    given, is ``iov`` with one spare row in front, which then describes the head.
    """
    if iov is None or not nbytes:
        send_bytes(sock, head)
        return
    if not IOVEC_IO:
        send_views(sock, [head, *iov_views(iov)], len(head) + nbytes)
        return
    if nbytes >= EARLY_HEAD_BYTES:
        send_bytes(sock, head)
        try:
            send_iov(sock, iov, nbytes)
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
        return
    if headroom is not None:
        rows = headroom
    else:
        rows = np.empty((len(iov) + 1, 2), dtype=np.uint64)
        rows[1:] = iov
    # the address of the bytes object's own buffer (no copy); ``head`` outlives the call
    rows[0] = (ctypes.cast(ctypes.c_char_p(head), ctypes.c_void_p).value or 0, len(head))
    try:
        send_iov(sock, rows, len(head) + nbytes)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


def recv_scatter(sock: socket.socket, iov: np.ndarray, nbytes: int) -> None:
    """Fills the ``nbytes`` bytes ``iov`` describes from ``sock``."""
    if not nbytes:
        return
    if not IOVEC_IO:
        recv_into_views(sock, iov_views(iov), nbytes)
        return
    try:
        recv_iov(sock, iov, nbytes)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


def drain(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        chunk = scratch[:min(nbytes, len(scratch))]
        recv_into_views(sock, [chunk], len(chunk))
        nbytes -= len(chunk)


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def pack_remote(remote: Sequence[tuple[int, int, int]]) -> bytes:
    """The ``remote`` entries of a request: (segment, offset, length) u64 words."""
    if isinstance(remote, Spans):
        entries = np.empty((len(remote), REMOTE_WORDS), dtype="<u8")
        entries[:, 0] = remote.segment
        entries[:, 1] = remote.offset
        entries[:, 2] = remote.length
        return entries.tobytes()
    return struct.pack("<" + "QQQ" * len(remote), *chain.from_iterable(remote))


def pack_uniform(segment: int, length: int, offsets: np.ndarray) -> bytes:
    """The ``remote`` entries of a uniform request (``FLAG_UNIFORM``)."""
    return UNIFORM.pack(segment, length) + np.asarray(offsets, dtype="<u8").tobytes()


def pack_local(local: Sequence[tuple[int, int]]) -> bytes:
    """The ``local`` entries of a request (LOCAL_DT records): (address, length)."""
    return struct.pack("<" + "QQ" * len(local), *chain.from_iterable(local))


def encode_request(kind: int, work: Work | None, body: bytes = b"", local: bytes = b""
                   ) -> bytes:
    """Header, entries and body of one request, in one buffer (the payload follows).

    ``local`` is :func:`pack_local` output (shm only).
    """
    if work is None:
        return HEADER.pack(kind, 0, 0, 0, 0, len(body), 0, 0, 0) + body
    imm = work.imm
    flags = FLAG_IMM if imm is not None else 0
    if imm is not None and imm.notify:
        body = imm.notify
    remote = work.remote
    n_remote = len(remote)
    if n_remote > MAX_ENTRIES:
        raise ValueError(f"{n_remote} remote entries in one request (at most {MAX_ENTRIES})")
    if isinstance(remote, Spans) and remote.uniform is not None:
        flags |= FLAG_UNIFORM
        entries = pack_uniform(*remote.uniform, remote.offset)
    else:
        entries = pack_remote(remote)
    header = HEADER.pack(kind, flags, n_remote, len(local) // LOCAL_DT.itemsize, 0,
                         len(body), work.wr_id, imm.transfer_id if imm else 0,
                         imm.expected if imm else 0)
    return b"".join((header, entries, local, body))


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

_LINGER_RESET = struct.pack("ii", 1, 0)


class StreamRail(Rail):
    """One connection to a peer's stream server.

    A work completes only once no thread of ours touches its local memory any more:
    should the rail fail while a thread is sending a WRITE's payload or receiving a
    READ's bytes, that thread completes the work when its system call has returned
    (the socket is shut down, so it returns at once). Work not yet taken by the sender
    can be withdrawn (:meth:`withdraw`).
    """

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
        # posted work the sender has not taken yet, by id(): whoever pops it owns it
        self._queued: dict[int, Work] = {}
        # work whose memory a thread of ours is copying now (at most a sender's and the
        # reader's), and the error of those the rail failed meanwhile: their thread
        # completes them once it lets go (ids, as Work compares by value)
        self._touched: dict[int, Work] = {}
        self._held: dict[int, TransferError] = {}
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
    def _payload(self, work: Work) -> int:
        """Bytes this side sends for ``work`` besides the request itself."""
        return work.nbytes if work.op is Op.WRITE else 0

    def _send_request(self, work: Work) -> None:
        """Sends ``work``'s request (with the payload where the stream carries it);
        raises :class:`PeerClosed` when the stream broke."""
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
            return len(self._pending) + len(self._queued)

    def post(self, work: Work) -> None:
        # An idle rail sends small work in the caller's thread: a thread hand-off costs
        # more than sending a few hundred KiB (a READ's request is small whatever it
        # reads). Busy rails queue, keeping order.
        with self._lock:
            if self._closed:
                raise ClosedError("rail is closed", peer=self.peer, op=str(work.op),
                                  transport=self.transport_name)
            if self._failure is not None:
                raise self._failure
            payload = self._payload(work)
            inline = self._busy == 0 and payload <= self.inline_bytes
            self._busy += 1
            if inline:
                self._send_lock.acquire()  # free: nothing queued or being sent
                self._pending.append(work)
                if payload:
                    self._touched[id(work)] = work
            else:
                self._queued[id(work)] = work
                self._queue.put(work)
        if inline:
            try:
                self._transmit(work, payload > 0)
            finally:
                self._send_lock.release()
                with self._lock:
                    self._busy -= 1

    def withdraw(self, works: Sequence[Work]) -> tuple[list[Work], bool]:
        with self._lock:
            taken = [w for w in works if self._queued.pop(id(w), None) is not None]
            ids = {id(w) for w in works}
            busy = (any(id(w) in ids for w in self._pending)
                    or any(key in ids for key in self._touched))
        return taken, busy

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
                    with self._lock:
                        if self._queued.pop(id(work), None) is None:
                            continue  # withdrawn, or already failed by _fail_all
                        failed = self._failure
                        touch = failed is None and self._payload(work) > 0
                        if failed is None:
                            self._pending.append(work)
                        if touch:
                            self._touched[id(work)] = work
                    if failed is None:
                        self._transmit(work, touch)
                if failed is not None:
                    self._complete(work, failed)
            finally:
                with self._lock:
                    self._busy -= 1

    def _transmit(self, work: Work, touched: bool) -> None:
        """Sends ``work`` (already pending), then lets go of its memory if ``touched``
        (only a payload sent from our memory touches it; a READ's bytes are the
        reader's)."""
        error = None
        try:
            self._send_request(work)
            self.bytes_sent += work.nbytes
        except PeerClosed as exc:
            error = self._error(PeerLostError, f"connection lost while sending: {exc}")
        except Exception as exc:  # a bug must not leave a handle waiting forever
            log.exception("rail %s#%d send failed", self.peer, self.index)
            error = self._error(ProtocolError, f"send failed: {exc!r}")
        if touched:
            self._let_go(work)
        if error is not None:
            self._fail_all(error)

    def _let_go(self, work: Work) -> bool:
        """Our thread no longer touches ``work``'s memory; completes it if the rail
        failed meanwhile (and says so)."""
        with self._lock:
            del self._touched[id(work)]
            error = self._held.pop(id(work), None)
        if error is None:
            return False
        self._complete(work, error)
        return True

    def _read_loop(self) -> None:
        try:
            while True:
                kind, status, _, body_len, wr_id = ANSWER.unpack(
                    recv_exact(self._sock, ANSWER.size))
                if kind != KIND_ANSWER or body_len > MAX_BODY:
                    raise ProtocolError("malformed answer", peer=self.peer,
                                        transport=self.transport_name)
                body = recv_exact(self._sock, body_len)
                with self._lock:
                    work = self._pending[0] if self._pending else None
                    take = (work is not None and work.wr_id == wr_id and not status
                            and work.op is Op.READ)
                    if take and work is not None:
                        self._touched[id(work)] = work
                if work is None or work.wr_id != wr_id:
                    raise ProtocolError(f"answer for unknown work request {wr_id}",
                                        peer=self.peer, transport=self.transport_name)
                error = None
                if status:
                    error = unpack_error(body, status, self.peer, str(work.op),
                                         self.transport_name)
                elif take:
                    held = False
                    try:
                        self._take_read(work)
                    finally:
                        held = self._let_go(work)
                    if held:
                        continue  # the rail failed meanwhile; the next read ends us
                with self._lock:
                    if not self._pending or self._pending[0] is not work:
                        continue  # failed meanwhile, and completed by _fail_all
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
            self._release()

    def _release(self) -> None:
        """Closes the socket of a rail that failed by itself, once no thread of ours can
        still use it: a dead peer's rail holds no descriptor until it is closed."""
        if self._sender is not threading.current_thread():
            self._sender.join(timeout=5)
        if self._send_lock.acquire(timeout=5):  # an inline send in a caller's thread
            try:
                self._sock.close()
            finally:
                self._send_lock.release()

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
            pending = []
            for work in self._pending:
                if id(work) in self._touched:  # completed by its thread on letting go
                    self._held[id(work)] = error
                else:
                    pending.append(work)
            self._pending.clear()
            queued = list(self._queued.values())
            self._queued.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # a thread in a system call returns
        except OSError:
            pass
        for work in pending:
            self._complete(work, error)
        for work in queued:
            self._complete(work, error)
        self._queue.put(None)  # the sender skips what was queued, then ends

    def abort(self, error: TransferError) -> None:
        with self._lock:
            if self._failure is None and not self._closed:
                self._failure = error
        try:  # close with a reset: bytes still queued either side are dropped, not landed
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass
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
        self._release()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else ("FAILED" if self._failure else "OPEN")
        return (f"<Rail {self.transport_name}\u2192{self.peer}#{self.index} {state} "
                f"inflight={self.inflight}>")


def hello(sock: socket.socket, name: str, timeout: float | None) -> None:
    """First message of a rail: who we are. The target answers once it accepted us."""
    body = msgpack.packb({"name": name, "version": WIRE_VERSION, "pid": os.getpid()})
    sock.settimeout(timeout)
    try:
        send_bytes(sock, encode_request(KIND_HELLO, None, body))
        kind, status, _, body_len, _ = ANSWER.unpack(recv_exact(sock, ANSWER.size))
        answer = recv_exact(sock, body_len)
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


def _check_entries(conn: Connection, seg: Segment, rows: np.ndarray, write: bool, op: str,
                   low: list[int] | None = None, high: list[int] | None = None) -> None:
    """Raises the segment's precise error for the first (segment, offset, length) row it
    may not serve; ``low``/``high`` are the rows' column minima and maxima if known.

    Rows are unsigned: each bound is checked before the sum that could wrap.
    """
    limit = seg.length
    low = rows.min(axis=0).tolist() if low is None else low
    high = rows.max(axis=0).tolist() if high is None else high
    if (seg.writable or not write) and low[2] > 0 and (
            high[1] + high[2] <= limit  # the largest offset and length still fit
            or (high[1] <= limit and high[2] <= limit
                and int((rows[:, 1] + rows[:, 2]).max()) <= limit)):
        return
    _refuse(conn, seg, rows[:, 1:].tolist(), write, op)


def _refuse(conn: Connection, seg: Segment, ranges: Iterable[Sequence[int]], write: bool,
            op: str) -> NoReturn:
    """Raises the segment's precise error for the first (offset, length) range it may not
    serve, once the fast bounds check has failed."""
    for offset, length in ranges:
        seg.check(offset, length, write=write, op=op, peer=conn.peer)
    raise InvalidDescriptorError("request refused", peer=conn.peer, op=op,
                                 segment=seg.name)


class Targets:
    """Where one request's bytes land (or come from) in the target's memory, checked
    and pinned: ``iov`` rows of (address, length) for gathered I/O, and the same ranges
    as memoryviews when iterated (made on demand: the fast paths never need them).
    ``headroom``, when set, is ``iov`` with a spare row in front (for an answer's head)."""

    __slots__ = ("iov", "nbytes", "headroom", "_segs", "_ids")

    def __init__(self, iov: np.ndarray, nbytes: int, segs: dict[int, Segment],
                 ids: np.ndarray | None = None, headroom: np.ndarray | None = None) -> None:
        self.iov = iov
        self.headroom = headroom
        self.nbytes = nbytes
        self._segs = segs
        self._ids = ids  # each row's segment id; None: every row is in the one segment

    def __len__(self) -> int:
        return len(self.iov)

    def __iter__(self) -> Iterator[memoryview]:
        if not len(self.iov):
            return
        ids = ([next(iter(self._segs))] * len(self.iov) if self._ids is None
               else self._ids.tolist())
        bases = {i: (seg.view(), seg.address) for i, seg in self._segs.items()}
        for seg_id, (address, length) in zip(ids, self.iov.tolist(), strict=True):
            view, base = bases[seg_id]
            yield view[address - base:address - base + length]


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
    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        """Moves a WRITE's bytes into ``views`` (already checked and pinned).

        ``local`` holds the initiator's (address, length) records when it sent them
        (shm).
        """
        raise NotImplementedError

    def serve(self, conn: Connection, wr_id: int, views: Targets,
              local: np.ndarray | None) -> None:
        """Moves a READ's bytes to the initiator and answers."""
        raise NotImplementedError

    def refuse_write(self, conn: Connection, nbytes: int) -> None:
        """Consumes the payload of a refused WRITE so the stream stays in step."""

    def tune(self, sock: socket.socket) -> None:
        """Sets the options of an accepted connection before it serves anything."""
        tune_socket(sock, self._buffer_bytes)

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
                try:
                    self.tune(sock)
                except OSError as exc:  # died early, or an option the host refuses
                    log.warning("%s connection not accepted: %s", self.transport_name, exc)
                    sock.close()
                    continue
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
            info = msgpack.unpackb(recv_exact(sock, body_len))
            if not isinstance(info, dict) or info.get("version") != WIRE_VERSION:
                raise ProtocolError(f"unsupported rail version {info!r:.80}")
            conn = Connection(sock, str(info["name"]), int(info.get("pid", 0)))
            sock.settimeout(None)
            send_bytes(sock, ANSWER.pack(KIND_ANSWER, 0, 0, 0, 0))
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
        uniform = flags & FLAG_UNIFORM
        remote_end = (UNIFORM.size + n_remote * 8 if uniform
                      else n_remote * REMOTE_WORDS * 8)
        local_end = remote_end + n_local * LOCAL_DT.itemsize
        blob = recv_exact(sock, local_end + body_len)  # entries and body: one call
        local = np.frombuffer(blob, LOCAL_DT, n_local, remote_end) if n_local else None
        body = blob[local_end:]
        op = Op.WRITE if kind == KIND_WRITE else Op.READ
        nbytes = 0
        if uniform:
            seg_id, length = UNIFORM.unpack_from(blob)
            offsets = np.frombuffer(blob, "<u8", n_remote, UNIFORM.size)
            if length > MAX_REQUEST_BYTES:
                raise ProtocolError("request too large", peer=conn.peer, length=length)
            nbytes = n_remote * length
        else:
            remote = np.frombuffer(blob, "<u8", n_remote * REMOTE_WORDS).reshape(
                n_remote, REMOTE_WORDS)
            low = high = [0, 0, 0]  # column minima and maxima of the entries
            if n_remote:
                low, high = remote.min(axis=0).tolist(), remote.max(axis=0).tolist()
                if high[2] > MAX_REQUEST_BYTES:
                    raise ProtocolError("request too large", peer=conn.peer, length=high[2])
                # no wrap-around: every length is bounded
                nbytes = (n_remote * high[2] if low[2] == high[2]
                          else int(remote[:, 2].sum()))
        if nbytes > MAX_REQUEST_BYTES:
            raise ProtocolError("request too large", peer=conn.peer, length=nbytes)
        pinned: list[Any] = []
        try:
            if uniform:
                views = self._resolve_uniform(conn, op, seg_id, length, offsets, nbytes,
                                              pinned)
            else:
                views = self._resolve(conn, op, remote, nbytes, low, high, pinned)
        except TransferError as exc:
            if op is Op.WRITE:
                self.refuse_write(conn, nbytes)
            send_bytes(sock, self._answer(wr_id, exc))
            return
        try:
            if op is Op.WRITE:
                try:
                    if nbytes:
                        self.land(conn, views, local)
                except TransferError as exc:
                    send_bytes(sock, self._answer(wr_id, exc))
                    return
                self.bytes_received += nbytes
                if flags & FLAG_IMM:
                    self._host.deliver_immediate(
                        conn.peer, Immediate(transfer_id, expected, body or None))
                send_bytes(sock, self._answer(wr_id, None))
            else:
                self.serve(conn, wr_id, views, local)
        finally:
            for seg in pinned:
                seg.unpin()

    def _resolve(self, conn: Connection, op: Op, remote: np.ndarray, nbytes: int,
                 low: list[int], high: list[int], pinned: list[Any]) -> Targets:
        """Checks every entry before any byte moves and pins the segments; returns where
        the bytes go. ``low``/``high`` are the entries' column minima and maxima."""
        write = op is Op.WRITE
        opname = str(op)
        ids = remote[:, 0]
        segs: dict[int, Segment] = {}
        if len(remote) and low[0] == high[0]:
            seg_id = low[0]
            segs[seg_id] = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
            _check_entries(conn, segs[seg_id], remote, write, opname, low, high)
        elif len(remote):
            for seg_id in np.unique(ids).tolist():
                seg = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
                _check_entries(conn, seg, remote[ids == seg_id], write, opname)
                segs[seg_id] = seg
        self._pin(conn, opname, segs, pinned)
        if len(segs) <= 1:  # (offset, length) rows plus (base, 0): the iovec rows
            base = next(iter(segs.values())).address if segs else 0
            rows = np.empty((len(remote) + 1, 2), dtype=np.uint64)
            np.add(remote[:, 1:], np.array((base, 0), dtype=np.uint64), out=rows[1:])
            return Targets(rows[1:], nbytes, segs, headroom=rows)
        iov = remote[:, 1:].copy()
        for seg_id, seg in segs.items():
            iov[ids == seg_id, 0] += np.uint64(seg.address)
        return Targets(iov, nbytes, segs, ids)

    def _resolve_uniform(self, conn: Connection, op: Op, seg_id: int, length: int,
                         offsets: np.ndarray, nbytes: int, pinned: list[Any]) -> Targets:
        """:meth:`_resolve` for uniform entries: ``length`` bytes at each of ``offsets``
        (unsigned, so one maximum bounds both ends) in one segment."""
        if not len(offsets):
            return Targets(np.empty((0, 2), dtype=np.uint64), 0, {})
        write = op is Op.WRITE
        opname = str(op)
        seg = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
        limit = seg.length
        if not (0 < length <= limit and (seg.writable or not write)
                and int(offsets.max()) <= limit - length):
            _refuse(conn, seg, ((offset, length) for offset in offsets.tolist()), write,
                    opname)
        self._pin(conn, opname, {seg_id: seg}, pinned)
        rows = np.empty((len(offsets) + 1, 2), dtype=np.uint64)  # row 0: the answer's head
        np.add(offsets, np.uint64(seg.address), out=rows[1:, 0])
        rows[1:, 1] = length
        return Targets(rows[1:], nbytes, {seg_id: seg}, headroom=rows)

    def _pin(self, conn: Connection, opname: str, segs: dict[int, Segment],
             pinned: list[Any]) -> None:
        """Pins host-memory ``segs`` into ``pinned``; raises (nothing pinned) otherwise."""
        for seg in segs.values():
            if seg.device != "cpu":
                raise NotSupportedError(f"{seg.device} memory is not reachable over "
                                        f"{self.transport_name}", peer=conn.peer, op=opname,
                                        transport=self.transport_name, segment=seg.name)
        try:
            for seg in segs.values():
                seg.pin()
                pinned.append(seg)
        except TransferError:
            for seg in pinned:
                seg.unpin()
            pinned.clear()
            raise

    def _answer(self, wr_id: int, exc: TransferError | None) -> bytes:
        if exc is None:
            return ANSWER.pack(KIND_ANSWER, 0, 0, 0, wr_id)
        body = pack_error(exc)
        return ANSWER.pack(KIND_ANSWER, error_code(exc), 0, len(body), wr_id) + body

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

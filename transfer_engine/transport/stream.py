"""What the stream transports (tcp, shm) share: framing, rails and the target's server.

One rail is one stream connection. The initiator's rail has a sender thread (posting
never blocks the caller on the network) and a reader thread that takes the target's
answers in order. The target runs one thread per connection that validates each
request against its segment table *before* touching memory, moves the bytes, counts
the immediate after the bytes, and answers.

Opening (see :mod:`transfer_engine.control.tickets`): on accept the target sends a
challenge; the initiator answers with a HELLO that proves it holds a ticket from the
control handshake; the target answers with its own proof and from then on takes every
request on the connection as that ticket's peer's. A connection that does not open
this way is answered with a bare "rail refused" and closed: a stranger learns nothing
about segments, peers or why.

Wire format (little-endian; one request, one answer, in order on each connection):

    challenge = magic "TEr4" nonce(32)                       (target, on accept)
    request  = header(32) remote local[n_local](16 each) body[body_len] payload
    header   = kind u8, flags u8, n_remote u16, n_local u16, pad u16, body_len u32,
               wr_id u64, transfer_id u64, expected u32
    flags    = 1: with immediate; 2: uniform remote entries
    remote   = n_remote of (segment u64, offset u64, length u64)   (target memory)
             | uniform: segment u64, length u64, then n_remote offsets u64
             | ANNOUNCE: n_remote of (address u64, length u64, writable u64)
    local    = address u64, length u64                    (initiator memory, shm only)
    body     = HELLO: msgpack {version, ticket, nonce, proof, pid};
               WRITE with immediate: notify bytes
    payload  = the bytes (tcp WRITE only)
    answer   = kind u8 (0x81), status u8 (0 ok, else an error code), pad u16,
               body_len u32, wr_id u64; body = msgpack error details (the HELLO's: the
               target's proof); then, for a tcp READ that succeeded, the bytes.

ANNOUNCE (shm) tells the target which ranges of the initiator's memory are registered
segments: the target copies to or from no other initiator memory.

Entries are whole 64-bit words, so the target reads them as one aligned ``(n, 3)``
array and checks a request of a thousand blocks with a handful of array operations.
Blocks of one length in one segment (the paged-KV case) travel as their offsets alone:
a third of the bytes, and one reduction to check them all. Each NumPy call counts here:
the kernel's copy of a batch evicts the caches, so a call costs 10-15 us when the next
request comes, several times its warm cost.
Versions (``version`` in the HELLO): 1, 20-byte remote entries (segment u32); 2, 24-byte
entries; 3, uniform entries added; 4, the challenge, ticket-bound rails and ANNOUNCE.

Bounds: a connection must open within ``HELLO_TIMEOUT`` seconds; at most
``MAX_OPENING`` connections may be opening at once (a new one pushes out the oldest: a
peer opens in one round trip, so a crowd of stalled openings cannot lock it out) and
``MAX_CONNECTIONS`` may be open in all (more are closed at once); once open, a request
that has begun must keep arriving (and an answer keep leaving) with no pause longer
than the stall timeout, or the rail is dropped, its thread and socket freed. An open
rail may stay idle between requests.

Subclasses say only how the payload moves (:meth:`StreamServer.land` /
:meth:`StreamServer.serve` on the target, :meth:`StreamRail._send_request` /
:meth:`StreamRail._take_read` on the initiator).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import queue
import socket
import struct
import threading
import time
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, chain
from typing import Any, NoReturn

import msgpack
import numpy as np

from transfer_engine.control.tickets import (
    CHALLENGE_BYTES,
    CHALLENGE_MAGIC,
    Credential,
    Ticket,
    new_challenge,
)
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    AuthenticationError,
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

WIRE_VERSION = 4
KIND_HELLO, KIND_WRITE, KIND_READ, KIND_ANNOUNCE, KIND_ANSWER = 1, 2, 3, 4, 0x81
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
# accept() failures that pass once fds or memory are freed
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
HELLO_TIMEOUT = 5.0  # seconds a new connection has to open
STALL_TIMEOUT = 20.0  # longest pause inside a request or an answer
MAX_OPENING = 64  # connections opening at once
MAX_CONNECTIONS = 4096  # connections open at once, per server
MAX_ANNOUNCED = 1 << 16  # ranges an initiator may announce


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


def open_rail(sock: socket.socket, credential: Credential | None, transport: str,
              timeout: float | None, ranges: np.ndarray | None = None) -> None:
    """Opens a rail: answers the target's challenge with our ticket, checks the target's
    proof and, for shm, announces our segments' ``ranges`` (ANNOUNCE rows). Raises
    :class:`AuthenticationError` or :class:`PeerClosed`/``OSError``."""
    if credential is None:
        raise AuthenticationError("no rail ticket: connect through the engine's handshake",
                                  transport=transport, op="connect")
    sock.settimeout(timeout)
    try:
        challenge = recv_exact(sock, CHALLENGE_BYTES)
        if not challenge.startswith(CHALLENGE_MAGIC):
            raise ProtocolError("the target does not speak rail version "
                                f"{WIRE_VERSION}", transport=transport, op="connect")
        nonce, proof = credential.opening(transport, challenge)
        body = msgpack.packb({"version": WIRE_VERSION, "ticket": credential.ticket,
                              "nonce": nonce, "proof": proof, "pid": os.getpid()})
        send_bytes(sock, encode_request(KIND_HELLO, None, body))
        kind, status, _, body_len, _ = ANSWER.unpack(recv_exact(sock, ANSWER.size))
        if body_len > MAX_BODY:
            raise ProtocolError("malformed answer to the rail's hello", transport=transport,
                                op="connect")
        answer = recv_exact(sock, body_len)
        if kind != KIND_ANSWER or status:
            raise unpack_error(answer, status or 2, "?", "connect", transport)
        credential.check_answer(transport, challenge, nonce, answer)
        if ranges is not None:
            send_bytes(sock, encode_announce(ranges))
    finally:
        sock.settimeout(None)


def encode_announce(ranges: np.ndarray) -> bytes:
    """An ANNOUNCE request: ``ranges`` rows of (address, length, writable)."""
    rows = np.ascontiguousarray(ranges, dtype="<u8").reshape(-1, 3)
    if len(rows) > MAX_ANNOUNCED:
        raise ValueError(f"{len(rows)} ranges to announce (at most {MAX_ANNOUNCED})")
    body = rows.tobytes()
    return HEADER.pack(KIND_ANNOUNCE, 0, 0, 0, 0, len(body), 0, 0, 0) + body


def set_stall_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bounds, in the kernel, every pause of a blocking call on ``sock`` (SO_RCVTIMEO,
    SO_SNDTIMEO): the data path keeps its one-call receives, and a stalled peer makes a
    call fail with EAGAIN instead of holding a thread forever."""
    sec = int(seconds or 0)
    usec = int(((seconds or 0) - sec) * 1e6)
    tv = struct.pack("ll", sec, usec)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# --- target side ----------------------------------------------------------------------

class Connection:
    """What the target knows of one open rail: the peer its ticket names (never what
    its messages say), that peer's process, what the rail has pinned right now, and the
    initiator ranges it announced (shm)."""

    __slots__ = ("sock", "peer", "pid", "ticket", "pinned", "ranges", "pidfd")

    def __init__(self, sock: socket.socket, peer: str, pid: int,
                 ticket: Ticket | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.pid = pid
        self.ticket = ticket
        self.pinned: list[Any] = []
        self.ranges: np.ndarray | None = None  # (start, end, writable) rows, sorted
        self.pidfd: int | None = None


class _Refused(Exception):
    """A connection that did not open: closed without an answer."""


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

    def __init__(self, listener: socket.socket, host: Host, buffer_bytes: int,
                 stall_timeout: float = STALL_TIMEOUT) -> None:
        self._listener = listener
        self._host = host
        self._buffer_bytes = buffer_bytes
        self._stall = stall_timeout
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._open: dict[socket.socket, Connection] = {}
        self._opening: collections.OrderedDict[socket.socket, None] = (
            collections.OrderedDict())  # oldest first
        self._closed = False
        self.bytes_received = 0
        self.stats: collections.Counter[str] = collections.Counter()
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

    def vouch(self, conn: Connection) -> None:
        """Checks what the transport itself can tell of the peer once its ticket is
        good (shm: the kernel's word on its process); raises :class:`_Refused`."""

    def _accept_loop(self) -> None:
        backoff = 0.0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL, None):
                    return  # listener closed
                if exc.errno in _RESOURCE_ERRORS:  # out of fds or memory: wait, go on
                    if not backoff:
                        log.warning("%s: cannot accept rails (%s); retrying with backoff",
                                    self.transport_name, exc.strerror)
                    self.stats["accept_errors"] += 1
                    backoff = min(1.0, backoff * 2 or 0.01)
                    time.sleep(backoff)
                continue  # ECONNABORTED, EPROTO, EINTR...: that one connection only
            if backoff:
                log.warning("%s: accepting rails again", self.transport_name)
                backoff = 0.0
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    self.stats["connections_shed"] += 1
                    sock.close()
                    continue
                if len(self._opening) >= MAX_OPENING:
                    # a peer opens in a round trip: the oldest opening is a straggler
                    stale = next(iter(self._opening))
                    del self._opening[stale]
                    self.stats["openings_shed"] += 1
                    try:
                        stale.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                try:
                    self.tune(sock)
                except OSError as exc:  # died early, or an option the host refuses
                    log.warning("%s connection not accepted: %s", self.transport_name, exc)
                    sock.close()
                    continue
                thread = threading.Thread(target=self._serve_conn, args=(sock,), daemon=True,
                                          name=f"te-{self.transport_name}-serve")
                self._conns[sock] = thread
                self._opening[sock] = None
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: shed the connection
                with self._lock:
                    self._conns.pop(sock, None)
                    self._opening.pop(sock, None)
                sock.close()

    def _admit(self, sock: socket.socket) -> tuple[Connection, bytes]:
        """The opening: challenge, ticket, proofs; returns the connection and our proof.
        Raises :class:`_Refused`."""
        sock.settimeout(HELLO_TIMEOUT)
        challenge = new_challenge()
        try:
            send_bytes(sock, challenge)
            kind, _, _, _, _, body_len, _, _, _ = HEADER.unpack(
                recv_exact(sock, HEADER.size))
            if kind != KIND_HELLO or body_len > 4096:
                raise _Refused("no hello")
            info = msgpack.unpackb(recv_exact(sock, body_len))
        except (PeerClosed, TimeoutError, OSError, ValueError, msgpack.UnpackException,
                struct.error) as exc:
            raise _Refused(f"no valid hello: {exc}") from None
        if not isinstance(info, dict) or info.get("version") != WIRE_VERSION:
            raise _Refused(f"rail version {info.get('version') if isinstance(info, dict) else '?'}")
        try:
            ticket, proof = self._host.admit_rail(info.get("ticket"), self.transport_name,
                                                  challenge, info.get("nonce"),
                                                  info.get("proof"))
        except TransferError as exc:
            raise _Refused(str(exc)) from None
        conn = Connection(sock, ticket.peer, ticket.pid, ticket)
        try:
            self.vouch(conn)
        except BaseException:
            ticket.release()
            raise
        return conn, proof

    def _serve_conn(self, sock: socket.socket) -> None:
        conn: Connection | None = None
        opening = True
        try:
            try:
                conn, proof = self._admit(sock)
            except _Refused as exc:
                self.stats["rails_refused"] += 1
                log.info("%s rail refused: %s", self.transport_name, exc)
                try:
                    send_bytes(sock, self._answer(0, AuthenticationError("rail refused")))
                except PeerClosed:
                    pass
                return
            sock.settimeout(None)
            set_stall_timeout(sock, self._stall)
            send_bytes(sock, ANSWER.pack(KIND_ANSWER, 0, 0, len(proof), 0) + proof)
            with self._lock:
                self._opening.pop(sock, None)
                opening = False
                self._open[sock] = conn
            while True:
                head = self._next_header(conn)
                if head is not None:
                    self._serve_one(conn, head)
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
                self._open.pop(sock, None)
                if opening:
                    self._opening.pop(sock, None)
            if conn is not None:
                if conn.ticket is not None:
                    conn.ticket.release()
                if conn.pidfd is not None:
                    os.close(conn.pidfd)
            sock.close()

    def _next_header(self, conn: Connection) -> bytes | None:
        """The next request's header; None when the rail stayed idle for a stall
        timeout (an idle rail is fine; a request cut off midway is not)."""
        sock = conn.sock
        try:
            head = sock.recv(HEADER.size, _WAITALL)
        except (BlockingIOError, TimeoutError):
            if self._closed:
                raise PeerClosed("server closed") from None
            return None
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
        if not head:
            raise PeerClosed("connection closed by peer")
        if len(head) < HEADER.size:
            head += recv_exact(sock, HEADER.size - len(head))
        return head

    def _serve_one(self, conn: Connection, head: bytes) -> None:
        sock = conn.sock
        (kind, flags, n_remote, n_local, _, body_len, wr_id, transfer_id,
         expected) = HEADER.unpack(head)
        if kind == KIND_ANNOUNCE:
            self._announce(conn, body_len)
            return
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
        pinned = conn.pinned
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
                        conn.peer, Immediate(transfer_id, expected, body or None),
                        conn.ticket.id if conn.ticket is not None else b"")
                send_bytes(sock, self._answer(wr_id, None))
            else:
                self.serve(conn, wr_id, views, local)
        finally:
            for seg in pinned:
                seg.unpin()
            pinned.clear()

    def _announce(self, conn: Connection, body_len: int) -> None:
        """Records the initiator's registered ranges (rows of address, length,
        writable), sorted by address, as (start, end, writable) rows."""
        if body_len % 24 or body_len > MAX_ANNOUNCED * 24:
            raise ProtocolError("malformed announcement", peer=conn.peer)
        rows = np.frombuffer(recv_exact(conn.sock, body_len), "<u8").reshape(-1, 3)
        start, length = rows[:, 0], rows[:, 1]
        if len(rows) and bool(((length == 0) | (start > np.uint64(2**64 - 1) - length)).any()):
            raise ProtocolError("announced range is empty or wraps", peer=conn.peer)
        order = np.argsort(start, kind="stable")
        out = np.empty((len(rows), 3), dtype=np.uint64)
        out[:, 0] = start[order]
        out[:, 1] = start[order] + length[order]
        out[:, 2] = rows[order, 2] != 0
        conn.ranges = out

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

    def revoke(self, segment: Segment) -> int:
        """Tears down the rails that hold ``segment`` pinned mid-request (its owner is
        closing it and the peer stalls), so that their pins drop; returns how many. What
        a torn WRITE leaves: a prefix of its bytes may have landed; no immediate was
        counted; the initiator's transfer fails."""
        with self._lock:
            stuck = [c for c in self._open.values() if any(p is segment for p in c.pinned)]
        for conn in stuck:
            log.warning("%s rail from %s torn down: segment %s is closing", self.transport_name,
                        conn.peer, segment.name)
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(stuck)

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

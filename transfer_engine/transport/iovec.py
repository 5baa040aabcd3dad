"""Gathered socket I/O from NumPy iovec arrays (Linux, 64-bit).

A transfer of many small blocks is one ``sendmsg`` or ``recvmsg`` whatever the block
count, but handing the kernel a Python list of memoryviews costs a Python object per
block on both sides, more than the copy of a 4 KiB block. Here the scatter-gather list
is an ``(n, 2)`` uint64 array of ``(address, length)`` rows, which is exactly the
kernel's ``struct iovec[]``: it is built with a few array operations from the planner's
columns and passed through ctypes (which releases the GIL for the call).

Callers own the memory behind the addresses: it must stay mapped (pinned segments) for
the duration of the call. ``IOVEC_IO`` is False where the layout does not match (not
Linux, not 64-bit); the stream transports then fall back to memoryviews.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_engine.planner import Columns, WorkRequest, iovec_array
from transfer_engine.segment import Segment

__all__ = ["IOVEC_IO", "IOV_MAX", "RECV_CHUNK", "MIN_PAYLOAD_RATE", "Pace", "host_rows",
           "iov_views", "send_iov", "send_some", "recv_iov", "recv_some", "recv_iov_ready",
           "recv_ready", "send_ready"]

IOV_MAX = 1024
RECV_CHUNK = 1 << 20
MIN_PAYLOAD_RATE = 64 << 10  # bytes per second a peer's message must keep, past one stall


class Pace:
    """How far behind a message from a peer may fall: by any moment, every byte but
    those of one ``stall`` at :data:`MIN_PAYLOAD_RATE` must have come. A peer that
    trickles (a byte every few seconds keeps each receive alive) is so cut after about
    two stalls whatever the message's size, rather than after its size at that rate
    (hours for a large one), and holds a serving thread that long at most. One pace
    spans a message's calls (a bounce refilled, a drain in chunks): ``got`` counts
    them all."""

    __slots__ = ("_due", "got")

    def __init__(self, stall: float) -> None:
        self._due = time.monotonic() + stall
        self.got = 0

    def until(self) -> float:
        """When, should nothing more come, the peer falls behind (``time.monotonic()``)."""
        return self._due + self.got / MIN_PAYLOAD_RATE

    def behind(self) -> bool:
        return time.monotonic() > self.until()

    def check(self, left: int) -> None:
        """Raises ``TimeoutError`` once behind (``left`` bytes still to come)."""
        if self.behind():
            raise TimeoutError(f"{left} bytes still to come, {self.got} received: the "
                               f"peer keeps less than {MIN_PAYLOAD_RATE >> 10} KiB/s")


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.c_void_p), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


def _load() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for name in ("sendmsg", "recvmsg"):
            fn = getattr(libc, name)
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load()
IOVEC_IO = _libc is not None and sys.byteorder == "little"
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def iov_views(iov: np.ndarray) -> list[memoryview]:
    """Writable byte views of the rows (the memory must stay mapped while they live)."""
    return [memoryview((ctypes.c_char * n).from_address(a)).cast("B")
            for a, n in iov.tolist()]


def _advance(iov: np.ndarray, done: int) -> np.ndarray:
    """The rows still to be moved after the first ``done`` bytes (a fresh array)."""
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    i = int(np.searchsorted(ends, done, side="right"))
    rest = iov[i:].copy()
    if len(rest):
        start = int(ends[i]) - int(iov[i, 1])
        rest[0, 0] += np.uint64(done - start)
        rest[0, 1] -= np.uint64(done - start)
    return rest


def head_rows(iov: np.ndarray, limit: int) -> np.ndarray:
    """The rows describing the first ``limit`` bytes of ``iov`` (the row where the limit
    falls cut short; ``iov`` itself when it holds no more)."""
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    i = int(np.searchsorted(ends, limit, side="left"))
    if i >= len(iov):
        return iov
    rows = iov[:i + 1].copy()
    rows[i, 1] -= np.uint64(int(ends[i]) - limit)
    return rows


def _call(fn: Any, fd: int, iov: np.ndarray, flags: int) -> int:
    """One system call over at most IOV_MAX rows; retries EINTR; raises OSError."""
    rows = iov[:IOV_MAX]
    hdr = _MsgHdr(None, 0, rows.ctypes.data, len(rows), None, 0, 0)
    while True:
        n = int(fn(fd, ctypes.byref(hdr), flags))
        if n >= 0:
            return n
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def send_iov(sock: socket.socket, iov: np.ndarray, nbytes: int,
             pace: Pace | None = None) -> None:
    """Sends the ``nbytes`` bytes described by ``iov`` in order (blocking socket); a
    peer that takes them slower than ``pace`` (checked whenever a call returns short)
    raises ``TimeoutError``."""
    assert _libc is not None
    iov = np.ascontiguousarray(iov, dtype=np.uint64)
    sent = _call(_libc.sendmsg, sock.fileno(), iov, _NOSIGNAL)
    if pace is not None:
        pace.got += sent
    while sent < nbytes:
        if pace is not None:
            pace.check(nbytes - sent)
        n = _call(_libc.sendmsg, sock.fileno(), _advance(iov, sent), _NOSIGNAL)
        if n == 0:
            raise OSError(errno.EPIPE, "send made no progress")
        sent += n
        if pace is not None:
            pace.got += n


def recv_iov(sock: socket.socket, iov: np.ndarray, nbytes: int,
             chunk: bool = False, patient: bool = False,
             pace: Pace | None = None) -> None:
    """Fills the ``nbytes`` bytes described by ``iov`` in order (blocking socket).

    One ``MSG_WAITALL`` call for the whole request by default: each call that returns
    must win the GIL back, which a busy Python thread in the process holds for up to the
    switch interval (5 ms), so a 16 MiB request in 1 MiB calls paid that wait 16 times
    (0.2 GB/s under a busy thread against 1.5 in one call, raw sockets). Under cubic
    (what loopback rails use) the size of the calls made no idle difference. With
    ``chunk``, more than ``2 * RECV_CHUNK`` bytes are received in calls of about
    ``RECV_CHUNK``, which streamed 20-35% faster under BBR on loopback. Raises
    ``ConnectionResetError`` when the stream ends first. With ``patient``, a receive
    bound of the socket running out (EAGAIN) is no error: the call goes on waiting.
    Behind ``pace``, checked whenever a call returns short, raises ``TimeoutError``: a
    peer that trickles its bytes does not hold the thread.
    """
    assert _libc is not None
    iov = np.ascontiguousarray(iov, dtype=np.uint64)
    if chunk and nbytes > 2 * RECV_CHUNK:
        for part, size in _chunks(iov, nbytes):
            _recv_all(sock, part, size, patient, pace)
        return
    _recv_all(sock, iov, nbytes, patient, pace)


def send_some(sock: socket.socket, iov: np.ndarray, wait: bool = True) -> int:
    """One ``sendmsg`` of ``iov``, for as long as the socket's send timeout (not at all
    without ``wait``): the bytes it took (0: none in that time). Raises OSError."""
    assert _libc is not None
    try:
        return _call(_libc.sendmsg, sock.fileno(), iov,
                     _NOSIGNAL if wait else _NOSIGNAL | _DONTWAIT)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return 0
        raise


def recv_some(sock: socket.socket, iov: np.ndarray, wait: bool = True) -> int:
    """One ``MSG_WAITALL`` receive into ``iov``, for as long as the socket's receive
    timeout (without ``wait``: what the socket holds now): the bytes that came (0:
    none). Raises ``ConnectionResetError`` at the stream's end, OSError otherwise."""
    assert _libc is not None
    try:
        n = _call(_libc.recvmsg, sock.fileno(), iov, _WAITALL if wait else _DONTWAIT)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return 0
        raise
    if n == 0:
        raise ConnectionResetError("connection closed by peer")
    return n


def _chunks(iov: np.ndarray, nbytes: int) -> list[tuple[np.ndarray, int]]:
    """``iov`` cut into consecutive runs of about ``RECV_CHUNK`` bytes (rows longer
    than that are split first), with their sizes."""
    lengths = iov[:, 1].astype(np.int64)  # a row's length fits: it is in memory
    if int(lengths.max()) > RECV_CHUNK:
        count = -(-lengths // RECV_CHUNK)
        row = np.repeat(np.arange(len(iov)), count)
        start = (np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)) * RECV_CHUNK
        lengths = np.minimum(RECV_CHUNK, lengths[row] - start)
        split = np.empty((len(row), 2), dtype=np.uint64)
        split[:, 0] = iov[row, 0] + start.astype(np.uint64)
        split[:, 1] = lengths
        iov = split
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, np.arange(RECV_CHUNK, nbytes, RECV_CHUNK), side="left") + 1
    out = []
    row0 = done = 0
    for cut in (*np.unique(cuts).tolist(), len(iov)):
        if cut > row0:
            size = int(ends[cut - 1]) - done
            out.append((iov[row0:cut], size))
            done += size
            row0 = cut
    return out


def _recv_all(sock: socket.socket, iov: np.ndarray, nbytes: int,
              patient: bool = False, pace: Pace | None = None) -> None:
    assert _libc is not None
    got = 0
    while got < nbytes:
        if got and pace is not None:
            pace.check(nbytes - got)
        try:
            n = _call(_libc.recvmsg, sock.fileno(), _advance(iov, got) if got else iov,
                      _WAITALL)
        except OSError as exc:
            if patient and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                if pace is not None:  # none came within the socket's bound
                    pace.check(nbytes - got)
                continue
            raise
        if n == 0:
            raise ConnectionResetError("connection closed by peer")
        got += n
        if pace is not None:
            pace.got += n


# Calls that cannot block, made while holding the GIL: a call that releases it must win
# it back afterwards, which costs up to the switch interval (5 ms) when a Python thread
# of the application is busy. Bytes the kernel already holds are taken without that
# hand-off; only a call that has to wait for the peer releases the GIL.
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
READY_BYTES = 1 << 20  # most bytes copied in one GIL-holding call (about 0.1-0.2 ms)


def _load_held() -> Any:
    if _libc is None or not _DONTWAIT:
        return None
    try:
        held = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held
        for name in ("send", "recv"):
            fn = getattr(held, name)
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
        held.recvmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
        held.recvmsg.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):
        return None
    return held


_held = _load_held()


def _held_result(n: int) -> int:
    """``n`` from a held call, -1 for "nothing there yet"; raises OSError on errors."""
    if n >= 0:
        return n
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
        return -1
    raise OSError(err, os.strerror(err))


def recv_ready(sock: socket.socket, buf: Any, nbytes: int) -> int:
    """Copies up to ``nbytes`` bytes the kernel already holds into writable ``buf``
    without giving up the GIL; returns how many, 0 at the end of the stream, -1 when
    none are there (or this host cannot tell). Raises OSError."""
    if _held is None or nbytes <= 0:
        return -1
    addr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(buf))
    return _held_result(int(_held.recv(sock.fileno(), addr, nbytes, _DONTWAIT)))


def send_ready(sock: socket.socket, data: bytes) -> int:
    """Sends as much of ``data`` as the socket buffer takes now, without giving up the
    GIL; returns how many bytes (-1: none, or this host cannot tell). Raises OSError."""
    if _held is None or not data:
        return -1
    return _held_result(int(_held.send(sock.fileno(), data, len(data),
                                       _DONTWAIT | _NOSIGNAL)))


def recv_iov_ready(sock: socket.socket, iov: np.ndarray, limit: int = READY_BYTES) -> int:
    """Scatters into ``iov`` up to ``limit`` bytes the kernel already holds, without
    giving up the GIL; returns how many (0: end of stream, -1: none there)."""
    if _held is None:
        return -1
    rows = head_rows(np.ascontiguousarray(iov, dtype=np.uint64), limit)[:IOV_MAX]
    hdr = _MsgHdr(None, 0, rows.ctypes.data, len(rows), None, 0, 0)
    return _held_result(int(_held.recvmsg(sock.fileno(), ctypes.byref(hdr), _DONTWAIT)))


def host_rows(request: WorkRequest, segments: Sequence[Segment]) -> np.ndarray:
    """The ``(address, length)`` rows of a request's local extents in pinned host
    memory (``segments``): what the stream transports send from or receive into."""
    extents = request.columns
    if extents is None:
        extents = Columns.from_pairs([(loc, loc) for loc in request.local])
    elif extents.iov is not None:  # laid out when its Blocks was built
        return extents.iov
    if len(segments) == 1:
        return iovec_array(extents.loff + segments[0].address, extents.length)
    address = np.zeros(len(extents), dtype=np.int64)
    for seg in segments:
        address[extents.lseg == seg.id] = seg.address
    return iovec_array(extents.loff + address, extents.length)

"""Byte moving for the stream transports: scatter and gather over a socket.

Byte buffers are bytes or byte-format memoryviews (``len`` is their size in bytes).
Each helper makes one system call in the common case, for any number of buffers:
MSG_WAITALL lets the kernel fill a whole scatter list before waking us, and the cursor
arithmetic after a short call runs only when one happened. A stalled peer is bounded in
the kernel (:func:`set_stall_timeout`), so the calls keep their one-call receives.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import socket
import struct
import termios
import time
from bisect import bisect_right
from collections.abc import Generator, Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

from transfer_engine.transport import held
from transfer_engine.transport.iovec import (
    IOVEC_IO,
    Pace,
    _advance,
    iov_views,
    recv_iov,
    recv_some,
    send_iov,
    send_some,
)

_IOV_CHUNK = 1000  # sendmsg/recvmsg_into take at most IOV_MAX buffers
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
EARLY_HEAD_BYTES = 256 << 10
PARK_AFTER = 0.1  # seconds a payload waits for the peer before its thread moves on
PARK_CHUNK = 64 << 10  # bytes that wake a parked tcp receive (or the rest of it)
TRICKLE_PAUSE = 0.01  # seconds a parked unix receive that got a trickle waits for more


class Wait(NamedTuple):
    """What a request served as steps waits for: its socket turning readable (or
    ``writable``), or ``until`` (``time.monotonic()``), when its peer falls behind;
    not ``watch``: ``until`` alone."""

    until: float
    writable: bool = False
    watch: bool = True


Steps = Generator[Wait, None, None]


class PeerClosed(Exception):
    """The stream ended (EOF or reset); translated where the peer's name is known."""


def _recv_into(sock: socket.socket, bufs: Sequence[Any], patient: bool = False) -> int:
    """Bytes received into ``bufs`` (0: the socket's receive bound ran out and
    ``patient`` says to wait on)."""
    try:
        n = sock.recvmsg_into(bufs, 0, _WAITALL)[0]
    except (BlockingIOError, TimeoutError) as exc:
        if patient:
            return 0
        raise PeerClosed(str(exc)) from exc
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
                    nbytes: int | None = None, patient: bool = False,
                    pace: Pace | None = None) -> None:
    """Fills ``views`` in order from ``sock``, scattering with recvmsg_into.

    ``nbytes`` is their total size when the caller knows it. With ``patient``, the
    socket's receive bound running out is no error (see :func:`recv_head`). A peer
    fallen behind ``pace`` (checked whenever a call returns short) raises
    :class:`PeerClosed`.
    """
    if nbytes is None:
        nbytes = sum(map(len, views))
    if nbytes <= 0:
        return
    got = _recv_into(sock, views[:_IOV_CHUNK] if len(views) > _IOV_CHUNK else views,
                     patient)
    if pace is not None:
        pace.got += got
    if got == nbytes:
        return
    ends = list(accumulate(map(len, views)))
    while got < nbytes:
        if pace is not None:
            try:
                pace.check(nbytes - got)
            except TimeoutError as exc:
                raise PeerClosed(str(exc)) from None
        n = _recv_into(sock, _rest(views, ends, got), patient)
        got += n
        if pace is not None:
            pace.got += n


def recv_exact(sock: socket.socket, n: int, patient: bool = False,
               pace: Pace | None = None) -> bytes:
    """The next ``n`` bytes of the stream (``patient`` and ``pace``: see
    :func:`recv_into_views`)."""
    if n <= 0:
        return b""
    data = _recv_first(sock, n, _WAITALL, patient)
    if len(data) == n:
        return data
    buf = _begun(n, data, pace)
    recv_into_views(sock, [memoryview(buf)[len(data):]], n - len(data), patient, pace)
    return bytes(buf)


def _recv_first(sock: socket.socket, n: int, flags: int, patient: bool) -> bytes:
    """What one receive of up to ``n`` bytes brings (nothing, if none came in time and
    ``patient`` says to wait on)."""
    try:
        data = sock.recv(n, flags)
    except (BlockingIOError, TimeoutError, InterruptedError) as exc:
        if not patient:
            raise PeerClosed(str(exc)) from exc
        return b""
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc
    if not data:
        raise PeerClosed("connection closed by peer")
    return data


def _begun(n: int, data: bytes, pace: Pace | None) -> bytearray:
    """A buffer for ``n`` bytes holding the ``data`` they began with (counted by
    ``pace``)."""
    buf = bytearray(n)
    buf[:len(data)] = data
    if pace is not None:
        pace.got += len(data)
    return buf


def recv_head(sock: socket.socket, n: int, linger: float | None = None,
              stall: float | None = None, whole: bool = True) -> bytes | None:
    """The next ``n`` bytes (a request's or an answer's header) if they begin to come
    within ``linger`` seconds, else None. One system call when they come, as a plain
    blocking receive would be: a worker that lingers on a busy rail pays no more per
    request than a thread of its own did.

    Without ``linger`` the socket's own receive bound is the wait, and the rest of the
    header is waited for patiently; with it, the bound is ``stall`` (None: unbounded)
    again on return. Not ``whole``: the part that came in that call, the rest being
    the caller's to take (:func:`recv_bytes_steps`).
    """
    if linger is not None:
        set_recv_timeout(sock, linger)
    try:
        try:
            head = sock.recv(n, _WAITALL)
        except (BlockingIOError, TimeoutError, InterruptedError):
            return None
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
    finally:
        if linger is not None:
            set_recv_timeout(sock, stall)
    if not head:
        raise PeerClosed("connection closed by peer")
    if len(head) < n and whole:
        head += recv_exact(sock, n - len(head), patient=linger is None,
                           pace=None if stall is None else Pace(stall))
    return head


def queued_bytes(sock: socket.socket) -> int:
    """Bytes the kernel holds unread on ``sock`` (0 where it cannot tell)."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


def has_bytes(sock: socket.socket) -> bool:
    """Whether bytes (or the end of the stream, or an error) wait on ``sock`` now."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        pass  # the next read reports it
    return True


def send_views(sock: socket.socket, bufs: Sequence[Any], nbytes: int | None = None,
               pace: Pace | None = None) -> None:
    """Sends every buffer in order, gathering with sendmsg (no concatenation copies).

    ``nbytes`` is their total size when the caller knows it; ``pace``: see
    :func:`send_gather`.
    """
    if nbytes is None:
        nbytes = sum(map(len, bufs))
    try:
        sent = sock.sendmsg(bufs[:_IOV_CHUNK] if len(bufs) > _IOV_CHUNK else bufs)
        if pace is not None:
            pace.got += sent
        if sent == nbytes:
            return
        ends = list(accumulate(map(len, bufs)))
        while sent < nbytes:
            if pace is not None:
                pace.check(nbytes - sent)
            n = sock.sendmsg(_rest(bufs, ends, sent))
            sent += n
            if pace is not None:
                pace.got += n
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


def send_bytes(sock: socket.socket, data: bytes) -> None:
    until = held.until()
    if until is not None and IOVEC_IO and data:
        try:
            sent = held.send_rows(sock, held.buffer_rows(data), len(data), until)
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
        if sent == len(data):
            return
        data = memoryview(data)[sent:]  # type: ignore[assignment]
    try:
        sock.sendall(data)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


class Unsent(NamedTuple):
    """What a held send left: ``nbytes`` bytes at ``rows``, which may point into
    ``keep`` (kept alive with them)."""

    rows: np.ndarray
    nbytes: int
    keep: bytes


def send_rest(sock: socket.socket, rest: Unsent, spill: bool = False,
              pace: Pace | None = None) -> Unsent | None:
    """Sends ``rest`` (blocking socket). In a held window the socket takes what it can
    within the budget holding the GIL, then the rest goes the usual way or, with
    ``spill``, is returned. ``pace``: see :func:`send_gather`."""
    rows, total = rest.rows, rest.nbytes
    try:
        until = held.until()
        if until is not None:  # the caller holds the GIL while the socket takes bytes
            sent = held.send_rows(sock, rows, total, until)
            if pace is not None:
                pace.got += sent
            if sent == total:
                return None
            rows, total = _advance(rows, sent), total - sent
            if spill:
                return Unsent(rows, total, rest.keep)
        send_iov(sock, rows, total, pace)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc
    return None


def send_gather(sock: socket.socket, head: bytes, iov: np.ndarray | None, nbytes: int,
                headroom: np.ndarray | None = None, spill: bool = False,
                pace: Pace | None = None) -> Unsent | None:
    """Sends ``head`` and then the ``nbytes`` bytes ``iov`` describes.

    Above ``EARLY_HEAD_BYTES`` the head goes in a call of its own: with TCP_NODELAY it
    leaves at once, so the target checks the entries while the payload is still being
    copied in, rather than after the sender's first 64 KiB segment. ``headroom``, if
    given, is ``iov`` with one spare row in front, which then describes the head. In
    a held window (:mod:`~transfer_engine.transport.held`) the socket takes what it can
    within the budget holding the GIL, and the rest the usual way, or, with ``spill``,
    is returned (:func:`send_rest`). A peer that takes the bytes slower than ``pace``
    (a target's READ answer to a peer that reads at a trickle) raises
    :class:`PeerClosed`, checked whenever a call returns short.
    """
    if iov is None or not nbytes:
        send_bytes(sock, head)
        return None
    if not IOVEC_IO:
        send_views(sock, [head, *iov_views(iov)], len(head) + nbytes, pace)
        return None
    until = held.until()
    if nbytes >= EARLY_HEAD_BYTES and until is None:
        send_bytes(sock, head)
        try:
            send_iov(sock, iov, nbytes, pace)
        except OSError as exc:
            raise PeerClosed(str(exc)) from exc
        return None
    if headroom is not None:
        rows = headroom
    else:
        rows = np.empty((len(iov) + 1, 2), dtype=np.uint64)
        rows[1:] = iov
    # the address of the bytes object's own buffer (no copy); ``head`` outlives the call
    rows[0] = (ctypes.cast(ctypes.c_char_p(head), ctypes.c_void_p).value or 0, len(head))
    return send_rest(sock, Unsent(rows, len(head) + nbytes, head), spill, pace)


def recv_scatter(sock: socket.socket, iov: np.ndarray, nbytes: int,
                 patient: bool = False, pace: Pace | None = None) -> None:
    """Fills the ``nbytes`` bytes ``iov`` describes from ``sock`` (``patient`` and
    ``pace``: see :func:`recv_into_views`)."""
    if not nbytes:
        return
    if not IOVEC_IO:
        recv_into_views(sock, iov_views(iov), nbytes, patient, pace)
        return
    try:
        until = held.until()
        if until is not None:  # the caller holds the GIL while the bytes come
            got = held.recv_rows(sock, np.ascontiguousarray(iov, dtype=np.uint64), nbytes,
                                 until)
            if pace is not None:
                pace.got += got
            if got == nbytes:
                return
            iov, nbytes = _advance(iov, got), nbytes - got
        recv_iov(sock, iov, nbytes, patient=patient, pace=pace)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc


def recv_bytes_steps(sock: socket.socket, n: int, pace: Pace, stall: float
                     ) -> Generator[Wait, None, bytes]:
    """The next ``n`` bytes (a request's header, entries or body) as steps: what the
    socket holds at once, in one call, and the rest as :func:`recv_steps` takes a slow
    peer's payload (``n`` > 0)."""
    data = _recv_first(sock, n, socket.MSG_DONTWAIT, patient=True)
    if len(data) == n:
        return data
    buf = _begun(n, data, pace)
    yield from recv_steps(sock, held.buffer_rows(memoryview(buf)[len(data):]),
                          n - len(data), pace, stall)
    return bytes(buf)


def recv_steps(sock: socket.socket, iov: np.ndarray, nbytes: int, pace: Pace,
               stall: float) -> Steps:
    """Fills the ``nbytes`` bytes ``iov`` describes, as steps: once a receive has not
    brought them all within :data:`PARK_AFTER`, yields when more must have come
    (``pace``), so that the thread serves others meanwhile; resume it when the socket
    turns readable or at that time. A payload that comes fast still comes in one call
    (with the GIL given up, so that rails copy side by side). The socket's receive
    bound is ``stall`` again at the end."""
    yield from _steps(sock, np.ascontiguousarray(iov, dtype=np.uint64), nbytes, pace, stall,
                      False)


def _steps(sock: socket.socket, rows: np.ndarray, nbytes: int, pace: Pace, stall: float,
           writable: bool) -> Steps:
    """:func:`recv_steps` or :func:`send_steps`. The first call waits up to
    :data:`PARK_AFTER`; once one has left bytes to move, the request parks, and every
    call after a park moves only what the socket takes at once: a peer that sends (or
    reads) a byte now and then, however often, holds no thread between them. While a
    tcp receive is parked, its socket reports readable only once :data:`PARK_CHUNK`
    bytes (or the rest) are there, so that a trickle wakes a worker per chunk; a unix
    socket's readiness ignores that mark, so there a parked receive that got less
    waits :data:`TRICKLE_PAUSE` before it looks again."""
    move = send_some if writable else recv_some
    bound = set_send_timeout if writable else set_recv_timeout
    chunked = not writable and sock.family != socket.AF_UNIX
    done = 0
    low = 1
    parked = False
    try:
        bound(sock, PARK_AFTER)
        while True:
            n = move(sock, _advance(rows, done) if done else rows, not parked)
            done += n
            pace.got += n
            if done >= nbytes:
                return
            pace.check(nbytes - done)  # after taking what came: it counts
            if parked and n >= PARK_CHUNK:
                continue  # the peer keeps up: more may be there already
            if chunked and min(nbytes - done, PARK_CHUNK) != low:
                low = min(nbytes - done, PARK_CHUNK)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low)
            trickle = parked and n > 0 and not writable and not chunked
            parked = True
            if trickle:
                yield Wait(min(pace.until(), time.monotonic() + TRICKLE_PAUSE), False, False)
            else:
                yield Wait(pace.until(), writable)
    except OSError as exc:
        raise PeerClosed(str(exc)) from exc
    finally:
        try:
            bound(sock, stall)
            if low != 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        except OSError:
            pass  # closed meanwhile


def send_steps(sock: socket.socket, rows: np.ndarray, nbytes: int, pace: Pace,
               stall: float) -> Steps:
    """Sends the ``nbytes`` bytes ``rows`` describe, as steps: once a send has not
    taken them all within :data:`PARK_AFTER` (a peer that reads slowly), yields until
    the socket turns writable or the peer falls behind ``pace``. The socket's send
    bound is ``stall`` again at the end."""
    yield from _steps(sock, np.ascontiguousarray(rows, dtype=np.uint64), nbytes, pace, stall,
                      True)


def drain(sock: socket.socket, nbytes: int, pace: Pace | None = None) -> None:
    """Receives and drops ``nbytes`` (at ``pace``, if given: a payload a refused
    request still owes is bounded as an accepted one's is)."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes > 0:
        chunk = scratch[:min(nbytes, len(scratch))]
        recv_into_views(sock, [chunk], len(chunk), pace=pace)
        nbytes -= len(chunk)


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def _timeval(seconds: float | None) -> bytes:
    sec = int(seconds or 0)
    return struct.pack("ll", sec, int(((seconds or 0) - sec) * 1e6))


def set_recv_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bounds each pause of a blocking receive on ``sock`` (SO_RCVTIMEO; None: none)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def set_send_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bounds each pause of a blocking send on ``sock`` (SO_SNDTIMEO; None: none)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def set_stall_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bounds, in the kernel, every pause of a blocking call on ``sock`` (SO_RCVTIMEO,
    SO_SNDTIMEO): the data path keeps its one-call receives, and a stalled peer makes a
    call fail with EAGAIN instead of holding a thread forever."""
    tv = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

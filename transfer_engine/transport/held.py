"""Waiting on a peer for a bounded time without giving up the GIL.

Every socket call of Python's releases the GIL and must win it back when it returns.
With a Python thread of the application busy, that costs up to the switch interval (5
ms) per call, longer than the copy of 16 MiB: an initiator that pays it a few times per
transfer keeps a tenth of its idle throughput (docs/data-plane.md, "The busy
initiator"). A thread inside a :func:`window` makes its socket calls non-blocking
through ``ctypes.PyDLL``, which keeps the GIL, and waits for the peer in ``poll``, also
holding it, for up to the window's budget per wait; past it, the ordinary (releasing)
calls take over. The application's other threads so wait at most one budget (the
switch interval by default) for the GIL, which is what the interpreter makes them wait
anyway once this thread asks for it.

Only threads that nothing of this process must run for (the peer is another process)
may hold: a target served by this very process could not move a byte meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import math
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np

from transfer_engine.transport.iovec import _advance, _MsgHdr, head_rows
from transfer_engine.transport.iovec import _call as iovec_call

__all__ = ["AVAILABLE", "Contention", "Turn", "contention", "turn", "budget", "window",
           "until", "grace", "send_rows", "recv_rows", "queued", "peek", "wait_for",
           "recv_exact", "default_budget", "hung_up", "hang_up"]

_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_local = threading.local()


class _EpollEvent(ctypes.Structure):
    # the kernel packs it on x86-64 only
    _pack_ = 1 if os.uname().machine == "x86_64" else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _TimerSpec(ctypes.Structure):
    _fields_ = [("interval", _TimeSpec), ("value", _TimeSpec)]


def _load() -> Any:
    if (not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8
            or sys.byteorder != "little" or not _DONTWAIT):
        return None
    try:
        lib = ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls keep the GIL
        for name in ("sendmsg", "recvmsg"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
        lib.recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.recv.restype = ctypes.c_ssize_t
        lib.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        lib.ioctl.restype = ctypes.c_int
        lib.ppoll.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong,
                              ctypes.POINTER(_TimeSpec), ctypes.c_void_p]
        lib.ppoll.restype = ctypes.c_int
        lib.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.timerfd_create.restype = ctypes.c_int
        lib.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(_TimerSpec), ctypes.c_void_p]
        lib.timerfd_settime.restype = ctypes.c_int
        lib.epoll_ctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.POINTER(_EpollEvent)]
        lib.epoll_ctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


_lib = _load()
AVAILABLE = _lib is not None


def default_budget() -> float:
    """The longest a window holds the GIL by default: the interpreter's switch interval
    (``$TE_HOLD_GIL`` in seconds overrides it; 0 turns holding off)."""
    value = os.environ.get("TE_HOLD_GIL", "").strip()
    if value:
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"TE_HOLD_GIL must be a number of seconds, not {value!r}"
                             ) from None
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"TE_HOLD_GIL must be a finite number of seconds >= 0, "
                             f"not {value!r}")
        return seconds
    return sys.getswitchinterval()


class Contention:
    """Whether this process's GIL was seen contended lately: a waiter woke well after
    its transfer had finished, which only a thread holding the GIL causes. Holding
    costs an idle process some throughput (more, smaller calls), so a transfer holds
    only for :data:`HOLD_FOR` seconds after such a sighting; then one waits the usual
    way again, and tells."""

    HOLD_FOR = 1.0

    def __init__(self) -> None:
        self.until = 0.0

    def saw(self, lag: float) -> None:
        """A blocked waiter woke ``lag`` seconds after its transfer finished."""
        if lag > max(0.5 * sys.getswitchinterval(), 0.0005):
            self.until = time.monotonic() + self.HOLD_FOR

    def now(self) -> bool:
        return time.monotonic() < self.until


contention = Contention()  # one GIL per process


class Turn:
    """When this thread's turn with the GIL began, as far as the engine can tell.

    A contended GIL changes hands about once a switch interval: the thread that waits
    for it asks the holder to let go after that long. A thread that holds the GIL
    while its peer copies (the waits above) therefore loses it when its turn ends,
    often just after the peer's answer came, and then waits a whole turn of the busy
    thread with nothing in flight. Where a wait would outlast the turn and only the
    peer has work left, giving the GIL up before the wait (:meth:`give`) lets the busy
    thread's turn run while the peer copies.

    The engine sees only its own calls. Between two of them the thread either ran
    (Python of the application: its CPU time grew as fast as the clock, and it held the
    GIL all along) or was off the CPU for more than :data:`GAP` (switched out, or in a
    call that gives the GIL up): then its turn began again when it came back. A held
    wait longer than a turn counts as a switch too.
    """

    GAP = 0.001
    #: one wait in so many that would give the turn for being long holds instead, so
    #: that it is measured again (the host may have become faster)
    PROBE = 16
    #: held waits kept per kind and size class (see :meth:`expect`)
    KEEP = 8
    __slots__ = ("began", "last", "cpu", "_waits")

    def __init__(self) -> None:
        self.began = 0.0
        self.last = -math.inf  # time.monotonic() and time.thread_time() of the last call
        self.cpu = 0.0
        # (kind, size class) -> what its held waits took
        self._waits: dict[tuple[Hashable, int], _Waits] = {}

    def expect(self, kind: Hashable, nbytes: int) -> float | None:
        """How long a held wait for a transfer of this ``kind`` (say, its transport and
        operation) and of about ``nbytes`` is expected to take (None: no such wait was
        seen). Long (more than a turn) once at least three quarters of the last
        :data:`KEEP` were; else the mean of the recent ones that were not. Giving the
        turn early wastes the rest of it where the wait would have fitted, so waits
        the host slowed now and then must not make it expected long; a wait that is
        long for its size (a large transfer) is long nearly every time."""
        seen = self._waits.get((kind, nbytes.bit_length()))
        if seen is None:
            return None
        long = seen.long(self.KEEP // 2)
        return seen.short if long is None else long

    def learned(self, kind: Hashable, nbytes: int, seconds: float) -> None:
        """A held wait for such a transfer ended after ``seconds``. One longer than a
        turn is kept as two turns: past its budget it gave the GIL up and waited for
        it again, so it only tells that the wait outlasts any turn."""
        key = (kind, nbytes.bit_length())
        seen = self._waits.get(key)
        if seen is None:
            seen = self._waits[key] = _Waits(self.KEEP)
        interval = sys.getswitchinterval()
        seen.last.append(min(seconds, 2 * interval))
        if seconds <= interval:
            seen.short = seconds if seen.short is None else 0.8 * seen.short + 0.2 * seconds

    def probe(self, kind: Hashable, nbytes: int) -> bool:
        """Whether this wait, which would give the turn, holds instead to be measured
        again: one in :data:`PROBE` of those expected long."""
        seen = self._waits.get((kind, nbytes.bit_length()))
        if seen is None or seen.long(self.KEEP // 2) is None:
            return False
        seen.gives = (seen.gives + 1) % self.PROBE
        return seen.gives == 0

    def resume(self, now: float, cpu: float | None = None) -> None:
        """The engine runs in this thread again at ``now`` (``cpu``: the thread's
        ``time.thread_time()`` then)."""
        cpu = time.thread_time() if cpu is None else cpu
        if (now - self.last) - (cpu - self.cpu) > self.GAP:
            self.began = now  # off the CPU meanwhile
        self.last, self.cpu = now, cpu

    def pause(self, now: float, waited: float, cpu: float | None = None) -> None:
        """The engine leaves at ``now`` after a held wait of ``waited`` seconds (off
        the CPU, but holding the GIL unless it was longer than a turn)."""
        if waited > sys.getswitchinterval():
            self.began = now
        self.last, self.cpu = now, time.thread_time() if cpu is None else cpu

    def left(self, now: float) -> float:
        """Seconds of the turn left at ``now`` (at most a switch interval)."""
        return sys.getswitchinterval() - (now - self.began)

    def give(self) -> None:
        """Lets another thread have the GIL (back once it had a turn, or at once if
        none wanted it): a new turn begins."""
        time.sleep(0)
        self.began = self.last = time.monotonic()
        self.cpu = time.thread_time()


class _Waits:
    """What held waits of one kind and size class took (:meth:`Turn.expect`)."""

    __slots__ = ("last", "short", "gives")

    def __init__(self, keep: int) -> None:
        self.last: collections.deque[float] = collections.deque(maxlen=keep)
        self.short: float | None = None  # the mean of those that fitted in a turn
        self.gives = 0  # since the last probe

    def long(self, enough: int) -> float | None:
        """The lower quartile of the last waits, if there are ``enough`` and it is
        longer than a turn; else None."""
        if len(self.last) < enough:
            return None
        quartile = sorted(self.last)[len(self.last) // 4]
        return quartile if quartile > sys.getswitchinterval() else None


def turn() -> Turn:
    """This thread's :class:`Turn`."""
    current: Turn | None = getattr(_local, "turn", None)
    if current is None:
        current = _local.turn = Turn()
    return current


def budget(seconds: float | None) -> float:
    """An engine's ``hold_gil``: ``seconds`` once checked, or :func:`default_budget`."""
    if seconds is None:
        return default_budget()
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
            0 <= seconds < math.inf):
        raise ValueError(f"hold_gil must be a finite number of seconds >= 0, not {seconds!r}")
    return float(seconds)


@contextlib.contextmanager
def window(seconds: float) -> Iterator[None]:
    """Within it, each stream call of this thread that waits for the peer holds the GIL
    for up to ``seconds`` (0: takes what is there, never waits; nested windows keep the
    shorter)."""
    before = getattr(_local, "budget", None)
    if seconds < 0 or _lib is None:
        yield
        return
    _local.budget = seconds if before is None else min(before, seconds)
    try:
        yield
    finally:
        _local.budget = before


def grace() -> float:
    """How long a socket this thread sent on is left to it to read the answer from
    (it may be switched out for a while in between); 0 outside a window."""
    budget = getattr(_local, "budget", None)
    return 0.0 if budget is None else 3 * budget + 0.002


def until() -> float | None:
    """In a window, how long (``time.monotonic()``) a wait that starts now may hold the
    GIL; else None. Each wait has its own: between two, the interpreter may switch."""
    budget: float | None = getattr(_local, "budget", None)
    return None if budget is None else time.monotonic() + budget


_EPOLL_CTL_MOD = 3


def epoll_modify(epfd: int, fd: int, events: int) -> None:
    """``epoll.modify`` (``fd`` registered by Python's ``select.epoll``, whose data is
    the fd) without giving up the GIL; raises OSError (or ValueError off Linux)."""
    if _lib is None:
        raise ValueError("no held calls on this host")
    ev = _EpollEvent(events, fd)
    if _lib.epoll_ctl(epfd, _EPOLL_CTL_MOD, fd, ctypes.byref(ev)) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _poll(fd: int, events: int, until: float) -> bool:
    """Whether ``fd`` turned ready for ``events`` (or failed) before ``until`` (looked
    at once if that has passed), waited for holding the GIL."""
    assert _lib is not None
    pfd = _PollFd(fd, events, 0)
    while True:
        left = max(0.0, until - time.monotonic())
        sec = int(left)
        n = _lib.ppoll(ctypes.byref(pfd), 1,
                       ctypes.byref(_TimeSpec(sec, int((left - sec) * 1e9))), None)
        if n > 0:
            return True
        if n == 0:
            if left <= 0 or time.monotonic() >= until:
                return False
            continue
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


_HUP = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP


def hung_up(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether the peer of ``sock`` shut its end down or closed it, even with bytes of
    its still unread here (or the socket failed). Looked at once holding the GIL, or
    waited for up to ``wait`` seconds giving it up (the peer may be this process)."""
    if _lib is not None and wait <= 0:
        return _poll(sock.fileno(), _HUP, 0.0)
    poller = select.poll()
    poller.register(sock.fileno(), _HUP)
    return bool(poller.poll(max(0.0, wait) * 1e3))


def hang_up(sock: socket.socket, wait: float) -> None:
    """Shuts our sending side of ``sock`` down and waits up to ``wait`` seconds for the
    peer to close its end (a socket closed meanwhile ends the wait)."""
    with contextlib.suppress(OSError, ValueError):
        sock.shutdown(socket.SHUT_WR)
        hung_up(sock, wait)


def _check(result: int) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def timer() -> int | None:
    """A new non-blocking monotonic timerfd (the caller closes it); None off Linux."""
    if _lib is None:
        return None
    return _check(_lib.timerfd_create(time.CLOCK_MONOTONIC,
                                      os.O_NONBLOCK | os.O_CLOEXEC))


def set_timer(fd: int, delay: float | None) -> None:
    """Makes timerfd ``fd`` fire once ``delay`` seconds from now (None: never),
    holding the GIL."""
    assert _lib is not None
    if delay is None:
        value = _TimeSpec(0, 0)
    else:
        delay = max(delay, 1e-6)  # zero would disarm it
        sec = int(delay)
        value = _TimeSpec(sec, int((delay - sec) * 1e9))
    _check(_lib.timerfd_settime(fd, 0, ctypes.byref(_TimerSpec(_TimeSpec(0, 0), value)),
                                None))


CALL_BYTES = 2 << 20  # most bytes one call moves (a peer draining as fast keeps it going)


def _call(fn: Any, fd: int, rows: np.ndarray, flags: int, left: int) -> int:
    """Bytes moved by one non-blocking call over the first :data:`CALL_BYTES` of
    ``rows`` (``left`` bytes); -1 if it would block."""
    try:
        return iovec_call(fn, fd, head_rows(rows, CALL_BYTES) if left > CALL_BYTES
                          else rows, flags)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return -1
        raise


class _Stretch:
    """A wait's deadline while bytes move: each call that moves some gives the next
    wait a whole budget again, up to four budgets in all (copying is not waiting, but
    a peer that trickles its bytes must not hold us long either)."""

    __slots__ = ("budget", "cap")

    def __init__(self, until: float) -> None:
        now = time.monotonic()
        self.budget = max(until - now, 0.0)
        self.cap = now + 4 * self.budget

    def moved(self) -> float:
        return min(self.cap, time.monotonic() + self.budget)


def send_rows(sock: socket.socket, rows: np.ndarray, nbytes: int, until: float) -> int:
    """Sends the ``nbytes`` bytes ``rows`` describes, in order, until ``until`` (moved
    on while the socket takes bytes: :class:`_Stretch`); returns how many it sent (the
    caller sends the rest). Raises OSError."""
    assert _lib is not None
    fd = sock.fileno()
    sent = 0
    stretch = _Stretch(until)
    while sent < nbytes:
        n = _call(_lib.sendmsg, fd, _advance(rows, sent) if sent else rows,
                  _DONTWAIT | _NOSIGNAL, nbytes - sent)
        if n > 0:
            sent += n
            until = stretch.moved()
            if time.monotonic() >= until:
                break
        elif not _poll(fd, select.POLLOUT, until):
            break
    return sent


def recv_rows(sock: socket.socket, rows: np.ndarray, nbytes: int, until: float) -> int:
    """Fills the ``nbytes`` bytes ``rows`` describes, in order, until ``until``;
    returns how many arrived. Raises ``ConnectionResetError`` at the stream's end,
    OSError otherwise.

    While bytes are still to come, the socket reports readable only once
    :data:`CALL_BYTES` of them (or the rest) are there (``SO_RCVLOWAT``): a wake-up per
    packet costs more than the copy.
    """
    assert _lib is not None
    fd = sock.fileno()
    got = 0
    low = 1
    stretch = _Stretch(until)
    try:
        while got < nbytes:
            n = _call(_lib.recvmsg, fd, _advance(rows, got) if got else rows, _DONTWAIT,
                      nbytes - got)
            if n == 0:
                raise ConnectionResetError("connection closed by peer")
            if n > 0:
                got += n
                until = stretch.moved()
                if time.monotonic() >= until:
                    break
                continue
            want = min(nbytes - got, CALL_BYTES)
            if want != low and sock.family != socket.AF_UNIX:
                low = want
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low)
            if not _poll(fd, select.POLLIN, until):
                break
    finally:
        if low != 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return got


def buffer_rows(buf: Any) -> np.ndarray:
    """One row (address, length) describing a writable buffer or bytes object."""
    if isinstance(buf, bytes):
        address = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
        return np.array([(address, len(buf))], dtype=np.uint64)
    view = memoryview(buf).cast("B")
    address = ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))
    return np.array([(address, len(view))], dtype=np.uint64)


_FIONREAD = 0x541B


def queued(sock: socket.socket) -> int:
    """Bytes the kernel holds unread on ``sock``, asked holding the GIL (0 on error)."""
    assert _lib is not None
    count = ctypes.c_int(0)
    if _lib.ioctl(sock.fileno(), _FIONREAD, ctypes.byref(count)) < 0:
        return 0
    return count.value


def peek(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes the kernel holds, left there, asked holding the GIL."""
    assert _lib is not None
    buf = ctypes.create_string_buffer(n)
    k = int(_lib.recv(sock.fileno(), buf, n, _DONTWAIT | socket.MSG_PEEK))
    return buf.raw[:k] if k > 0 else b""


def wait_for(sock: socket.socket, nbytes: int, until: float) -> bool:
    """Whether ``nbytes`` bytes (or the stream's end) are queued on ``sock`` before
    ``until``, waited for holding the GIL; a TCP socket reports readable only once
    they are (``SO_RCVLOWAT``), others are looked at again after each wake-up."""
    fd = sock.fileno()
    low = 1
    try:
        while True:
            have = queued(sock)
            if have >= nbytes:
                return True
            if sock.family != socket.AF_UNIX and nbytes - have != low:
                low = nbytes - have
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low)
            if not _poll(fd, select.POLLIN, until):
                return False
            if peek(sock, 1) == b"" and queued(sock) == 0:
                return True  # the stream's end (or an error): the reader finds out
    finally:
        if low != 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def recv_exact(sock: socket.socket, n: int, until: float) -> bytes:
    """The next ``n`` bytes, or those of them that came before ``until`` (none: the
    stream is quiet). Raises ``ConnectionResetError`` at the stream's end."""
    assert _lib is not None
    buf = ctypes.create_string_buffer(n)
    fd = sock.fileno()
    got = 0
    while True:
        k = int(_lib.recv(fd, ctypes.byref(buf, got), n - got, _DONTWAIT))
        if k == 0:
            raise ConnectionResetError("connection closed by peer")
        if k > 0:
            got += k
            if got == n:
                return buf.raw
            continue
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            raise OSError(err, os.strerror(err))
        if err != errno.EINTR and not _poll(fd, select.POLLIN, until):
            return buf.raw[:got]

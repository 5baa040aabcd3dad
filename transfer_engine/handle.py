"""Transfer handles: what ``Engine.write`` / ``Engine.read`` return.

A handle is PENDING until the transfer ends, then DONE or FAILED, once:

- ``wait(timeout)`` returns once every byte landed (and the notification was sent), or
  raises the transfer's error; when only the *wait* ran out it raises
  ``TransferTimeout`` and the transfer goes on.
- A transfer submitted with a deadline (``Engine.write(..., timeout=)``, or the
  engine's ``transfer_timeout``) that has not finished by then fails with
  ``TransferTimeout``, as a cancel would.
- ``cancel()`` fails it with ``TransferCancelled`` (True), or does nothing to a finished
  one (False). Work not yet sent is withdrawn; work already on the wire is stopped by
  tearing down its rail, and other transfers on that rail fail over to another
  transport or fail with ``PeerLostError``; the next transfer over tcp opens a new rail.
- A peer that stops answering (no reply to probes for ``peer_timeout``) fails it with
  ``PeerLostError``.

Whatever ends it, the handle finishes only once this side no longer copies bytes from
or into its local memory, and its segments are unpinned then. On failure any prefix of
the destination may have been written and the notification was not delivered. Two
limits of a cancel (or deadline): a WRITE's bytes already in the peer's kernel may
still land there after the handle failed (the aborted rail is reset, which drops most
of them), and so, if a request's last byte had already reached it, may its
notification; and over ``shm`` the peer copies, so a request it had already taken may
still complete in our memory if that peer was stalled and resumes.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from transfer_engine.descriptor import Op
from transfer_engine.errors import TransferCancelled, TransferError, TransferTimeout

if TYPE_CHECKING:
    from transfer_engine.errors import TransferEngineError

__all__ = ["TransferState", "TransferHandle"]

log = logging.getLogger(__name__)

CANCEL_WAIT = 5.0  # seconds cancel() waits for threads in a system call to let go


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"  # every byte landed (and the notification, if any, was sent)
    FAILED = "failed"


class TransferHandle:
    """Tracks one transfer. ``wait`` returns once every byte landed, or raises.

    On failure, any prefix of the destination may have been written and the notification
    was not delivered; ``error`` says what went wrong, with peer, op and transport.
    """

    __slots__ = ("id", "op", "peer", "nbytes", "transport", "_state", "_error",
                 "_bytes_done", "_latch", "_lock", "_canceller", "_assist", "_lagged",
                 "_done_at", "_callbacks", "__weakref__")

    def __init__(self, transfer_id: int, op: Op, peer: str, nbytes: int) -> None:
        self.id = transfer_id
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.transport: str | None = None
        self._state = TransferState.PENDING
        self._error: TransferError | None = None
        self._bytes_done = 0
        # held while pending, released once by _finish; each waiter passes it on. One
        # futex hand-off wakes a waiter (an Event takes a condition and two locks).
        self._latch = threading.Lock()
        self._latch.acquire()
        self._lock = threading.Lock()
        # set by the engine: stops the transfer with an error; False if it had finished
        self._canceller: Callable[[TransferHandle, TransferError], bool] | None = None
        # set by the engine: takes completions in the waiting thread for a while,
        # holding the GIL (transport/held.py); the wait then goes on as usual
        self._assist: Callable[[TransferHandle, float | None], None] | None = None
        # set by the engine: hears how long after the finish a blocked waiter woke
        self._lagged: Callable[[float], None] | None = None
        self._done_at = 0.0
        self._callbacks: list[Callable[[TransferHandle], None]] | None = None

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def bytes_done(self) -> int:
        return self._bytes_done

    def done(self) -> bool:
        """Whether the transfer finished (its completions already here are taken
        first, in this thread: see ``Engine(hold_gil=)``)."""
        if self._state is TransferState.PENDING and self._assist is not None:
            self._assist(self, 0.0)
        return self._state is not TransferState.PENDING

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the transfer finished; raises its error, or ``TransferTimeout``
        (the transfer goes on; wait again or close the engine to abandon it)."""
        left = timeout
        if self._state is TransferState.PENDING and self._assist is not None:
            start = time.monotonic()
            self._assist(self, timeout)
            if timeout is not None:
                left = timeout - (time.monotonic() - start)
        if self._state is TransferState.PENDING:
            if not self._latch.acquire(timeout=-1 if left is None else max(left, 0.0)):
                raise TransferTimeout(f"transfer {self.id} not finished after {timeout}s",
                                      peer=self.peer, op=str(self.op),
                                      transport=self.transport, length=self.nbytes)
            self._latch.release()
            if self._lagged is not None:
                self._lagged(time.monotonic() - self._done_at)
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Calls ``fn(handle)`` once the transfer finished, done or failed: at once, in
        this thread, if it has; else in the thread that finishes it (a transport's:
        ``fn`` must be quick and never wait). An exception from ``fn`` is logged."""
        with self._lock:
            if self._state is TransferState.PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def cancel(self) -> bool:
        """Stops the transfer: it fails with :class:`TransferCancelled`. Returns False
        (and changes nothing) if it had already finished, True if this call cancelled
        it. On True the handle has failed, unless a thread of ours was inside a system
        call on its memory: the socket is shut down under it and the handle fails as it
        returns (waited for here up to :data:`CANCEL_WAIT` seconds)."""
        if self._state is not TransferState.PENDING:
            return False
        error = TransferCancelled(f"transfer {self.id} cancelled", peer=self.peer,
                                  op=str(self.op), transport=self.transport)
        canceller = self._canceller
        if canceller is None:  # not driven by an engine: nothing else to stop
            return self._finish(error)
        if not canceller(self, error):
            return False
        if self._latch.acquire(timeout=CANCEL_WAIT):
            self._latch.release()
        return True

    # engine side
    def _add_bytes(self, n: int) -> None:
        with self._lock:
            self._bytes_done += n

    def _finish(self, error: TransferEngineError | None = None) -> bool:
        with self._lock:
            if self._state is not TransferState.PENDING:
                return False
            if error is not None:
                assert isinstance(error, TransferError)
                self._error = error.with_context(peer=self.peer, op=str(self.op),
                                                 transport=self.transport)
                self._state = TransferState.FAILED
            else:
                self._state = TransferState.DONE
            self._done_at = time.monotonic()
            callbacks, self._callbacks = self._callbacks, None
        self._latch.release()
        for fn in callbacks or ():
            _call(fn, self)
        return True

    def __repr__(self) -> str:
        return (f"<TransferHandle {self.id:#x} {self.op.name} \u2192{self.peer} "
                f"{self._bytes_done}/{self.nbytes}B via {self.transport} {self._state.name}>")


def _call(fn: Callable[[TransferHandle], None], handle: TransferHandle) -> None:
    try:
        fn(handle)
    except Exception:
        log.exception("done callback of %r failed", handle)

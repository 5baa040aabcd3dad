"""Ctrl-C held back while the caller's thread does the engine's bookkeeping.

A thread that submits a transfer, or waits for one holding the GIL (``held``), sends
requests, takes answers and finishes transfers itself. A KeyboardInterrupt raised in
the middle of that would leave a stream half-sent (its rail must go), a transfer
posted in part, or a handle that never finishes. Python raises it from SIGINT's
handler, which only the main thread runs, between two bytecodes. :class:`Deferred`
swaps that handler, for the duration of a bounded block, for one that notes the
signal, then runs the original once, as it would have run, when the block ends.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

try:  # the C module: the ``signal`` wrappers cost microseconds in enum conversions
    import _signal as _sig
except ImportError:  # pragma: no cover - not CPython
    import signal as _sig

__all__ = ["Deferred", "allowed", "blocking", "term"]

_SIGINT = int(_sig.SIGINT)
_MAIN = threading.main_thread().ident
_local = threading.local()


def _on_stack(target: FrameType | None, frame: FrameType | None) -> bool:
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


class Deferred:
    """A block in which Ctrl-C waits: its Python handler runs once the block ends
    (with the frame it would have seen). Only the main thread, and only a Python
    handler, is concerned: ``SIG_IGN`` ignores and ``SIG_DFL`` kills as before. Use it
    as ``with Deferred():`` in the function whose work it guards. A block inside
    another leaves it to the outer one.

    Should another signal's handler raise in the block's exit before the handler is
    back, the note left installed notices at the next SIGINT (the guarded function is
    no longer running) and puts the handler back then, and runs it."""

    __slots__ = ("_before", "_caught", "_frame")

    def __init__(self) -> None:
        self._before: Any = None
        self._caught: Any = None
        self._frame: FrameType | None = None  # the guarded function's, while it runs

    def _note(self, signum: int, frame: Any) -> None:
        if _on_stack(self._frame, frame):
            if self._caught is None:
                self._caught = (signum, frame)
            return
        _sig.signal(_SIGINT, self._before)  # left behind by an exit cut short
        self._before(signum, frame)

    def __enter__(self) -> Deferred:
        if threading.get_ident() != _MAIN:
            return self
        before = _sig.getsignal(_SIGINT)
        owner = getattr(before, "__self__", None)
        if type(owner) is Deferred:
            if _on_stack(owner._frame, sys._getframe(1)):
                return self  # inside another block: its end runs the handler
            before = owner._before  # a block whose exit was cut short
        if not callable(before):
            return self
        try:
            _sig.signal(_SIGINT, self._note)
        except ValueError:  # not the main interpreter
            return self
        self._before = before
        self._frame = sys._getframe(1)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._before is None:
            return
        try:
            self._let_through()
        finally:
            self._before = self._frame = None

    def _let_through(self) -> None:
        """Puts the original handler back, and runs it for the signal noted, if any."""
        _sig.signal(_SIGINT, self._before)
        caught, self._caught = self._caught, None
        if caught is not None:
            self._before(*caught)


@contextlib.contextmanager
def allowed(allow: bool = True) -> Iterator[None]:
    """Marks a stretch of a :class:`Deferred` block in which a call that may block for
    long (:func:`blocking`) may be cut short: where nothing half done would be left
    (no completion is being taken there). ``allow=False`` marks nothing."""
    before = getattr(_local, "allowed", False)
    _local.allowed = before or allow
    try:
        yield
    finally:
        _local.allowed = before


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """Around a call that may block for long (a handshake with a peer that does not
    answer): Ctrl-C acts at once, one noted already included, where the caller
    :func:`allowed` it; else it waits for its block's end as usual."""
    current = (_sig.getsignal(_SIGINT) if getattr(_local, "allowed", False)
               and threading.get_ident() == _MAIN else None)
    owner = getattr(current, "__self__", None)
    if type(owner) is not Deferred or owner._before is None:
        yield
        return
    try:
        owner._let_through()
        yield
    finally:
        _sig.signal(_SIGINT, current)


def term(context: Any) -> None:
    """Terminates a ZeroMQ ``context`` with SIGINT blocked in this thread. A signal
    that interrupts libzmq's term makes it return early, and pyzmq then forgets the
    context, leaking its threads and descriptors; blocked here, the signal waits (or
    goes to another thread) and its handler runs once term is done. Call it once the
    context's sockets are closed, so that term returns."""
    before = _sig.pthread_sigmask(_sig.SIG_BLOCK, {_SIGINT})
    try:
        context.term()
    finally:
        _sig.pthread_sigmask(_sig.SIG_SETMASK, before)

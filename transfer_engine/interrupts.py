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

import threading
from types import TracebackType
from typing import Any

try:  # the C module: the ``signal`` wrappers cost microseconds in enum conversions
    import _signal as _sig
except ImportError:  # pragma: no cover - not CPython
    import signal as _sig

__all__ = ["Deferred", "term"]

_SIGINT = int(_sig.SIGINT)
_MAIN = threading.main_thread().ident


class Deferred:
    """A block in which Ctrl-C waits: its Python handler runs once the block ends
    (with the frame it would have seen). Only the main thread, and only a Python
    handler, is concerned: ``SIG_IGN`` ignores and ``SIG_DFL`` kills as before."""

    __slots__ = ("_before", "_caught")

    def __init__(self) -> None:
        self._before: Any = None
        self._caught: Any = None

    def _note(self, signum: int, frame: Any) -> None:
        if self._caught is None:
            self._caught = (signum, frame)

    def __enter__(self) -> Deferred:
        if threading.get_ident() != _MAIN:
            return self
        before = _sig.getsignal(_SIGINT)
        if callable(before):
            try:
                _sig.signal(_SIGINT, self._note)
            except ValueError:  # not the main interpreter
                return self
            self._before = before
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        _sig.signal(_SIGINT, before)
        caught, self._caught = self._caught, None
        if caught is not None:
            before(*caught)



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

"""A waiting caller reads its rail itself (:meth:`StreamRail.assist`), holding the GIL.

Functions of :class:`~transfer_engine.transport.stream.rail.StreamRail` (``rail``), in a
module of their own: see
:mod:`~transfer_engine.transport.held` for why and docs/data-plane.md for the measure.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from transfer_engine.descriptor import Op
from transfer_engine.errors import PeerLostError
from transfer_engine.transport import held
from transfer_engine.transport.base import Work
from transfer_engine.transport.stream.io import PeerClosed
from transfer_engine.transport.stream.wire import ANSWER, KIND_ANSWER

__all__ = ["assist", "send_queued", "waits_only", "whole_answer"]


def waits_only(rail: Any, works: Sequence[Work]) -> bool:
    """Every request of ``works`` sent whole (a WRITE's payload too), and no READ's
    bytes to come to us (unless the target copies them itself)."""
    if not rail.peer_copies and any(work.op is Op.READ for work in works):
        return False
    ids = {id(work) for work in works}
    with rail._lock:
        return not (any(key in ids for key in rail._queued)
                    or any(key in ids for key in rail._touched)
                    or (rail._parked is not None and id(rail._parked[0]) in ids))


def assist(rail: Any, works: Sequence[Work]) -> bool:
    """Sends those of ``works`` still queued (unless a worker is sending on the
    rail: it needs the GIL this thread would hold) and takes this rail's answers in
    the calling thread, inside its held window (held.py), while one of ``works``
    waits for one here. Nothing waits past the window's budget: a payload the socket
    does not take goes on in a worker, and an answer (with a READ's bytes) is taken
    only once it is whole in the kernel. Returns whether it took any answer."""
    ids = {id(work) for work in works}
    if not send_queued(rail, works, ids):
        return False
    with rail._lock:
        if (rail._released or any(key in ids for key in rail._queued)
                or (rail._parked is not None and id(rail._parked[0]) in ids)
                or not rail._claim()):
            return False
        rail._enter()
    alive = True
    took = False
    midway = False
    rail._pump.quiet(rail._fd)  # the poller would wake to contend for the GIL
    try:
        while True:
            with rail._lock:
                if not any(id(work) in ids for work in rail._pending):
                    break
            until = held.until()
            if until is None or not whole_answer(rail, until):
                break
            midway = True  # from here a part of the answer may be consumed
            head = held.recv_exact(rail._sock, ANSWER.size, until)
            if len(head) < ANSWER.size:  # it was whole a moment ago: the stream broke
                raise PeerClosed("answer cut short")
            alive = bool(rail._answer(head))
            midway = False
            took = True
            if not alive:
                break
    except (PeerClosed, OSError) as exc:
        alive = False
        if not rail._closed:
            rail._fail_all(rail._error(PeerLostError, f"connection lost: {exc}"))
    except BaseException as exc:  # interrupted (Ctrl-C): a half-read answer breaks
        if midway:                # the stream, so the rail goes
            alive = False
            rail._interrupted("read", exc)
        raise
    finally:
        rail._unclaim()
        if alive:
            rail._pump.unhold(rail._fd)
        rail._leave()
    return took


def send_queued(rail: Any, works: Sequence[Work], ids: set[int] | None = None) -> bool:
    """Sends those of ``works`` still queued in this thread, unless a worker is sending
    on the rail (it needs the GIL this thread would hold): False then, or if the rail
    is done."""
    ids = {id(work) for work in works} if ids is None else ids
    me = threading.get_ident()
    with rail._lock:
        if rail._released or rail._failure is not None:
            return False
        if rail._drainer is not None and rail._drainer != me:
            return False
        unsent = (any(key in ids for key in rail._queued)
                  or (rail._parked is not None and id(rail._parked[0]) in ids))
    if unsent:  # a drain is scheduled, not begun: this thread sends them itself
        rail._drain_sends(spill=True)
    return True


def whole_answer(rail: Any, until: float) -> bool:
    """Waits, holding the GIL until ``until`` at most, for the next answer to be
    whole in the kernel, with a READ's bytes when they follow it; False if it was
    not by then, or cannot ever be (more than the socket buffer holds)."""
    if not held.wait_for(rail._sock, ANSWER.size, until):
        return False
    head = held.peek(rail._sock, ANSWER.size)
    if len(head) < ANSWER.size:
        return True  # the stream's end: the reader reports it
    kind, status, _, body_len, wr_id = ANSWER.unpack(head)
    need = ANSWER.size + body_len
    with rail._lock:
        work = rail._pending[0] if rail._pending else None
    if (kind == KIND_ANSWER and not status and work is not None
            and work.wr_id == wr_id and work.op is Op.READ
            and rail._payload_follows(work)):
        need += work.nbytes
    if need > rail._rcvbuf // 2:
        return False  # never whole at once: a worker reads it the usual way
    return held.wait_for(rail._sock, need, until)

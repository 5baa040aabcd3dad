"""A decoder's word that it has read a request's blocks, the notification that frees
them on prefill: one reader's (``SENT_PREFIX`` + request id), or reader ``k`` of ``n``
where several decode ranks read slices of one prefill rank's blocks
(``SENT_OF_PREFIX`` + ``k/n:`` + request id), freed once all ``n`` have said so."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from transfer_engine.connectors.vllm.config import SENT_OF_PREFIX, SENT_PREFIX

__all__ = ["sent_note", "Holds", "SentNotes"]

log = logging.getLogger(__name__)

MAX_READERS = 64  # as many as tensor-parallel ranks the params may name
MAX_PENDING = 4096  # requests heard of from some readers but not all


def sent_note(request_id: str, reader: int = 0, readers: int = 1) -> bytes:
    """The notification reader ``reader`` of ``readers`` sends once it has every byte."""
    if readers == 1:
        return SENT_PREFIX + request_id.encode()
    return SENT_OF_PREFIX + f"{reader}/{readers}:".encode() + request_id.encode()


class SentNotes:
    """Prefill's tally of the readers heard from, per request (not thread-safe: the
    worker calls it under its lock)."""

    def __init__(self) -> None:
        self._heard: dict[str, tuple[int, set[int]]] = {}  # id -> (readers, heard from)

    def add(self, payload: bytes) -> str | None:
        """The request whose every reader has now said so, or None (another's note,
        not all readers yet, or a malformed one, which is ignored)."""
        if payload.startswith(SENT_PREFIX):
            return payload[len(SENT_PREFIX):].decode(errors="replace")
        if not payload.startswith(SENT_OF_PREFIX):
            return None
        head, sep, rid_bytes = payload[len(SENT_OF_PREFIX):].partition(b":")
        k, slash, n = head.partition(b"/")
        if not (sep and slash and k.isdigit() and n.isdigit()):
            return None
        reader, readers = int(k), int(n)
        if not 0 <= reader < readers <= MAX_READERS:
            return None
        rid = rid_bytes.decode(errors="replace")
        want, heard = self._heard.get(rid, (readers, set()))
        want = max(want, readers)  # readers that disagree on their number: the larger
        heard.add(reader)
        if len(heard) >= want:
            self._heard.pop(rid, None)
            return rid
        if rid not in self._heard and len(self._heard) >= MAX_PENDING:
            self._heard.clear()  # notes for requests never held here must not pile up
        self._heard[rid] = (want, heard)
        return None


class Holds:
    """Prefill's held requests: each until its readers have said they read it, or its
    lease ran out. ``lock`` is the worker's (its counters are read under it);
    ``on_read(request_id)`` hears of each request read."""

    def __init__(self, clock: Callable[[], float], stats: dict[str, Any],
                 held_seconds: deque[float], lock: threading.Lock,
                 on_read: Callable[[str], None] = lambda rid: None) -> None:
        self.on_read = on_read
        self._clock = clock
        self._stats = stats
        self._held_seconds = held_seconds
        self._lock = lock
        self._sending: dict[str, float] = {}  # request id -> lease deadline
        self._sent_early: set[str] = set()  # read before its metadata arrived
        self._notes = SentNotes()  # readers heard from, per request
        self._held_at: dict[str, float] = {}  # request id -> when prefill held it

    def hold(self, reqs: dict[str, float]) -> None:
        now = self._clock()
        with self._lock:
            for rid, lease in reqs.items():
                if rid not in self._sending:
                    self._stats["held_requests"] += 1
                self._sending[rid] = now + lease
                self._held_at[rid] = time.monotonic()

    def heard(self, payload: bytes) -> None:
        """A notification: a reader's word that it has read a request's blocks."""
        with self._lock:
            rid = self._notes.add(payload)
            if rid is not None:
                self._sent_early.add(rid)
        if rid is not None:
            self.on_read(rid)

    @property
    def held(self) -> set[str]:
        with self._lock:
            return set(self._sending)

    def released(self) -> set[str]:
        """The requests read, or whose lease ran out, since the last call."""
        now = self._clock()
        out: set[str] = set()
        with self._lock:
            for rid in list(self._sent_early):
                if rid in self._sending:
                    del self._sending[rid]
                    self._sent_early.discard(rid)
                    out.add(rid)
                    self._stats["sent_requests"] += 1
                    self._held_seconds.append(
                        time.monotonic() - self._held_at.pop(rid, time.monotonic()))
            for rid, deadline in list(self._sending.items()):
                if deadline <= now:
                    del self._sending[rid]
                    self._held_at.pop(rid, None)
                    out.add(rid)
                    self._stats["lease_expired"] += 1
                    log.warning("request %s: lease ran out before the decoder read its "
                                "blocks; freeing them", rid)
            # notifications for requests never held here (aborted) must not pile up
            if len(self._sent_early) > 4096:
                self._sent_early.clear()
        return out

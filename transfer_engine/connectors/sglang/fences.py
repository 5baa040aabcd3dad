"""No late write lands in pages decode gave back.

Prefill WRITEs a room's chunks straight into pages decode allocated. When the room fails
on decode (SGLang aborted it, it timed out, prefill failed or stopped answering), SGLang
frees those pages and soon hands them to another request; a write of the failed room
still under way would then land in that request's KV, silently. So a decode rank gives a
failed room's pages back only once it is *fenced*:

- **quiet**: prefill says no write of the room is in flight and none will start
  (:class:`~.messages.RoomQuiet`, sent once its writes ended, by :class:`Drains`); if
  every write of the room completed, each was acknowledged after its bytes landed, and
  that is enough;
- **cut**: otherwise (a write failed midway, prefill said nothing within
  ``fence_timeout_s``, or stopped answering heartbeats) decode's engine cuts the prefill
  engine off its memory (:meth:`Engine.cut_peer`): its tickets are revoked and its rails
  closed once the requests served on them stopped. All writes of a room go on the rails
  of one ticket, which the quiet names: a cut that stood after that ticket was issued
  (:meth:`Engine.cut_covers`) fences the room without another one, so one broken
  connection costs one cut, not one per room (nor a cut of the connection prefill
  opened again since).

Until then the receiver's ``poll`` keeps the room ``Transferring``; where SGLang defers
the release itself (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``), ``poll``
fails the room at once and SGLang holds the pages until
``is_abort_release_safe`` says the fence stands.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from transfer_engine.connectors.sglang.rooms import SendRoom
from transfer_engine.engine import Engine
from transfer_engine.handle import TransferState

__all__ = ["Fence", "Fences", "Drains", "MAX_FENCES", "FENCED_TTL_S"]

log = logging.getLogger(__name__)

MAX_FENCES = 65536  # failed rooms tracked at once by a decode rank
FENCED_TTL_S = 600.0  # a fenced room nobody cleared is forgotten after this
GIVE_UP = 4  # fence_timeout_s's: cuts that never stand give the pages back after this


@dataclass(eq=False)
class Fence:
    """Decode: a failed room whose pages prefill may still write."""

    room: int
    nonce: int
    prefill: str  # the prefill engine's name
    since: float  # monotonic: when the room failed here
    quiet: bool | None = None  # prefill's word: writes ended, all landed (True) or not
    ticket: bytes = b""  # the rail ticket of the room's writes, as the quiet named it
    # monotonic: when a cut became needed (at once for a prefill that stopped answering,
    # when a failed write was reported, at the latest fence_timeout_s after ``since``)
    due: float = math.inf
    fenced: bool = False
    fenced_at: float = 0.0
    forgotten: bool = False  # the receiver (or SGLang) is done with it


class Fences:
    """Decode: the failed rooms being fenced, and the cuts that fence them. Thread-safe;
    :meth:`advance` runs on the manager's background thread and never blocks it (cuts
    run on a thread of their own)."""

    def __init__(self, engine: Engine, timeout_s: float,
                 stats: collections.Counter[str]) -> None:
        self._engine = engine
        self._timeout = timeout_s
        self._stats = stats
        self._lock = threading.Lock()
        self._rooms: dict[int, list[Fence]] = {}
        self._count = 0
        self._last_cut: dict[str, float] = {}  # prefill engine -> start of its last cut
        self._cutting: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="te-sglang-cut")

    def start(self, room: int, nonce: int, prefill: str, lost: bool = False) -> Fence:
        """Room ``room`` (request ``nonce``) failed here after its request went to the
        prefill engine ``prefill`` (``lost``: which stopped answering)."""
        now = time.monotonic()
        fence = Fence(room, nonce, prefill, now, due=now if lost else math.inf)
        with self._lock:
            self._rooms.setdefault(room, []).append(fence)
            self._count += 1
            if self._count > MAX_FENCES:
                self._trim()
        self._stats["fences_started"] += 1
        return fence

    def quiet(self, room: int, nonce: int, clean: bool, ticket: bytes) -> bool:
        """Prefill's word on ``room``; True if it fenced a room."""
        with self._lock:
            fence = next((f for f in self._rooms.get(room, ()) if f.nonce == nonce), None)
            if fence is None or fence.fenced or fence.quiet is not None:
                return False
            fence.quiet, fence.ticket = clean, ticket
            if clean:
                self._fence(fence, "fences_quiet")
            else:
                fence.due = min(fence.due, time.monotonic())
            return clean

    def safe(self, room: int) -> bool:
        """Whether no write of a failed use of ``room`` can land any more."""
        with self._lock:
            return all(f.fenced for f in self._rooms.get(room, ()))

    def drop(self, room: int) -> None:
        """SGLang released the pages of ``room`` (fenced or timed out): forget it."""
        with self._lock:
            self._count -= len(self._rooms.pop(room, ()))

    def forget(self, fence: Fence) -> None:
        """The receiver is done with ``fence``: dropped once fenced."""
        with self._lock:
            fence.forgotten = True
            if fence.fenced:
                self._remove(fence)

    def advance(self, now: float) -> None:
        """Fences what a cut already covers, starts the cuts still needed, forgets
        fenced rooms nobody clears."""
        wanted: set[str] = set()
        with self._lock:
            for fences in list(self._rooms.values()):
                for fence in list(fences):
                    if fence.fenced:
                        if fence.forgotten or now - fence.fenced_at > FENCED_TTL_S:
                            self._remove(fence)
                        continue
                    fence.due = min(fence.due, fence.since + self._timeout)
                    if fence.due > now:
                        continue  # prefill's word may still come
                    if self._covered(fence):
                        self._fence(fence, "fences_covered")
                    elif now - fence.since > GIVE_UP * self._timeout:
                        log.error("bootstrap room %d: prefill engine %s could not be cut off "
                                  "within %.0fs; its pages are given back unfenced",
                                  fence.room, fence.prefill, now - fence.since)
                        self._fence(fence, "fences_given_up")
                    elif fence.prefill not in self._cutting:
                        wanted.add(fence.prefill)
            self._cutting |= wanted
        for name in wanted:
            try:
                self._pool.submit(self._cut, name)
            except RuntimeError:  # closing
                with self._lock:
                    self._cutting.discard(name)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- internals (holding _lock unless said) -------------------------------------------

    def _covered(self, fence: Fence) -> bool:
        """Whether a cut that stood fences ``fence``: one after the ticket its writes
        went on was issued, or one that began after the cut became due (prefill had
        stopped the room, or said nothing: its writes' rails were open by then)."""
        if fence.ticket and self._engine.cut_covers(fence.prefill, fence.ticket):
            return True
        return self._last_cut.get(fence.prefill, -math.inf) > fence.due

    def _fence(self, fence: Fence, stat: str) -> None:
        fence.fenced, fence.fenced_at = True, time.monotonic()
        self._stats[stat] += 1
        if fence.forgotten:
            self._remove(fence)

    def _remove(self, fence: Fence) -> None:
        fences = self._rooms.get(fence.room)
        if fences is not None and fence in fences:
            fences.remove(fence)
            self._count -= 1
            if not fences:
                del self._rooms[fence.room]

    def _trim(self) -> None:
        """Over :data:`MAX_FENCES`: the oldest fenced rooms go first (unfenced ones stay:
        their pages must not be given back)."""
        for fence in sorted((f for fs in self._rooms.values() for f in fs if f.fenced),
                            key=lambda f: f.fenced_at):
            if self._count <= MAX_FENCES:
                break
            self._remove(fence)

    def _cut(self, name: str) -> None:
        """Cut thread: cuts engine ``name`` off; every room of it that the cut covers
        is fenced at the next :meth:`advance`."""
        began = time.monotonic()
        try:
            done = self._engine.cut_peer(name, timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001 - the engine closed under us
            log.warning("cutting prefill engine %s off failed: %s", name, exc)
            done = False
        with self._lock:
            self._cutting.discard(name)
            if done:
                self._last_cut[name] = began
                self._stats["fence_cuts"] += 1
        if done:
            log.info("prefill engine %s cut off: failed rooms' pages can be given back", name)
        else:
            log.warning("prefill engine %s: a request of its was still being served %.1fs "
                        "into the cut; trying again", name, self._timeout)


class Drains:
    """Prefill: rooms that ended without success; decode hears :class:`RoomQuiet` once
    no write of theirs is in flight (the manager's background thread asks :meth:`due`).
    Called under the manager's lock, which also guards the claims' ``posting``."""

    def __init__(self) -> None:
        self._rooms: dict[int, SendRoom] = {}  # id(claim) -> claim

    def watch(self, claim: SendRoom) -> None:
        """``claim`` takes no more writes (its ``stopped`` is set)."""
        self._rooms.setdefault(id(claim), claim)

    def due(self) -> list[tuple[SendRoom, bool]]:
        """Rooms whose writes all ended, with whether every one completed; forgotten
        here."""
        out: list[tuple[SendRoom, bool]] = []
        for key, claim in list(self._rooms.items()):
            if claim.posting or any(h.state is TransferState.PENDING for h in claim.writes):
                continue
            del self._rooms[key]
            out.append((claim, all(h.state is TransferState.DONE for h in claim.writes)))
        return out

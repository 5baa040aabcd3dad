"""Immediate counting: when has every byte of a transfer landed?

The planner marks the last work request of each rail a transfer uses with an immediate
``(transfer_id, expected)`` where ``expected`` is the number of rails used. Rails keep
their own order (a TCP stream, an RDMA RC queue pair), so when a rail's immediate
arrives, all of that rail's bytes are in place; when ``expected`` immediates of one
transfer have arrived, all of them are, whatever order the rails finished in. One of the
immediates carries the notification bytes. Pure bookkeeping: no I/O, no threads.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

__all__ = ["Notification", "ImmediateCounter", "KeptNotes"]


@dataclass(frozen=True, slots=True)
class Notification:
    """What a target receives once a transfer's bytes have all landed."""

    peer: str
    transfer_id: int
    payload: bytes


@dataclass(slots=True)
class _Pending:
    expected: int
    seen: int = 0
    payload: bytes | None = None
    first: int | None = None  # a later attempt's: the transfer id of its first


@dataclass
class ImmediateCounter:
    """Counts immediates per (peer, transfer) and says when a notification is due.

    The table of partial transfers is bounded, so that a peer sending partial transfers
    forever (or dying mid-transfer) costs a bounded amount, and costs it alone:

    - ``max_per_peer`` partial transfers (and ``max_peer_bytes`` of their payloads) per
      peer: beyond them the peer's own oldest partial entries go;
    - ``max_pending`` entries (and ``max_bytes`` of payloads) in all: beyond them the
      oldest entry of the peer holding the most goes.

    So a flood from one peer never evicts another peer's pending notification unless
    that other peer holds as much as the flooder. An evicted transfer starts over: its
    notification never fires (the initiator's handle still completes).

    An immediate may name the initiator's work request it came with (``work``): a work
    that landed but whose answer was lost is sent again over another rail (a NIC rail
    failing over), marked ``resent``, and counting it twice would fire the notification
    before another rail's bytes landed, or fire it twice. The last ``max_recent`` works
    counted are remembered, and a resent one among them is dropped (counted in
    ``duplicates``). Only a resent arrival is ever dropped: work ids need only be unique
    per rail for everything else.

    A transfer whose answer was lost after its bytes landed (its rail torn down, its
    transport failing) is made again as a new attempt, with a new transfer id so that
    the two attempts' counts never mix; its immediates name the first attempt's id
    (``first``). Of the attempts of one transfer, only the first to complete notifies:
    the last ``max_fired`` notifications are remembered, and an attempt naming one of
    them is dropped (counted in ``duplicates``), as is a first attempt that completes
    after a later one notified for it. A peer that never names a first attempt is
    never dropped this way, whatever its transfer ids.
    """

    max_pending: int = 65536
    max_per_peer: int = 4096
    max_bytes: int = 256 << 20
    max_peer_bytes: int = 16 << 20
    max_recent: int = 65536
    max_fired: int = 16384
    # per peer, partial transfers by (origin, transfer id): the origin (the rail
    # ticket the immediates came through) keeps two connections that use one name, a
    # restarted peer's or an impostor's, from completing each other's counts
    _peers: dict[str, dict[tuple[bytes, int], _Pending]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)  # payload bytes held per peer
    _count: int = 0
    _total_bytes: int = 0
    # (peer, origin, work) of the latest works counted, oldest first
    _recent: OrderedDict[tuple[str, bytes, int], None] = field(default_factory=OrderedDict)
    # (peer, origin, transfer id) of the latest notifications, oldest first: True where
    # a later attempt notified for that first attempt
    _fired: OrderedDict[tuple[str, bytes, int], bool] = field(default_factory=OrderedDict)
    dropped: int = 0
    duplicates: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pending", "max_per_peer", "max_bytes", "max_peer_bytes",
                     "max_recent", "max_fired"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def arrive(self, peer: str, transfer_id: int, expected: int,
               payload: bytes | None = None, origin: bytes = b"",
               work: int | None = None, resent: bool = False, first: int | None = None
               ) -> Notification | None:
        """Records one immediate; returns the notification when it was the last one.
        ``origin`` names the connection the immediates of one transfer share; ``work``
        (if known) the initiator's work request it came with, ``resent`` whether that
        work was sent before on another rail; ``first`` the transfer id of the
        transfer's first attempt, when this is a later one."""
        if expected < 1:
            raise ValueError(f"expected must be >= 1, got {expected}")
        if work is not None:
            seen = (peer, origin, work)
            if resent and seen in self._recent:
                self.duplicates += 1
                return None
        key = (origin, transfer_id)
        table = self._peers.get(peer)
        entry = table.get(key) if table is not None else None
        if entry is not None and entry.expected != expected:
            raise ValueError(
                f"transfer {transfer_id} from {peer}: expected {entry.expected} "
                f"immediates, a later one says {expected}")
        if work is not None:
            self._recent[seen] = None
            self._recent.move_to_end(seen)
            if len(self._recent) > self.max_recent:
                self._recent.popitem(last=False)
        if entry is None:
            if expected == 1:
                return self._fire(peer, origin, transfer_id, first, payload or b"")
            if table is None:
                table = self._peers[peer] = {}
                self._bytes[peer] = 0
            if len(table) >= min(self.max_per_peer, self.max_pending):
                self._evict(peer)
            elif self._count >= self.max_pending:
                self._evict(max(self._peers, key=lambda p: len(self._peers[p])))
            if peer not in self._peers:  # its last entry was the one evicted
                table = self._peers[peer] = {}
                self._bytes[peer] = 0
            entry = table[key] = _Pending(expected)
            self._count += 1
        if first is not None:
            entry.first = first
        entry.seen += 1
        if entry.seen < entry.expected:
            if payload is not None:
                self._hold(peer, entry, payload)
            return None
        self._drop(peer, key)
        return self._fire(peer, origin, transfer_id, entry.first,
                          (payload if payload is not None else entry.payload) or b"")

    def _fire(self, peer: str, origin: bytes, transfer_id: int, first: int | None,
              payload: bytes) -> Notification | None:
        """The notification of a completed attempt, unless another attempt of the same
        transfer notified already."""
        later = first is not None
        fired = (peer, origin, first if first is not None else transfer_id)
        if self._fired.get(fired, False) or (later and fired in self._fired):
            self.duplicates += 1
            return None
        self._fired[fired] = later
        self._fired.move_to_end(fired)
        if len(self._fired) > self.max_fired:
            self._fired.popitem(last=False)
        return Notification(peer, transfer_id if first is None else first, payload)

    def _hold(self, peer: str, entry: _Pending, payload: bytes) -> None:
        """Keeps ``payload`` with ``entry``, evicting within the byte bounds."""
        size = len(payload) - len(entry.payload or b"")
        entry.payload = payload
        self._bytes[peer] += size
        self._total_bytes += size
        table = self._peers[peer]
        while self._bytes[peer] > self.max_peer_bytes and len(table) > 1:
            self._evict(peer, keep=entry)
        while self._total_bytes > self.max_bytes:
            victim = max(self._bytes, key=self._bytes.__getitem__)
            if victim == peer and len(table) == 1:
                break  # one payload alone (at most a message) is always kept
            self._evict(victim, keep=entry)

    def _evict(self, peer: str, keep: _Pending | None = None) -> None:
        """Drops ``peer``'s oldest partial entry (not ``keep``)."""
        table = self._peers[peer]
        for key, entry in table.items():
            if entry is not keep:
                self._drop(peer, key)
                self.dropped += 1
                return

    def _drop(self, peer: str, key: tuple[bytes, int]) -> None:
        table = self._peers[peer]
        entry = table.pop(key)
        self._count -= 1
        size = len(entry.payload or b"")
        self._bytes[peer] -= size
        self._total_bytes -= size
        if not table:
            del self._peers[peer]
            del self._bytes[peer]

    def pending(self, peer: str) -> int:
        """Partial transfers held for ``peer``."""
        return len(self._peers.get(peer, ()))

    @property
    def pending_bytes(self) -> int:
        """Notification payload bytes held for partial transfers, all peers together
        (at most ``max_bytes``)."""
        return self._total_bytes

    @property
    def recent_works(self) -> int:
        """Works remembered against a second arrival (at most ``max_recent``)."""
        return len(self._recent)

    def forget_peer(self, peer: str) -> int:
        """Drops the partial transfers of a peer that went away; returns how many."""
        table = self._peers.pop(peer, {})
        size = self._bytes.pop(peer, 0)
        self._count -= len(table)
        self._total_bytes -= size
        return len(table)

    def __len__(self) -> int:
        return self._count


class KeptNotes:
    """Notifications kept for ``Engine.notifications()``: the latest ``max_count``, up
    to ``max_bytes`` of payload. Nobody may be taking them (an application that uses
    callbacks only, or a reader that stopped): the oldest then go, rather than the
    process's memory."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._notes: deque[Notification] = deque()
        self._max_count = max_count
        self._max_bytes = max_bytes
        self.nbytes = 0

    def append(self, note: Notification) -> int:
        """Keeps ``note``; returns how many older ones were dropped for it."""
        self._notes.append(note)
        self.nbytes += len(note.payload)
        dropped = 0
        while len(self._notes) > self._max_count or self.nbytes > self._max_bytes:
            self.nbytes -= len(self._notes.popleft().payload)
            dropped += 1
        return dropped

    def take(self, max_count: int | None = None) -> list[Notification]:
        """The oldest ``max_count`` (all by default), taken out."""
        out: list[Notification] = []
        while self._notes and (max_count is None or len(out) < max_count):
            out.append(self._notes.popleft())
            self.nbytes -= len(out[-1].payload)
        return out

    def __len__(self) -> int:
        return len(self._notes)

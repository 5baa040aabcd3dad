"""Immediate counting: when has every byte of a transfer landed?

The planner marks the last work request of each rail a transfer uses with an immediate
``(transfer_id, expected)`` where ``expected`` is the number of rails used. Rails keep
their own order (a TCP stream, an RDMA RC queue pair), so when a rail's immediate
arrives, all of that rail's bytes are in place; when ``expected`` immediates of one
transfer have arrived, all of them are, whatever order the rails finished in. One of the
immediates carries the notification bytes. Pure bookkeeping: no I/O, no threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Notification", "ImmediateCounter"]


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


@dataclass
class ImmediateCounter:
    """Counts immediates per (peer, transfer) and says when a notification is due.

    ``max_pending`` bounds the table: a peer that sends partial transfers forever (or
    dies mid-transfer) cannot grow it without limit; the oldest partial entries go first.
    """

    max_pending: int = 65536
    _pending: dict[tuple[str, int], _Pending] = field(default_factory=dict)
    dropped: int = 0

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")

    def arrive(self, peer: str, transfer_id: int, expected: int,
               payload: bytes | None = None) -> Notification | None:
        """Records one immediate; returns the notification when it was the last one."""
        if expected < 1:
            raise ValueError(f"expected must be >= 1, got {expected}")
        key = (peer, transfer_id)
        entry = self._pending.get(key)
        if entry is None:
            if expected == 1:
                return Notification(peer, transfer_id, payload or b"")
            if len(self._pending) >= self.max_pending:
                self._pending.pop(next(iter(self._pending)))
                self.dropped += 1
            entry = self._pending[key] = _Pending(expected)
        elif entry.expected != expected:
            raise ValueError(
                f"transfer {transfer_id} from {peer}: expected {entry.expected} "
                f"immediates, a later one says {expected}")
        entry.seen += 1
        if payload is not None:
            entry.payload = payload
        if entry.seen < entry.expected:
            return None
        del self._pending[key]
        return Notification(peer, transfer_id, entry.payload or b"")

    def forget_peer(self, peer: str) -> int:
        """Drops the partial transfers of a peer that went away; returns how many."""
        keys = [k for k in self._pending if k[0] == peer]
        for k in keys:
            del self._pending[k]
        return len(keys)

    def __len__(self) -> int:
        return len(self._pending)

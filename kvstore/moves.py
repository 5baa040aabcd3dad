"""Moves of objects between a storage node's DRAM and disk pools (the master's side).

A node that lends a disk file has two tiers. New objects go to DRAM; when a put finds
no DRAM room, eviction picks the least recently used objects with a DRAM replica as
before, but a victim whose node has disk space is *demoted* instead of dropped (only a
put that finds nothing in DRAM to evict or demote, and no space on its way back, e.g.
one batch larger than the DRAM, is placed on disk directly, by the master's
``_spill``); a get of an object that lives only on disk *promotes* it back when its
node's DRAM has room (without evicting anything for it).

A move never changes what a reader sees. The master keeps the object's row LIVE and
makes a second, PENDING row for the same key and version on the target pool, then
journals ``Op.COPY`` to the node, which copies the bytes between its own pools (no
network) and adds the copy to its directory. Once the node acknowledges that journal
push, the new row is published if the old one is still the key's current object (same
row, same version); the old row then retires like any replaced object, so its space
comes back only when the leases of readers still reading it end (a parked put waits
for that free like any other). A demoted row keeps the object's recency. If the key
was removed, replaced or expired meanwhile, the copy is freed instead. The journal is
ordered, so the node copies before it applies any free of the source range.

The disk tier is bounded by its file: when a demotion finds no disk room the pool is
marked under pressure, and until a demotion fits again, eviction also drops that
pool's least recently used objects, as many bytes as the victims it could not take
(the master's ``_shed``); otherwise objects only on disk are passed over by eviction,
since dropping them frees no DRAM.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvstore.objects import ObjectTable, State
from kvstore.protocol import JOURNAL, Op, wall_time

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["TierMoves", "Move"]

I64 = npt.NDArray[np.int64]

DRAM = "dram"
DISK = "disk"


@dataclass(eq=False)
class Move:
    """One object on its way to another tier: ``src`` is its current row."""

    src: int
    version: int
    pending: int  # nodes yet to acknowledge their copy
    tier: str


class TierMoves:
    """Mixed into :class:`kvstore.master.Master`: demotion, promotion and their
    bookkeeping. Only called with the master's lock held."""

    table: ObjectTable
    counters: collections.Counter[str]
    _pools: list[Any]
    _clock: Callable[[], float]
    _moves: dict[int, Move]  # pending row -> move
    _moving: dict[int, int]  # source row -> pending row

    def _retire(self, rows: I64) -> None:
        raise NotImplementedError

    def _free_rows(self, rows: I64) -> None:
        raise NotImplementedError

    def _tier_pool(self, node: Any, tier: str) -> Any | None:
        for p in node.pools:
            pool = self._pools[p]
            if pool.tier == tier and pool.alive:
                return pool
        return None

    @property
    def _tiered(self) -> bool:
        return any(p.tier == DISK and p.alive for p in self._pools)

    def _start_moves(self, rows: I64, tier: str) -> npt.NDArray[np.bool_]:
        """Starts moving each row's replicas that are not on ``tier`` to that tier of
        the same node, where it has room; True for rows that now have a move pending
        (started here or before)."""
        t = self.table
        now = self._clock()
        out = np.zeros(rows.size, dtype=bool)
        for i, row in enumerate(rows.tolist()):
            if row in self._moving:
                out[i] = True
                continue
            length = int(t.length[row])
            if length == 0 or t.state[row] != State.LIVE:
                continue
            new: list[tuple[Any, int]] = []
            for p, _ in t.replicas(row):
                pool = self._pools[p]
                if pool.tier == tier or not pool.alive:
                    continue
                target = self._tier_pool(pool.node, tier)
                if target is None or target.usable_after > now:
                    continue
                off = target.space.alloc(length)
                if tier == DISK:
                    target.pressure = off < 0
                if off >= 0:
                    new.append((target, off))
            if not new:
                continue
            dst = int(t.new_rows(1)[0])
            t.keys[dst] = t.keys[row]
            t.length[dst] = length
            t.checksum[dst] = t.checksum[row]
            t.version[dst] = t.version[row]
            t.deadline[dst] = t.deadline[row]
            t.state[dst] = State.PENDING
            for r, (target, off) in enumerate(new):
                t.pool[dst, r] = target.index
                t.offset[dst, r] = off
                ops = np.zeros(1, dtype=JOURNAL)
                ops["op"] = Op.COPY
                e = ops["entry"]
                e["key"] = t.keys[row]
                e["pool"] = target.local
                e["offset"] = off
                e["length"] = length
                e["checksum"] = t.checksum[row]
                e["version"] = t.version[row]
                e["expires"] = wall_time(t.deadline[row:row + 1], self._clock())[0]
                target.node.outbox.append(ops)
                target.node.moving.append(dst)
            t.nrep[dst] = len(new)
            self._moves[dst] = Move(row, int(t.version[row]), len(new), tier)
            self._moving[row] = dst
            out[i] = True
        return out

    def _copied(self, dst: int) -> None:
        """A node acknowledged (or can no longer acknowledge) its copy into ``dst``."""
        move = self._moves.get(dst)
        if move is None:
            return
        move.pending -= 1
        if move.pending > 0:
            return
        del self._moves[dst]
        if self._moving.get(move.src) == dst:
            del self._moving[move.src]
        t = self.table
        if t.nrep[dst] == 0:  # every target node was lost
            t.drop_rows(np.array([dst], dtype=np.int64))
            return
        src = move.src
        rows = np.array([dst], dtype=np.int64)
        current = (t.state[src] == State.LIVE and int(t.version[src]) == move.version
                   and int(t.lookup(t.keys[rows], touch=False)[0]) == src)
        if not current:  # removed, replaced, evicted or expired meanwhile
            self._free_rows(rows)
            return
        old = t.publish(rows)
        if move.tier == DISK:  # demoted, not used: it keeps its place in the eviction order
            t.stamp[dst] = t.stamp[src]
        self._retire(old[old >= 0])
        self.counters["demotions" if move.tier == DISK else "disk_promotions"] += 1

    def _moves_acked(self, node: Any) -> None:
        while node.copies and node.copies[0][0] <= node.acked:
            for dst in node.copies.popleft()[1]:
                self._copied(dst)

    def _moves_lost(self, node: Any) -> None:
        """``node`` was dropped: its copies will never be acknowledged."""
        pending = [d for _, rows in node.copies for d in rows] + node.moving
        node.copies.clear()
        node.moving = []
        for dst in pending:
            self._copied(dst)

    def _spare(self, rows: I64) -> tuple[npt.NDArray[np.bool_], int]:
        """Of eviction victims ``rows``: which to keep (demoted, already moving, or on a
        disk pool with room), and the DRAM bytes the moves started here will free."""
        t = self.table
        keep = np.zeros(rows.size, dtype=bool)
        if rows.size == 0 or not self._tiered:
            return keep, 0
        disk = np.array([p.tier == DISK for p in self._pools] + [False])
        pressure = np.array([bool(getattr(p, "pressure", False)) for p in self._pools]
                            + [False])
        pools = t.pool[rows]  # -1 indexes the trailing False
        has = pools >= 0
        on_disk = (disk[pools] & has).sum(axis=1)
        dram = has.sum(axis=1) - on_disk
        disk_only = (dram == 0) & (on_disk > 0)
        keep[disk_only & ~(pressure[pools] & has).any(axis=1)] = True
        cand = np.flatnonzero(dram > 0)
        before = np.fromiter((r in self._moving for r in rows[cand].tolist()), dtype=bool,
                             count=cand.size)
        moved = self._start_moves(rows[cand], DISK)
        keep[cand[moved]] = True
        new = cand[moved & ~before]
        freed = int((t.length[rows[new]] * dram[new]).sum())
        return keep, freed

    def _demoting(self) -> int:
        """DRAM bytes that the pending demotions free once they complete."""
        t = self.table
        total = 0
        for move in self._moves.values():
            if move.tier == DISK and t.state[move.src] == State.LIVE:
                total += int(t.length[move.src]) * int(t.nrep[move.src])
        return total

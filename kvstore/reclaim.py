"""How the kvstore master gives space back: leases, retirement, frees, eviction.

An object taken out of the index (removed, replaced, expired, evicted) is *retired*:
its space is freed at once when no get's lease holds it, else when the last lease ends
(released by the reader's next request, or after ``lease_s``). A free goes through the
node's journal (:mod:`kvstore.journal`): the space is reused only once the node
acknowledges it. Eviction takes the least recently used objects no lease holds; with
disk pools, victims with a DRAM replica are demoted instead of dropped
(:mod:`kvstore.moves`).
"""

from __future__ import annotations

import numpy as np

from kvstore.master_state import I64, MasterState
from kvstore.moves import DISK
from kvstore.objects import State

__all__ = ["Reclaim"]


class Reclaim(MasterState):
    """Mixed into :class:`kvstore.master.Master`: leases, frees and eviction."""

    def _release(self, lease_ids: np.ndarray) -> None:
        for lease in lease_ids.tolist():
            entry = self._leases.pop(int(lease), None)
            if entry is not None:
                self._unlease(entry[1])

    def _unlease(self, rows: I64) -> None:
        t = self.table
        np.subtract.at(t.leases, rows, 1)
        done = rows[(t.leases[rows] == 0) & (t.state[rows] == State.RETIRED)]
        if done.size:
            self._free_rows(np.unique(done))

    def _retire(self, rows: I64) -> None:
        """Rows just taken out of the index: freed now, or when their leases end."""
        if rows.size == 0:
            return
        t = self.table
        held = t.leases[rows] > 0
        t.state[rows[held]] = State.RETIRED
        self._journal_retired(rows[held])  # a master restarted meanwhile must not
        self._free_rows(rows[~held])       # publish them again from the directories

    def _free_rows(self, rows: I64) -> None:
        """Frees the space of ``rows`` (through the nodes' journals) and the rows."""
        t = self.table
        for row in rows.tolist():
            length = int(t.length[row])
            for p, off in t.replicas(row):
                self._queue_free(p, off, length)
        t.drop_rows(rows)

    def _queue_free(self, p: int, off: int, length: int) -> None:
        """Frees ``length`` bytes at ``off`` of pool ``p`` through its node's journal: the
        space is reused once the node acknowledges."""
        pool = self._pools[p]
        if pool.alive:
            pool.node.frees.append((p, off, length))
            pool.coming += pool.space.unit(length)

    def _evict(self, nbytes: int) -> bool:
        """Evicts the least recently used LIVE objects no lease holds until ``nbytes`` of
        DRAM are on their way back; False when nothing was evicted (``nbytes <= 0``
        evicts nothing). With disk pools, victims with a DRAM replica are demoted to
        their node's disk pool where it has room (:mod:`kvstore.moves`): they stay
        readable, and their DRAM comes back once the move completes; the rest are
        dropped. Objects only on disk are passed over unless their pool is under
        pressure, and then only as much as the demotions lack (:meth:`_shed`)."""
        t = self.table
        if not self._tiered:
            rows = t.victims(nbytes)
            if rows.size == 0:
                return False
            self.counters["evictions"] += int(rows.size)
            self._retire(rows)
            return True
        evicted = False
        dram = np.array([p.tier != DISK for p in self._pools] + [False])
        for _ in range(64):
            if nbytes <= 0:
                break
            rows = t.victims(nbytes, pools=dram[:-1])
            if rows.size == 0:
                break
            t.state[rows] = State.LIVE  # still theirs until dropped
            keep, moving = self._spare(rows)
            if keep.any():
                t.publish(rows[keep], schedule=False)  # demoted or moving: still readable
                rows = rows[~keep]
            nbytes -= moving + int((np.maximum(t.length[rows], 1)
                                    * dram[t.pool[rows]].sum(axis=1)).sum())
            if rows.size:
                self.counters["evictions"] += int(rows.size)
                self._shed(rows)
                self._retire(rows)
            evicted = evicted or moving > 0 or rows.size > 0
        return evicted

    def _shed(self, dropped: I64) -> None:
        """A disk pool under pressure (a demotion found no room) drops its least
        recently used objects, as many bytes as the DRAM victims ``dropped`` of its node
        hold, less what it has free or on its way: the next demotions fit."""
        t = self.table
        for disk in self._pools:
            if disk.tier != DISK or not disk.pressure or not disk.alive:
                continue
            mine = np.array([p in disk.node.pools and p != disk.index
                             for p in range(len(self._pools))] + [False])
            lost = int((t.length[dropped] * mine[t.pool[dropped]].sum(axis=1)).sum())
            need = lost - disk.space.free_bytes - disk.coming
            if need <= 0:
                continue
            only = np.zeros(len(self._pools), dtype=bool)
            only[disk.index] = True
            rows = t.victims(need, pools=only)
            if rows.size:
                self.counters["evictions"] += int(rows.size)
                self._retire(rows)

    def _drop_replicas(self, rows: I64, dead: np.ndarray, *, free: bool) -> np.ndarray:
        """Removes replicas on pools ``dead`` from ``rows``; returns a mask of rows left
        with none. With ``free`` the space of removed replicas on live pools is freed."""
        t = self.table
        pools = t.pool[rows]
        gone = np.isin(pools, dead) & (pools >= 0)
        if free:
            for i, r in zip(*np.nonzero(gone), strict=True):
                self._queue_free(int(pools[i, r]), int(t.offset[rows[i], r]),
                                 int(t.length[rows[i]]))
        keep = (pools >= 0) & ~gone
        order = np.argsort(~keep, axis=1, kind="stable")
        newp = np.take_along_axis(pools, order, axis=1)
        newo = np.take_along_axis(t.offset[rows], order, axis=1)
        nrep = keep.sum(axis=1)
        newp[np.arange(self.max_replicas)[None, :] >= nrep[:, None]] = -1
        t.pool[rows] = newp
        t.offset[rows] = newo
        t.nrep[rows] = nrep
        return np.asarray(nrep == 0)

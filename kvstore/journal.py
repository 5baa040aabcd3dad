"""The kvstore master's journal: every commit and free, pushed to the node holding the
space.

Each node keeps a directory of its objects from the journal (what a restarted master
rebuilds its table from), and acknowledges each push in its next heartbeat; a push not
acknowledged within a heartbeat interval is sent again. Space freed through the journal
is quarantined until the node acknowledges the push that carries the free, so that a
put never writes where a reader of the old object may still be reading.
"""

from __future__ import annotations

import numpy as np

from kvstore.master_state import I64, MasterState, Node
from kvstore.protocol import JOURNAL, MAX_FENCE, KvJournal, Op, wall_time
from transfer_engine.control.auth import seal
from transfer_engine.control.reply import send_frame

__all__ = ["Journal"]

_JOURNAL_CHUNK = 50_000  # ops per journal message (72 bytes each, under the 4 MiB limit)


class Journal(MasterState):
    """Mixed into :class:`kvstore.master.Master`: journal pushes and their
    acknowledgements."""

    def _journal_commits(self, rows: I64) -> None:
        self._journal_rows(rows, Op.COMMIT)

    def _journal_retired(self, rows: I64) -> None:
        """Tells the nodes holding ``rows`` that these objects are gone, though their
        space stays held (leased) until freed."""
        self._journal_rows(rows, Op.RETIRE)

    def _journal_rows(self, rows: I64, op: Op) -> None:
        """Journals ``op`` for every replica of ``rows``, one batch per pool."""
        t = self.table
        if rows.size == 0:
            return
        for r in range(self.max_replicas):
            sel = rows[t.nrep[rows] > r]
            if sel.size == 0:
                break
            pools = t.pool[sel, r]
            for p in np.unique(pools).tolist():
                pool = self._pools[p]
                if not pool.alive:
                    continue
                these = sel[pools == p]
                ops = np.zeros(these.size, dtype=JOURNAL)
                ops["op"] = op
                e = ops["entry"]
                e["key"] = t.keys[these]
                e["pool"] = pool.local
                e["offset"] = t.offset[these, r]
                e["length"] = t.length[these]
                e["checksum"] = t.checksum[these]
                e["version"] = t.version[these]
                e["expires"] = wall_time(t.deadline[these], self._clock())
                pool.node.outbox.append(ops)

    def _fence(self, rows: I64, writer: str) -> bool:
        """Has the nodes holding ``rows`` cut ``writer`` off their engines before they
        apply the frees that follow (:class:`KvJournal` ``fence``); False, doing
        nothing, where one of them fences :data:`MAX_FENCE` others in its next push."""
        if not writer:
            return True
        t = self.table
        nodes: dict[int, Node] = {}
        for row in rows.tolist():
            for p, _ in t.replicas(row):
                pool = self._pools[p]
                if pool.alive:
                    nodes[id(pool.node)] = pool.node
        if any(writer not in n.fence and len(n.fence) >= MAX_FENCE for n in nodes.values()):
            return False
        for node in nodes.values():
            node.fence[writer] = None
        return True

    def _flush(self) -> None:
        """Sends each node its pending journal operations."""
        now = self._clock()
        for node in self._nodes.values():
            if node.frees:
                ops = np.zeros(len(node.frees), dtype=JOURNAL)
                ops["op"] = Op.FREE
                ops["entry"]["pool"] = [self._pools[p].local for p, _, _ in node.frees]
                ops["entry"]["offset"] = [off for _, off, _ in node.frees]
                node.outbox.append(ops)
            if not node.outbox:
                continue
            ops = np.concatenate(node.outbox)
            node.outbox = []
            fence, node.fence = list(node.fence), {}
            for start in range(0, ops.size, _JOURNAL_CHUNK):
                node.seq += 1
                frame = seal(KvJournal(epoch=self.epoch, seq=node.seq,
                                       ops=ops[start:start + _JOURNAL_CHUNK].tobytes(),
                                       fence=fence), self._signer)
                node.unacked.append((node.seq, now, frame))
                self._send_node(node, frame)
            if node.frees:
                node.quarantine.append((node.seq, node.frees))
                node.frees = []
            if node.moving:
                node.copies.append((node.seq, node.moving))
                node.moving = []

    def _send_node(self, node: Node, frame: bytes) -> None:
        send_frame(self._sock, node.identity, frame)  # if dropped: resent after a heartbeat

    def _acked(self, node: Node, seq: int) -> None:
        freed = False
        node.acked = max(node.acked, seq)
        while node.unacked and node.unacked[0][0] <= node.acked:
            node.unacked.popleft()
        while node.quarantine and node.quarantine[0][0] <= node.acked:
            for p, off, length in node.quarantine.popleft()[1]:
                pool = self._pools[p]
                if pool.alive:
                    pool.space.free(off, length)
                    pool.coming -= pool.space.unit(length)
                    freed = True
        self._moves_acked(node)  # demoted sources retire: their frees follow
        if freed and self._parked:
            self._unpark(self._clock())

"""How the kvstore master places puts: space on distinct nodes, commit, and puts parked
until evicted space comes back.

A put is two-phase. ``kv-put`` allocates, for each key, space on ``replicas`` distinct
nodes (DRAM first, then distinct zones and pods), and records the objects PENDING;
``kv-commit`` publishes them, replacing older versions. A small batch goes to one node
(latency-bound: one transfer), a large one is cut into one run of consecutive keys per
pool (bandwidth-bound). A put that finds no room evicts what it lacks, less the frees
already on their way back, and as much again for the puts that follow, and is parked
until the nodes acknowledge those frees (or answered RETRY for the keys without room
after two heartbeat intervals). Keys that DRAM cannot hold even so go to disk pools.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

from kvstore.errors import StoreError
from kvstore.master_state import MasterState, PendingPut, Pool, check_distinct
from kvstore.moves import DISK
from kvstore.objects import State
from kvstore.protocol import KvCommit, KvCommitted, KvPlaced, KvPut, Status, column
from transfer_engine.control.messages import ErrorReply, Message
from transfer_engine.control.tickets import valid_name
from transfer_engine.errors import ProtocolError

__all__ = ["Placement", "SPREAD_BYTES"]

SPREAD_BYTES = 8 << 20
SUSPECT_S = 10.0  # seconds a node a client reported failing gets new objects only if need be
"""A put batch of at least this many bytes (all replicas) is spread over the nodes."""


class Placement(MasterState):
    """Mixed into :class:`kvstore.master.Master`: ``kv-put``, ``kv-commit`` and parked
    puts."""

    def _put(self, msg: KvPut, ident: bytes | None = None, until: float | None = None,
             since: float | None = None) -> KvPlaced | None:
        """Places a put's keys. A put that must wait for evicted space is parked (None:
        no answer yet) when ``ident`` is given, until ``until`` (default: two heartbeat
        intervals from now); else those keys are answered RETRY."""
        keys = self._keys(msg.keys)
        n = keys.shape[0]
        lengths = column(msg.lengths, "<i8", n, "lengths")
        checks = column(msg.checksums, "<u8", n, "checksums")
        if (lengths < 0).any():
            raise ProtocolError("lengths: negative")
        if not 1 <= msg.replicas <= self.max_replicas:
            raise ProtocolError(f"replicas must be 1..{self.max_replicas}")
        if msg.ttl < 0:
            raise ProtocolError("ttl must be >= 0")
        if msg.writer and not valid_name(msg.writer):
            raise ProtocolError("writer: not an engine's name")
        check_distinct(keys)
        now = self._clock()
        status = np.zeros(n, dtype=np.int8)
        if msg.if_absent:
            status[self.table.lookup(keys, touch=True, new_turn=False) >= 0] = Status.EXISTS
        pools = np.full((n, self.max_replicas), -1, dtype=np.int32)
        offsets = np.zeros((n, self.max_replicas), dtype=np.int64)
        todo = np.flatnonzero(status == Status.OK)
        # disk pools are filled by demotion only: new objects are the likeliest to be read
        usable = [p for p in self._pools if p.alive and p.node.active and p.tier != DISK]
        ready = [p for p in usable if p.usable_after <= now]
        trusted = [p for p in ready if p.node.suspect_until <= now]
        if len({p.node.name for p in trusted}) >= min(
                msg.replicas, len({p.node.name for p in ready})):
            ready = trusted  # nodes a client could not write to lately: only if need be
        ready.sort(key=lambda p: p.index)
        biggest = max((p.space.capacity for p in usable), default=0)
        want = min(msg.replicas, len({p.node.name for p in ready}))
        until = now + 2 * self.node_interval if until is None else until
        first = since is None
        since = now if since is None else since
        fits = lengths[todo][lengths[todo] <= biggest]  # TOO_LARGE ones aside
        if ready and fits.size:
            self._key_bytes = int(ready[0].space.round(fits).mean()) * max(1, want)
        if ident is not None and ready and todo.size:
            # clearly short of room: evict and park before placing anything
            short = (int(ready[0].space.round(fits).sum()) * want
                     - sum(p.space.free_bytes for p in ready))
            if short > 0 and self._park(ident, msg, until, since, short, ready):
                self.counters["puts_parked"] += first
                return None
        evict_bytes = 0
        start = next(self._put_ids)
        # a small batch is latency-bound: all on one node, one transfer (batches take
        # turns); a large one is bandwidth-bound: cut into one run of consecutive keys
        # per pool, so each node's share is one range on both sides when the caller's
        # buffers are consecutive (merged into one copy)
        spread = len(ready) if int(lengths[todo].sum()) * max(1, want) >= SPREAD_BYTES else 0
        sizes = lengths.tolist()
        for i in todo.tolist():
            length = sizes[i]
            if not ready:
                status[i] = Status.RECOVERING if usable else Status.NO_SPACE
                continue
            if length > biggest:
                status[i] = Status.TOO_LARGE
                continue
            got = self._place(ready, length, want, start + i * spread // n)
            if len(got) < want:
                for p, off in got:
                    self._pools[p].space.free(off, length)
                status[i] = Status.RETRY
                evict_bytes += length * want
                continue
            if want == 1:
                pools[i, 0], offsets[i, 0] = got[0]
            else:
                for r, (p, off) in enumerate(got):
                    pools[i, r] = p
                    offsets[i, r] = off
        if evict_bytes:
            if ident is not None and self._park(ident, msg, until, since, evict_bytes,
                                                ready):
                # answered once the frees land: give back the space placed so far
                for i in np.flatnonzero(pools[:, 0] >= 0).tolist():
                    for r in range(self.max_replicas):
                        if pools[i, r] >= 0:
                            self._pools[int(pools[i, r])].space.free(int(offsets[i, r]),
                                                                      int(lengths[i]))
                self.counters["puts_parked"] += first
                return None
            if ident is None:
                self._evict(evict_bytes - self._coming(ready))
            if not self._on_way(ready):
                # nothing to evict or demote, nothing coming back: the rest goes to disk
                self._spill(status, lengths, pools, offsets, msg.replicas, start)
                status[status == Status.RETRY] = Status.NO_SPACE
        placed = np.flatnonzero(pools[:, 0] >= 0)
        put_id = secrets.randbits(62) or 1  # unguessable: a put is committed by its id
        while put_id in self._puts:
            put_id = secrets.randbits(62) or 1
        versions = np.zeros(n, dtype=np.uint64)
        if placed.size:
            t = self.table
            rows = t.new_rows(int(placed.size))
            t.keys[rows] = keys[placed]
            t.length[rows] = lengths[placed]
            t.checksum[rows] = checks[placed]
            t.version[rows] = self._version + np.arange(1, rows.size + 1, dtype=np.uint64)
            versions[placed] = t.version[rows]
            self._version += int(rows.size)
            t.state[rows] = State.PENDING
            t.deadline[rows] = now + msg.ttl if msg.ttl > 0 else math.inf
            t.pool[rows] = pools[placed]
            t.offset[rows] = offsets[placed]
            t.nrep[rows] = (pools[placed] >= 0).sum(axis=1)
            self._puts[put_id] = PendingPut(now + self.put_timeout_s, placed, rows, n,
                                            msg.writer)
        self.counters["puts"] += int(placed.size)
        nodes, wire_pools = self._node_table(pools)
        return KvPlaced(put_id=put_id if placed.size else 0, status=status.tobytes(),
                        versions=versions.tobytes(),
                        replicas=self.max_replicas, nodes=nodes, pools=wire_pools.tobytes(),
                        offsets=offsets.tobytes(), deadline_s=self.put_timeout_s)

    def _spill(self, status: np.ndarray, lengths: np.ndarray, pools: np.ndarray,
               offsets: np.ndarray, replicas: int, start: int) -> None:
        """Places the RETRY keys of a put on disk pools, when DRAM has nothing left to
        evict or demote and no space on its way back (a batch larger than the DRAM)."""
        now = self._clock()
        disk = [p for p in self._pools if p.alive and p.node.active and p.tier == DISK
                and p.usable_after <= now]
        want = min(replicas, len({p.node.name for p in disk}))
        if not want:
            return
        for i in np.flatnonzero(status == Status.RETRY).tolist():
            length = int(lengths[i])
            got = self._place(disk, length, want, start + i)
            if len(got) < want:
                for p, off in got:
                    self._pools[p].space.free(off, length)
                continue
            status[i] = Status.OK
            for r, (p, off) in enumerate(got):
                pools[i, r] = p
                offsets[i, r] = off

    def _coming(self, ready: list[Pool]) -> int:
        """Bytes on their way back to the ``ready`` pools: frees not yet acknowledged,
        and the DRAM that pending demotions free once they complete."""
        return sum(p.coming for p in ready) + (self._demoting() if self._moves else 0)

    def _on_way(self, ready: list[Pool]) -> bool:
        """Whether space is on its way back to the ``ready`` pools, or to a disk pool
        (which lets the next eviction demote)."""
        return self._coming(ready) > 0 or any(p.coming for p in self._pools
                                              if p.tier == DISK and p.alive)

    def _room(self, nbytes: int, share: float = 1.0) -> None:
        """Evicts what the ready pools lack of ``nbytes`` free (at most ``share`` of
        their capacity), counting the space on its way back."""
        now = self._clock()
        ready = [p for p in self._pools if p.alive and p.node.active and p.tier != DISK
                 and p.usable_after <= now]
        if ready:
            nbytes = min(nbytes, int(sum(p.space.capacity for p in ready) * share))
            self._evict(nbytes - sum(p.space.free_bytes for p in ready)
                        - self._coming(ready))

    def _park(self, ident: bytes, msg: KvPut, until: float, since: float, short: int,
              ready: list[Pool]) -> bool:
        """Evicts what a put is ``short`` of, less the space on its way back, and as
        much again (up to 1/1024 of the pools) for the puts that follow; parks the put
        until it lands. False when nothing is on its way."""
        slack = min(short, sum(p.space.capacity for p in ready) // 1024)
        self._evict(short + slack - self._coming(ready))
        if not self._on_way(ready):
            return False
        self._parked.append((ident, msg, until, since))
        return True

    def _place(self, ready: list[Pool], length: int, want: int, spin: int
               ) -> list[tuple[int, int]]:
        """Space for ``want`` replicas on distinct nodes, preferring DRAM, then zones and
        pods not used yet; ``spin`` rotates the starting pool so puts spread over nodes."""
        count = len(ready)
        if want == 1:  # the common case: the first pool from ``spin`` with room, DRAM first
            for dram in (True, False):
                for j in range(count):
                    pool = ready[(spin + j) % count]
                    if (pool.tier == "dram") == dram and pool.space.free_bytes >= length:
                        off = pool.space.alloc(length)
                        if off >= 0:
                            return [(pool.index, off)]
            return []
        got: list[tuple[int, int]] = []
        used_nodes: set[str] = set()
        used_zones: set[str] = set()
        used_pods: set[str] = set()
        for _ in range(want):
            cands: list[tuple[int, int, Pool]] = []
            for j in range(count):
                pool = ready[(spin + j) % count]
                node = pool.node
                if node.name in used_nodes or pool.space.free_bytes < length:
                    continue
                rank = (2 * (pool.tier != "dram") + (node.zone != "" and node.zone in used_zones)
                        + (node.pod != "" and node.pod in used_pods))
                cands.append((rank, j, pool))
            cands.sort(key=lambda c: (c[0], c[1]))
            for _, _, pool in cands:
                off = pool.space.alloc(length)
                if off >= 0:
                    got.append((pool.index, off))
                    used_nodes.add(pool.node.name)
                    used_zones.add(pool.node.zone)
                    used_pods.add(pool.node.pod)
                    break
            else:
                break
        return got

    def _commit(self, msg: KvCommit) -> KvCommitted:
        put = self._puts.pop(msg.put_id, None)
        if put is None:
            raise StoreError(f"unknown put {msg.put_id}: its deadline passed or the master "
                             "restarted; nothing of it is stored")
        t = self.table
        rows = put.rows
        status = np.full(put.n, Status.FAILED, dtype=np.int8)
        if msg.abort:
            self._free_rows(rows)
            return KvCommitted(status=status.tobytes())
        failed = {str(name) for name in msg.failed}
        for name in failed:  # new objects keep off it a while (a node that heartbeats
            node = self._nodes.get(name)  # but serves nothing would take every retry)
            if node is not None:
                node.suspect_until = self._clock() + SUSPECT_S
        if failed:
            bad = [p.index for p in self._pools if p.node.name in failed]
            gone = self._drop_replicas(rows, np.array(bad, dtype=np.int32), free=True)
            rows = rows[~gone]
            self._free_rows(put.rows[gone])
            keep = ~gone
        else:
            keep = np.ones(rows.size, dtype=bool)
        alive = t.nrep[rows] > 0
        if not alive.all():
            self._free_rows(rows[~alive])
            rows = rows[alive]
        old = t.publish(rows, distinct=True)  # one put's keys: checked at placement
        self._retire(old[old >= 0])
        self._journal_commits(rows)
        status[put.keys_placed[keep][alive]] = Status.OK
        self.counters["commits"] += int(rows.size)
        return KvCommitted(status=status.tobytes())

    def _unpark(self, now: float) -> None:
        """Runs the parked puts again, in arrival order; those past their wait are
        answered whatever they get (RETRY where there is still no room)."""
        parked, self._parked = self._parked, []
        for ident, msg, until, since in parked:
            try:
                reply: Message | None = self._put(msg, ident if now < until else None,
                                                  until, since)
            except (ProtocolError, StoreError, ValueError) as exc:
                reply = ErrorReply(message=str(exc))
            if reply is not None:
                self.counters["parked_us"] += int(1e6 * (self._clock() - since))
                self._reply(ident, reply)

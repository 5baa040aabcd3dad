"""The kvstore master's storage nodes: registration, heartbeats, recovery, loss.

A node registers its pools (and, after a master restart, its directory of objects, in
parts), heartbeats every ``node_interval`` seconds, and is dropped after
``node_max_missed`` silent intervals: its replicas are forgotten, and objects left with
none are gone. A node that served an earlier master takes no new objects for
``grace_s`` seconds (a put of that master may still write its free space), and the
objects it reports are held as if leased for ``lease_s`` (readers of that master may
still read them).

Bounds: a node registers at most ``MAX_NODE_POOLS`` pools and a directory of at most
``MAX_DIRECTORY`` objects with versions below 2**62, and finishes registering within
``REGISTER_S`` seconds of its first part (else it is dropped, its parts with it). A
dropped node's pool numbers are given to later pools once ``2 * grace`` has passed and
no object names them, so that restarts do not grow the master's pool list.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgumentError
from kvstore.master_state import MasterState, Node, Pool
from kvstore.objects import State
from kvstore.protocol import (
    ENTRY,
    RETIRED_VERSION,
    KvBeat,
    KvBeatAck,
    KvNode,
    KvNodeWelcome,
    column,
)
from kvstore.space import Space
from transfer_engine.errors import ProtocolError

__all__ = ["Nodes"]

log = logging.getLogger("kvstore.master")  # the master's log, as its other lines

MAX_NODE_POOLS = 64
MAX_POOLS = 4096  # pools the master holds, live and dead ones not yet reused
MAX_TEXT = 1024  # characters in a node's name, incarnation, endpoint, place, pool names
MAX_POOL_BYTES = 1 << 56  # capacity one pool may claim
MAX_DIRECTORY = 1 << 22  # objects a rejoining node may report (56 bytes each here)
MAX_VERSION = 1 << 62
REGISTER_S = 60.0


class Nodes(MasterState):
    """Mixed into :class:`kvstore.master.Master`: ``kv-node`` and ``kv-beat``."""

    def _held_elsewhere(self, node: Node, ident: bytes, now: float) -> bool:
        """Whether ``node``'s name is held by a live node on another connection: one
        heard from within 1.5 heartbeats (a restarted node, or one whose connection
        was replaced, waits that long; a stranger cannot take a live node's name)."""
        return (node.active and ident != node.identity
                and now - node.last_seen <= 1.5 * self.node_interval)

    def _beat(self, ident: bytes, msg: KvBeat) -> KvBeatAck:
        node = self._nodes.get(msg.name)
        if (node is None or node.incarnation != msg.incarnation or not node.active
                or msg.epoch != self.epoch):
            return KvBeatAck(known=False, epoch=self.epoch)
        now = self._clock()
        if self._held_elsewhere(node, ident, now):
            raise ProtocolError(f"node {msg.name} beats on another connection")
        node.last_seen = now
        node.identity = ident
        self._acked(node, msg.acked)
        for i, (seq, sent, frame) in enumerate(node.unacked):
            if now - sent > self.node_interval:
                node.unacked[i] = (seq, now, frame)
                self._send_node(node, frame)
        return KvBeatAck(known=True, epoch=self.epoch)

    def _register(self, ident: bytes, msg: KvNode) -> KvNodeWelcome:
        now = self._clock()
        for what in ("name", "incarnation", "control", "pod", "zone"):
            text = getattr(msg, what)
            if not isinstance(text, str) or len(text) > MAX_TEXT or (
                    what == "name" and not text):
                raise ProtocolError(f"node registration: {what} is a string of at most "
                                    f"{MAX_TEXT} characters")
        node = self._nodes.get(msg.name)
        if msg.part == 0:
            if node is not None and self._held_elsewhere(node, ident, now):
                raise ProtocolError(f"node name {msg.name} is held by a live node: "
                                    "registering again once it has been silent for "
                                    f"{1.5 * self.node_interval:g}s")
            if node is not None:
                self._drop_node(node, "registered again")
            node = Node(msg.name, msg.incarnation, msg.control, msg.pod, msg.zone, ident,
                         now, since=now)
            self._nodes[msg.name] = node
        elif node is None or node.incarnation != msg.incarnation or node.active or \
                msg.part != len(node.parts):
            raise ProtocolError(f"node {msg.name}: registration part {msg.part} out of order")
        if len(msg.pools) > MAX_NODE_POOLS:
            self._drop_node(node, "too many pools")
            raise ProtocolError(f"node {msg.name}: at most {MAX_NODE_POOLS} pools")
        part = column(msg.entries, ENTRY, None, "entries")
        held = sum(len(p) for p in node.parts) + len(part)
        if held > MAX_DIRECTORY or (part.size and int(part["version"].max()) >= MAX_VERSION):
            self._drop_node(node, "directory out of bounds")
            raise ProtocolError(f"node {msg.name}: a directory holds at most "
                                f"{MAX_DIRECTORY} objects, with versions below 2**62")
        node.identity = ident
        node.last_seen = now
        node.parts.append(part.copy())
        if not msg.last:
            return KvNodeWelcome(epoch=self.epoch, interval=self.node_interval,
                                 max_missed=self.node_max_missed)
        entries = np.concatenate(node.parts)
        node.parts = []
        seen_before = bool(msg.epoch) or entries.size > 0
        usable_after = now + self.grace_s if seen_before else now
        try:  # every row checked before a pool is made: a refusal leaves nothing behind
            spaces = [self._pool_space(msg, spec, entries, local)
                      for local, spec in enumerate(msg.pools)]
            if (entries["pool"] >= len(msg.pools)).any() or (entries["pool"] < 0).any():
                raise ProtocolError(f"node {msg.name}: directory names an unknown pool")
            if len(self._pools) + len(spaces) - len(self._dead_pools) > MAX_POOLS:
                raise ProtocolError(f"node {msg.name}: the master holds at most "
                                    f"{MAX_POOLS} pools")
        except (ProtocolError, InvalidArgumentError) as exc:
            self._drop_node(node, "registration refused")
            raise ProtocolError(str(exc)) from None
        for local, (spec, space) in enumerate(zip(msg.pools, spaces, strict=True)):
            index = self._pool_slot(now)
            pool = Pool(index, node, local, spec[0], spec[2], space, usable_after)
            if index == len(self._pools):
                self._pools.append(pool)
            else:
                self._pools[index] = pool
            node.pools.append(pool.index)
        node.active = True
        if entries.size:
            self._recover(node, entries)
        log.info("kvstore master: node %s joined (%d pools, %d objects)", node.name,
                 len(node.pools), entries.size)
        return KvNodeWelcome(epoch=self.epoch, interval=self.node_interval,
                             max_missed=self.node_max_missed)

    @staticmethod
    def _pool_space(msg: KvNode, spec: Any, entries: np.ndarray, local: int) -> Space:
        """The space of a registering node's pool row ``spec`` (``[segment, bytes,
        tier]``) with its directory's objects in place; ProtocolError if malformed."""
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
                and type(spec[1]) is int and isinstance(spec[2], str)
                and 0 < spec[1] <= MAX_POOL_BYTES
                and len(spec[0]) <= MAX_TEXT and len(spec[2]) <= MAX_TEXT):
            raise ProtocolError(f"node {msg.name}: pools rows are [segment, bytes, tier] "
                                f"(1 to 2**56 bytes, names of at most {MAX_TEXT} "
                                "characters)")
        mine = entries[entries["pool"] == local]
        return Space.from_used(spec[1], mine["offset"], mine["length"])

    def _pool_slot(self, now: float) -> int:
        """A number for a new pool: a dead pool's, once ``2 * grace`` has passed since
        it died (no put or lease of its time is left) and no object names it; else a
        new one."""
        dead = self._dead_pools
        quiet = 2 * max(self.grace_s, self.lease_s, self.put_timeout_s)
        if dead and now - dead[0][0] > quiet:
            _, index = dead.popleft()
            t = self.table
            cap = t.capacity
            if not (t.pool[:cap][t.state[:cap] != State.FREE] == index).any():
                return index
            dead.append((now, index))  # still named: look again later
        return len(self._pools)

    def _recover(self, node: Node, entries: np.ndarray) -> None:
        """Adds a rejoining node's directory to the table: the newest version of a key
        wins, replicas of one version merge, everything else is freed."""
        t = self.table
        # removed under a lease, or past their TTL: held a lease's time, then freed
        gone = (entries["version"] == RETIRED_VERSION) | (
            (entries["expires"] > 0) & (entries["expires"] <= time.time()))
        if gone.any():
            self._hold_retired(node, entries[gone])
            entries = entries[~gone]
            if entries.size == 0:
                return
        pool_of = np.array(node.pools, dtype=np.int64)[entries["pool"]]
        keys = np.ascontiguousarray(entries["key"]).astype(np.uint64)
        order = np.lexsort((~entries["version"].astype(np.uint64), keys[:, 1], keys[:, 0]))
        entries, keys, pool_of = entries[order], keys[order], pool_of[order]
        current = t.lookup(keys, touch=False).tolist()
        new_rows: list[int] = []
        prev_key: tuple[int, int] | None = None
        winner = -1
        for i, ((k0, k1), _, off, length, checksum, version, expires) in enumerate(
                entries.tolist()):
            if (k0, k1) != prev_key:
                prev_key = (k0, k1)
                row = current[i]
                if row >= 0 and int(t.version[row]) >= version:
                    winner = row
                else:
                    if row >= 0:
                        t.unpublish_rows(np.array([row]))
                        self._retire(np.array([row]))
                    winner = int(t.new_rows(1)[0])
                    t.keys[winner] = (k0, k1)
                    t.length[winner] = length
                    t.checksum[winner] = checksum
                    t.version[winner] = version
                    t.deadline[winner] = (math.inf if expires <= 0 else  # its TTL
                                          self._clock() + expires - time.time())
                    t.state[winner] = State.PENDING
                    new_rows.append(winner)
            n = int(t.nrep[winner])
            p = int(pool_of[i])
            if (int(t.version[winner]) == version and n < self.max_replicas
                    and int(t.length[winner]) == length
                    and p not in t.pool[winner, :n].tolist()):
                t.pool[winner, n] = p
                t.offset[winner, n] = off
                t.nrep[winner] = n + 1
            else:
                self._queue_free(p, off, length)
        self._version = max(self._version, int(entries["version"].max()) + 1)
        if new_rows:
            rows = np.array(new_rows, dtype=np.int64)
            t.publish(rows)
            # readers of the previous master may still be reading these
            np.add.at(t.leases, rows, 1)
            self._lease(rows)

    def _hold_retired(self, node: Node, entries: np.ndarray) -> None:
        """Objects a previous master removed while a reader's lease held them: never
        published again; their space is freed once a lease of ours has passed (such a
        reader may still be reading)."""
        t = self.table
        rows = t.new_rows(entries.size)
        t.keys[rows] = np.ascontiguousarray(entries["key"]).astype(np.uint64)
        t.length[rows] = entries["length"]
        t.checksum[rows] = entries["checksum"]
        t.version[rows] = RETIRED_VERSION
        t.pool[rows, 0] = np.array(node.pools, dtype=np.int64)[entries["pool"]]
        t.offset[rows, 0] = entries["offset"]
        t.nrep[rows] = 1
        t.state[rows] = State.RETIRED
        np.add.at(t.leases, rows, 1)
        self._lease(rows)

    def _drop_node(self, node: Node, reason: str) -> None:
        log.warning("kvstore master: dropping node %s (%s)", node.name, reason)
        self.counters["nodes_dropped"] += 1
        dead = np.array(node.pools, dtype=np.int32)
        for p in node.pools:
            self._pools[p].alive = False
            self._dead_pools.append((self._clock(), p))
        node.active = False
        self._nodes.pop(node.name, None)
        t = self.table
        if dead.size:
            cap = t.capacity
            hit = np.flatnonzero((np.isin(t.pool[:cap], dead)).any(axis=1)
                                 & (t.state[:cap] != State.FREE))
            if hit.size:
                empty = hit[self._drop_replicas(hit, dead, free=False)]
                live = empty[t.state[empty] == State.LIVE]
                t.unpublish_rows(live)
                self._retire(live)
                retired = empty[(t.state[empty] == State.RETIRED) & (t.leases[empty] == 0)]
                t.drop_rows(retired)
        if node.copies or node.moving:  # after its replicas are gone from the rows
            self._moves_lost(node)

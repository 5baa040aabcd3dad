"""The store's master: object metadata, space, leases and node liveness. No value bytes.

Protocol (messages in :mod:`kvstore.protocol`, signed as every control message):

* **Put** is two-phase. ``kv-put`` allocates, for each key, space on ``replicas``
  distinct nodes (distinct zones, then pods, when nodes publish them) and records the
  object PENDING; the client writes the bytes to the nodes with the engine's one-sided
  WRITE; ``kv-commit`` then makes the objects visible, replacing older versions. A
  reader never finds a PENDING object, so it never sees half-written or uncommitted
  bytes. A put not committed within ``put_timeout_s`` is dropped and its space freed.
* **Get**: ``kv-get`` answers the replicas of each key and a lease; until the lease is
  released (piggybacked on the client's next request) or ``lease_s`` passes, the space
  of those objects is not reused, even if they are removed, replaced or evicted.
* **Space** comes back to a pool only once the node has acknowledged the free in its
  journal (see below). Eviction takes the least recently used objects no lease holds,
  the deepest blocks of a chain before their prefix (see :mod:`kvstore.objects`); a
  get, a query or an ``if_absent`` put refreshes every key it finds. A get that misses
  keys makes room for them at once (as many keys as the latest put's, each), since a
  prefix cache puts what it missed once it has computed it: the frees land while it
  reads and computes, and its put finds room. A put that still finds none evicts what
  it lacks, less the frees already on their way back, and as much again (up to 1/1024
  of the pools) for the puts that follow, and is parked at the master: it is answered
  when the nodes acknowledge the frees, or with RETRY for the keys without room after
  two heartbeat intervals (the client then asks again).
* **Nodes** register their pools, heartbeat every ``node_interval`` seconds, and are
  dropped after ``node_max_missed`` silent intervals: their replicas are forgotten, and
  objects left with none are gone.
* **Restart**: every commit and free is pushed to the node holding the space (the
  *journal*), which keeps a directory of its objects. A restarted master has none; a
  node's next heartbeat learns that and the node registers again with its directory, from
  which the master rebuilds its table. Space the node reports as free may still be
  written by a put of the previous master, and objects it reports may be leased by
  readers of the previous master: such a node's pools take no new objects for
  ``grace_s`` seconds, and its objects are held as if leased for ``lease_s``.

Run it in-process (``with Master("tcp://127.0.0.1:0") as m: m.endpoint``) or as
``kvstore-master --bind tcp://0.0.0.0:7400`` (with ``TE_CONTROL_SECRET`` set when not on
loopback).
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from kvstore.errors import StoreError
from kvstore.index import has_duplicates
from kvstore.moves import DISK, Move, TierMoves
from kvstore.objects import ObjectTable, State
from kvstore.protocol import (
    ENTRY,
    JOURNAL,
    MAX_BATCH,
    KvBeat,
    KvBeatAck,
    KvCommit,
    KvCommitted,
    KvFound,
    KvGet,
    KvJournal,
    KvLocated,
    KvNode,
    KvNodeWelcome,
    KvPlaced,
    KvPut,
    KvQuery,
    KvRemove,
    KvStats,
    KvStatsReply,
    Op,
    Status,
    column,
)
from kvstore.space import Space
from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig, check_exposure, open_request, seal
from transfer_engine.control.messages import Denied, ErrorReply, Message
from transfer_engine.errors import AuthenticationError, ProtocolError

__all__ = ["Master", "main"]

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
_JOURNAL_CHUNK = 50_000  # ops per journal message (64 bytes each, under the 4 MiB limit)
SPREAD_BYTES = 8 << 20
"""A put batch of at least this many bytes (all replicas) is spread over the nodes."""


@dataclass(eq=False)
class _Node:
    name: str
    incarnation: str
    control: str
    pod: str
    zone: str
    identity: bytes
    last_seen: float
    pools: list[int] = field(default_factory=list)
    active: bool = False
    parts: list[np.ndarray] = field(default_factory=list)
    seq: int = 0  # last journal seq sent
    acked: int = 0
    unacked: collections.deque[tuple[int, float, bytes]] = field(
        default_factory=collections.deque)
    outbox: list[np.ndarray] = field(default_factory=list)
    frees: list[tuple[int, int, int]] = field(default_factory=list)  # not yet sent
    quarantine: collections.deque[tuple[int, list[tuple[int, int, int]]]] = field(
        default_factory=collections.deque)
    moving: list[int] = field(default_factory=list)  # rows of tier copies not yet sent
    copies: collections.deque[tuple[int, list[int]]] = field(
        default_factory=collections.deque)  # (journal seq, rows copied by it)


@dataclass(eq=False)
class _Pool:
    index: int
    node: _Node
    local: int  # the node's own number for this pool
    segment: str
    tier: str
    space: Space
    usable_after: float
    alive: bool = True
    pressure: bool = False  # disk: a demotion found no room (eviction may drop from it)
    coming: int = 0  # bytes freed through the journal, not yet acknowledged


@dataclass(eq=False)
class _Put:
    deadline: float
    keys_placed: I64  # positions in the request of the keys that got rows
    rows: I64
    n: int


class Master(TierMoves, Closeable):
    """The metadata service; see the module docstring.

    Parameters:
        bind: ZeroMQ endpoint to serve, e.g. ``tcp://127.0.0.1:0`` (0: a free port).
        auth: control-message signing (:class:`AuthConfig` or the secret); default
            ``AuthConfig.from_env()``.
        insecure: serve a non-loopback address without a secret (see
            :func:`~transfer_engine.control.auth.check_exposure`).
        lease_s: seconds a get's lease holds its objects' space at most.
        put_timeout_s: seconds a put may take between allocation and commit.
        grace_s: seconds a node that served an earlier master takes no new objects;
            default ``max(lease_s, put_timeout_s)``.
        node_interval: seconds between node heartbeats.
        node_max_missed: silent intervals after which a node is dropped.
        max_replicas: replicas an object may have at most.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *,
                 auth: AuthConfig | str | bytes | None = None, insecure: bool | None = None,
                 lease_s: float = 5.0, put_timeout_s: float = 20.0,
                 grace_s: float | None = None, node_interval: float = 0.5,
                 node_max_missed: int = 4, max_replicas: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._closed = True
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        host = bind.split("://", 1)[-1].rsplit(":", 1)[0]
        check_exposure(host, auth.secret is not None, insecure, what="kvstore master")
        self._signer = auth.signer()
        self.lease_s = float(lease_s)
        self.put_timeout_s = float(put_timeout_s)
        self.grace_s = float(max(lease_s, put_timeout_s) if grace_s is None else grace_s)
        self.node_interval = float(node_interval)
        self.node_max_missed = int(node_max_missed)
        self.max_replicas = int(max_replicas)
        self._clock = clock
        self.epoch = uuid.uuid4().hex[:16]
        self.table = ObjectTable(max_replicas=self.max_replicas)
        self._nodes: dict[str, _Node] = {}
        self._pools: list[_Pool] = []
        self._puts: dict[int, _Put] = {}
        self._put_ids = itertools.count(1)
        self._leases: dict[int, tuple[float, I64]] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._key_bytes = 0  # space a key of the latest put took, replicas included
        # puts waiting for frees: (client, put, answer by, parked at)
        self._parked: list[tuple[bytes, KvPut, float, float]] = []
        self._version = time.time_ns()
        self._moves: dict[int, Move] = {}
        self._moving: dict[int, int] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._zctx: zmq.Context[Any] = zmq.Context()
        try:
            self._sock = self._zctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
            if bind.endswith(":0"):
                port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.endpoint = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self._sock.bind(bind)
                self.endpoint = bind
        except BaseException:
            self._zctx.destroy(linger=0)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="te-kv-master", daemon=True)
        self._closed = False
        self._thread.start()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "OPEN"
        return (f"<Master {self.endpoint} objects={len(self.table)} "
                f"nodes={sum(n.active for n in self._nodes.values())} {state}>")

    def close(self) -> None:
        """Stops serving and releases the socket. Idempotent. Nodes keep their objects
        and register again with the next master."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(10)
        self._sock.close(linger=0)
        self._zctx.term()

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                if sock.poll(20, zmq.POLLIN):
                    with self._lock:
                        for _ in range(256):
                            try:
                                ident, frame = sock.recv_multipart(zmq.NOBLOCK)[-2:]
                            except zmq.Again:
                                break
                            self._serve(ident, frame)
                        self._flush()
                now = self._clock()
                if now >= next_tick:
                    with self._lock:
                        self._tick(now)
                        self._flush()
                    next_tick = now + 0.05
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.warning("kvstore master: %s", exc)
            except Exception:  # the service must outlive any one bad request
                log.exception("kvstore master loop")

    def _serve(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = open_request(frame, self._signer, peer="kv-client")
        except AuthenticationError as exc:
            log.warning("kvstore master: refused a message: %s", exc)
            self._sock.send_multipart([ident, seal(Denied(reason=str(exc)), None)])
            return
        except ProtocolError as exc:
            log.info("kvstore master: malformed message: %s", exc)
            self._reply(ident, ErrorReply(message=str(exc)))
            return
        try:
            reply = self._handle(ident, msg)
        except (ProtocolError, StoreError, ValueError) as exc:
            reply = ErrorReply(message=str(exc))
        if reply is not None:
            self._reply(ident, reply)

    def _reply(self, ident: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([ident, seal(msg, self._signer)], zmq.NOBLOCK)
        except zmq.Again:
            log.info("kvstore master: dropped a reply to a slow peer")

    def _handle(self, ident: bytes, msg: Message) -> Message | None:
        release = getattr(msg, "release", None)
        if release:
            self._release(column(release, "<u8", None, "release"))
        if isinstance(msg, KvGet):
            return self._get(msg)
        if isinstance(msg, KvPut):
            return self._put(msg, ident)
        if isinstance(msg, KvCommit):
            return self._commit(msg)
        if isinstance(msg, KvQuery):
            return self._query(msg)
        if isinstance(msg, KvRemove):
            return self._remove(msg)
        if isinstance(msg, KvBeat):
            return self._beat(ident, msg)
        if isinstance(msg, KvNode):
            return self._register(ident, msg)
        if isinstance(msg, KvStats):
            return KvStatsReply(stats=self._stats())
        return ErrorReply(message=f"the kvstore master does not serve {msg.kind!r}")

    # -- clients -----------------------------------------------------------------------

    def _keys(self, data: bytes) -> npt.NDArray[np.uint64]:
        keys = column(data, "<u8", None, "keys")
        if keys.size % 2 or keys.size // 2 > MAX_BATCH:
            raise ProtocolError(f"keys: a batch holds 1 to {MAX_BATCH} 16-byte keys")
        return keys.reshape(-1, 2).astype(np.uint64)

    def _node_table(self, pools: np.ndarray) -> tuple[list[Any], np.ndarray]:
        """Rows of the nodes ``pools`` refer to, and ``pools`` renumbered into them."""
        flat = pools.ravel()
        used = sorted(set(flat[flat >= 0].tolist()))  # a batch touches few pools
        rows = []
        for p in used:
            pool = self._pools[p]
            rows.append([pool.node.name, pool.node.incarnation, pool.node.control,
                         pool.segment])
        renumber = np.full(len(self._pools) + 1, -1, dtype=np.int32)  # [-1] stays -1
        renumber[used] = np.arange(len(used), dtype=np.int32)
        return rows, renumber[pools]

    def _get(self, msg: KvGet) -> KvLocated:
        keys = self._keys(msg.keys)
        t = self.table
        rows = t.lookup(keys, touch=True)
        found = rows >= 0
        status = np.where(found, Status.OK, Status.MISSING).astype(np.int8)
        hit = rows[found]
        self.counters["gets"] += keys.shape[0]
        self.counters["hits"] += int(hit.size)
        lease = 0
        if hit.size:
            np.add.at(t.leases, hit, 1)
            lease = next(self._lease_ids)
            expiry = self._clock() + self.lease_s
            self._leases[lease] = (expiry, hit)
            heapq.heappush(self._lease_heap, (expiry, lease))
        miss = keys.shape[0] - int(hit.size)
        if miss and self._key_bytes:
            # a prefix cache puts the blocks it missed once it has computed them: make
            # room for them now (the hits are leased: never evicted), so the frees land
            # while it reads and computes
            self._room(miss * self._key_bytes)
        pools = np.full((keys.shape[0], self.max_replicas), -1, dtype=np.int32)
        offsets = np.zeros((keys.shape[0], self.max_replicas), dtype=np.int64)
        pools[found] = t.pool[hit]
        offsets[found] = t.offset[hit]
        lengths = np.zeros(keys.shape[0], dtype=np.int64)
        lengths[found] = t.length[hit]
        checks = np.zeros(keys.shape[0], dtype=np.uint64)
        checks[found] = t.checksum[hit]
        versions = np.zeros(keys.shape[0], dtype=np.uint64)
        versions[found] = t.version[hit]
        if hit.size and self._tiered:
            self._promote(hit)
        nodes, pools = self._node_table(pools)
        return KvLocated(lease_id=lease, lease_s=self.lease_s, status=status.tobytes(),
                         lengths=lengths.tobytes(), checksums=checks.tobytes(),
                         versions=versions.tobytes(),
                         replicas=self.max_replicas, nodes=nodes, pools=pools.tobytes(),
                         offsets=offsets.tobytes())

    def _promote(self, rows: I64) -> None:
        """Counts hits on objects only on disk and moves them back to DRAM where their
        node has room (the get itself reads them from disk)."""
        disk = np.array([p.tier == DISK for p in self._pools] + [True])
        pools = self.table.pool[rows]  # -1 indexes the trailing True
        only = rows[disk[pools].all(axis=1)]
        if only.size:
            self.counters["disk_hits"] += int(only.size)
            self._start_moves(only, "dram")

    def _query(self, msg: KvQuery) -> KvFound:
        rows = self.table.lookup(self._keys(msg.keys), touch=True)
        return KvFound(status=np.where(rows >= 0, Status.OK, Status.MISSING)
                       .astype(np.int8).tobytes())

    def _remove(self, msg: KvRemove) -> KvFound:
        keys = self._keys(msg.keys)
        _check_distinct(keys)
        rows = self.table.unpublish(keys)
        self._retire(rows[rows >= 0])
        return KvFound(status=np.where(rows >= 0, Status.OK, Status.MISSING)
                       .astype(np.int8).tobytes())

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
        _check_distinct(keys)
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
        ready.sort(key=lambda p: p.index)
        biggest = max((p.space.capacity for p in usable), default=0)
        want = min(msg.replicas, len({p.node.name for p in ready}))
        until = now + 2 * self.node_interval if until is None else until
        first = since is None
        since = now if since is None else since
        if ready and todo.size:
            self._key_bytes = int(ready[0].space.round(lengths[todo]).mean()) * max(1, want)
        if ident is not None and ready and todo.size:
            # clearly short of room: evict and park before placing anything
            fits = lengths[todo][lengths[todo] <= biggest]
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
        put_id = start
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
            self._puts[put_id] = _Put(now + self.put_timeout_s, placed, rows, n)
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

    def _coming(self, ready: list[_Pool]) -> int:
        """Bytes on their way back to the ``ready`` pools: frees not yet acknowledged,
        and the DRAM that pending demotions free once they complete."""
        return sum(p.coming for p in ready) + (self._demoting() if self._moves else 0)

    def _on_way(self, ready: list[_Pool]) -> bool:
        """Whether space is on its way back to the ``ready`` pools, or to a disk pool
        (which lets the next eviction demote)."""
        return self._coming(ready) > 0 or any(p.coming for p in self._pools
                                              if p.tier == DISK and p.alive)

    def _room(self, nbytes: int) -> None:
        """Evicts what the ready pools lack of ``nbytes`` free, counting the space on its
        way back."""
        now = self._clock()
        ready = [p for p in self._pools if p.alive and p.node.active and p.tier != DISK
                 and p.usable_after <= now]
        if ready:
            self._evict(nbytes - sum(p.space.free_bytes for p in ready)
                        - self._coming(ready))

    def _park(self, ident: bytes, msg: KvPut, until: float, since: float, short: int,
              ready: list[_Pool]) -> bool:
        """Evicts what a put is ``short`` of, less the space on its way back, and as
        much again (up to 1/1024 of the pools) for the puts that follow; parks the put
        until it lands. False when nothing is on its way."""
        slack = min(short, sum(p.space.capacity for p in ready) // 1024)
        self._evict(short + slack - self._coming(ready))
        if not self._on_way(ready):
            return False
        self._parked.append((ident, msg, until, since))
        return True

    def _place(self, ready: list[_Pool], length: int, want: int, spin: int
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
            cands: list[tuple[int, int, _Pool]] = []
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

    # -- space -------------------------------------------------------------------------

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
        self._free_rows(rows[~held])

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

    # -- journal -----------------------------------------------------------------------

    def _journal_commits(self, rows: I64) -> None:
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
                ops["op"] = Op.COMMIT
                e = ops["entry"]
                e["key"] = t.keys[these]
                e["pool"] = pool.local
                e["offset"] = t.offset[these, r]
                e["length"] = t.length[these]
                e["checksum"] = t.checksum[these]
                e["version"] = t.version[these]
                pool.node.outbox.append(ops)

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
            for start in range(0, ops.size, _JOURNAL_CHUNK):
                node.seq += 1
                frame = seal(KvJournal(epoch=self.epoch, seq=node.seq,
                                       ops=ops[start:start + _JOURNAL_CHUNK].tobytes()),
                             self._signer)
                node.unacked.append((node.seq, now, frame))
                self._send_node(node, frame)
            if node.frees:
                node.quarantine.append((node.seq, node.frees))
                node.frees = []
            if node.moving:
                node.copies.append((node.seq, node.moving))
                node.moving = []

    def _send_node(self, node: _Node, frame: bytes) -> None:
        try:
            self._sock.send_multipart([node.identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # resent after the next heartbeat

    def _acked(self, node: _Node, seq: int) -> None:
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

    # -- nodes -------------------------------------------------------------------------

    def _beat(self, ident: bytes, msg: KvBeat) -> KvBeatAck:
        node = self._nodes.get(msg.name)
        if (node is None or node.incarnation != msg.incarnation or not node.active
                or msg.epoch != self.epoch):
            return KvBeatAck(known=False, epoch=self.epoch)
        now = self._clock()
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
        node = self._nodes.get(msg.name)
        if msg.part == 0:
            if node is not None:
                self._drop_node(node, "registered again")
            node = _Node(msg.name, msg.incarnation, msg.control, msg.pod, msg.zone, ident,
                         now)
            self._nodes[msg.name] = node
        elif node is None or node.incarnation != msg.incarnation or node.active or \
                msg.part != len(node.parts):
            raise ProtocolError(f"node {msg.name}: registration part {msg.part} out of order")
        node.identity = ident
        node.last_seen = now
        node.parts.append(column(msg.entries, ENTRY, None, "entries").copy())
        if not msg.last:
            return KvNodeWelcome(epoch=self.epoch, interval=self.node_interval,
                                 max_missed=self.node_max_missed)
        entries = np.concatenate(node.parts)
        node.parts = []
        seen_before = bool(msg.epoch) or entries.size > 0
        usable_after = now + self.grace_s if seen_before else now
        for local, spec in enumerate(msg.pools):
            if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
                    and isinstance(spec[1], int) and isinstance(spec[2], str)):
                raise ProtocolError(f"node {msg.name}: pools rows are [segment, bytes, tier]")
            mine = entries[entries["pool"] == local]
            space = Space.from_used(spec[1], mine["offset"], mine["length"])
            pool = _Pool(len(self._pools), node, local, spec[0], spec[2], space, usable_after)
            self._pools.append(pool)
            node.pools.append(pool.index)
        if (entries["pool"] >= len(msg.pools)).any() or (entries["pool"] < 0).any():
            raise ProtocolError(f"node {msg.name}: directory names an unknown pool")
        node.active = True
        if entries.size:
            self._recover(node, entries)
        log.info("kvstore master: node %s joined (%d pools, %d objects)", node.name,
                 len(node.pools), entries.size)
        return KvNodeWelcome(epoch=self.epoch, interval=self.node_interval,
                             max_missed=self.node_max_missed)

    def _recover(self, node: _Node, entries: np.ndarray) -> None:
        """Adds a rejoining node's directory to the table: the newest version of a key
        wins, replicas of one version merge, everything else is freed."""
        t = self.table
        pool_of = np.array(node.pools, dtype=np.int64)[entries["pool"]]
        keys = np.ascontiguousarray(entries["key"]).astype(np.uint64)
        order = np.lexsort((~entries["version"].astype(np.uint64), keys[:, 1], keys[:, 0]))
        entries, keys, pool_of = entries[order], keys[order], pool_of[order]
        current = t.lookup(keys, touch=False).tolist()
        new_rows: list[int] = []
        prev_key: tuple[int, int] | None = None
        winner = -1
        for i, ((k0, k1), _, off, length, checksum, version) in enumerate(entries.tolist()):
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
            lease = next(self._lease_ids)
            expiry = self._clock() + self.lease_s
            self._leases[lease] = (expiry, rows)
            heapq.heappush(self._lease_heap, (expiry, lease))

    def _drop_node(self, node: _Node, reason: str) -> None:
        log.warning("kvstore master: dropping node %s (%s)", node.name, reason)
        self.counters["nodes_dropped"] += 1
        dead = np.array(node.pools, dtype=np.int32)
        for p in node.pools:
            self._pools[p].alive = False
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

    # -- time --------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if any(p[2] <= now for p in self._parked):
            self._unpark(now)
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease = heapq.heappop(self._lease_heap)
            entry = self._leases.pop(lease, None)
            if entry is not None:
                self._unlease(entry[1])
        for put_id, put in list(self._puts.items()):
            if put.deadline > now:
                break
            del self._puts[put_id]
            self.counters["puts_expired"] += 1
            self._free_rows(put.rows)
        expired = self.table.expired(now)
        if expired.size:
            self.counters["expirations"] += int(expired.size)
            self._retire(expired)
        limit = self.node_interval * self.node_max_missed
        for node in list(self._nodes.values()):
            if now - node.last_seen > limit:
                self._drop_node(node, f"silent for {now - node.last_seen:.1f}s")

    # -- introspection -----------------------------------------------------------------

    def _stats(self) -> dict[str, Any]:
        t = self.table
        return {
            "epoch": self.epoch,
            "objects": len(t),
            "rows": t.rows_in_use,
            "table_bytes": t.nbytes(),
            "leases": len(self._leases),
            "pending_puts": len(self._puts),
            "pending_moves": len(self._moves),
            "nodes": sorted(n.name for n in self._nodes.values() if n.active),
            "pools": [{"node": p.node.name, "segment": p.segment, "tier": p.tier,
                       "capacity": p.space.capacity, "free": p.space.free_bytes,
                       "ready": p.usable_after <= self._clock()}
                      for p in self._pools if p.alive],
            **{k: int(v) for k, v in self.counters.items()},
        }

    def stats(self) -> dict[str, Any]:
        """Objects, rows, pools (free space per node), leases, counters."""
        with self._lock:
            return self._stats()

    def wait_nodes(self, count: int, timeout: float = 10.0, *, ready: bool = True) -> None:
        """Waits until ``count`` nodes are registered (and, with ``ready``, past their
        grace period); raises :class:`StoreError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                now = self._clock()
                names = {p.node.name for p in self._pools if p.alive and p.node.active
                         and (not ready or p.usable_after <= now)}
            if len(names) >= count:
                return
            if time.monotonic() > deadline:
                raise StoreError(f"{len(names)} of {count} storage nodes after {timeout}s")
            time.sleep(0.01)


def _check_distinct(keys: np.ndarray) -> None:
    if has_duplicates(keys):
        raise ProtocolError("keys in one request must be distinct")


def main(argv: list[str] | None = None) -> None:
    """``kvstore-master``: serves until SIGINT or SIGTERM."""
    ap = argparse.ArgumentParser(prog="kvstore-master", description=__doc__.split("\n")[0])
    ap.add_argument("--bind", default="tcp://127.0.0.1:7400")
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--put-timeout-s", type=float, default=20.0)
    ap.add_argument("--grace-s", type=float, default=None)
    ap.add_argument("--node-interval", type=float, default=0.5)
    ap.add_argument("--secret-file", default=None, help="file holding the control secret")
    ap.add_argument("--insecure", action="store_true",
                    help="serve a non-loopback address without a secret")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    auth = AuthConfig.from_env()
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            auth = AuthConfig(secret=f.read().strip())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Master(args.bind, auth=auth, insecure=args.insecure or None, lease_s=args.lease_s,
                put_timeout_s=args.put_timeout_s, grace_s=args.grace_s,
                node_interval=args.node_interval) as master:
        print(f"kvstore-master serving {master.endpoint} epoch {master.epoch}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()

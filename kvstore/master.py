"""The store's master: object metadata, space, leases and node liveness. No value bytes.

Protocol (messages in :mod:`kvstore.protocol`, signed as every control message):

* **Put** is two-phase. ``kv-put`` allocates, for each key, space on ``replicas``
  distinct nodes (distinct zones, then pods, when nodes publish them) and records the
  object PENDING; the client writes the bytes to the nodes with the engine's one-sided
  WRITE; ``kv-commit`` then makes the objects visible, replacing older versions. A
  reader never finds a PENDING object, so it never sees half-written or uncommitted
  bytes. A put not committed within ``put_timeout_s`` is dropped and its space freed,
  fenced: the journal push carrying the frees names the writer's engine (``KvPut``
  ``writer``), which each node cuts off its engine before it applies or acknowledges
  the push, so a late WRITE of a stalled writer never lands in reused space.
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

This module holds the service loop, the requests that only read (get, query, remove,
stats) and the timers; the rest is mixed in from one module each (see
:mod:`kvstore.master_state`): :mod:`kvstore.placement` (put and commit),
:mod:`kvstore.reclaim` (leases, frees, eviction), :mod:`kvstore.journal`,
:mod:`kvstore.nodes` and :mod:`kvstore.moves` (tiers).

Run it in-process (``with Master("tcp://127.0.0.1:0") as m: m.endpoint``) or as
``kvstore-master --bind tcp://0.0.0.0:7400`` (with ``TE_CONTROL_SECRET`` set when not on
loopback). With ``--etcd ADDRESS`` several masters stand by and the one that leads in
etcd serves (:mod:`transfer_engine.control.etcd_leader`); nodes and clients given the
same address follow it (:mod:`kvstore.link`), and a new leader rebuilds its table from
the nodes as after a restart.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import zmq

from kvstore.errors import StoreError
from kvstore.journal import Journal
from kvstore.link import MASTER_ROLE
from kvstore.master_state import I64, Node, PendingPut, Pool, check_distinct
from kvstore.moves import DISK, Move
from kvstore.nodes import REGISTER_S, Nodes
from kvstore.objects import ObjectTable
from kvstore.placement import Placement
from kvstore.protocol import (
    KvBeat,
    KvCommit,
    KvFound,
    KvGet,
    KvLocated,
    KvNode,
    KvPut,
    KvQuery,
    KvRemove,
    KvStats,
    KvStatsReply,
    Status,
    column,
)
from kvstore.reclaim import Reclaim
from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig, check_exposure, open_request
from transfer_engine.control.etcd_leader import EtcdLeader
from transfer_engine.control.messages import ErrorReply, Message
from transfer_engine.control.reply import SINGLE_FRAME, answer_multipart, refuse, send_reply
from transfer_engine.errors import AuthenticationError, ClosedError, ProtocolError

__all__ = ["Master", "main"]

log = logging.getLogger(__name__)

MISS_ROOM_SHARE = 0.125  # most of the store one get's misses make room for


class Master(Placement, Reclaim, Journal, Nodes, Closeable):
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
        self._nodes: dict[str, Node] = {}
        self._pools: list[Pool] = []
        self._dead_pools: collections.deque[tuple[float, int]] = collections.deque()
        self._puts: dict[int, PendingPut] = {}
        self._put_ids = itertools.count(1)
        self._leases: dict[int, tuple[float, I64]] = {}
        self._lease_heap: list[tuple[float, int]] = []
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
                                frames = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._serve(frames)
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

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.info("kvstore master: malformed message: %s (%d frames)", SINGLE_FRAME,
                     len(frames))
            answer_multipart(self._sock, frames, self._signer)
            return
        ident, frame = frames
        try:
            msg = open_request(frame, self._signer, peer="kv-client")
        except (AuthenticationError, ProtocolError) as exc:
            if isinstance(exc, AuthenticationError):
                log.warning("kvstore master: refused a message: %s", exc)
            else:
                log.info("kvstore master: malformed message: %s", exc)
            refuse(self._sock, ident, exc, self._signer)
            return
        try:
            reply = self._handle(ident, msg)
        except (ProtocolError, StoreError, ValueError) as exc:
            reply = ErrorReply(message=str(exc))
        except Exception as exc:  # a bug: the asker gets an answer, the loop goes on
            log.exception("kvstore master: %s failed", msg.kind)
            reply = ErrorReply(message=f"the master failed on {msg.kind}: {exc!r:.200}")
        if reply is not None:
            self._reply(ident, reply)

    def _reply(self, ident: bytes, msg: Message) -> None:
        if not send_reply(self._sock, ident, msg, self._signer):
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
            lease = self._lease(hit)
        miss = keys.shape[0] - int(hit.size)
        if miss and self._key_bytes:
            # a prefix cache puts the blocks it missed once it has computed them: make
            # room for them now (the hits are leased: never evicted), so the frees land
            # while it reads and computes; one get makes room for an eighth of the
            # store at most (its puts evict what they still lack)
            self._room(miss * self._key_bytes, share=MISS_ROOM_SHARE)
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
        check_distinct(keys)
        rows = self.table.unpublish(keys)
        self._retire(rows[rows >= 0])
        return KvFound(status=np.where(rows >= 0, Status.OK, Status.MISSING)
                       .astype(np.int8).tobytes())

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
            if not self._fence(put.rows, put.writer):
                continue  # its nodes fence enough writers this time: the next tick
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
            elif not node.active and now - node.since > REGISTER_S:
                self._drop_node(node, f"still registering after {REGISTER_S:g}s")

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
    ap.add_argument("--etcd", default=None,
                    help="etcd://h1:2379[,h2:2379...][/prefix]: stand by until this master "
                         "leads there, then serve and publish --advertise; nodes and "
                         "clients given the same address follow the leader")
    ap.add_argument("--advertise", default=None,
                    help="endpoint published in etcd (default: --bind)")
    ap.add_argument("--leader-ttl", type=float, default=3.0,
                    help="seconds a master that stopped renewing keeps the lead")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    auth = AuthConfig.from_env()
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            auth = AuthConfig(secret=f.read().strip())
    stop, lost = threading.Event(), threading.Event()
    leader: EtcdLeader | None = None
    if args.etcd:
        advertise = args.advertise or args.bind
        host, _, port = advertise.rpartition(":")
        if port in ("0", "*") or host.endswith(("0.0.0.0", "*", "[::]")):
            ap.error(f"--etcd needs an endpoint others can reach: give --advertise (and a "
                     f"fixed port in --bind), not {advertise!r}")
        def on_lost() -> None:
            lost.set()
            stop.set()
        leader = EtcdLeader(args.etcd, MASTER_ROLE, advertise, ttl=args.leader_ttl,
                            on_lost=on_lost)

    def on_signal(*_: object) -> None:
        stop.set()
        if leader is not None:
            leader.cancel()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with ExitStack() as stack:
        if leader is not None:
            stack.callback(leader.close)
            print(f"kvstore-master standing by for the lead in {args.etcd}", flush=True)
            try:
                leader.campaign()
            except ClosedError:
                return
        master = stack.enter_context(Master(
            args.bind, auth=auth, insecure=args.insecure or None, lease_s=args.lease_s,
            put_timeout_s=args.put_timeout_s, grace_s=args.grace_s,
            node_interval=args.node_interval))
        role = " (leader)" if leader is not None else ""
        print(f"kvstore-master serving {master.endpoint} epoch {master.epoch}{role}",
              flush=True)
        stop.wait()
    if lost.is_set():  # a supervisor may start it again, as a standby
        print("kvstore-master lost the lead; stopped serving", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()

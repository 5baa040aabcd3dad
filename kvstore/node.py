"""A storage node: an engine that lends its registered DRAM (and optionally a disk file)
to the store.

Clients WRITE values into the node's segments and READ them back with the engine's
one-sided operations, at offsets the master hands out. The only bytes the node moves
itself are tier moves: with a disk pool, the master demotes objects from DRAM to disk
when DRAM runs short and promotes them back on a hit (:mod:`kvstore.moves`), and the node
copies them between its own pools when the journal says so. Otherwise the node's job is
to stay known to the master: it registers its pools, heartbeats, and applies
the master's *journal* (commits and frees of its space) to a directory of the objects it
holds, acknowledging each push. A restarted master learns the node's objects from that
directory when the node registers again.

In-process (tests, the demo)::

    with Master() as master, StorageNode(master.endpoint, 256 << 20) as node:
        ...

As a process: ``python -m kvstore.node --master tcp://HOST:7400 --capacity 1G``.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import signal
import threading
import time
import uuid
from contextlib import ExitStack
from typing import Any

import numpy as np
import zmq

from kvstore.errors import InvalidArgumentError, StoreError
from kvstore.link import locate_master, moved_master
from kvstore.protocol import (
    ENTRY,
    JOURNAL,
    MAX_FENCE,
    RETIRED_VERSION,
    KvBeat,
    KvBeatAck,
    KvJournal,
    KvNode,
    KvNodeWelcome,
    Op,
    column,
)
from transfer_engine import Engine
from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.etcd_client import ETCD_SCHEME
from transfer_engine.control.messages import Message
from transfer_engine.control.request import SignedClient
from transfer_engine.control.tickets import valid_name
from transfer_engine.errors import ClosedError, TransferEngineError

__all__ = ["StorageNode", "main"]

log = logging.getLogger(__name__)

_PART = 60_000  # directory entries per registration message (64 bytes each)

# key lo, key hi, pool, offset, len, ck, ver, expires (epoch seconds, 0: never)
Entry = tuple[int, int, int, int, int, int, int, float]


class StorageNode(Closeable):
    """Contributes memory to the store; see the module docstring.

    Parameters:
        master: the master's endpoint, or the etcd that names the leading master
            (``etcd://h1:2379[,...][/prefix]``, see :mod:`kvstore.link`): a node whose
            master goes silent looks the leader up again and registers with it.
        capacity: bytes of DRAM to lend (one registered segment).
        name: unique node name; default a random one.
        engine: an engine to register the memory with (not closed by the node); default
            one of its own, on ``host``.
        disk_path: a spill file lent as a second, slower tier (created or truncated to
            ``disk_capacity`` bytes, memory-mapped and registered): objects evicted from
            DRAM are demoted to it instead of dropped, and read from it until promoted.
        disk_capacity: bytes of the disk pool (its bound: the file never grows).
        pod: placement label; the master puts replicas of one object in distinct pods
            and zones when it can.
        zone: placement label, as ``pod``.
        auth: control-message signing, as for the engine and the master.
        prefault: touch every DRAM page now, so the first writes run at memory speed.
        timeout: seconds to wait for the master's answer to a registration.
    """

    def __init__(self, master: str, capacity: int, *, name: str | None = None,
                 engine: Engine | None = None, host: str = "127.0.0.1",
                 disk_path: str | None = None, disk_capacity: int = 0, pod: str = "",
                 zone: str = "", auth: AuthConfig | str | bytes | None = None,
                 prefault: bool = True, timeout: float = 5.0) -> None:
        self._closed = True
        if capacity <= 0:
            raise InvalidArgumentError(f"capacity must be > 0 bytes, not {capacity}")
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        self.name = name or f"kvnode-{uuid.uuid4().hex[:8]}"
        self.master = master
        self.incarnation = uuid.uuid4().hex[:16]
        self.timeout = timeout
        self._signer = auth.signer()
        self._stack = ExitStack()
        try:
            if engine is None:
                engine = self._stack.enter_context(
                    Engine(self.name, host=host, role="store", pod=pod, zone=zone, auth=auth))
            self.engine = engine
            self.pod, self.zone = pod, zone
            dram = np.empty(capacity, dtype=np.uint8)
            if prefault:
                dram.fill(0)
            self.dram = dram
            self._pools: list[list[Any]] = []
            self._memory: list[Any] = [dram]  # per pool, for tier copies
            seg = self._stack.enter_context(engine.register(dram, name=f"{self.name}/dram"))
            self._pools.append([seg.name, capacity, "dram"])
            if disk_path is not None:
                if disk_capacity <= 0:
                    raise InvalidArgumentError("a disk pool needs disk_capacity > 0")
                fd = os.open(disk_path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(fd, disk_capacity)
                    disk = mmap.mmap(fd, disk_capacity)
                finally:
                    os.close(fd)
                self._stack.callback(disk.close)
                view = np.frombuffer(disk, dtype=np.uint8)
                self._stack.callback(lambda: self._memory.clear())  # the view before the map
                self._memory.append(view)
                del view
                seg = self._stack.enter_context(engine.register(disk, name=f"{self.name}/disk"))
                self._pools.append([seg.name, disk_capacity, "disk"])
            self.directory: dict[tuple[int, int], Entry] = {}
            self._copies: dict[tuple[int, int, int], set[tuple[int, int]]] = {}
            self.copies = 0  # tier copies made
            self.copy_failures = 0
            self.fenced = 0  # writers cut off because their puts expired
            self.epoch = ""  # of the master we serve
            self.applied = 0  # last journal seq applied
            self.interval = 0.5
            self._lock = threading.Lock()
            self._registered = threading.Event()
            self._heard = time.monotonic()  # when the master last spoke to us
            self._looked = 0.0  # when the leading master was last looked up
            self._link = SignedClient(None, locate_master(master, timeout), self._signer,
                                      peer="kvstore-master",
                                      name="storage node's master link", ipv6=False)
            self._stack.callback(self._link.close)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"te-kv-node-{self.name}")
        except BaseException:
            self._stack.close()
            raise
        self._closed = False
        self._thread.start()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else ("REGISTERED" if self._registered.is_set()
                                               else "JOINING")
        return f"<StorageNode {self.name!r} objects={len(self.directory)} {state}>"

    @property
    def endpoint(self) -> str:
        return self.engine.endpoint

    @property
    def master_endpoint(self) -> str:
        """Where the master this node serves (or is looking for) is reached now."""
        return self._link.address

    @property
    def registered(self) -> bool:
        """Whether that master has welcomed this node."""
        return self._registered.is_set()

    def close(self) -> None:
        """Stops heartbeating (the master drops the node after its silence) and releases
        the memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(10)
        self._stack.close()

    def wait_registered(self, timeout: float = 10.0) -> bool:
        return self._registered.wait(timeout)

    # -- the master link ---------------------------------------------------------------

    def _recv(self, timeout: float) -> Message | None:
        """The next message from the master (an answer, or a journal push), or None
        after ``timeout`` seconds or when it is not one we accept."""
        if not self._link.poll(timeout):
            return None
        self._heard = time.monotonic()
        try:
            return self._link.read()
        except TransferEngineError as exc:
            log.warning("node %s: bad message from the master: %s", self.name, exc)
            return None

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                self._follow()
                if not self._registered.is_set():
                    if not self._register():
                        self._link.reset()
                        self._stop.wait(min(self.interval, 0.2))
                        continue
                    next_beat = time.monotonic() + self.interval
                msg = self._recv(max(0.0, next_beat - time.monotonic()))
                if isinstance(msg, KvJournal):
                    self._journal(msg)
                elif isinstance(msg, KvBeatAck) and not msg.known:
                    log.info("node %s: the master does not know us: registering", self.name)
                    self._registered.clear()
                if time.monotonic() >= next_beat:
                    self._beat()
                    next_beat = time.monotonic() + self.interval
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.warning("node %s: %s", self.name, exc)
                self._link.reset()
            except Exception:
                log.exception("node %s loop", self.name)
                self._stop.wait(0.1)

    def _follow(self) -> None:
        """With the master named through etcd: once it has been silent for three
        heartbeats (at most once a second), looks up who leads, and moves to a new
        leader (registering with it, as with a restarted master)."""
        if not self.master.startswith(ETCD_SCHEME):
            return
        now = time.monotonic()
        if now - self._heard < 3 * self.interval or now - self._looked < 1.0:
            return
        self._looked = now
        try:
            address = moved_master(self.master, self._link.address, min(self.timeout, 2.0))
        except StoreError as exc:
            log.info("node %s: %s", self.name, exc)
            return
        if address is not None:
            log.info("node %s: the master moved from %s to %s", self.name,
                     self._link.address, address)
            self._link.retarget(address)
            self._registered.clear()
            self._heard = now

    def _beat(self) -> None:
        self._link.send(KvBeat(name=self.name, incarnation=self.incarnation,
                               epoch=self.epoch, acked=self.applied))

    def _register(self) -> bool:
        """Sends our pools and directory; True once the master welcomed the last part."""
        with self._lock:
            rows = list(self.directory.values())
        entries = np.zeros(len(rows), dtype=ENTRY)
        if rows:
            cols = list(zip(*rows, strict=True))
            entries["key"][:, 0] = np.array(cols[0], dtype=np.uint64)
            entries["key"][:, 1] = np.array(cols[1], dtype=np.uint64)
            for name, col in zip(("pool", "offset", "length"), cols[2:5], strict=True):
                entries[name] = np.array(col, dtype=np.int64)
            entries["checksum"] = np.array(cols[5], dtype=np.uint64)
            entries["version"] = np.array(cols[6], dtype=np.uint64)
            entries["expires"] = np.array(cols[7], dtype=np.float64)
        parts = max(1, -(-entries.size // _PART))
        welcome: KvNodeWelcome | None = None
        for part in range(parts):
            chunk = entries[part * _PART:(part + 1) * _PART]
            self._link.send(KvNode(name=self.name, incarnation=self.incarnation,
                                   epoch=self.epoch, control=self.engine.endpoint,
                                   pod=self.pod, zone=self.zone, pools=self._pools,
                                   part=part, last=part == parts - 1,
                                   entries=chunk.tobytes()))
            deadline = time.monotonic() + self.timeout
            while True:
                msg = self._recv(deadline - time.monotonic())
                if msg is None:
                    return False
                if isinstance(msg, KvNodeWelcome):
                    welcome = msg
                    break
        assert welcome is not None
        self.epoch = welcome.epoch
        self.interval = welcome.interval
        self.applied = 0
        self._registered.set()
        log.info("node %s: registered with master %s (%d objects)", self.name, self.epoch,
                 entries.size)
        return True

    def _journal(self, msg: KvJournal) -> None:
        if msg.epoch != self.epoch:
            return
        if msg.seq == self.applied + 1:
            if msg.fence and not self._fence(msg.fence):
                return  # neither applied nor acknowledged: the master sends it again
            ops = column(msg.ops, JOURNAL, None, "ops")
            with self._lock:
                for op, ((k0, k1), pool, off, length, ck, ver, exp) in ops.tolist():
                    if op == Op.COMMIT:
                        self._add((k0, k1, pool, off, length, ck, ver, exp))
                    elif op == Op.FREE:
                        self._drop(pool, off)
                    elif op == Op.COPY:
                        self._copy((k0, k1, pool, off, length, ck, ver, exp))
                    elif op == Op.RETIRE:
                        self._retire(pool, off)
            self.applied = msg.seq
        if msg.seq <= self.applied:
            self._beat()  # acknowledge at once: the master reuses freed space only then


    def _fence(self, writers: list[Any]) -> bool:
        """Cuts ``writers`` (engines whose puts expired) off our engine before the
        space they were given is freed; False if that did not hold within a heartbeat
        interval (the master sends the push again, and we try again)."""
        end = time.monotonic() + self.interval
        if (not isinstance(writers, list) or len(writers) > MAX_FENCE
                or not all(valid_name(w) for w in writers)):
            log.warning("node %s: journal push with a malformed fence ignored", self.name)
            return False
        for writer in writers:
            if writer == self.engine.name:
                continue  # a late put of our own process writes nothing through a rail
            try:
                cut = self.engine.cut_peer(writer, max(0.0, end - time.monotonic()))
            except ClosedError:
                return False
            if not cut:
                log.warning("node %s: a late write of %s is still landing; its expired "
                            "put's space stays held", self.name, writer)
                return False
        self.fenced += len(writers)
        return True

    def _add(self, entry: Entry) -> None:
        old = self.directory.get((entry[2], entry[3]))
        if old is not None:
            self._drop(old[2], old[3])
        self.directory[(entry[2], entry[3])] = entry
        self._copies.setdefault((entry[0], entry[1], entry[6]), set()).add(
            (entry[2], entry[3]))

    def _drop(self, pool: int, off: int) -> None:
        entry = self.directory.pop((pool, off), None)
        if entry is not None:
            ident = (entry[0], entry[1], entry[6])
            where = self._copies.get(ident)
            if where is not None:
                where.discard((pool, off))
                if not where:
                    del self._copies[ident]

    def _retire(self, pool: int, off: int) -> None:
        """The object at (pool, off) is no longer stored; its space stays held (a
        reader's lease) until the FREE that follows: kept at version 0, never a copy
        source, never published again by a restarted master."""
        entry = self.directory.get((pool, off))
        if entry is not None and entry[6] != RETIRED_VERSION:
            self._drop(pool, off)
            self.directory[(pool, off)] = (*entry[:6], RETIRED_VERSION, entry[7])

    def _copy(self, entry: Entry) -> None:
        """Copies the object (key, version) of ``entry`` from the pool holding it into
        ``entry``'s range (a tier move); journal order guarantees the source is here."""
        k0, k1, pool, off, length, _, ver, _ = entry
        src = next((w for w in self._copies.get((k0, k1, ver), ()) if w[0] != pool), None)
        if src is None or not (0 <= pool < len(self._memory)):
            self.copy_failures += 1
            log.error("node %s: tier copy of key %#x v%d has no source here", self.name,
                      k0 | k1 << 64, ver)
            return
        mem = self._memory
        mem[pool][off:off + length] = mem[src[0]][src[1]:src[1] + length]
        self.copies += 1
        self._add(entry)

    def object_pool(self, key: int) -> list[str]:
        """Tiers (``"dram"``/``"disk"``) holding copies of ``key`` here (for tests and
        operators; the master decides which one readers use)."""
        k0, k1 = key & ((1 << 64) - 1), key >> 64
        with self._lock:
            return sorted(self._pools[p][2] for (p, _), e in self.directory.items()
                          if (e[0], e[1]) == (k0, k1))


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("b").rstrip("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvstore.node``: serves until SIGINT or SIGTERM."""
    ap = argparse.ArgumentParser(prog="kvstore-node", description=__doc__.split("\n")[0])
    ap.add_argument("--master", required=True,
                    help="tcp://HOST:PORT, or etcd://H:P[,H:P...][/prefix] to follow the leader")
    ap.add_argument("--capacity", default="256M", help="DRAM to lend, e.g. 1G")
    ap.add_argument("--name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--disk", default=None, help="a file to lend as a disk pool")
    ap.add_argument("--disk-capacity", default="0")
    ap.add_argument("--pod", default="")
    ap.add_argument("--zone", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with StorageNode(args.master, _size(args.capacity), name=args.name, host=args.host,
                     disk_path=args.disk, disk_capacity=_size(args.disk_capacity),
                     pod=args.pod, zone=args.zone) as node:
        node.wait_registered(30)
        print(f"kvstore-node {node.name} serving {node.endpoint}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()

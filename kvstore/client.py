"""The store's client: asks the master where, then moves the bytes itself.

A batch costs one round trip to the master to place or locate every key, then one
engine WRITE or READ per storage node (all nodes at once, each a :class:`Blocks` of the
batch's values on that node), then, for a put, one round trip to commit. Leases taken by
gets are released on the next request, with no round trip of their own. A ``get_into``
hides the locate: it starts reading where each key was last seen (by this client's puts
and gets) while the master answers, and keeps a key's bytes only where the master
reports the same version in the same place; the other keys are read after.

Keys are 128-bit on the wire. An ``int`` key (e.g. a chained block hash from
:func:`kvstore.block_hashes`) is used as it is; ``bytes`` of 8 or 16 bytes are read as a
little-endian integer; a ``str`` (or other ``bytes``) is hashed (BLAKE2b-128), so
Mooncake-style string keys work too. Batches may also be ``uint64`` arrays of shape
``(n,)`` or ``(n, 2)`` (low word first).

Guarantees: a get returns the bytes of a committed put, never a half-written,
uncommitted or reused range (the master's lease keeps the space; a read that completes
after its lease ran out is repeated). When a node dies during a get, the keys it held
are read from another replica, or the get raises :class:`ObjectUnavailableError`
naming the key. With ``verify=True`` a value whose CRC32 does not match is read from
another replica, or fails the same way. A ``get_into`` buffer whose key comes back
missing may have been written (with bytes of an older value); its content is not defined.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import logging
import threading
import time
import uuid
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from kvstore.errors import (
    InvalidArgumentError,
    KeyFormatError,
    MasterUnavailableError,
    ObjectUnavailableError,
    PutError,
    StoreError,
)
from kvstore.index import has_duplicates
from kvstore.protocol import (
    MAX_BATCH,
    KvCommit,
    KvCommitted,
    KvFound,
    KvGet,
    KvLocated,
    KvPlaced,
    KvPut,
    KvQuery,
    KvRemove,
    KvStats,
    KvStatsReply,
    Status,
    column,
    pack,
)
from kvstore.tiers import LocalTier
from transfer_engine import Blocks, Engine
from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig, Signer, open_reply, seal
from transfer_engine.control.messages import ErrorReply, Message
from transfer_engine.errors import TransferEngineError
from transfer_engine.handle import TransferHandle
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["Client", "Lookup", "key_rows", "crc"]

log = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
_M64 = (1 << 64) - 1
_HAS_CRC = 1 << 32  # a recorded checksum: CRC32 with this bit set (0: none recorded)
_GUESSES = 1 << 16  # remembered key locations (about 200 bytes each)
_PUT_ATTEMPTS = 3  # rewrites of keys whose nodes all failed or left during the write


def crc(data: Any) -> int:
    """The checksum the store records for ``data`` (bytes-like)."""
    return zlib.crc32(data) | _HAS_CRC


def _key_int(key: object) -> int:
    if isinstance(key, bool):
        raise KeyFormatError("a key cannot be a bool")
    if isinstance(key, int | np.integer):
        k = int(key)
        if not 0 <= k < 1 << 128:
            raise KeyFormatError(f"key {k} does not fit in 128 unsigned bits")
        return k
    if isinstance(key, str):
        key = key.encode()
    if isinstance(key, bytes | bytearray | memoryview):
        raw = bytes(key)
        if len(raw) in (8, 16):
            return int.from_bytes(raw, "little")
        return int.from_bytes(hashlib.blake2b(b"k" + raw, digest_size=16).digest(), "little")
    raise KeyFormatError(f"a key must be int, bytes or str, not {type(key).__name__}")


def key_rows(keys: object) -> U64:
    """``keys`` (a sequence of keys, or a ``uint64`` array) as ``uint64[n, 2]``."""
    if isinstance(keys, np.ndarray):
        if keys.dtype != np.uint64 or keys.ndim not in (1, 2) or (
                keys.ndim == 2 and keys.shape[1] != 2):
            raise KeyFormatError("a key array must be uint64 of shape (n,) or (n, 2)")
        if keys.ndim == 1:
            out = np.zeros((keys.shape[0], 2), dtype=np.uint64)
            out[:, 0] = keys
            return out
        return np.ascontiguousarray(keys)
    if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Iterable):
        raise KeyFormatError("keys must be a sequence of keys or a uint64 array")
    ints = [_key_int(k) for k in keys]
    out = np.zeros((len(ints), 2), dtype=np.uint64)
    if ints:
        out[:, 0] = [k & _M64 for k in ints]
        out[:, 1] = [k >> 64 for k in ints]
    return out


def _memory(address: int, length: int) -> memoryview:
    """A view of ``length`` bytes at ``address`` (registered memory we were given)."""
    return memoryview((ctypes.c_uint8 * length).from_address(address)).cast("B")


def _address(obj: Any, writable: bool) -> tuple[int, int]:
    """``(address, length)`` of a contiguous buffer, without copying."""
    try:
        arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
    except (TypeError, ValueError, BufferError) as exc:
        raise InvalidArgumentError(f"not a contiguous buffer: {type(obj).__name__}") from exc
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError("buffers must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError("a get_into buffer must be writable")
    return int(arr.ctypes.data), int(arr.nbytes)


class _MasterLink:
    """One DEALER socket to the master. Requests are answered in the order sent: one
    waited for at a time, after those :meth:`post`-ed before it, whose answers go to
    their callbacks first."""

    def __init__(self, address: str, signer: Signer | None) -> None:
        self.address = address
        self._signer = signer
        self._zctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._open()
        self._posted: deque[tuple[Message, Callable[[Message | Exception], None]]] = deque()

    def _open(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
        sock.connect(self.address)
        return sock

    def request(self, msg: Message, timeout: float,
                between: Callable[[], None] | None = None) -> Message:
        """Sends ``msg`` and returns its answer; ``between`` runs while the master works
        on it (its exception is raised once the answer is read, which would otherwise
        pair with the next request)."""
        self._send(msg)
        error: BaseException | None = None
        if between is not None:
            try:
                between()
            except BaseException as exc:
                error = exc
        reply = self._answer(msg, timeout)
        if error is not None:
            raise error
        return reply

    def _send(self, msg: Message) -> None:
        self._sock.send(seal(msg, self._signer))

    def post(self, msg: Message, on_reply: Callable[[Message | Exception], None]) -> None:
        """Sends a request without waiting: ``on_reply`` gets its answer (or the error
        that stood for it) when a later request is answered, or at :meth:`drain`."""
        self._send(msg)
        self._posted.append((msg, on_reply))

    def drain(self, timeout: float) -> None:
        """Takes the answers of every posted request."""
        while self._posted:
            msg, on_reply = self._posted.popleft()
            try:
                reply: Message | Exception = self._receive(msg, timeout)
            except MasterUnavailableError as exc:
                on_reply(exc)
                raise  # the socket was reset: nothing sent before comes back
            except StoreError as exc:
                reply = exc
            on_reply(reply)

    def _answer(self, msg: Message, timeout: float) -> Message:
        self.drain(timeout)
        return self._receive(msg, timeout)

    def _receive(self, msg: Message, timeout: float) -> Message:
        if not self._sock.poll(int(timeout * 1000), zmq.POLLIN):
            self._sock.close(linger=0)  # a late answer would pair with the next request
            self._sock = self._open()
            lost = list(self._posted)
            self._posted.clear()
            error = MasterUnavailableError(f"no answer from the master at {self.address} "
                                           f"in {timeout}s to {msg.kind}")
            for _, on_reply in lost:
                on_reply(error)
            raise error
        reply = open_reply(self._sock.recv(), self._signer, peer="kvstore-master",
                           op=msg.kind)
        if isinstance(reply, ErrorReply):
            raise StoreError(f"the master refused {msg.kind}: {reply.message}")
        return reply

    def close(self) -> None:
        self._sock.close(linger=0)
        self._zctx.term()


@dataclass
class _Where:
    """Replicas of a batch as the master answered them."""

    status: npt.NDArray[np.int8]
    nodes: list[Any]
    pools: npt.NDArray[np.int32]  # [n, R], index into nodes, -1 none
    offsets: I64  # [n, R]


def _where(msg: KvPlaced | KvLocated, n: int) -> _Where:
    r = msg.replicas
    return _Where(column(msg.status, "<i1", n, "status"), msg.nodes,
                  column(msg.pools, "<i4", n * r, "pools").reshape(n, r),
                  column(msg.offsets, "<i8", n * r, "offsets").reshape(n, r))


def _node_rows(where: _Where) -> list[tuple[str, ...]]:
    """The node rows of an answer, comparable with each other and usable as keys."""
    return [tuple(str(v) for v in row) for row in where.nodes]


@dataclass
class _Settle:
    """What a put's commit answer is applied to: the keys it placed (``rows``), which
    of them were written (``ok``, indices), their versions, places and lengths."""

    rows: U64
    ok: npt.NDArray[np.int64]
    versions: U64
    where: _Where
    lengths: I64


@dataclass
class _Guess:
    """Reads :meth:`Client._speculate` started: ``jobs`` as for ``_move``, keyed by
    index into ``nodes`` (node rows); ``picked[i]``: the location guessed for key i."""

    picked: dict[int, tuple[int, tuple[str, ...], int, int]]
    jobs: dict[int, list[tuple[int, int, int, int]]]
    nodes: list[tuple[str, ...]]
    handles: list[tuple[int, TransferHandle]]
    failed: dict[int, BaseException]


class Client(Closeable):
    """A client of the cluster store.

    Parameters:
        master: the master's endpoint, e.g. ``tcp://127.0.0.1:7400``.
        engine: the engine that moves the bytes (not closed by the client); default one
            of its own on ``host``.
        replicas: copies of each put value, on distinct nodes (fewer when fewer nodes
            are up).
        staging_bytes: registered memory for ``put``/``get`` of plain bytes (grows to
            the largest batch); ``put_from``/``get_into`` use your registered buffers.
        checksum: record a CRC32 of each value on put (what ``verify`` checks); costs a
            pass over the bytes (about 3.6 GB/s here).
        timeout: seconds for a master request and for a batch's transfers.
        auth: control-message signing, as for engines and the master.
        local_cache_bytes: memory for a local DRAM tier in front of the cluster (0:
            none): gets are served from it when the master's version matches, values
            read or written are kept in it; see :mod:`kvstore.tiers` for the rule that
            keeps it from serving stale values.
        local_max_value_bytes: the largest value the local tier keeps.
    """

    def __init__(self, master: str, *, engine: Engine | None = None, name: str | None = None,
                 host: str = "127.0.0.1", replicas: int = 1, staging_bytes: int = 16 << 20,
                 checksum: bool = False, timeout: float = 10.0,
                 auth: AuthConfig | str | bytes | None = None, local_cache_bytes: int = 0,
                 local_max_value_bytes: int = 4 << 20) -> None:
        self._closed = True
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        if not 1 <= replicas <= 4:
            raise InvalidArgumentError(f"replicas must be 1..4, not {replicas}")
        self.replicas = replicas
        self.checksum = checksum
        self.timeout = timeout
        self._stack = ExitStack()
        try:
            if engine is None:
                engine = self._stack.enter_context(
                    Engine(name or f"kvclient-{uuid.uuid4().hex[:8]}", host=host, auth=auth))
            self.engine = engine
            self._link = _MasterLink(master, auth.signer())
            self._stack.callback(self._link.close)
            self._tier: LocalTier | None = None
            if local_cache_bytes:
                self._tier = self._stack.enter_context(
                    LocalTier(local_cache_bytes, max_value_bytes=local_max_value_bytes))
        except BaseException:
            self._stack.close()
            raise
        self._lock = threading.RLock()
        self._release: list[int] = []
        self._peers: dict[str, tuple[str, Peer]] = {}  # node -> (incarnation, peer)
        self._bad: dict[str, float] = {}  # node -> monotonic time until we skip it
        self._buffers: list[tuple[int, int, Segment]] = []  # sorted (start, end, seg)
        self._staging: np.ndarray | None = None
        self._staging_seg: Segment | None = None
        self._staging_min = staging_bytes
        # key -> (version, node row, offset, length) of a replica seen lately: a get_into
        # starts reading there while the master confirms it (see _speculate)
        self._guesses: OrderedDict[tuple[int, int], tuple[int, tuple[str, ...], int, int]] = \
            OrderedDict()
        self._guessing = False  # from the first get_into on: only it can use them
        self._late_failed: list[int] = []  # keys of puts that did not wait, not stored
        self._late_reasons: list[str] = []
        self.remote_hits = 0
        self.guessed_reads = 0
        self._closed = False

    def __repr__(self) -> str:
        return (f"<Client master={self._link.address} peers={len(self._peers)} "
                f"{'CLOSED' if self._closed else 'OPEN'}>")

    def close(self) -> None:
        """Releases leases still held (best effort) and everything the client owns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:  # commits of puts that did not wait: sent already, their answers read
                self._link.drain(min(self.timeout, 5.0))
            except TransferEngineError:
                pass
            if self._late_failed:
                log.warning("kvstore client: %d values of puts that did not wait were not "
                            "stored (%s)", len(self._late_failed), "; ".join(self._late_reasons))
            if self._release:
                try:
                    self._link.request(KvStats(release=self._take_release()), 1.0)
                except TransferEngineError:
                    pass  # they expire on their own
            if self._staging_seg is not None:
                self._staging_seg.close()
            self._stack.close()

    # -- plumbing ----------------------------------------------------------------------

    def _take_release(self) -> bytes:
        out = pack(self._release, "<u8")
        self._release = []
        return out

    def _request(self, msg: Message, between: Callable[[], None] | None = None) -> Message:
        if self._closed:
            raise StoreError("the client is closed")
        return self._link.request(msg, self.timeout, between)

    def _peer(self, row: list[Any]) -> tuple[Peer, RemoteSegment]:
        name, incarnation, control, segment = (str(v) for v in row)
        cached = self._peers.get(name)
        if cached is not None and cached[0] == incarnation and cached[1].lost is None:
            peer = cached[1]
        else:
            peer = self.engine.connect(control, timeout=min(self.timeout, 3.0))
            self._peers[name] = (incarnation, peer)
        return peer, peer.segment(segment)

    def _node_failed(self, name: str, exc: BaseException) -> None:
        log.info("kvstore client: node %s failed: %s", name, exc)
        self._bad[name] = time.monotonic() + 2.0
        self._peers.pop(name, None)
        try:
            self.engine.peer_lost(name, f"kvstore: {exc}")
        except TransferEngineError:
            pass

    def _usable(self, name: str) -> bool:
        until = self._bad.get(name)
        return until is None or until < time.monotonic()

    def register_buffer(self, obj: Any) -> Segment:
        """Registers memory for zero-copy ``put_from``/``get_into`` (a numpy array, a
        writable buffer or ``(address, length)``); closing the returned segment
        deregisters it. A :class:`Segment` the client's engine already registered is
        used as it is (memory registered once for other transfers, e.g. a KV cache)."""
        with self._lock:
            if isinstance(obj, Segment):
                if self.engine.segments.get(obj.name) is not obj or obj.closed:
                    raise InvalidArgumentError(f"segment {obj.name!r} is not an open "
                                               "segment of this client's engine")
                seg = obj
            else:
                seg = self.engine.register(obj)
            start = int(seg.address)
            self._buffers = [b for b in self._buffers if not b[2].closed]
            bisect.insort(self._buffers, (start, start + int(seg.length), seg),
                          key=lambda b: b[0])
            return seg

    def _local(self, addrs: I64, lens: I64) -> list[tuple[Segment, int]]:
        """For each address: the registered segment holding ``[addr, addr+len)``."""
        starts = [b[0] for b in self._buffers]
        out: list[tuple[Segment, int]] = []
        for a, n in zip(addrs.tolist(), lens.tolist(), strict=True):
            i = bisect.bisect_right(starts, a) - 1
            if i < 0 or a + n > self._buffers[i][1] or self._buffers[i][2].closed:
                raise InvalidArgumentError(f"[{a:#x}, +{n}) is not inside a registered buffer "
                                           "(register_buffer)")
            seg = self._buffers[i][2]
            out.append((seg, a - int(seg.address)))
        return out

    def _stage(self, nbytes: int) -> tuple[np.ndarray, int]:
        """The staging buffer (at least ``nbytes``) and its address."""
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging_seg is not None:
                self._staging_seg.close()
                self._buffers = [b for b in self._buffers if not b[2].closed]
            size = max(self._staging_min, 1 << max(0, nbytes - 1).bit_length())
            self._staging = np.empty(size, dtype=np.uint8)
            self._staging.fill(0)  # fault the pages in once, not on every first use
            self._staging_seg = self.register_buffer(self._staging)
        return self._staging, int(self._staging.ctypes.data)

    def _move(self, write: bool, jobs: dict[int, list[tuple[int, int, int, int]]],
              nodes: list[Any], deadline: float) -> dict[int, BaseException]:
        """Runs one engine WRITE/READ per node: ``jobs[node]`` rows are ``(local addr,
        remote offset, length, tag)``. Returns the nodes that failed, with why."""
        handles, failed = self._post_moves(write, jobs, nodes)
        failed.update(self._wait_moves(handles, nodes, deadline))
        return failed

    def _post_moves(self, write: bool, jobs: dict[int, list[tuple[int, int, int, int]]],
                    nodes: list[Any], blame: bool = True
                    ) -> tuple[list[tuple[int, TransferHandle]], dict[int, BaseException]]:
        """Starts :meth:`_move`'s transfers (copies to a node on our own engine happen
        now); returns their handles and the nodes that failed already. ``blame``: a
        failed node is skipped for a while (else only its connection is dropped)."""
        failed: dict[int, BaseException] = {}
        handles: list[tuple[int, TransferHandle]] = []
        for node, items in jobs.items():
            items = [it for it in items if it[2] > 0]
            if not items:
                continue
            name = str(nodes[node][0])
            if name == self.engine.name:  # a node on our own engine: copy in place
                try:
                    self._copy_local(write, str(nodes[node][3]), items)
                except TransferEngineError as exc:
                    failed[node] = exc
                continue
            try:
                peer, remote = self._peer(nodes[node])
                arr = np.array([it[:3] for it in items], dtype=np.int64)
                locs = self._local(arr[:, 0], arr[:, 2])
                by_seg: dict[int, list[int]] = {}
                for k, (seg, _) in enumerate(locs):
                    by_seg.setdefault(seg.id, []).append(k)
                blocks = []
                for ks in by_seg.values():
                    seg = locs[ks[0]][0]
                    idx = np.array(ks)
                    blocks.append(Blocks(seg, remote, np.array([locs[k][1] for k in ks]),
                                         arr[idx, 1], arr[idx, 2]))
                op = self.engine.write if write else self.engine.read
                handles.append((node, op(peer, blocks)))
            except InvalidArgumentError:
                for _, handle in handles:  # nothing started may outlive the error
                    handle.cancel()
                raise
            except TransferEngineError as exc:
                failed[node] = exc
                self._failed(name, exc, blame)
        return handles, failed

    def _wait_moves(self, handles: list[tuple[int, TransferHandle]], nodes: list[Any],
                    deadline: float, blame: bool = True) -> dict[int, BaseException]:
        failed: dict[int, BaseException] = {}
        for node, handle in handles:
            try:
                handle.wait(max(0.001, deadline - time.monotonic()))
            except TransferEngineError as exc:
                handle.cancel()  # a late transfer must not touch buffers given back
                failed[node] = exc
                self._failed(str(nodes[node][0]), exc, blame)
        return failed

    def _failed(self, name: str, exc: BaseException, blame: bool) -> None:
        if blame:
            self._node_failed(name, exc)
        else:  # a guess gone wrong (e.g. the node restarted): reconnect when asked
            self._peers.pop(name, None)

    # -- reads started before the master answers -----------------------------------------

    def _remember(self, rows: U64, idx: npt.NDArray[np.int64], versions: U64,
                  where: _Where, lengths: I64) -> None:
        """Notes where keys ``idx`` live (their first replica), for :meth:`_speculate`."""
        if idx.size == 0 or not self._guessing:
            return
        guesses = self._guesses
        node_rows = _node_rows(where)
        for (k0, k1), version, p, off, length in zip(
                rows[idx].tolist(), versions[idx].tolist(), where.pools[idx, 0].tolist(),
                where.offsets[idx, 0].tolist(), lengths[idx].tolist(), strict=True):
            if p >= 0:
                guesses[(k0, k1)] = (version, node_rows[p], off, length)
        while len(guesses) > _GUESSES:  # the oldest noted go first
            guesses.popitem(last=False)

    def _speculate(self, rows: U64, dest: I64, caps: I64) -> _Guess | None:
        """Starts reading the keys whose place we remember into ``dest``, before the
        master confirms it. Sound because an object stays where it was put until it is
        retired, and never comes back once retired: if the master then reports the same
        version at the same place (and leases it), the bytes read were that version's
        throughout. Keys it reports otherwise are read again (their buffers may hold
        stale bytes meanwhile; a missing key's buffer is not defined)."""
        guesses = self._guesses
        nodes: list[tuple[str, ...]] = []
        index: dict[tuple[str, ...], int] = {}
        jobs: dict[int, list[tuple[int, int, int, int]]] = {}
        picked: dict[int, tuple[int, tuple[str, ...], int, int]] = {}
        for i, (key, addr, cap) in enumerate(zip(map(tuple, rows.tolist()), dest.tolist(),
                                                  caps.tolist(), strict=True)):
            g = guesses.get(key)
            if g is None or not 0 < g[3] <= cap:
                continue
            row = g[1]
            j = index.get(row)
            if j is None:
                cached = self._peers.get(row[0])
                if (cached is None or cached[0] != row[1] or cached[1].lost is not None
                        or not self._usable(row[0])):
                    continue  # only nodes we hold a live connection to, same incarnation
                j = index[row] = len(nodes)
                nodes.append(row)
            jobs.setdefault(j, []).append((addr, g[2], g[3], i))
            picked[i] = g
        if not picked:
            return None
        try:
            handles, failed = self._post_moves(False, jobs, nodes, blame=False)
        except InvalidArgumentError:
            return None  # not registered memory: the plain path says so precisely
        return _Guess(picked, jobs, nodes, handles, failed)

    def _confirm(self, guess: _Guess, found: npt.NDArray[np.bool_], versions: U64,
                 where: _Where, lengths: I64) -> npt.NDArray[np.bool_]:
        """Waits for :meth:`_speculate`'s reads; True for keys the master placed where
        they were read (same version, length, node incarnation, segment and offset)."""
        failed = guess.failed
        failed.update(self._wait_moves(guess.handles, guess.nodes,
                                       time.monotonic() + self.timeout, blame=False))
        guess.handles = []
        ok = np.zeros(found.shape[0], dtype=bool)
        node_rows = _node_rows(where)
        for node, items in guess.jobs.items():
            if node in failed:
                continue
            for _, off, length, i in items:
                version, row, _, _ = guess.picked[i]
                if not found[i] or int(versions[i]) != version or int(lengths[i]) != length:
                    continue
                for r in range(where.pools.shape[1]):
                    p = int(where.pools[i, r])
                    if p < 0:
                        break
                    if int(where.offsets[i, r]) == off and node_rows[p] == row:
                        ok[i] = True
                        break
        self.guessed_reads += int(ok.sum())
        return ok

    def _abandon(self, guess: _Guess) -> None:
        """Stops :meth:`_speculate`'s reads still running (the get failed before it
        could confirm them): nothing lands in the caller's buffers after it returns."""
        for _, handle in guess.handles:
            handle.cancel()  # no-op on one that finished
        for _, handle in guess.handles:
            try:
                handle.wait(self.timeout)
            except TransferEngineError:
                pass
        guess.handles = []

    def _copy_local(self, write: bool, segment: str,
                    items: list[tuple[int, int, int, int]]) -> None:
        seg = self.engine.segments.get(segment)
        if seg is None or seg.closed:
            raise ObjectUnavailableError(f"local segment {segment!r} is gone")
        base = int(seg.address)
        self._local(np.array([it[0] for it in items], dtype=np.int64),
                    np.array([it[2] for it in items], dtype=np.int64))
        for addr, off, length, _ in items:
            if off < 0 or off + length > int(seg.length):
                raise ObjectUnavailableError(f"[{off}, +{length}) is outside {segment!r}")
            if write:
                ctypes.memmove(base + off, addr, length)
            else:
                ctypes.memmove(addr, base + off, length)

    # -- put ---------------------------------------------------------------------------

    def _settled(self, settle: _Settle, done: Message) -> tuple[np.ndarray, np.ndarray]:
        """Takes a commit's answer: notes where the stored keys are; returns (indices
        into the put's keys) those whose every replica was lost, and those refused."""
        assert isinstance(done, KvCommitted)
        ok = settle.ok
        st = column(done.status, "<i1", settle.rows.shape[0], "status")
        self._remember(settle.rows, ok[st[ok] == Status.OK], settle.versions, settle.where,
                       settle.lengths)
        return (ok[st[ok] == Status.FAILED],
                ok[(st[ok] != Status.OK) & (st[ok] != Status.FAILED)])

    def _settled_late(self, settle: _Settle, done: Message | Exception) -> None:
        """A commit posted by a put that did not wait: keys not stored are kept for
        :meth:`flush` to report."""
        if isinstance(done, Exception):
            bad, why = settle.ok, str(done)
        else:
            lost, refused = self._settled(settle, done)
            bad, why = np.concatenate((lost, refused)), "commit refused or replicas lost"
        if bad.size:
            rows = settle.rows[bad]
            self._late_failed += [int(a) | int(b) << 64 for a, b in rows.tolist()]
            self._late_reasons.append(f"{bad.size} keys: {why}")

    def flush(self) -> None:
        """Waits for the commits of puts made with ``wait=False``; raises
        :class:`PutError` naming their keys that were not stored (once)."""
        with self._lock:
            if self._closed:
                raise StoreError("the client is closed")
            try:
                self._link.drain(self.timeout)
            finally:
                failed, reasons = self._late_failed, self._late_reasons
                self._late_failed, self._late_reasons = [], []
            if failed:
                raise PutError(f"{len(failed)} values of earlier puts not stored "
                               f"({'; '.join(reasons)})", list[object](failed))

    def _put(self, rows: U64, addrs: I64, lens: I64, *, ttl: float | None,
             if_absent: bool, replicas: int | None, checks: U64 | None,
             wait: bool = True) -> None:
        """Stores each value ``[addrs[i], +lens[i])`` (registered memory) under key
        ``rows[i]``; raises :class:`PutError` naming the keys that were not stored.
        ``wait`` False: returns once the bytes are written and the commit is sent (see
        :meth:`batch_put`)."""
        n = rows.shape[0]
        if n == 0:
            return
        if n > MAX_BATCH:
            for s in range(0, n, MAX_BATCH):
                e = s + MAX_BATCH
                self._put(rows[s:e], addrs[s:e], lens[s:e], ttl=ttl, if_absent=if_absent,
                          replicas=replicas, checks=None if checks is None else checks[s:e],
                          wait=wait)
            return
        if has_duplicates(rows):
            raise InvalidArgumentError("keys in one put must be distinct")
        if checks is None:
            checks = np.zeros(n, dtype=np.uint64)
        deadline = time.monotonic() + self.timeout
        todo = np.arange(n)
        failed_keys: list[int] = []
        reasons: list[str] = []
        delay = 0.0005
        rewrites = 0
        while todo.size:
            placed = self._request(KvPut(
                keys=rows[todo].tobytes(), lengths=pack(lens[todo], "<i8"),
                checksums=pack(checks[todo], "<u8"), replicas=replicas or self.replicas,
                ttl=float(ttl or 0.0), if_absent=if_absent, release=self._take_release()))
            assert isinstance(placed, KvPlaced)
            where = _where(placed, todo.size)
            ok = np.flatnonzero(where.status == Status.OK)
            if ok.size:
                jobs: dict[int, list[tuple[int, int, int, int]]] = {}
                for i in ok.tolist():
                    j = int(todo[i])
                    for r in range(where.pools.shape[1]):
                        p = int(where.pools[i, r])
                        if p < 0:
                            break
                        jobs.setdefault(p, []).append(
                            (int(addrs[j]), int(where.offsets[i, r]), int(lens[j]), j))
                limit = min(deadline, time.monotonic() + 0.8 * placed.deadline_s)
                bad = self._move(True, jobs, where.nodes, limit)
                reasons += [f"{where.nodes[b][0]}: {e}" for b, e in bad.items()]
                versions = column(placed.versions, "<u8", todo.size, "versions")
                if self._tier is not None:
                    # the tier serves a value only at the version the master holds, so
                    # one whose commit fails is never served
                    wrote = np.flatnonzero(~np.isin(where.pools[ok, 0], list(bad)))
                    js = todo[ok[wrote]]
                    self._tier.fill(rows[js], versions[ok[wrote]],
                                    [_memory(int(addrs[j]), int(lens[j])) for j in js],
                                    promotion=False)
                commit = KvCommit(put_id=placed.put_id,
                                  failed=[str(where.nodes[b][0]) for b in bad],
                                  release=self._take_release())
                settle = _Settle(rows[todo], ok, versions, where, lens[todo])
                if not wait:
                    self._link.post(commit, functools.partial(self._settled_late, settle))
                    again = todo[:0]
                else:
                    done = self._request(commit)
                    lost, refused = self._settled(settle, done)
                    failed_keys += todo[refused].tolist()
                    if refused.size:
                        reasons.append(f"{refused.size} keys: commit refused")
                    # every replica's node failed or left during the write: placed
                    # again (on the nodes still up) a few times, then given up
                    if lost.size and rewrites < _PUT_ATTEMPTS:
                        again = todo[lost]
                        rewrites += 1
                    else:
                        again = todo[:0]
                        if lost.size:
                            failed_keys += todo[lost].tolist()
                            reasons.append(f"{lost.size} keys: every node holding them "
                                           f"failed or left during {_PUT_ATTEMPTS + 1} writes")
            else:
                again = todo[:0]
            for code in (Status.NO_SPACE, Status.TOO_LARGE, Status.RECOVERING):
                hit = todo[where.status == code]
                if hit.size:
                    failed_keys += hit.tolist()
                    reasons.append(f"{hit.size} keys: {code.name}")
            todo = np.concatenate((todo[where.status == Status.RETRY], again))
            if again.size and todo.size == again.size:
                continue  # nothing waits for space: place the lost keys again now
            if todo.size:
                if time.monotonic() + delay > deadline:
                    failed_keys += todo.tolist()
                    reasons.append(f"{todo.size} keys: no space freed within {self.timeout}s")
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        if failed_keys:
            keys: list[object] = [int(rows[j, 0]) | int(rows[j, 1]) << 64
                                  for j in sorted(failed_keys)]
            raise PutError(f"{len(keys)} of {n} values not stored ({'; '.join(reasons)})",
                           keys)

    def batch_put(self, keys: object, values: Sequence[Any], *, ttl: float | None = None,
                  if_absent: bool = False, replicas: int | None = None,
                  wait: bool = True) -> None:
        """Stores ``values`` (bytes-like) under ``keys``, replacing older values; readers
        see either the old or the whole new value. ``if_absent``: keys already stored
        are left as they are. ``ttl`` seconds (None: until evicted). Raises
        :class:`PutError` (the keys it names keep their old values).

        ``wait=False`` (a cache storing what it computed, off its critical path): returns
        once the bytes are written and the commit is sent, without waiting for the
        master's answer. The master takes the commit before any later request of this
        client (so this client's next get sees the values); other clients see them a
        moment later. Keys the commit could not store are not written again: they are
        counted, and :meth:`flush` names them. Values are still copied before return, and
        space or placement problems are still raised here."""
        rows = key_rows(keys)
        views = [memoryview(v).cast("B") if not isinstance(v, np.ndarray) else
                 memoryview(np.ascontiguousarray(v).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
                 for v in values]
        if len(views) != rows.shape[0]:
            raise InvalidArgumentError(f"{rows.shape[0]} keys but {len(views)} values")
        lens = np.array([v.nbytes for v in views], dtype=np.int64)
        with self._lock:
            staging, base = self._stage(int(lens.sum()) + 64 * len(views))
            offs = np.zeros(len(views), dtype=np.int64)
            pos = 0
            for i, v in enumerate(views):
                offs[i] = pos
                staging[pos:pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
                pos += (v.nbytes + 63) & ~63
            checks = (np.array([crc(v) for v in views], dtype=np.uint64)
                      if self.checksum else None)
            self._put(rows, offs + base, lens, ttl=ttl, if_absent=if_absent,
                      replicas=replicas, checks=checks, wait=wait)

    def put(self, key: object, value: Any, *, ttl: float | None = None,
            if_absent: bool = False, replicas: int | None = None) -> None:
        """One value; see :meth:`batch_put`."""
        self.batch_put([key], [value], ttl=ttl, if_absent=if_absent, replicas=replicas)

    def put_from(self, keys: object, buffers: Sequence[Any], *, ttl: float | None = None,
                 if_absent: bool = False, replicas: int | None = None,
                 wait: bool = True) -> None:
        """Zero-copy put: each value is a buffer (numpy array, memoryview) lying inside
        memory registered with :meth:`register_buffer` (reusable once this returns, also
        with ``wait=False``, see :meth:`batch_put`)."""
        rows = key_rows(keys)
        spans = [_address(b, writable=False) for b in buffers]
        if len(spans) != rows.shape[0]:
            raise InvalidArgumentError(f"{rows.shape[0]} keys but {len(spans)} buffers")
        self.put_from_addresses(rows, [a for a, _ in spans], [n for _, n in spans], ttl=ttl,
                                if_absent=if_absent, replicas=replicas, wait=wait)

    def put_from_addresses(self, keys: object, addresses: Sequence[int],
                           sizes: Sequence[int], *, ttl: float | None = None,
                           if_absent: bool = False, replicas: int | None = None,
                           wait: bool = True) -> None:
        """As :meth:`put_from`, with raw addresses inside registered buffers."""
        rows = key_rows(keys)
        addrs = np.asarray(addresses, dtype=np.int64)
        lens = np.asarray(sizes, dtype=np.int64)
        if addrs.shape != (rows.shape[0],) or lens.shape != addrs.shape or (lens < 0).any():
            raise InvalidArgumentError("one address and one size >= 0 per key")
        with self._lock:
            self._local(addrs, lens)  # refuse unregistered memory before anything moves
            checks = None
            if self.checksum:
                checks = np.array([crc(_memory(a, n)) for a, n in
                                   zip(addrs.tolist(), lens.tolist(), strict=True)],
                                  dtype=np.uint64)
            self._put(rows, addrs, lens, ttl=ttl, if_absent=if_absent, replicas=replicas,
                      checks=checks, wait=wait)

    # -- get ---------------------------------------------------------------------------

    def _locate(self, rows: U64, between: Callable[[], None] | None = None
                ) -> tuple[U64, _Where, I64, U64, float]:
        """(versions, replicas, lengths, checksums, lease end) of each key; ``between``
        runs while the master works on the request."""
        started = time.monotonic()
        reply = self._request(KvGet(keys=rows.tobytes(), release=self._take_release()),
                              between)
        assert isinstance(reply, KvLocated)
        n = rows.shape[0]
        if reply.lease_id:
            self._release.append(reply.lease_id)
        return (column(reply.versions, "<u8", n, "versions"), _where(reply, n),
                column(reply.lengths, "<i8", n, "lengths"),
                column(reply.checksums, "<u8", n, "checksums"), started + reply.lease_s)

    def _get(self, rows: U64, dest: I64 | None, caps: I64 | None, verify: bool
             ) -> tuple[I64, I64]:
        """Reads every key into ``dest[i]`` (registered memory of ``caps[i]`` bytes) or,
        with ``dest`` None, into staging. Returns (lengths, -1 where missing; the
        staging offsets used)."""
        n = rows.shape[0]
        guessed: list[_Guess] = []
        between: Callable[[], None] | None = None
        self._guessing |= dest is not None
        if dest is not None and caps is not None and not verify and self._tier is None \
                and self._guesses:
            def speculate() -> None:
                assert dest is not None and caps is not None
                g = self._speculate(rows, dest, caps)
                if g is not None:
                    guessed.append(g)
            between = speculate
        try:
            for _attempt in range(2):
                versions, where, lengths, checks, lease_end = self._locate(rows, between)
                between = None
                guess = guessed[0] if guessed and guessed[0].handles else None
                found = where.status == Status.OK
                out = np.where(found, lengths, -1)
                if dest is None:
                    padded = (lengths + 63) & ~63
                    offs = np.concatenate(([0], np.cumsum(padded)[:-1])) if n else padded
                    _, base = self._stage(int(padded.sum()) + 64)
                    addrs = offs + base
                else:
                    assert caps is not None
                    small = found & (lengths > caps)
                    if small.any():
                        i = int(np.flatnonzero(small)[0])
                        raise InvalidArgumentError(
                            f"key {i}: value of {int(lengths[i])} bytes does not fit its "
                            f"{int(caps[i])}-byte buffer")
                    offs = np.zeros(n, dtype=np.int64)
                    addrs = dest
                    self._local(addrs[found], lengths[found])
                remote = found
                if self._tier is not None:
                    remote = found & ~self._tier.serve(rows, versions, found, addrs,
                                                       checks if verify else None, crc)
                if guess is not None:
                    remote = found & ~self._confirm(guess, found, versions, where, lengths)
                self._read(rows, remote, where, addrs, lengths, checks, verify)
                self._remember(rows, np.flatnonzero(found), versions, where, lengths)
                self.remote_hits += int(remote.sum())
                if self._tier is not None and remote.any():
                    got = np.flatnonzero(remote)
                    self._tier.fill(rows[got], versions[got],
                                    [_memory(int(addrs[i]), int(lengths[i])) for i in got],
                                    promotion=True)
                if time.monotonic() < lease_end:
                    return out, offs
                log.info("kvstore client: a read outlived its lease; reading again")
            raise ObjectUnavailableError("reads keep outliving their leases (master lease_s "
                                         "too short for these transfers?)")
        finally:
            for g in guessed:
                if g.handles:
                    self._abandon(g)

    def _read(self, rows: U64, found: npt.NDArray[np.bool_], where: _Where, addrs: I64,
              lengths: I64, checks: U64, verify: bool) -> None:
        n = rows.shape[0]
        nrep = (where.pools >= 0).sum(axis=1)
        tried = np.zeros_like(where.pools, dtype=bool)
        why: dict[int, list[str]] = {}
        pending = np.flatnonzero(found & (lengths > 0))
        deadline = time.monotonic() + self.timeout
        nodes = where.nodes
        for _ in range(where.pools.shape[1] + 1):
            if pending.size == 0:
                return
            jobs: dict[int, list[tuple[int, int, int, int]]] = {}
            chosen: dict[int, int] = {}
            lost: list[int] = []
            for i in pending.tolist():
                pick = -1
                for s in range(int(nrep[i])):
                    r = (i + s) % int(nrep[i])  # spread a batch over the replicas
                    if not tried[i, r] and self._usable(str(nodes[where.pools[i, r]][0])):
                        pick = r
                        break
                if pick < 0:
                    lost.append(i)
                    continue
                tried[i, pick] = True
                chosen[i] = pick
                jobs.setdefault(int(where.pools[i, pick]), []).append(
                    (int(addrs[i]), int(where.offsets[i, pick]), int(lengths[i]), i))
            if lost:
                i = lost[0]
                key = int(rows[i, 0]) | int(rows[i, 1]) << 64
                raise ObjectUnavailableError(
                    f"no readable replica of key {key:#x} ({len(lost)} of {n} keys): "
                    f"{'; '.join(why.get(i, ['every replica node failed recently']))}",
                    key=key, reasons=why.get(i, []))
            bad = self._move(False, jobs, nodes, deadline)
            again: list[int] = []
            for node, items in jobs.items():
                for _, _, _, i in items:
                    if node in bad:
                        why.setdefault(i, []).append(f"{nodes[node][0]}: {bad[node]}")
                        again.append(i)
            if verify:
                for i, r in chosen.items():
                    if int(where.pools[i, r]) in bad or not checks[i]:
                        continue
                    if crc(_memory(int(addrs[i]), int(lengths[i]))) != int(checks[i]):
                        why.setdefault(i, []).append(f"{nodes[where.pools[i, r]][0]}: "
                                                     "checksum mismatch")
                        again.append(i)
            pending = np.array(sorted(set(again)), dtype=np.int64)
        if pending.size:
            raise ObjectUnavailableError(f"{pending.size} keys could not be read")

    def batch_get(self, keys: object, *, verify: bool = False) -> list[bytes | None]:
        """Values of ``keys`` (None where missing). ``verify``: check the CRC32 recorded
        at put (values put without one are not checked). Raises
        :class:`ObjectUnavailableError` when a key's every replica fails."""
        rows = key_rows(keys)
        with self._lock:
            lengths, offs = self._get(rows, None, None, verify)
            staging = self._staging
            out: list[bytes | None] = []
            for n, o in zip(lengths.tolist(), offs.tolist(), strict=True):
                out.append(None if n < 0 else (b"" if n == 0 or staging is None
                                               else staging[o:o + n].tobytes()))
            return out

    def get(self, key: object, *, verify: bool = False) -> bytes | None:
        return self.batch_get([key], verify=verify)[0]

    def get_into(self, keys: object, buffers: Sequence[Any], *, verify: bool = False
                 ) -> list[int | None]:
        """Zero-copy get into buffers lying inside registered memory; returns each value's
        length (None where missing)."""
        rows = key_rows(keys)
        spans = [_address(b, writable=True) for b in buffers]
        if len(spans) != rows.shape[0]:
            raise InvalidArgumentError(f"{rows.shape[0]} keys but {len(spans)} buffers")
        return self.get_into_addresses(rows, [a for a, _ in spans], [n for _, n in spans],
                                       verify=verify)

    def get_into_addresses(self, keys: object, addresses: Sequence[int],
                           sizes: Sequence[int], *, verify: bool = False
                           ) -> list[int | None]:
        """As :meth:`get_into`, with raw addresses inside registered buffers."""
        rows = key_rows(keys)
        addrs = np.asarray(addresses, dtype=np.int64)
        caps = np.asarray(sizes, dtype=np.int64)
        if addrs.shape != (rows.shape[0],) or caps.shape != addrs.shape:
            raise InvalidArgumentError("one address and one size per key")
        out: list[int | None] = []
        with self._lock:
            for s in range(0, max(1, rows.shape[0]), MAX_BATCH):
                e = s + MAX_BATCH
                lengths, _ = self._get(rows[s:e], addrs[s:e], caps[s:e], verify)
                out += [None if n < 0 else n for n in lengths.tolist()]
        return out

    # -- queries -----------------------------------------------------------------------

    def batch_exists(self, keys: object) -> npt.NDArray[np.bool_]:
        with self._lock:
            return _query(keys, self._request, self._take_release)

    def exists(self, key: object) -> bool:
        return bool(self.batch_exists([key])[0])

    def longest_prefix(self, block_hashes: object) -> int:
        """How many leading blocks of a chain of block hashes are stored (one round trip
        for the whole chain)."""
        return _leading(self.batch_exists(block_hashes))

    def batch_remove(self, keys: object) -> npt.NDArray[np.bool_]:
        """Removes keys; True where one was stored. Readers holding a lease finish
        reading the old bytes."""
        rows = key_rows(keys)
        out = np.zeros(rows.shape[0], dtype=bool)
        with self._lock:
            if self._tier is not None:
                self._tier.invalidate(rows)
            for s in range(0, rows.shape[0], MAX_BATCH):
                reply = self._request(KvRemove(keys=rows[s:s + MAX_BATCH].tobytes(),
                                               release=self._take_release()))
                assert isinstance(reply, KvFound)
                st = column(reply.status, "<i1", min(MAX_BATCH, rows.shape[0] - s), "status")
                out[s:s + MAX_BATCH] = st == Status.OK
        return out

    def remove(self, key: object) -> bool:
        return bool(self.batch_remove([key])[0])

    def stats(self) -> dict[str, Any]:
        """The master's view (objects, pools and free space, leases, counters such as
        ``demotions``, ``disk_hits``, ``disk_promotions``) and this client's:
        ``remote_hits`` (values read from nodes), ``guessed_reads`` (values a
        ``get_into`` read before the master answered), ``late_put_failures`` (values of
        puts that did not wait, not stored, not yet reported by :meth:`flush`), and with
        a local tier ``local_hits``,
        ``promotions`` (remote hits kept locally), ``local_writes``, ``local_stale``
        (copies dropped: another version, or the key is gone), ``local_evictions``,
        ``local_entries``."""
        with self._lock:
            reply = self._request(KvStats(release=self._take_release()))
            assert isinstance(reply, KvStatsReply)
            out = dict(reply.stats)
            out["remote_hits"] = self.remote_hits
            out["guessed_reads"] = self.guessed_reads
            out["late_put_failures"] = len(self._late_failed)
            if self._tier is not None:
                out.update(self._tier.counters())
            return out


def _query(keys: object, request: Callable[[Message], Message],
           release: Callable[[], bytes]) -> npt.NDArray[np.bool_]:
    """Which ``keys`` are stored: one master request per ``MAX_BATCH`` keys."""
    rows = key_rows(keys)
    out = np.zeros(rows.shape[0], dtype=bool)
    for s in range(0, rows.shape[0], MAX_BATCH):
        reply = request(KvQuery(keys=rows[s:s + MAX_BATCH].tobytes(), release=release()))
        assert isinstance(reply, KvFound)
        st = column(reply.status, "<i1", min(MAX_BATCH, rows.shape[0] - s), "status")
        out[s:s + MAX_BATCH] = st == Status.OK
    return out


def _leading(found: npt.NDArray[np.bool_]) -> int:
    miss = np.flatnonzero(~found)
    return int(miss[0]) if miss.size else int(found.size)


class Lookup(Closeable):
    """Asks the master which keys are stored, and nothing else: no engine, no memory.

    For a process that only decides what to load (a vLLM scheduler): a :class:`Client`
    would start an engine it never uses.

    Parameters:
        master: the master's endpoint.
        timeout: seconds for a master request.
        auth: control-message signing, as for :class:`Client`.
    """

    def __init__(self, master: str, *, timeout: float = 10.0,
                 auth: AuthConfig | str | bytes | None = None) -> None:
        self._closed = True
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        self.timeout = timeout
        self._link = _MasterLink(master, auth.signer())
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Lookup master={self._link.address} {'CLOSED' if self._closed else 'OPEN'}>"

    def _request(self, msg: Message) -> Message:
        if self._closed:
            raise StoreError("the lookup is closed")
        return self._link.request(msg, self.timeout)

    def batch_exists(self, keys: object) -> npt.NDArray[np.bool_]:
        with self._lock:
            return _query(keys, self._request, lambda: b"")

    def longest_prefix(self, block_hashes: object) -> int:
        """As :meth:`Client.longest_prefix`."""
        return _leading(self.batch_exists(block_hashes))

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._link.close()

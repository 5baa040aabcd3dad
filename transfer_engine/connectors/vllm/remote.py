"""A prefill worker's KV as a decoder reads it: the manifest every worker publishes
(its layers' segments and block layouts, its compatibility hash), the READ of some
blocks of every layer, planned as a few array operations per pair of segments, and the
decoder's table of such peers."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from transfer_engine.connectors.compat import compat_hash, describe_mismatch
from transfer_engine.connectors.vllm.config import MANIFEST_SEGMENT, PROTOCOL_VERSION
from transfer_engine.connectors.vllm.metadata import SOURCES, RecvSpec, sources
from transfer_engine.descriptor import Blocks, Descriptor
from transfer_engine.engine import Engine
from transfer_engine.errors import ClosedError, ProtocolError, TransferEngineError
from transfer_engine.handle import TransferHandle, TransferState
from transfer_engine.layout import BlockLayout, head_pieces, pair_runs
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["Layers", "MergedKV", "Placement", "Reads", "Recv", "RemoteKV", "RemotePeers",
           "manifest"]

Layers = Mapping[str, tuple[Segment, BlockLayout]]  # layer -> (its segment, its layout)
# a manifest is a few hundred bytes per layer; a peer that claims more is not read
MAX_MANIFEST_BYTES = 4 << 20


@dataclass(frozen=True)
class Placement:
    """Which of the model's KV heads a worker holds: tensor-parallel rank ``tp_rank`` of
    ``tp_size``, heads ``first .. first + count`` (``heads`` None: not known), or the
    whole KV whatever its rank (``replicated``: an MLA latent cache, the same on every
    rank)."""

    tp_rank: int = 0
    tp_size: int = 1
    heads: tuple[int, int] | None = None
    replicated: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "heads": None if self.heads is None else list(self.heads),
                "replicated": self.replicated}

    @classmethod
    def from_wire(cls, data: Any) -> Placement:
        heads = data.get("heads")
        if heads is not None:
            first, count = (int(h) for h in heads)
            if first < 0 or count < 1:
                raise ValueError(f"heads {heads!r:.40}")
            heads = (first, count)
        return cls(int(data["tp_rank"]), int(data["tp_size"]), heads,
                   data.get("replicated", False) is True)


def manifest(layers: Layers, compat: dict[str, Any], placement: Placement = Placement(),
             push: tuple[str, int] | None = None) -> bytes:
    """What a worker publishes in its ``MANIFEST_SEGMENT`` for decoders to check and
    plan their READs by (``push``: the segment prefill pushes KV into, and its size,
    where this worker takes pushes)."""
    return bytes(msgpack.packb({
        "version": PROTOCOL_VERSION, "compat": compat, "hash": compat_hash(compat),
        "placement": placement.to_wire(), "push": list(push) if push else None,
        "layers": {n: [seg.name, layout.to_wire()] for n, (seg, layout) in layers.items()}}))


def _head_slices(ours: Placement, theirs: Placement, layers: Layers,
                 remote: dict[str, tuple[str, BlockLayout]]
                 ) -> dict[str, tuple[np.ndarray, np.ndarray, int]] | None:
    """The pieces of each layer's block parts to read where the peer holds other heads
    than ours (None: the same ones, read whole); raises ``ValueError`` saying why our
    heads cannot be read there."""
    if ours.replicated and theirs.replicated:
        return None  # every rank holds the whole latent cache
    if ours.heads is None or theirs.heads is None:
        if (ours.tp_rank, ours.tp_size) != (theirs.tp_rank, theirs.tp_size):
            raise ValueError(f"tensor-parallel rank {ours.tp_rank} of {ours.tp_size} here, "
                             f"{theirs.tp_rank} of {theirs.tp_size} there, and which KV "
                             "heads each holds is not known")
        return None
    if ours.heads == theirs.heads:
        return None
    (first, count), (rfirst, rcount) = ours.heads, theirs.heads
    if rfirst <= first and first + count <= rfirst + rcount:  # ours among the peer's
        at, rat, n = 0, first - rfirst, count
    elif first <= rfirst and rfirst + rcount <= first + count:  # the peer's among ours
        at, rat, n = rfirst - first, 0, rcount
    else:
        raise ValueError(f"we hold KV heads {first}..{first + count}, the peer "
                         f"{rfirst}..{rfirst + rcount}")
    out = {}
    for name, (_, layout) in layers.items():
        rlayout = remote[name][1]
        if layout.heads is None or layout.heads[1] != count:
            raise ValueError(f"layer {name!r}: where its {count} heads lie is not known")
        out[name] = head_pieces(layout, rlayout, at, rat, n)
    return out


@dataclass(frozen=True, eq=False)
class _Parts:
    """Every part (K, V) of some layers that lie in one local and one remote segment, as
    arrays: where part ``k`` of block 0 starts on each side, the block strides, the
    part's length."""

    local: Segment
    remote: RemoteSegment
    runs: bool  # whole runs of adjacent blocks are contiguous on both sides
    local_base: np.ndarray
    local_stride: np.ndarray
    remote_base: np.ndarray
    remote_stride: np.ndarray
    length: np.ndarray


@dataclass(eq=False)
class RemoteKV:
    """A connected prefill worker and where its layers' blocks lie."""

    peer: Peer
    layouts: dict[str, tuple[str, BlockLayout]]  # layer -> (segment name, layout)
    # layer -> where our heads lie in a block part here and there (None: whole parts)
    slices: dict[str, tuple[np.ndarray, np.ndarray, int]] | None = None
    # the segment it takes pushed KV into and its size (None: it takes none)
    push: tuple[str, int] | None = None
    # layers (None: all) -> their parts, grouped by segment pair (see _parts)
    _cache: dict[tuple[str, ...] | None, list[_Parts]] = dataclasses.field(
        default_factory=dict)

    @classmethod
    def connect(cls, engine: Engine, endpoint: str, layers: Layers,
                compat: dict[str, Any], timeout: float,
                placement: Placement = Placement()) -> RemoteKV:
        """Connects to the worker at ``endpoint``, reads its manifest and checks it
        against ours (``layers``, ``compat``, ``placement``: the heads we hold, read
        whole or sliced out of the peer's blocks); raises ``ProtocolError`` naming the
        mismatch."""
        peer = engine.connect(endpoint, timeout=timeout)
        mseg = peer.segment(MANIFEST_SEGMENT)
        if not 0 < mseg.length <= MAX_MANIFEST_BYTES:
            raise ProtocolError(f"KV manifest of {mseg.length} bytes (at most "
                                f"{MAX_MANIFEST_BYTES} are read)", peer=peer.name)
        buf = np.zeros(mseg.length, dtype=np.uint8)
        with engine.register(buf, name=f"te-vllm/manifest-in/{id(buf):x}") as local:
            engine.read(peer, [(Descriptor(local, 0, mseg.length),
                                Descriptor(mseg, 0, mseg.length))]).wait(timeout)
        try:
            data = msgpack.unpackb(buf.tobytes())
            version, theirs = data["version"], data["compat"]
            if version != PROTOCOL_VERSION:
                raise ProtocolError(f"peer speaks KV connector protocol {version}, we "
                                    f"speak {PROTOCOL_VERSION}; upgrade one side",
                                    peer=peer.name)
            remote = {n: (str(v[0]), BlockLayout.from_wire(v[1]))
                      for n, v in data["layers"].items()}
            where = (Placement() if data.get("placement") is None
                     else Placement.from_wire(data["placement"]))
            push = data.get("push")
            if push is not None:
                push = (str(push[0]), int(push[1]))
                if not 0 < push[1] <= peer.segment(push[0]).length:
                    raise ValueError(f"push segment of {push[1]} bytes")
        except (ValueError, KeyError, TypeError, AttributeError,
                msgpack.UnpackException) as exc:
            raise ProtocolError(f"malformed KV manifest: {exc}", peer=peer.name) from exc
        if data.get("hash") != compat_hash(compat):
            raise ProtocolError("incompatible KV caches, refusing to transfer: "
                                + describe_mismatch(compat, theirs), peer=peer.name)
        for name, (seg_name, _) in remote.items():
            if name not in layers:
                raise ProtocolError(f"peer has layer {name!r}, we do not", peer=peer.name)
            peer.segment(seg_name)  # known now, so building a READ asks nothing
        if set(layers) != set(remote):
            raise ProtocolError(f"peer lacks layers {sorted(set(layers) - set(remote))}",
                                peer=peer.name)
        try:
            slices = _head_slices(placement, where, layers, remote)
        except ValueError as exc:
            raise ProtocolError(f"cannot read our KV heads there: {exc}",
                                peer=peer.name) from None
        if slices is None:
            for name, (_, layout) in remote.items():
                why = layers[name][1].compatible(layout)
                if why is not None:
                    raise ProtocolError(f"layer {name!r} cannot take the peer's blocks: "
                                        f"{why}", peer=peer.name)
        return cls(peer, remote, slices, push)

    def check_ids(self, layers: Layers, spec: RecvSpec) -> None:
        """Every block id of a load, local and remote, inside every layer."""
        sides = [(min(ids), max(ids), side) for ids, side in (
            (spec.local_block_ids, "local"), (spec.remote_block_ids, "remote"))]
        for name, (_, layout) in layers.items():  # Python ints: nothing wraps
            rlayout = self.layouts[name][1]
            for (lo, hi, side), lay in zip(sides, (layout, rlayout), strict=True):
                if lo < 0 or hi >= lay.num_blocks:
                    raise ProtocolError(f"a {side} block id of {lo}..{hi} lies "
                                        f"outside layer {name!r}", peer=self.peer.name)

    def _parts(self, layers: Layers, names: tuple[str, ...] | None) -> list[_Parts]:
        """The parts of the layers ``names`` (None: all) against the peer's, once per
        set of layers: a load then costs a few array operations per segment pair, not a
        Python loop over layers (on a busy decoder each layer's share of a READ's
        set-up was a tenth of a millisecond)."""
        got = self._cache.get(names)
        if got is not None:
            return got
        rows: dict[tuple[int, int, bool],
                   tuple[Segment, RemoteSegment, list[tuple[int, ...]]]] = {}
        for name in layers if names is None else names:
            seg, layout = layers[name]
            rname, rlayout = self.layouts[name]
            rseg = self.peer.segment(rname)
            sliced = self.slices[name] if self.slices is not None else None
            runs = layout.contiguous and rlayout.contiguous and sliced is None
            entry = rows.setdefault((id(seg), id(rseg), runs), (seg, rseg, []))
            for loff, roff in zip(layout.parts, rlayout.parts, strict=True):
                if sliced is None:
                    entry[2].append((layout.segment_offset + loff, layout.block_stride,
                                     rlayout.segment_offset + roff, rlayout.block_stride,
                                     layout.block_bytes))
                    continue
                for lpiece, rpiece in zip(sliced[0].tolist(), sliced[1].tolist(),
                                          strict=True):  # our heads' pieces of the part
                    entry[2].append((layout.segment_offset + loff + lpiece,
                                     layout.block_stride,
                                     rlayout.segment_offset + roff + rpiece,
                                     rlayout.block_stride, sliced[2]))
        got = []
        for (_, _, runs), (seg, rseg, parts) in rows.items():
            cols = np.array(parts, dtype=np.int64).reshape(-1, 5).T[:, :, None]
            got.append(_Parts(seg, rseg, runs, *cols))
        if len(self._cache) < 64:
            self._cache[names] = got
        return got

    def pairs(self, layers: Layers, local_ids: list[int], remote_ids: list[int],
              names: tuple[str, ...] | None = None) -> list[Blocks]:
        """The READ of blocks checked by :meth:`check_ids`, for the layers ``names``
        (default: all): one :class:`Blocks` per pair of segments, with every layer's
        parts (K, V), whole runs of blocks adjacent on both sides merged where the
        layouts allow."""
        out: list[Blocks] = []
        if not local_ids:
            return out
        runs = np.array(pair_runs(local_ids, remote_ids), dtype=np.int64).reshape(-1, 3).T
        single = (np.asarray(local_ids, dtype=np.int64),
                  np.asarray(remote_ids, dtype=np.int64))
        for p in self._parts(layers, names):
            if p.runs:
                lb, rb, count = runs[0], runs[1], p.length * runs[2]
            else:
                lb, rb = single
                count = np.broadcast_to(p.length, (len(p.length), len(lb)))
            out.append(Blocks(p.local, p.remote, (p.local_base + lb * p.local_stride).ravel(),
                              (p.remote_base + rb * p.remote_stride).ravel(), count.ravel()))
        return out


@dataclass(eq=False)
class MergedKV:
    """The prefill ranks that hold a decode rank's KV heads between them (prefill runs
    more tensor-parallel ranks): a load READs each one's heads into our blocks."""

    sources: list[RemoteKV]

    def check_ids(self, layers: Layers, spec: RecvSpec) -> None:
        for info in self.sources:
            info.check_ids(layers, spec)

    def read(self, engine: Engine, layers: Layers, local_ids: list[int],
             remote_ids: list[int], notify: bytes, timeout: float | None) -> Reads:
        """One READ per source, each telling its prefill rank (its only reader) that
        the blocks were read; raises what stopped one from posting, after cancelling
        those posted."""
        handles: list[TransferHandle] = []
        try:
            for info in self.sources:
                handles.append(engine.read(info.peer, info.pairs(layers, local_ids,
                                                                 remote_ids),
                                           notify=notify, timeout=timeout))
        except TransferEngineError:
            for handle in handles:
                handle.cancel()
            raise
        return Reads(handles)


class Reads:
    """Several READs of one load, seen as one handle: done once all are, failed if
    any failed."""

    def __init__(self, handles: list[TransferHandle]) -> None:
        self.handles = handles
        self.nbytes = sum(h.nbytes for h in handles)

    @property
    def state(self) -> TransferState:
        states = {h.state for h in self.handles}
        if TransferState.PENDING in states:
            return TransferState.PENDING
        return TransferState.FAILED if TransferState.FAILED in states else TransferState.DONE

    @property
    def error(self) -> Any:
        return next((h.error for h in self.handles if h.error is not None), None)

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> None:
        """Waits for every READ (``timeout`` in all); raises the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def cancel(self) -> bool:
        return any([h.cancel() for h in self.handles])


@dataclass(eq=False)
class Recv:
    """A load under way on decode: its READ (or READs), its peer's handshake first."""

    spec: RecvSpec
    handle: TransferHandle | Reads | None
    started: float  # time.monotonic(): durations are real even under a fake clock
    error: str | None = None
    handshake: Future[Any] | None = None  # the peer's, while it is under way
    parts: list[TransferHandle] = dataclasses.field(default_factory=list)  # later layers
    info: RemoteKV | None = None  # the peer of a layer-wise load, for its later READs
    # time.monotonic() by which a sync load is given up; 0 for an async load (a sync
    # load may go layer by layer, an async one never)
    deadline: float = 0.0
    landed: float = 0.0  # time.monotonic() when the forward last found a part landed
    pushed: bool = False  # copied out of a room prefill pushed it into: no READ


class RemotePeers:
    """The prefill workers a decoder has read from, and the handshakes under way (on a
    small pool of unpinned threads: a handshake waits on the network, and the rails'
    threads it starts inherit its CPU affinity)."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._name = name
        self._initializer = initializer
        self._known: dict[str, RemoteKV | MergedKV] = {}
        self._closed = False
        self._handshakes: dict[str, Future[RemoteKV]] = {}  # endpoint -> under way
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the forward's thread and engine threads shake

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=4, thread_name_prefix=f"te-vllm-handshake-{self._name}",
                initializer=self._initializer)
        return self._executor

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` on the pool (work that waits on the network, handed over
        by a thread that must not); nothing once closed."""
        with self._lock:
            if self._closed:
                return
            self._pool().submit(fn, *args)

    def get(self, endpoint: str) -> Any:
        """The peer (a :class:`RemoteKV`, or a :class:`MergedKV` for joined
        endpoints) connected at ``endpoint``, or None."""
        return self._known.get(endpoint)

    def handshake(self, engine: Engine, endpoint: str, layers: Layers,
                  compat: dict[str, Any], timeout: float,
                  placement: Placement = Placement()) -> Future[Any]:
        """The handshake with ``endpoint``: the one under way, or a new one. For
        several endpoints (joined by :data:`SOURCES`), one future for all of their
        handshakes, giving a :class:`MergedKV`."""
        if SOURCES in endpoint:
            return self._merged(engine, endpoint, layers, compat, timeout, placement)
        with self._lock:
            fut = self._handshakes.get(endpoint)
            if fut is None:
                if self._closed:
                    fut = Future()
                    fut.set_exception(ClosedError("the connector is closing"))
                    return fut
                fut = self._pool().submit(RemoteKV.connect, engine, endpoint, layers,
                                          compat, timeout, placement)
                self._handshakes[endpoint] = fut
            return fut

    def _merged(self, engine: Engine, key: str, layers: Layers, compat: dict[str, Any],
                timeout: float, placement: Placement) -> Future[MergedKV]:
        parts = [(e, self.get(e) or self.handshake(engine, e, layers, compat, timeout,
                                                    placement)) for e in sources(key)]
        out: Future[MergedKV] = Future()
        left = [len(parts)]
        lock = threading.Lock()

        def one_done(_: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                out.set_result(MergedKV([
                    p if isinstance(p, RemoteKV) else self.settled(e, p)
                    for e, p in parts]))
            except BaseException as exc:  # noqa: BLE001 - the load fails with it
                out.set_exception(exc)

        for _, part in parts:
            if isinstance(part, RemoteKV):
                one_done(None)
            else:
                part.add_done_callback(one_done)
        return out

    def settled(self, endpoint: str, fut: Future[Any]) -> Any:
        """The peer ``fut`` (done) connected, kept for later loads; raises what broke
        the handshake (a failed one is tried again by a later load)."""
        with self._lock:
            if self._handshakes.get(endpoint) is fut:
                del self._handshakes[endpoint]
        info = fut.result()
        with self._lock:
            return self._known.setdefault(endpoint, info)

    def forget(self, endpoint: str) -> None:
        """The next load from ``endpoint`` (each of them, if joined) connects afresh."""
        self._known.pop(endpoint, None)
        if SOURCES in endpoint:
            for one in sources(endpoint):
                self._known.pop(one, None)

    def __len__(self) -> int:
        return len(self._handshakes)

    def close(self, engine_closed: Callable[[], None]) -> None:
        """Cancels handshakes not started, runs ``engine_closed`` (which fails the
        running ones), then waits for their threads."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._known.clear()
        self._handshakes.clear()
        engine_closed()
        if executor is not None:
            executor.shutdown(wait=True)

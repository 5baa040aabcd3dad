"""Worker-side logic: owns the engine and the registered KV memory, loads and holds;
in store mode, loads from and saves to the cluster store."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)

from kvstore.client import Client
from transfer_engine.connectors.compat import compat_hash
from transfer_engine.connectors.vllm.blocks import (
    head_range,
    layer_groups,
    layout_signature,
    register_layers,
)
from transfer_engine.connectors.vllm.config import (
    MANIFEST_SEGMENT,
    PROTOCOL_VERSION,
    TEConnectorConfig,
    unpin_current_thread,
    unpinned,
)
from transfer_engine.connectors.vllm.metadata import PushSpec, RecvSpec, TEHandshakeMetadata
from transfer_engine.connectors.vllm.push import PushSide, parse_push
from transfer_engine.connectors.vllm.remote import (
    MergedKV,
    Placement,
    Reads,
    Recv,
    RemoteKV,
    RemotePeers,
    manifest,
)
from transfer_engine.connectors.vllm.rooms import Staging
from transfer_engine.connectors.vllm.sent import Holds, sent_note
from transfer_engine.connectors.vllm.stats import (
    INTERVAL_COUNTS,
    TIMES,
    interval,
    worker_counters,
)
from transfer_engine.connectors.vllm.store import StoreIO, StoreJobs, StoreLoad, StoreSave
from transfer_engine.descriptor import Descriptor
from transfer_engine.engine import Engine
from transfer_engine.errors import (
    ClosedError,
    ConnectError,
    PeerLostError,
    ProtocolError,
    TransferEngineError,
    TransferTimeout,
)
from transfer_engine.handle import TransferHandle, TransferState
from transfer_engine.layout import BlockLayout
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

log = logging.getLogger(__name__)

_WORKERS: weakref.WeakSet[TEConnectorWorker] = weakref.WeakSet()


def live_workers() -> list[TEConnectorWorker]:
    """The worker-side connectors alive in this process (tests read their counters)."""
    return list(_WORKERS)


class TEConnectorWorker:
    """Worker-side logic: owns the engine and the registered KV memory.

    :param engine_name: unique engine name among peers.
    :param config: the connector's configuration.
    :param compat: factors that must match between peers (model, dtype, block size...);
        the layer layouts are added by :meth:`register_kv_caches`.
    :param clock: monotonic clock for leases held here (tests pass a fake one).
    :param wall_clock: ``time.time``-like clock the peers' lease expiries are read by.
    :param rank: tensor parallel rank (store mode keys each rank's pieces apart).
    :param tp_size: tensor parallel ranks; ``kv_heads``: (this rank's KV heads, the
        model's), where known (a decode rank then reads its heads out of the blocks of
        a prefill rank holding more); ``replicated``: every rank holds the whole KV (an
        MLA latent cache, read whole); ``takes_push``: staging memory for pushes.
    """

    def __init__(self, engine_name: str, config: TEConnectorConfig,
                 compat: dict[str, Any], clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, rank: int = 0,
                 tp_size: int = 1, kv_heads: tuple[int, int] | None = None,
                 takes_push: bool = True, replicated: bool = False) -> None:
        self.engine_name = engine_name
        self.rank, self._tp, self._kv_heads = rank, tp_size, kv_heads
        self.placement = Placement(rank, tp_size, kv_heads and head_range(rank, tp_size,
                                                                          *kv_heads),
                                   replicated)
        self.config = config
        self.compat = dict(compat)
        self._clock = clock
        self._wall = wall_clock
        self.engine: Engine | None = None
        self._layers: dict[str, tuple[Segment, BlockLayout]] = {}
        self._tensors: list[Any] = []
        self._manifest = b""
        self._peers = RemotePeers(engine_name, initializer=unpin_current_thread)
        self._recving: dict[str, Recv] = {}
        self._failed_blocks: set[int] = set()
        self._lock = threading.Lock()
        self._store_client: Client | None = None
        self.stats = worker_counters()
        self._reported = dict.fromkeys(INTERVAL_COUNTS.values(), 0)  # by interval_stats
        self._times: dict[str, deque[float]] = {  # since the last interval_stats
            key: deque(maxlen=4096) for key, _, _ in TIMES}
        self._holds = Holds(clock, self.stats, self._times["held_seconds"], self._lock)
        self._store = StoreJobs(None, self.stats, (), engine_name)  # off until opened
        # layer-wise sync loads: the forward's layers in groups (layer_groups), learnt
        # from a step in which vLLM waited for every layer (until then a sync load
        # completes before the forward); this step's waits; the handles each layer waits
        # for; the loads whose later layers are still landing
        self._groups: list[tuple[str, ...]] | None = None
        self._waited: dict[str, None] = {}
        self._layer_waits: dict[str, list[tuple[TransferHandle, Recv]]] = {}
        self._layered: list[Recv] = []
        self._scratch: Segment | None = None  # a few bytes a notification's READ lands in
        self._step_wait = 0.0  # seconds this step's forward waited for sync loads
        self._takes_push = takes_push and config.push_mib > 0  # decode: a staging room
        self._push: PushSide | None = None
        _WORKERS.add(self)

    # set-up
    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Registers every layer tensor once and publishes the manifest."""
        engine = self.engine
        if engine is None:
            # a serving process has no device runtime: GPU KV is served from threads
            on_gpu = any(str(t.device) != "cpu" for t in kv_caches.values())
            with unpinned():  # the engine's threads start here
                self.engine = engine = Engine(
                    self.engine_name, host=self.config.host, port=self.config.port,
                    transports=self.config.transports,
                    serve="thread" if on_gpu else self.config.serve,
                    timeout=self.config.timeout_s, auth=self.config.auth())
        self._layers.update(register_layers(engine, kv_caches, num_blocks,
                                            self._kv_heads[0] if self._kv_heads else None))
        self._tensors += kv_caches.values()  # alive while registered
        self.compat["layouts"] = sorted({layout_signature(layout)
                                         for _, layout in self._layers.values()})
        self.compat["num_layers"] = len(self._layers)
        if self.config.push:
            self._push = PushSide(
                engine, self._layers,
                lambda where: self._peers.handshake(engine, where, self._layers,
                                                    self.compat, self.config.timeout_s,
                                                    self.placement),
                self._peers.settled, self._peers.get, self._peers.submit,
                self._tell, self.stats,
                self.rank, self._tp, self._takes_push * (self.config.push_mib << 20),
                self.config.timeout_s, self._peers.forget)
            self._holds.on_read = self._push.read
        self._manifest = manifest(self._layers, self.compat, self.placement,
                                  self._push.manifest_entry if self._push else None)
        self._manifest_buf = np.frombuffer(bytearray(self._manifest), dtype=np.uint8)
        engine.register(self._manifest_buf, name=MANIFEST_SEGMENT)
        engine.on_notify(self._on_notify)
        if self.config.store is not None:
            self._open_store(self.config.store)

    def _open_store(self, master: str) -> None:
        """Store mode: a store client on this engine, the KV segments registered with
        it as they are, and one thread the loads and saves run on (they wait on the
        network; the forward pass never does)."""
        assert self.engine is not None
        self._store_client = Client(master, engine=self.engine,
                                    timeout=self.config.store_timeout_s,
                                    auth=self.config.auth())
        self._store = StoreJobs(
            StoreIO(self._store_client, self._layers, f"{self.hash[:16]}/tp{self.rank}"
                    + (f"of{self._tp}" if self._tp > 1 else "")),
            self.stats, (self.stats["recv_seconds"], self._times["store_load_seconds"]),
            self.engine_name, initializer=unpin_current_thread)

    @property
    def hash(self) -> str:
        return compat_hash(self.compat)

    @property
    def layouts(self) -> dict[str, BlockLayout]:
        """The block layout of each registered layer, by layer name."""
        return {name: layout for name, (_, layout) in self._layers.items()}

    @property
    def staging(self) -> Staging | None:
        """Decode's rooms for pushed KV (None: it takes no pushes)."""
        return self._push.staging if self._push is not None else None

    @property
    def receiving(self) -> int:
        """Requests whose KV is being read from a prefill engine now."""
        return len(self._recving)

    def handshake_metadata(self) -> TEHandshakeMetadata:
        assert self.engine is not None, "register_kv_caches first"
        return TEHandshakeMetadata(self.engine.endpoint, self.engine.name, PROTOCOL_VERSION,
                                   self.hash,
                                   self.store.labels if self.store is not None else ())

    # decode: loads
    def start_load(self, specs: Iterable[RecvSpec]) -> None:
        """Starts one READ per request, or the peer's handshake first; never waits on
        the network. Failures are reported by :meth:`results`."""
        for spec in specs:
            self._recving[spec.request_id] = self._begin(spec)

    def load_now(self, specs: Iterable[RecvSpec]) -> None:
        """Loads before this step's forward, which computes with the KV: every READ
        (and each new peer's handshake) is started, then all are waited for, within
        ``timeout_s`` in all. A load that fails marks its blocks, and vLLM recomputes
        them."""
        specs = list(specs)
        if not specs:
            return
        began = time.monotonic()
        deadline = began + self.config.timeout_s
        self.stats["recv_sync"] += len(specs)
        recvs = [self._begin(spec, timeout=self.config.timeout_s, deadline=deadline)
                 for spec in specs]
        shaking = [r for r in recvs if r.handshake is not None]
        while shaking:  # each READ starts as soon as its peer's handshake is done
            pending = {r.handshake for r in shaking if r.handshake is not None}
            futures_wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                         return_when=FIRST_COMPLETED)
            late = time.monotonic() >= deadline
            for recv in list(shaking):
                fut = recv.handshake
                assert fut is not None
                if fut.done():
                    shaking.remove(recv)
                    self._after_handshake(recv, fut, max(0.001, deadline - time.monotonic()))
                elif late:  # its future stays for a later load to use
                    shaking.remove(recv)
                    recv.handshake = None
                    self._fail(recv, TransferTimeout(
                        f"handshake not done within {self.config.timeout_s} s",
                        peer=self._source(recv.spec), op="load"))
        for recv in recvs:
            if recv.handle is not None:
                self._settle(recv, recv.handle)
                recv.landed = time.monotonic()
            if recv.info is not None and recv.handle is not None \
                    and recv.handle.state is TransferState.DONE and self._issue_rest(recv):
                self._layered.append(recv)  # the forward waits for the rest
                self.stats["recv_layered"] += 1
                continue
            for part in recv.parts:  # later READs posted before one failed to post
                part.cancel()
            self._account(recv)
        self._step_wait += time.monotonic() - began

    def _settle(self, recv: Recv, handle: TransferHandle | Reads) -> None:
        """Waits for one READ of a sync load until the load's deadline; past that,
        cancels it, which returns once nothing of it writes into the blocks."""
        with contextlib.suppress(TransferEngineError):
            # the READ's own deadline ends it; the extra second is for its answer
            handle.wait(max(0.0, recv.deadline - time.monotonic()) + 1.0)
        if handle.cancel():
            log.error("request %s: KV read cancelled after %.1f s",
                      recv.spec.request_id, time.monotonic() - recv.started)

    def _await_part(self, recv: Recv, handle: TransferHandle) -> None:
        """The forward needs a later READ of a layer-wise load: waits for it (counted
        as this step's wait), cancelling it past the load's deadline."""
        if handle.done():
            return
        began = time.monotonic()
        self._settle(recv, handle)
        recv.landed = time.monotonic()
        self._step_wait += recv.landed - began

    def _account(self, recv: Recv) -> bool:
        """A sync load is over: its blocks are marked for vLLM to recompute unless
        every READ of it landed in time. Returns whether they did."""
        if self._loaded(recv):
            return True
        self.stats["recv_failed"] += 1
        self._failed_blocks.update(recv.spec.local_block_ids)
        return False

    # prefill: pushes
    def start_push(self, specs: Iterable[PushSpec]) -> None:
        """Places each of this step's whole prefills in our lane at decode, to push to."""
        if self._push is not None:
            self._push.start(list(specs))

    def layer_saved(self, name: str) -> None:
        """The forward has computed layer ``name``: it goes to pushes' rooms."""
        if self._push is not None:
            self._push.layer_done(name)

    def start_step(self) -> None:
        """A step's metadata is bound: its forward's layer waits are counted afresh."""
        self._waited.clear()

    def wait_for_layer(self, name: str) -> None:
        """The forward is about to compute layer ``name``: its bytes must be here."""
        if self._groups is None:
            self._waited.setdefault(name, None)
        for handle, recv in self._layer_waits.pop(name, ()):
            self._await_part(recv, handle)

    def finish_layered(self) -> None:
        """After the forward: waits for every layer-wise load still landing (a layer
        vLLM did not wait for included), marks the failed ones' blocks, tells prefill
        the good ones were read; and learns the layer order from a forward that waited
        for every layer. Idempotent: vLLM may call it twice a step."""
        if self._groups is None and self._layers and all(
                name in self._waited for name in self._layers):
            self._groups = [tuple(g) for g in layer_groups(
                [name for name in self._waited if name in self._layers])]
            log.info("KV loads go layer by layer, in the forward's order")
        self._layer_waits.clear()
        if self._push is not None:
            self._push.forward_done()
        layered, self._layered = self._layered, []
        for recv in layered:
            for part in recv.parts:
                self._await_part(recv, part)
            if self._account(recv):
                self._notify_read(recv)
        if self._step_wait:
            with self._lock:
                self._times["load_wait_seconds"].append(self._step_wait)
            self._step_wait = 0.0

    def _tell(self, peer: Peer, segment: str, payload: bytes) -> TransferHandle:
        """Sends ``payload`` to ``peer``: the notification of a READ of one byte of its
        ``segment`` into our scratch bytes (several threads tell); not waited for."""
        assert self.engine is not None
        with self._lock:
            if self._scratch is None:
                self._scratch = self.engine.register(np.zeros(64, dtype=np.uint8),
                                                     name="te-vllm/scratch")
        return self.engine.read(peer, [(Descriptor(self._scratch, 0, 1),
                                        Descriptor(peer.segment(segment), 0, 1))],
                                notify=payload)

    def _notify_read(self, recv: Recv) -> None:
        """Tells prefill that a load's blocks were read (a READ's own note did not)."""
        assert self.engine is not None
        info = self._peers.get(self._source(recv.spec))
        if info is None:
            return  # the peer is gone: prefill's lease frees the blocks
        try:
            self._tell(info.peer, MANIFEST_SEGMENT, sent_note(
                recv.spec.remote_request_id, *recv.spec.reader(self.rank)))
        except TransferEngineError as exc:
            log.warning("request %s: could not tell %s its blocks were read (%s); its "
                        "lease frees them", recv.spec.request_id, info.peer.name, exc)

    def _begin(self, spec: RecvSpec, timeout: float | None = None,
               deadline: float | None = None) -> Recv:
        """Checks a load and starts its READ (``timeout``: the READ's deadline), or its
        peer's handshake first; a load that cannot start has failed. A sync load
        (``deadline`` given) may go layer by layer."""
        recv = Recv(spec, None, time.monotonic(), deadline=deadline or 0.0)
        self.stats["recv_requests"] += 1
        try:
            if not spec.local_block_ids:
                raise ProtocolError("no blocks to load")
            if len(spec.local_block_ids) != len(spec.remote_block_ids):
                raise ProtocolError("local and remote block counts differ")
            where = self._source(spec)
            if self._push is not None and self._push.take(spec, where):
                recv.pushed = True
                self._notify_read(recv)
                return recv
            info = self._peers.get(where)
            if info is None:
                assert self.engine is not None
                recv.handshake = self._peers.handshake(self.engine, where, self._layers,
                                                       self.compat, self.config.timeout_s,
                                                       self.placement)
            else:
                self._issue(recv, info, timeout)
        except (TransferEngineError, KeyError, ValueError) as exc:
            self._fail(recv, exc)
        return recv

    def _loaded(self, recv: Recv) -> bool:
        """Whether the request's READ ended well inside the prefill's lease (counted
        in the stats); logs why not."""
        if recv.error is not None:  # logged when it failed
            return False
        if recv.pushed:
            self._times["load_seconds"].append(time.monotonic() - recv.started)
            return True
        handle = recv.handle
        failed = next((h for h in recv.parts if h.state is not TransferState.DONE), None)
        if failed is not None:
            log.error("request %s: KV read failed: %s", recv.spec.request_id,
                      failed.error or "cancelled")
        elif handle is not None and handle.state is TransferState.DONE:
            if self._wall() < recv.spec.lease_expiry:
                self.stats["recv_bytes"] += handle.nbytes + sum(h.nbytes for h in recv.parts)
                took = (recv.landed or time.monotonic()) - recv.started
                self.stats["recv_seconds"].append(took)
                self._times["load_seconds"].append(took)
                return True
            # not shown to have finished inside the lease: the bytes may be another
            # request's
            log.error("request %s: KV read finished after the prefill engine's lease "
                      "ran out; recomputing", recv.spec.request_id)
        elif handle is not None:
            log.error("request %s: KV read failed: %s", recv.spec.request_id, handle.error)
        return False

    def _issue(self, recv: Recv, info: RemoteKV | MergedKV,
               timeout: float | None = None) -> None:
        assert self.engine is not None
        spec = recv.spec
        if self._wall() >= spec.lease_expiry:
            self._fail(recv, "the prefill engine's lease on the blocks ran out before the "
                             "read could start; they may hold another request's KV by now")
            return
        info.check_ids(self._layers, spec)
        local, remote = spec.local_block_ids, spec.remote_block_ids
        note = sent_note(spec.remote_request_id, *spec.reader(self.rank))
        if isinstance(info, MergedKV):  # our heads from several prefill ranks, whole
            recv.handle = info.read(self.engine, self._layers, local, remote, note, timeout)
            return
        groups = self._groups
        if not (recv.deadline and groups and len(groups) > 1 and len(local) > 1):
            recv.handle = self.engine.read(info.peer, info.pairs(self._layers, local, remote),
                                           notify=note, timeout=timeout)
            return
        # Layer by layer: first the last block of every layer (this step's forward
        # writes its new tokens' KV there when the block is partial, before it waits for
        # a layer) and the first layer's other blocks, waited for before the forward;
        # then (:meth:`_issue_rest`) a READ per later group, each waited for by its first
        # layer. Prefill hears that the blocks were read once all have landed
        # (:meth:`finish_layered`).
        recv.info = info
        recv.handle = self.engine.read(
            info.peer, info.pairs(self._layers, local[-1:], remote[-1:])
            + info.pairs(self._layers, local[:-1], remote[:-1], groups[0]),
            timeout=timeout)

    def _issue_rest(self, recv: Recv) -> bool:
        """The later groups' READs of a layer-wise load whose first READ landed: posted
        only then, as posting them with it held its bytes back (measured on a busy
        one-core decoder: 2 MiB landed in 3.5-6 ms instead of 1.4)."""
        assert self.engine is not None and recv.info is not None and self._groups
        local, remote = recv.spec.local_block_ids[:-1], recv.spec.remote_block_ids[:-1]
        try:
            for names in self._groups[1:]:
                handle = self.engine.read(
                    recv.info.peer, recv.info.pairs(self._layers, local, remote, names),
                    timeout=max(0.001, recv.deadline - time.monotonic()))
                recv.parts.append(handle)
                self._layer_waits.setdefault(names[0], []).append((handle, recv))
        except TransferEngineError as exc:
            self._fail(recv, exc)
            return False
        return True

    def _source(self, spec: RecvSpec) -> str:
        """Where this rank loads ``spec`` from (a latent cache held whole on every
        prefill rank: from one of them)."""
        return spec.endpoint_for(self.rank, merge=not self.placement.replicated)

    def _fail(self, recv: Recv, why: BaseException | str) -> None:
        recv.error = str(why)
        if isinstance(why, ConnectError | PeerLostError | TransferTimeout | ClosedError):
            self._peers.forget(self._source(recv.spec))
        log.error("request %s: KV load from %s failed: %s", recv.spec.request_id,
                  self._source(recv.spec), why)

    def _after_handshake(self, recv: Recv, fut: Future[Any],
                         timeout: float | None = None) -> None:
        recv.handshake = None
        try:
            where = self._source(recv.spec)
            self._issue(recv, self._peers.settled(where, fut), timeout)
        # Whatever broke the handshake (a refused peer, a timeout, the engine closing
        # under it), the request must come back as a load error, not end the engine.
        except Exception as exc:  # noqa: BLE001
            self._fail(recv, exc)

    # store mode
    @property
    def store(self) -> StoreIO | None:
        """The store link in store mode, else None."""
        return self._store.io

    def start_store_loads(self, specs: Iterable[StoreLoad]) -> None:
        """Queues each request's read from the store; :meth:`results` reports it."""
        self._store.start_loads(specs)

    def start_store_saves(self, specs: Iterable[StoreSave]) -> None:
        """Queues each finished request's put; vLLM frees its blocks once it is done
        (:meth:`results` reports it as sent, whether the put worked or not)."""
        self._store.start_saves(specs)

    # prefill: holds
    def hold(self, reqs: dict[str, float]) -> None:
        self._holds.hold(reqs)

    def _on_notify(self, note: Any) -> None:
        fields = parse_push(note.payload) if self._push is not None else None
        if fields is not None:
            assert self._push is not None
            self._push.on_note(note.peer, fields)
            return
        self._holds.heard(note.payload)

    @property
    def held(self) -> int:
        """Requests whose blocks are held: for a decoder's read or a store save."""
        return len(self._holds.held | self._store.saving())

    def results(self) -> KVConnectorTransferResults:
        self.finish_layered()
        out = KVConnectorTransferResults()
        saved: set[str] = set()
        if self._store.busy:
            stored = self._store.results()
            out.finished_recving |= stored.loaded
            out.failed_recving |= stored.failed
            self._failed_blocks |= stored.failed_blocks
            saved = stored.saved
        saving = self._store.saving()
        released = self._holds.released()
        # a request's blocks are free once nothing holds them: neither a decoder's lease
        # nor a save still reading them
        out.finished_sending |= released - saving
        if saved:  # (the held set is copied under the lock: not at every step)
            out.finished_sending |= saved - self._holds.held
        if self._recving or self._store.loading:
            # vLLM calls this once per step from a thread that hardly lets go of the
            # GIL while a request waits for its KV; without this the transfer threads
            # wait for the interpreter's 5 ms switch interval at every hand-over
            # (measured: 6 ms per load, 1.4 ms with it).
            time.sleep(0)
        for recv in list(self._recving.values()):
            fut = recv.handshake
            if fut is not None and fut.done():
                self._after_handshake(recv, fut)
        for rid, recv in list(self._recving.items()):
            handle = recv.handle
            if recv.handshake is not None or (handle is not None
                                              and handle.state is TransferState.PENDING):
                continue
            del self._recving[rid]
            out.finished_recving.add(rid)
            if self._loaded(recv):
                continue
            self.stats["recv_failed"] += 1
            out.failed_recving.add(rid)
            self._failed_blocks.update(recv.spec.local_block_ids)
        return out

    def interval_stats(self) -> dict[str, Any] | None:
        """What happened since the last call, as :class:`~.stats.TEConnectorStats`
        data (vLLM asks once per step), or None when nothing did."""
        with self._lock:
            return interval(self.stats, self._reported, self._times)

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def close(self) -> None:
        """Closes the engine (in-flight reads and handshakes fail) and waits for the
        handshake threads; forgets every request."""
        engine, self.engine = self.engine, None
        self._store.close()
        client, self._store_client = self._store_client, None
        if client is not None:
            client.close()
        self._peers.close(engine.close if engine is not None else lambda: None)
        _WORKERS.discard(self)

    def __repr__(self) -> str:
        return (f"<TEConnectorWorker {self.engine_name!r} layers={len(self._layers)} "
                f"recving={len(self._recving)} handshakes={len(self._peers)} "
                f"held={len(self._holds.held)}>")

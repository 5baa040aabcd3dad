"""vLLM KV connector (``KVConnectorBase_V1``) moving paged KV blocks over our engine.

Mount it on both engines of a prefill/decode pair::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TransferEngineConnector",
        "kv_connector_module_path": "transfer_engine.connectors.vllm",
        "kv_role": "kv_producer",            # "kv_consumer" on decode, or "kv_both"
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host": "10.0.0.5", "port": 0, "lease_s": 30}}'

This module is the only one in the project that imports vLLM.

Protocol (a pull design: decode READs the prefill engine's blocks, one-sided)
-----------------------------------------------------------------------------
Who calls what, in which order (S = scheduler side, W = worker side)::

    prefill W  register_kv_caches    registers each layer tensor once (one segment per
                                     layer, block addresses from the tensor's strides)
                                     and a small manifest segment: protocol version,
                                     compatibility hash (model, dtype, block size,
                                     layout) and every layer's block layout
    prefill W  get_handshake_metadata -> endpoint, engine name, version, hash
    prefill S  set_xfer_handshake_metadata   learns the worker's endpoint
    proxy      request to prefill with kv_transfer_params={"do_remote_decode": True},
               max_tokens=1
    prefill S  request_finished      holds the request's blocks (returns True) and
                                     answers kv_transfer_params: remote_endpoint,
                                     remote_engine_id, remote_request_id,
                                     remote_block_ids, remote_num_tokens, lease_expiry
                                     (wall clock, seconds since the epoch),
                                     protocol_version
    prefill S  build_connector_meta  tells its worker: hold these for lease_s seconds
    proxy      request to decode with those kv_transfer_params
    decode S   get_num_new_matched_tokens -> (prompt tokens not cached locally, async)
               (refuses, with one log line, params that fail parse_remote_params: a
               wrong type or range, blocks that do not cover exactly remote_num_tokens,
               another prompt's params (prompt_hash), an expired lease or another
               protocol version: 0 tokens, vLLM computes the prompt itself)
    decode S   update_state_after_alloc   pairs remote blocks with the blocks vLLM
                                          allocated; build_connector_meta ships them
    decode W   start_load_kv         one READ of every layer's blocks, coalescing runs
                                     of consecutive blocks, with a notification; the
                                     first load from a peer first connects and reads
                                     and checks the peer's manifest (a mismatch is
                                     refused with a message naming what differs) on a
                                     background thread, so a slow or dead peer never
                                     stalls the forward pass: the READ is issued by a
                                     later step once the handshake is done
    prefill W  (notification)        the blocks were read: report finished_sending,
                                     vLLM frees them; or the lease ran out: the same
    decode W   get_transfer_results  finished_recving; a failed READ is also in
                                     failed_recving and its blocks in
                                     get_block_ids_with_load_errors, so vLLM
                                     recomputes (policy "recompute") instead of reading
                                     garbage

Layer-by-layer overlap: in the proxy flow the decode engine learns the block ids only
after prefill finished, so there is no prefill compute left to overlap with; the
transfer is one READ of all layers, issued in layer order (``save_kv_layer`` and
``wait_for_layer_load`` are no-ops). A push variant (decode allocates first, prefill
writes each layer after its attention) needs the proxy to contact decode first.

Deadlines: the lease is enforced by the prefill worker with its own monotonic clock
(``lease_s`` from the scheduler's metadata), counted from a moment no earlier than the
one ``lease_expiry`` in kv_transfer_params (wall-clock time) is counted from. Decode
trusts the blocks only while that time has not passed: it does not load an expired
lease, does not start a READ after it, and reports a READ it saw finish only after it
as failed (the prefill engine may have given the blocks to another request by then;
vLLM recomputes). Across hosts, lease_s must cover the clock skew.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from transfer_engine.connectors.compat import compat_hash, describe_mismatch
from transfer_engine.descriptor import Blocks, Descriptor
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
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["TransferEngineConnector", "TEConnectorScheduler", "TEConnectorWorker",
           "TEConnectorConfig", "TEConnectorMetadata", "TEHandshakeMetadata", "RecvSpec",
           "BlockLayout", "block_layout", "PROTOCOL_VERSION", "live_workers",
           "RemoteParams", "parse_remote_params", "prompt_hash"]

log = logging.getLogger(__name__)

# Protocol versions (kv_transfer_params and the manifest):
#   1: pull over Engine.read; manifest segment "te-vllm/manifest"; lease in params.
#   2: params carry prompt_hash, and decode checks every field (parse_remote_params).
PROTOCOL_VERSION = 2
MANIFEST_SEGMENT = "te-vllm/manifest"
_SENT_PREFIX = b"te-vllm/sent:"  # notification: the reader has every byte of a request

_WORKERS: weakref.WeakSet[TEConnectorWorker] = weakref.WeakSet()


def live_workers() -> list[TEConnectorWorker]:
    """The worker-side connectors alive in this process (tests read their counters)."""
    return list(_WORKERS)


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def _unpin_current_thread() -> None:
    """Lets the calling thread run on every CPU (the kernel keeps it within the
    process's cpuset)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, _all_cpus())


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Threads started inside run on every CPU, not on the one core vLLM's CPU worker
    pins its compute thread to. A new thread inherits its creator's CPUs, so without
    this the engine's transfer and control threads would share that core with vLLM's
    busy-polling main loop (and, on one host, with the other engine's): they then
    starve for seconds. The calling thread gets its own CPUs back on exit."""
    try:
        pinned = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux: nothing is pinned this way
        yield
        return
    if pinned >= _all_cpus():
        yield
        return
    _unpin_current_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, pinned)


# --- configuration ------------------------------------------------------------------


@dataclass(frozen=True)
class TEConnectorConfig:
    """``kv_connector_extra_config`` of the connector.

    :param host: address the worker's engine listens on and peers reach it by.
    :param port: control port of the worker's engine (0: a free one; with tensor
        parallelism, rank r uses ``port + r`` when ``port`` is set).
    :param transports: transport names, best first (``None``: the engine's default).
    :param lease_s: seconds prefill holds a finished request's blocks for decode.
    :param timeout_s: seconds for handshakes (connect, manifest read).
    """

    host: str = "127.0.0.1"
    port: int = 0
    transports: tuple[str, ...] | None = None
    lease_s: float = 30.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.lease_s <= 0 or self.timeout_s <= 0:
            raise ValueError("lease_s and timeout_s must be positive")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> TEConnectorConfig:
        known = {"host", "port", "transports", "lease_s", "timeout_s"}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        transports = extra.get("transports")
        if isinstance(transports, str):
            transports = [t.strip() for t in transports.split(",") if t.strip()]
        return cls(host=str(extra.get("host", cls.host)), port=int(extra.get("port", 0)),
                   transports=tuple(transports) if transports else None,
                   lease_s=float(extra.get("lease_s", cls.lease_s)),
                   timeout_s=float(extra.get("timeout_s", cls.timeout_s)))


# --- block layout from strides ------------------------------------------------------


@dataclass(frozen=True)
class BlockLayout:
    """Where block ``b`` of one layer tensor lies, in bytes from the tensor's start:
    ``part_offsets[i] + b * block_stride`` for ``part_len`` bytes, for each part i (K
    and V are two parts in vLLM's GPU layout, one part in block-major layouts)."""

    block_stride: int
    part_offsets: tuple[int, ...]
    part_len: int
    extent: int  # bytes from the first to one past the last byte of the tensor
    signature: str  # what must match between peers (shape without the block count)

    @property
    def contiguous_blocks(self) -> bool:
        """Whether consecutive blocks of a part are adjacent (runs coalesce)."""
        return self.part_len == self.block_stride

    def spans(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        return [(off + b * self.block_stride, self.part_len)
                for off in self.part_offsets for b in blocks]

    def to_wire(self) -> list[Any]:
        return [self.block_stride, list(self.part_offsets), self.part_len, self.extent,
                self.signature]

    @classmethod
    def from_wire(cls, data: list[Any]) -> BlockLayout:
        stride, offsets, part_len, extent, signature = data
        return cls(int(stride), tuple(int(o) for o in offsets), int(part_len), int(extent),
                   str(signature))


def block_layout(shape: Sequence[int], strides: Sequence[int], itemsize: int,
                 num_blocks: int, dtype: str = "") -> BlockLayout:
    """The block layout of a KV tensor of ``shape``/``strides`` (in elements) holding
    ``num_blocks`` blocks, derived from the strides alone.

    The block dimension is the one of size ``num_blocks`` (when a leading dimension of
    size 2 is K/V and ``num_blocks`` is 2 too, the later one). Dimensions with a larger
    stride give parts (K and V); smaller ones are the block's interior.
    """
    if len(shape) != len(strides):
        raise ValueError("shape and strides differ in length")
    if any(s < 0 for s in strides):
        raise ValueError(f"negative strides {tuple(strides)} are not supported")
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise ValueError(f"no dimension of {tuple(shape)} has {num_blocks} blocks")
    bd = candidates[-1] if len(candidates) > 1 and shape[0] == 2 else candidates[0]
    bstride = strides[bd]
    inner = [d for d in range(len(shape)) if d != bd and shape[d] > 1
             and strides[d] < bstride]
    outer = [d for d in range(len(shape)) if d != bd and shape[d] > 1
             and strides[d] >= bstride]
    interior = 1 + sum((shape[d] - 1) * strides[d] for d in inner)
    if interior > bstride and num_blocks > 1:
        raise ValueError(f"blocks overlap: interior {interior} > block stride {bstride}")
    offsets = [0]
    for d in outer:
        offsets = [o + i * strides[d] for o in offsets for i in range(shape[d])]
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    sig_shape = ["B" if d == bd else str(n) for d, n in enumerate(shape)]
    signature = f"{dtype}[{','.join(sig_shape)}]parts={len(offsets)}"
    return BlockLayout(bstride * itemsize, tuple(sorted(o * itemsize for o in offsets)),
                       interior * itemsize, extent * itemsize, signature)


def coalesce(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs ``(local start, remote start, count)`` where both block lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if runs:
            ls, rs, n = runs[-1]
            if lb == ls + n and rb == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


# --- metadata passed between the roles ----------------------------------------------


@dataclass
class RecvSpec:
    """Decode side: load ``remote_block_ids`` of the peer into ``local_block_ids``."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_endpoint: str
    remote_engine_id: str
    remote_request_id: str
    lease_expiry: float = math.inf  # wall clock: the blocks are the peer's after this


@dataclass
class TEConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, float] = field(default_factory=dict)  # req id -> lease (s)


@dataclass
class TEHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> its scheduler: where peers reach this worker."""

    endpoint: str
    engine_name: str
    protocol_version: int
    compat_hash: str


# --- kv_transfer_params: what decode accepts ------------------------------------------

MAX_ID_CHARS = 512  # endpoint, engine and request ids
MAX_BLOCK_ID = (1 << 31) - 1
MAX_LEASE_S = 24 * 3600.0  # a lease further out than this is not one prefill gave


@dataclass(frozen=True)
class RemoteParams:
    """kv_transfer_params as decode checked them: every field typed and in range, the
    blocks covering exactly ``num_tokens``, bound to this request's prompt."""

    endpoint: str
    engine_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    lease_expiry: float


def prompt_hash(prompt: Sequence[int], num_tokens: int) -> str:
    """What binds kv_transfer_params to the prompt whose KV they describe."""
    tokens = np.asarray(list(prompt[:num_tokens]), dtype=np.int64)
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:32]


def _text(params: dict[str, Any], key: str, required: bool = True) -> str:
    value = params.get(key, None if required else "")
    if not isinstance(value, str) or (required and not value) or len(value) > MAX_ID_CHARS:
        raise ValueError(f"{key} must be a non-empty string of at most {MAX_ID_CHARS} "
                         f"characters, got {type(value).__name__}")
    return value


def _integer(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def parse_remote_params(params: Any, prompt: Sequence[int], block_size: int, now: float
                        ) -> RemoteParams:
    """Checks kv_transfer_params from a client (they reach decode through the proxy,
    or from anyone who can send a request); raises ValueError saying what is wrong."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params is not a map")
    version = params.get("protocol_version")
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ValueError(f"kv_transfer_params protocol version {version!r:.20}, this "
                         f"connector speaks {PROTOCOL_VERSION}")
    endpoint = _text(params, "remote_endpoint")
    if not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://"):]:
        raise ValueError(f"remote_endpoint {endpoint!r:.80} is not tcp://host:port")
    engine_id = _text(params, "remote_engine_id", required=False)
    request_id = _text(params, "remote_request_id")
    num_tokens = _integer(params.get("remote_num_tokens"), "remote_num_tokens", 1,
                          max(1, len(prompt)))
    if num_tokens > len(prompt):
        raise ValueError(f"remote_num_tokens {num_tokens} exceeds the prompt's "
                         f"{len(prompt)} tokens")
    ids = params.get("remote_block_ids")
    needed = -(-num_tokens // block_size)
    if not isinstance(ids, list) or len(ids) != needed:
        raise ValueError(f"remote_block_ids must list exactly {needed} blocks for "
                         f"{num_tokens} tokens of {block_size}, got "
                         f"{len(ids) if isinstance(ids, list) else type(ids).__name__}")
    block_ids = [_integer(b, "a remote block id", 0, MAX_BLOCK_ID) for b in ids]
    lease = params.get("lease_expiry")
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not math.isfinite(
            lease):
        raise ValueError(f"lease_expiry must be a finite number, got {lease!r:.40}")
    if lease <= now:
        raise ValueError("the prefill engine's lease on the blocks has expired")
    if lease > now + MAX_LEASE_S:
        raise ValueError(f"lease_expiry is {lease - now:.0f} s away, more than any lease")
    if params.get("prompt_hash") != prompt_hash(prompt, num_tokens):
        raise ValueError("kv_transfer_params belong to another prompt (prompt_hash differs)")
    return RemoteParams(endpoint, engine_id, request_id, block_ids, num_tokens, float(lease))


# --- scheduler side -----------------------------------------------------------------


class TEConnectorScheduler:
    """Scheduler-side logic; holds no memory and does no I/O.

    :param engine_id: vLLM's engine id (kv_transfer_params name it to peers).
    :param block_size: tokens per KV block.
    :param lease_s: seconds a finished request's blocks are held for the decoder.
    :param endpoint: this engine's worker endpoint, if known before the handshake
        metadata arrives.
    :param wall_clock: ``time.time``-like clock for lease expiry in kv_transfer_params.
    """

    def __init__(self, engine_id: str, block_size: int, lease_s: float = 30.0,
                 endpoint: str | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.lease_s = lease_s
        self.endpoint = endpoint
        self._wall = wall_clock
        self._recv: dict[str, RecvSpec] = {}
        self._send: dict[str, float] = {}
        self._parsed: dict[str, RemoteParams] = {}  # matched, waiting for allocation
        self.refused: dict[str, str] = {}  # request id -> why a load was refused

    def set_handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        meta = metadata.get(0)
        if isinstance(meta, TEHandshakeMetadata):
            self.endpoint = meta.endpoint

    def _usable(self, request: Request, params: dict[str, Any]) -> RemoteParams | None:
        rid = request.request_id
        try:
            parsed = parse_remote_params(params, request.prompt_token_ids or (),
                                         self.block_size, self._wall())
        except ValueError as exc:
            self.refused[rid] = str(exc)
            log.warning("request %s: not loading remote KV: %s; computing locally", rid,
                        exc)
            return None
        return parsed

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return 0, False
        parsed = self._usable(request, params)
        if parsed is None:
            params["do_remote_prefill"] = False
            return 0, False
        self._parsed[request.request_id] = parsed
        count = parsed.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # a preempted request recomputes
        parsed = self._parsed.pop(request.request_id, None)
        if num_external_tokens <= 0 or parsed is None:
            return
        group = blocks.blocks[0]
        cached = sum(1 for b in group if b.block_hash is not None)
        remote = parsed.block_ids
        end = min(len(remote), len(group))
        self._recv[request.request_id] = RecvSpec(
            request.request_id, [b.block_id for b in group[cached:end]], remote[cached:end],
            parsed.endpoint, parsed.engine_id, parsed.request_id, parsed.lease_expiry)

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None
                             ) -> TEConnectorMetadata:
        meta = TEConnectorMetadata(self._recv, self._send)
        self._recv, self._send = {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing to hand over
        if not block_ids or self.endpoint is None:
            return False, None
        prompt = request.prompt_token_ids or ()
        num_tokens = min(int(request.num_computed_tokens), len(prompt))
        needed = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or len(block_ids) < needed:
            return False, None
        self._send[request.request_id] = self.lease_s
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "protocol_version": PROTOCOL_VERSION,
            "remote_endpoint": self.endpoint, "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": [int(b) for b in block_ids[:needed]],
            "remote_num_tokens": num_tokens,
            "prompt_hash": prompt_hash(prompt, num_tokens),
            "lease_expiry": self._wall() + self.lease_s,
        }


# --- worker side --------------------------------------------------------------------


@dataclass(eq=False)
class _Recv:
    spec: RecvSpec
    handle: TransferHandle | None
    started: float
    error: str | None = None
    handshake: Future[_RemoteInfo] | None = None  # the peer's, while it is under way


@dataclass(eq=False)
class _RemoteInfo:
    peer: Peer
    layouts: dict[str, tuple[str, BlockLayout]]  # layer -> (segment name, layout)


class TEConnectorWorker:
    """Worker-side logic: owns the engine and the registered KV memory.

    :param engine_name: unique engine name among peers.
    :param config: the connector's configuration.
    :param compat: factors that must match between peers (model, dtype, block size...);
        the layer layouts are added by :meth:`register_kv_caches`.
    :param clock: monotonic clock for leases held here (tests pass a fake one).
    :param wall_clock: ``time.time``-like clock the peers' lease expiries are read by.
    """

    def __init__(self, engine_name: str, config: TEConnectorConfig,
                 compat: dict[str, Any], clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.engine_name = engine_name
        self.config = config
        self.compat = dict(compat)
        self._clock = clock
        self._wall = wall_clock
        self.engine: Engine | None = None
        self._layers: dict[str, tuple[Segment, BlockLayout]] = {}
        self._tensors: list[Any] = []
        self._manifest = b""
        self._peers: dict[str, _RemoteInfo] = {}
        self._handshakes: dict[str, Future[_RemoteInfo]] = {}  # endpoint -> under way
        self._executor: ThreadPoolExecutor | None = None
        self._recving: dict[str, _Recv] = {}
        self._sending: dict[str, float] = {}  # request id -> lease deadline
        self._sent_early: set[str] = set()  # notified before its metadata arrived
        self._failed_blocks: set[int] = set()
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = {"recv_requests": 0, "recv_failed": 0,
                                      "recv_bytes": 0,
                                      "recv_seconds": deque(maxlen=1024),  # latest
                                      "sent_requests": 0, "lease_expired": 0}
        _WORKERS.add(self)

    # set-up
    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Registers every layer tensor once and publishes the manifest."""
        if self.engine is None:
            with _unpinned():  # the engine's threads start here
                self.engine = Engine(self.engine_name, host=self.config.host,
                                     port=self.config.port,
                                     transports=self.config.transports,
                                     timeout=self.config.timeout_s)
        seen: dict[int, Segment] = {}
        layouts = {}
        for name, tensor in kv_caches.items():
            layout = block_layout(tuple(tensor.shape), tuple(tensor.stride()),
                                  tensor.element_size(), num_blocks, str(tensor.dtype))
            address = int(tensor.data_ptr())
            seg = seen.get(address)
            if seg is None or seg.length < layout.extent:
                seg = self.engine.register((address, layout.extent), name=f"kv/{name}")
                seen[address] = seg
            self._tensors.append(tensor)  # alive while registered
            self._layers[name] = (seg, layout)
            layouts[name] = layout.to_wire()
            log.info("layer %s: shape %s strides %s -> %s", name, tuple(tensor.shape),
                     tuple(tensor.stride()), layout)
        self.compat["layouts"] = sorted({v[4] for v in layouts.values()})
        self.compat["num_layers"] = len(layouts)
        manifest = {"version": PROTOCOL_VERSION, "compat": self.compat,
                    "hash": compat_hash(self.compat),
                    "layers": {n: [self._layers[n][0].name, lw] for n, lw in layouts.items()}}
        self._manifest = bytes(msgpack.packb(manifest))
        self._manifest_buf = np.frombuffer(bytearray(self._manifest), dtype=np.uint8)
        self.engine.register(self._manifest_buf, name=MANIFEST_SEGMENT)
        self.engine.on_notify(self._on_notify)

    @property
    def hash(self) -> str:
        return compat_hash(self.compat)

    def handshake_metadata(self) -> TEHandshakeMetadata:
        assert self.engine is not None, "register_kv_caches first"
        return TEHandshakeMetadata(self.engine.endpoint, self.engine.name, PROTOCOL_VERSION,
                                   self.hash)

    # decode: loads
    def _connect_peer(self, engine: Engine, endpoint: str) -> _RemoteInfo:
        """Connects to the peer and checks its manifest (on the handshake thread; it
        touches no state of this worker but the engine, which is thread-safe)."""
        peer = engine.connect(endpoint, timeout=self.config.timeout_s)
        mseg = peer.segment(MANIFEST_SEGMENT)
        buf = np.zeros(mseg.length, dtype=np.uint8)
        with engine.register(buf, name=f"te-vllm/manifest-in/{id(buf):x}") as local:
            engine.read(peer, [(Descriptor(local, 0, mseg.length),
                                Descriptor(mseg, 0, mseg.length))]
                        ).wait(self.config.timeout_s)
        try:
            manifest = msgpack.unpackb(buf.tobytes())
            version, theirs = manifest["version"], manifest["compat"]
            layers = {n: (str(v[0]), BlockLayout.from_wire(v[1]))
                      for n, v in manifest["layers"].items()}
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"malformed KV manifest: {exc}", peer=peer.name) from exc
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"peer speaks KV connector protocol {version}, we speak "
                                f"{PROTOCOL_VERSION}; upgrade one side", peer=peer.name)
        if manifest.get("hash") != self.hash:
            raise ProtocolError("incompatible KV caches, refusing to transfer: "
                                + describe_mismatch(self.compat, theirs), peer=peer.name)
        for name, (seg_name, _) in layers.items():
            if name not in self._layers:
                raise ProtocolError(f"peer has layer {name!r}, we do not", peer=peer.name)
            peer.segment(seg_name)  # known now, so building a READ asks nothing
        return _RemoteInfo(peer, layers)

    def _handshake(self, endpoint: str) -> Future[_RemoteInfo]:
        fut = self._handshakes.get(endpoint)
        if fut is None:
            assert self.engine is not None
            if self._executor is None:
                # unpinned, and so are the rails' threads a handshake starts
                self._executor = ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix=f"te-vllm-handshake-{self.engine_name}",
                    initializer=_unpin_current_thread)
            fut = self._executor.submit(self._connect_peer, self.engine, endpoint)
            self._handshakes[endpoint] = fut
        return fut

    def _pairs(self, info: _RemoteInfo, spec: RecvSpec) -> list[Blocks]:
        """The READ of a request's blocks: one :class:`Blocks` per layer and part (K, V),
        whole runs of blocks adjacent on both sides merged where the layouts allow."""
        peer = info.peer
        out = []
        for name, (_, layout) in self._layers.items():  # Python ints: nothing wraps
            rname, rlayout = info.layouts[name]
            for ids, lay, side in ((spec.local_block_ids, layout, "local"),
                                   (spec.remote_block_ids, rlayout, "remote")):
                top = max(lay.part_offsets) + lay.part_len
                if min(ids) < 0 or max(ids) * lay.block_stride + top > lay.extent:
                    raise ProtocolError(f"a {side} block id of {min(ids)}..{max(ids)} lies "
                                        f"outside layer {name!r}", peer=peer.name)
        runs = np.array(coalesce(spec.local_block_ids, spec.remote_block_ids),
                        dtype=np.int64).reshape(-1, 3)
        single = (np.asarray(spec.local_block_ids, dtype=np.int64),
                  np.asarray(spec.remote_block_ids, dtype=np.int64))
        count: np.ndarray | int
        for name, (seg, layout) in self._layers.items():
            rname, rlayout = info.layouts[name]
            rseg = peer.segment(rname)
            if layout.contiguous_blocks and rlayout.contiguous_blocks:
                lb, rb, count = runs[:, 0], runs[:, 1], runs[:, 2] * layout.part_len
            else:
                (lb, rb), count = single, layout.part_len
            for loff, roff in zip(layout.part_offsets, rlayout.part_offsets, strict=True):
                out.append(Blocks(seg, rseg, loff + lb * layout.block_stride,
                                  roff + rb * rlayout.block_stride, count))
        return out

    def start_load(self, specs: Iterable[RecvSpec]) -> None:
        """Starts one READ per request, or the peer's handshake first; never waits on
        the network. Failures are reported by :meth:`results`."""
        for spec in specs:
            recv = _Recv(spec, None, self._clock())
            self.stats["recv_requests"] += 1
            self._recving[spec.request_id] = recv
            try:
                if not spec.local_block_ids:
                    raise ProtocolError("no blocks to load")
                if len(spec.local_block_ids) != len(spec.remote_block_ids):
                    raise ProtocolError("local and remote block counts differ")
                info = self._peers.get(spec.remote_endpoint)
                if info is None:
                    recv.handshake = self._handshake(spec.remote_endpoint)
                else:
                    self._issue(recv, info)
            except (TransferEngineError, KeyError, ValueError) as exc:
                self._fail(recv, exc)

    def _issue(self, recv: _Recv, info: _RemoteInfo) -> None:
        assert self.engine is not None
        spec = recv.spec
        if self._wall() >= spec.lease_expiry:
            self._fail(recv, "the prefill engine's lease on the blocks ran out before the "
                             "read could start; they may hold another request's KV by now")
            return
        recv.handle = self.engine.read(info.peer, self._pairs(info, spec),
                                       notify=_SENT_PREFIX + spec.remote_request_id.encode())

    def _fail(self, recv: _Recv, why: BaseException | str) -> None:
        recv.error = str(why)
        if isinstance(why, ConnectError | PeerLostError | TransferTimeout | ClosedError):
            self._peers.pop(recv.spec.remote_endpoint, None)  # connect afresh next time
        log.error("request %s: KV load from %s failed: %s", recv.spec.request_id,
                  recv.spec.remote_endpoint, why)

    def _after_handshake(self, recv: _Recv, fut: Future[_RemoteInfo]) -> None:
        endpoint = recv.spec.remote_endpoint
        recv.handshake = None
        if self._handshakes.get(endpoint) is fut:
            del self._handshakes[endpoint]  # a failed one is tried again by a later load
        try:
            info = fut.result()
            info = self._peers.setdefault(endpoint, info)
            self._issue(recv, info)
        # Whatever broke the handshake (a refused peer, a timeout, the engine closing
        # under it), the request must come back as a load error, not end the engine.
        except Exception as exc:  # noqa: BLE001
            self._fail(recv, exc)

    # prefill: holds
    def hold(self, reqs: dict[str, float]) -> None:
        now = self._clock()
        with self._lock:
            for rid, lease in reqs.items():
                self._sending[rid] = now + lease

    def _on_notify(self, note: Any) -> None:
        payload: bytes = note.payload
        if payload.startswith(_SENT_PREFIX):
            with self._lock:
                self._sent_early.add(payload[len(_SENT_PREFIX):].decode())

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._sending)

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        now = self._clock()
        with self._lock:
            for rid in list(self._sent_early):
                if rid in self._sending:
                    del self._sending[rid]
                    self._sent_early.discard(rid)
                    out.finished_sending.add(rid)
                    self.stats["sent_requests"] += 1
            for rid, deadline in list(self._sending.items()):
                if deadline <= now:
                    del self._sending[rid]
                    out.finished_sending.add(rid)
                    self.stats["lease_expired"] += 1
                    log.warning("request %s: lease ran out before the decoder read its "
                                "blocks; freeing them", rid)
            # notifications for requests never held here (aborted) must not pile up
            if len(self._sent_early) > 4096:
                self._sent_early.clear()
        if self._recving:
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
            if handle is not None and handle.state is TransferState.DONE:
                if self._wall() < recv.spec.lease_expiry:
                    self.stats["recv_bytes"] += handle.nbytes
                    self.stats["recv_seconds"].append(self._clock() - recv.started)
                    continue
                # not shown to have finished inside the lease: the bytes may be another
                # request's
                log.error("request %s: KV read finished after the prefill engine's lease "
                          "ran out; recomputing", rid)
                handle = None
            if handle is not None:
                log.error("request %s: KV read failed: %s", rid, handle.error)
            self.stats["recv_failed"] += 1
            out.failed_recving.add(rid)
            self._failed_blocks.update(recv.spec.local_block_ids)
        return out

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def close(self) -> None:
        """Closes the engine (in-flight reads and handshakes fail) and waits for the
        handshake threads; forgets every request."""
        engine, self.engine = self.engine, None
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._peers.clear()
        self._handshakes.clear()
        if engine is not None:
            engine.close()
        if executor is not None:
            executor.shutdown(wait=True)
        _WORKERS.discard(self)

    def __repr__(self) -> str:
        return (f"<TEConnectorWorker {self.engine_name!r} layers={len(self._layers)} "
                f"recving={len(self._recving)} handshakes={len(self._handshakes)} "
                f"held={len(self._sending)}>")


# --- the connector vLLM instantiates ------------------------------------------------


class TransferEngineConnector(KVConnectorBase_V1):
    """vLLM's entry point: forwards to :class:`TEConnectorScheduler` (SCHEDULER role)
    or :class:`TEConnectorWorker` (WORKER role)."""

    _ids = itertools.count()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.config = TEConnectorConfig.from_extra_config(dict(ktc.kv_connector_extra_config))
        self.engine_id = str(ktc.engine_id)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed KV load fails the request; "
                        "set 'recompute' to recompute it instead",
                        ktc.kv_load_failure_policy)
        block_size = int(vllm_config.cache_config.block_size)
        self._kv_cache_cfg = kv_cache_config
        self.scheduler: TEConnectorScheduler | None = None
        self.worker: TEConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = TEConnectorScheduler(self.engine_id, block_size,
                                                  self.config.lease_s)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            config = self.config
            if config.port:
                config = TEConnectorConfig(config.host, config.port + rank,
                                           config.transports, config.lease_s,
                                           config.timeout_s)
            mc = vllm_config.model_config
            compat = {"model": str(mc.model), "dtype": str(mc.dtype),
                      "block_size": block_size,
                      "tp_size": vllm_config.parallel_config.tensor_parallel_size}
            self.worker = TEConnectorWorker(
                f"vllm-{self.engine_id}-tp{rank}-{next(self._ids)}", config, compat)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        num_blocks = (self._kv_cache_cfg.num_blocks if self._kv_cache_cfg is not None
                      else next(iter(kv_caches.values())).shape[1])
        self.worker.register_kv_caches(kv_caches, int(num_blocks))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake_metadata() if self.worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TEConnectorMetadata)
        if meta.reqs_to_send:
            self.worker.hold(meta.reqs_to_send)
        if meta.reqs_to_recv:
            self.worker.start_load(meta.reqs_to_recv.values())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]
                             ) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.results()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        if self.scheduler is not None:
            self.scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_cfg.kv_cache_groups))) \
            if self._kv_cache_cfg is not None else (0,)


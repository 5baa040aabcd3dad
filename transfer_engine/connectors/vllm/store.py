"""Store mode: the keys of a request's KV blocks in the cluster store, and the worker's
loads and saves of them (``kvstore``: the master says where, our engine moves the bytes
between the registered KV cache and the storage nodes, one-sided).

A block's key names the block and its whole prefix (a chain of hashes): vLLM's own
block hashes where the request has them at this block size (they also cover LoRA,
multimodal inputs and cache salts), otherwise :func:`kvstore.block_hashes` over the
token ids. A block is stored as one value per *piece* (one layer's K or V of one tensor
parallel rank): a piece's key mixes the block's key with its label, which starts with
the worker's compatibility hash (model, dtype, block size, KV heads, layouts) and its
tensor-parallel rank and size, so different models, layouts or splits of the heads
never share a key.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import block_hashes
from kvstore.client import Client, Lookup
from kvstore.errors import StoreError
from transfer_engine.errors import ProtocolError
from transfer_engine.layout import BlockLayout
from transfer_engine.segment import Segment

log = logging.getLogger(__name__)

STORE_SALT = b"te-vllm/store/1"


@dataclass
class StoreLoad:
    """Worker: read blocks ``keys[i]`` from the store into local blocks ``block_ids[i]``."""

    request_id: str
    block_ids: list[int]
    keys: list[int]


@dataclass
class StoreSave:
    """Worker: put local blocks ``block_ids[i]`` under ``keys[i]`` (those not stored)."""

    request_id: str
    block_ids: list[int]
    keys: list[int]


def _key(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def request_block_keys(request: Any, prompt: Sequence[int], block_size: int, count: int,
                       use_vllm_hashes: bool = True) -> list[int]:
    """Keys of the first ``count`` full blocks of ``prompt``: from vLLM's block hashes
    when the request carries them at ``block_size`` granularity, else from the tokens.
    The same request gives the same keys at lookup and at save."""
    if count <= 0:
        return []
    hashes = getattr(request, "block_hashes", None) if use_vllm_hashes else None
    num_tokens = int(getattr(request, "num_tokens", len(prompt)))
    if (hashes and len(hashes) >= count and len(hashes) == num_tokens // block_size
            and all(isinstance(h, bytes) for h in hashes[:count])):
        return [_key(STORE_SALT + b"vllm:" + bytes(h)) for h in hashes[:count]]
    rows = block_hashes(np.asarray(list(prompt[:count * block_size]), dtype=np.int64),
                        block_size, key_bytes=16, salt=STORE_SALT)
    return [int(lo) | int(hi) << 64 for lo, hi in rows.tolist()]


def piece_keys(block_keys: Sequence[int], labels: Sequence[str]) -> list[int]:
    """Keys of every piece of every block, block-major (``labels`` order within)."""
    tags = [lab.encode() for lab in labels]
    out = []
    for key in block_keys:
        raw = key.to_bytes(16, "little")
        out += [_key(raw + b"/" + tag) for tag in tags]
    return out


def stored_prefix(lookup: Lookup, block_keys: Sequence[int], labels: Sequence[str]) -> int:
    """How many leading blocks have every piece stored (one master request)."""
    if not block_keys or not labels:
        return 0
    found = lookup.batch_exists(piece_keys(block_keys, labels)).reshape(
        len(block_keys), len(labels)).all(axis=1)
    miss = np.flatnonzero(~found)
    return int(miss[0]) if miss.size else len(block_keys)


@dataclass(frozen=True)
class _Piece:
    label: str
    segment: Segment
    offset: int  # the part's offset in the layer tensor
    stride: int  # bytes between blocks
    length: int


class StoreIO:
    """The worker's loads and saves: blocking calls, run on the connector's store thread.

    :param client: a store client on the worker's engine.
    :param layers: layer name -> (registered segment, block layout), as registered.
    :param prefix: what every piece label starts with (compatibility hash and rank).
    """

    def __init__(self, client: Client, layers: dict[str, tuple[Segment, BlockLayout]],
                 prefix: str) -> None:
        self.client = client
        self._pieces: list[_Piece] = []
        seen: set[int] = set()
        for name, (seg, layout) in layers.items():
            if seg.id not in seen:
                client.register_buffer(seg)
                seen.add(seg.id)
            for part, off in enumerate(layout.parts):
                self._pieces.append(_Piece(f"{prefix}/{name}/{part}", seg,
                                           layout.segment_offset + off,
                                           layout.block_stride, layout.block_bytes))
        self.labels: tuple[str, ...] = tuple(p.label for p in self._pieces)
        self.block_bytes = sum(p.length for p in self._pieces)

    def _spans(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        addrs, sizes = [], []
        for b in block_ids:
            for p in self._pieces:
                addrs.append(int(p.segment.address) + p.offset + int(b) * p.stride)
                sizes.append(p.length)
        return addrs, sizes

    def load(self, spec: StoreLoad) -> int:
        """Reads every piece of the blocks; raises :class:`StoreError` unless every one
        was stored and whole. Returns the bytes read."""
        keys = piece_keys(spec.keys, self.labels)
        addrs, sizes = self._spans(spec.block_ids)
        got = self.client.get_into_addresses(keys, addrs, sizes)
        short = [i for i, (n, want) in enumerate(zip(got, sizes, strict=True)) if n != want]
        if short:
            raise StoreError(f"{len(short)} of {len(keys)} KV pieces are missing or of "
                             f"another size in the store (first: block "
                             f"{spec.block_ids[short[0] // len(self.labels)]})")
        return sum(sizes)

    def save(self, spec: StoreSave) -> int:
        """Puts the pieces the store does not hold yet; returns the bytes written."""
        keys = piece_keys(spec.keys, self.labels)
        addrs, sizes = self._spans(spec.block_ids)
        missing = np.flatnonzero(~self.client.batch_exists(keys)).tolist()
        if not missing:
            return 0
        self.client.put_from_addresses([keys[i] for i in missing],
                                       [addrs[i] for i in missing],
                                       [sizes[i] for i in missing], if_absent=True)
        return sum(sizes[i] for i in missing)


@dataclass
class StoreResults:
    """What :meth:`StoreJobs.results` found finished since its last call."""

    loaded: set[str]  # loads that ended, well or not
    failed: set[str]  # of those, the ones whose blocks vLLM must recompute
    failed_blocks: set[int]
    saved: set[str]  # saves that ended (their blocks are free of the store)


class StoreJobs:
    """The worker's store loads and saves, run one at a time on their own thread (they
    wait on the network; the forward pass never does).

    :param io: the store link (None: store mode is off, every load fails at once).
    :param stats: the worker's counters, which this adds its ``store_*`` counts to.
    :param load_seconds: where each load's duration is appended.
    """

    def __init__(self, io: StoreIO | None, stats: dict[str, Any],
                 load_seconds: Sequence[deque[float]], name: str,
                 initializer: Callable[[], None] | None = None) -> None:
        self.io = io
        self._stats = stats
        self._load_seconds = load_seconds
        self._executor = None if io is None else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"te-vllm-store-{name}",
            initializer=initializer)
        self._loads: dict[str, tuple[StoreLoad, Future[int], float]] = {}
        self._saves: dict[str, Future[int]] = {}
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return bool(self._loads or self._saves)

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    def saving(self) -> set[str]:
        """Requests whose blocks a save still reads."""
        with self._lock:
            return set(self._saves)

    def _failed(self, why: str) -> Future[int]:
        fut: Future[int] = Future()
        fut.set_exception(ProtocolError(why))
        return fut

    def start_loads(self, specs: Iterable[StoreLoad]) -> None:
        for spec in specs:
            self._stats["store_loads"] += 1
            if self.io is None or self._executor is None:
                fut = self._failed("store mode is off on this worker")
            elif not spec.block_ids:
                fut = self._failed("no blocks to load from the store")
            else:
                fut = self._executor.submit(self.io.load, spec)
            self._loads[spec.request_id] = (spec, fut, time.monotonic())

    def start_saves(self, specs: Iterable[StoreSave]) -> None:
        for spec in specs:
            fut: Future[int]
            if self.io is None or self._executor is None or not spec.block_ids:
                fut = Future()
                fut.set_result(0)
            else:
                fut = self._executor.submit(self.io.save, spec)
            with self._lock:
                self._saves[spec.request_id] = fut

    def results(self) -> StoreResults:
        out = StoreResults(set(), set(), set(), set())
        for rid, (spec, fut, started) in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[rid]
            out.loaded.add(rid)
            try:
                self._stats["store_load_bytes"] += fut.result()
                took = time.monotonic() - started
                for series in self._load_seconds:
                    series.append(took)
            # Whatever broke the load (a missing piece, a node or the master gone),
            # vLLM recomputes the blocks: never a failed request, never wrong KV.
            except Exception as exc:  # noqa: BLE001
                self._stats["store_load_failed"] += 1
                log.warning("request %s: KV load from the store failed: %s; "
                            "recomputing", rid, exc)
                out.failed.add(rid)
                out.failed_blocks.update(spec.block_ids)
        done: dict[str, Future[int]] = {}
        with self._lock:
            for rid, fut in list(self._saves.items()):
                if fut.done():
                    done[rid] = self._saves.pop(rid)
        for rid, fut in done.items():
            out.saved.add(rid)
            try:
                nbytes = fut.result()
            # A save that failed costs a later engine a recompute, never this request:
            # logged and dropped.
            except Exception as exc:  # noqa: BLE001
                self._stats["store_save_failed"] += 1
                log.warning("request %s: KV save to the store failed: %s", rid, exc)
                continue
            if nbytes:
                self._stats["store_saves"] += 1
                self._stats["store_save_bytes"] += nbytes
        return out

    def close(self) -> None:
        """Cancels queued work and waits for the one running."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self.io = None

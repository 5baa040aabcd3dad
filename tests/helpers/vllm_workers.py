"""Two vLLM connector workers (prefill, decode) in this process, with real engines on
loopback and KV caches as CPU torch tensors, as the vLLM contract tests drive them.
Import it once vLLM and torch are known to import (the tests skip without them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from tests.helpers.clock import FakeClock
from transfer_engine.connectors.vllm import RecvSpec, TEConnectorConfig, TEConnectorWorker

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 64, 16, 2, 32, 3
COMPAT = {"model": "tiny", "dtype": "float32", "block_size": BLOCK, "tp_size": 1}


def gpu_caches(seed: int) -> dict[str, Any]:
    """vLLM's GPU per-layer layout ``[2, num_blocks, block_size, heads, dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM, generator=gen)
            for i in range(LAYERS)}


def cpu_caches(seed: int) -> dict[str, Any]:
    """vLLM's CPU block-major layout ``[num_blocks, heads, block_size, 2 * dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, generator=gen)
            for i in range(LAYERS)}


def mla_caches(seed: int, num_blocks: int = NUM_BLOCKS) -> dict[str, Any]:
    """An MLA latent cache ``[num_blocks, block_size, latent + rope dim]``: no K/V
    split, one part per block."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(num_blocks, BLOCK, 40, generator=gen)
            for i in range(LAYERS)}


def block_of(tensor: Any, b: int) -> Any:
    return tensor[:, b] if tensor.shape[0] == 2 else tensor[b]


@contextmanager
def worker_pair(clock: FakeClock, caches: Callable[[int], dict[str, Any]] = gpu_caches,
                **config: Any) -> Iterator[tuple[TEConnectorWorker, TEConnectorWorker,
                                                 dict[str, Any], dict[str, Any]]]:
    """Prefill and decode workers with ``caches`` (seeds 1 and 2; GPU-layout ones by
    default) registered; ``config``: more of the connector's settings."""
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0, **config)
    prefill = TEConnectorWorker("prefill-w", cfg, COMPAT, clock, takes_push=False)
    decode = TEConnectorWorker("decode-w", cfg, COMPAT, clock)
    pk, dk = caches(1), caches(2)
    try:
        prefill.register_kv_caches(pk, NUM_BLOCKS)
        decode.register_kv_caches(dk, NUM_BLOCKS)
        yield prefill, decode, pk, dk
    finally:
        decode.close()
        prefill.close()


def wait_results(worker: TEConnectorWorker, want: str, rid: str, timeout: float = 5.0
                 ) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = worker.results()
        if rid in getattr(res, want):
            return res
        time.sleep(0.005)
    raise AssertionError(f"{rid} not in {want} after {timeout}s")


def spec(prefill: TEConnectorWorker, rid: str, local: list[int], remote: list[int]
         ) -> RecvSpec:
    assert prefill.engine is not None
    return RecvSpec(rid, local, remote, prefill.engine.endpoint, "prefill-engine", rid)


def blocks(ids: list[int], cached: int = 0) -> KVCacheBlocks:
    """vLLM's block list of ``ids``, the first ``cached`` of them prefix-cache hits."""
    out = [KVCacheBlock(i) for i in ids]
    for b in out[:cached]:
        b.set_block_hash(b"h" * 8)
    return KVCacheBlocks((out,))

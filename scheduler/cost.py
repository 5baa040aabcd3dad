"""What a request costs and what it must meet: the cost model the router estimates with
and the simulator charges, and the service-level objectives.

The defaults describe an 8B-parameter GQA model in bf16 (32 layers x 8 KV heads x 128
dims x K,V x 2 bytes = 128 KiB of KV per token) on one modern GPU per instance, 400 Gb/s
RDMA inside a zone, a faster fabric inside a pod and 20 Gb/s of TCP across zones. They
are parameters, not measurements: change them to describe another fleet.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.policy import PathClass

__all__ = ["CostModel", "SLO"]


@dataclass(frozen=True)
class CostModel:
    """Linear costs.

    :param block_tokens: tokens per prefix-cache block (the trace's hash unit).
    :param prefill_tokens_per_s: prefill throughput of one instance (tokens/s).
    :param prefill_overhead_s: fixed cost of one prefill (scheduling, first kernel).
    :param attention_tokens: context length at which attention doubles the cost of a
        prefilled token (its attention reads every earlier token, cached or not).
    :param kv_bytes_per_token: KV-cache bytes per token, all layers.
    :param decode_step_s: one decode step with an empty batch (seconds).
    :param decode_step_per_kv_token_s: added to a step per KV token in the batch.
    :param decode_kv_tokens: KV capacity of one decode instance (tokens).
    :param pod_bytes_per_s: bandwidth between two instances of one pod.
    :param rdma_bytes_per_s: RDMA bandwidth between two instances of one zone.
    :param tcp_bytes_per_s: TCP bandwidth (across zones, or when RDMA is avoided).
    :param store_bytes_per_s: bandwidth from the KV store to a prefill instance.
    :param transfer_latency_s: fixed cost of one KV transfer (handshake, notification).
    """

    block_tokens: int = 512
    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.02
    attention_tokens: float = 32_768.0
    kv_bytes_per_token: int = 131_072
    decode_step_s: float = 0.008
    decode_step_per_kv_token_s: float = 4e-8
    decode_kv_tokens: int = 400_000
    pod_bytes_per_s: float = 50e9
    rdma_bytes_per_s: float = 25e9
    tcp_bytes_per_s: float = 2.5e9
    store_bytes_per_s: float = 25e9
    transfer_latency_s: float = 0.002

    def __post_init__(self) -> None:
        for name in ("block_tokens", "prefill_tokens_per_s", "kv_bytes_per_token",
                     "decode_kv_tokens", "attention_tokens", "pod_bytes_per_s", "rdma_bytes_per_s",
                     "tcp_bytes_per_s", "store_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    def prefill_s(self, tokens: float, cached: float = 0.0) -> float:
        """Seconds to prefill ``tokens`` uncached tokens after ``cached`` cached ones."""
        tokens = max(tokens, 1.0)
        context = cached + tokens / 2
        return (self.prefill_overhead_s + tokens * (1.0 + context / self.attention_tokens)
                / self.prefill_tokens_per_s)

    def decode_step(self, kv_tokens: float) -> float:
        """Seconds per output token with ``kv_tokens`` in the batch."""
        return self.decode_step_s + self.decode_step_per_kv_token_s * kv_tokens

    def bandwidth(self, path: PathClass, transport: str) -> float:
        """Bytes per second between two instances (``shm`` on one host is a copy)."""
        if path is PathClass.HOST:
            return self.pod_bytes_per_s * 2
        if transport == "tcp" or path is PathClass.CROSS_ZONE:
            return self.tcp_bytes_per_s
        return self.pod_bytes_per_s if path is PathClass.POD else self.rdma_bytes_per_s

    def transfer_s(self, tokens: float, path: PathClass, transport: str = "rdma") -> float:
        """Seconds to move the KV of ``tokens`` tokens over ``path``."""
        return (self.transfer_latency_s
                + tokens * self.kv_bytes_per_token / self.bandwidth(path, transport))

    def fetch_s(self, blocks: float) -> float:
        """Seconds to fetch ``blocks`` cached blocks from the store."""
        if blocks <= 0:
            return 0.0
        return (self.transfer_latency_s
                + blocks * self.block_tokens * self.kv_bytes_per_token / self.store_bytes_per_s)


@dataclass(frozen=True)
class SLO:
    """Targets a request must meet to count towards goodput.

    TTFT scales with the prompt, since no router makes a long prefill short:
    ``ttft <= ttft_s + ttft_x * (time to prefill the whole prompt, nothing cached)``.

    :param ttft_s: fixed TTFT allowance (seconds).
    :param ttft_x: allowance per second of full (uncached) prefill.
    :param tpot_s: time per output token after the first (seconds).
    """

    ttft_s: float = 1.0
    ttft_x: float = 1.5
    tpot_s: float = 0.02

    def __post_init__(self) -> None:
        if self.ttft_s < 0 or self.ttft_x < 0 or self.tpot_s <= 0:
            raise ValueError("SLO targets must be non-negative (tpot positive)")

    def ttft_limit(self, input_tokens: float, cost: CostModel) -> float:
        return self.ttft_s + self.ttft_x * (cost.prefill_s(input_tokens)
                                            - cost.prefill_overhead_s)

"""The connector's numbers the way vLLM collects them: each worker hands over what
happened since its last step (:class:`TEConnectorStats`); vLLM sums them across
workers, logs a summary with its throughput line and exports them to Prometheus
(:class:`TEPromMetrics`, on the server's ``/metrics``)."""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# counters: (key, Prometheus name, help)
COUNTS = (
    ("loads", "te_kv_loads", "KV loads from a remote prefill started by decode"),
    ("sync_loads", "te_kv_sync_loads",
     "of those, loads done before the admitting step's forward"),
    ("layered_loads", "te_kv_layered_loads",
     "of those, loads read layer by layer while that forward ran"),
    ("load_failures", "te_kv_load_failures",
     "KV loads from a remote prefill that failed (vLLM recomputed the blocks)"),
    ("load_bytes", "te_kv_load_bytes", "bytes of KV loaded from remote prefills"),
    ("holds", "te_kv_holds", "requests whose blocks prefill held for a decoder (prefill; "
     "each ends as sent or lease_expired)"),
    ("sent", "te_kv_sent_requests", "requests whose blocks a decoder read (prefill)"),
    ("lease_expired", "te_kv_lease_expired",
     "requests whose blocks no decoder read before the lease ran out (prefill)"),
    ("pushes", "te_kv_pushes", "requests whose KV prefill pushed layer by layer into a "
     "room decode reserved (prefill)"),
    ("push_failures", "te_kv_push_failures",
     "pushes prefill gave up (decode read those blocks instead)"),
    ("push_bytes", "te_kv_push_bytes", "bytes of KV prefill pushed"),
    ("push_refused", "te_kv_push_refused",
     "rooms decode refused or could not grant (decode)"),
    ("pushed_loads", "te_kv_pushed_loads",
     "of the loads, those decode copied from a pushed room, with no READ"),
    ("store_loads", "te_kv_store_loads", "KV loads from the cluster store"),
    ("store_load_failures", "te_kv_store_load_failures",
     "KV loads from the cluster store that failed (vLLM recomputed the blocks)"),
    ("store_load_bytes", "te_kv_store_load_bytes", "bytes of KV loaded from the store"),
    ("store_saves", "te_kv_store_saves", "prompts' blocks put into the cluster store"),
    ("store_save_failures", "te_kv_store_save_failures", "puts into the store that failed"),
    ("store_save_bytes", "te_kv_store_save_bytes", "bytes of KV put into the store"),
)
# count key -> the worker's cumulative counter it is the change of
INTERVAL_COUNTS = {"loads": "recv_requests", "sync_loads": "recv_sync",
                   "layered_loads": "recv_layered",
                   "load_failures": "recv_failed", "load_bytes": "recv_bytes",
                   "holds": "held_requests", "sent": "sent_requests",
                   "lease_expired": "lease_expired",
                   "pushes": "push_started", "push_failures": "push_failed",
                   "push_bytes": "push_bytes", "push_refused": "push_refused",
                   "pushed_loads": "recv_pushed",
                   "store_loads": "store_loads", "store_load_failures": "store_load_failed",
                   "store_load_bytes": "store_load_bytes", "store_saves": "store_saves",
                   "store_save_failures": "store_save_failed",
                   "store_save_bytes": "store_save_bytes"}
# observations in seconds: (key, Prometheus name, help)
TIMES = (
    ("load_seconds", "te_kv_load_seconds",
     "from a load's start on decode to its last byte (handshake included)"),
    ("held_seconds", "te_kv_held_seconds",
     "from prefill finishing a request to a decoder having read its blocks (the router "
     "hop, decode's wait for a step and the read)"),
    ("store_load_seconds", "te_kv_store_load_seconds", "one load from the store"),
    ("load_wait_seconds", "te_kv_load_wait_seconds",
     "in a step with sync loads, how long its forward waited for their KV, before it "
     "and at each layer"),
)


def worker_counters() -> dict[str, Any]:
    """A worker's cumulative counters (those INTERVAL_COUNTS reports the changes of)
    and its latest load times."""
    out: dict[str, Any] = dict.fromkeys(INTERVAL_COUNTS.values(), 0)
    out["recv_seconds"] = deque(maxlen=1024)
    return out


def interval(counters: dict[str, Any], reported: dict[str, int],
             times: dict[str, deque[float]]) -> dict[str, Any] | None:
    """The change of ``counters`` since ``reported`` (then brought up to date) and the
    ``times`` observed since (then cleared), or None when nothing happened."""
    out: dict[str, Any] = {}
    for key, stat in INTERVAL_COUNTS.items():
        value = int(counters[stat])
        out[key] = value - reported[stat]
        reported[stat] = value
    for key, seen in times.items():
        out[key] = list(seen)
        seen.clear()
    return out if any(out.values()) else None


BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def empty() -> dict[str, Any]:
    out: dict[str, Any] = {key: 0 for key, _, _ in COUNTS}
    out.update({key: [] for key, _, _ in TIMES})
    return out


@dataclass
class TEConnectorStats(KVConnectorStats):
    """Counts and times of one interval, plain ints and lists (they cross processes)."""

    data: dict[str, Any] = field(default_factory=dict)  # vLLM's field, typed here

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # from another version or worker: missing keys read as nothing
            self.data = {**empty(), **self.data}

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            mine = self.data.get(key)
            if isinstance(mine, list):
                mine.extend(value)
            elif isinstance(mine, int):
                self.data[key] = mine + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {key: self.data[key] for key, _, _ in COUNTS
                                       if self.data[key]}
        for key, _, _ in TIMES:
            values = self.data[key]
            if values:
                ms = np.asarray(values, dtype=np.float64) * 1e3
                out[f"{key[:-8]}_ms_p50"] = round(float(np.percentile(ms, 50)), 2)
                out[f"{key[:-8]}_ms_p99"] = round(float(np.percentile(ms, 99)), 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key, _, _ in COUNTS) and not any(
            self.data[key] for key, _, _ in TIMES)

    def clone_and_reset(self) -> TEConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old


class TEPromMetrics(KVConnectorPromMetrics):
    """``vllm:te_kv_*`` counters and histograms, one series per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric],
                                                              type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(self._counter_cls(
                name=f"vllm:{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for key, name, doc in COUNTS}
        self.histograms = {
            key: create_metric_per_engine(self._histogram_cls(
                name=f"vllm:{name}", documentation=doc, buckets=list(BUCKETS),
                labelnames=labelnames), per_engine_labelvalues)
            for key, name, doc in TIMES}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for key, per_engine in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)

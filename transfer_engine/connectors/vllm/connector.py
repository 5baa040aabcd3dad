"""vLLM's ``KVConnectorBase_V1`` on our engine: dispatches each call to its role's side."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from transfer_engine.connectors.vllm.config import (
    TEConnectorConfig,
    log_with,
)
from transfer_engine.connectors.vllm.metadata import (
    TEConnectorMetadata,
)
from transfer_engine.connectors.vllm.scheduler_side import (
    TEConnectorScheduler,
)
from transfer_engine.connectors.vllm.stats import TEConnectorStats, TEPromMetrics
from transfer_engine.connectors.vllm.worker_side import (
    TEConnectorWorker,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _kv_heads(model_config: Any, parallel_config: Any) -> tuple[int, int] | None:
    """(this rank's KV heads, the model's), or None where there are none to split (an
    MLA latent cache, the same on every rank) or the model does not say."""
    if getattr(model_config, "use_mla", False):
        return None
    try:
        return (int(model_config.get_num_kv_heads(parallel_config)),
                int(model_config.get_total_num_kv_heads()))
    except (AttributeError, TypeError, ValueError):
        return None


class TransferEngineConnector(KVConnectorBase_V1):
    """vLLM's entry point: forwards to :class:`TEConnectorScheduler` (SCHEDULER role)
    or :class:`TEConnectorWorker` (WORKER role)."""

    _ids = itertools.count()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        log_with(logging.getLogger("vllm"))
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
            lookup = None
            if self.config.store is not None:
                from kvstore.client import Lookup

                lookup = Lookup(self.config.store, timeout=self.config.store_timeout_s,
                                auth=self.config.auth())
            hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
            groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config else 1
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec \
                if kv_cache_config and kv_cache_config.kv_cache_groups else None
            window = getattr(spec, "sliding_window", None) or (
                0 if getattr(spec, "attention_chunk_size", None) else None)
            self.scheduler = TEConnectorScheduler(self.engine_id, block_size,
                                                  self.config.lease_s, store=lookup,
                                                  vllm_hashes=hash_block == block_size,
                                                  sync_load=self.config.load == "sync",
                                                  kv_groups=groups, tp_size=tp_size,
                                                  push=self.config.push, window=window)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            config = self.config
            if config.port:
                config = dataclasses.replace(config, port=config.port + rank)
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            kv_heads = _kv_heads(mc, pc)
            # which heads a rank holds is checked apart (worker placement), so ranks of
            # prefill and decode of other tensor-parallel sizes may trade them
            compat = {"model": str(mc.model), "dtype": str(mc.dtype),
                      "block_size": block_size,
                      "kv_heads": kv_heads[1] if kv_heads else None}
            self.worker = TEConnectorWorker(
                f"vllm-{self.engine_id}-tp{rank}-{next(self._ids)}", config, compat,
                rank=rank, tp_size=int(pc.tensor_parallel_size), kv_heads=kv_heads,
                takes_push=str(ktc.kv_role) != "kv_producer",
                replicated=bool(getattr(mc, "use_mla", False)))

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        num_blocks = (self._kv_cache_cfg.num_blocks if self._kv_cache_cfg is not None
                      else next(iter(kv_caches.values())).shape[1])
        self.worker.register_kv_caches(kv_caches, int(num_blocks))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake_metadata() if self.worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Starts the step's work as soon as its metadata arrives, before the forward:
        vLLM calls ``start_load_kv`` only after the forward in steps without a sync
        load, which would leave an async load (and prefill's hold) a step behind."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is None or not isinstance(connector_metadata, TEConnectorMetadata):
            return
        meta = connector_metadata
        self.worker.start_step()
        if meta.reqs_to_send:
            self.worker.hold(meta.reqs_to_send)
        if meta.reqs_to_push:
            self.worker.start_push(meta.reqs_to_push.values())
        if meta.reqs_to_recv:
            specs = meta.reqs_to_recv.values()
            self.worker.start_load([s for s in specs if not s.sync])
            self.worker.load_now([s for s in specs if s.sync])
        if meta.store_saves:
            self.worker.start_store_saves(meta.store_saves.values())
        if meta.store_loads:
            self.worker.start_store_loads(meta.store_loads.values())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # started by bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_layered()

    def get_transfer_results(self, finished_req_ids: set[str]
                             ) -> KVConnectorTransferResults:
        assert self.worker is not None
        return self.worker.results()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.worker.interval_stats() if self.worker is not None else None
        return TEConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TEConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return TEPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None and self.scheduler.store is not None:
            self.scheduler.store.close()

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

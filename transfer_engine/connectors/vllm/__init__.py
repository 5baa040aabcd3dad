"""vLLM KV connector (``KVConnectorBase_V1``) moving paged KV blocks over our engine.

Mount it on both engines of a prefill/decode pair::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TransferEngineConnector",
        "kv_connector_module_path": "transfer_engine.connectors.vllm",
        "kv_role": "kv_producer",            # "kv_consumer" on decode, or "kv_both"
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host": "10.0.0.5", "port": 0, "lease_s": 30}}'

This package is the only place in the project that imports vLLM.

Protocol (a pull design: decode READs the prefill engine's blocks, one-sided)
-----------------------------------------------------------------------------
Who calls what, in which order (S = scheduler side, W = worker side)::

    prefill W  register_kv_caches    registers each layer tensor once (one segment per
                                     layer, block addresses from the tensor's strides)
                                     and a small manifest segment: protocol version,
                                     compatibility hash (model, dtype, block size,
                                     layout, the model's KV heads), which heads this
                                     rank holds, and every layer's block layout
                                     (where a block's heads lie in it included)
    prefill W  get_handshake_metadata -> endpoint, engine name, version, hash
    prefill S  set_xfer_handshake_metadata   learns every rank's worker endpoint
    proxy      request to prefill with kv_transfer_params={"do_remote_decode": True},
               max_tokens=1
    prefill S  request_finished      holds the request's blocks (returns True) and
                                     answers kv_transfer_params: remote_endpoint,
                                     remote_endpoints (every rank's, in rank order;
                                     decode rank r of D loads its heads from prefill
                                     rank r*P//D of P, and a decode whose size P does
                                     not divide refuses them),
                                     remote_engine_id, remote_request_id,
                                     remote_block_ids, remote_num_tokens, lease_expiry
                                     (wall clock, seconds since the epoch),
                                     protocol_version
    prefill S  build_connector_meta  tells its worker: hold these for lease_s seconds
    every   W  get_kv_connector_stats   counts and times since the last step: vLLM logs
                                     them and exports them as vllm:te_kv_* on /metrics
    proxy      request to decode with those kv_transfer_params
    decode S   get_num_new_matched_tokens -> (prompt tokens not cached locally, and
               with load "sync" (the default) never the prompt's last token; whether
               the load is async: only with load "async")
               (refuses, with one log line, params that fail parse_remote_params: a
               wrong type or range, blocks that do not cover exactly remote_num_tokens,
               another prompt's params (prompt_hash), an expired lease or another
               protocol version; and params another request already loaded (replayed:
               prefill may have reused the blocks): 0 tokens, vLLM computes the prompt)
    decode S   update_state_after_alloc   pairs remote blocks with the blocks vLLM
                                          allocated; build_connector_meta ships them
    decode W   bind_connector_metadata  (before the step's forward) one READ of every
                                     layer's blocks, coalescing runs of consecutive
                                     blocks, with a notification; the first load from
                                     a peer first connects and reads and checks the
                                     peer's manifest (a mismatch is refused with a
                                     message naming what differs) on a background
                                     thread.
                                     load "sync": waits for the READs (at most
                                     timeout_s), so this step's forward computes with
                                     the KV; a failed one's blocks go to
                                     get_block_ids_with_load_errors (vLLM recomputes).
                                     load "async": returns at once; a slow or dead peer
                                     never stalls the forward, and the request is
                                     admitted at the step after its READ ends
    prefill W  (notification)        the blocks were read (by every decode rank
                                     reading them): report finished_sending, vLLM
                                     frees them; or the lease ran out: the same
    decode W   get_transfer_results  (async) finished_recving; a failed READ is also
                                     in failed_recving and its blocks in
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

Store mode (``"store": "tcp://MASTER:PORT"`` in kv_connector_extra_config, any role)
---------------------------------------------------------------------------------
::

    W  register_kv_caches        also opens a store client on the worker's engine and
                                 hands it the KV segments; the handshake metadata names
                                 the pieces of a block it stores (one per layer and K/V)
    S  get_num_new_matched_tokens   no P/D params: asks the master once which leading
                                 blocks beyond the local prefix cache have every piece
                                 stored (never the prompt's last token) -> (tokens, async)
    S  update_state_after_alloc  pairs those blocks' keys with the blocks vLLM allocated
    W  bind_connector_metadata   queues the read on the store thread; results() reports
                                 it in finished_recving, a failure also in
                                 failed_recving with its blocks (vLLM recomputes)
    S  request_finished          a finished (not aborted) request's full prompt blocks
                                 not loaded from the store are to be saved: its blocks
                                 are held (True) until the put is done
    W  bind_connector_metadata   queues the put of the pieces the store lacks; results()
                                 reports finished_sending once it is done (and a P/D
                                 lease on the same request is over); a failed put is
                                 logged and dropped

Requests with P/D kv_transfer_params (``do_remote_prefill``) load from their prefill
engine and never ask the store. Keys: :mod:`transfer_engine.connectors.vllm.store`.
"""

from transfer_engine.connectors.vllm.blocks import vllm_layout
from transfer_engine.connectors.vllm.config import PROTOCOL_VERSION, TEConnectorConfig
from transfer_engine.connectors.vllm.connector import TransferEngineConnector
from transfer_engine.connectors.vllm.metadata import (
    RecvSpec,
    RemoteParams,
    TEConnectorMetadata,
    TEHandshakeMetadata,
    parse_remote_params,
    prompt_hash,
)
from transfer_engine.connectors.vllm.scheduler_side import TEConnectorScheduler
from transfer_engine.connectors.vllm.worker_side import TEConnectorWorker, live_workers

__all__ = ["TransferEngineConnector", "TEConnectorScheduler", "TEConnectorWorker",
           "TEConnectorConfig", "TEConnectorMetadata", "TEHandshakeMetadata", "RecvSpec",
           "vllm_layout", "PROTOCOL_VERSION", "live_workers",
           "RemoteParams", "parse_remote_params", "prompt_hash"]

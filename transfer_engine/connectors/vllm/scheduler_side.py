"""Scheduler-side logic: hands prefill's blocks over, checks decode's params; no I/O."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
)

from transfer_engine.connectors.vllm.config import (
    PROTOCOL_VERSION,
)
from transfer_engine.connectors.vllm.metadata import (
    RecvSpec,
    RemoteParams,
    TEConnectorMetadata,
    TEHandshakeMetadata,
    parse_remote_params,
    prompt_hash,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


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

"""Scheduler-side logic: hands prefill's blocks over, checks decode's params, asks the
store (one master request per new request in store mode); moves no bytes."""

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
    PushSpec,
    RecvSpec,
    RemoteParams,
    TEConnectorMetadata,
    TEHandshakeMetadata,
    parse_push_params,
    parse_remote_params,
    prompt_hash,
)
from transfer_engine.connectors.vllm.store import (
    StoreLoad,
    StoreSave,
    request_block_keys,
    stored_prefix,
)
from transfer_engine.errors import TransferEngineError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvstore.client import Lookup

log = logging.getLogger(__name__)

STORE_RETRY_S = 10.0  # seconds without store lookups after one failed
NULL_BLOCK = 0  # vLLM's null block: stands for a block freed behind a window
MAX_CONSUMED = 65536  # hand-overs remembered against replay (each until its lease ends)


class TEConnectorScheduler:
    """Scheduler-side logic; holds no memory and moves no bytes (store mode asks the
    master which blocks it holds).

    :param engine_id: vLLM's engine id (kv_transfer_params name it to peers).
    :param block_size: tokens per KV block.
    :param lease_s: seconds a finished request's blocks are held for the decoder.
    :param endpoint: this engine's worker endpoint, if known before the handshake
        metadata arrives.
    :param wall_clock: ``time.time``-like clock for lease expiry in kv_transfer_params.
    :param store: the cluster store's lookup (store mode), or ``None``.
    :param vllm_hashes: whether vLLM's block hashes are at ``block_size`` granularity
        (then they key the store; otherwise the token ids do).
    :param sync_load: load a remote prefill's KV before the forward of the step that
        admits the request (its KV is whole by then), not beside it.
    :param kv_groups: vLLM's KV cache groups; with more than one (a hybrid cache, each
        group with block ids of its own) nothing is handed over or loaded: vLLM
        computes every prompt, never with another group's blocks.
    :param window: the attention's sliding window in tokens, if it has one (0: windowed
        some other way, e.g. chunked local attention; None: full attention). Behind
        a window vLLM frees blocks, and prefill hands over only what its own next
        token needs (freed blocks are vLLM's null block, ``NULL_BLOCK``): a load
        after which decode computes an earlier token reaches further back, and is
        refused when that block is gone.
    """

    def __init__(self, engine_id: str, block_size: int, lease_s: float = 30.0,
                 endpoint: str | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 store: Lookup | None = None, vllm_hashes: bool = True,
                 sync_load: bool = True, kv_groups: int = 1, tp_size: int = 1,
                 push: bool = True, window: int | None = None) -> None:
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.endpoints: tuple[str, ...] = ()  # every rank's worker, in rank order
        self.block_size = block_size
        self.lease_s = lease_s
        self.endpoint = endpoint
        self._wall = wall_clock
        self._recv: dict[str, RecvSpec] = {}
        self._send: dict[str, float] = {}
        self._parsed: dict[str, tuple[RemoteParams, int]] = {}  # matched, waiting for
        # allocation: the params and the tokens vLLM had computed locally
        self.refused: dict[str, str] = {}  # request id -> why a load was refused
        # (prefill endpoint, its request id) -> (our request that loads it, lease end):
        # prefill frees the blocks once read, so a second use would read another
        # request's KV
        self._consumed: dict[tuple[str, str], tuple[str, float]] = {}
        self.store = store
        self._vllm_hashes = vllm_hashes
        self.sync_load = sync_load
        self.kv_groups = kv_groups
        self.window = window
        if kv_groups > 1:
            log.warning("%d KV cache groups (a hybrid KV cache): this connector moves "
                        "one group's blocks, so it hands over and loads nothing; every "
                        "prompt is computed", kv_groups)
        self.store_labels: tuple[str, ...] = ()  # every rank's pieces of a block
        self._store_hits: dict[str, tuple[int, int, list[int]]] = {}  # rid -> (computed
        # tokens asked with, blocks stored from the start, their keys)
        self._store_known: dict[str, int] = {}  # rid -> leading blocks known stored
        self._store_loads: dict[str, StoreLoad] = {}
        self._store_saves: dict[str, StoreSave] = {}
        self.store_errors = 0
        self._store_down_until = 0.0  # monotonic: no lookups before (the master failed)
        self.push = push  # prefill pushes where the router asks
        # prefill: requests allocated this step whose KV may be pushed (pushed only when
        # the step prefills the whole prompt), and the room of each push started
        self._push_alloc: dict[str, tuple[Request, str, tuple[str, ...], list[int]]] = {}
        self._told_chunked = False  # a chunked prefill's push fell back to a read
        self._pushes: dict[str, PushSpec] = {}
        self._rooms: dict[str, str] = {}  # request id -> room, until it finishes

    def set_handshake(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        meta = metadata.get(0)
        if isinstance(meta, TEHandshakeMetadata):
            self.endpoint = meta.endpoint
        self.endpoints = tuple(m.endpoint for _, m in sorted(metadata.items())
                               if isinstance(m, TEHandshakeMetadata))
        labels: list[str] = []
        for rank in sorted(metadata):
            m = metadata[rank]
            if isinstance(m, TEHandshakeMetadata):
                labels += m.store_labels
        self.store_labels = tuple(labels)

    # store mode
    def _store_match(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the store holds beyond ``num_computed_tokens``, whole blocks, never
        the prompt's last token (vLLM computes it to sample the next one); asks the
        master once per request and computed-token count."""
        if self.store is None or not self.store_labels:
            return 0
        rid = request.request_id
        prompt = request.prompt_token_ids or ()
        bs = self.block_size
        local = num_computed_tokens // bs
        wanted = (len(prompt) - 1) // bs
        if wanted <= local:
            return 0
        cached = self._store_hits.get(rid)
        if cached is not None and cached[0] == num_computed_tokens:
            return (cached[1] - local) * bs
        if time.monotonic() < self._store_down_until:
            return 0
        keys = request_block_keys(request, prompt, bs, wanted, self._vllm_hashes)
        try:
            stored = local + stored_prefix(self.store, keys[local:], self.store_labels)
        except TransferEngineError as exc:
            # every new request would wait out the timeout in the scheduler's loop
            # while the master is down: ask again only after a pause
            self.store_errors += 1
            self._store_down_until = time.monotonic() + STORE_RETRY_S
            log.warning("request %s: store lookup failed: %s; computing locally, no "
                        "lookups for %.0f s", rid, exc, STORE_RETRY_S)
            return 0
        self._store_hits[rid] = (num_computed_tokens, stored, keys[:stored])
        return (stored - local) * bs

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.kv_groups > 1:
            if isinstance(params, dict) and params.get("do_remote_prefill"):
                params["do_remote_prefill"] = False
                self.refused[request.request_id] = "hybrid KV cache (several groups)"
            return 0, False
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            count = self._store_match(request, num_computed_tokens)
            return (count, True) if count > 0 else (0, False)
        return self._remote_match(request, num_computed_tokens, params)

    def _store_alloc(self, request: Request, blocks: KVCacheBlocks,
                     num_external_tokens: int) -> None:
        hit = self._store_hits.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        if hit is None:  # nothing of ours to load: a load error, so vLLM recomputes
            self._store_loads[rid] = StoreLoad(rid, [], [])
            return
        _, stored, keys = hit
        group = blocks.blocks[0]
        start = sum(1 for b in group if b.block_hash is not None)
        end = min(stored, len(group))
        if end <= start:
            self._store_loads[rid] = StoreLoad(rid, [], [])
            return
        self._store_known[request.request_id] = end
        self._store_loads[request.request_id] = StoreLoad(
            request.request_id, [b.block_id for b in group[start:end]], keys[start:end])

    def _store_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Puts the prompt's full blocks this request computed (those not known to be
        stored); True while the worker still reads them (their free waits for it)."""
        known = self._store_known.pop(request.request_id, 0)
        self._store_hits.pop(request.request_id, None)
        if self.store is None or not self.store_labels or self.kv_groups > 1:
            return False
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False  # aborted: its KV may be incomplete
        prompt = request.prompt_token_ids or ()
        count = min(int(request.num_computed_tokens), len(prompt)) // self.block_size
        count = min(count, len(block_ids))
        if self.window is not None and NULL_BLOCK in block_ids[:count]:
            # blocks behind the window were freed: a prefix is stored only as far as it
            # is whole
            count = block_ids.index(NULL_BLOCK)
        if count <= known:
            return False
        keys = request_block_keys(request, prompt, self.block_size, count, self._vllm_hashes)
        self._store_saves[request.request_id] = StoreSave(
            request.request_id, [int(b) for b in block_ids[known:count]], keys[known:])
        return True

    def _usable(self, request: Request, params: dict[str, Any]) -> RemoteParams | None:
        rid = request.request_id
        try:
            now = self._wall()
            parsed = parse_remote_params(params, request.prompt_token_ids or (),
                                         self.block_size, now, self.tp_size)
            key = (parsed.endpoint, parsed.request_id)
            user = self._consumed.get(key)
            if user is not None and user[0] != rid and user[1] > now:
                raise ValueError(f"kv_transfer_params of prefill request "
                                 f"{parsed.request_id!r:.80} were already used by request "
                                 f"{user[0]!r:.80} (replayed); its blocks are not held "
                                 "for this one")
        except ValueError as exc:
            self._refuse(rid, str(exc))
            return None
        return parsed

    def _refuse(self, rid: str, why: str) -> None:
        """A request's remote KV is not loaded: vLLM computes its prompt here."""
        self.refused[rid] = why
        log.warning("request %s: not loading remote KV: %s; computing locally", rid, why)

    def _remote_match(self, request: Request, num_computed_tokens: int,
                      params: dict[str, Any]) -> tuple[int, bool]:
        parsed = self._usable(request, params)
        if parsed is None:
            params["do_remote_prefill"] = False
            return 0, False
        # the step after the load computes at least the prompt's last token (vLLM
        # samples from it), so a load covering the whole prompt stops one short
        last = len(request.prompt_token_ids or ()) - 1
        gone = self._window_gone(parsed.block_ids, min(parsed.num_tokens, last))
        if gone is not None:
            self._refuse(request.request_id, gone)
            params["do_remote_prefill"] = False
            return 0, False
        self._parsed[request.request_id] = (parsed, num_computed_tokens)
        if self.sync_load:
            return max(0, min(parsed.num_tokens, last) - num_computed_tokens), False
        count = parsed.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _window_gone(self, remote: list[int], position: int) -> str | None:
        """Why the token at ``position``, the first decode computes, cannot use the
        handed-over blocks (a block its window reaches was freed on prefill), or None."""
        if self.window is None or NULL_BLOCK not in remote:
            return None
        start = max(0, position - self.window + 1) if self.window > 0 else 0
        needed = remote[start // self.block_size:-(-position // self.block_size)]
        if NULL_BLOCK not in needed:
            return None
        return (f"the window of token {position} reaches a block prefill freed (the "
                "sequential hand-off recomputes the prompt's last token)")

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            self._store_alloc(request, blocks, num_external_tokens)
            if params and params.get("do_remote_decode") and "push" in params:
                self._push_allocated(request, blocks, params)
            return
        self._store_hits.pop(request.request_id, None)
        params["do_remote_prefill"] = False  # a preempted request recomputes
        matched = self._parsed.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        parsed, local_tokens = matched
        group = blocks.blocks[0]
        # blocks vLLM had cached (never their hashes: a sync load's blocks are hashed
        # as they are allocated, before any byte is loaded into them)
        cached = local_tokens // self.block_size
        remote = parsed.block_ids
        end = min(len(remote), len(group))
        self._consume((parsed.endpoint, parsed.request_id), request.request_id,
                      parsed.lease_expiry)
        self._recv[request.request_id] = RecvSpec(
            request.request_id, [b.block_id for b in group[cached:end]], remote[cached:end],
            parsed.endpoint, parsed.engine_id, parsed.request_id, parsed.lease_expiry,
            sync=self.sync_load, remote_endpoints=parsed.endpoints, decode_tp=self.tp_size,
            room=parsed.room, prompt_hash=parsed.prompt_hash, num_tokens=parsed.num_tokens,
            room_blocks=len(remote), first_block=cached)

    def _push_allocated(self, request: Request, blocks: KVCacheBlocks,
                        params: dict[str, Any]) -> None:
        """Prefill: the router asks for this request's KV to be pushed; remembered
        until the step is built (its KV is pushed if that step prefills it whole)."""
        rid = request.request_id
        if not self.push or self.kv_groups > 1:
            return
        try:
            room, to = parse_push_params(params)
        except ValueError as exc:
            log.warning("request %s: not pushing its KV: %s", rid, exc)
            return
        prompt = request.prompt_token_ids or ()
        needed = -(-len(prompt) // self.block_size)
        ids = [int(b.block_id) for b in blocks.blocks[0][:needed]]
        if prompt and len(ids) == needed:
            self._push_alloc[rid] = (request, room, to, ids)

    def _consume(self, key: tuple[str, str], rid: str, lease_expiry: float) -> None:
        """Remembers a hand-over as used until its lease ends (bounded: the oldest go
        first, and entries past their lease are dropped as new ones come)."""
        consumed = self._consumed
        if len(consumed) >= MAX_CONSUMED:
            now = self._wall()
            for k in [k for k, (_, end) in consumed.items() if end <= now]:
                del consumed[k]
            while len(consumed) >= MAX_CONSUMED:
                del consumed[next(iter(consumed))]
        consumed[key] = (rid, lease_expiry)

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None
                             ) -> TEConnectorMetadata:
        for rid, (request, room, to, ids) in self._push_alloc.items():
            prompt = request.prompt_token_ids or ()
            scheduled = (scheduler_output.num_scheduled_tokens.get(rid, 0)
                         if scheduler_output is not None else 0)
            # vLLM has set the tokens it found cached, not yet added this step's
            if request.num_computed_tokens + scheduled < len(prompt):
                if not self._told_chunked:  # once: it holds for every long prompt
                    self._told_chunked = True
                    log.info("request %s is prefilled in chunks: decode reads its blocks "
                             "rather than taking a push, which needs the whole prompt in "
                             "one step (said once)", rid)
                continue
            self._pushes[rid] = PushSpec(rid, room, to, ids, len(prompt),
                                         prompt_hash(prompt, len(prompt)), self.lease_s)
            self._rooms[rid] = room
        self._push_alloc.clear()
        meta = TEConnectorMetadata(self._recv, self._send, self._store_loads,
                                   self._store_saves, self._pushes)
        self._pushes = {}
        self._recv, self._send = {}, {}
        self._store_loads, self._store_saves = {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        saving = self._store_finished(request, block_ids)
        room = self._rooms.pop(request.request_id, None)
        ask = request.kv_transfer_params
        if isinstance(ask, dict) and ask.get("te_probe") is True:
            # the router asks where this server's workers are (to name them in a push)
            known = self.endpoints or ((self.endpoint,) if self.endpoint else ())
            return saving, {"te_endpoints": list(known)}
        held, params = self._remote_finished(request, block_ids)
        if params is not None and room is not None:
            params["push_room"] = room
        return held or saving, params

    def _remote_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or self.kv_groups > 1:
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # aborted, or its first token ended it (EOS, a stop token): nothing to
            # hand over, so the blocks are free at once instead of at the lease's end
            return False, None
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
            "remote_endpoints": list(self.endpoints or (self.endpoint,)),
            "remote_request_id": request.request_id,
            "remote_block_ids": [int(b) for b in block_ids[:needed]],
            "remote_num_tokens": num_tokens,
            "prompt_hash": prompt_hash(prompt, num_tokens),
            "lease_expiry": self._wall() + self.lease_s,
        }

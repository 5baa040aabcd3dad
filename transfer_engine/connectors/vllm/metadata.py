"""What passes between the roles: kv_transfer_params as decode checks them, and the
scheduler-to-worker and worker-to-scheduler metadata.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from transfer_engine.connectors.vllm.config import (
    PROTOCOL_VERSION,
)
from transfer_engine.connectors.vllm.rooms import valid_room
from transfer_engine.connectors.vllm.store import StoreLoad, StoreSave


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
    sync: bool = False  # loaded before this step's forward, which computes with it
    remote_endpoints: tuple[str, ...] = ()  # every prefill rank's, in rank order
    decode_tp: int = 1  # this decode's tensor-parallel ranks (a multiple or divisor of
    # prefill's)
    # a pushed room the blocks may be in (push.py): its id, what it must hold (the
    # prompt's hash, tokens and blocks as the params say) and where these blocks start
    room: str = ""
    prompt_hash: str = ""
    num_tokens: int = 0
    room_blocks: int = 0
    first_block: int = 0

    def endpoint_for(self, rank: int, merge: bool = True) -> str:
        """Where tensor-parallel rank ``rank`` loads from: the prefill rank that holds
        its KV heads (of its own number where both sides run as many ranks), the one
        endpoint given, or, where prefill runs more ranks than decode, the prefill
        ranks that hold them together (their endpoints joined by :data:`SOURCES`;
        ``merge`` False: the first of them, for a cache every rank holds whole)."""
        listed = self.remote_endpoints
        if not listed:
            return self.remote_endpoint
        if len(listed) <= self.decode_tp or not merge:
            return listed[rank * len(listed) // self.decode_tp]
        per = len(listed) // self.decode_tp
        return SOURCES.join(listed[rank * per:(rank + 1) * per])

    def reader(self, rank: int) -> tuple[int, int]:
        """``(k, n)``: rank ``rank`` is reader ``k`` of the ``n`` decode ranks that read
        slices of one prefill rank's blocks."""
        n = max(1, self.decode_tp // max(1, len(self.remote_endpoints)))
        return rank % n, n


SOURCES = " + "  # joins the endpoints of the prefill ranks one decode rank reads from


def sources(endpoint: str) -> list[str]:
    """The prefill endpoints :meth:`RecvSpec.endpoint_for` joined (one, usually)."""
    return endpoint.split(SOURCES)


@dataclass(frozen=True)
class PushSpec:
    """Prefill: push the blocks of a request prefilled whole in this step."""

    request_id: str
    room: str
    to: tuple[str, ...]  # decode's workers, by tensor-parallel rank
    block_ids: list[int]
    num_tokens: int
    prompt_hash: str
    lease_s: float


@dataclass
class TEConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, float] = field(default_factory=dict)  # req id -> lease (s)
    store_loads: dict[str, StoreLoad] = field(default_factory=dict)
    store_saves: dict[str, StoreSave] = field(default_factory=dict)
    reqs_to_push: dict[str, PushSpec] = field(default_factory=dict)


@dataclass
class TEHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> its scheduler: where peers reach this worker."""

    endpoint: str
    engine_name: str
    protocol_version: int
    compat_hash: str
    store_labels: tuple[str, ...] = ()  # the pieces of a block it stores (store mode)


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
    endpoints: tuple[str, ...] = ()  # every prefill rank's, in rank order (tp > 1)
    prompt_hash: str = ""
    room: str = ""  # where prefill pushed the blocks to this decode, if it did


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


MAX_TP = 64


def checked_endpoint(value: Any, key: str) -> str:
    """``value`` if it is ``tcp://host:port``, else ValueError naming ``key``."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or \
            not value.startswith("tcp://") or ":" not in value[len("tcp://"):]:
        raise ValueError(f"{key} {value!r:.80} is not tcp://host:port")
    return value


def _endpoints(params: dict[str, Any], tp_size: int) -> tuple[str, ...]:
    """Every prefill rank's endpoint: as many as this decode's ranks, fewer that divide
    them (each decode rank reads its heads from the prefill rank holding them) or more,
    a multiple of them (each decode rank reads its heads from the several prefill ranks
    holding them)."""
    listed = params.get("remote_endpoints")
    if listed is None:
        if tp_size > 1:
            raise ValueError(f"this decode runs {tp_size} tensor-parallel ranks and the "
                             "params name one prefill endpoint (remote_endpoints absent)")
        return ()
    if not isinstance(listed, list) or not 0 < len(listed) <= MAX_TP:
        raise ValueError(f"remote_endpoints must list 1 to {MAX_TP} endpoints")
    if max(len(listed), tp_size) % min(len(listed), tp_size):
        raise ValueError(f"prefill runs {len(listed)} tensor-parallel ranks, this decode "
                         f"{tp_size}: one of the two counts must divide the other")
    out = tuple(checked_endpoint(e, "a remote endpoint") for e in listed)
    if len(set(out)) < len(out):
        raise ValueError("remote_endpoints names one endpoint for two ranks")
    return out


def parse_remote_params(params: Any, prompt: Sequence[int], block_size: int, now: float,
                        tp_size: int = 1) -> RemoteParams:
    """Checks kv_transfer_params from a client (they reach decode through the proxy,
    or from anyone who can send a request); raises ValueError saying what is wrong.
    ``tp_size``: this decode's tensor-parallel ranks."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params is not a map")
    version = params.get("protocol_version")
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ValueError(f"kv_transfer_params protocol version {version!r:.20}, this "
                         f"connector speaks {PROTOCOL_VERSION}")
    endpoint = checked_endpoint(_text(params, "remote_endpoint"), "remote_endpoint")
    endpoints = _endpoints(params, tp_size)
    if endpoints and endpoints[0] != endpoint:
        raise ValueError("remote_endpoints does not start with remote_endpoint")
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
    digest = prompt_hash(prompt, num_tokens)
    if params.get("prompt_hash") != digest:
        raise ValueError("kv_transfer_params belong to another prompt (prompt_hash differs)")
    room = params.get("push_room", "")
    if room != "" and not valid_room(room):
        raise ValueError("push_room must be a string of 16 to 128 characters")
    return RemoteParams(endpoint, engine_id, request_id, block_ids, num_tokens, float(lease),
                        endpoints, digest, room)


def parse_push_params(params: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """Prefill: the room and decode's workers (by rank) the router asks it to push a
    request's KV into; raises ValueError saying what is wrong."""
    push = params.get("push")
    if not isinstance(push, dict):
        raise ValueError("push must be a map")
    room = push.get("room")
    if not valid_room(room):
        raise ValueError("push room must be a string of 16 to 128 characters")
    to = push.get("to")
    if not isinstance(to, list) or not 0 < len(to) <= MAX_TP:
        raise ValueError(f"push must name 1 to {MAX_TP} decode endpoints (to)")
    return room, tuple(checked_endpoint(e, "a push endpoint") for e in to)

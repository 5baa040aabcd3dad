"""Wire messages of the SGLang backend, on the project's versioned control protocol.

They ride on :mod:`transfer_engine.control.messages` (msgpack, size limits, field type
checks, HMAC signing with ``TE_CONTROL_SECRET``); ``BACKEND_VERSION`` versions what the
backend itself exchanges, checked in the bootstrap lookup and in every room request.

Backend versions:
    1: prefill ranks register at the bootstrap server; decode sends a room request
       (its page indices) to the prefill rank's side channel; prefill writes pages with
       one notification per chunk; statuses and pings on the side channels; prefill
       tells decode when a room that failed has no write in flight (``RoomQuiet``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from transfer_engine.control.messages import SMALL, Message, message

__all__ = ["BACKEND_VERSION", "PrefillRegister", "PrefillLookup", "PrefillInfo",
           "RoomRequest", "RoomStatus", "RoomQuiet", "Ping"]

BACKEND_VERSION = 1


@message
@dataclass(frozen=True, slots=True)
class PrefillRegister(Message):
    """Prefill rank -> bootstrap server: where rank ``rank`` is reached and what its KV
    looks like (``compat``: the factors both sides must share)."""

    kind: ClassVar[str] = "sglang/register"
    max_bytes: ClassVar[int] = 256 << 10
    rank: int = 0
    engine_name: str = ""
    engine_endpoint: str = ""
    channel: str = ""  # the rank's side channel (room requests, statuses, pings)
    version: int = BACKEND_VERSION
    compat: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class PrefillLookup(Message):
    """Decode rank -> bootstrap server: who is prefill rank ``rank``?"""

    kind: ClassVar[str] = "sglang/lookup"
    max_bytes: ClassVar[int] = SMALL
    rank: int = 0


@message
@dataclass(frozen=True, slots=True)
class PrefillInfo(Message):
    """Bootstrap server -> decode rank: the registration of the rank asked for."""

    kind: ClassVar[str] = "sglang/prefill"
    max_bytes: ClassVar[int] = 256 << 10
    rank: int = 0
    engine_name: str = ""
    engine_endpoint: str = ""
    channel: str = ""
    version: int = BACKEND_VERSION
    compat: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class RoomRequest(Message):
    """Decode rank -> prefill rank: write the KV of ``room`` into these pages.

    ``kv_pages``: little-endian int32 page indices, in token order; ``aux_index`` the
    metadata-buffer row (-1: none); ``epoch`` changes when decode re-registers its
    buffers, so prefill reconnects to pick up the new segments."""

    kind: ClassVar[str] = "sglang/room"
    room: int = 0
    rank: int = 0
    decode_name: str = ""
    decode_endpoint: str = ""
    decode_channel: str = ""
    epoch: int = 0
    kv_pages: bytes = b""
    aux_index: int = -1
    decode_prefix_len: int = 0
    nonce: int = 0  # random per request; echoed in every chunk notification
    version: int = BACKEND_VERSION
    compat_hash: str = ""


@message
@dataclass(frozen=True, slots=True)
class RoomStatus(Message):
    """Either side -> the other's side channel, best effort.

    ``ok`` False: the room failed or was aborted on the sender's side, ``reason`` says
    why. ``ok`` True (prefill -> decode): every chunk was sent, ``chunks`` of them,
    and the last one carried no bytes (so no notification announces the total)."""

    kind: ClassVar[str] = "sglang/status"
    max_bytes: ClassVar[int] = 16 << 10
    room: int = 0
    nonce: int = 0  # the room request's: a status of an earlier use of the room is ignored
    ok: bool = False
    reason: str = ""
    chunks: int = 0


@message
@dataclass(frozen=True, slots=True)
class RoomQuiet(Message):
    """Prefill rank -> decode rank, once a room that failed (or that decode gave up)
    has no write in flight and will start none: decode may give its pages back
    (fences.py). ``clean``: every write of the room completed (its bytes landed);
    ``ticket``: the rail ticket id the room's writes went on (``b""``: none was
    posted), for decode's ``Engine.cut_covers``."""

    kind: ClassVar[str] = "sglang/quiet"
    max_bytes: ClassVar[int] = SMALL
    room: int = 0
    nonce: int = 0
    clean: bool = False
    ticket: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Liveness check of a side channel or the bootstrap server; answered with Ack."""

    kind: ClassVar[str] = "sglang/ping"
    max_bytes: ClassVar[int] = SMALL

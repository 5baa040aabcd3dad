"""Rooms: SGLang's ``bootstrap_room`` as each side tracks it, and chunk notifications."""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer_engine.connectors.sglang.messages import PrefillInfo
from transfer_engine.errors import ProtocolError, TransferError
from transfer_engine.handle import TransferHandle
from transfer_engine.layout import BlockLayout
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment

__all__ = ["MAX_ROOM", "MAX_NONCE", "MAX_TOKENS", "RemoteBuffers", "check_room",
           "note_payload", "parse_note", "PrefillEntry", "SendRoom", "RecvRoom"]

MAX_ROOM = (1 << 64) - 1
MAX_NONCE = (1 << 32) - 1  # a room request's nonce rides as u32 in every notification
MAX_TOKENS = (1 << 31) - 1  # token counts SGLang indexes with (decode_prefix_len)
RemoteBuffers = list[tuple[RemoteSegment, BlockLayout]]  # a peer's buffers, as pages
# Notification of one written chunk: prefix, room, the request's nonce, chunk number,
# chunk count (-1: more chunks follow). Decode counts chunks per room; the count comes
# with the last one; the nonce keeps a late chunk of an earlier use of the room out.
_NOTE = struct.Struct("<8sQIIi")
_NOTE_PREFIX = b"te-sgl1/"


def note_payload(room: int, nonce: int, seq: int, total: int) -> bytes:
    """The notification of chunk ``seq``; raises ``ProtocolError`` (not
    ``struct.error``) for a field that does not fit, so no caller sees a bare error."""
    try:
        return _NOTE.pack(_NOTE_PREFIX, room, nonce, seq, total)
    except struct.error as exc:
        raise ProtocolError(f"chunk notification of room {room} (nonce {nonce}, chunk "
                            f"{seq}, count {total}) does not fit: {exc}") from None


def parse_note(payload: bytes) -> tuple[int, int, int, int] | None:
    """``(room, nonce, chunk number, chunk count or -1)``, or None for another payload."""
    if len(payload) != _NOTE.size or not payload.startswith(_NOTE_PREFIX):
        return None
    _, room, nonce, seq, total = _NOTE.unpack(payload)
    return room, nonce, seq, total


def check_room(room: Any) -> int:
    """A bootstrap room as SGLang assigns it (an integer in [0, 2**64)); raises
    ``ProtocolError`` for anything else."""
    if isinstance(room, bool) or not isinstance(room, int | np.integer) \
            or not 0 <= int(room) <= MAX_ROOM:
        raise ProtocolError(f"bootstrap room must be an integer in [0, 2**64), got {room!r}")
    return int(room)



@dataclass
class PrefillEntry:
    """A decode rank's view of one prefill server rank (``prefill_info_table`` values;
    SGLang's decode scheduler reads ``dp_size`` and ``follow_bootstrap_room``)."""

    info: PrefillInfo
    dp_size: int = 1
    follow_bootstrap_room: bool = True

    @property
    def name(self) -> str:
        return self.info.engine_name

    @property
    def channel(self) -> str:
        return self.info.channel


@dataclass
class SendRoom:
    """Prefill side: where decode wants room ``room`` written.

    ``peer`` stays None (and the buffers empty) while decode's engine is being
    connected; ``error`` says why that failed (the room fails with it). Every write of
    the room is kept in ``writes`` until decode was told it ended (``RoomQuiet``)."""

    room: int
    peer: Peer | None
    decode_channel: str
    kv_pages: np.ndarray
    aux_index: int
    decode_prefix_len: int
    nonce: int
    kv_remote: RemoteBuffers
    aux_remote: RemoteBuffers
    claimed: float  # monotonic
    aborted: str | None = None
    error: TransferError | None = None
    # what fences.py needs to tell decode when the room's writes ended (manager's lock)
    writes: list[TransferHandle] = field(default_factory=list)
    posting: int = 0  # writes being posted right now
    stopped: bool = False  # the room takes no more writes
    late: bool = False  # decode's engine was connected for this room, after its request


@dataclass
class RecvRoom:
    """Decode side: what arrived for room ``room``."""

    room: int
    prefill: PrefillEntry
    nonce: int = field(default_factory=lambda: secrets.randbits(32))
    seen: set[int] = field(default_factory=set)
    total: int | None = None
    error: TransferError | None = None
    done: bool = False  # the receiver concluded; no pings needed

    @property
    def complete(self) -> bool:
        return self.total is not None and len(self.seen) >= self.total

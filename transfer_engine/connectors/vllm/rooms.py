"""Decode's staging segment for pushed KV and the rooms in it (see ``push.py``): each
room a range reserved for one request's push, used again only once that push has
landed wholly or its lease and a margin have passed."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer_engine.layout import BlockLayout
from transfer_engine.segment import Segment

__all__ = ["Room", "Staging", "copy_room", "room_offsets", "valid_room"]

Layers = Mapping[str, tuple[Segment, BlockLayout]]  # layer -> (its segment, its layout)

ALIGN = 4096
MAX_ROOMS = 4096  # rooms held by one decode worker at once
MAX_LEASE_S = 120.0  # a room is held at most this long, whatever prefill asks
MARGIN_S = 5.0  # after its lease, before a range not wholly landed is used again
ROOM_CHARS = (16, 128)  # an unguessable id: at least 16 characters


def valid_room(room: Any) -> bool:
    return isinstance(room, str) and ROOM_CHARS[0] <= len(room) <= ROOM_CHARS[1]


def room_offsets(layers: Layers, blocks: int) -> tuple[dict[str, int], int]:
    """Where each layer starts in a room of ``blocks`` blocks (layers by name, each
    layer's parts one after the other, each part's blocks in prompt order), and the
    room's size. Both sides compute it from layouts their compatibility check made
    equal."""
    out: dict[str, int] = {}
    offset = 0
    for name in sorted(layers):
        layout = layers[name][1]
        out[name] = offset
        offset += len(layout.parts) * blocks * layout.block_bytes
    return out, offset


def checked_int(fields: dict[str, Any], key: str, low: int, high: int) -> int:
    value = fields.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key} {value!r:.40}")
    return value


@dataclass(eq=False)
class Room:
    """A range of decode's staging reserved for one request's push."""

    room: str
    peer: str  # the engine that asked (checked to be the one at ``endpoint``)
    endpoint: str
    offset: int
    length: int
    gen: int
    blocks: int
    tokens: int
    prompt_hash: str
    layers: int
    expires: float  # monotonic
    granted: bool = False  # the asker proved to be the engine at its endpoint
    landed: set[int] = field(default_factory=set)  # layer indexes whose bytes are in
    abandoned: bool = False  # not used; its range waits for the push to land

    @property
    def whole(self) -> bool:
        return len(self.landed) == self.layers


class Staging:
    """Decode's staging segment and the rooms in it. Thread-safe: notifications come
    from the engine's threads, loads from the forward's."""

    def __init__(self, segment: Segment, layers: Layers,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.segment = segment
        self._layers = layers
        self._names = sorted(layers)
        self._clock = clock
        self._lock = threading.Condition()  # notified as pushes land
        self._free: list[tuple[int, int]] = [(0, segment.length)]  # (offset, length)
        self._rooms: dict[str, Room] = {}
        self._gen = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._rooms)

    def whole(self, room_id: str) -> bool:
        """Whether every layer of the room's push has landed."""
        with self._lock:
            room = self._rooms.get(room_id)
            return room is not None and room.whole

    def reserve(self, peer: str, fields: dict[str, Any]) -> Room:
        """A room for an ask from ``peer``; raises ValueError saying why not."""
        room = fields.get("room")
        if not valid_room(room):
            raise ValueError("room id is not a string of 16 to 128 characters")
        blocks = checked_int(fields, "blocks", 1, 1 << 20)
        tokens = checked_int(fields, "tokens", 1, 1 << 30)
        length = room_offsets(self._layers, blocks)[1]
        if fields.get("bytes") != length:
            raise ValueError(f"asks {fields.get('bytes')!r:.20} bytes for {blocks} blocks, "
                             f"which take {length} here")
        endpoint, digest = fields.get("endpoint"), fields.get("prompt_hash")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or \
                len(endpoint) > 512 or not isinstance(digest, str) or len(digest) > 128:
            raise ValueError("endpoint or prompt_hash malformed")
        lease = fields.get("lease_s")
        if isinstance(lease, bool) or not isinstance(lease, int | float) or \
                not math.isfinite(lease) or lease <= 0:
            raise ValueError(f"lease_s {lease!r:.20}")
        now = self._clock()
        with self._lock:
            self._sweep(now)
            if room in self._rooms:
                raise ValueError("room id already taken")
            if len(self._rooms) >= MAX_ROOMS:
                raise ValueError(f"{MAX_ROOMS} rooms held already")
            held = sum(r.length for r in self._rooms.values() if r.peer == peer)
            if held + length > self.segment.length // 2:
                raise ValueError("the peer holds half of the staging memory already")
            offset = self._take(-(-length // ALIGN) * ALIGN)
            if offset is None:
                raise ValueError(f"no {length} bytes free in the staging memory")
            self._gen += 1
            out = Room(room, peer, endpoint, offset, length, self._gen, blocks, tokens,
                       digest, len(self._names), now + min(float(lease), MAX_LEASE_S))
            self._rooms[room] = out
            return out

    def granted(self, room: Room) -> None:
        with self._lock:
            room.granted = True

    def drop(self, room: Room) -> None:
        """A room whose grant could not be given: nothing was written to it."""
        with self._lock:
            if self._rooms.get(room.room) is room:
                del self._rooms[room.room]
                self._give(room)

    def landed(self, peer: str, fields: dict[str, Any]) -> None:
        """A WRITE of some layers of a room landed."""
        with self._lock:
            room = self._rooms.get(fields.get("room"))  # type: ignore[arg-type]
            if room is None or room.peer != peer or fields.get("gen") != room.gen:
                self.refused += 1
                return
            layers = fields.get("layers")
            if not isinstance(layers, list):
                self.refused += 1
                return
            room.landed.update(i for i in layers if isinstance(i, int)
                               and not isinstance(i, bool) and 0 <= i < room.layers)
            if room.whole:
                self._lock.notify_all()
            if room.abandoned and room.whole:
                del self._rooms[room.room]
                self._give(room)

    def take(self, room_id: str, endpoint: str, prompt_hash: str, tokens: int,
             blocks: int, wait_s: float = 0.0) -> Room | None:
        """The room a load may copy from: granted, whole (waiting up to ``wait_s`` for
        its last layers to land), of the prefill at ``endpoint``, for this prompt,
        inside its lease. It is the caller's until :meth:`release`. A room that is not
        whole by then is abandoned (its range frees once its push lands); one that does
        not match is left alone."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.abandoned or not room.granted \
                    or room.endpoint != endpoint or room.prompt_hash != prompt_hash \
                    or room.tokens != tokens or room.blocks != blocks:
                return None
            if not room.whole and wait_s > 0:
                self._lock.wait_for(lambda: room.whole, wait_s)
            if self._clock() >= room.expires or not room.whole:
                room.abandoned = True
                return None
            del self._rooms[room_id]  # nobody else takes it
            return room

    def release(self, room: Room) -> None:
        with self._lock:
            self._give(room)

    def view(self, room: Room) -> np.ndarray:
        return np.frombuffer(self.segment.view(room.offset, room.length), dtype=np.uint8)

    def _sweep(self, now: float) -> None:
        for key, room in list(self._rooms.items()):
            # past its lease no load takes it; past the margin too no WRITE of its push
            # is still landing (prefill starts none after the lease)
            if now >= room.expires + (MARGIN_S if not room.whole else 0.0):
                del self._rooms[key]
                self._give(room)

    def _take(self, length: int) -> int | None:
        for i, (offset, size) in enumerate(self._free):
            if size >= length:
                if size == length:
                    del self._free[i]
                else:
                    self._free[i] = (offset + length, size - length)
                return offset
        return None

    def _give(self, room: Room) -> None:
        length = -(-room.length // ALIGN) * ALIGN
        free = sorted([*self._free, (room.offset, length)])
        merged: list[tuple[int, int]] = []
        for offset, size in free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged


def copy_room(view: np.ndarray, layers: Layers, room_blocks: int, first: int,
              local_ids: list[int]) -> int:
    """Copies a room's blocks ``first ..`` into ``local_ids`` of every layer (host
    memory); returns the bytes copied."""
    offsets, _ = room_offsets(layers, room_blocks)
    ids = np.asarray(local_ids, dtype=np.int64)
    n = len(ids)
    copied = 0
    for name in sorted(layers):
        seg, layout = layers[name]
        bb = layout.block_bytes
        whole = np.frombuffer(seg.view(), dtype=np.uint8)
        base = offsets[name]
        for k, part in enumerate(layout.parts):
            # part k of every block: bb bytes, one block_stride apart
            rows = np.lib.stride_tricks.as_strided(
                whole[layout.segment_offset + part:], shape=(layout.num_blocks, bb),
                strides=(layout.block_stride, 1), writeable=True)
            start = base + (k * room_blocks + first) * bb
            rows[ids] = view[start:start + n * bb].reshape(n, bb)
            copied += n * bb
    return copied

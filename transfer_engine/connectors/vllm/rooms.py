"""Decode's staging memory for pushed KV (see ``push.py``): a lane of it per prefill
worker that pushes here, each lane a segment of its own, and in a lane the rooms of that
worker's requests, which it places itself and announces with their bytes.

A lane is revoked by closing its segment: that waits for the writes into it and fails
every later one at decode, so the range can go to another worker (or afresh to the same
one) with no stale byte landing in it."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from transfer_engine.layout import BlockLayout
from transfer_engine.segment import Segment

__all__ = ["Lane", "Ranges", "Room", "Staging", "copy_room", "room_offsets", "valid_room"]

Layers = Mapping[str, tuple[Segment, BlockLayout]]  # layer -> (its segment, its layout)

ALIGN = 4096
MAX_ROOMS = 4096  # rooms held by one decode worker at once
MAX_LEASE_S = 120.0  # a room is held at most this long, whatever prefill asks
MARGIN_S = 5.0  # after a room's lease, before prefill writes over its range
LANE_BYTES = 64 << 20  # one prefill worker's lane of decode's staging
# a lane quiet this long, with no room of its worker's held, may go to another worker
LANE_IDLE_S = 60.0
ROOM_CHARS = (16, 128)  # an unguessable id: at least 16 characters


def valid_room(room: Any) -> TypeGuard[str]:
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


class Ranges:
    """First-fit ranges of ``[offset, offset + length)``, aligned; not thread-safe."""

    def __init__(self, offset: int, length: int) -> None:
        self._free: list[tuple[int, int]] = [(offset, length)] if length > 0 else []

    def take(self, length: int) -> int | None:
        length = -(-length // ALIGN) * ALIGN
        for i, (offset, size) in enumerate(self._free):
            if size >= length:
                if size == length:
                    del self._free[i]
                else:
                    self._free[i] = (offset + length, size - length)
                return offset
        return None

    def give(self, offset: int, length: int) -> None:
        length = -(-length // ALIGN) * ALIGN
        merged: list[tuple[int, int]] = []
        for start, size in sorted([*self._free, (offset, length)]):
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged


@dataclass(eq=False)
class Room:
    """One request's pushed KV in a lane: where, what it must hold, what has landed."""

    room: str
    peer: str  # the prefill engine whose lane it is in
    offset: int
    length: int
    blocks: int
    tokens: int
    prompt_hash: str
    layers: int
    expires: float  # monotonic
    landed: set[int] = field(default_factory=set)  # layer indexes whose bytes are in
    abandoned: bool = False  # a load found it not whole: never copied

    @property
    def whole(self) -> bool:
        return len(self.landed) == self.layers


@dataclass(eq=False)
class Lane:
    """A prefill worker's lane: its range of the staging memory, registered alone."""

    peer: str  # the prefill engine it is granted to
    offset: int  # in the staging memory
    length: int
    segment: Segment
    last: float  # monotonic: when granted, or when a push into it last landed


class Staging:
    """Decode's staging memory, its lanes and the rooms in them. Thread-safe:
    notifications come on the engine's threads, loads on the forward's, lane asks on
    the peers' pool.

    :param register: ``register(view, name)`` -> the lane's segment (the engine's).
    :param prefix: lane segments are named ``{prefix}/{k}.{generation}``.
    """

    def __init__(self, buf: np.ndarray, register: Callable[[np.ndarray, str], Segment],
                 layers: Layers, prefix: str, lane_bytes: int = LANE_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._buf = buf
        self._register = register
        self._prefix = prefix
        self._layers = layers
        self._names = sorted(layers)
        self._clock = clock
        self._lock = threading.Condition()  # notified as pushes land
        self.length = len(buf)
        self.lane_bytes = min(lane_bytes, self.length)
        self.lane_idle_s = LANE_IDLE_S
        self._free = Ranges(0, self.length // self.lane_bytes * self.lane_bytes
                            if self.lane_bytes else 0)
        self._lanes: dict[str, Lane] = {}  # prefill engine -> its lane
        self._rooms: dict[str, Room] = {}
        self._generation = itertools.count(1)
        self.refused = 0  # notes refused
        self.revoked = 0  # lanes taken back (from an idle worker, or on a new ask)

    def __len__(self) -> int:
        return len(self._rooms)

    def lanes(self) -> dict[str, tuple[str, int]]:
        """Prefill engine -> its lane's segment name and length."""
        with self._lock:
            return {p: (ln.segment.name, ln.length) for p, ln in self._lanes.items()}

    def lane(self, peer: str) -> tuple[str, int]:
        """A fresh lane for prefill engine ``peer``: a segment of its own, named back
        (with its length) in the grant. A worker asks only when it has none or dropped
        its own after a failure, so its old lane (rooms, writes and all) is revoked
        first. With none free, the lane idle longest (:attr:`lane_idle_s`, no room of
        its worker's held) is taken back. Raises ValueError when none can be had."""
        with self._lock:
            now = self._clock()
            old = self._lanes.pop(peer, None)
            offset = old.offset if old is not None else self._free.take(self.lane_bytes)
            if offset is None:
                old = self._idlest(now)
                if old is None:
                    raise ValueError(f"all {len(self._lanes)} lanes of the staging "
                                     "memory are taken")
                del self._lanes[old.peer]
                offset = old.offset
            if old is not None:
                for key in [k for k, r in self._rooms.items() if r.peer == old.peer]:
                    del self._rooms[key]
                self.revoked += 1
            name = f"{self._prefix}/{offset // self.lane_bytes}.{next(self._generation)}"
        if old is not None:
            try:  # waits for writes into it; every later one fails at our end
                old.segment.close()
            except Exception as exc:  # noqa: BLE001 - its range stays out of use
                raise ValueError(f"lane of {old.peer} not revoked: {exc}") from exc
        try:
            segment = self._register(self._buf[offset:offset + self.lane_bytes], name)
        except Exception:
            with self._lock:
                self._free.give(offset, self.lane_bytes)
            raise
        with self._lock:
            self._lanes[peer] = Lane(peer, offset, self.lane_bytes, segment, self._clock())
        return name, self.lane_bytes

    def _idlest(self, now: float) -> Lane | None:
        held = {r.peer for r in self._rooms.values() if now < r.expires}
        idle = [ln for ln in self._lanes.values()
                if ln.peer not in held and now - ln.last >= self.lane_idle_s]
        return min(idle, key=lambda ln: ln.last, default=None)

    def whole(self, room_id: str) -> bool:
        """Whether every layer of the room's push has landed."""
        with self._lock:
            room = self._rooms.get(room_id)
            return room is not None and room.whole

    def landed(self, peer: str, fields: dict[str, Any]) -> None:
        """A WRITE of some layers of a room landed; the first one places the room.
        Raises ValueError for a note that does not fit (counted in ``refused``)."""
        with self._lock:
            try:
                self._land(peer, fields)
            except ValueError:
                self.refused += 1
                raise

    def _land(self, peer: str, fields: dict[str, Any]) -> None:
        lane = self._lanes.get(peer)
        room_id = fields.get("room")
        if lane is None or not valid_room(room_id):
            raise ValueError("no lane of this peer's, or a malformed room id")
        blocks = checked_int(fields, "blocks", 1, 1 << 20)
        offset = checked_int(fields, "offset", 0, lane.length)  # in the lane
        length = room_offsets(self._layers, blocks)[1]
        if offset + length > lane.length:
            raise ValueError("the room runs past the peer's lane")
        offset += lane.offset
        tokens = checked_int(fields, "tokens", 1, 1 << 30)
        digest, layers = fields.get("prompt_hash"), fields.get("layers")
        lease = fields.get("lease_s")
        if not isinstance(digest, str) or len(digest) > 128 or not isinstance(layers, list) \
                or isinstance(lease, bool) or not isinstance(lease, int | float) \
                or not 0 < lease < math.inf:
            raise ValueError("prompt_hash, layers or lease_s malformed")
        room = self._rooms.get(room_id)  # type: ignore[arg-type]
        key = (peer, offset, blocks, tokens, digest)
        if room is not None and (room.peer, room.offset, room.blocks, room.tokens,
                                 room.prompt_hash) != key:
            raise ValueError("the room id is another room's")
        now = self._clock()
        lane.last = now
        if room is None:
            # the peer writes a new room over whatever of its own it held there
            for other in [r for r in self._rooms.values() if r.peer == peer
                          and r.offset < offset + length and offset < r.offset + r.length]:
                del self._rooms[other.room]
            if len(self._rooms) >= MAX_ROOMS:
                self._sweep(now)
                if len(self._rooms) >= MAX_ROOMS:
                    raise ValueError(f"{MAX_ROOMS} rooms held already")
            room = Room(room_id, peer, offset, length, blocks, tokens, digest,  # type: ignore[arg-type]
                        len(self._names), now + min(float(lease), MAX_LEASE_S))
            self._rooms[room.room] = room
        room.landed.update(i for i in layers if isinstance(i, int)
                           and not isinstance(i, bool) and 0 <= i < room.layers)
        if room.whole:
            if room.abandoned:
                del self._rooms[room.room]
            self._lock.notify_all()

    def take(self, room_id: str, peer: str, prompt_hash: str, tokens: int, blocks: int,
             wait_s: float = 0.0) -> Room | None:
        """The room a load may copy from: in the lane of ``peer`` (the engine at the
        params' prefill endpoint), for this prompt, inside its lease, whole (waiting up
        to ``wait_s`` for layers still landing). Taken once. A room not whole by then
        is abandoned, never copied; one that does not match is left alone."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.abandoned or room.peer != peer \
                    or room.prompt_hash != prompt_hash or room.tokens != tokens \
                    or room.blocks != blocks:
                return None
            if not room.whole and wait_s > 0:
                self._lock.wait_for(lambda: room.whole, wait_s)
            if self._clock() >= room.expires or not room.whole:
                room.abandoned = True
                return None
            del self._rooms[room_id]
            return room

    def view(self, room: Room) -> np.ndarray:
        return self._buf[room.offset:room.offset + room.length]

    def _sweep(self, now: float) -> None:
        for key in [k for k, r in self._rooms.items() if now >= r.expires]:
            del self._rooms[key]


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

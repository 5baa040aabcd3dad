"""Layer-wise push: prefill WRITEs each layer's blocks, as soon as its forward has
computed the layer, into a room decode reserved for the request in memory of its own
(its staging segment); decode copies them into its blocks when the request reaches it,
with no READ between its scheduler and the step's forward.

The room is decode's, not its blocks: with the first-token hand-off decode sees the
request only once prefill has sampled that token, long after the KV was computed, so
there are no blocks to write into yet. A room lives in one staging segment per decode
worker (``push_mib``), cut into ranges first-fit.

The exchange, on notifications between the two engines (authenticated like any):

1. the router names a room (an unguessable id) and decode's workers in prefill's
   kv_transfer_params (``push``); prefill's worker connects to decode's and *asks*
   for the room (bytes, blocks, the prompt's hash, its own endpoint, a lease);
2. decode reserves a range, connects back to the endpoint named and checks that the
   engine there is the one that asked, then *grants* the range with a generation;
3. prefill WRITEs each layer into the range once the layer is computed and the grant
   is in; each WRITE's notification names the layers it carried and the generation,
   and fires on decode once its bytes have landed (immediate counting);
4. decode's load finds the room whole, checks it against the request's params (the
   prefill endpoint, the prompt's hash, the tokens) and copies it into the blocks;
   anything else (not asked, not granted, not whole yet, another peer's, expired) and
   it READs from prefill's blocks as before, which prefill holds until told.

A range is used again only once every layer of its push has landed or its lease (and
a margin) has passed; prefill starts no WRITE after the grant's lease, so no late
write lands in a range that holds another request's KV, and a notification of an
older generation counts for nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from transfer_engine.connectors.vllm.config import MANIFEST_SEGMENT
from transfer_engine.connectors.vllm.rooms import (
    MAX_LEASE_S,
    MAX_ROOMS,
    Layers,
    Room,
    Staging,
    checked_int,
    copy_room,
    room_offsets,
)
from transfer_engine.descriptor import Blocks, Descriptor
from transfer_engine.engine import Engine
from transfer_engine.errors import TransferEngineError
from transfer_engine.segment import Segment

__all__ = ["PUSH_NOTE", "PUSH_SEGMENT", "PushSide", "PushSpec", "Pusher", "parse_push",
           "push_note"]

log = logging.getLogger(__name__)

PUSH_NOTE = b"te-vllm/push:"  # notification prefix of the exchange
PUSH_SEGMENT = "te-vllm/push"  # decode's staging segment
# how long a load waits for the last layers of a granted room still landing (a READ
# of the whole KV costs a few milliseconds more than that, on any link it waits for)
LAND_WAIT_S = 0.02
MAX_NOTE = 4096  # bytes of one push notification


def push_note(kind: str, **fields: Any) -> bytes:
    return PUSH_NOTE + bytes(msgpack.packb({"kind": kind, **fields}))


def parse_push(payload: bytes) -> dict[str, Any] | None:
    """A push notification's fields, or None when it is not one or is malformed."""
    if not payload.startswith(PUSH_NOTE) or len(payload) > MAX_NOTE:
        return None
    try:
        data = msgpack.unpackb(payload[len(PUSH_NOTE):])
    except (ValueError, msgpack.UnpackException):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("kind"), str) else None


# --- prefill: pushing ---------------------------------------------------------------

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


@dataclass(eq=False)
class _Push:
    spec: PushSpec
    peer: Any  # decode's RemoteKV, once connected
    started: float
    grant: tuple[int, int, float] | None = None  # offset, generation, deadline
    done: list[str] = field(default_factory=list)  # layers computed, in order
    sent: int = 0  # of those, written
    forward_done: bool = False


class Pusher:
    """Prefill's pushes in flight. The forward's thread reports layers as it computes
    them; grants come on an engine thread; WRITEs go from whichever finds both."""

    def __init__(self, engine: Engine, layers: Layers, scratch: Callable[[], Segment],
                 submit: Callable[..., Any], stats: dict[str, Any]) -> None:
        self._engine = engine
        self._layers = layers
        self._index = {name: i for i, name in enumerate(sorted(layers))}
        self._scratch = scratch
        self._submit = submit
        self._stats = stats
        self._lock = threading.Lock()
        self._pushes: dict[str, _Push] = {}  # room -> push
        self._step: list[_Push] = []  # pushes whose layers this forward computes

    def start(self, spec: PushSpec) -> _Push | None:
        """A push whose layers this step's forward computes (None: one for its room
        is under way already, or too many are); :meth:`ask` asks for its room."""
        now = time.monotonic()
        push = _Push(spec, None, now)
        with self._lock:
            for room, old in list(self._pushes.items()):
                if now - old.started > old.spec.lease_s:
                    del self._pushes[room]
            if spec.room in self._pushes or len(self._pushes) >= MAX_ROOMS:
                return None
            self._pushes[spec.room] = push
            self._step.append(push)
        self._stats["push_started"] += 1
        return push

    def ask(self, push: _Push, peer: Any) -> None:
        """Asks decode (``peer``, connected) for the push's room."""
        try:
            if peer.push is None or peer.slices is not None:
                raise ValueError("decode takes no pushes, or holds other KV heads")
            segment, size = peer.push
            _, length = room_offsets(self._layers, len(push.spec.block_ids))
            if length > size // 2:
                raise ValueError(f"{length} bytes do not fit decode's staging")
            push.peer = peer
            spec = push.spec
            self._engine.read(peer.peer, [(Descriptor(self._scratch(), 0, 1),
                                           Descriptor(peer.peer.segment(segment), 0, 1))],
                              notify=push_note("ask", room=spec.room, bytes=length,
                                               blocks=len(spec.block_ids),
                                               tokens=spec.num_tokens,
                                               prompt_hash=spec.prompt_hash,
                                               endpoint=self._engine.endpoint,
                                               lease_s=spec.lease_s))
        except Exception as exc:  # noqa: BLE001 - decode pulls instead
            self.end(push, f"not pushing to {push.spec.to}: {exc}")

    def granted(self, peer: str, fields: dict[str, Any]) -> None:
        """Decode's grant (an engine thread): writes what the forward has computed."""
        with self._lock:
            push = self._pushes.get(fields.get("room"))  # type: ignore[arg-type]
            if push is None or push.peer is None or push.peer.peer.name != peer:
                return
            try:
                offset = checked_int(fields, "offset", 0, 1 << 62)
                gen = checked_int(fields, "gen", 1, 1 << 62)
                expires = float(fields.get("expires_in", 0.0))
                length = room_offsets(self._layers, len(push.spec.block_ids))[1]
                if offset + length > push.peer.push[1] or not 0 < expires <= MAX_LEASE_S:
                    raise ValueError("outside decode's staging")
            except (TypeError, ValueError) as exc:
                log.warning("request %s: malformed grant from %s: %s", push.spec.request_id,
                            peer, exc)
                return
            push.grant = (offset, gen, time.monotonic() + expires - 1.0)
            ready = push.forward_done
        if ready:
            self._submit(self._flush, push)

    def layer_done(self, name: str) -> None:
        """The forward computed layer ``name`` of this step's pushes."""
        if not self._step or name not in self._index:
            return
        with self._lock:
            ready = []
            for push in self._step:
                push.done.append(name)
                if push.grant is not None:
                    ready.append(push)
        for push in ready:
            self._flush(push)

    def forward_done(self) -> None:
        """This step's forward is over: what is granted goes now, the rest when its
        grant comes."""
        with self._lock:
            step, self._step = self._step, []
            for push in step:
                push.forward_done = True
        for push in step:
            if push.grant is not None:
                self._flush(push)

    def _flush(self, push: _Push) -> None:
        with self._lock:
            grant = push.grant
            names = push.done[push.sent:]
            push.sent = len(push.done)
            last = push.forward_done and push.sent >= len(self._layers)
            if last and not names:  # every layer went before the forward's end
                self._pushes.pop(push.spec.room, None)
            if grant is None or not names or push.peer is None:
                push.sent -= len(names)  # they go once the grant is in
                return
        offset, gen, deadline = grant
        left = deadline - time.monotonic()
        if left <= 0:
            self.end(push, "its grant ran out")
            return
        try:
            self._engine.write(push.peer.peer, self._pairs(push, names, offset),
                               notify=push_note("layers", room=push.spec.room, gen=gen,
                                                layers=[self._index[n] for n in names]),
                               timeout=left)
            self._stats["push_bytes"] += sum(
                len(self._layers[n][1].parts) * self._layers[n][1].block_bytes
                for n in names) * len(push.spec.block_ids)
        except (TransferEngineError, ValueError) as exc:
            self.end(push, f"push failed: {exc}")
            return
        if last:
            with self._lock:
                self._pushes.pop(push.spec.room, None)

    def _pairs(self, push: _Push, names: list[str], offset: int) -> list[Blocks]:
        """A WRITE of the layers ``names`` of the request's blocks into its room."""
        ids = np.asarray(push.spec.block_ids, dtype=np.int64)
        n = len(ids)
        offsets, _ = room_offsets(self._layers, n)
        remote = push.peer.peer.segment(push.peer.push[0])
        by_segment: dict[int, tuple[Segment, list[np.ndarray], list[np.ndarray]]] = {}
        for name in names:
            seg, layout = self._layers[name]
            entry = by_segment.setdefault(id(seg), (seg, [], []))
            bb = layout.block_bytes
            for k, part in enumerate(layout.parts):
                entry[1].append(layout.segment_offset + part + ids * layout.block_stride)
                entry[2].append(offset + offsets[name] + (k * n + np.arange(n)) * bb)
        sizes = {layout.block_bytes for _, layout in self._layers.values()}
        if len(sizes) != 1:
            raise ValueError("layers of several block sizes")
        size = sizes.pop()
        return [Blocks(seg, remote, np.concatenate(loc), np.concatenate(rem), size)
                for seg, loc, rem in by_segment.values()]

    def end(self, push: _Push, why: str) -> None:
        with self._lock:
            self._pushes.pop(push.spec.room, None)
            if push in self._step:
                self._step.remove(push)
        self._stats["push_failed"] += 1
        log.warning("request %s: %s; decode reads the blocks instead",
                    push.spec.request_id, why)

    def __len__(self) -> int:
        return len(self._pushes)


# --- a worker's side of the exchange --------------------------------------------------

class PushSide:
    """One worker's part in pushes: decode's staging and its answers to asks (where it
    takes pushes), prefill's pushes. The worker owns the engine, the peers' table and
    the scratch bytes a notification's READ lands in; this holds no thread of its own
    (the peers' pool runs what waits on the network).

    :param connect: ``connect(endpoint)`` -> the handshake's future (a ``RemoteKV``).
    :param settle: ``settle(endpoint, future)`` -> the peer, kept for later loads.
    :param submit: runs a callable on the peers' pool.
    :param staging_bytes: decode's staging memory (0: takes no pushes).
    """

    def __init__(self, engine: Engine, layers: Layers, connect: Callable[[str], Any],
                 settle: Callable[[str, Any], Any], submit: Callable[..., Any],
                 scratch: Callable[[], Segment], stats: dict[str, Any], rank: int,
                 tp_size: int, staging_bytes: int, timeout: float) -> None:
        self._engine = engine
        self._connect, self._settle, self._submit = connect, settle, submit
        self._scratch = scratch
        self._stats = stats
        self._rank, self._tp = rank, tp_size
        self._timeout = timeout
        self._layers = layers
        host = all(seg.device == "cpu" for seg, _ in layers.values())
        if not host:
            log.info("KV in device memory: this worker neither pushes nor takes pushes "
                     "(decode reads the blocks)")
        self.staging: Staging | None = None
        if host and staging_bytes > 0:
            buf = np.zeros(staging_bytes, dtype=np.uint8)
            self._buf = buf  # alive while registered
            self.staging = Staging(engine.register(buf, name=PUSH_SEGMENT), layers)
        self.pusher = Pusher(engine, layers, scratch, submit, stats) if host else None

    @property
    def manifest_entry(self) -> tuple[str, int] | None:
        return (PUSH_SEGMENT, self.staging.segment.length) if self.staging is not None \
            else None

    # notifications (an engine thread)
    def on_note(self, peer: str, fields: dict[str, Any]) -> None:
        kind = fields["kind"]
        if kind == "layers" and self.staging is not None:
            self.staging.landed(peer, fields)
        elif kind == "grant" and self.pusher is not None:
            self.pusher.granted(peer, fields)
        elif kind == "ask" and self.staging is not None:
            try:
                room = self.staging.reserve(peer, fields)
            except ValueError as exc:
                self._stats["push_refused"] += 1
                log.warning("push asked by %s refused: %s", peer, exc)
                return
            self._submit(self._grant, room)

    def _grant(self, room: Room) -> None:
        """Connects to the endpoint the asker named; grants the room only if the engine
        there is the asker (so a load later trusts the room as that endpoint's)."""
        assert self.staging is not None
        try:
            fut = self._connect(room.endpoint)
            fut.result(self._timeout)
            info = self._settle(room.endpoint, fut)
            if info.peer.name != room.peer:
                raise ValueError(f"the engine at {room.endpoint} is {info.peer.name!r}, "
                                 f"not the asker {room.peer!r}")
            self.staging.granted(room)
            self._engine.read(info.peer, [(Descriptor(self._scratch(), 0, 1),
                                           Descriptor(info.peer.segment(
                                               MANIFEST_SEGMENT), 0, 1))],
                              notify=push_note("grant", room=room.room, offset=room.offset,
                                               gen=room.gen, expires_in=max(
                                                   0.001, room.expires - time.monotonic())))
        except Exception as exc:  # noqa: BLE001 - the room is not given; decode reads
            self.staging.drop(room)
            self._stats["push_refused"] += 1
            log.warning("push room for %s not granted: %s", room.peer, exc)

    # prefill
    def start(self, specs: list[PushSpec]) -> None:
        """Asks decode for each request's room (prefill, before the forward)."""
        if self.pusher is None:
            return
        for spec in specs:
            if len(spec.to) != self._tp:  # a rank pushes to the rank of its number
                log.info("request %s: decode runs %d ranks, prefill %d: not pushing",
                         spec.request_id, len(spec.to), self._tp)
                continue
            push = self.pusher.start(spec)
            if push is not None:
                self._submit(self._ask, push, spec.to[self._rank])

    def _ask(self, push: Any, endpoint: str) -> None:
        assert self.pusher is not None
        try:
            fut = self._connect(endpoint)
            fut.result(self._timeout)
            info = self._settle(endpoint, fut)
        except Exception as exc:  # noqa: BLE001 - decode reads the blocks instead
            self.pusher.end(push, f"decode at {endpoint} not reached: {exc}")
            return
        self.pusher.ask(push, info)

    def layer_done(self, name: str) -> None:
        if self.pusher is not None:
            self.pusher.layer_done(name)

    def forward_done(self) -> None:
        if self.pusher is not None:
            self.pusher.forward_done()

    # decode
    def take(self, spec: Any, endpoint: str) -> bool:
        """Copies a load's blocks out of its pushed room, if that room is whole and
        this request's; False: read them from prefill instead."""
        if self.staging is None or not spec.room:
            return False
        room = self.staging.take(spec.room, endpoint, spec.prompt_hash, spec.num_tokens,
                                 spec.room_blocks, LAND_WAIT_S)
        if room is None:
            return False
        try:
            if spec.first_block + len(spec.local_block_ids) > room.blocks:
                return False
            self._stats["recv_bytes"] += copy_room(
                self.staging.view(room), self._layers, room.blocks, spec.first_block,
                spec.local_block_ids)
            self._stats["recv_pushed"] += 1
            return True
        except (IndexError, ValueError) as exc:  # a block id outside the cache: read
            log.error("request %s: pushed KV not copied: %s", spec.request_id, exc)
            return False
        finally:
            self.staging.release(room)

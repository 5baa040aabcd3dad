"""Layer-wise push: prefill WRITEs each layer's blocks, as soon as its forward has
computed the layer, into memory of decode's own (its staging memory); decode copies
them into its blocks when the request reaches it, with no READ between its scheduler
and the step's forward.

The bytes go to decode's staging, not its blocks: with the first-token hand-off decode
sees the request only once prefill has sampled that token, after the KV was computed,
so there are no blocks to write into yet. The staging memory (``push_mib`` per decode
worker) is cut into lanes of 64 MiB, one per prefill worker that pushes there, each
registered as a segment of its own.

The exchange, on notifications between the two engines (authenticated like any):

1. once per pair of workers: prefill's worker connects to decode's and asks for a
   *lane*, naming its own endpoint; decode connects back, checks that the engine there
   is the one that asked, and grants a lane, naming its segment (or refuses: none
   left, and none idle long enough to take back). A worker asks again only after a
   push failed; decode then revokes its old lane (closing the segment fails every
   write still coming) and grants a fresh one;
2. per request: the router names a room (an unguessable id) and decode's workers in
   prefill's kv_transfer_params (``push``); prefill places the room in its lane and
   WRITEs each layer there once its forward has computed it. Each WRITE's
   notification names the room, where it lies, what it holds (blocks, tokens, the
   prompt's hash), its lease and the layers the WRITE carried, and fires on decode
   once those bytes have landed (immediate counting), so no per-request round trip
   waits on either side's Python;
3. decode's load finds the room whole in the lane of the engine at the params' prefill
   endpoint, for the same prompt, inside its lease, and copies it into the blocks,
   once; anything else (no lane, not whole in time, another prompt's, expired, taken)
   and it READs from prefill's blocks, which prefill holds until told.

Prefill writes a range of its lane again only once every WRITE into it has ended and
decode has said it read the request (or the room's lease and a margin have passed);
decode never copies a room past its lease, and a room overwritten by its own lane's
owner is dropped, so no late write lands in bytes a load still copies. A lane taken
back is a closed segment: a write still aimed at it fails at decode, and its worker
asks afresh at its next push.
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
from transfer_engine.connectors.vllm.metadata import PushSpec, checked_endpoint
from transfer_engine.connectors.vllm.rooms import (
    ALIGN,
    MARGIN_S,
    MAX_ROOMS,
    Layers,
    Ranges,
    Staging,
    copy_room,
    room_offsets,
)
from transfer_engine.descriptor import Blocks
from transfer_engine.engine import Engine
from transfer_engine.errors import TransferEngineError
from transfer_engine.segment import Segment

__all__ = ["PUSH_NOTE", "PUSH_SEGMENT", "PushSide", "PushSpec", "Pusher", "parse_push",
           "push_note"]

log = logging.getLogger(__name__)

PUSH_NOTE = b"te-vllm/push:"  # notification prefix of the exchange
PUSH_SEGMENT = "te-vllm/push"  # decode's door for lane asks; lanes: PUSH_SEGMENT/k.gen
# how long a load waits for the last layers of a room still landing (a READ of the
# whole KV costs a few milliseconds more than that, on any link it waits for)
LAND_WAIT_S = 0.02
LANE_RETRY_S = 30.0  # a decode worker that refused a lane is asked again after this
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

@dataclass(eq=False)
class _Lane:
    """Prefill's lane at one decode worker: asked for, then granted or refused."""

    endpoint: str
    peer: Any = None  # decode's RemoteKV, once connected
    granted: bool = False  # decode named the lane's segment
    remote: Any = None  # that segment (a RemoteSegment), once looked up
    ranges: Ranges | None = None  # ready: where in it this worker's rooms may go
    refused: float = 0.0  # time.monotonic() when refused (asked again a while later)
    waiting: list[_Push] = field(default_factory=list)  # pushes before the grant


@dataclass(eq=False)
class _Push:
    spec: PushSpec
    lane: _Lane
    started: float
    length: int
    offset: int | None = None  # the room, once placed in the lane
    done: list[str] = field(default_factory=list)  # layers computed, in order
    sent: int = 0  # of those, written
    forward_done: bool = False
    ended: bool = False  # nothing more will be written
    read: bool = False  # decode said it has the request's KV
    handles: list[Any] = field(default_factory=list)


class Pusher:
    """Prefill's lanes and pushes. The forward's thread reports layers as it computes
    them; grants come on an engine thread; WRITEs go from whichever finds both."""

    def __init__(self, engine: Engine, layers: Layers, tell: Callable[..., Any],
                 submit: Callable[..., Any], stats: dict[str, Any],
                 forget: Callable[[str], None] = lambda endpoint: None) -> None:
        self._engine = engine
        self._forget = forget
        self._layers = layers
        self._index = {name: i for i, name in enumerate(sorted(layers))}
        self._tell = tell
        self._submit = submit
        self._stats = stats
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}  # decode endpoint -> lane
        self._pushes: dict[str, _Push] = {}  # request id -> push, until its range is free
        self._step: list[_Push] = []  # pushes whose layers this forward computes
        sizes = {layout.block_bytes for _, layout in layers.values()}
        self._block_bytes = sizes.pop() if len(sizes) == 1 else 0

    def __len__(self) -> int:
        return len(self._pushes)

    def start(self, spec: PushSpec, endpoint: str) -> _Lane | None:
        """A push whose layers this step's forward computes; returns a lane to ask for
        (a new one), else None."""
        length = room_offsets(self._layers, len(spec.block_ids))[1]
        with self._lock:
            self._reap_locked()
            if spec.request_id in self._pushes or len(self._pushes) >= MAX_ROOMS \
                    or not self._block_bytes:
                return None
            lane = self._lanes.get(endpoint)
            if lane is not None and lane.refused:
                if time.monotonic() - lane.refused < LANE_RETRY_S:
                    return None
                lane = None  # asked again: decode may have lanes free by now
            new = lane is None
            if lane is None:
                lane = self._lanes[endpoint] = _Lane(endpoint)
            push = _Push(spec, lane, time.monotonic(), length)
            self._pushes[spec.request_id] = push
            self._step.append(push)
            if lane.ranges is None:
                lane.waiting.append(push)
            else:
                self._place(push)
        self._stats["push_started"] += 1
        return lane if new else None

    def ask(self, lane: _Lane, peer: Any) -> None:
        """Asks decode (``peer``, connected) for a lane."""
        try:
            if peer.push is None or peer.slices is not None:
                raise ValueError("decode takes no pushes, or holds other KV heads")
            lane.peer = peer
            self._tell(peer.peer, peer.push[0],
                       push_note("ask-lane", endpoint=self._engine.endpoint))
        except (TransferEngineError, ValueError) as exc:
            self.refused(lane, str(exc))

    def refused(self, lane: _Lane, why: str) -> None:
        with self._lock:
            lane.refused = time.monotonic()
            waiting, lane.waiting = lane.waiting, []
        for push in waiting:
            self.end(push, f"no lane at {lane.endpoint}: {why}")

    def granted(self, peer: str, fields: dict[str, Any]) -> None:
        """Decode's answer to a lane ask (an engine thread): the lane's segment is
        looked up on the pool (it may take a round trip)."""
        with self._lock:
            lane = next((ln for ln in self._lanes.values() if ln.peer is not None
                         and ln.peer.peer.name == peer and not ln.granted
                         and not ln.refused), None)
            if lane is None:
                return
            lane.granted = True
        name, length = fields.get("segment"), fields.get("length")
        if not isinstance(name, str) or not name or len(name) > 256 \
                or isinstance(length, bool) or not isinstance(length, int) \
                or not 0 < length <= 1 << 40:
            why = str(fields.get("why", ""))[:200] if length == 0 else "malformed grant"
            self.refused(lane, why or "refused")
            return
        self._submit(self._ready, lane, name, length)

    def _ready(self, lane: _Lane, name: str, length: int) -> None:
        """Looks the granted segment up; the pushes waiting for the lane go now."""
        try:
            remote = lane.peer.peer.segment(name)
            if remote.length < length:
                raise ValueError(f"segment {name} holds {remote.length} bytes, not "
                                 f"{length}")
        except (TransferEngineError, ValueError) as exc:
            self.refused(lane, f"granted lane not found: {exc}")
            return
        with self._lock:
            lane.remote = remote
            lane.ranges = Ranges(0, length)
            waiting, lane.waiting = lane.waiting, []
            for push in waiting:
                self._place(push)
            ready = [p for p in waiting if p.forward_done and p.offset is not None]
        for push in ready:
            self._flush(push)

    def _place(self, push: _Push) -> None:
        """Puts a push's room in its lane (under the lock); one that does not fit is
        not pushed."""
        assert push.lane.ranges is not None
        push.offset = push.lane.ranges.take(push.length)
        if push.offset is None:
            push.ended = True
            self._step_drop(push)
            self._stats["push_failed"] += 1
            log.info("request %s: no room in the lane at %s; decode reads the blocks",
                     push.spec.request_id, push.lane.endpoint)

    def _step_drop(self, push: _Push) -> None:
        if push in self._step:
            self._step.remove(push)

    def layer_done(self, name: str) -> None:
        """The forward computed layer ``name`` of this step's pushes."""
        if not self._step or name not in self._index:
            return
        with self._lock:
            ready = []
            for push in self._step:
                if name in push.done:
                    continue
                push.done.append(name)
                # in groups of 1, 1, 2, 4, 8... layers: each WRITE's posting takes the
                # forward's thread (and Python's lock) a while, so fewer of them
                if push.offset is not None and len(push.done) - push.sent >= max(
                        1, push.sent):
                    ready.append(push)
        for push in ready:
            self._flush(push)

    def forward_done(self) -> None:
        """This step's forward is over: what is placed goes now, the rest once its
        lane is granted."""
        with self._lock:
            step, self._step = self._step, []
            for push in step:
                push.forward_done = True
        for push in step:
            self._flush(push)

    def _flush(self, push: _Push) -> None:
        with self._lock:
            if push.offset is None or push.ended:
                return
            names = push.done[push.sent:]
            push.sent = len(push.done)
            if push.forward_done and push.sent >= len(self._layers):
                push.ended = True
            if not names:
                return
        spec = push.spec
        left = spec.lease_s - (time.monotonic() - push.started)
        if left <= 0:
            self.end(push, "its lease ran out before the push")
            return
        try:
            handle = self._engine.write(
                push.lane.peer.peer, self._pairs(push, names),
                notify=push_note("layers", room=spec.room, offset=push.offset,
                                 blocks=len(spec.block_ids), tokens=spec.num_tokens,
                                 prompt_hash=spec.prompt_hash, lease_s=spec.lease_s,
                                 layers=[self._index[n] for n in names]),
                timeout=left)
        except (TransferEngineError, ValueError) as exc:
            with self._lock:  # the next push asks afresh (decode may have restarted)
                if self._lanes.get(push.lane.endpoint) is push.lane:
                    del self._lanes[push.lane.endpoint]
            self._forget(push.lane.endpoint)
            self.end(push, f"push failed: {exc}")
            return
        with self._lock:
            push.handles.append(handle)
        self._stats["push_bytes"] += sum(
            len(self._layers[n][1].parts) for n in names) * self._block_bytes * len(
                spec.block_ids)

    def _pairs(self, push: _Push, names: list[str]) -> list[Blocks]:
        """A WRITE of the layers ``names`` of the request's blocks into its room."""
        assert push.offset is not None
        ids = np.asarray(push.spec.block_ids, dtype=np.int64)
        n = len(ids)
        offsets, _ = room_offsets(self._layers, n)
        remote = push.lane.remote
        by_segment: dict[int, tuple[Segment, list[np.ndarray], list[np.ndarray]]] = {}
        bb = self._block_bytes
        for name in names:
            seg, layout = self._layers[name]
            entry = by_segment.setdefault(id(seg), (seg, [], []))
            for k, part in enumerate(layout.parts):
                entry[1].append(layout.segment_offset + part + ids * layout.block_stride)
                entry[2].append(push.offset + offsets[name] + (k * n + np.arange(n)) * bb)
        return [Blocks(seg, remote, np.concatenate(loc), np.concatenate(rem), bb)
                for seg, loc, rem in by_segment.values()]

    def end(self, push: _Push, why: str) -> None:
        """Writes no more of a push (decode reads those blocks)."""
        with self._lock:
            push.ended = True
            self._step_drop(push)
        self._stats["push_failed"] += 1
        log.warning("request %s: %s; decode reads the blocks instead",
                    push.spec.request_id, why)

    def read(self, request_id: str) -> None:
        """Decode said it has the request's KV: its room's range may be written again
        once the push's WRITEs have ended."""
        with self._lock:
            push = self._pushes.get(request_id)
            if push is not None:
                push.read = True
            self._reap_locked()

    def reap(self) -> None:
        with self._lock:
            self._reap_locked()

    def _reap_locked(self) -> None:
        now = time.monotonic()
        for rid, push in list(self._pushes.items()):
            if self._lanes.get(push.lane.endpoint) is push.lane and any(
                    h.done() and h.error is not None for h in push.handles):
                # decode took the lane back (or lost it): the next push asks afresh
                del self._lanes[push.lane.endpoint]
                log.info("push lane at %s dropped after a failed write",
                         push.lane.endpoint)
            expired = now - push.started > push.spec.lease_s + MARGIN_S
            if not expired and not (push.ended and push.read
                                    and all(h.done() for h in push.handles)):
                continue
            del self._pushes[rid]
            self._step_drop(push)
            if push in push.lane.waiting:
                push.lane.waiting.remove(push)
            if push.offset is not None and push.lane.ranges is not None:
                push.lane.ranges.give(push.offset, push.length)


# --- a worker's side of the exchange --------------------------------------------------

class PushSide:
    """One worker's part in pushes: decode's staging and its answers to lane asks
    (where it takes pushes), prefill's pushes. The worker owns the engine and the
    peers' table; this runs no thread of its own (the peers' pool runs what waits on
    the network).

    :param connect: ``connect(endpoint)`` -> the handshake's future (a ``RemoteKV``).
    :param settle: ``settle(endpoint, future)`` -> the peer, kept for later loads.
    :param known: ``known(endpoint)`` -> the peer if connected, else None.
    :param submit: runs a callable on the peers' pool.
    :param tell: ``tell(peer, segment, payload)``: a notification to a peer.
    :param staging_bytes: decode's staging memory (0: takes no pushes).
    :param forget: ``forget(endpoint)``: the next connection there is made afresh.
    """

    def __init__(self, engine: Engine, layers: Layers, connect: Callable[[str], Any],
                 settle: Callable[[str, Any], Any], known: Callable[[str], Any],
                 submit: Callable[..., Any], tell: Callable[..., Any],
                 stats: dict[str, Any], rank: int, tp_size: int, staging_bytes: int,
                 timeout: float, forget: Callable[[str], None] = lambda e: None) -> None:
        self._engine = engine
        self._connect, self._settle, self._known = connect, settle, known
        self._submit = submit
        self._tell = tell
        self._stats = stats
        self._rank, self._tp = rank, tp_size
        self._timeout = timeout
        self._layers = layers
        self._granting: set[str] = set()  # peers whose lane ask is being answered
        host = all(seg.device == "cpu" for seg, _ in layers.values())
        if not host:
            log.info("KV in device memory: this worker neither pushes nor takes pushes "
                     "(decode reads the blocks)")
        self.staging: Staging | None = None
        if host and staging_bytes > 0:
            # lane asks come as notes on a small door of its own; each granted lane is
            # a segment of its own (see rooms.py)
            self._door = np.zeros(ALIGN, dtype=np.uint8)
            self._buf = np.zeros(staging_bytes, dtype=np.uint8)  # alive while registered
            engine.register(self._door, name=PUSH_SEGMENT)
            self.staging = Staging(self._buf, lambda view, name: engine.register(
                view, name=name), layers, PUSH_SEGMENT)
        self.pusher = Pusher(engine, layers, tell, submit, stats,
                             forget) if host else None

    @property
    def manifest_entry(self) -> tuple[str, int] | None:
        if self.staging is None:
            return None
        return PUSH_SEGMENT, len(self._door)

    def _peer(self, endpoint: str) -> Any:
        """The worker at ``endpoint``, connected (on the pool: it waits); raises what
        broke the handshake."""
        fut = self._connect(endpoint)
        fut.result(self._timeout)
        return self._settle(endpoint, fut)

    # notifications (an engine thread)
    def on_note(self, peer: str, fields: dict[str, Any]) -> None:
        kind = fields["kind"]
        if kind == "layers" and self.staging is not None:
            try:
                self.staging.landed(peer, fields)
            except ValueError as exc:
                log.warning("pushed KV from %s refused: %s", peer, exc)
        elif kind == "lane" and self.pusher is not None:
            self.pusher.granted(peer, fields)
        elif kind == "ask-lane" and self.staging is not None:
            try:
                endpoint = checked_endpoint(fields.get("endpoint"), "endpoint")
            except ValueError:
                return
            if peer in self._granting:
                return
            self._granting.add(peer)
            self._submit(self._grant, peer, endpoint)

    def _grant(self, asker: str, endpoint: str) -> None:
        """Connects to the endpoint the asker named and grants it a lane only if the
        engine there is the asker (a load later trusts a room as that endpoint's)."""
        assert self.staging is not None
        try:
            info = self._peer(endpoint)
            if info.peer.name != asker:
                raise ValueError(f"the engine at {endpoint} is {info.peer.name!r}, not "
                                 f"{asker!r}")
            try:
                segment, length = self.staging.lane(asker)
                answer = push_note("lane", segment=segment, length=length)
            except ValueError as exc:
                self._stats["push_refused"] += 1
                answer = push_note("lane", segment="", length=0, why=str(exc))
            self._tell(info.peer, MANIFEST_SEGMENT, answer)
        except Exception as exc:  # noqa: BLE001 - no lane: decode reads
            self._stats["push_refused"] += 1
            log.warning("push lane for %s not granted: %s", asker, exc)
        finally:
            self._granting.discard(asker)

    # prefill
    def start(self, specs: list[PushSpec]) -> None:
        """Places each request this step prefills whole in its lane at decode (asking
        for the lane first where there is none)."""
        if self.pusher is None:
            return
        for spec in specs:
            if len(spec.to) != self._tp:  # a rank pushes to the rank of its number
                log.info("request %s: decode runs %d ranks, prefill %d: not pushing",
                         spec.request_id, len(spec.to), self._tp)
                continue
            lane = self.pusher.start(spec, spec.to[self._rank])
            if lane is not None:
                self._submit(self._ask, lane)

    def _ask(self, lane: Any) -> None:
        assert self.pusher is not None
        try:
            info = self._peer(lane.endpoint)
        except Exception as exc:  # noqa: BLE001 - decode reads the blocks instead
            self.pusher.refused(lane, f"decode not reached: {exc}")
            return
        self.pusher.ask(lane, info)

    def layer_done(self, name: str) -> None:
        if self.pusher is not None:
            self.pusher.layer_done(name)

    def forward_done(self) -> None:
        if self.pusher is not None:
            self.pusher.forward_done()
            self.pusher.reap()

    def read(self, request_id: str) -> None:
        if self.pusher is not None:
            self.pusher.read(request_id)

    # decode
    def take(self, spec: Any, endpoint: str) -> bool:
        """Copies a load's blocks out of its pushed room, if that room is whole and
        this request's; False: read them from prefill instead."""
        info = self._known(endpoint)  # (None, or several prefill ranks: never pushed)
        if self.staging is None or not spec.room or getattr(info, "peer", None) is None:
            return False
        room = self.staging.take(spec.room, info.peer.name, spec.prompt_hash,
                                 spec.num_tokens, spec.room_blocks, LAND_WAIT_S)
        if room is None or spec.first_block + len(spec.local_block_ids) > room.blocks:
            return False
        try:
            self._stats["recv_bytes"] += copy_room(
                self.staging.view(room), self._layers, room.blocks, spec.first_block,
                spec.local_block_ids)
        except (IndexError, ValueError) as exc:  # a block id outside the cache: read
            log.error("request %s: pushed KV not copied: %s", spec.request_id, exc)
            return False
        self._stats["recv_pushed"] += 1
        return True

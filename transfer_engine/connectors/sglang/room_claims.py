"""What a rank answers on its side channel (the service thread): pings, room statuses
(decode's aborts reach prefill, prefill's outcome reaches decode), prefill's word that a
failed room's writes ended (decode), and, on prefill, decode's room requests, checked
and claimed for the sender that will write them, whose writes it posts and tracks until
decode was told they ended (fences.py).

The service thread never waits on the network: every field of a room request is
checked at the door, and a decode engine this rank has not connected to yet (or whose
buffers changed) is connected on a small pool (more wait for its threads), so pings
and other rooms are never queued behind a slow or silent decode endpoint. A connect
that fails fails only the rooms that named it: their claims carry the error (the
prefill sender fails with it) and decode is told through its side channel."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from transfer_engine.connectors.sglang.config import SGLangBackendConfig
from transfer_engine.connectors.sglang.fences import Drains, Fences
from transfer_engine.connectors.sglang.kv_buffers import remote_buffers
from transfer_engine.connectors.sglang.messages import (
    BACKEND_VERSION,
    Ping,
    RoomQuiet,
    RoomRequest,
    RoomStatus,
)
from transfer_engine.connectors.sglang.rooms import (
    MAX_NONCE,
    MAX_TOKENS,
    RecvRoom,
    RemoteBuffers,
    SendRoom,
    check_room,
)
from transfer_engine.control.messages import Ack, Message
from transfer_engine.descriptor import Blocks
from transfer_engine.engine import Engine
from transfer_engine.errors import (
    BusyError,
    ClosedError,
    ConnectError,
    InvalidDescriptorError,
    ProtocolError,
    RemoteError,
    TransferEngineError,
    TransferError,
)
from transfer_engine.handle import TransferHandle
from transfer_engine.peer import Peer

__all__ = ["RoomClaims", "Connected", "CONNECT_THREADS", "MAX_CONNECTS",
           "MAX_CONNECTS_PER_PEER", "MAX_NAME_CHARS", "check_request", "check_pages"]

log = logging.getLogger(__name__)

CONNECT_THREADS = 8  # decode engines being connected at once (the pool's threads)
MAX_CONNECTS = 256  # of them connected or waiting for a thread, in all: then refused
MAX_CONNECTS_PER_PEER = 2  # of them for one decode engine name
MAX_NAME_CHARS = 512  # longest engine name or endpoint a room request may carry
MAX_PAGE = (1 << 31) - 1  # page indices and the metadata row are int32 on both sides
MAX_TICKET = 64  # bytes of a rail ticket id a RoomQuiet may name
RECENT_ROOMS = 4096  # prefill: rooms SGLang let go, kept to answer a late abort

Connected = tuple[Peer, RemoteBuffers, RemoteBuffers]  # a decode engine and its buffers


def _check_int(msg: RoomRequest, name: str, low: int, high: int) -> int:
    """Field ``name`` of ``msg`` as an int in ``[low, high]``; ``ProtocolError`` else."""
    value = getattr(msg, name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"room request: {name} must be an integer in [{low}, {high}], "
                            f"got {value!r}"[:300], peer=msg.decode_name)
    return value


def _check_str(msg: RoomRequest, name: str, scheme: str = "") -> str:
    """Field ``name`` of ``msg``: a non-empty string of at most ``MAX_NAME_CHARS``
    (starting with ``scheme`` if given)."""
    value = getattr(msg, name)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS \
            or not value.startswith(scheme):
        want = f"a {scheme}... endpoint" if scheme else "a name"
        raise ProtocolError(f"room request: {name} must be {want} of 1 to {MAX_NAME_CHARS} "
                            f"characters, got {value!r}"[:300],
                            peer=str(msg.decode_name)[:MAX_NAME_CHARS] or None)
    return value


def check_request(msg: RoomRequest) -> np.ndarray:
    """Checks every field of ``msg`` that is later packed, used as an index or handed to
    SGLang (raises ``ProtocolError``); returns its page indices."""
    _check_str(msg, "decode_name")
    _check_str(msg, "decode_endpoint", "tcp://")
    _check_str(msg, "decode_channel", "tcp://")
    _check_int(msg, "nonce", 0, MAX_NONCE)  # packed as u32 in every chunk notification
    _check_int(msg, "aux_index", -1, MAX_PAGE)
    _check_int(msg, "decode_prefix_len", 0, MAX_TOKENS)  # SGLang's start_send_idx
    if not isinstance(msg.kv_pages, bytes) or len(msg.kv_pages) % 4:
        raise ProtocolError("kv_pages must be little-endian int32 bytes",
                            peer=msg.decode_name)
    return np.frombuffer(msg.kv_pages, dtype="<i4").astype(np.int64)


def check_pages(claim: SendRoom, name: str) -> None:
    """Raises ``InvalidDescriptorError`` unless every page and the metadata row of
    ``claim`` lies inside decode's registered buffers."""
    aux = np.array([claim.aux_index] if claim.aux_index >= 0 else [], dtype=np.int64)
    for kind, remote, ids in (("kv", claim.kv_remote, claim.kv_pages),
                              ("aux", claim.aux_remote, aux)):
        limit = min((lay.num_blocks for _, lay in remote), default=0)
        bad = ids[(ids < 0) | (ids >= limit)]
        if bad.size:
            raise InvalidDescriptorError(f"room {claim.room}: {kind} index {int(bad[0])} is "
                                         f"out of range [0, {limit}) of decode's buffers",
                                         peer=name)


class RoomClaims:
    """The side-channel handlers of :class:`~.manager.TransferEngineKVManager`, which
    holds the state below."""

    mode: str
    rank: int
    compat: dict[str, Any]
    compat_hash: str
    config: SGLangBackendConfig
    engine: Engine
    stats: collections.Counter[str]
    transfer_infos: dict[int, SendRoom]
    _lock: threading.Lock
    _kv: list[tuple[int, int, int]]
    _aux: list[tuple[int, int, int]]
    _given_up: collections.OrderedDict[tuple[int, int], str]
    # prefill: name -> (peer, epoch, its kv and aux buffers)
    _decode_peers: dict[str, tuple[Peer, int, RemoteBuffers, RemoteBuffers]]
    # prefill: connects under way, by (name, endpoint, epoch)
    _connects: dict[tuple[str, str, int], Future[Connected]]
    _connect_pool: ThreadPoolExecutor
    _recv_rooms: dict[int, RecvRoom]
    fences: Fences | None  # decode
    _drains: Drains  # prefill
    _wake: threading.Event  # set: the background thread runs a round now
    _recent: collections.OrderedDict[tuple[int, int], SendRoom]  # prefill, bounded
    post: Callable[[str, Message], None]  # best-effort send (the manager's)

    def _on_request(self, msg: Message) -> Message:
        if isinstance(msg, Ping):
            return Ack()
        if isinstance(msg, RoomStatus):
            self._on_status(msg)
            return Ack()
        if isinstance(msg, RoomRequest) and self.mode == "prefill":
            self._claim(msg)
            return Ack()
        if isinstance(msg, RoomQuiet) and self.fences is not None:
            self._on_quiet(msg)
            return Ack()
        raise ProtocolError(f"unexpected {msg.kind} on a {self.mode} side channel")

    def _claim(self, msg: RoomRequest) -> None:
        room = check_room(msg.room)
        if msg.version != BACKEND_VERSION:
            raise ProtocolError(f"decode speaks backend version {msg.version}, we speak "
                                f"{BACKEND_VERSION}", peer=msg.decode_name)
        if msg.compat_hash != self.compat_hash:
            raise ProtocolError(f"incompatible KV caches: decode's hash {msg.compat_hash} "
                                f"!= ours {self.compat_hash} (ours: {self.compat})",
                                peer=msg.decode_name)
        if msg.rank != self.rank:
            raise ProtocolError(f"room request for rank {msg.rank} reached rank {self.rank}",
                                peer=msg.decode_name)
        pages = check_request(msg)
        claim = SendRoom(room, None, msg.decode_channel, pages, msg.aux_index,
                         msg.decode_prefix_len, msg.nonce, [], [], time.monotonic())
        name = msg.decode_name
        with self._lock:
            other = self.transfer_infos.get(room)
            given_up = self._given_up.pop((room, msg.nonce), None)
            cached = self._decode_peers.get(name)
        if given_up is not None:  # nothing will be written: decode may let the pages go
            self.post(msg.decode_channel, RoomQuiet(room, msg.nonce, True, b""))
            raise ProtocolError(f"decode gave bootstrap room {room} up before its request "
                                f"arrived: {given_up}", peer=name)
        if other is not None:
            raise ProtocolError(f"bootstrap room {room} is already claimed by decode "
                                f"{other.peer.name if other.peer else other.decode_channel}",
                                peer=name)
        if cached is not None and cached[1] == msg.epoch and cached[0].lost is None:
            # known decode engine, same buffers: checked and claimed here, no I/O
            claim.kv_remote, claim.aux_remote = cached[2], cached[3]
            check_pages(claim, name)
            claim.peer = cached[0]
            self._record(claim, name)
            return
        pending = self._connect(name, msg.decode_endpoint, msg.epoch)
        self._record(claim, name)
        pending.add_done_callback(lambda done: self._settle(claim, name, done))

    def _record(self, claim: SendRoom, name: str) -> None:
        with self._lock:
            if claim.room in self.transfer_infos:
                raise ProtocolError(f"bootstrap room {claim.room} is already claimed",
                                    peer=name)
            self.transfer_infos[claim.room] = claim
        self.stats["rooms_claimed"] += 1

    def _connect(self, name: str, endpoint: str, epoch: int) -> Future[Connected]:
        """The connect to decode engine ``name`` at ``endpoint`` (buffers of ``epoch``):
        one under way is shared; a new one starts on the pool, within the bounds."""
        key = (name, endpoint, epoch)
        with self._lock:
            pending = self._connects.get(key)
            if pending is not None:
                return pending
            if len(self._connects) >= MAX_CONNECTS:
                raise BusyError(f"{MAX_CONNECTS} decode engines are being connected "
                                f"already; room request from {name!r} refused", peer=name)
            if sum(k[0] == name for k in self._connects) >= MAX_CONNECTS_PER_PEER:
                raise BusyError(f"{MAX_CONNECTS_PER_PEER} connects to decode {name!r} are "
                                "under way already; room request refused", peer=name)
            pending = self._connects[key] = Future()
        try:
            self._connect_pool.submit(self._connect_job, key, pending)
        except RuntimeError:  # the pool is shut down: the manager is closing
            with self._lock:
                self._connects.pop(key, None)
            raise ClosedError("prefill rank is closing", peer=name) from None
        return pending

    def _connect_job(self, key: tuple[str, str, int], pending: Future[Connected]) -> None:
        """Pool thread: connects, reads decode's buffers, caches them; resolves
        ``pending`` with them or the error."""
        name, endpoint, epoch = key
        try:
            peer = self.engine.connect(endpoint, timeout=self.config.timeout_s / 2)
            if peer.name != name:
                raise ProtocolError(f"endpoint {endpoint} is engine {peer.name!r}, the "
                                    f"request named {name!r}", peer=name)
            with self._lock:
                cached = self._decode_peers.get(name)
            if cached is not None and cached[0] is peer and cached[1] != epoch:
                peer.refresh()  # same connection, new buffers: read their segments again
            kv_remote = remote_buffers(peer, "kv", self._kv)
            aux_remote = remote_buffers(peer, "aux", self._aux)
        except BaseException as exc:
            with self._lock:
                self._connects.pop(key, None)
            pending.set_exception(exc)
            return
        with self._lock:
            self._connects.pop(key, None)
            self._decode_peers[name] = (peer, epoch, kv_remote, aux_remote)
        pending.set_result((peer, kv_remote, aux_remote))

    def _settle(self, claim: SendRoom, name: str, done: Future[Connected]) -> None:
        """Completes ``claim`` once its decode engine is connected, or fails it (and only
        it) with the reason, telling decode."""
        error: TransferError | None = None
        try:
            peer, claim.kv_remote, claim.aux_remote = done.result()
            check_pages(claim, name)
        except TransferError as exc:
            error = exc
        except TransferEngineError as exc:
            error = RemoteError(str(exc), peer=name, op="connect")
        except Exception as exc:  # noqa: BLE001 - only this room may fail for it
            error = ConnectError(f"connecting to decode {name!r} failed: {exc!r}"[:300],
                                 peer=name, op="connect")
        if error is None:
            claim.peer = peer  # last: the sender reads a claim with a peer as ready
            return
        claim.error = error
        self.stats["claims_failed"] += 1
        log.info("bootstrap room %s: %s", claim.room, error)
        self.post(claim.decode_channel, RoomStatus(claim.room, claim.nonce, False,
                                                   str(error)[:4096]))
        self.stop_room(claim)

    def _on_status(self, msg: RoomStatus) -> None:
        if isinstance(msg.chunks, bool) or not 0 <= msg.chunks <= MAX_NONCE:
            raise ProtocolError(f"room status: chunks must lie in [0, 2**32), got "
                                f"{msg.chunks!r}")
        with self._lock:
            if self.mode == "prefill":
                claim = self.transfer_infos.get(msg.room)
                if msg.ok:
                    return
                if claim is None:  # SGLang let it go already, or it is yet to come
                    claim = self._recent.get((msg.room, msg.nonce))
                if claim is not None and claim.nonce == msg.nonce:
                    claim.aborted = claim.aborted or msg.reason or "aborted"
                    self._stop(claim)
                elif claim is None:  # the abort overtook the request
                    self._given_up[(msg.room, msg.nonce)] = msg.reason or "aborted"
                    while len(self._given_up) > 4096:
                        self._given_up.popitem(last=False)
                return
            recv = self._recv_rooms.get(msg.room)
            if recv is None or recv.nonce != msg.nonce:
                return
            if msg.ok:
                recv.total = msg.chunks
            elif recv.error is None:
                recv.error = RemoteError(f"prefill failed the room: {msg.reason}",
                                         peer=recv.prefill.name, op="sglang-recv")

    def _on_quiet(self, msg: RoomQuiet) -> None:
        """Decode: prefill says a failed room's writes ended (fences.py)."""
        room = check_room(msg.room)
        if not 0 <= msg.nonce <= MAX_NONCE or len(msg.ticket) > MAX_TICKET:
            raise ProtocolError(f"room quiet: nonce must lie in [0, 2**32) and the ticket "
                                f"be at most {MAX_TICKET} bytes")
        assert self.fences is not None
        self.fences.quiet(room, msg.nonce, msg.clean, msg.ticket)

    # --- prefill: the writes of a room -------------------------------------------------

    def post_write(self, claim: SendRoom, pairs: list[Blocks], notify: bytes
                   ) -> TransferHandle:
        """Posts one chunk's WRITE of ``claim`` (kept in ``claim.writes``), unless the
        room takes no more (``RemoteError`` if decode gave it up)."""
        with self._lock:
            if claim.aborted is not None:
                raise RemoteError(f"decode gave the room up: {claim.aborted}")
            if claim.stopped:
                raise ClosedError(f"bootstrap room {claim.room} was stopped")
            claim.posting += 1
        handle: TransferHandle | None = None
        try:
            assert claim.peer is not None
            handle = self.engine.write(claim.peer, pairs, notify=notify)
        finally:
            with self._lock:
                claim.posting -= 1
                if handle is not None:
                    claim.writes.append(handle)
        handle.add_done_callback(lambda _: self._write_ended(claim))
        return handle

    def _write_ended(self, claim: SendRoom) -> None:
        """A transport thread: a stopped room's decode hears now, not a round later."""
        if claim.stopped:
            self._wake.set()

    def stop_room(self, claim: SendRoom) -> None:
        """``claim`` takes no more writes; decode hears ``RoomQuiet`` once those posted
        ended (:meth:`_post_quiet`)."""
        with self._lock:
            self._stop(claim)

    def _stop(self, claim: SendRoom) -> None:
        """:meth:`stop_room`, holding ``_lock``."""
        claim.stopped = True
        self._drains.watch(claim)
        self._wake.set()  # decode hears at once if no write is in flight

    def _post_quiet(self) -> None:
        """Background thread (prefill): tells decode of every stopped room whose writes
        all ended. A write that failed may have broken the connection's state on either
        side: the decode engine is connected afresh for its next room."""
        with self._lock:
            due = self._drains.due()
            for claim, clean in due:
                if not clean and claim.peer is not None:
                    cached = self._decode_peers.get(claim.peer.name)
                    if cached is not None and cached[0] is claim.peer:
                        del self._decode_peers[claim.peer.name]
        for claim, clean in due:
            ticket = claim.peer.ticket if claim.peer is not None and claim.writes else b""
            self.post(claim.decode_channel, RoomQuiet(claim.room, claim.nonce, clean, ticket))
            self.stats["rooms_quieted"] += 1

    def _remember(self, claim: SendRoom) -> None:
        """Prefill: SGLang let ``claim`` go; kept a while to answer a late abort (holding
        ``_lock``)."""
        self._recent[(claim.room, claim.nonce)] = claim
        while len(self._recent) > RECENT_ROOMS:
            self._recent.popitem(last=False)

"""What a rank answers on its side channel (the service thread): pings, room statuses
(decode's aborts reach prefill, prefill's outcome reaches decode), and, on prefill,
decode's room requests, checked and claimed for the sender that will write them."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from transfer_engine.connectors.sglang.config import SGLangBackendConfig
from transfer_engine.connectors.sglang.kv_buffers import remote_buffers
from transfer_engine.connectors.sglang.messages import (
    BACKEND_VERSION,
    Ping,
    RoomRequest,
    RoomStatus,
)
from transfer_engine.connectors.sglang.rooms import RecvRoom, SendRoom, check_room
from transfer_engine.control.messages import Ack, Message
from transfer_engine.engine import Engine
from transfer_engine.errors import InvalidDescriptorError, ProtocolError, RemoteError
from transfer_engine.peer import Peer

__all__ = ["RoomClaims"]


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
    _decode_peers: dict[str, tuple[Peer, int]]
    _recv_rooms: dict[int, RecvRoom]

    def _on_request(self, msg: Message) -> Message:
        if isinstance(msg, Ping):
            return Ack()
        if isinstance(msg, RoomStatus):
            self._on_status(msg)
            return Ack()
        if isinstance(msg, RoomRequest) and self.mode == "prefill":
            self._claim(msg)
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
        if not isinstance(msg.kv_pages, bytes) or len(msg.kv_pages) % 4:
            raise ProtocolError("kv_pages must be little-endian int32 bytes",
                                peer=msg.decode_name)
        pages = np.frombuffer(msg.kv_pages, dtype="<i4").astype(np.int64)
        with self._lock:
            other = self.transfer_infos.get(room)
            given_up = self._given_up.pop((room, msg.nonce), None)
        if given_up is not None:
            raise ProtocolError(f"decode gave bootstrap room {room} up before its request "
                                f"arrived: {given_up}", peer=msg.decode_name)
        if other is not None:
            raise ProtocolError(f"bootstrap room {room} is already claimed by decode "
                                f"{other.peer.name}", peer=msg.decode_name)
        peer = self._decode_peer(msg.decode_name, msg.decode_endpoint, msg.epoch)
        kv_remote = remote_buffers(peer, "kv", self._kv)
        aux_remote = remote_buffers(peer, "aux", self._aux)
        aux = [msg.aux_index] if msg.aux_index >= 0 else []
        for kind, remote, ids in (("kv", kv_remote, pages.tolist()), ("aux", aux_remote, aux)):
            limit = min((lay.num_blocks for _, lay in remote), default=0)
            bad = [p for p in ids if not 0 <= p < limit]
            if bad:
                raise InvalidDescriptorError(f"room {room}: {kind} index {bad[0]} is out of "
                                             f"range [0, {limit}) of decode's buffers",
                                             peer=msg.decode_name)
        claim = SendRoom(room, peer, msg.decode_channel, pages, msg.aux_index,
                         msg.decode_prefix_len, msg.nonce, kv_remote, aux_remote,
                         time.monotonic())
        with self._lock:
            if room in self.transfer_infos:
                raise ProtocolError(f"bootstrap room {room} is already claimed",
                                    peer=msg.decode_name)
            self.transfer_infos[room] = claim
        self.stats["rooms_claimed"] += 1

    def _decode_peer(self, name: str, endpoint: str, epoch: int) -> Peer:
        with self._lock:
            cached = self._decode_peers.get(name)
        if cached is not None and cached[1] == epoch and cached[0].lost is None:
            return cached[0]
        peer = self.engine.connect(endpoint, timeout=self.config.timeout_s / 2)
        if peer.name != name:
            raise ProtocolError(f"endpoint {endpoint} is engine {peer.name!r}, the request "
                                f"named {name!r}", peer=name)
        with self._lock:
            self._decode_peers[name] = (peer, epoch)
        return peer

    def _on_status(self, msg: RoomStatus) -> None:
        with self._lock:
            if self.mode == "prefill":
                claim = self.transfer_infos.get(msg.room)
                if msg.ok:
                    return
                if claim is not None and claim.nonce == msg.nonce:
                    claim.aborted = msg.reason or "aborted"
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

"""The per-rank manager: engine, registered KV and aux buffers, side channel, rooms.

One :class:`TransferEngineKVManager` per SGLang scheduler rank. It owns

- an :class:`~transfer_engine.engine.Engine` with every KV buffer (``kv_data_ptrs``:
  per-layer K then V buffers, page ``p`` at ``p * kv_item_lens[i]``) and every
  metadata buffer (``aux_data_ptrs``) registered as a segment;
- a side channel (:class:`~.channel.Service`) where the peer ranks send room requests,
  room statuses and pings;
- a background thread that turns engine notifications into room progress (decode),
  sends best-effort statuses, pings the prefill ranks a decode rank waits on, fences
  failed rooms (decode) and tells decode when a failed room's writes ended (prefill),
  and drops claimed rooms that no prefill request took up in time (prefill).

A failed room's pages go back to SGLang only once no write of it can land
(:mod:`.fences`); with SGLang's deferred release on, SGLang asks
:meth:`~TransferEngineKVManager.is_abort_release_safe`.

Closing it stops the threads, closes the channel and the engine (in-flight transfers
fail with ``ClosedError``).

What the side channel answers is :class:`~.room_claims.RoomClaims`; how SGLang's
buffers are read and laid out in pages is :mod:`.kv_buffers`.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
import uuid
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

from transfer_engine.closeable import Closeable
from transfer_engine.connectors.compat import compat_hash, describe_mismatch
from transfer_engine.connectors.sglang.channel import (
    Links,
)
from transfer_engine.connectors.sglang.config import SGLangBackendConfig, device_memory
from transfer_engine.connectors.sglang.fences import Drains, Fences
from transfer_engine.connectors.sglang.kv_buffers import kv_buffers, page_layout
from transfer_engine.connectors.sglang.messages import (
    BACKEND_VERSION,
    Ping,
    PrefillInfo,
    PrefillLookup,
    PrefillRegister,
    RoomRequest,
    RoomStatus,
)
from transfer_engine.connectors.sglang.room_claims import CONNECT_THREADS, Connected, RoomClaims
from transfer_engine.connectors.sglang.rooms import (
    PrefillEntry,
    RecvRoom,
    RemoteBuffers,
    SendRoom,
    parse_note,
)
from transfer_engine.control.auth import AuthConfig, Signer
from transfer_engine.control.messages import Ack, Message
from transfer_engine.control.service import Service, split_host_port, tcp_endpoint
from transfer_engine.descriptor import Blocks
from transfer_engine.engine import Engine
from transfer_engine.errors import (
    ClosedError,
    ConnectError,
    PeerLostError,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from transfer_engine.layout import kv_blocks
from transfer_engine.notify import Notification
from transfer_engine.peer import ControlClient, Peer
from transfer_engine.segment import Segment

__all__ = ["TransferEngineKVManager"]

log = logging.getLogger(__name__)

LOOKUP_WAIT_S = 0.1  # longest a scheduler cycle waits for a prefill lookup
MAX_LOOKUPS = 64  # prefill lookups under way at once (more wait for a later cycle)


def _sglang_defers() -> bool:
    """Whether the SGLang running us defers a failed room's release (its
    ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``); read only where SGLang
    already imported its settings."""
    envs = getattr(sys.modules.get("sglang.srt.environ"), "envs", None)
    flag = getattr(envs, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", None)
    try:
        return bool(flag.get()) if flag is not None else False
    except Exception:  # noqa: BLE001 - an SGLang without the setting
        return False


def _mode(mode: Any) -> str:
    value = str(getattr(mode, "value", mode))
    if value not in ("prefill", "decode"):
        raise ValueError(f"the transfer_engine backend runs in disaggregation mode "
                         f"'prefill' or 'decode', not {value!r}")
    return value


class TransferEngineKVManager(BaseKVManager, Closeable, RoomClaims):  # type: ignore[misc]
    """SGLang's KV manager on our engine (one per scheduler rank).

    :param args: SGLang's ``KVArgs`` for this rank (buffers, page size, rank).
    :param disaggregation_mode: ``DisaggregationMode.PREFILL`` or ``.DECODE`` (or the
        strings).
    :param server_args: SGLang's ``ServerArgs``; ``host``,
        ``disaggregation_bootstrap_port`` and ``device`` are read.
    :param is_mla_backend: whether the pool is MLA (one buffer per layer); part of the
        compatibility factors.
    :param config: settings; default :meth:`SGLangBackendConfig.from_env`.

    A prefill manager registers at its bootstrap server before returning and raises
    ``ConnectError`` if it cannot (a prefill rank that nobody can find serves nothing).
    """

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False, *,
                 config: SGLangBackendConfig | None = None) -> None:
        self.kv_args = args
        self.mode = _mode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.config = config or SGLangBackendConfig.from_env(server_args)
        self.rank = int(getattr(args, "engine_rank", 0) or 0)
        self.name = f"sglang-{self.mode}-r{self.rank}-{uuid.uuid4().hex[:8]}"
        self._kv = kv_buffers(args, "kv")
        self._aux = kv_buffers(args, "aux")
        self.compat: dict[str, Any] = {
            "backend_version": BACKEND_VERSION,
            "page_size": getattr(args, "page_size", None),
            "kv_cache_dtype": str(getattr(args, "kv_cache_dtype_str", "") or ""),
            "kv_layout": getattr(args, "kv_layout", None),
            "is_mla": self.is_mla_backend,
            "kv_item_lens": [item for _, _, item in self._kv],
            "aux_item_lens": [item for _, _, item in self._aux],
        }
        self.compat_hash = compat_hash(self.compat)
        self._lock = threading.Lock()
        self._closed = False
        self.transfer_infos: dict[int, SendRoom] = {}  # prefill: claimed rooms
        self._senders: set[int] = set()  # prefill: rooms with a live sender
        self._recv_rooms: dict[int, RecvRoom] = {}  # decode
        self.prefill_info_table: dict[str, PrefillEntry] = {}  # decode, by bootstrap addr
        self._lookups: dict[str, Future[PrefillEntry]] = {}  # decode: lookups under way
        self._decode_peers: dict[str, tuple[Peer, int, RemoteBuffers, RemoteBuffers]] = {}
        self._connects: dict[tuple[str, str, int], Future[Connected]] = {}
        # prefill: (room, nonce) decode gave up before its request arrived (bounded)
        self._given_up: collections.OrderedDict[tuple[int, int], str] = (
            collections.OrderedDict())
        self._recent: collections.OrderedDict[tuple[int, int], SendRoom] = (
            collections.OrderedDict())  # prefill: rooms let go, for a late abort
        self._drains = Drains()  # prefill: stopped rooms whose writes may be in flight
        self.fences: Fences | None = None  # decode: failed rooms not to give back yet
        # SGLang (decode) holds a failed room's pages until is_abort_release_safe
        self.enable_deferred_decode_kv_release = self.mode == "decode" and _sglang_defers()
        self._clients: dict[str, ControlClient] = {}
        self._outbox: collections.deque[tuple[str, Message]] = collections.deque(maxlen=4096)
        self._wake = threading.Event()
        self._epoch = 0
        self._kv_segments: list[Segment] = []
        self._aux_segments: list[Segment] = []
        self.stats = collections.Counter[str]()
        auth = AuthConfig.from_env()
        self._signer: Signer | None = auth.signer()
        self._stack = ExitStack()
        try:
            self.engine = Engine(self.name, host=self.config.host,
                                 transports=self.config.transports,
                                 timeout=self.config.timeout_s, role=self.mode, auth=auth)
            self._stack.callback(self.engine.close)
            if self.mode == "decode":
                self.fences = Fences(self.engine, self.config.fence_timeout_s, self.stats)
                self._stack.callback(self.fences.close)
            self.register_buffer_to_engine()
            self._zctx: zmq.Context[Any] = zmq.Context()
            self._stack.callback(self._term_context)
            self._stack.callback(self._close_clients)
            # prefill: connects to decode engines, off the side channel's thread
            self._connect_pool = ThreadPoolExecutor(
                max_workers=CONNECT_THREADS, thread_name_prefix=f"te-sglang-conn-{self.name}")
            self._stack.callback(self._connect_pool.shutdown, wait=False,
                                 cancel_futures=True)
            self._channel = Service(self._zctx, self.config.host, 0, self._on_request,
                                    f"sglang-chan-{self.name}", self._signer)
            self._stack.callback(self._channel.close)  # it never waits on a peer
            self._bg_stop = threading.Event()
            self._bg = threading.Thread(target=self._background, daemon=True,
                                        name=f"te-sglang-bg-{self.name}")
            self._bg.start()
            self._stack.callback(self._bg.join, 5)
            self._stack.callback(self._wake.set)
            self._stack.callback(self._bg_stop.set)
            self._lookup_pool = ThreadPoolExecutor(
                max_workers=2, thread_name_prefix=f"te-sglang-lookup-{self.name}")
            self._stack.callback(self._lookup_pool.shutdown, wait=False,
                                 cancel_futures=True)
            if self.mode == "prefill":
                self.register_to_bootstrap()
        except BaseException:
            self._stack.close()
            raise

    # --- buffers ----------------------------------------------------------------------

    def register_buffer_to_engine(self) -> None:
        """Registers every KV and aux buffer (idempotent). SGLang calls this again after
        it released and re-allocated its memory; peers learn the new segments from the
        ``epoch`` of the next room request."""
        if self._kv_segments:
            return
        self._kv = kv_buffers(self.kv_args, "kv")  # SGLang may have moved its memory
        self._aux = kv_buffers(self.kv_args, "aux")
        device = str(getattr(self.server_args, "device", "cpu") or "cpu")
        gpu_id = int(getattr(self.kv_args, "gpu_id", 0) or 0)
        done: list[Segment] = []
        try:
            for i, (ptr, length, _) in enumerate(self._kv):
                done.append(self.engine.register(device_memory(ptr, length, device, gpu_id),
                                                  name=f"sglang/kv/{i}"))
            for i, (ptr, length, _) in enumerate(self._aux):
                done.append(self.engine.register((ptr, length), name=f"sglang/aux/{i}"))
        except BaseException:
            for seg in done:
                seg.close()
            raise
        self._kv_segments = done[:len(self._kv)]
        self._aux_segments = done[len(self._kv):]
        self._kv_layouts = [page_layout(length, item) for _, length, item in self._kv]
        self._aux_layouts = [page_layout(length, item) for _, length, item in self._aux]
        self._epoch += 1

    def deregister_buffer_to_engine(self) -> None:
        """Deregisters every buffer (before SGLang frees its memory). Transfers into or
        out of them must be over; the engine refuses a segment that is in use."""
        segs, self._kv_segments, self._aux_segments = (
            self._kv_segments + self._aux_segments, [], [])
        for seg in segs:
            seg.close()

    # --- bootstrap --------------------------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Prefill: registers this rank at ``bootstrap_host:disaggregation_bootstrap_port``,
        retrying with back-off; raises ``ConnectError`` when every attempt failed and
        ``RemoteError`` when the server refused."""
        port = int(getattr(self.server_args, "disaggregation_bootstrap_port", 0) or 0)
        if not port:
            raise ConnectError("server_args.disaggregation_bootstrap_port is not set",
                               op="register")
        endpoint = tcp_endpoint(self.config.bootstrap_host, port, connect=True)
        msg = PrefillRegister(self.rank, self.engine.name, self.engine.endpoint,
                              self._channel.endpoint, BACKEND_VERSION, self.compat)
        last: TransferError | None = None
        for attempt in range(self.config.register_attempts):
            if attempt:
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
            try:
                reply = self._request(endpoint, msg)
            except (TransferTimeout, ConnectError) as exc:
                last = exc
                log.warning("registering at the bootstrap server %s (attempt %d/%d): %s",
                            endpoint, attempt + 1, self.config.register_attempts, exc)
                continue
            if not isinstance(reply, Ack):
                raise ProtocolError(f"expected ack, got {reply.kind}", peer=endpoint,
                                    op="register")
            return
        raise ConnectError(f"prefill rank {self.rank} could not register at the bootstrap "
                           f"server {endpoint} in {self.config.register_attempts} attempts: "
                           f"{last}", peer=endpoint, op="register")

    def prefill_info(self, bootstrap_addr: str) -> PrefillEntry:
        """Decode: the prefill rank this rank pairs with behind ``bootstrap_addr``
        (``host:port``), asked once and cached. Raises ``ConnectError``,
        ``TransferTimeout``, ``RemoteError`` (not registered) or ``ProtocolError``."""
        with self._lock:
            entry = self.prefill_info_table.get(bootstrap_addr)
        if entry is not None:
            return entry
        try:
            host, port = split_host_port(bootstrap_addr)
        except ValueError as exc:
            raise ConnectError(str(exc), peer=bootstrap_addr, op="lookup") from exc
        reply = self._request(tcp_endpoint(host, port, connect=True), PrefillLookup(self.rank))
        if not isinstance(reply, PrefillInfo):
            raise ProtocolError(f"expected prefill info, got {reply.kind}",
                                peer=bootstrap_addr, op="lookup")
        if reply.version != BACKEND_VERSION:
            raise ProtocolError(f"prefill speaks backend version {reply.version}, we speak "
                                f"{BACKEND_VERSION}; upgrade one side", peer=reply.engine_name)
        entry = PrefillEntry(reply)
        with self._lock:
            self.prefill_info_table[bootstrap_addr] = entry
        return entry

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode (called by SGLang's scheduler before it creates receivers, each cycle
        until True or it gives up on the request): whether the prefill server behind
        ``bootstrap_addr`` is known now. The lookup runs in the background and is waited
        for ``LOOKUP_WAIT_S`` at most, so an address that does not answer never holds
        the scheduler, and with it every running request."""
        with self._lock:
            if bootstrap_addr in self.prefill_info_table:
                return True
            lookup = self._lookups.get(bootstrap_addr)
            if lookup is None:
                if len(self._lookups) >= MAX_LOOKUPS or self._closed:
                    return False  # asked again next cycle
                lookup = self._lookups[bootstrap_addr] = self._lookup_pool.submit(
                    self.prefill_info, bootstrap_addr)
        try:
            lookup.result(LOOKUP_WAIT_S)
        except (TimeoutError, CancelledError):  # not yet; or the manager is closing
            return False
        except Exception as exc:  # noqa: BLE001 - SGLang's scheduler must not see it
            log.warning("prefill at %s: %s", bootstrap_addr, exc)
            return False
        finally:
            if lookup.done():
                with self._lock:
                    if self._lookups.get(bootstrap_addr) is lookup:
                        del self._lookups[bootstrap_addr]
        return True

    def check_compat(self, entry: PrefillEntry) -> None:
        """Raises ``ProtocolError`` naming every factor that differs."""
        theirs = entry.info.compat
        if compat_hash(theirs) != self.compat_hash:
            raise ProtocolError("incompatible KV caches, refusing to transfer: "
                                + describe_mismatch(self.compat, theirs), peer=entry.name)

    def forget_prefill(self, channel: str) -> None:
        """Drops cached lookups of a prefill rank (it died or restarted)."""
        with self._lock:
            for addr, entry in list(self.prefill_info_table.items()):
                if entry.channel == channel:
                    del self.prefill_info_table[addr]

    # --- control requests (scheduler thread) ------------------------------------------

    def _request(self, endpoint: str, msg: Message) -> Message:
        with self._lock:
            if self._closed:
                raise ClosedError("manager is closed", op=msg.kind)
            client = self._clients.get(endpoint)
            if client is None:
                client = self._clients[endpoint] = ControlClient(
                    self._zctx, endpoint, peer=endpoint, auth=self._signer)
        return client.request(msg, self.config.timeout_s)

    def request_room(self, entry: PrefillEntry, msg: RoomRequest) -> None:
        """Decode: asks the prefill rank to write room ``msg.room``; raises what the
        prefill refused (``RemoteError``) or ``TransferTimeout``."""
        try:
            reply = self._request(entry.channel, msg)
        except TransferTimeout:
            self.forget_prefill(entry.channel)
            raise
        if not isinstance(reply, Ack):
            raise ProtocolError(f"expected ack, got {reply.kind}", peer=entry.name)

    def post(self, endpoint: str, msg: Message) -> None:
        """Sends ``msg`` from the background thread (woken for it), best effort
        (answers are not awaited); the oldest is dropped when thousands are queued."""
        self._outbox.append((endpoint, msg))
        self._wake.set()

    def _term_context(self) -> None:
        channel = getattr(self, "_channel", None)
        if channel is not None and not channel.stopped:
            log.warning("%s: side channel still busy; leaving its ZeroMQ context open",
                        self.name)
            return
        self._zctx.term()

    def _close_clients(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    # --- prefill: rooms and pairs (scheduler thread) ----------------------------------

    def attach_sender(self, room: int) -> bool:
        """Prefill: marks ``room`` as having a live sender; False if one exists."""
        with self._lock:
            if room in self._senders:
                return False
            self._senders.add(room)
            return True

    def send_room(self, room: int) -> SendRoom | None:
        with self._lock:
            return self.transfer_infos.get(room)

    def forget_send_room(self, room: int) -> None:
        with self._lock:
            claim = self.transfer_infos.pop(room, None)
            self._senders.discard(room)
            if claim is not None:
                self._remember(claim)

    def pairs(self, claim: SendRoom, src_pages: list[int], dst_pages: list[int],
              src_aux: int | None) -> list[Blocks]:
        """What one chunk moves: its pages (and the aux row), as one :class:`Blocks` per
        buffer; runs of pages adjacent on both sides are merged."""
        out: list[Blocks] = []
        if src_pages:
            out += kv_blocks(self._kv_layouts, [lay for _, lay in claim.kv_remote],
                             self._kv_segments, [seg for seg, _ in claim.kv_remote],
                             src_pages, dst_pages)
        if src_aux is not None and claim.aux_index >= 0 and self._aux:
            out += kv_blocks(self._aux_layouts, [lay for _, lay in claim.aux_remote],
                             self._aux_segments, [seg for seg, _ in claim.aux_remote],
                             [src_aux], [claim.aux_index])
        return out

    # --- decode: rooms ----------------------------------------------------------------

    def open_recv_room(self, room: int, entry: PrefillEntry) -> RecvRoom:
        with self._lock:
            if room in self._recv_rooms:
                raise ProtocolError(f"bootstrap room {room} already has a receiver on this "
                                    "decode rank")
            recv = self._recv_rooms[room] = RecvRoom(room, entry)
            return recv

    def recv_room(self, room: int) -> RecvRoom | None:
        with self._lock:
            return self._recv_rooms.get(room)

    def forget_recv_room(self, room: int) -> None:
        with self._lock:
            self._recv_rooms.pop(room, None)

    def room_request(self, recv: RecvRoom, pages: np.ndarray, aux_index: int,
                     decode_prefix_len: int) -> RoomRequest:
        return RoomRequest(recv.room, self.rank, self.engine.name, self.engine.endpoint,
                           self._channel.endpoint, self._epoch,
                           np.ascontiguousarray(pages, dtype="<i4").tobytes(), aux_index,
                           decode_prefix_len, recv.nonce, BACKEND_VERSION,
                           self.compat_hash)

    def _on_note(self, note: Notification) -> None:
        parsed = parse_note(note.payload)
        if parsed is None:
            return
        room, nonce, seq, total = parsed
        with self._lock:
            recv = self._recv_rooms.get(room)
            if recv is None or recv.prefill.name != note.peer or recv.nonce != nonce:
                self.stats["notes_unclaimed"] += 1
                return
            recv.seen.add(seq)
            if total >= 0:
                recv.total = total
        self.stats["chunks_received"] += 1

    # --- decode: SGLang's deferred release of a failed room's pages ---------------------

    supports_deferred_decode_kv_release = True
    ROUND_S = 0.05  # the background thread's longest sleep (see _background)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Whether no write of a failed use of ``bootstrap_room`` can land any more
        (SGLang's deferred release asks; the acks it counts are our fence)."""
        return self.fences is None or self.fences.safe(int(bootstrap_room))

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        if self.fences is not None:
            self.fences.drop(int(bootstrap_room))

    # --- background thread ------------------------------------------------------------

    def _background(self) -> None:
        """Rounds every :attr:`ROUND_S`, and at once when a notification arrives, a
        message is posted, a room stops or a stopped room's write ends (``_wake``): an
        aborted room's pages wait a round trip, not a round."""
        links = Links(self._zctx, self._signer)
        beat = self.config.heartbeat_s
        next_beat = time.monotonic() + beat
        misses: dict[str, int] = {}
        wake = self._wake
        self.engine.on_notify(lambda _note: wake.set())
        try:
            while not self._bg_stop.is_set():
                wake.wait(self.ROUND_S)
                wake.clear()  # before taking: what comes after sets it again
                for note in self.engine.notifications(timeout=0):
                    self._on_note(note)
                now = time.monotonic()
                if self.fences is not None:
                    self.fences.advance(now)
                else:
                    self._post_quiet()
                while self._outbox:
                    endpoint, msg = self._outbox.popleft()
                    links.send(endpoint, msg)
                if now < next_beat:
                    continue
                next_beat = now + beat
                if self.mode == "decode":
                    self._heartbeat(links, misses)
                else:
                    self._expire_claims(now)
        except Exception:
            log.exception("background thread of %s failed", self.name)
        finally:
            links.close()

    def _heartbeat(self, links: Links, misses: dict[str, int]) -> None:
        """Pings every prefill rank with rooms in flight; one that answered none of the
        last ``heartbeat_misses`` pings fails its rooms with ``PeerLostError``."""
        with self._lock:
            waiting: dict[str, list[RecvRoom]] = {}
            for recv in self._recv_rooms.values():
                if not recv.done and recv.error is None and not recv.complete:
                    waiting.setdefault(recv.prefill.channel, []).append(recv)
        for channel in list(misses):
            if channel not in waiting:
                del misses[channel]
                links.drop(channel)
        for channel, rooms in waiting.items():
            answered = links.answered(channel)
            if channel in misses and not answered:
                misses[channel] += 1
            else:
                misses[channel] = 0
            if misses[channel] >= self.config.heartbeat_misses:
                prefill = rooms[0].prefill
                error = PeerLostError(
                    f"prefill rank {prefill.info.rank} ({prefill.name} at {channel}) "
                    f"stopped answering: {misses[channel]} heartbeats of "
                    f"{self.config.heartbeat_s}s missed", peer=prefill.name,
                    op="sglang-recv")
                with self._lock:
                    for recv in rooms:
                        recv.error = recv.error or error
                self.forget_prefill(channel)
                self.stats["prefills_lost"] += 1
                del misses[channel]
                links.drop(channel)
                continue
            links.send(channel, Ping())

    def _expire_claims(self, now: float) -> None:
        """Prefill: drops rooms claimed by decode that no prefill request took up within
        ``bootstrap_timeout_s`` and tells the decode side."""
        limit = self.config.bootstrap_timeout_s
        with self._lock:
            stale = [c for r, c in self.transfer_infos.items()
                     if r not in self._senders and now - c.claimed > limit]
            for claim in stale:
                del self.transfer_infos[claim.room]
        for claim in stale:
            self.stats["claims_expired"] += 1
            reason = (f"no prefill request for bootstrap room {claim.room} reached prefill "
                      f"rank {self.rank} within {limit}s")
            self.post(claim.decode_channel, RoomStatus(claim.room, claim.nonce, False, reason))
            self.stop_room(claim)  # nothing was written: decode hears so at once

    # --- life cycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stops the threads, closes the side channel and the engine. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stack.close()

    def _unclosed(self) -> str:
        return f"{type(self).__name__} {self.name!r} was not closed"

    def __repr__(self) -> str:
        state = " CLOSED" if self._closed else ""
        return (f"<TransferEngineKVManager {self.name!r} {self.mode} rank={self.rank} "
                f"kv_buffers={len(self._kv)} rooms={len(self.transfer_infos)}"
                f"/{len(self._recv_rooms)}{state}>")

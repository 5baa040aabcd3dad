"""SGLang's KV sender (prefill) and receiver (decode) on our engine.

Protocol, per request (a *room*: SGLang's ``bootstrap_room``)::

    prefill  Sender(room)           poll: Bootstrapping (no decode pages known yet)
    decode   Receiver(room)         poll: Bootstrapping
    decode   init(dp_rank)          asks the bootstrap server for the prefill rank of
                                    the same rank number (cached per server), checks the
                                    compatibility factors (page size, dtype, per-page
                                    bytes of every buffer, layout); poll: WaitingForInput
    decode   send_metadata(pages, aux_index)
                                    room request to the prefill rank's side channel: the
                                    decode engine, its page indices and metadata row;
                                    prefill checks every field and claims the room, or
                                    refuses (the receiver fails with the reason); it
                                    connects to the decode engine (once per peer, in
                                    the background) and checks the indices against
                                    decode's registered buffers, failing only that room
                                    (both sides told) if either fails
    prefill  poll                   Bootstrapping while decode's engine is connected,
                                    then WaitingForInput (the room is claimed)
    prefill  init(n_pages, aux_index); send(pages) once per chunk
                                    one engine WRITE per chunk: every K and V buffer's
                                    pages (runs of pages adjacent on both sides merged),
                                    plus the metadata row with the last chunk; each
                                    carries a notification (room, chunk number, and with
                                    the last one the chunk count); poll: Transferring,
                                    then Success once every write completed
    decode   poll                   Transferring once a chunk landed, Success once every
                                    chunk's notification arrived (each one is delivered
                                    only after all of its bytes landed)

Failures make ``poll`` return ``KVPoll.Failed``; ``failure_exception()`` raises the
precise error (errors of :mod:`transfer_engine.errors`, naming the room and peer):
``PeerLostError`` when the prefill rank stopped answering heartbeats or a write lost
its peer, ``TransferTimeout`` for the bootstrap and waiting timeouts, ``ProtocolError``
for a bad room or incompatible caches, ``RemoteError`` for what the other side
reported, ``NotSupportedError`` for what this backend does not do (state/hybrid pools,
host destinations, data-parallel attention), ``ClosedError`` after ``abort()``. A side
that fails tells the other through its side channel (best effort).

A room that fails on decode after its request went out keeps ``poll`` at
``Transferring`` until no write of prefill's can land in its pages any more (prefill
says its writes ended, or decode cut prefill's engine off: :mod:`.fences`); only then
does it return ``Failed``, after which SGLang gives the pages to other requests. Where
SGLang defers that release itself, ``poll`` fails at once and SGLang waits for
``kv_mgr.is_abort_release_safe``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import (
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)

from transfer_engine.connectors.sglang.fences import Fence
from transfer_engine.connectors.sglang.manager import TransferEngineKVManager
from transfer_engine.connectors.sglang.messages import RoomStatus
from transfer_engine.connectors.sglang.rooms import PrefillEntry, check_room, note_payload
from transfer_engine.errors import (
    ClosedError,
    InvalidDescriptorError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    TransferEngineError,
    TransferError,
    TransferTimeout,
)
from transfer_engine.handle import TransferHandle, TransferState

__all__ = ["TransferEngineKVSender", "TransferEngineKVReceiver"]

log = logging.getLogger(__name__)


def _for_room(exc: TransferEngineError, room: Any, op: str) -> TransferError:
    """``exc`` as a ``TransferError`` of the same kind whose message names the room."""
    if isinstance(exc, TransferError):
        if exc.message.startswith("bootstrap room"):
            return exc
        return type(exc)(f"bootstrap room {room}: {exc.message}",
                         **{"op": op, **exc.context()})
    return RemoteError(f"bootstrap room {room}: {exc}", op=op)


def _uses_state(state_indices: Any) -> bool:
    return bool(state_indices) and any(s is not None and len(s) for s in state_indices)


class TransferEngineKVSender(BaseKVSender):  # type: ignore[misc]
    """Prefill side of one room: writes its pages into the pages decode allocated."""

    def __init__(self, mgr: TransferEngineKVManager, bootstrap_addr: str,
                 bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: int | None = None
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self._error: TransferError | None = None
        self._handles: list[TransferHandle] = []
        self._next = 0  # pages sent so far
        self._last_sent = False
        self._created = time.monotonic()
        self._started: float | None = None
        self._latency: float | None = None
        self._attached = False
        self._decode_prefix_len: int | None = None
        self._room = -1
        try:
            self._room = check_room(bootstrap_room)
            if mgr.mode != "prefill":
                raise ProtocolError("a sender needs a prefill manager")
            if not mgr.attach_sender(self._room):
                raise ProtocolError("this prefill rank already has a sender for the room")
            self._attached = True
        except TransferEngineError as exc:
            self._fail(exc, tell_decode=False)

    def _fail(self, exc: TransferEngineError, tell_decode: bool = True) -> int:
        if self._error is None:
            self._error = _for_room(exc, self.bootstrap_room, "sglang-send")
            log.warning("%s", self._error)
            claim = self.kv_mgr.send_room(self._room) if self._attached else None
            if tell_decode and claim is not None:
                self.kv_mgr.post(claim.decode_channel,
                                 RoomStatus(self._room, claim.nonce, False, str(exc)))
            if claim is not None:  # decode hears once the writes posted ended
                self.kv_mgr.stop_room(claim)
        self.conclude_state = KVPoll.Failed
        return int(KVPoll.Failed)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """SGLang announces the pages it will send (the prompt's, past the prefix decode
        holds): a count that is not decode's fails the room now, before any send."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        claim = self.kv_mgr.send_room(self._room) if self._attached else None
        if self.conclude_state is None and claim is not None \
                and len(claim.kv_pages) != self.num_kv_indices:
            self._fail(ProtocolError(
                f"decode allocated {len(claim.kv_pages)} pages past the "
                f"{claim.decode_prefix_len} tokens it holds, prefill announced "
                f"{self.num_kv_indices} (is decode_prefix_len past the prompt?)",
                peer=claim.peer.name if claim.peer else None))

    def send(self, kv_indices: npt.NDArray[np.int32], state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None) -> None:
        """Writes one chunk; the chunk that reaches ``num_kv_indices`` pages is the last
        and carries the metadata row. Later calls are ignored."""
        if self.conclude_state is not None or self._last_sent:
            return
        try:
            self._send(kv_indices, state_indices)
        except TransferEngineError as exc:
            self._fail(exc)
        except ValueError as exc:
            self._fail(InvalidDescriptorError(str(exc)))

    def _send(self, kv_indices: npt.NDArray[np.int32], state_indices: list[Any] | None
              ) -> None:
        if _uses_state(state_indices):
            raise NotSupportedError("state buffers (mamba, SWA, DSA pools) are not moved by "
                                    "the transfer_engine backend")
        if self.num_kv_indices is None:
            raise ProtocolError("send() before init()")
        claim = self.kv_mgr.send_room(self._room)
        if claim is None:
            raise ProtocolError("send() before the decode side claimed the room")
        if claim.aborted is not None:
            raise RemoteError(f"decode gave the room up: {claim.aborted}")
        if claim.error is not None:
            raise claim.error
        if claim.peer is None:
            raise ProtocolError("send() before the decode side's engine was connected")
        if len(claim.kv_pages) != self.num_kv_indices:
            raise ProtocolError(f"decode allocated {len(claim.kv_pages)} pages, prefill "
                                f"announced {self.num_kv_indices}")
        pages = np.asarray(kv_indices, dtype=np.int64).ravel()
        start, stop = self._next, self._next + len(pages)
        if stop > self.num_kv_indices:
            raise ProtocolError(f"send() of pages [{start}, {stop}) past the "
                                f"{self.num_kv_indices} announced in init()")
        self._next = stop
        last = stop == self.num_kv_indices
        pairs = self.kv_mgr.pairs(claim, pages.tolist(), claim.kv_pages[start:stop].tolist(),
                                  self.aux_index if last else None)
        seq = len(self._handles)
        if last:
            self._last_sent = True
        if not pairs:
            if last:  # nothing to write: the count goes by the side channel
                self.kv_mgr.post(claim.decode_channel,
                                 RoomStatus(self._room, claim.nonce, True, "", seq))
            return
        if self._started is None:
            self._started = time.perf_counter()
        self._handles.append(self.kv_mgr.post_write(
            claim, pairs, note_payload(self._room, claim.nonce, seq, seq + 1 if last else -1)))

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        claim = self.kv_mgr.send_room(self._room)
        if claim is None:
            waited = time.monotonic() - self._created
            limit = self.kv_mgr.config.bootstrap_timeout_s
            if waited > limit:
                return self._fail(TransferTimeout(
                    f"no decode rank claimed the room within {limit}s (is decode up, and "
                    "was it given the same bootstrap host, port and room?)"))
            return int(KVPoll.Bootstrapping)
        if claim.aborted is not None:
            return self._fail(RemoteError(f"decode gave the room up: {claim.aborted}",
                                          peer=claim.peer.name if claim.peer else None),
                              tell_decode=False)
        if claim.error is not None:  # decode was told when the claim failed
            return self._fail(claim.error, tell_decode=False)
        if claim.peer is None:  # decode's engine is being connected (bounded)
            return int(KVPoll.Bootstrapping)
        if not self._handles and not self._last_sent:
            return int(KVPoll.WaitingForInput)
        for handle in self._handles:
            if handle.state is TransferState.FAILED:
                assert handle.error is not None
                return self._fail(handle.error)
        if self._last_sent and all(h.state is TransferState.DONE for h in self._handles):
            if self._started is not None:
                self._latency = time.perf_counter() - self._started
            self.conclude_state = KVPoll.Success
            return int(KVPoll.Success)
        return int(KVPoll.Transferring)

    def pop_decode_prefix_len(self) -> int:
        """Tokens decode already holds (it sent pages only for the rest); once."""
        if self._decode_prefix_len is not None:
            return 0
        claim = self.kv_mgr.send_room(self._room) if self._attached else None
        if claim is None:  # not known before decode claimed the room
            return 0
        self._decode_prefix_len = claim.decode_prefix_len
        return self._decode_prefix_len

    def get_transfer_metric(self) -> KVTransferMetric:
        nbytes = sum(h.nbytes for h in self._handles if h.state is TransferState.DONE)
        return KVTransferMetric(transfer_latency_s=self._latency,
                                transfer_total_bytes=nbytes or None)

    def failure_exception(self) -> None:
        """Raises why the room failed (and forgets the room)."""
        self.conclude_state = KVPoll.Failed
        error = self._error or RemoteError(f"bootstrap room {self.bootstrap_room}: failed "
                                           "for an unknown reason", op="sglang-send")
        self.clear()
        raise error

    def abort(self) -> None:
        if self.conclude_state is None:
            self._fail(ClosedError("aborted by SGLang (AbortReq)"))

    def clear(self) -> None:
        if self._attached:
            self._attached = False
            self.kv_mgr.forget_send_room(self._room)

    def __repr__(self) -> str:
        return (f"<TransferEngineKVSender room={self.bootstrap_room} "
                f"pages={self._next}/{self.num_kv_indices} chunks={len(self._handles)} "
                f"state={self.conclude_state}>")


class TransferEngineKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """Decode side of one room: announces its pages, then waits for them to land."""

    def __init__(self, mgr: TransferEngineKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: int | None = None
        # read by SGLang's decode scheduler
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list[PrefillEntry] = []
        self._error: TransferError | None = None
        self._reason = ""
        self._prefill: PrefillEntry | None = None
        self._sent_at: float | None = None
        self._asked = False  # the room request may have reached prefill
        self._fence: Fence | None = None  # failed after asking: pages not to give back yet
        self._opened = False
        self._nonce = 0
        self._room = -1
        try:
            self._room = check_room(bootstrap_room)
            if mgr.mode != "decode":
                raise ProtocolError("a receiver needs a decode manager")
        except TransferEngineError as exc:
            self._fail(exc)

    def _fail(self, exc: TransferEngineError) -> int:
        if self._error is None:
            self._reason = str(exc)
            self._error = _for_room(exc, self.bootstrap_room, "sglang-recv")
            log.warning("%s", self._error)
            recv = self.kv_mgr.recv_room(self._room) if self._opened else None
            if recv is not None:
                recv.done = True  # no more heartbeats on its behalf
            fences = self.kv_mgr.fences
            if self._asked and self._prefill is not None and fences is not None \
                    and not (recv is not None and recv.complete):
                self._fence = fences.start(self._room, self._nonce, self._prefill.name,
                                           lost=isinstance(exc, PeerLostError))
                self.ensure_abort_notified()  # prefill stops, and says when it has
        self.conclude_state = KVPoll.Failed
        return int(KVPoll.Failed)

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state is not None:
            return
        try:
            if prefill_dp_rank not in (0, None):
                raise NotSupportedError(f"prefill dp rank {prefill_dp_rank}: data-parallel "
                                        "attention is not supported by the transfer_engine "
                                        "backend")
            entry = self.kv_mgr.prefill_info(self.bootstrap_addr)
            self.kv_mgr.check_compat(entry)
        except TransferEngineError as exc:
            self._fail(exc)
            return
        self._prefill = entry
        self.bootstrap_infos = [entry]

    def send_metadata(self, kv_indices: npt.NDArray[np.int32], aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None, destination: Any = "device",
                      device_kv_indices: Any = None) -> None:
        if self.conclude_state is not None:
            return
        try:
            if self._prefill is None:
                raise ProtocolError("send_metadata() before a successful init()")
            if _uses_state(state_indices):
                raise NotSupportedError("state buffers (mamba, SWA, DSA pools) are not "
                                        "moved by the transfer_engine backend")
            if str(getattr(destination, "value", destination)) != "device" \
                    or device_kv_indices is not None:
                raise NotSupportedError("host KV destinations are not supported by the "
                                        "transfer_engine backend")
            pages = np.asarray(kv_indices).ravel()
            if pages.size and (pages.min() < 0 or pages.max() >= 2 ** 31):
                raise InvalidDescriptorError("page indices must lie in [0, 2**31)")
            recv = self.kv_mgr.open_recv_room(self._room, self._prefill)
            self._opened = True
            self._nonce = recv.nonce
            msg = self.kv_mgr.room_request(recv, pages,
                                           -1 if aux_index is None else int(aux_index),
                                           int(decode_prefix_len or 0))
            self._asked = True
            self.kv_mgr.request_room(self._prefill, msg)
        except TransferEngineError as exc:
            # unanswered, the request may still reach prefill (fenced: it is told not to
            # serve it); refused, nothing will be written
            self._asked = self._asked and isinstance(exc, TransferTimeout)
            self._fail(exc)
            return
        self._sent_at = time.monotonic()

    def poll(self) -> int:
        if self._fence is not None and not self._fence.fenced \
                and not self.kv_mgr.enable_deferred_decode_kv_release:
            return int(KVPoll.Transferring)  # failed, but prefill may still write
        if self.conclude_state is not None:
            return self.conclude_state
        if self._prefill is None:
            return int(KVPoll.Bootstrapping)
        if self._sent_at is None:
            return int(KVPoll.WaitingForInput)
        recv = self.kv_mgr.recv_room(self._room)
        if recv is None:
            return self._fail(ProtocolError("the room was cleared while in flight"))
        if recv.error is not None:
            return self._fail(recv.error)
        if recv.complete:
            recv.done = True
            self.conclude_state = KVPoll.Success
            return int(KVPoll.Success)
        limit = self.kv_mgr.config.waiting_timeout_s
        if time.monotonic() - self._sent_at > limit:
            self._fail(TransferTimeout(
                f"KV of the room did not arrive within {limit}s ({len(recv.seen)} chunks "
                f"landed)", peer=recv.prefill.name))
            self.ensure_abort_notified()
            return int(KVPoll.Failed)
        return int(KVPoll.Transferring if recv.seen else KVPoll.WaitingForInput)

    def failure_exception(self) -> None:
        """Raises why the room failed (and forgets the room)."""
        self.conclude_state = KVPoll.Failed
        error = self._error or RemoteError(f"bootstrap room {self.bootstrap_room}: failed "
                                           "for an unknown reason", op="sglang-recv")
        self.clear()
        raise error

    def abort(self) -> None:
        if self.conclude_state is None:
            self._fail(ClosedError("aborted by SGLang (AbortReq)"))
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tells the prefill rank to stop writing this room (once, best effort)."""
        if self.abort_notified or not self._asked or self._prefill is None:
            return
        self.abort_notified = True
        reason = self._reason or "decode aborted the room"
        self.kv_mgr.post(self._prefill.channel,
                         RoomStatus(self._room, self._nonce, False, reason))

    def clear(self) -> None:
        if self._opened:
            self._opened = False
            self.kv_mgr.forget_recv_room(self._room)
        if self._fence is not None and self.kv_mgr.fences is not None:
            self.kv_mgr.fences.forget(self._fence)

    def __repr__(self) -> str:
        return (f"<TransferEngineKVReceiver room={self.bootstrap_room} "
                f"prefill={self._prefill.name if self._prefill else None} "
                f"state={self.conclude_state}>")

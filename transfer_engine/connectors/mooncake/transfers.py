"""Transfers in the Mooncake ``TransferEngine`` API: raw addresses paired into our
descriptors, batches submitted sync or async under Mooncake's deadline, their
statuses, and the notifications that arrive with them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from transfer_engine.descriptor import Descriptor
from transfer_engine.errors import TransferEngineError
from transfer_engine.handle import TransferState
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

from .address_map import AddressMap, remote_map
from .api_types import TransferNotify, TransferOpcode
from .codes import STATUS_COMPLETED, STATUS_FAILED, STATUS_PENDING, STATUS_TIMEOUT, Failed, log
from .engine_base import Batch, EngineBase

__all__ = ["TransferAPI"]


class TransferAPI(EngineBase):
    """Transfers, batch statuses and notifications of the Mooncake ``TransferEngine``."""

    def _pairs(self, target: str, buffers: Sequence[int], peer_addresses: Sequence[int],
               lengths: Sequence[int], temps: list[Segment]
               ) -> tuple[Peer, list[tuple[Descriptor, Descriptor]]]:
        engine = self._need_engine()
        peer = self._peer(target)  # first, as Mooncake opens the segment first
        if not (len(buffers) == len(peer_addresses) == len(lengths)):
            raise Failed(-1, f"{len(buffers)} buffers, {len(peer_addresses)} peer "
                             f"addresses, {len(lengths)} lengths")
        pairs = []
        refreshed = False
        for buf, remote, length in zip(buffers, peer_addresses, lengths, strict=True):
            if not isinstance(length, int) or length < 0:
                raise Failed(-1, f"bad length {length!r}")
            if length == 0:
                continue  # nothing to move, as Mooncake
            with self._lock:
                found = self._maps[target].find(remote, length)
            if found is None and not refreshed:
                peer.refresh()  # the peer may have registered it since we connected
                refreshed = True
                with self._lock:
                    self._maps[target] = remote_map(peer)
                    found = self._maps[target].find(remote, length)
            if found is None:
                raise Failed(-1, f"{length} bytes at {remote:#x} lie in no region "
                                 f"{target} registered")
            rseg, roff = found
            with self._lock:
                local = self._local_map.find(buf, length)
            if local is None:
                seg = engine.register((buf, length), name=f"mc-tmp:{uuid.uuid4().hex}")
                temps.append(seg)
                local = (seg, 0)
            lseg, loff = local
            pairs.append((Descriptor(lseg, loff, length), Descriptor(rseg, roff, length)))
        return peer, pairs

    def _submit(self, target: str, buffers: Sequence[int], peer_addresses: Sequence[int],
                lengths: Sequence[int], opcode: TransferOpcode | int,
                notify: TransferNotify | None) -> int:
        """Starts one batch; returns its id (> 0). Raises ``Failed``/engine errors."""
        engine = self._need_engine()
        op = TransferOpcode(int(opcode))
        total = sum(n for n in lengths if isinstance(n, int) and n > 0)
        batch = Batch(None, time.monotonic() + self._timeout + total / 1e9)
        try:
            peer, pairs = self._pairs(target, buffers, peer_addresses, lengths, batch.temps)
            if pairs:
                payload = notify._encode() if notify is not None else None
                submit = engine.write if op is TransferOpcode.Write else engine.read
                batch.handle = submit(peer, pairs, notify=payload)
        except BaseException:
            self._release(batch)
            with self._lock:  # stale addresses: ask the peer afresh next time
                if target in self._peers:
                    self._maps[target] = AddressMap()
            raise
        with self._lock:
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = batch
        return batch_id

    def _release(self, batch: Batch) -> None:
        for seg in batch.temps:
            try:
                seg.close()
            except TransferEngineError as exc:  # still busy: the engine closes it later
                log.warning("temporary registration not released: %s", exc)
        batch.temps = []

    def _wait(self, batch_id: int) -> None:
        """Waits for a batch and forgets it; raises on failure."""
        with self._lock:
            batch = self._batches.pop(batch_id, None)
        if batch is None:
            raise Failed(-1, f"unknown batch id {batch_id}")
        if batch.handle is None:
            return
        try:
            batch.handle.wait(max(0.0, batch.deadline - time.monotonic()))
        finally:
            if batch.handle.done():
                self._release(batch)
            else:  # timed out: cancel, release once it finishes (it holds the pins)
                batch.handle.cancel()
                with self._lock:
                    self._batches[-batch_id] = batch

    def _sync(self, name: str, target: str, buffers: Sequence[int],
              peer_addresses: Sequence[int], lengths: Sequence[int],
              opcode: TransferOpcode | int, notify: TransferNotify | None = None) -> int:
        def run() -> None:
            self._wait(self._submit(target, buffers, peer_addresses, lengths, opcode, notify))
        return 0 if self._call(name, run) == 0 else -1

    def _async(self, name: str, target: str, buffers: Sequence[int],
               peer_addresses: Sequence[int], lengths: Sequence[int],
               opcode: TransferOpcode | int) -> int:
        try:
            return self._submit(target, buffers, peer_addresses, lengths, opcode, None)
        except (Failed, TransferEngineError) as exc:
            log.warning("%s to %s: %s", name, target, exc)
            return 0

    def transfer_sync_write(self, target_hostname: str, buffer: int,
                            peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Writes ``length`` bytes at local ``buffer`` to ``peer_buffer_address`` of the
        peer; 0 once they landed, -1 on failure."""
        return self._sync("transfer_sync_write", target_hostname, [buffer],
                          [peer_buffer_address], [length], TransferOpcode.Write)

    def transfer_sync_read(self, target_hostname: str, buffer: int,
                           peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """Reads ``length`` bytes at the peer's ``peer_buffer_address`` into ``buffer``;
        0 or -1."""
        return self._sync("transfer_sync_read", target_hostname, [buffer],
                          [peer_buffer_address], [length], TransferOpcode.Read)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode | int,
                      notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        """One transfer of either direction, with an optional notification; 0 or -1."""
        return self._sync("transfer_sync", target_hostname, [buffer], [peer_buffer_address],
                          [length], opcode, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        """Writes every (buffer, peer address, length) as one transfer; 0 or -1."""
        return self._sync("batch_transfer_sync_write", target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.Write)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int],
                                 lengths: Sequence[int], transport_hint: str = "") -> int:
        """Reads every (buffer, peer address, length) as one transfer; 0 or -1."""
        return self._sync("batch_transfer_sync_read", target_hostname, buffers,
                          peer_buffer_addresses, lengths, TransferOpcode.Read)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode | int,
                            notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        """A batch of either direction, with an optional notification; 0 or -1."""
        return self._sync("batch_transfer_sync", target_hostname, buffers,
                          peer_buffer_addresses, lengths, opcode, notify)

    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """Starts a write; a batch id for :meth:`transfer_check_status`, or 0."""
        return self._async("transfer_submit_write", target_hostname, [buffer],
                           [peer_buffer_address], [length], TransferOpcode.Write)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int],
                                   lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts a batch of writes; its batch id, or 0."""
        return self._async("batch_transfer_async_write", target_hostname, buffers,
                           peer_buffer_addresses, lengths, TransferOpcode.Write)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int],
                                  lengths: Sequence[int], transport_hint: str = "") -> int:
        """Starts a batch of reads; its batch id, or 0."""
        return self._async("batch_transfer_async_read", target_hostname, buffers,
                           peer_buffer_addresses, lengths, TransferOpcode.Read)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode | int, transport_hint: str = "") -> int:
        """Starts a batch of either direction; its batch id, or 0."""
        return self._async("batch_transfer_async", target_hostname, buffers,
                           peer_buffer_addresses, lengths, opcode)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed (or unknown id), -2 past the deadline. A
        batch is forgotten once a final status (1, -1, -2) was returned."""
        with self._lock:
            batch = self._batches.get(batch_id)
        if batch is None:
            return STATUS_FAILED
        state = TransferState.DONE if batch.handle is None else batch.handle.state
        if state is TransferState.PENDING:
            if time.monotonic() < batch.deadline:
                return STATUS_PENDING
            with self._lock:
                self._batches.pop(batch_id, None)
                self._batches[-batch_id] = batch  # released when it finishes
            assert batch.handle is not None
            batch.handle.cancel()
            log.warning("batch %d timed out after %.1fs", batch_id, self._timeout)
            return STATUS_TIMEOUT
        with self._lock:
            self._batches.pop(batch_id, None)
        self._release(batch)
        if state is TransferState.FAILED:
            assert batch.handle is not None
            log.warning("batch %d failed: %s", batch_id, batch.handle.error)
            return STATUS_FAILED
        return STATUS_COMPLETED

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch; 0 if all succeeded, -1 if any failed or timed out."""
        result = 0
        for batch_id in batch_ids:
            if self._call("get_batch_transfer_status", self._wait, batch_id) != 0:
                result = STATUS_FAILED
        self._reap()
        return result

    def _reap(self) -> None:
        """Releases timed-out batches that have finished since."""
        with self._lock:
            late = [(k, b) for k, b in self._batches.items()
                    if k < 0 and b.handle is not None and b.handle.done()]
            for k, _ in late:
                del self._batches[k]
        for _, batch in late:
            self._release(batch)

    # --- notifications ----------------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received since the last call (each exactly once)."""
        engine = self._engine
        if engine is None:
            return []
        return [TransferNotify._decode(n.peer, n.payload) for n in engine.notifications(0)]

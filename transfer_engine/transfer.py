"""Transfers in flight: submit, plan, post, complete, fall back, cancel, expire.

A transfer is validated, its local segments pinned, planned into work requests over
the peer's best transport's rails, and posted; completions count down to its end, a
failure that another transport may fix repeats it there (with one notification), and a
cancel, a deadline or a stuck segment stops it once nothing of ours still touches its
memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Hashable
from typing import Any

from transfer_engine import interrupts
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    InvalidDescriptorError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from transfer_engine.handle import TransferHandle, TransferState
from transfer_engine.interrupts import Deferred
from transfer_engine.peer import Peer
from transfer_engine.planner import plan_columns
from transfer_engine.segment import Segment
from transfer_engine.staging import Staging
from transfer_engine.state import EngineState, LiveTransfer
from transfer_engine.transport import held
from transfer_engine.transport.base import (
    Completion,
    Immediate,
    Rail,
    TornDown,
    Transport,
    Work,
)
from transfer_engine.validate import Pairs, validate
from transfer_engine.watchdog import Watchdog

log = logging.getLogger(__name__)

# Failures after which the same transfer is repeated over the peer's next transport.
_FALLBACK_ERRORS = (NotSupportedError, PeerLostError)
_BYTES_STAT = {Op.WRITE: "bytes_write", Op.READ: "bytes_read"}
# attempts again over the same transport after this side tore its rail down (a cancel
# of another transfer, an interrupted call)
RETRIES = 3


def _interrupted(xfer: LiveTransfer) -> TransferCancelled:
    return TransferCancelled("interrupted (Ctrl-C) while a rail to the peer was reopened",
                             peer=xfer.peer.name, op=str(xfer.op),
                             transport=xfer.transports[0] if xfer.transports else None)


class Transfers(EngineState):
    """The engine's transfer table and its life cycle (a part of :class:`Engine`)."""

    def write(self, peer: Peer | str, pairs: Pairs, notify: bytes | None = None, *,
              timeout: float | None = None) -> TransferHandle:
        """Writes each local descriptor's bytes to its remote descriptor.

        ``pairs`` is a sequence of ``(local, remote)`` :class:`Descriptor` pairs, or a
        :class:`Blocks` (or a list of them): the same pairs as arrays, much cheaper for
        many small blocks. ``notify`` (bytes, at most 64 KiB) reaches the peer's
        :meth:`notifications` once every byte has landed, exactly once. ``timeout``:
        the transfer's deadline in seconds (default: the engine's
        ``transfer_timeout``); past it the handle fails with :class:`TransferTimeout`
        (see :meth:`TransferHandle.cancel` for what is stopped how). Raises
        :class:`InvalidDescriptorError` or :class:`UnknownPeerError` before anything
        moves.
        """
        return self._submit(Op.WRITE, peer, pairs, notify, timeout)

    @property
    def in_flight(self) -> int:
        """Transfers submitted and not finished."""
        return len(self._live)

    @property
    def probing(self) -> int | None:
        """Peers the silence watchdog probes now (see ``peer_timeout``); None before
        the first transfer started it."""
        return self._watchdog.probing if self._watchdog is not None else None

    def read(self, peer: Peer | str, pairs: Pairs, notify: bytes | None = None, *,
             timeout: float | None = None) -> TransferHandle:
        """Reads each remote descriptor's bytes into its local descriptor; ``notify``
        reaches the peer after all of them arrived here. ``timeout`` as for
        :meth:`write`."""
        return self._submit(Op.READ, peer, pairs, notify, timeout)

    def _submit(self, op: Op, peer_ref: Peer | str, pairs: Pairs,
                notify: bytes | None, timeout: float | None = None) -> TransferHandle:
        if self._closed:
            raise ClosedError("engine is closed", op=str(op))
        peer = self.peer(peer_ref if isinstance(peer_ref, str) else peer_ref.name)
        if peer.lost is not None:
            raise PeerLostError(f"peer lost: {peer.lost}", peer=peer.name, op=str(op))
        peer.reprobe()
        if peer.order == [] or peer.transport is None:
            raise PeerLostError("peer has no open rails", peer=peer.name, op=str(op))
        if notify is not None and (not isinstance(notify, bytes | bytearray)
                                   or len(notify) > 65536):
            raise InvalidDescriptorError("notify must be bytes of at most 64 KiB",
                                         peer=peer.name, op=str(op))
        extents, locals_ = validate(self._segments, op, peer, pairs)
        nbytes = extents.nbytes
        handle = TransferHandle(next(self._transfer_ids), op, peer.name, nbytes)
        # Ctrl-C midway would leave segments pinned or work posted in part
        with Deferred():
            pinned: list[Segment] = []
            try:
                for seg in locals_:
                    seg.pin()
                    pinned.append(seg)
            except TransferError as exc:
                for seg in pinned:
                    seg.unpin()
                raise exc.with_context(peer=peer.name, op=str(op)) from None
            xfer = LiveTransfer(handle, peer, op, extents,
                                bytes(notify) if notify is not None else None,
                                self._route(peer), pinned)
            handle._canceller = self._cancel_handle
            # a peer in this very process needs our GIL to move the bytes: never held then;
            # others only while the GIL is seen contended (held.Contention)
            hold = 0.0
            if self.hold_gil and held.AVAILABLE and not (
                    peer.info.pid == os.getpid() and peer.info.host_id == self.host_id):
                handle._lagged = held.contention.saw
                if held.contention.now():
                    hold = self.hold_gil
                    handle._assist = self._assist
                    held.turn().resume(time.monotonic())
            with self._lock:
                self._live[handle.id] = xfer
            if timeout is None:
                timeout = self.transfer_timeout
            watchdog = self._watchdog
            if watchdog is None and (timeout is not None or self.peer_timeout is not None):
                watchdog = self._start_watchdog()
            if timeout is not None and watchdog is not None:
                watchdog.add(time.monotonic() + timeout, handle.id, timeout)
            self.stats["transfers"] += 1
            # held: what the caller sends inline, it sends holding the GIL (held.py)
            with held.window(hold) if hold else contextlib.nullcontext():
                failure = self._start_attempt(xfer, interruptible=True)
            if hold:
                held.turn().resume(time.monotonic())
            if failure is not None:
                raise failure
        return handle

    def _start_attempt(self, xfer: LiveTransfer, interruptible: bool = False
                       ) -> Exception | None:
        """Plans and posts the transfer's next attempt. Should that fail unexpectedly,
        the transfer fails (its segments unpinned, its handle finished) and the exception
        is returned, for :meth:`_submit` to raise; nothing is left waiting."""
        try:
            self._post_attempt(xfer, interruptible)
        except Exception as exc:
            log.exception("transfer %d to %s could not start", xfer.handle.id,
                          xfer.peer.name)
            error = exc if isinstance(exc, TransferError) else ProtocolError(
                f"transfer could not start: {exc!r}", peer=xfer.peer.name, op=str(xfer.op))
            self._finish(xfer, error)
            return exc
        return None

    def _post_attempt(self, xfer: LiveTransfer, interruptible: bool) -> None:
        """``interruptible``: Ctrl-C may cut a rail's reopening short (in ``write()``,
        not in a completion, whose rail's bookkeeping it would cut too)."""
        while True:  # rails torn down (a cancel, a dead connection) carry nothing more
            name = xfer.transports[0]
            try:
                with interrupts.allowed(interruptible):
                    rails = self._live_rails(xfer.peer.rails[name], self._transports[name])
            except BaseException:  # Ctrl-C while a rail was reopened: nothing posted yet
                self._finish(xfer, _interrupted(xfer))
                raise
            if rails:
                break
            with xfer.lock:
                skip = len(xfer.transports) > 1 and xfer.stopping is None
                if skip:
                    xfer.transports.pop(0)
            if not skip:
                self._finish(xfer, PeerLostError("no open rails to the peer",
                                                 peer=xfer.peer.name, op=str(xfer.op),
                                                 transport=name))
                return
            xfer.peer.demote(name)
        transport = self._transports[name]
        rails = transport.carriers(rails, xfer.local_segments, xfer.extents.remote_ids())
        if len(rails) > 1:
            # the least busy of the active rails first: a transfer smaller than two
            # shares goes to an idle rail, and a lone caller keeps to one warm connection
            # (alternating between idle ones measured slower)
            rails = sorted(rails[:transport.active(rails)], key=lambda rail: rail.inflight)
            rails = rails[:transport.spread(rails)]
        caps = transport.capabilities
        if (not caps.device_memory and xfer.staged is None
                and any(seg.device != "cpu" for seg in xfer.local_segments)
                and not transport.reaches_device(rails, xfer.local_segments)):
            try:  # device memory over a host-memory transport: through a bounce
                xfer.extents, xfer.staged = self._staging().stage(
                    xfer.op, xfer.extents, xfer.local_segments)
            except TransferError as exc:
                self._finish(xfer, exc.with_context(peer=xfer.peer.name, op=str(xfer.op),
                                                    transport=name))
                return
            xfer.staged.bounce.pin()
            xfer.local_segments.append(xfer.staged.bounce)
        weights = [float(getattr(rail, "weight", 1.0)) for rail in rails]
        plan = plan_columns(xfer.extents, num_rails=len(rails), slice_size=caps.slice_size,
                            max_sge=caps.max_sge, max_wr_bytes=caps.max_wr_bytes,
                            remote_scatter=caps.remote_scatter, weights=weights,
                            min_split=caps.min_split)
        transfer_id = next(self._transfer_ids)  # fresh per attempt: counts never mix
        first = xfer.first_id  # a later attempt names the first: notified once
        if first is None:
            xfer.first_id = transfer_id
        notify_pending = xfer.notify is not None and xfer.op is Op.WRITE
        works: list[Work] = []
        for wr in plan.requests:
            imm = None
            if wr.imm and xfer.op is Op.WRITE and xfer.notify is not None:
                imm = Immediate(transfer_id, plan.rails_used,
                                xfer.notify if notify_pending else None, first)
                notify_pending = False
            works.append(Work(next(self._wr_ids), xfer.op, wr.local, wr.remote, wr.nbytes,
                              imm, transport.prepare(wr, xfer.local_segments), xfer))
        items = [(rails[wr.rail], w) for wr, w in zip(plan.requests, works, strict=True)]
        with xfer.lock:
            stopped = xfer.stopping
            if stopped is None:
                xfer.handle.transport = name
                xfer.remaining = len(works)
                xfer.error = None
                xfer.started = time.monotonic()
                xfer.posted, xfer.posting = items, True
        if stopped is not None:
            self._finish(xfer, stopped)
            return
        self._post(xfer, items, interruptible)

    def _stand_in(self, xfer: LiveTransfer, closed: Rail) -> Rail | None:
        """Another rail of the attempt's transport that can carry its work, for one
        closed after it was chosen (another transfer's cancel tore it down); reopened
        if need be. None if there is none."""
        if self._closed:
            return None
        name = xfer.transports[0]
        transport = self._transports[name]
        listed = xfer.peer.rails[name]
        rails = ([rail for rail in listed if not rail.closed]
                 or self._live_rails(listed, transport))
        rails = transport.carriers(rails, xfer.local_segments, xfer.extents.remote_ids())
        return min(rails, key=lambda rail: rail.inflight) if rails else None

    @staticmethod
    def _live_rails(listed: list[Rail], transport: Transport) -> list[Rail]:
        """The open rails of ``listed`` (the peer's), once those of its closed ones that
        ``transport`` reopened (a broken path) are put in their place."""
        for i, rail in enumerate(listed):
            if rail.closed and (new := transport.revived(rail)) is not None:
                listed[i] = new
        return [rail for rail in listed if not rail.closed]

    def _post(self, xfer: LiveTransfer, items: list[tuple[Rail, Work]],
              interruptible: bool = False) -> None:
        """Posts ``items`` (already ``xfer.posted``, with ``xfer.posting`` set)."""
        try:
            for i, (rail, work) in enumerate(items):
                error = xfer.stopping
                if error is None:
                    try:
                        if xfer.staged is not None and xfer.op is Op.WRITE:
                            xfer.staged.ready_for(work.local)  # copies overlap sends
                        try:
                            rail.post(work)
                        except ClosedError:  # torn down since it was chosen (a cancel)
                            try:
                                with interrupts.allowed(interruptible):
                                    stand_in = self._stand_in(xfer, rail)
                            except BaseException:  # Ctrl-C while a rail was reopened
                                cut = _interrupted(xfer)
                                for _, unposted in items[i:]:
                                    self._on_complete(Completion(unposted, cut))
                                raise
                            if stand_in is None:
                                raise
                            stand_in.post(work)
                            with xfer.lock:
                                items[i] = (stand_in, work)
                        continue
                    except TransferError as exc:
                        error = exc
                for _, unposted in items[i:]:
                    self._on_complete(Completion(unposted, error))
                return
        finally:
            with xfer.lock:
                xfer.posting = False

    def _assist(self, handle: TransferHandle, timeout: float | None) -> None:
        """Takes the transfer's completions in the thread that waits for it, holding
        the GIL for up to ``hold_gil`` seconds (at most ``timeout``) per wait for the
        peer: a busy Python thread of the application would otherwise make each
        hand-off cost it up to the switch interval (transport/held.py)."""
        with self._lock:
            xfer = self._live.get(handle.id)
        if xfer is None:
            return
        budget = self.hold_gil if timeout is None else min(self.hold_gil, max(timeout, 0.0))
        turn = held.turn()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        turn.resume(start)
        kind = (handle.transport, handle.op)  # what a wait's length is learned for
        gave = False
        with Deferred():  # Ctrl-C midway would leave bookkeeping half done
            try:
                with contextlib.ExitStack() as windows:
                    windows.enter_context(held.window(budget))
                    for step in range(3):  # the attempt, then a READ's notification or a fallback
                        with xfer.lock:
                            items = None if xfer.posting else list(xfer.posted or ())
                            notifying = xfer.notifying
                        if not items or handle.state is not TransferState.PENDING:
                            return
                        by_rail: dict[int, tuple[Rail, list[Work]]] = {}
                        for rail, work in items:
                            by_rail.setdefault(id(rail), (rail, []))[1].append(work)
                        if step == 0 and not notifying:
                            # a payload a worker has not begun is ours to send first:
                            # then only the peer's part may be left (a tcp WRITE)
                            for rail, works in by_rail.values():
                                rail.send_queued(works)
                            start = time.monotonic()  # what is learned: the wait after
                            if self._give_turn(turn, kind, handle.nbytes, timeout, by_rail):
                                gave = True
                                start = time.monotonic()
                                self.stats["gil_given"] += 1
                                if deadline is not None:  # the turn given took its share
                                    if deadline <= start:
                                        return
                                    windows.enter_context(held.window(deadline - start))
                        took = False
                        for rail, works in by_rail.values():
                            took = rail.assist(works) or took
                        if not took:
                            return
            finally:
                end = time.monotonic()
                if not gave and handle.state is not TransferState.PENDING:
                    turn.learned(kind, handle.nbytes, end - start)
                turn.pause(end, end - start)

    @staticmethod
    def _give_turn(turn: held.Turn, kind: Hashable, nbytes: int, timeout: float | None,
                   by_rail: dict[int, tuple[Rail, list[Work]]]) -> bool:
        """Gives the GIL up before the wait (held.Turn) where it is expected to outlast
        this thread's turn with it and only the peer has work left; True if it did."""
        interval = sys.getswitchinterval()
        expected = turn.expect(kind, nbytes)
        if (expected is None or (timeout is not None and timeout < 2 * interval)
                or turn.left(time.monotonic()) >= expected
                or not all(rail.waits_only(works) for rail, works in by_rail.values())
                or turn.probe(kind, nbytes)):
            return False
        turn.give()
        return True

    def _on_complete(self, done: Completion) -> None:
        xfer: LiveTransfer = done.work.context
        with xfer.lock:
            if done.error is not None:
                xfer.error = xfer.error or done.error
            else:
                xfer.handle._add_bytes(done.work.nbytes)
            xfer.remaining -= 1
            if xfer.remaining > 0:
                return
            error = xfer.error
            repeat = error is not None and not self._closed and xfer.stopping is None
            again = (repeat and isinstance(error, TornDown)
                     and error.stopping != xfer.handle.id and xfer.retries < RETRIES)
            fallback = (repeat and not again and not xfer.notifying
                        and isinstance(error, _FALLBACK_ERRORS) and len(xfer.transports) > 1)
            if again:
                xfer.retries += 1
            if fallback:
                failed = xfer.transports.pop(0)
        if error is not None:
            if again:  # its rail was torn down by this side: the same way again
                self.stats["retries_torn_down"] += 1
                log.info("transfer %d to %s: %s; posting it again", xfer.handle.id,
                         xfer.peer.name, error.message)
                if xfer.notifying:  # a READ's notification: the same work, which the
                    done.work.resent = True  # peer drops should it have counted it
                    self._notify(xfer, done.work)
                    return
                xfer.handle._bytes_done = 0
                self._start_attempt(xfer)
                return
            if fallback:
                xfer.peer.demote(failed)
                if self.traffic is not None:
                    self.traffic.record(xfer.peer.name, failed,
                                        time.monotonic() - xfer.started, False)
                self.stats[f"fallback_{failed}"] += 1
                log.info("transfer %d to %s: %s failed (%s); retrying over %s",
                         xfer.handle.id, xfer.peer.name, failed, error, xfer.transports[0])
                xfer.handle._bytes_done = 0
                self._start_attempt(xfer)
                return
            self._finish(xfer, error)
            return
        if xfer.op is Op.READ and xfer.notify is not None and not xfer.notifying:
            xfer.notifying = True
            self._notify(xfer, Work(next(self._wr_ids), Op.WRITE, [], [], 0, Immediate(
                next(self._transfer_ids), 1, xfer.notify), None, xfer))
            return
        self._finish(xfer, None)

    def _notify(self, xfer: LiveTransfer, work: Work) -> None:
        """Posts a READ's notification (a WRITE of no bytes with its immediate), once
        the bytes are in."""
        rails = xfer.peer.rails[xfer.transports[0]]
        items = [(next((r for r in rails if not r.closed), rails[0]), work)]
        with xfer.lock:
            xfer.remaining = 1
            xfer.error = None
            xfer.posted, xfer.posting = items, True
        self._post(xfer, items)

    def _finish(self, xfer: LiveTransfer, error: TransferError | None) -> None:
        with xfer.lock:  # once: a closing engine may race a late completion here
            if xfer.finished:
                return
            xfer.finished = True
            if error is not None and xfer.stopping is not None:
                error = xfer.stopping  # the cancel said why, whatever failed after it
        if xfer.staged is not None:  # a READ's bytes onto the device, then the bounce back
            if error is None and xfer.op is Op.READ:
                try:
                    xfer.staged.to_device()
                except TransferError as exc:
                    error = exc.with_context(peer=xfer.peer.name, op=str(xfer.op))
            xfer.staged.finish()
        with xfer.lock:
            segments, xfer.local_segments = xfer.local_segments, []
        for seg in segments:
            seg.unpin()
        with self._lock:
            self._live.pop(xfer.handle.id, None)
            retire = (xfer.peer in self._retired
                      and not any(x.peer is xfer.peer for x in self._live.values()))
            if retire:
                self._retired.discard(xfer.peer)
        if retire:
            xfer.peer.close()
        self.stats["transfers_failed" if error else "transfers_done"] += 1
        if error is None:
            self.stats[_BYTES_STAT[xfer.op]] += xfer.handle.nbytes
            if xfer.transports:
                latency = time.monotonic() - xfer.started
                self.latencies.observe(str(xfer.op), xfer.transports[0], latency)
                xfer.peer.succeeded(xfer.transports[0], latency)
                if self.traffic is not None:
                    self.traffic.record(xfer.peer.name, xfer.transports[0], latency, True,
                                        xfer.handle.nbytes)
        xfer.handle._finish(error)

    def _staging(self) -> Staging:
        with self._lock:
            if self._staging_area is None:
                self._staging_area = Staging(
                    lambda buf, name: self.register(buf, name))  # type: ignore[attr-defined]
            return self._staging_area

    def _route(self, peer: Peer) -> list[str]:
        """The transports a new transfer to ``peer`` tries, best first: the peer's
        health order, reordered by the traffic policy when the engine has one."""
        order = list(peer.order)
        if self.traffic is None or len(order) < 2:
            return order
        return [t for t in self.traffic.order(order, self._placement, peer.meta)
                if t in order]

    def _cancel_handle(self, handle: TransferHandle, error: TransferError) -> bool:
        with self._lock:
            xfer = self._live.get(handle.id)
        if xfer is None:
            return False
        with Deferred():  # Ctrl-C midway would leave work neither withdrawn nor failed
            return self._cancel(xfer, error)

    def _cancel(self, xfer: LiveTransfer, error: TransferError) -> bool:
        """Fails ``xfer`` with ``error`` once nothing of ours touches its memory: work
        not yet sent is withdrawn, rails with its work on the wire are torn down (their
        other work fails with ``PeerLostError``, which may fail over). False if it had
        finished or was being stopped already."""
        with xfer.lock:
            if xfer.finished or xfer.stopping is not None:
                return False
            xfer.stopping = error
            xfer.error = error
            del xfer.transports[1:]  # no fallback
            items = list(xfer.posted or ())
            posting = xfer.posting
        self.stats["transfers_timed_out" if isinstance(error, TransferTimeout)
                   else "transfers_cancelled"] += 1
        by_rail: dict[int, tuple[Rail, list[Work]]] = {}
        for rail, work in items:
            by_rail.setdefault(id(rail), (rail, []))[1].append(work)
        for rail, works in by_rail.values():
            if not posting:  # while posting, which work a rail holds is not settled
                taken, busy = rail.withdraw(works)
                for work in taken:
                    self._on_complete(Completion(work, error))
                if not busy:
                    continue
            self.stats["rails_torn_down"] += 1
            log.info("tearing down a %s rail to %s to stop transfer %d (%s)",
                     xfer.handle.transport, xfer.peer.name, xfer.handle.id, error.message)
            rail.abort(TornDown(
                f"rail torn down to stop transfer {xfer.handle.id} ({error.message})",
                stopping=xfer.handle.id, peer=xfer.peer.name,
                transport=xfer.handle.transport))
        return True

    def _segment_stuck(self, seg: Segment) -> None:
        """``Segment.close`` found pins left after its wait: stop our transfers that use
        the segment, and have every transport tear down peers' requests on it."""
        with self._lock:
            live = [x for x in self._live.values()
                    if any(s is seg for s in x.local_segments)]
        for xfer in live:
            self._cancel(xfer, ClosedError("segment deregistered while the transfer used it",
                                           peer=xfer.peer.name, op=str(xfer.op),
                                           segment=seg.name))
        for transport in self._transports.values():
            try:
                transport.revoke(seg)
            except Exception:
                log.exception("%s could not revoke segment %s", transport.name, seg.name)

    def _start_watchdog(self) -> Watchdog | None:
        with self._lock:
            if self._watchdog is None and not self._closed:
                self._watchdog = Watchdog(self.name, self._zctx, self._signer,
                                          expire=self._expire, live=self._live,
                                          stuck=self._stuck, silent=self._silent,
                                          peer_timeout=self.peer_timeout)
            return self._watchdog

    def _expire(self, handle_id: int, seconds: float) -> None:
        with self._lock:
            xfer = self._live.get(handle_id)
        if xfer is not None:
            self._cancel(xfer, TransferTimeout(
                f"transfer {handle_id} not finished within its deadline of {seconds}s",
                peer=xfer.peer.name, op=str(xfer.op), transport=xfer.handle.transport,
                length=xfer.handle.nbytes))

    def _stuck(self, before: float) -> dict[Any, str]:
        """Peers with a transfer in flight since before ``before``, and where to probe
        them (their control endpoint)."""
        with self._lock:
            live = list(self._live.values())
        out: dict[Any, str] = {}
        for xfer in live:
            peer = xfer.peer
            if (0 < xfer.started < before and not xfer.finished and peer.lost is None
                    and peer not in out):
                out[peer] = peer.control_address
        return out

    def _silent(self, peer: Peer, seconds: float) -> None:
        with self._lock:
            current = self._peers.get(peer.name) is peer
        if current:
            self.peer_lost(peer.name, f"no answer to control probes for {seconds:.1f}s")

"""The initiator's side of a stream rail: one connection to a peer's stream server.

It opens with the ticket's proof (:func:`open_rail`), then sends requests from a pump
worker (or the caller's thread, for small work on an idle rail) and takes the answers,
in order, on a pump worker (:mod:`.pump`).
"""

from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    PeerLostError,
    ProtocolError,
    TransferError,
)
from transfer_engine.transport import held
from transfer_engine.transport.base import Completion, Host, OnComplete, Rail, TornDown, Work
from transfer_engine.transport.iovec import Pace
from transfer_engine.transport.stream import held_reading, pump
from transfer_engine.transport.stream.io import (
    PeerClosed,
    Unsent,
    has_bytes,
    queued_bytes,
    recv_exact,
    recv_head,
    send_rest,
    set_recv_timeout,
)
from transfer_engine.transport.stream.server import STALL_TIMEOUT
from transfer_engine.transport.stream.wire import (
    ANSWER,
    KIND_ANSWER,
    MAX_BODY,
    unpack_error,
)

log = logging.getLogger(__name__)

_LINGER_RESET = struct.pack("ii", 1, 0)


class StreamRail(Rail):
    """One connection to a peer's stream server.

    The rail has no thread of its own (:mod:`.pump`): small work on an idle rail is sent
    in the caller's thread, other work by a pump worker, and answers are read by a pump
    worker once the pump's poller saw them arrive.

    A work completes only once no thread of ours touches its local memory any more:
    should the rail fail while a thread is sending a WRITE's payload or receiving a
    READ's bytes, that thread completes the work when its system call has returned
    (the socket is shut down, so it returns at once). Work not yet taken by a sender
    can be withdrawn (:meth:`withdraw`).
    """

    transport_name = "stream"
    inline_bytes = 512 << 10  # largest work an idle rail sends in the caller's thread
    # an answer (a READ's bytes too) keeps a Pace of this many seconds, or the rail
    # fails: a target that stops sending midway holds no reader of ours for ever
    stall_timeout = STALL_TIMEOUT

    def __init__(self, sock: socket.socket, peer: str, index: int, on_complete: OnComplete,
                 host: Host) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self.peer = peer
        self.index = index
        self._on_complete = on_complete
        self._host = host
        self._lock = threading.Lock()
        self._pending: collections.deque[Work] = collections.deque()
        self._sendq: collections.deque[Work] = collections.deque()
        self._sending = False  # a drain of _sendq is scheduled or running
        self._drainer: int | None = None  # the thread draining it (a worker, or assist)
        # a payload a waiting caller began and left to the next drainer (assist)
        self._parked: tuple[Work, Unsent] | None = None
        # posted work no sender has taken yet, by id(): whoever pops it owns it
        self._queued: dict[int, Work] = {}
        # work whose memory a thread of ours is copying now (at most a sender's and the
        # reader's), and the error of those the rail failed meanwhile: their thread
        # completes them once it lets go (ids, as Work compares by value)
        self._touched: dict[int, Work] = {}
        self._held: dict[int, TransferError] = {}
        self._closed = False
        self._failure: TransferError | None = None
        self._torn_down = False  # closed by this side, the peer being fine (torn_down)
        # opens a new connection on the same path (set by the transport): see reopened
        self.reopen: Callable[[], Rail] | None = None
        self._send_lock = threading.Lock()
        self._busy = 0  # work queued or being sent
        self.bytes_sent = 0
        # threads inside a system call on the socket (thread id -> depth); the socket is
        # closed by whoever leaves last once the rail failed
        self._users: dict[int, int] = {}
        self._idle = threading.Condition(self._lock)
        self._released = False
        # the thread reading answers now (the poller, a worker, or a caller waiting
        # inside a held window, which has the socket watched again when it is done)
        self._reader: int | None = None
        # a pump worker that took an answer waits this long for the next (one system
        # call: the receive bound), and every receive of ours waits on past it
        set_recv_timeout(sock, pump.LINGER)
        self._rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self._pump = pump.acquire()
        self._pump.watch(self._fd, self._on_readable, self._on_ready)

    # hooks for subclasses
    def _payload(self, work: Work) -> int:
        """Bytes this side sends for ``work`` besides the request itself."""
        return work.nbytes if work.op is Op.WRITE else 0

    def _send_request(self, work: Work, spill: bool = False) -> Unsent | None:
        """Sends ``work``'s request (with the payload where the stream carries it);
        raises :class:`PeerClosed` when the stream broke. With ``spill``, in a held
        window, may return the payload the socket did not take within the budget."""
        raise NotImplementedError

    def _take_read(self, work: Work) -> None:
        """Called after a successful READ answer; the bytes may follow on the stream."""

    # Rail API
    @property
    def closed(self) -> bool:
        return self._closed or self._failure is not None

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._queued)

    def post(self, work: Work) -> None:
        # An idle rail sends small work in the caller's thread: a thread hand-off costs
        # more than sending a few hundred KiB (a READ's request is small whatever it
        # reads). Busy rails queue, keeping order; the pump's own threads always queue
        # (they must not wait on one peer while others' answers arrive).
        with self._lock:
            if self._closed:
                raise ClosedError("rail is closed", peer=self.peer, op=str(work.op),
                                  transport=self.transport_name)
            if self._failure is not None:
                raise self._failure
            payload = self._payload(work)
            inline = self._busy == 0 and payload <= self.inline_bytes and not pump.in_pump()
            self._busy += 1
            schedule = False
            if inline:
                self._send_lock.acquire()  # free: nothing queued or being sent
                self._pending.append(work)
                if payload:
                    self._touched[id(work)] = work
                self._enter()
            else:
                self._queued[id(work)] = work
                self._sendq.append(work)
                schedule = not self._sending
                self._sending = True
            if held.until() is not None:  # the caller will take the answer (assist)
                self._pump.hold(self._fd, held.grace())
        if schedule:
            self._pump.submit(self._drain_sends)
        if inline:
            try:
                self._transmit(work, payload > 0)
            finally:
                self._send_lock.release()
                with self._lock:
                    self._busy -= 1
                self._leave()

    def withdraw(self, works: Sequence[Work]) -> tuple[list[Work], bool]:
        with self._lock:
            taken = [w for w in works if self._queued.pop(id(w), None) is not None]
            ids = {id(w) for w in works}
            busy = (any(id(w) in ids for w in self._pending)
                    or any(key in ids for key in self._touched))
        return taken, busy

    def _error(self, exc_type: type[TransferError], message: str, work: Work | None = None
               ) -> TransferError:
        return exc_type(message, peer=self.peer, transport=self.transport_name,
                        op=str(work.op) if work else None)

    # who touches the socket (call _enter holding self._lock)
    def _enter(self) -> None:
        me = threading.get_ident()
        self._users[me] = self._users.get(me, 0) + 1

    def _leave(self) -> None:
        me = threading.get_ident()
        with self._lock:
            depth = self._users.pop(me) - 1
            if depth:
                self._users[me] = depth
            last = not self._users
            if last:
                self._idle.notify_all()
            finish = last and self._failure is not None and not self._released
            if finish:
                self._released = True
        if finish:
            self._finalize()

    def _finalize(self) -> None:
        """Closes the socket of a failed rail once no thread of ours uses it: a dead
        peer's rail holds no descriptor until it is closed."""
        self._pump.forget(self._fd)
        try:
            self._sock.close()
        finally:
            pump.release(self._pump)

    # sending (a pump worker, or a caller that waits: assist)
    def _drain_sends(self, spill: bool = False) -> None:
        """Sends the queued work in order, as the rail's one drainer. ``spill``: the
        caller waits in a held window; what the socket does not take within its budget
        is left (parked) to a worker, which this call then starts."""
        with self._lock:
            if self._drainer is not None:
                return  # another thread drains: it sends what this job was for
            self._drainer = threading.get_ident()
        try:
            self._drain(spill)
        finally:
            with self._lock:
                mine = self._drainer == threading.get_ident()  # left by an exception
                if mine:
                    self._drainer = None
                    self._sending = bool(self._sendq) or self._parked is not None
            if mine and self._sending:  # a caller interrupted between works: go on
                self._pump.submit(self._drain_sends)

    def _drain(self, spill: bool) -> None:
        while True:
            with self._lock:
                parked, self._parked = self._parked, None
                work = None
                if parked is None:
                    while self._sendq:
                        candidate = self._sendq.popleft()
                        if self._queued.pop(id(candidate), None) is not None:
                            work = candidate
                            break
                        self._busy -= 1  # withdrawn, or already failed by _fail_all
                    if work is None:  # with the lock held: a post now schedules anew
                        self._sending = False
                        self._drainer = None
                        return
                self._enter()
            finished = True
            left: Unsent | None = None
            try:
                with self._send_lock:
                    if parked is not None:
                        work, rest = parked
                        left = self._transmit(work, True, spill, rest)
                    elif work is not None:
                        with self._lock:
                            failed = self._failure
                            touch = failed is None and self._payload(work) > 0
                            if failed is None:
                                self._pending.append(work)
                            if touch:
                                self._touched[id(work)] = work
                        if failed is None:
                            left = self._transmit(work, touch, spill)
                        else:
                            self._complete(work, failed)
                    if left is not None and work is not None:  # a worker goes on
                        finished = False
                        with self._lock:
                            self._parked = (work, left)
                            self._drainer = None  # _sending stays set
                        self._pump.submit(self._drain_sends)
                        return
            finally:
                if finished:
                    with self._lock:
                        self._busy -= 1
                self._leave()

    def _transmit(self, work: Work, touched: bool, spill: bool = False,
                  rest: Unsent | None = None) -> Unsent | None:
        """Sends ``work`` (already pending; or ``rest``, what is left of its payload),
        then lets go of its memory if ``touched`` (only a payload sent from our memory
        touches it; a READ's bytes are the reader's). With ``spill``: what the socket
        did not take within the held budget, the memory still touched (see
        :meth:`_drain`)."""
        error = None
        try:
            left = (send_rest(self._sock, rest, spill) if rest is not None
                    else self._send_request(work, spill))
            if left is not None:
                return left
            self.bytes_sent += work.nbytes
        except PeerClosed as exc:
            error = self._error(PeerLostError, f"connection lost while sending: {exc}")
        except Exception as exc:  # a bug must not leave a handle waiting forever
            log.exception("rail %s#%d send failed", self.peer, self.index)
            error = self._error(ProtocolError, f"send failed: {exc!r}")
        except BaseException as exc:  # interrupted mid-request: the stream is broken
            if touched:
                self._let_go(work)
            self._interrupted("send", exc)
            raise
        if touched:
            self._let_go(work)
        if error is not None:
            self._fail_all(error)
        return None

    def _let_go(self, work: Work) -> bool:
        """Our thread no longer touches ``work``'s memory; completes it if the rail
        failed meanwhile (and says so)."""
        with self._lock:
            del self._touched[id(work)]
            error = self._held.pop(id(work), None)
        if error is None:
            return False
        self._complete(work, error)
        return True

    # reading answers (a pump worker, once the socket turned readable)
    def _on_ready(self) -> bool:
        """On the poller: takes the answers that are whole in the kernel already and
        need no wait (a READ's bytes are a worker's), so that a quiet rail's answer
        costs no hand-off to a worker; False when a worker must take over."""
        with self._lock:
            if self._released or not self._claim():
                return True
            self._enter()
        handled = rearm = False
        try:
            while True:
                ready = self._whole_answer()
                if ready is None:
                    break  # a worker's
                taken = self._answer() if ready else None
                if taken is None:
                    handled = rearm = True  # nothing more there
                    break
                if not taken:
                    handled = True  # the rail failed: nothing to watch
                    break
        finally:
            self._unclaim()
            if rearm:
                self._pump.rearm(self._fd)
            self._leave()
        return handled

    def _whole_answer(self) -> bool | None:
        """True if an answer is whole in the kernel and asks for nothing more, False if
        no byte is there, None otherwise (partial, a READ's bytes, the stream's end)."""
        queued = queued_bytes(self._sock)
        if queued < ANSWER.size:
            return None if queued or has_bytes(self._sock) else False
        try:
            head = self._sock.recv(ANSWER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return None
        if len(head) < ANSWER.size:
            return None
        kind, status, _, body_len, wr_id = ANSWER.unpack(head)
        if queued < ANSWER.size + body_len:
            return None
        if status or kind != KIND_ANSWER:
            return True
        with self._lock:
            work = self._pending[0] if self._pending else None
        if (work is not None and work.wr_id == wr_id and work.op is Op.READ
                and self._payload_follows(work)):
            return None
        return True

    def _payload_follows(self, work: Work) -> bool:
        """Whether a READ's bytes follow its answer on the stream."""
        return False

    def _on_readable(self) -> None:
        with self._lock:
            if self._released or not self._claim():
                return
            self._enter()
        rearm = False
        try:
            if has_bytes(self._sock):
                while True:
                    taken = self._answer()
                    if taken is None:
                        break  # none came within pump.LINGER: idle
                    if not taken:
                        return  # the rail failed: nothing to watch
                    if self._pump.crowded():
                        break  # other rails wait for a worker
            rearm = True
        finally:
            self._unclaim()
            if rearm:  # before leaving: the socket is closed only once nobody uses it
                self._pump.rearm(self._fd)
            self._leave()

    def _claim(self) -> bool:
        """Makes this thread the rail's reader (holding ``_lock``); False if another
        thread reads."""
        if self._reader is not None:
            return False
        self._reader = threading.get_ident()
        return True

    def _unclaim(self) -> None:
        with self._lock:
            self._reader = None

    def assist(self, works: Sequence[Work]) -> bool:
        return held_reading.assist(self, works)

    def send_queued(self, works: Sequence[Work]) -> None:
        held_reading.send_queued(self, works)

    peer_copies = False  # the target moves a work's bytes; only requests and answers travel

    def waits_only(self, works: Sequence[Work]) -> bool:
        return held_reading.waits_only(self, works)

    def _answer(self, head: bytes | None = None) -> bool | None:
        """Takes one answer (whose header the caller may have read: ``head``),
        waiting up to :data:`pump.LINGER` (the socket's receive bound) for it to begin:
        None if it did not. False once the rail failed."""
        try:
            if head is None:
                head = recv_head(self._sock, ANSWER.size, stall=self.stall_timeout)
            if head is None:
                return None
            kind, status, _, body_len, wr_id = ANSWER.unpack(head)
            if kind != KIND_ANSWER or body_len > MAX_BODY:
                raise ProtocolError("malformed answer", peer=self.peer,
                                    transport=self.transport_name)
            body = recv_exact(self._sock, body_len, patient=True, pace=Pace(self.stall_timeout))
            with self._lock:
                work = self._pending[0] if self._pending else None
                take = (work is not None and work.wr_id == wr_id and not status
                        and work.op is Op.READ)
                if take and work is not None:
                    self._touched[id(work)] = work
            if work is None or work.wr_id != wr_id:
                raise ProtocolError(f"answer for unknown work request {wr_id}",
                                    peer=self.peer, transport=self.transport_name)
            error = None
            if status:
                error = unpack_error(body, status, self.peer, str(work.op),
                                     self.transport_name)
            elif take:
                held = False
                try:
                    self._take_read(work)
                finally:
                    held = self._let_go(work)
                if held:
                    return True  # the rail failed meanwhile; the next read ends us
            with self._lock:
                if not self._pending or self._pending[0] is not work:
                    return True  # failed meanwhile, and completed by _fail_all
                self._pending.popleft()
            self._complete(work, error)
            return True
        except PeerClosed as exc:
            if not self._closed:
                self._fail_all(self._error(PeerLostError, f"connection lost: {exc}"))
        except TransferError as exc:
            self._fail_all(exc)
        except Exception as exc:
            log.exception("rail %s#%d reader failed", self.peer, self.index)
            self._fail_all(self._error(ProtocolError, f"reader failed: {exc!r}"))
        if not self._closed:
            self._fail_all(self._error(PeerLostError, "connection lost"))
        return False

    def _complete(self, work: Work, error: TransferError | None) -> None:
        try:
            self._on_complete(Completion(work, error))
        except Exception:
            log.exception("completion callback failed")

    def _fail_all(self, error: TransferError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
            error = self._failure  # the first cause wins: a later close keeps it
            pending = []
            for work in self._pending:
                if id(work) in self._touched:  # completed by its thread on letting go
                    self._held[id(work)] = error
                else:
                    pending.append(work)
            self._pending.clear()
            queued = list(self._queued.values())
            self._queued.clear()
            parked, self._parked = self._parked, None  # no thread sends it now
            if parked is not None:
                self._busy -= 1
            finish = not self._users and not self._released
            if finish:
                self._released = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # a thread in a system call returns
        except OSError:
            pass
        for work in pending:
            self._complete(work, error)
        for work in queued:
            self._complete(work, error)
        if parked is not None:
            self._let_go(parked[0])
        if finish:
            self._finalize()

    def _interrupted(self, call: str, exc: BaseException) -> None:
        """A ``call`` of ours on the socket was interrupted midway (Ctrl-C in a waiting
        caller): the stream is broken, the peer is not, so the rail goes as torn down
        and its work may be posted again (:class:`TornDown`)."""
        self._torn_down = True
        self._fail_all(self._error(TornDown, f"{call} interrupted: {exc!r}"))

    @property
    def torn_down(self) -> bool:
        """Closed by this side (to stop a transfer, for a lost peer, after an
        interrupted call), not broken by the peer or the network."""
        return self._torn_down

    def reopened(self) -> Rail | None:
        """A new connection on this rail's path, opened now, once, if this side tore it
        down; None otherwise (a broken path is the transport's to try again). Cut
        short (Ctrl-C), the next transfer tries again."""
        with self._lock:
            reopen = self.reopen
            if reopen is None or not self._torn_down:
                return None
            self.reopen = None
        try:
            return reopen()
        except TransferError as exc:
            log.info("%s rail to %s not reopened: %s", self.transport_name, self.peer, exc)
            return None
        except BaseException:
            self.reopen = reopen
            raise

    def abort(self, error: TransferError) -> None:
        with self._lock:
            if self._failure is None and not self._closed:
                self._failure = error
                self._torn_down = True  # not if it had broken by itself first
        try:  # close with a reset: bytes still queued either side are dropped, not landed
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            copying = self.peer_copies and not self._released and any(
                w.op is Op.READ for w in self._pending)
            if copying:
                self._enter()  # the socket stays open meanwhile
        if copying:  # the peer copies into our memory: seeing us hang up, it stops after
            try:  # the copy under way and closes its end
                held.hang_up(self._sock, 5.0)
            finally:
                self._leave()
        self._fail_all(self._error(ClosedError, "rail is closed"))
        me = threading.get_ident()
        deadline = time.monotonic() + 5
        with self._lock:  # other threads in a system call return (the socket is shut)
            while set(self._users) - {me} and time.monotonic() < deadline:
                self._idle.wait(0.05)

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else ("FAILED" if self._failure else "OPEN")
        return (f"<Rail {self.transport_name}\u2192{self.peer}#{self.index} {state} "
                f"inflight={self.inflight}>")


"""The target's side of the stream rails: accept, open, check, move, count, answer.

A connection opens on a thread of its own; once open, the process's pump (:mod:`.pump`)
watches it, and a pump worker serves each request as it arrives: it validates the
request against the segment table *before* touching memory, moves the bytes (the
subclass says how), counts the immediate after the bytes, and answers. Every resource
a stranger can make it hold is bounded (:mod:`.wire`'s notes and the constants here).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import msgpack
import numpy as np

from transfer_engine.control.tickets import new_challenge
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    AuthenticationError,
    ProtocolError,
    TransferError,
    error_code,
)
from transfer_engine.segment import Segment
from transfer_engine.transport.base import Host, Immediate
from transfer_engine.transport.cuts import Cuts, Teardown
from transfer_engine.transport.iovec import Pace
from transfer_engine.transport.stream import pump
from transfer_engine.transport.stream.connection import (
    PARK_PART,
    Connection,
    Parking,
    can_park,
)
from transfer_engine.transport.stream.io import (
    PeerClosed,
    Steps,
    Wait,
    has_bytes,
    recv_bytes_steps,
    recv_exact,
    recv_head,
    recv_steps,
    send_bytes,
    send_steps,
    set_stall_timeout,
    tune_socket,
)
from transfer_engine.transport.stream.targets import (
    Targets,
    check_entries,
    pin,
    refuse,
    stage,
    unstage,
)
from transfer_engine.transport.stream.wire import (
    ANSWER,
    FLAG_IMM,
    FLAG_RESENT,
    HEADER,
    KIND_ANNOUNCE,
    KIND_ANSWER,
    KIND_DEVICES,
    KIND_HELLO,
    KIND_READ,
    KIND_WRITE,
    MAX_BODY,
    WIRE_VERSION,
    decode_entries,
    entries_size,
    pack_error,
)

log = logging.getLogger(__name__)

RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
HELLO_TIMEOUT = 5.0  # seconds a new connection has to open
STALL_TIMEOUT = 20.0  # longest pause inside a request or an answer
MAX_OPENING = 64  # connections opening at once
MAX_CONNECTIONS = 4096  # connections open at once, per server


class Refused(Exception):
    """A connection that did not open: closed without an answer."""


class StreamServer(Teardown):
    """Accepts rails and serves their requests against the host's segments."""

    transport_name = "stream"
    stages_device = True  # device segments served through a bounce (targets.stage)

    def __init__(self, listener: socket.socket, host: Host, buffer_bytes: int,
                 stall_timeout: float = STALL_TIMEOUT) -> None:
        self._listener = listener
        self._host = host
        self._buffer_bytes = buffer_bytes
        self._stall = stall_timeout
        self._lock = threading.Lock()
        # by socket: the opening's thread, then None (served by the pump)
        self._conns: dict[socket.socket, threading.Thread | None] = {}
        self._open: dict[socket.socket, Connection] = {}
        self._shed: set[socket.socket] = set()  # idle rails shut to make room
        self._opening: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._closed = False
        self.bytes_received = 0
        self.parking = Parking()
        self.cuts = Cuts()
        self.stats: collections.Counter[str] = collections.Counter()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"te-{self.transport_name}-accept")
        self._acceptor.start()

    # hooks
    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        """Moves a WRITE's bytes into ``views`` (already checked and pinned).

        ``local`` holds the initiator's (address, length) records when it sent them
        (shm). Raising ``TransferError``, it has taken the whole payload off the
        stream (the error is answered and the rail goes on)."""
        raise NotImplementedError

    def land_steps(self, conn: Connection, views: Targets, local: np.ndarray | None) -> Steps:
        """:meth:`land` as steps: a payload that the peer sends slowly waits on the
        poller, its worker free (:func:`~.io.recv_steps`)."""
        iov = self.stream_rows(views) if can_park(conn) else None
        if iov is not None:
            yield from recv_steps(conn.sock, iov, views.nbytes, Pace(self._stall), self._stall)
        else:
            yield from self.land_bounced(conn, views, local)

    def land_bounced(self, conn: Connection, views: Targets, local: np.ndarray | None) -> Steps:
        """:meth:`land_steps` where :meth:`stream_rows` places nothing: :meth:`land`."""
        self.land(conn, views, local)
        yield from ()

    def park_cost(self, views: Targets) -> int:
        """Bytes a parked WRITE into ``views`` holds beyond its request (a bounce)."""
        return 0

    def stream_rows(self, views: Targets) -> np.ndarray | None:
        """Where a WRITE's payload lands, as iovec rows (None: :meth:`land`'s way)."""
        return None

    def serve(self, conn: Connection, wr_id: int, views: Targets,
              local: np.ndarray | None) -> None:
        """Moves a READ's bytes to the initiator and answers."""
        raise NotImplementedError

    def serve_steps(self, conn: Connection, wr_id: int, views: Targets,
                    local: np.ndarray | None) -> Steps:
        """:meth:`serve` as steps: an answer the peer takes slowly waits likewise."""
        iov = self.stream_rows(views) if can_park(conn) else None
        if iov is None:
            yield from self.serve_bounced(conn, wr_id, views, local)
            return
        # the head alone first: it leaves at once, and the initiator readies its receive
        send_bytes(conn.sock, self._answer(wr_id, None))
        yield from send_steps(conn.sock, iov, views.nbytes, Pace(self._stall), self._stall)

    def serve_bounced(self, conn: Connection, wr_id: int, views: Targets,
                      local: np.ndarray | None) -> Steps:
        """:meth:`serve_steps` where :meth:`stream_rows` places nothing: :meth:`serve`."""
        self.serve(conn, wr_id, views, local)
        yield from ()

    def announce_devices(self, conn: Connection, body: bytes) -> None:
        """An initiator's device segments (shm IPC); refused by other transports."""
        raise ProtocolError(f"{self.transport_name} takes no device announcement",
                            peer=conn.peer)

    def stage(self, conn: Connection, views: Targets, op: Op, local: np.ndarray | None
              ) -> tuple[Targets, Callable[[], None] | None]:
        """``views`` with device memory put behind a bounce (:func:`targets.stage`; a
        READ's device bytes are copied on return)."""
        return stage(views, op, conn.peer)

    def refuse_write(self, conn: Connection, nbytes: int) -> None:
        """Consumes the payload of a refused WRITE so the stream stays in step."""

    def tune(self, sock: socket.socket) -> None:
        """Sets the options of an accepted connection before it serves anything."""
        tune_socket(sock, self._buffer_bytes)

    def vouch(self, conn: Connection) -> None:
        """The transport's own check of a peer with a good ticket; raises ``Refused``."""

    def _accept_loop(self) -> None:
        backoff = 0.0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL, None):
                    return  # listener closed
                if exc.errno in RESOURCE_ERRORS:  # out of fds or memory: wait, go on
                    if not backoff:
                        log.warning("%s: cannot accept rails (%s); retrying with backoff",
                                    self.transport_name, exc.strerror)
                    self.stats["accept_errors"] += 1
                    backoff = min(1.0, backoff * 2 or 0.01)
                    time.sleep(backoff)
                continue  # ECONNABORTED, EPROTO, EINTR...: that one connection only
            if backoff:
                log.warning("%s: accepting rails again", self.transport_name)
                backoff = 0.0
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                if len(self._conns) - len(self._shed) >= MAX_CONNECTIONS and \
                        not self._shed_idle():
                    self.stats["connections_shed"] += 1
                    sock.close()
                    continue
                if len(self._opening) >= MAX_OPENING:
                    # a peer opens in a round trip: the oldest opening is a straggler
                    stale = next(iter(self._opening))
                    del self._opening[stale]
                    self.stats["openings_shed"] += 1
                    try:
                        stale.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                try:
                    self.tune(sock)
                except OSError as exc:  # died early, or an option the host refuses
                    log.warning("%s connection not accepted: %s", self.transport_name, exc)
                    sock.close()
                    continue
                thread = threading.Thread(target=self._serve_conn, args=(sock,), daemon=True,
                                          name=f"te-{self.transport_name}-serve")
                self._conns[sock] = thread
                self._opening[sock] = None
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: shed the connection
                with self._lock:
                    self._conns.pop(sock, None)
                    self._opening.pop(sock, None)
                sock.close()

    def _shed_idle(self) -> bool:
        """At capacity (holding ``_lock``): shuts the oldest idle rail of the peer that
        holds the most (its worker drops it), so that no peer keeps the others out.
        False when no peer holds more than one."""
        held = collections.Counter(c.peer for s, c in self._open.items()
                                   if s not in self._shed).most_common(1)
        if not held or held[0][1] < 2:
            return False
        peer = held[0][0]
        for sock, conn in self._open.items():  # oldest first
            if conn.peer == peer and not conn.busy and sock not in self._shed:
                self._shed.add(sock)
                self.stats["rails_shed"] += 1
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return True
        return False

    def _admit(self, sock: socket.socket) -> tuple[Connection, bytes]:
        """The opening: challenge, ticket, proofs; returns the connection and our proof.
        Raises :class:`Refused`."""
        sock.settimeout(HELLO_TIMEOUT)
        challenge = new_challenge()
        try:
            send_bytes(sock, challenge)
            kind, _, _, _, _, body_len, _, _, _ = HEADER.unpack(
                recv_exact(sock, HEADER.size))
            if kind != KIND_HELLO or body_len > 4096:
                raise Refused("no hello")
            info = msgpack.unpackb(recv_exact(sock, body_len))
        except (PeerClosed, TimeoutError, OSError, ValueError, msgpack.UnpackException,
                struct.error) as exc:
            raise Refused(f"no valid hello: {exc}") from None
        if not isinstance(info, dict) or info.get("version") != WIRE_VERSION:
            raise Refused(f"rail version {info.get('version') if isinstance(info, dict) else '?'}")
        try:
            ticket, proof = self._host.admit_rail(info.get("ticket"), self.transport_name,
                                                  challenge, info.get("nonce"),
                                                  info.get("proof"))
        except TransferError as exc:
            raise Refused(str(exc)) from None
        conn = Connection(sock, ticket.peer, ticket.pid, ticket)
        try:
            self.vouch(conn)
        except BaseException:
            ticket.release()
            raise
        return conn, proof

    def _serve_conn(self, sock: socket.socket) -> None:
        """The opening, on a thread of its own (a stranger may take its time, up to
        HELLO_TIMEOUT, and must not hold a pump thread); the open rail then goes to the
        pump, and this thread ends."""
        conn: Connection | None = None
        mark = self.cuts.mark()
        try:
            try:
                conn, proof = self._admit(sock)
            except Refused as exc:
                self.stats["rails_refused"] += 1
                log.info("%s rail refused: %s", self.transport_name, exc)
                try:
                    send_bytes(sock, self._answer(0, AuthenticationError("rail refused")))
                except PeerClosed:
                    pass
                self._drop(sock, None)
                return
            sock.settimeout(None)
            set_stall_timeout(sock, self._stall)
            send_bytes(sock, ANSWER.pack(KIND_ANSWER, 0, 0, len(proof), 0) + proof)
            with self._lock:
                self._opening.pop(sock, None)
                if self._closed or self.cuts.since(conn.peer, mark):
                    raise PeerClosed("server closed, or its peer cut")
                self._open[sock] = conn
                conn.pump = pump.acquire()
                self._conns[sock] = None  # served by the pump from now on
                conn.pump.watch(sock.fileno(), lambda: self._on_readable(conn))
        except (PeerClosed, TimeoutError, OSError):
            self._drop(sock, conn)
        except Exception:
            log.exception("%s server failed", self.transport_name)
            self._drop(sock, conn)

    def _drop(self, sock: socket.socket, conn: Connection | None) -> None:
        """Forgets a connection and frees what it holds (once: later calls do nothing)."""
        with self._lock:
            if self._conns.pop(sock, False) is False:
                return
            self._open.pop(sock, None)
            self._shed.discard(sock)
            self._opening.pop(sock, None)
            steps = None
            if conn is not None:
                steps, conn.parked = conn.parked, None
        if steps is not None:
            steps.close()  # its pins and bounce go
        held = conn.pump if conn is not None else None
        if held is not None:
            held.forget(sock.fileno())
        if conn is not None:
            if conn.ticket is not None:
                conn.ticket.release()
            if conn.pidfd is not None:
                os.close(conn.pidfd)
            if conn.devices is not None:
                conn.devices.close()
        sock.close()
        if held is not None:
            pump.release(held)

    def _on_readable(self, conn: Connection) -> None:
        """Serves the requests arriving on ``conn`` (a pump worker), then has the pump
        watch it again."""
        with self._lock:
            if conn.busy or conn.sock not in self._open or self._closed:
                return
            conn.busy = True
            steps, conn.parked = conn.parked, None
        sock = conn.sock
        held = conn.pump
        assert held is not None
        wait: Wait | None = None
        try:
            # a request's header, entries and body come as steps too: a peer that sends
            # them slowly parks like a slow payload
            head = b"" if steps is None and has_bytes(sock) else None
            while (steps is not None or head is not None) and not self._closed:
                if steps is None:
                    steps = self._serve_one(conn, head)  # type: ignore[arg-type]
                wait = next(steps, None)
                if wait is not None:
                    break  # the peer is slow: the rail waits on the poller, not here
                steps = None
                if held.crowded():
                    break  # other rails wait for a worker
                head = recv_head(sock, HEADER.size, pump.LINGER, self._stall, whole=False)
        except Exception as exc:  # the rail goes; the peer's other rails stay
            if isinstance(exc, TransferError):
                log.warning("%s rail from %s dropped: %s", self.transport_name, conn.peer, exc)
            elif not isinstance(exc, PeerClosed | TimeoutError):
                log.exception("%s server failed", self.transport_name)
            self._drop(sock, conn)
            return
        with self._lock:  # rearmed only while open: a dropped rail's number is reused
            conn.busy = False
            live = sock in self._open and not self._closed
            if live:
                conn.parked = steps if wait is not None else None
                held.rearm(sock.fileno(), *(wait or ()))
        if not live:
            if steps is not None and wait is not None:
                steps.close()
            self._drop(sock, conn)

    def _serve_one(self, conn: Connection, head: bytes) -> Steps:
        """One request, as steps (see :meth:`land_steps`), from the part of its header
        already taken."""
        sock = conn.sock
        if len(head) < HEADER.size:
            head += yield from self.take_steps(conn, HEADER.size - len(head))
        (kind, flags, n_remote, n_local, _, body_len, wr_id, transfer_id,
         expected) = HEADER.unpack(head)
        if kind == KIND_ANNOUNCE:
            self.check_announce(conn, body_len)
            self._announce(conn, (yield from self.take_steps(conn, body_len)))
            return
        if kind == KIND_DEVICES:
            if body_len > MAX_BODY:
                raise ProtocolError("device announcement too large", peer=conn.peer)
            self.announce_devices(conn, (yield from self.take_steps(conn, body_len)))
            return
        if kind not in (KIND_WRITE, KIND_READ):
            raise ProtocolError(f"unknown request kind {kind}", peer=conn.peer)
        blob = yield from self.take_steps(conn, entries_size(
            flags, n_remote, n_local, body_len, conn.peer))
        entries = decode_entries(blob, flags, n_remote, n_local, conn.peer)
        local, body, nbytes = entries.local, entries.body, entries.nbytes
        op = Op.WRITE if kind == KIND_WRITE else Op.READ
        pinned = conn.pinned
        try:
            if entries.uniform is not None:
                views = self._resolve_uniform(conn, op, *entries.uniform, nbytes, pinned)
            else:
                assert entries.remote is not None
                views = self._resolve(conn, op, entries.remote, nbytes, entries.low,
                                      entries.high, pinned)
            views, landed = self.stage(conn, views, op, local)
        except TransferError as exc:
            for seg in pinned:
                seg.unpin()
            pinned.clear()
            if op is Op.WRITE:
                self.refuse_write(conn, nbytes)
            send_bytes(sock, self._answer(wr_id, exc))
            return
        try:
            if op is Op.WRITE:
                try:
                    if nbytes:
                        yield from self.parking.steps(self.land_steps(
                            conn, views, local), lambda: len(blob) + self.park_cost(views),
                            sock)
                        if landed is not None:
                            landed()
                except TransferError as exc:
                    send_bytes(sock, self._answer(wr_id, exc))
                    return
                self.bytes_received += nbytes
                if flags & FLAG_IMM:
                    self._host.deliver_immediate(
                        conn.peer, Immediate(transfer_id, expected, body or None, entries.first),
                        conn.ticket.id if conn.ticket is not None else b"", wr_id,
                        bool(flags & FLAG_RESENT))
                send_bytes(sock, self._answer(wr_id, None))
            else:
                yield from self.parking.steps(self.serve_steps(conn, wr_id, views, local),
                                              lambda: self.park_cost(views), sock)
        finally:
            unstage(views)
            for seg in pinned:
                seg.unpin()
            pinned.clear()

    def take_steps(self, conn: Connection, n: int) -> Generator[Wait, None, bytes]:
        """The next ``n`` bytes of a request, at :class:`Pace` (no trickling): as steps
        where the rail may park, so that a peer slow to send them holds no worker."""
        if n <= 0:
            return b""
        if not can_park(conn):
            return recv_exact(conn.sock, n, pace=Pace(self._stall))
        return (yield from self.parking.steps(
            recv_bytes_steps(conn.sock, n, Pace(self._stall), self._stall), lambda: n,
            conn.sock, PARK_PART))

    def check_announce(self, conn: Connection, body_len: int) -> None:
        """Initiators announce their ranges to shm only (its target copies from them)."""
        raise ProtocolError(f"{self.transport_name} takes no range announcement",
                            peer=conn.peer)

    def _announce(self, conn: Connection, body: bytes) -> None:
        """Records an announcement :meth:`check_announce` let through."""

    def _resolve(self, conn: Connection, op: Op, remote: np.ndarray, nbytes: int,
                 low: list[int], high: list[int], pinned: list[Any]) -> Targets:
        """Checks every entry before any byte moves and pins the segments; returns where
        the bytes go. ``low``/``high`` are the entries' column minima and maxima."""
        write = op is Op.WRITE
        opname = str(op)
        ids = remote[:, 0]
        segs: dict[int, Segment] = {}
        if len(remote) and low[0] == high[0]:
            seg_id = low[0]
            segs[seg_id] = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
            check_entries(conn.peer, segs[seg_id], remote, write, opname, low, high)
        elif len(remote):
            for seg_id in np.unique(ids).tolist():
                seg = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
                check_entries(conn.peer, seg, remote[ids == seg_id], write, opname)
                segs[seg_id] = seg
        pin(segs, pinned, conn.peer, opname, self.transport_name, self.stages_device)
        if len(segs) <= 1:  # (offset, length) rows plus (base, 0): the iovec rows
            base = next(iter(segs.values())).address if segs else 0
            rows = np.empty((len(remote) + 1, 2), dtype=np.uint64)
            np.add(remote[:, 1:], np.array((base, 0), dtype=np.uint64), out=rows[1:])
            return Targets(rows[1:], nbytes, segs, headroom=rows)
        iov = remote[:, 1:].copy()
        for seg_id, seg in segs.items():
            iov[ids == seg_id, 0] += np.uint64(seg.address)
        return Targets(iov, nbytes, segs, ids)

    def _resolve_uniform(self, conn: Connection, op: Op, seg_id: int, length: int,
                         offsets: np.ndarray, nbytes: int, pinned: list[Any]) -> Targets:
        """:meth:`_resolve` for uniform entries: ``length`` bytes at each of ``offsets``
        (unsigned, so one maximum bounds both ends) in one segment."""
        if not len(offsets):
            return Targets(np.empty((0, 2), dtype=np.uint64), 0, {})
        write = op is Op.WRITE
        opname = str(op)
        seg = self._host.local_segment(seg_id, peer=conn.peer, op=opname)
        limit = seg.length
        if not (0 < length <= limit and (seg.writable or not write)
                and int(offsets.max()) <= limit - length):
            refuse(conn.peer, seg, ((offset, length) for offset in offsets.tolist()), write,
                    opname)
        pin({seg_id: seg}, pinned, conn.peer, opname, self.transport_name, self.stages_device)
        rows = np.empty((len(offsets) + 1, 2), dtype=np.uint64)  # row 0: the answer's head
        np.add(offsets, np.uint64(seg.address), out=rows[1:, 0])
        rows[1:, 1] = length
        return Targets(rows[1:], nbytes, {seg_id: seg}, headroom=rows)

    def _answer(self, wr_id: int, exc: TransferError | None) -> bytes:
        if exc is None:
            return ANSWER.pack(KIND_ANSWER, 0, 0, 0, wr_id)
        body = pack_error(exc)
        return ANSWER.pack(KIND_ANSWER, error_code(exc), 0, len(body), wr_id) + body

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            idle = [(sock, c) for sock, c in self._open.items() if not c.busy]
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for sock, conn in idle:  # busy ones are dropped by their worker
            self._drop(sock, conn)
        self._acceptor.join(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self._lock:
                if not self._conns:
                    break
            time.sleep(0.005)

"""The serving process: a stream transport's server, run outside the application.

Started by :class:`.process.ServeProcess` with three descriptors: its end of the
private channel, the listening socket, and the application's ``/proc/<pid>/mem``
(opened by the application itself, so no ptrace permission is involved). It runs the
same :class:`~transfer_engine.transport.tcp.TcpServer` or
:class:`~transfer_engine.transport.shm.ShmServer` as the in-process mode, every check
included, against a host that asks the application only what only it knows:

- a rail's opening (``admit``): the tickets stay in the application;
- segments arrive as the application registers them (``seg``), with the memfd of their
  shared pages (:mod:`.shared`); bytes in those pages move straight between the socket
  and memory; the rest of a segment (its partial end pages, or all of it when it could
  not be shared) through the mem file;
- immediates go back (``imm``) after their bytes landed, in order.

It exits when the channel closes, which the kernel does when the application exits or
is killed (``PR_SET_PDEATHSIG`` would follow the thread that started it instead).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from transfer_engine.errors import AuthenticationError, InvalidDescriptorError, ProtocolError
from transfer_engine.segment import MemoryInfo, Segment, _view_at
from transfer_engine.transport import held
from transfer_engine.transport.base import Immediate
from transfer_engine.transport.iovec import Pace
from transfer_engine.transport.shm import ShmServer
from transfer_engine.transport.stream.channel import Channel, ChannelClosed, FrameTooLarge
from transfer_engine.transport.stream.connection import Connection
from transfer_engine.transport.stream.io import (
    PeerClosed,
    Steps,
    drain,
    recv_scatter,
    recv_steps,
    send_bytes,
    send_gather,
    send_steps,
)
from transfer_engine.transport.stream.server import HELLO_TIMEOUT
from transfer_engine.transport.stream.shared import MAP_POPULATE
from transfer_engine.transport.stream.targets import Targets
from transfer_engine.transport.tcp import TcpServer

log = logging.getLogger(__name__)
_U64 = 1 << 64
BOUNCE = 1 << 20  # bytes moved through the mem file per call
_parent = 0  # the application's pid (main)


class ServedSegment(Segment):
    """A segment of the application's, as the serving process reaches it: ``address``
    is the application's; ``[lo, hi)`` of it is mapped here at ``address + delta``."""

    __slots__ = ("lo", "hi", "delta", "_map")

    def __init__(self, seg_id: int, name: str, address: int, length: int, device: str,
                 writable: bool, server: TcpServer | ShmServer | None) -> None:
        def stuck(seg: Segment) -> None:
            if server is not None:
                server.revoke(seg)

        super().__init__(seg_id, name, MemoryInfo(address, 1, device, writable, None),
                         on_stuck=stuck)
        self.length = length
        self.lo = self.hi = self.delta = 0
        self._map: mmap.mmap | None = None

    def attach(self, fd: int, start: int, end: int, fd_offset: int) -> None:
        # populated now (about 50 ms a GiB, as a registration pins pages): else every
        # page takes a fault on its first transfer, half the time of a cold 16 MiB READ
        self._map = mmap.mmap(fd, end - start, mmap.MAP_SHARED | MAP_POPULATE,
                              mmap.PROT_READ | mmap.PROT_WRITE, offset=fd_offset)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)  # as the application's side
            except OSError:
                pass
        here = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.lo, self.hi, self.delta = start, end, here - start

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        raise InvalidDescriptorError("the application's memory has no view here",
                                     segment=self.name)

    def detach(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still out: the mapping goes with the process
                pass
            self._map = None
            self.lo = self.hi = 0


class ProxyHost:
    """The application, as the server sees it (see the module's notes)."""

    def __init__(self, chan: Channel, name: str, host_id: str) -> None:
        self._chan = chan
        self._name = name
        self._host_id = host_id
        self.segments: dict[int, ServedSegment] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def host_id(self) -> str:
        return self._host_id

    def local_segment(self, segment_id: int, *, peer: str | None = None,
                      op: str | None = None) -> Segment:
        seg = self.segments.get(segment_id)
        if seg is None or seg.closed:
            raise InvalidDescriptorError("unknown or deregistered segment", peer=peer, op=op,
                                         segment=segment_id)
        return seg

    def deliver_immediate(self, peer: str, imm: Immediate, origin: bytes = b"",
                          work: int | None = None, resent: bool = False) -> None:
        try:
            self._chan.send({"op": "imm", "peer": peer, "origin": origin,
                             "transfer": imm.transfer_id, "expected": imm.expected,
                             "notify": imm.notify, "first": imm.first, "work": work,
                             "resent": resent})
        except FrameTooLarge as exc:  # the peer's rail goes, not the link
            raise ProtocolError(f"immediate not relayed: {exc}", peer=peer) from None

    def admit_rail(self, ticket: object, transport: str, challenge: bytes, nonce: object,
                   proof: object) -> tuple[Any, bytes]:
        try:
            reply = self._chan.call({"op": "admit", "ticket": ticket, "transport": transport,
                                     "challenge": challenge, "nonce": nonce, "proof": proof},
                                    HELLO_TIMEOUT)
        except (ChannelClosed, TimeoutError):
            raise AuthenticationError("rail refused") from None
        if not reply.get("ok"):
            raise AuthenticationError("rail refused")
        return _Admission(self._chan, reply["admission"], reply["ticket"], reply["peer"],
                          reply["pid"]), reply["proof"]

    def local_ranges(self) -> np.ndarray:
        return np.empty((0, 3), dtype=np.uint64)


class _Admission:
    """The application's ticket for one admitted rail, released there on close."""

    __slots__ = ("_chan", "admission", "id", "peer", "pid", "_released")

    def __init__(self, chan: Channel, admission: int, ticket_id: bytes, peer: str,
                 pid: int) -> None:
        self._chan, self.admission, self.id = chan, admission, ticket_id
        self.peer, self.pid = peer, pid
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            try:
                self._chan.send({"op": "release", "admission": self.admission})
            except ChannelClosed:
                pass


def _pieces(views: Targets) -> list[tuple[int, int, int]]:
    """(application address, length, local address or 0) runs of a request's rows: a
    nonzero local address where the bytes are in shared pages, 0 where they go
    through the mem file."""
    segs, ids = views.segments, views.ids
    rows = views.iov.tolist()
    seg_of = ([next(iter(segs.values()))] * len(rows) if ids is None
              else [segs[i] for i in ids.tolist()])
    out: list[tuple[int, int, int]] = []
    for (address, length), seg in zip(rows, seg_of, strict=True):
        end = address + length
        lo, hi = max(address, seg.lo), min(end, seg.hi)  # type: ignore[attr-defined]
        if lo >= hi:
            out.append((address, length, 0))
            continue
        if address < lo:
            out.append((address, lo - address, 0))
        out.append((lo, hi - lo, lo + seg.delta))  # type: ignore[attr-defined]
        if hi < end:
            out.append((hi, end - hi, 0))
    return out


def direct_rows(views: Targets) -> np.ndarray | None:
    """The request's rows as local addresses when every byte is in shared pages."""
    iov = views.iov
    if not len(iov):
        return iov
    segs, ids = views.segments, views.ids
    out = iov.copy()
    for seg_id, seg in segs.items():
        rows = slice(None) if ids is None else ids == seg_id
        mine = iov[rows]
        if not len(mine):
            continue
        if not (int(mine[:, 0].min()) >= seg.lo  # type: ignore[attr-defined]
                and int((mine[:, 0] + mine[:, 1]).max()) <= seg.hi):  # type: ignore[attr-defined]
            return None
        delta = np.uint64(seg.delta % _U64)  # type: ignore[attr-defined]
        out[rows, 0] += delta
    return out


Batch = list[tuple[int, int, int]]  # (local address, length, mem file address or -1)


def _batches(views: Targets, bounce: memoryview) -> Iterator[Batch]:
    """A request's bytes in order, as batches of local rows: a piece in shared pages
    as itself (mem file address -1), the rest in ``bounce``, standing for the mem
    file's bytes at the address given. A batch ends when the bounce is full, so that
    a request naming a piece many times costs one bounce however large it is."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(bounce))
    batch: Batch = []
    used = 0
    for address, length, here in _pieces(views):
        if here:
            batch.append((here, length, -1))
            continue
        off = 0
        while off < length:
            n = min(length - off, len(bounce) - used)
            batch.append((base + used, n, address + off))
            used += n
            off += n
            if used == len(bounce):
                yield batch
                batch, used = [], 0
    if batch:
        yield batch


def _through_mem(batch: Batch, call: Any, fd: int) -> None:
    """Reads (``os.preadv``) or writes (``os.pwrite``) a batch's bounced rows from or
    to the mem file."""
    for local, n, address in batch:
        if address >= 0:
            _full(call, fd, _view_at(local, n, call is os.preadv), address)


class ServeTcpServer(TcpServer):
    """:class:`TcpServer` over the application's memory from outside its process."""

    stages_device = False  # no device runtime here: device segments are refused

    def __init__(self, listener: socket.socket, host: ProxyHost, mem_fd: int,
                 buffer_bytes: int, congestion: str | None, stall_timeout: float) -> None:
        self._mem = mem_fd
        super().__init__(listener, host, buffer_bytes, congestion, stall_timeout)

    def stream_rows(self, views: Targets) -> np.ndarray | None:
        return direct_rows(views)  # else through the bounce

    def park_cost(self, views: Targets) -> int:
        return 0 if direct_rows(views) is not None else min(BOUNCE, views.nbytes)

    def land_bounced(self, conn: Connection, views: Targets, local: np.ndarray | None
                     ) -> Steps:
        return self._bounce_steps(conn, views)

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        iov = direct_rows(views)
        if iov is not None:
            recv_scatter(conn.sock, iov, views.nbytes, pace=Pace(self._stall))
            return
        for _ in self._bounce_steps(conn, views):
            pass  # no timer to wait on: wait here, at the same pace

    def _bounce_steps(self, conn: Connection, views: Targets) -> Steps:
        """A payload through one bounce of the mem file, as steps (see land_steps)."""
        pace = Pace(self._stall)
        bounce = memoryview(bytearray(min(BOUNCE, views.nbytes)))
        taken = 0  # payload bytes received so far
        try:
            for batch in _batches(views, bounce):
                n = sum(row[1] for row in batch)
                rows = np.array([row[:2] for row in batch], dtype=np.uint64)
                yield from recv_steps(conn.sock, rows, n, pace, self._stall)
                taken += n
                _through_mem(batch, os.pwrite, self._mem)
        except InvalidDescriptorError:  # the rest of the payload is still owed: taken
            drain(conn.sock, views.nbytes - taken, pace)  # so the stream stays in step
            raise

    def serve(self, conn: Connection, wr_id: int, views: Targets,
              local: np.ndarray | None) -> None:
        iov = direct_rows(views)
        answer = self._answer(wr_id, None)
        pace = Pace(self._stall)
        if iov is not None:
            headroom = np.empty((len(iov) + 1, 2), dtype=np.uint64)
            headroom[1:] = iov
            send_gather(conn.sock, answer, iov, views.nbytes, headroom, pace=pace)
            return
        for _ in self._answer_steps(conn, wr_id, views):
            pass  # no timer to wait on: wait here, at the same pace

    def serve_bounced(self, conn: Connection, wr_id: int, views: Targets,
                      local: np.ndarray | None) -> Steps:
        return self._answer_steps(conn, wr_id, views)

    def _answer_steps(self, conn: Connection, wr_id: int, views: Targets) -> Steps:
        """A READ's answer through one bounded bounce, sent each time it is full (a
        READ that names a piece many times must not cost its size in memory here), as
        steps (see serve_steps)."""
        pace = Pace(self._stall)
        answer = self._answer(wr_id, None)
        bounce = memoryview(bytearray(min(BOUNCE, views.nbytes) or 1))
        first = True
        for batch in _batches(views, bounce):
            try:
                _through_mem(batch, os.preadv, self._mem)
            except InvalidDescriptorError as exc:
                if first:  # nothing sent yet: say why
                    send_bytes(conn.sock, self._answer(wr_id, exc))
                    return
                raise PeerClosed(f"read answer cut short: {exc}") from None
            rows = np.array([row[:2] for row in batch], dtype=np.uint64)
            if first:
                rows = np.concatenate((held.buffer_rows(answer), rows))
            yield from send_steps(conn.sock, rows, int(rows[:, 1].sum()), pace, self._stall)
            first = False
        if first:
            send_bytes(conn.sock, answer)


class ServeShmServer(ShmServer):
    """:class:`ShmServer` over the application's memory from outside its process: the
    initiator's bytes are copied to and from shared pages directly, and through bounce
    buffers and the mem file for the rest."""

    stages_device = False

    def __init__(self, listener: socket.socket, host: ProxyHost, mem_fd: int,
                 stall_timeout: float) -> None:
        self._mem = mem_fd
        super().__init__(listener, host, 0, stall_timeout)

    def copies(self, views: Targets, theirs: list[tuple[int, int]], write_to_peer: bool
               ) -> Iterator[tuple[list[tuple[int, int]], list[tuple[int, int]],
                                   Callable[[], None] | None]]:
        iov = direct_rows(views)
        if iov is not None:
            yield iov.tolist(), theirs, None
            return
        # what is not in shared pages goes through one bounce of at most BOUNCE bytes,
        # refilled step by step: a request naming a piece many times costs no more
        bounce = memoryview(bytearray(min(BOUNCE, views.nbytes) or 1))
        peer = _Rows(theirs)
        for batch in _batches(views, bounce):
            if write_to_peer:
                _through_mem(batch, os.preadv, self._mem)
            yield ([(a, k) for a, k, _ in batch], peer.take(sum(row[1] for row in batch)),
                   None if write_to_peer else functools.partial(
                       _through_mem, batch, os.pwrite, self._mem))


class _Rows:
    """(address, length) rows taken as one run of bytes, handed out in order."""

    def __init__(self, rows: list[tuple[int, int]]) -> None:
        self._rows = rows
        self._i = 0
        self._off = 0  # bytes of row ``_i`` already handed out

    def take(self, nbytes: int) -> list[tuple[int, int]]:
        """The rows of the next ``nbytes``."""
        out: list[tuple[int, int]] = []
        while nbytes > 0 and self._i < len(self._rows):
            address, length = self._rows[self._i]
            n = min(length - self._off, nbytes)
            out.append((address + self._off, n))
            nbytes -= n
            self._off += n
            if self._off == length:
                self._i, self._off = self._i + 1, 0
        return out


def _full(call: Any, fd: int, buf: memoryview, offset: int) -> None:
    """One whole pread/pwrite of ``buf`` at ``offset`` of the mem file."""
    done = 0
    while done < len(buf):
        try:
            n = (call(fd, buf[done:], offset + done) if call is os.pwrite
                 else call(fd, [buf[done:]], offset + done))
        except OSError:
            n = 0
        if n <= 0:
            if os.getppid() != _parent:  # it exited: its peers' rails go
                raise PeerClosed("the application is gone")
            raise InvalidDescriptorError("memory of the application is not mapped",
                                         offset=offset + done)
        done += n


def main() -> None:
    """The serving process's main thread: set up, then read the channel until it closes."""
    logging.basicConfig(level=os.environ.get("TE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s te-serve %(levelname)s %(message)s")
    global _parent
    ctrl, listen, mem = (int(v) for v in os.environ["TE_SERVE_FDS"].split(","))
    _parent = int(os.environ["TE_SERVE_PARENT"])
    if os.getppid() != _parent:
        sys.exit(0)  # the application is gone already
    chan = Channel(socket.socket(fileno=ctrl))
    cfg, _ = chan.recv()
    host = ProxyHost(chan, cfg["name"], cfg["host_id"])
    listener = socket.socket(fileno=listen)
    listener.listen(128)
    server: TcpServer | ShmServer
    if cfg["kind"] == "shm":
        server = ServeShmServer(listener, host, mem, cfg["stall"])
    else:
        server = ServeTcpServer(listener, host, mem, cfg["buffer_bytes"], cfg["congestion"],
                                cfg["stall"])
    chan.send({"op": "ready", "pid": os.getpid()})
    try:
        while True:
            msg, fds = chan.recv()
            if chan.answer(msg):
                continue
            op = msg.get("op")
            if op == "seg":
                _add_segment(chan, host, server, msg, fds)
            elif op == "drop":
                threading.Thread(target=_drop, args=(chan, host, msg), daemon=True).start()
            elif op == "cut":
                threading.Thread(target=_cut, args=(chan, server, msg), daemon=True).start()
            elif op == "revoke":
                seg = host.segments.get(msg["seg"])
                if seg is not None:
                    server.revoke(seg)
            elif op == "ping":
                chan.send({"re": msg["id"]})
            elif op == "stats":
                chan.send({"re": msg["id"], "bytes_received": server.bytes_received,
                           "stats": dict(server.stats)})
            elif op == "close":
                break
            for fd in fds:
                os.close(fd)
    except ChannelClosed:
        pass
    finally:
        server.close()
        for seg in list(host.segments.values()):
            seg.detach()
        chan.close()


def _add_segment(chan: Channel, host: ProxyHost, server: TcpServer | ShmServer, msg: dict[str, Any],
                 fds: list[int]) -> None:
    seg = ServedSegment(msg["seg"], msg["name"], msg["address"], msg["length"],
                        msg["device"], msg["writable"], server)
    error = None
    if fds and msg.get("body"):
        start, end, fd_offset = msg["body"]
        try:
            seg.attach(fds[0], start, end, fd_offset)
        except (OSError, ValueError) as exc:
            error = str(exc)  # reached through the mem file instead
    host.segments[seg.id] = seg
    chan.send({"re": msg["id"], "ok": True, "shared": seg.hi - seg.lo, "error": error})


def _drop(chan: Channel, host: ProxyHost, msg: dict[str, Any]) -> None:
    seg = host.segments.get(msg["seg"])
    reply: dict[str, Any] = {"re": msg["id"], "ok": True}
    if seg is not None:
        try:
            seg.close(timeout=msg.get("timeout", 5.0))
        except Exception as exc:  # noqa: BLE001 - reported to the application
            reply = {"re": msg["id"], "ok": False, "error": str(exc)}
        else:
            host.segments.pop(seg.id, None)
            seg.detach()
    try:
        chan.send(reply)
    except ChannelClosed:
        pass


def _cut(chan: Channel, server: TcpServer | ShmServer, msg: dict[str, Any]) -> None:
    ok = server.cut(str(msg["peer"]), float(msg.get("timeout", 5.0)))
    try:
        chan.send({"re": msg["id"], "ok": ok})
    except ChannelClosed:
        pass


if __name__ == "__main__":
    main()

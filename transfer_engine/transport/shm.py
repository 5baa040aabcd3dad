"""Same-host transport: cross-memory attach over a Unix-socket rail.

Mechanism, and why: the kernel's cross-memory attach (``process_vm_readv`` /
``process_vm_writev``) copies straight between two processes' address spaces in one
system call, with a scatter list on both sides. Any registered memory works (a torch
tensor, a numpy array, vLLM's KV cache) without allocating it in ``/dev/shm`` first, with
no mapping to set up or tear down per segment, and with one copy (the same as memcpy
through a shared mapping), measured here at memcpy speed from 64 KiB blocks up. Shared
memory-backed segments would need every user allocation moved into ``/dev/shm``, which
vLLM's cache is not, and first-touch page faults of fresh mappings run at a tenth of
memcpy speed.

Protocol: the rails are the stream rails of ``stream.py`` over a Unix socket. The
*target* moves the bytes: for a WRITE it pulls from the initiator
(``process_vm_readv``) after checking segment, bounds and permission, so nothing outside
a registered, open segment is ever written, and a deregistered segment is refused exactly
as over TCP. For a READ it pushes (``process_vm_writev``). The answer follows the copy,
so a finished handle means the bytes landed.

Who may be copied: the target takes the initiator's process from the kernel
(``SO_PEERCRED`` on the Unix socket, and a pidfd to that process), never from a message,
and serves the rail only if it is the process the ticket's handshake named. Each copy
first checks that this process is still the one that connected (its pidfd has not
exited, so its pid cannot have passed to another process) and that every initiator
range lies inside a segment the initiator announced on the rail (writable ones only,
for a READ). The socket lives in a private folder (mode 0700) of its own.

Fallback: when the kernel refuses cross-memory attach (``EPERM`` under a strict ptrace
policy or a seccomp filter; ``ENOSYS``) the answer carries ``NotSupportedError`` and
the engine repeats the transfer over TCP. No process is opened to every other: where
Yama restricts ptrace to descendants (``ptrace_scope`` 1) an initiator names, with
``PR_SET_PTRACER``, the one target process (as the kernel reports it on the socket)
that may attach to it, and only its latest shm peer can; with ``ptrace_scope`` 0 (same
user) or ``CAP_SYS_PTRACE`` nothing is granted; at 2 or 3 only the capability works.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from transfer_engine import interrupts
from transfer_engine.control.tickets import Credential
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    InvalidDescriptorError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    TransferError,
)
from transfer_engine.planner import WorkRequest
from transfer_engine.segment import Segment
from transfer_engine.transport import held
from transfer_engine.transport.base import Capabilities, Host, OnComplete, Rail, Transport, Work
from transfer_engine.transport.iovec import host_rows
from transfer_engine.transport.shm_ipc import DeviceTable, PeerDevices, ipc_copy
from transfer_engine.transport.stream import (
    KIND_READ,
    KIND_WRITE,
    STALL_TIMEOUT,
    Connection,
    PeerClosed,
    Refused,
    StreamRail,
    StreamServer,
    Targets,
    encode_announce,
    encode_request,
    open_rail,
    pack_local,
    send_bytes,
)
from transfer_engine.transport.stream.process import ServeProcess, serve_mode
from transfer_engine.transport.stream.wire import MAX_ANNOUNCED

__all__ = ["ShmTransport", "host_id"]

log = logging.getLogger(__name__)

_PR_SET_PTRACER = 0x59616D61
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+
_UCRED = struct.Struct("iII")  # pid, uid, gid


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_IOVP = ctypes.POINTER(_IoVec)
for _fn in ("process_vm_readv", "process_vm_writev"):
    getattr(_libc, _fn).argtypes = [ctypes.c_int, _IOVP, ctypes.c_ulong, _IOVP,
                                    ctypes.c_ulong, ctypes.c_ulong]
    getattr(_libc, _fn).restype = ctypes.c_ssize_t
_IOV_MAX = 1024


def host_id() -> str:
    """Same value in two processes iff they can attach to each other's memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _iovecs(pairs: list[tuple[int, int]]) -> ctypes.Array[_IoVec]:
    arr = (_IoVec * len(pairs))()
    for i, (addr, length) in enumerate(pairs):
        arr[i].base = addr
        arr[i].len = length
    return arr


def cross_copy(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]],
               write: bool) -> None:
    """Copies between our ``local`` ranges and ``pid``'s ``remote`` ranges, in order.

    Both lists describe the same number of bytes. Raises ``OSError`` on failure.
    """
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    total = sum(n for _, n in local)
    li = ri = 0
    lo = ro = 0  # offsets inside the current entries, after partial copies
    while total > 0:
        lpart = [(local[li][0] + lo, local[li][1] - lo)] + local[li + 1:li + _IOV_MAX]
        rpart = [(remote[ri][0] + ro, remote[ri][1] - ro)] + remote[ri + 1:ri + _IOV_MAX]
        lv, rv = _iovecs(lpart), _iovecs(rpart)
        n = fn(pid, lv, len(lpart), rv, len(rpart), 0)
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if n == 0:
            raise OSError(errno.EFAULT, "cross-memory copy made no progress")
        total -= n
        # advance both cursors by n bytes
        for cursor in ("l", "r"):
            entries, idx, off = (local, li, lo) if cursor == "l" else (remote, ri, ro)
            left = n
            while left:
                room = entries[idx][1] - off
                if left >= room:
                    left -= room
                    idx += 1
                    off = 0
                else:
                    off += left
                    left = 0
            if cursor == "l":
                li, lo = idx, off
            else:
                ri, ro = idx, off


def _translate(exc: OSError, conn: Connection, op: str) -> TransferError:
    if exc.errno in (errno.EPERM, errno.ENOSYS, errno.EACCES):
        return NotSupportedError(f"cross-memory attach refused: {exc.strerror}",
                                 peer=conn.peer, op=op, transport="shm")
    if exc.errno == errno.ESRCH:
        return PeerLostError("peer process is gone", peer=conn.peer, op=op, transport="shm")
    return TransferError(f"cross-memory copy failed: {exc}", peer=conn.peer, op=op,
                         transport="shm")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket, as the
    kernel recorded it when the connection was made."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                         _UCRED.size))


def _pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd for the socket's peer process: from the socket itself where the kernel
    offers it (no window for the pid to be reused), else opened by pid right after
    the credentials were read. None where neither exists."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exited(pidfd: int | None) -> bool:
    """Whether the process behind ``pidfd`` has exited (a pidfd polls readable then)."""
    if pidfd is None:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: same-user processes may attach (classic ptrace rules)


def grant_attach(pid: int) -> None:
    """Lets process ``pid`` (a same-host target) copy to and from our memory where Yama
    would otherwise forbid it; one process at a time, never any process."""
    if _ptrace_scope() != 1:
        return
    try:
        _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except Exception:  # not Linux: nothing to grant
        pass


def outside_ranges(ranges: np.ndarray | None, rows: np.ndarray, writable: bool) -> bool:
    """Whether any (address, length) row of ``rows`` leaves the announced ``ranges``
    ((start, end, writable) rows sorted by start), or needs a writable one and is not."""
    if not len(rows):
        return False
    if ranges is None or not len(ranges):
        return True
    address = rows["address"]
    length = rows["length"]
    idx = np.searchsorted(ranges[:, 0], address, side="right").astype(np.int64) - 1
    if bool((idx < 0).any()):
        return True
    hit = ranges[idx]
    end = hit[:, 1]
    # start <= address here; where address < end, end - address does not wrap
    bad = (address >= end) | (length > end - np.minimum(address, end))
    if writable:
        bad |= hit[:, 2] == 0
    return bool(bad.any())


class ShmRail(StreamRail):
    transport_name = "shm"
    peer_copies = True

    def __init__(self, sock: socket.socket, peer: str, index: int, on_complete: OnComplete,
                 host: Host, announced: np.ndarray, devices: DeviceTable | None = None
                 ) -> None:
        self._announced = announced  # the ranges the target knows of
        self.devices = devices  # ours, announced for IPC (None: the peer maps none)
        self._devices_said = -1  # the version of them the target knows
        super().__init__(sock, peer, index, on_complete, host)

    def _payload(self, work: Work) -> int:
        return 0  # the target copies; only (address, length) entries travel

    def _send_request(self, work: Work, spill: bool = False) -> None:
        ranges = self._host.local_ranges()
        if ranges is not self._announced:  # a segment came or went: say so first
            send_bytes(self._sock, encode_announce(ranges))
            self._announced = ranges
        devices = self.devices
        if devices is not None and devices.version != self._devices_said:
            self._devices_said, message = devices.announcement()
            send_bytes(self._sock, message)
        if work.prepared is not None:  # (address, length) rows: the LOCAL_DT layout
            local = np.ascontiguousarray(work.prepared, dtype="<u8").tobytes()
        else:
            bases: dict[int, int] = {}
            extents = []
            for seg_id, offset, length in work.local:
                base = bases.get(seg_id)
                if base is None:
                    base = bases[seg_id] = self._host.local_segment(seg_id).address
                extents.append((base + offset, length))
            local = pack_local(extents)
        kind = KIND_WRITE if work.op is Op.WRITE else KIND_READ
        send_bytes(self._sock, encode_request(kind, work, local=local))


class ShmServer(StreamServer):
    transport_name = "shm"

    def check_announce(self, conn: Connection, body_len: int) -> None:
        if body_len % 24 or body_len > MAX_ANNOUNCED * 24:
            raise ProtocolError("malformed announcement", peer=conn.peer)

    def _announce(self, conn: Connection, body: bytes) -> None:
        """Records the initiator's registered ranges (rows of address, length,
        writable), sorted by address, as (start, end, writable) rows."""
        rows = np.frombuffer(body, "<u8").reshape(-1, 3)
        start, length = rows[:, 0], rows[:, 1]
        if len(rows) and bool(((length == 0) | (start > np.uint64(2**64 - 1) - length)).any()):
            raise ProtocolError("announced range is empty or wraps", peer=conn.peer)
        order = np.argsort(start, kind="stable")
        out = np.empty((len(rows), 3), dtype=np.uint64)
        out[:, 0] = start[order]
        out[:, 1] = start[order] + length[order]
        out[:, 2] = rows[order, 2] != 0
        conn.ranges = out

    def announce_devices(self, conn: Connection, body: bytes) -> None:
        if conn.devices is None:
            conn.devices = PeerDevices(conn.peer, same_process=conn.pid == os.getpid())
        conn.devices.announce(body)

    def _ipc_rows(self, conn: Connection, local: np.ndarray | None, write_to_peer: bool
                  ) -> list[tuple[int, int, str]] | None:
        if conn.devices is None or local is None:
            return None
        rows: list[tuple[int, int, str]] | None = conn.devices.translate(
            local, writable=write_to_peer)
        return rows

    def stage(self, conn: Connection, views: Targets, op: Op, local: np.ndarray | None
              ) -> tuple[Targets, Callable[[], None] | None]:
        if self._ipc_rows(conn, local, op is Op.READ) is not None:
            return views, None  # device to device (or host) by IPC: no bounce here
        return super().stage(conn, views, op, local)

    def vouch(self, conn: Connection) -> None:
        pid, uid, _ = peer_credentials(conn.sock)
        if pid <= 0 or pid != conn.pid:
            raise Refused(f"the connecting process ({pid}) is not the one the handshake "
                           f"named ({conn.pid})")
        conn.pidfd = _pidfd(conn.sock, pid)

    def _copy(self, conn: Connection, views: Targets, local: np.ndarray | None,
              write_to_peer: bool, op: str) -> None:
        if local is None:
            raise NotSupportedError("shm request without initiator addresses",
                                    peer=conn.peer, op=op, transport="shm")
        mapped = self._ipc_rows(conn, local, write_to_peer)
        if mapped is not None:  # the initiator's device memory, mapped here
            ipc_copy(views, mapped, write_to_peer, conn.peer, op)
            return
        if outside_ranges(conn.ranges, local, writable=write_to_peer):
            raise InvalidDescriptorError("initiator range outside the segments it "
                                         "announced", peer=conn.peer, op=op,
                                         transport="shm")
        theirs = local.tolist()
        if views.nbytes != sum(n for _, n in theirs):
            raise NotSupportedError("shm request sizes disagree", peer=conn.peer, op=op,
                                    transport="shm")
        if _exited(conn.pidfd):
            raise PeerLostError("peer process is gone", peer=conn.peer, op=op,
                                transport="shm")
        for ours, part, after in self.copies(views, theirs, write_to_peer):
            if held.hung_up(conn.sock):  # its transfer was stopped: nothing more moves
                raise PeerClosed("the initiator hung up")
            try:
                cross_copy(conn.pid, ours, part, write=write_to_peer)
            except OSError as exc:
                raise _translate(exc, conn, op) from exc
            if after is not None:
                after()

    def copies(self, views: Targets, theirs: list[tuple[int, int]], write_to_peer: bool
               ) -> Iterator[tuple[list[tuple[int, int]], list[tuple[int, int]],
                                   Callable[[], None] | None]]:
        """The copy in steps: our (address, length) rows in this process, the peer's
        rows for the same bytes, and what to run after the step (a serving process
        puts bounced bytes in place, a bounded buffer at a time). Here: one step."""
        yield views.iov.tolist(), theirs, None

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        self._copy(conn, views, local, write_to_peer=False, op="write")

    def serve(self, conn: Connection, wr_id: int, views: Targets,
              local: np.ndarray | None) -> None:
        try:
            self._copy(conn, views, local, write_to_peer=True, op="read")
        except TransferError as exc:
            send_bytes(conn.sock, self._answer(wr_id, exc))
            return
        send_bytes(conn.sock, self._answer(wr_id, None))


def sweep_dead(parent: str) -> None:
    """Removes the socket folders (``te-shm-<pid>-*``, ours to remove) of processes of
    this user that are gone: a process killed outright cannot remove its own."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["te", "shm"] or not parts[2].isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError, OverflowError):
            continue


class ShmTransport(Transport):
    """Cross-memory-attach rails between processes of one host.

    :param rails: connections opened per peer (copies of different rails run in
        parallel on the target).
    :param slice_size: bytes per work request (8 MiB against 4: half the requests, less
        initiator CPU, a request queued behind one waits 2-3 ms of copying at most).
    :param socket_dir: folder in which the transport makes its private (0700) socket
        folder (default: the system temp folder).
    :param stall_timeout: longest pause the target allows inside a request or an
        answer before it drops the rail.
    :param serve: where peers' requests are served: ``"thread"`` (threads of this
        process) or ``"process"`` (a serving process of its own, which copies while this
        process's threads are busy in Python; see :mod:`.stream.process`). Default:
        ``$TE_SERVE`` or ``"thread"``.
    """

    name = "shm"

    def __init__(self, rails: int = 2, slice_size: int = 8 << 20,
                 socket_dir: str | None = None, stall_timeout: float = STALL_TIMEOUT,
                 serve: str | None = None) -> None:
        self._serve = serve_mode(serve)
        self._process: ServeProcess | None = None
        if not stall_timeout > 0:
            raise ValueError("stall_timeout must be positive")
        self._caps = Capabilities(max_sge=1000, max_wr_bytes=256 << 20, remote_scatter=True,
                                  same_host_only=True, default_rails=rails,
                                  slice_size=slice_size, min_split=1 << 20)
        self._parent = socket_dir or tempfile.gettempdir()
        self._stall = stall_timeout
        self._dir: str | None = None
        self._path: str | None = None
        self._server: ShmServer | None = None
        self._host: Host | None = None
        self._rails: list[ShmRail] = []
        self._devices = DeviceTable()
        self._closed = False

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def reaches_device(self, rails: Sequence[Rail], segments: Sequence[Segment]) -> bool:
        """Whether ``rails`` take these local segments' device memory as it is (every
        rail's target maps device IPC, every device segment is exported for it, and
        none is host memory), so that the engine need not stage it."""
        devices = self._devices
        return (all(isinstance(r, ShmRail) and r.devices is not None for r in rails)
                and all(s.device != "cpu" and devices.has(s.id) for s in segments))

    def prepare(self, request: WorkRequest, segments: Sequence[Segment]) -> np.ndarray:
        """The request's local extents as ``(address, length)`` rows (host memory: the
        engine sends this transport nothing else)."""
        return host_rows(request, segments)

    def start(self, host: Host) -> dict[str, Any]:
        self._host = host
        sweep_dead(self._parent)
        self._dir = tempfile.mkdtemp(prefix=f"te-shm-{os.getpid()}-",  # mode 0700
                                     dir=self._parent)
        self._path = os.path.join(self._dir, "rail.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._path)
            if self._serve == "process":
                try:
                    self._process = ServeProcess("shm", listener, host,
                                                 stall_timeout=self._stall,
                                                 rebind=self._rebind)
                except ClosedError as exc:
                    log.warning("%s; serving shm from threads of this process instead",
                                exc)
                    self._serve = "thread"
            if self._process is None:
                listener.listen(128)
        except (OSError, TransferError):
            listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        if self._process is None:
            self._server = ShmServer(listener, host, 0, self._stall)
        info = {"path": self._path, "host_id": host.host_id, "pid": os.getpid()}
        if self._process is None:
            info["ipc"] = True  # served here: device IPC mappings can be opened
        return info

    def _rebind(self) -> socket.socket:
        """A listener on the rail socket's path again, for a new serving process."""
        if self._path is None:
            raise OSError("the shm transport is closed")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            again.bind(self._path)
        except OSError:
            again.close()
            raise
        return again

    def register(self, segment: Segment) -> dict[str, Any]:
        if self._process is not None:
            self._process.register(segment)
        if segment.device != "cpu":
            self._devices.add(segment)
        return {}

    def deregister(self, segment: Segment) -> None:
        if self._process is not None:
            self._process.deregister(segment)
        self._devices.remove(segment.id)

    def reachable(self, peer_meta: dict[str, Any]) -> bool:
        info = peer_meta.get("transports", {}).get("shm")
        return (isinstance(info, dict) and self._host is not None
                and info.get("host_id") == self._host.host_id)

    def connect(self, peer: str, info: dict[str, Any], on_complete: OnComplete,
                timeout: float | None = 10.0, credential: Credential | None = None
                ) -> Rail:
        if self._closed or self._host is None:
            raise ClosedError("transport is closed", peer=peer, transport=self.name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        announced = self._host.local_ranges()
        try:
            sock.settimeout(timeout)
            sock.connect(str(info["path"]))
            grant_attach(peer_credentials(sock)[0])  # the kernel's word, not the peer's
            with interrupts.blocking():  # the peer may not answer
                open_rail(sock, credential, self.name, timeout, announced)
        except AuthenticationError as exc:
            sock.close()
            raise exc.with_context(peer=peer, op="connect", transport=self.name) from None
        except Exception as exc:
            sock.close()
            raise ConnectError(f"cannot open shm rail at {info.get('path')}: {exc}",
                               peer=peer, op="connect", transport=self.name) from exc
        except BaseException:  # Ctrl-C
            sock.close()
            raise
        rail = ShmRail(sock, peer, len(self._rails), on_complete, self._host, announced,
                       self._devices if info.get("ipc") is True else None)
        rail.stall_timeout = self._stall
        self._rails.append(rail)
        rail.reopen = functools.partial(self.connect, peer, info, on_complete, timeout,
                                        credential)
        return rail

    def revived(self, rail: Rail) -> Rail | None:
        """For a rail this side tore down (a cancel, a deadline, an interrupted call), a
        new connection to the same peer with the same ticket, opened now, once."""
        return rail.reopened() if isinstance(rail, ShmRail) else None

    def revoke(self, segment: Segment) -> None:
        for server in (self._process, self._server):
            if server is not None:
                server.revoke(segment)

    def cut(self, peer: str, timeout: float) -> bool:
        return self.cut_servers((self._process, self._server), peer, timeout)

    def info(self, key: str) -> Any:
        if key == "serve":
            return self._serve
        if key == "serve_pid":
            return self._process.pid if self._process is not None else None
        if key in ("bytes_received", "server_stats") and self._process is not None:
            got = self._process.stats()
            return got["bytes_received"] if key == "bytes_received" else got["stats"]
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rail in self._rails:
            rail.close()
        self._rails.clear()
        if self._server is not None:
            self._server.close()
        if self._process is not None:
            self._process.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

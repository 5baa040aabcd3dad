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

Fallback: when the kernel refuses cross-memory attach (``EPERM`` under a strict ptrace
policy or a seccomp filter; ``ENOSYS``) the answer carries ``NotSupportedError`` and
the engine repeats the transfer over TCP. Each process allows peers to attach with
``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` where Yama is active.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import tempfile
import uuid
from typing import Any

import numpy as np

from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    ClosedError,
    ConnectError,
    NotSupportedError,
    PeerLostError,
    TransferError,
)
from transfer_engine.segment import Segment
from transfer_engine.transport.base import Capabilities, Host, OnComplete, Rail, Transport, Work
from transfer_engine.transport.stream import (
    KIND_READ,
    KIND_WRITE,
    Connection,
    StreamRail,
    StreamServer,
    Targets,
    encode_request,
    hello,
    pack_local,
    send_bytes,
)

__all__ = ["ShmTransport", "host_id"]

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


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


class ShmRail(StreamRail):
    transport_name = "shm"

    def _payload(self, work: Work) -> int:
        return 0  # the target copies; only (address, length) entries travel

    def _send_request(self, work: Work) -> None:
        if work.iov is not None:  # (address, length) rows: the LOCAL_DT layout
            local = np.ascontiguousarray(work.iov, dtype="<u8").tobytes()
        else:
            bases: dict[int, int] = {}
            pieces = []
            for seg_id, offset, length in work.local:
                base = bases.get(seg_id)
                if base is None:
                    base = bases[seg_id] = self._host.local_segment(seg_id).address
                pieces.append((base + offset, length))
            local = pack_local(pieces)
        kind = KIND_WRITE if work.op is Op.WRITE else KIND_READ
        send_bytes(self._sock, encode_request(kind, work, local=local))


class ShmServer(StreamServer):
    transport_name = "shm"

    def _copy(self, conn: Connection, views: Targets, local: np.ndarray | None,
              write_to_peer: bool, op: str) -> None:
        if local is None:
            raise NotSupportedError("shm request without initiator addresses",
                                    peer=conn.peer, op=op, transport="shm")
        ours = views.iov.tolist()
        theirs = local.tolist()
        if views.nbytes != sum(n for _, n in theirs):
            raise NotSupportedError("shm request sizes disagree", peer=conn.peer, op=op,
                                    transport="shm")
        try:
            cross_copy(conn.pid, ours, theirs, write=write_to_peer)
        except OSError as exc:
            raise _translate(exc, conn, op) from exc

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


def _allow_attach() -> None:
    try:
        _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
    except Exception:  # not Linux with Yama: nothing to allow
        pass


class ShmTransport(Transport):
    """Cross-memory-attach rails between processes of one host.

    :param rails: connections opened per peer (copies of different rails run in
        parallel on the target).
    :param slice_size: bytes per work request.
    :param socket_dir: folder for the Unix sockets (default: the system temp folder).
    """

    name = "shm"

    def __init__(self, rails: int = 2, slice_size: int = 4 << 20,
                 socket_dir: str | None = None) -> None:
        self._caps = Capabilities(max_sge=1000, max_wr_bytes=256 << 20, remote_scatter=True,
                                  same_host_only=True, default_rails=rails,
                                  slice_size=slice_size, min_split=1 << 20)
        self._dir = socket_dir or tempfile.gettempdir()
        self._path: str | None = None
        self._server: ShmServer | None = None
        self._host: Host | None = None
        self._rails: list[ShmRail] = []
        self._closed = False

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def start(self, host: Host) -> dict[str, Any]:
        self._host = host
        _allow_attach()
        self._path = os.path.join(self._dir, f"te-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._path)
        listener.listen(128)
        self._server = ShmServer(listener, host, 0)
        return {"path": self._path, "host_id": host.host_id, "pid": os.getpid()}

    def register(self, segment: Segment) -> dict[str, Any]:
        return {}

    def deregister(self, segment: Segment) -> None:
        pass

    def reachable(self, peer_meta: dict[str, Any]) -> bool:
        info = peer_meta.get("transports", {}).get("shm")
        return bool(info) and self._host is not None and info.get("host_id") == self._host.host_id

    def connect(self, peer: str, info: dict[str, Any], on_complete: OnComplete,
                timeout: float | None = 10.0) -> Rail:
        if self._closed or self._host is None:
            raise ClosedError("transport is closed", peer=peer, transport=self.name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(info["path"])
            sock.settimeout(None)
            hello(sock, self._host.name, timeout)
        except Exception as exc:
            sock.close()
            raise ConnectError(f"cannot open shm rail at {info.get('path')}: {exc}",
                               peer=peer, op="connect", transport=self.name) from exc
        rail = ShmRail(sock, peer, len(self._rails), on_complete, self._host)
        self._rails.append(rail)
        return rail

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rail in self._rails:
            rail.close()
        self._rails.clear()
        if self._server is not None:
            self._server.close()
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass

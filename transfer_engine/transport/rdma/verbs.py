"""The verbs boundary of the RDMA transport: everything that touches pyverbs objects directly.

It holds the lazy pyverbs import (``import_pyverbs``/``verbs``), the translation of
pyverbs errors into ours (``translate``), the pyverbs objects that need no device (QP
attributes for each state change, chained send and receive work requests, and their
release), the opened NIC (``Device``: context, protection domain, completion queue and
its thread, queue-pair state changes, memory registration) and ``open_devices``. It is
separate from ``rdma`` so that the transport's protocol, rail and failover logic reads
apart from the verbs calls. pyverbs is still imported only when a transport is built,
never by importing this module.

Checked against rdma-core 44's pyverbs (Debian 12 ``python3-pyverbs``); the facts of
its API this module relies on, and ``tests/test_rdma_pyverbs_api.py`` pins:

- ``SGE``, ``SendWR`` and ``RecvWR`` name their destructor ``__dealloc`` (sic) rather
  than Cython's ``__dealloc__``: the C memory they malloc is freed only by ``close()``,
  and ``close()`` does not clear the pointer, so it must run exactly once (``release``).
- ``SendWR.next_wr`` stores a raw pointer into the next ``SendWR`` object: every request
  of a chain must stay referenced until ``post_send`` returns (``send_chain``).
- ``Context.query_gid_type`` returns ``enum ibv_gid_type_sysfs`` (RoCE v2 is
  ``IBV_GID_TYPE_SYSFS_ROCE_V2`` = 1), not ``enum ibv_gid_type`` (``IBV_GID_TYPE_ROCE_V2``
  = 2).
- ``GlobalRoute`` defaults ``hop_limit`` to 1, which a routed RoCE v2 fabric drops.
- ``PyverbsRDMAError`` messages already end in ``Errno: N, <strerror>``.
- ``get_device_list()`` raises ``PyverbsRDMAError`` when there is no device.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from transfer_engine.errors import (
    ConnectError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransferError,
)
from transfer_engine.transport.rdma.batch import WrBatch
from transfer_engine.transport.rdma.placement import RouteSettings
from transfer_engine.transport.rdma.plan import CqRoom, Opcode, QpInfo, WrSpec, mtu_enum

if TYPE_CHECKING:
    from transfer_engine.transport.rdma.inbound import _Inbound

__all__ = ["PYVERBS_HINT", "Device", "import_pyverbs", "init_attr", "open_devices",
           "post_send", "qp_init_attr", "recv_wr", "release", "roce_v2_gid_type",
           "rtr_attr", "rts_attr", "send_chain", "translate", "verbs"]

# The transport's logger: records keep the name they had before this module was split out.
log = logging.getLogger("transfer_engine.transport.rdma")

PYVERBS_HINT = ("install rdma-core's Python bindings: `apt-get install python3-pyverbs "
                "rdma-core ibverbs-providers` (Debian/Ubuntu) or `dnf install "
                "python3-pyverbs` (Fedora/RHEL); in a virtualenv, make the system "
                "dist-packages folder visible with a .pth file (see docs/rdma.md)")

_VERBS: Any = None
_CHANNEL_LOCK = threading.Lock()
_HOP_LIMIT = 255  # GRH hop limit; pyverbs' GlobalRoute default of 1 stops at a router


def import_pyverbs() -> Any:
    """Imports pyverbs once; ``NotSupportedError`` says what is missing and how to get it."""
    global _VERBS
    if _VERBS is not None:
        return _VERBS
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as enums
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        raise NotSupportedError(f"no RDMA: pyverbs is not importable ({exc}); "
                                f"{PYVERBS_HINT}", transport="rdma") from exc
    _VERBS = types.SimpleNamespace(
        e=enums, Error=PyverbsError, Context=device.Context,
        get_device_list=device.get_device_list, PD=pd.PD, MR=mr.MR,
        DmaBufMR=getattr(mr, "DmaBufMR", None), CQ=cq.CQ, CompChannel=cq.CompChannel,
        QP=qp.QP, QPInitAttr=qp.QPInitAttr, QPAttr=qp.QPAttr, QPCap=qp.QPCap,
        AHAttr=addr.AHAttr, GlobalRoute=addr.GlobalRoute, GID=addr.GID, SGE=wr.SGE,
        SendWR=wr.SendWR, RecvWR=wr.RecvWR)
    return _VERBS


def verbs() -> Any:
    return _VERBS if _VERBS is not None else import_pyverbs()


def _describe(exc: BaseException) -> str:
    """The error's text with its errno, once (pyverbs puts ``Errno: N`` in the message
    when it knows it)."""
    text = str(exc)
    code = getattr(exc, "error_code", 0) or 0
    if code <= 0 or "Errno" in text:
        return text
    return f"{text} (errno {code}: {os.strerror(code)})"


@contextmanager
def translate(cls: type[TransferError], what: str, **ctx: Any) -> Iterator[None]:
    """The one place pyverbs errors become ours (errno in the message)."""
    try:
        yield
    except verbs().Error as exc:
        raise cls(f"{what} failed: {_describe(exc)}", transport="rdma", **ctx) from exc


# --- pyverbs objects that need no device --------------------------------------------


def release(objs: Iterable[Any]) -> None:
    """Frees the C memory of ``SGE``/``SendWR``/``RecvWR`` objects no longer needed.

    pyverbs never frees it on collection (their destructor is spelled ``__dealloc``, so
    Cython does not install it) and ``close()`` is not idempotent (a second call frees
    twice), so each object is released exactly once, after its copy was taken: an
    ``SGE`` once a work request copied it, a work request once posted. A pyverbs whose
    objects lack ``__dealloc`` has a real destructor and is left to it.
    """
    for obj in objs:
        if hasattr(type(obj), "__dealloc"):
            obj.close()


def send_chain(wr_id: int, specs: Sequence[WrSpec]) -> list[Any]:
    """The ``SendWR`` objects for ``specs``, linked through ``next_wr``; the first is the
    head to post. ``next_wr`` holds a raw pointer into the next object, so the caller
    keeps the whole list until ``post_send`` returns (which then releases it).
    Requests pyverbs refuses (a key or length over 32 bits, no entry) are a
    ``ProtocolError``: the work's fault, not the rail's.
    """
    v = verbs()
    wrs: list[Any] = []
    try:
        for spec in specs:
            wr = _send_wr(v, wr_id, spec)
            if wrs:
                wrs[-1].next_wr = wr
            wrs.append(wr)
    except (OverflowError, TypeError, v.Error) as exc:
        release(wrs)
        raise ProtocolError(f"work request not representable in verbs: {_describe(exc)}",
                            transport="rdma") from exc
    except BaseException:
        release(wrs)
        raise
    return wrs


def _send_wr(v: Any, wr_id: int, spec: WrSpec) -> Any:
    flags = v.e.IBV_SEND_SIGNALED if spec.signaled else 0
    if spec.opcode is Opcode.SEND_WITH_IMM:
        flags |= v.e.IBV_SEND_FENCE  # after any READ before it
    sges: list[Any] = []
    try:
        for s in spec.sges:
            sges.append(v.SGE(s.addr, s.length, s.lkey))
        wr = v.SendWR(wr_id=wr_id, opcode=int(spec.opcode), num_sge=len(sges),
                      imm_data=socket.htonl(spec.imm or 0), sg=sges, send_flags=flags)
    finally:
        release(sges)  # the SendWR copied them into its own list
    if spec.opcode is not Opcode.SEND_WITH_IMM:
        try:
            wr.set_wr_rdma(spec.rkey, spec.remote_addr)
        except BaseException:
            release([wr])
            raise
    return wr


def post_send(qp: Any, wrs: list[Any], peer: str | None = None) -> None:
    """Posts a chain from ``send_chain`` and releases it (posted or not)."""
    try:
        with translate(PeerLostError, "ibv_post_send", peer=peer):
            qp.post_send(wrs[0])
    finally:
        release(wrs)


def recv_wr(wr_id: int, addr: int, length: int, lkey: int) -> Any:
    """One single-entry ``RecvWR``; release it once posted."""
    v = verbs()
    sge = v.SGE(addr, length, lkey)
    try:
        return v.RecvWR(wr_id=wr_id, num_sge=1, sg=[sge])
    finally:
        release([sge])


def qp_init_attr(cq: Any, *, send_wr: int, recv_wr: int, send_sge: int) -> Any:
    """Creation attributes of an RC QP on one CQ, signaling only flagged requests."""
    v = verbs()
    cap = v.QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=send_sge,
                  max_recv_sge=1)
    return v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def init_attr(port: int) -> Any:
    """RESET -> INIT: the port, and remote read/write access to the QP."""
    v = verbs()
    attr = v.QPAttr(qp_state=v.e.IBV_QPS_INIT)
    attr.port_num, attr.pkey_index = port, 0
    attr.qp_access_flags = (v.e.IBV_ACCESS_LOCAL_WRITE | v.e.IBV_ACCESS_REMOTE_WRITE
                            | v.e.IBV_ACCESS_REMOTE_READ)
    return attr


def rtr_attr(theirs: QpInfo, mtu: int, *, port: int, gid_index: int,
             max_dest_rd_atomic: int, traffic_class: int = 0, service_level: int = 0) -> Any:
    """INIT -> RTR against the peer's QP (``mtu`` in bytes). A non-zero GID makes the
    path global (RoCE always; IB with a GRH), in ``traffic_class``."""
    v = verbs()
    is_global = 1 if theirs.gid.replace(":", "").strip("0") else 0
    gr = (v.GlobalRoute(dgid=v.GID(theirs.gid), sgid_index=gid_index,
                        hop_limit=_HOP_LIMIT, traffic_class=traffic_class)
          if is_global else None)
    attr = v.QPAttr(qp_state=v.e.IBV_QPS_RTR)
    attr.path_mtu = mtu_enum(mtu)
    attr.dest_qp_num, attr.rq_psn = theirs.qp_num, theirs.psn
    attr.max_dest_rd_atomic, attr.min_rnr_timer = max_dest_rd_atomic, 12
    attr.ah_attr = v.AHAttr(dlid=theirs.lid, is_global=is_global, port_num=port, gr=gr,
                            sl=service_level)
    return attr


def rts_attr(psn: int, max_rd_atomic: int) -> Any:
    """RTR -> RTS: our starting PSN, ~67 ms ack timeout, 7 retries, 7 RNR retries."""
    v = verbs()
    attr = v.QPAttr(qp_state=v.e.IBV_QPS_RTS)
    attr.sq_psn, attr.timeout, attr.retry_cnt = psn, 14, 7
    attr.rnr_retry, attr.max_rd_atomic = 7, max_rd_atomic
    return attr


def roce_v2_gid_type() -> int:
    """What ``Context.query_gid_type`` returns for a RoCE v2 GID: a value of ``enum
    ibv_gid_type_sysfs`` (1). Older rdma-core named that same value
    ``IBV_GID_TYPE_ROCE_V2``, a name that now means 2 in the public ``enum
    ibv_gid_type`` (what ``query_gid_ex`` reports), hence the fallback."""
    e = verbs().e
    return int(getattr(e, "IBV_GID_TYPE_SYSFS_ROCE_V2", e.IBV_GID_TYPE_ROCE_V2))


# --- the opened NIC --------------------------------------------------------------------


def _new_channel_fd(make: Any) -> tuple[Any, int | None]:
    """Creates a completion channel and finds its descriptor, which pyverbs hides: the
    one new ``anon_inode:[infinibandevent]`` in /proc/self/fd. None if ambiguous."""
    def events() -> set[int]:
        out = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                    out.add(int(name))
            except OSError:
                continue
        return out
    with _CHANNEL_LOCK:
        before = events()
        channel = make()
        new = events() - before
    return channel, (new.pop() if len(new) == 1 else None)


class Device:
    """One opened NIC: context, protection domain, one CQ with its completion channel,
    and the thread that reads completions."""

    def __init__(self, name: str, *, route: RouteSettings, cq_depth: int,
                 relaxed_ordering: bool, on_wc: Any, poll_interval: float) -> None:
        v = verbs()
        self.name, self.route = name, route
        opened: list[Any] = []  # closed in reverse if opening fails partway
        try:
            with translate(NotSupportedError, f"opening RDMA device {name}"):
                self.ctx = v.Context(name=name)
                opened.append(self.ctx)
                attr = self.ctx.query_device()
                self.port, port = self._active_port(attr.phys_port_cnt)
                self.lid = port.lid
                self.mtu = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}.get(port.active_mtu,
                                                                            1024)
                self.max_msg_size = int(port.max_msg_sz) or (1 << 30)
                self.gid_index = self._gid_index(port, route.gid_index)
                self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
                self.pd = v.PD(self.ctx)
                opened.append(self.pd)
                self.channel, self._chan_fd = _new_channel_fd(lambda: v.CompChannel(self.ctx))
                opened.append(self.channel)
                self.cq = v.CQ(self.ctx, min(cq_depth, attr.max_cqe), None, self.channel, 0)
                self.cq_room = CqRoom(min(cq_depth, attr.max_cqe))
                opened.append(self.cq)
        except BaseException:
            for obj in reversed(opened):
                try:
                    obj.close()
                except Exception as exc:  # the first failure is the one to report
                    log.warning("closing %s on %s: %s", type(obj).__name__, name, exc)
            raise
        self.max_sge = max(1, min(attr.max_sge, 30))
        self.max_sge_rd = max(1, min(getattr(attr, "max_sge_rd", 0) or attr.max_sge, 30))
        self.max_rd_atomic = max(1, min(attr.max_qp_rd_atom, 16))  # as responder
        self.max_init_rd_atomic = max(1, min(attr.max_qp_init_rd_atom, 16))  # initiator
        self.link_rate_gbps = 0.0  # filled from topology by the transport
        self._relaxed = relaxed_ordering and hasattr(v.e, "IBV_ACCESS_RELAXED_ORDERING")
        self._on_wc, self._interval = on_wc, poll_interval
        self._inbound: dict[int, _Inbound] = {}
        self._calls: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"te-rdma-cq-{name}",
                                        daemon=True)
        self._thread.start()

    def _active_port(self, count: int) -> tuple[int, Any]:
        v = verbs()
        for num in range(1, count + 1):
            port = self.ctx.query_port(num)
            if port.state == v.e.IBV_PORT_ACTIVE:
                return num, port
        raise NotSupportedError(f"no RDMA device: {self.name} has no ACTIVE port "
                                "(check `ibv_devinfo`, cabling and the subnet manager)",
                                transport="rdma")

    def _gid_index(self, port: Any, wanted: int | None) -> int:
        """RoCE needs a RoCE v2 GID (IPv4-mapped preferred); IB works with index 0."""
        v = verbs()
        if wanted is not None:
            return wanted
        if port.link_layer != v.e.IBV_LINK_LAYER_ETHERNET:
            return 0
        best = None
        roce_v2 = roce_v2_gid_type()
        for i in range(port.gid_tbl_len):
            try:
                gid = str(self.ctx.query_gid(self.port, i))
                kind = self.ctx.query_gid_type(self.port, i)
            except v.Error:
                continue
            if gid.replace(":", "").strip("0") == "" or kind != roce_v2:
                continue
            if gid.startswith("0000:0000:0000:0000:0000:ffff"):
                return i
            best = i if best is None else best
        return best if best is not None else 0

    # QPs and memory

    def create_qp(self, *, send_wr: int, recv_wr: int, send_sge: int) -> Any:
        """A QP in INIT, its completions' room reserved on the CQ (``ConnectError``
        when the CQ cannot take them); :meth:`destroy_qp` gives it back."""
        v = verbs()
        self.cq_room.reserve(send_wr + recv_wr, self.name)
        try:
            init = qp_init_attr(self.cq, send_wr=send_wr, recv_wr=recv_wr,
                                send_sge=send_sge)
            with translate(ConnectError, f"creating a queue pair on {self.name}"):
                qp = v.QP(self.pd, init)
                try:
                    qp.to_init(init_attr(self.port))
                except v.Error:
                    qp.close()
                    raise
        except BaseException:
            self.cq_room.cancel(send_wr + recv_wr)
            raise
        self.cq_room.hold(id(qp), send_wr + recv_wr)
        return qp

    def destroy_qp(self, qp: Any) -> None:
        """Destroys a QP and frees its room on the CQ (idempotent)."""
        try:
            qp.close()
        finally:
            self.cq_room.free(id(qp))

    @staticmethod
    def qp_key(qp: Any) -> int:
        """The key of an inbound QP in receive work-request ids: its QP number, unique on
        this device and 24 bits wide, so it fits beside a 20-bit buffer index."""
        return int(qp.qp_num)

    def qp_info(self, qp: Any, psn: int) -> QpInfo:
        return QpInfo(qp.qp_num, self.lid, self.gid, self.gid_index, psn, self.mtu,
                      self.name, self.port)

    def connect_qp(self, qp: Any, psn: int, theirs: QpInfo, mtu: int,
                   peer: str | None = None) -> None:
        """INIT -> RTR -> RTS against the peer's QP."""
        with translate(ConnectError, f"connecting queue pair on {self.name}", peer=peer,
                       op="connect"):
            qp.to_rtr(rtr_attr(theirs, mtu, port=self.port, gid_index=self.gid_index,
                               max_dest_rd_atomic=self.max_rd_atomic,
                               traffic_class=self.route.traffic_class,
                               service_level=self.route.service_level))
            qp.to_rts(rts_attr(psn, self.max_init_rd_atomic))

    def post_send(self, qp: Any, wr_id: int, specs: Sequence[WrSpec] | WrBatch,
                  peer: str | None = None) -> None:
        """Posts ``specs`` as one chain (one doorbell). ``ProtocolError`` when a request
        is not representable in verbs (the work's fault), ``PeerLostError`` when the
        queue pair refuses the chain. pyverbs needs an object per request: a batch is
        turned into them here."""
        if isinstance(specs, WrBatch):
            specs = specs.specs()
        post_send(qp, send_chain(wr_id, specs), peer)

    def post_recv(self, qp: Any, wr_id: int, addr: int, length: int, lkey: int,
                  peer: str | None = None) -> None:
        wr = recv_wr(wr_id, addr, length, lkey)
        try:
            with translate(ConnectError, f"posting a receive on {self.name}", peer=peer):
                qp.post_recv(wr)
        finally:
            release([wr])

    def alloc_mr(self, length: int) -> Any:
        """A buffer pyverbs allocates and registers (receive and notify slots)."""
        v = verbs()
        with translate(RegistrationError, f"allocating a {length}-byte buffer"):
            return v.MR(self.pd, length, v.e.IBV_ACCESS_LOCAL_WRITE)

    def register(self, address: int, length: int, device: str, *, writable: bool,
                 segment: str) -> tuple[Any, int]:
        """Registers memory; returns (MR, base address the NIC uses for byte 0).

        GPU memory: dma-buf first (iova = offset in the dma-buf), else the
        nvidia-peermem path (a plain registration of the device pointer).
        """
        v = verbs()
        access = (v.e.IBV_ACCESS_LOCAL_WRITE | v.e.IBV_ACCESS_REMOTE_WRITE
                  | v.e.IBV_ACCESS_REMOTE_READ) if writable else v.e.IBV_ACCESS_REMOTE_READ
        if self._relaxed:
            access |= v.e.IBV_ACCESS_RELAXED_ORDERING
        ctx = {"segment": segment, "length": length}
        if device.startswith("cuda") and v.DmaBufMR is not None:
            from transfer_engine import gpu  # lazy: needs CUDA

            try:
                fd, offset = gpu.dmabuf_fd(address, length)
            except NotSupportedError as exc:
                log.info("no dma-buf for %s (%s); trying peer memory", segment, exc)
            else:
                try:
                    return self._dmabuf_mr(fd, offset, length, access, ctx), offset
                except RegistrationError as exc:
                    log.info("%s; trying peer memory", exc)
                finally:
                    os.close(fd)  # the MR holds its own reference to the dma-buf
        with translate(RegistrationError, f"memory registration on {self.name}"
                       + (" (GPU memory needs nvidia-peermem or dma-buf)"
                          if device.startswith("cuda") else ""), **ctx):
            return v.MR(self.pd, length, access, address=address), address

    def _dmabuf_mr(self, fd: int, offset: int, length: int, access: int,
                   ctx: dict[str, Any]) -> Any:
        """A dma-buf MR whose iova is ``offset`` (pyverbs registers iova = offset).
        rdma-core 44 takes the descriptor as ``dmabuf``; a pyverbs that types it as its
        own ``DmaBuf`` refuses an int (``TypeError``): that is a ``RegistrationError``
        too, so the caller falls back to peer memory."""
        v = verbs()
        what = f"dma-buf registration on {self.name}"
        try:
            with translate(RegistrationError, what, **ctx):
                return v.DmaBufMR(self.pd, length, access, dmabuf=fd, offset=offset)
        except TypeError as exc:
            raise RegistrationError(f"{what} failed: this pyverbs' DmaBufMR takes no "
                                    f"file descriptor ({exc})", transport="rdma",
                                    **ctx) from exc

    # inbound QPs, deferred calls, completions

    def add_inbound(self, conn: _Inbound) -> None:
        self._inbound[conn.key] = conn

    def remove_inbound(self, conn: _Inbound) -> None:
        self._inbound.pop(conn.key, None)

    def inbound(self, key: int) -> _Inbound | None:
        return self._inbound.get(key)

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Runs ``fn`` on the completion thread (callbacks never run on a caller's)."""
        self._calls.append((fn, args))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _loop(self) -> None:
        v = verbs()
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._chan_fd is not None:
            poller.register(self._chan_fd, select.POLLIN)
        # Without the channel's descriptor we sleep 1 ms between polls: bounded CPU.
        timeout = int(self._interval * 1000) if self._chan_fd is not None else 1
        self.cq.req_notify()
        while not self._stopping:
            try:
                self._drain()
                while self._calls:
                    fn, args = self._calls.popleft()
                    fn(*args)
                for fd, _ in poller.poll(timeout):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                    else:  # readable: get_cq_event will not block (it holds the GIL)
                        self.channel.get_cq_event(self.cq)
                        self.cq.ack_events(1)
                        self.cq.req_notify()
            except v.Error as exc:
                log.error("rdma completion thread of %s: %s", self.name, _describe(exc))
            except Exception:
                log.exception("rdma completion callback failed")

    def _drain(self) -> None:
        while True:
            count, wcs = self.cq.poll(32)
            for wc in wcs:
                try:
                    self._on_wc(self, wc)
                except Exception:  # one handler's failure must not drop the batch's rest
                    log.exception("rdma completion of wr_id %#x failed", wc.wr_id)
            if count < 32:
                return

    def stop(self) -> None:
        self._stopping = True
        self.call_soon(lambda: None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        for obj in (self.cq, self.channel, self.pd, self.ctx):
            try:
                obj.close()
            except verbs().Error as exc:
                log.warning("closing %s on %s: %s", type(obj).__name__, self.name, exc)
        os.close(self._wake_r)
        os.close(self._wake_w)


def open_devices(names: list[str] | None, **kwargs: Any) -> list[Device]:
    """Opens the named NICs (every one with an active port when None)."""
    v = verbs()
    try:
        found = [d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                 for d in v.get_device_list()]
    except v.Error as exc:
        raise NotSupportedError(f"no RDMA device: {_describe(exc)} (no RDMA NIC or "
                                "driver; `ibv_devices` lists them)",
                                transport="rdma") from exc
    if not found:
        raise NotSupportedError("no RDMA device: the device list is empty",
                                transport="rdma")
    missing = [n for n in names or [] if n not in found]
    if missing:
        raise NotSupportedError(f"no RDMA device named {missing}; found {found}",
                                transport="rdma")
    devices: list[Device] = []
    errors = []
    for name in names or found:
        try:
            devices.append(Device(name, **kwargs))
        except NotSupportedError as exc:
            if names:  # asked for by name: its failure is the caller's to see
                for dev in devices:
                    dev.close()
                raise
            errors.append(str(exc))
    if not devices:
        raise NotSupportedError(f"no usable RDMA device: {'; '.join(errors)}",
                                transport="rdma")
    return devices

"""The RDMA transport's use of pyverbs, checked against the installed pyverbs: NO DEVICE.

These tests were written and run on a machine with rdma-core 44's pyverbs (Debian 12
``python3-pyverbs``) but no RDMA NIC and no kernel InfiniBand support: no device was
available, so nothing here opens one. They run wherever pyverbs imports and are skipped,
saying so, where it does not; with ``TE_PYVERBS_REQUIRED=1`` (set by ``scripts/test.sh``
in a full run, after ``scripts/setup_pyverbs.sh`` has fetched Debian's pyverbs into
``.venv-pyverbs``) its absence is an error instead. They need no device, so they carry no
``rdma`` marker.

What is exercised, against the real library:

- every pyverbs module, class, function and enum name the transport uses exists, and
  our own enums (``Opcode``, ``WcStatus``, MTUs) equal pyverbs' values;
- the RoCE v2 GID choice (``Device._gid_index`` over a stand-in context answering with
  pyverbs' ``query_gid_type`` values);
- the objects the transport builds without a device are built by the transport's own
  functions, exactly as on the data path: ``QPCap``/``QPInitAttr`` (``qp_init_attr``),
  the INIT/RTR/RTS ``QPAttr`` with ``AHAttr``/``GlobalRoute``/``GID``
  (``init_attr``/``rtr_attr``/``rts_attr``), chained ``SGE``/``SendWR`` from
  ``build_work_requests`` output (``send_chain``), ``RecvWR`` (``recv_wr``), and a
  ``WC`` as ``CQ.poll`` fills it, decoded as the completion thread decodes it;
- a rail's data path (``RdmaRail.post`` -> ``send_chain`` -> ``post_send``) on stand-ins
  for the QP, the NIC and the transport, so real pyverbs objects reach the QP's
  ``post_send``; a request pyverbs refuses fails that work only;
- the error paths that need no device: ``get_device_list()`` raising becomes
  ``NotSupportedError``; a failing ``post_send`` becomes ``PeerLostError`` with the errno
  once; values pyverbs cannot convert become ``ProtocolError``; a device that fails to
  open partway closes what it opened (on stand-ins for the device objects);
- the memory rules of pyverbs' work-request objects (freed only by ``close()``, once).

What is NOT exercised (it needs a device; only the ``rdma``-marked tests in
``tests/test_transport_rdma.py`` cover it, and they have not yet run on hardware
against this code): opening a ``Context``,
``query_device``/``query_port``/``query_gid``/``query_gid_type`` results, creating a
``PD``, ``MR``, ``DmaBufMR``, ``CompChannel``, ``CQ`` or ``QP``, the state changes
themselves (``to_init``/``to_rtr``/``to_rts``), posting to a real queue, polling, and
completion events. For those calls only the names and documented parameters are
checked here.
"""

from __future__ import annotations

import itertools
import os
import socket
import types
from typing import Any

import pytest

try:
    import pyverbs.cq as pv_cq
    import pyverbs.device as pv_device
    import pyverbs.wr as pv_wr
    from pyverbs.pyverbs_error import PyverbsRDMAError
except ImportError as exc:  # no rdma-core Python bindings
    if os.environ.get("TE_PYVERBS_REQUIRED") == "1":
        raise RuntimeError(f"TE_PYVERBS_REQUIRED=1 but pyverbs is not importable ({exc}); "
                           "scripts/setup_pyverbs.sh makes it importable") from exc
    pytest.skip(f"pyverbs not importable ({exc}); install python3-pyverbs (see "
                "docs/rdma.md) to check the transport against its API",
                allow_module_level=True)

from tests.helpers.faults import fake_pyverbs
from transfer_engine.descriptor import Extent, Op
from transfer_engine.errors import NotSupportedError, PeerLostError, ProtocolError
from transfer_engine.transport.base import Completion, Immediate, Work
from transfer_engine.transport.rdma import RdmaRail
from transfer_engine.transport.rdma.placement import RouteSettings
from transfer_engine.transport.rdma.plan import (
    MrKey,
    Opcode,
    QpInfo,
    Sge,
    WcStatus,
    WrSpec,
    build_work_requests,
    decode_imm,
    encode_imm,
    mtu_enum,
)
from transfer_engine.transport.rdma.verbs import (
    Device,
    import_pyverbs,
    init_attr,
    open_devices,
    post_send,
    qp_init_attr,
    recv_wr,
    release,
    roce_v2_gid_type,
    rtr_attr,
    rts_attr,
    send_chain,
)


@pytest.fixture(scope="module")
def v() -> Any:
    return import_pyverbs()


def _no_device() -> bool:
    try:
        return not pv_device.get_device_list()
    except PyverbsRDMAError:
        return True


# --- names ----------------------------------------------------------------------------

def test_every_class_and_function_the_transport_imports_exists(v: Any) -> None:
    for name in ("Context", "get_device_list", "PD", "MR", "DmaBufMR", "CQ",
                 "CompChannel", "QP", "QPInitAttr", "QPAttr", "QPCap", "AHAttr",
                 "GlobalRoute", "GID", "SGE", "SendWR", "RecvWR", "Error"):
        assert getattr(v, name) is not None, name
    assert issubclass(PyverbsRDMAError, v.Error)


@pytest.mark.parametrize("cls,members", [
    ("Context", ["query_device", "query_port", "query_gid", "query_gid_type", "close"]),
    ("CQ", ["poll", "req_notify", "ack_events", "close"]),
    ("CompChannel", ["get_cq_event", "close"]),
    ("QP", ["to_init", "to_rtr", "to_rts", "post_send", "post_recv", "qp_num", "close"]),
    ("MR", ["read", "write", "buf", "lkey", "rkey", "close"]),
    ("DmaBufMR", ["lkey", "rkey", "close"]),
    ("SendWR", ["next_wr", "set_wr_rdma", "opcode", "imm_data", "send_flags", "close"]),
    ("RecvWR", ["wr_id", "num_sge", "close"]),
    ("QPAttr", ["port_num", "pkey_index", "qp_access_flags", "path_mtu", "dest_qp_num",
                "rq_psn", "max_dest_rd_atomic", "min_rnr_timer", "ah_attr", "sq_psn",
                "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"]),
])
def test_methods_and_attributes_the_transport_uses_exist(v: Any, cls: str,
                                                         members: list[str]) -> None:
    missing = [m for m in members if not hasattr(getattr(v, cls), m)]
    assert not missing, f"pyverbs {cls} lacks {missing}"


def test_query_results_have_the_fields_the_transport_reads() -> None:
    device_attr = ["phys_port_cnt", "max_cqe", "max_sge", "max_sge_rd", "max_qp_rd_atom",
                   "max_qp_init_rd_atom"]
    port_attr = ["state", "lid", "active_mtu", "max_msg_sz", "link_layer", "gid_tbl_len"]
    wc = ["wr_id", "status", "vendor_err", "opcode", "imm_data", "byte_len"]
    assert [a for a in device_attr if not hasattr(pv_device.DeviceAttr, a)] == []
    assert [a for a in port_attr if not hasattr(pv_device.PortAttr, a)] == []
    assert [a for a in wc if not hasattr(pv_cq.WC, a)] == []
    assert hasattr(pv_device.Device, "name")


def test_device_bound_constructors_document_the_arguments_we_pass(v: Any) -> None:
    """Cython hides their signatures; the docstrings name the parameters."""
    docs = {"Context": (v.Context.__init__, ["*name*"]),
            "MR": (v.MR.__init__, [":param length", ":param access", ":param address"]),
            "DmaBufMR": (v.DmaBufMR.__init__, [":param dmabuf", ":param offset"]),
            "CQ": (v.CQ.__init__, [":param cqe", ":param cq_context", ":param channel",
                                   ":param comp_vector"]),
            "QP": (v.QP.__init__, [":param creator", ":param init_attr"]),
            "get_cq_event": (v.CompChannel.get_cq_event, [":param expected_cq"]),
            "poll": (v.CQ.poll, ["(npolled, wcs)"])}
    for what, (fn, needles) in docs.items():
        doc = fn.__doc__ or ""
        assert all(n in doc for n in needles), f"{what}: {needles} not in {doc!r}"


def test_enum_names_and_values_match_ours(v: Any) -> None:
    e = v.e
    assert {op: int(getattr(e, name)) for op, name in [
        (Opcode.WRITE, "IBV_WR_RDMA_WRITE"), (Opcode.WRITE_WITH_IMM, "IBV_WR_RDMA_WRITE_WITH_IMM"),
        (Opcode.SEND, "IBV_WR_SEND"), (Opcode.SEND_WITH_IMM, "IBV_WR_SEND_WITH_IMM"),
        (Opcode.READ, "IBV_WR_RDMA_READ")]} == {op: int(op) for op in Opcode}
    for status in WcStatus:
        assert int(getattr(e, f"IBV_WC_{status.name}")) == status, status
    for nbytes in (256, 512, 1024, 2048, 4096):
        assert int(getattr(e, f"IBV_MTU_{nbytes}")) == mtu_enum(nbytes)
    for name in ("IBV_PORT_ACTIVE", "IBV_LINK_LAYER_ETHERNET", "IBV_QPT_RC",
                 "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS", "IBV_ACCESS_LOCAL_WRITE",
                 "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ",
                 "IBV_ACCESS_RELAXED_ORDERING", "IBV_SEND_SIGNALED", "IBV_SEND_FENCE",
                 "IBV_WC_RECV_RDMA_WITH_IMM"):
        assert hasattr(e, name), name


def test_roce_v2_is_what_query_gid_type_returns(v: Any) -> None:
    """``query_gid_type`` yields ``enum ibv_gid_type_sysfs``: RoCE v2 is 1 there, while
    ``IBV_GID_TYPE_ROCE_V2`` (2) belongs to ``enum ibv_gid_type``."""
    assert roce_v2_gid_type() == int(v.e.IBV_GID_TYPE_SYSFS_ROCE_V2) == 1
    assert roce_v2_gid_type() != int(v.e.IBV_GID_TYPE_ROCE_V2)


def test_gid_selection_reads_query_gid_type_values(v: Any) -> None:
    """``Device._gid_index`` over a GID table answered with pyverbs' own values: the
    IPv4-mapped RoCE v2 entry wins, a RoCE v1 twin and unreadable entries do not."""
    v1, v2 = v.e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1, v.e.IBV_GID_TYPE_SYSFS_ROCE_V2
    link_local = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    mapped = "0000:0000:0000:0000:0000:ffff:0a00:0001"
    table = {0: (link_local, v1), 1: (link_local, v2), 3: (mapped, v1), 4: (mapped, v2)}

    class _Ctx:
        def query_gid(self, port: int, index: int) -> Any:
            if index not in table:
                raise PyverbsRDMAError(f"Failed to query gid {index} of port {port}")
            return v.GID(table[index][0])

        def query_gid_type(self, port: int, index: int) -> int:
            return int(table[index][1])

    dev = object.__new__(Device)  # no device: only the fields _gid_index reads
    dev.ctx, dev.port = _Ctx(), 1
    port = types.SimpleNamespace(link_layer=v.e.IBV_LINK_LAYER_ETHERNET, gid_tbl_len=6)
    assert dev._gid_index(port, None) == 4
    del table[4]
    assert dev._gid_index(port, None) == 1  # no IPv4-mapped RoCE v2: the first RoCE v2
    assert dev._gid_index(port, 5) == 5  # asked for explicitly
    ib = types.SimpleNamespace(link_layer=v.e.IBV_LINK_LAYER_INFINIBAND, gid_tbl_len=6)
    assert dev._gid_index(ib, None) == 0


@pytest.mark.parametrize("failing", ["PD", "CQ"])
def test_a_device_that_fails_to_open_closes_what_it_opened(
        v: Any, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """``Device.__init__`` failing partway (here the PD, or the CQ after the completion
    channel) closes the context and everything opened after it, newest first, and says
    which step failed. NO DEVICE: the context, PD, channel and CQ are stand-ins (there
    is no NIC to open here); the error is pyverbs' own ``PyverbsRDMAError``."""
    closed: list[str] = []

    class _Obj:
        kind = "?"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if self.kind == failing:
                raise PyverbsRDMAError(f"Failed to create {self.kind}", 12)

        def close(self) -> None:
            closed.append(self.kind)

    class _Ctx(_Obj):
        kind = "Context"

        def query_device(self) -> Any:
            return types.SimpleNamespace(phys_port_cnt=1, max_cqe=4096, max_sge=30,
                                         max_sge_rd=30, max_qp_rd_atom=16,
                                         max_qp_init_rd_atom=16)

        def query_port(self, num: int) -> Any:
            return types.SimpleNamespace(state=v.e.IBV_PORT_ACTIVE, lid=1, active_mtu=5,
                                         max_msg_sz=1 << 30,
                                         link_layer=v.e.IBV_LINK_LAYER_INFINIBAND)

        def query_gid(self, port: int, index: int) -> Any:
            return v.GID("fe80:0000:0000:0000:0202:c9ff:fe00:0001")

    stand_ins = {name: type(name, (_Obj,), {"kind": name})
                 for name in ("PD", "CompChannel", "CQ")}
    fake = types.SimpleNamespace(**{**vars(v), "Context": _Ctx, **stand_ins})
    fake_pyverbs(monkeypatch, fake)
    with pytest.raises(NotSupportedError) as info:
        Device("fake0", route=RouteSettings(), cq_depth=64, relaxed_ordering=False,
               on_wc=lambda wc: None, poll_interval=0.01)
    assert f"Failed to create {failing}" in str(info.value) and "fake0" in str(info.value)
    assert closed == {"PD": ["Context"], "CQ": ["CompChannel", "PD", "Context"]}[failing]


# --- QP setup objects, built by the transport's own functions ---------------------------

def test_qp_creation_attributes(v: Any) -> None:
    init = qp_init_attr(None, send_wr=1024, recv_wr=256, send_sge=30)
    assert isinstance(init, v.QPInitAttr)
    assert init.qp_type == v.e.IBV_QPT_RC and init.sq_sig_all == 0
    assert (init.max_send_wr, init.max_recv_wr, init.max_send_sge, init.max_recv_sge) == (
        1024, 256, 30, 1)


def test_init_attributes(v: Any) -> None:
    attr = init_attr(2)
    assert attr.qp_state == v.e.IBV_QPS_INIT
    assert (attr.port_num, attr.pkey_index) == (2, 0)
    assert attr.qp_access_flags == (v.e.IBV_ACCESS_LOCAL_WRITE | v.e.IBV_ACCESS_REMOTE_WRITE
                                    | v.e.IBV_ACCESS_REMOTE_READ)


def _peer(gid: str, lid: int = 0) -> QpInfo:
    return QpInfo(0xABCDE, lid, gid, 3, 0x123456, 4096, "mlx5_1", 1)


def test_rtr_attributes_roce(v: Any) -> None:
    gid = "0000:0000:0000:0000:0000:ffff:0a00:0002"
    attr = rtr_attr(_peer(gid), 4096, port=1, gid_index=3, max_dest_rd_atomic=16)
    assert attr.qp_state == v.e.IBV_QPS_RTR
    assert attr.path_mtu == v.e.IBV_MTU_4096
    assert (attr.dest_qp_num, attr.rq_psn) == (0xABCDE, 0x123456)
    assert (attr.max_dest_rd_atomic, attr.min_rnr_timer) == (16, 12)
    ah = attr.ah_attr
    assert (ah.is_global, ah.port_num, ah.dlid) == (1, 1, 0)
    assert (str(ah.dgid), ah.sgid_index) == (gid, 3)
    assert ah.hop_limit == 255  # pyverbs' own default (1) would not cross a router
    assert (ah.traffic_class, ah.sl) == (0, 0)
    marked = rtr_attr(_peer(gid), 4096, port=1, gid_index=3, max_dest_rd_atomic=16,
                      traffic_class=106, service_level=3).ah_attr
    assert (marked.traffic_class, marked.sl) == (106, 3)


def test_rtr_attributes_without_gid_are_local(v: Any) -> None:
    attr = rtr_attr(_peer("0000:0000:0000:0000:0000:0000:0000:0000", lid=7), 1024, port=1,
                    gid_index=0, max_dest_rd_atomic=4)
    assert attr.path_mtu == v.e.IBV_MTU_1024
    assert (attr.ah_attr.is_global, attr.ah_attr.dlid) == (0, 7)


def test_rts_attributes(v: Any) -> None:
    attr = rts_attr(0x654321, 8)
    assert attr.qp_state == v.e.IBV_QPS_RTS
    assert (attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry,
            attr.max_rd_atomic) == (0x654321, 14, 7, 7, 8)


def test_gid_strings_round_trip_as_the_transport_writes_them(v: Any) -> None:
    text = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    assert str(v.GID(text)) == text
    assert QpInfo.from_wire(_peer(str(v.GID(text))).to_wire()).gid == text


# --- work requests ----------------------------------------------------------------------

class _QP:
    """Stands in for a QP: records what ``post_send``/``post_recv`` receive."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.posted: list[Any] = []

    def post_send(self, wr: Any) -> None:
        self.posted.append(wr)
        if self.error is not None:
            raise self.error


def _specs() -> list[WrSpec]:
    """A WRITE split over several requests (max_sge 2, scattered local pieces) ending in
    WRITE_WITH_IMM, as the rail builds them, plus a notify SEND_WITH_IMM."""
    local = [(1, i * 8192, 4096) for i in range(5)]  # five non-adjacent local pieces
    remote = [(2, 0, 5 * 4096)]
    specs = build_work_requests(
        Op.WRITE, local, remote, local_keys={1: MrKey(0x7F0000000000, 1 << 20, 0x1111)},
        remote_keys={2: MrKey(0x5000, 1 << 20, 0x2222)}, max_sge=2,
        max_msg_size=1 << 20, imm=encode_imm(7, 2))
    send = WrSpec(Opcode.SEND_WITH_IMM, (Sge(0x7F0000100000, 40, 0x3333),), 0, 0, True,
                  encode_imm(7, 2))
    return [*specs, send]


def test_send_chain_builds_every_request(v: Any) -> None:
    specs = _specs()
    assert len(specs) == 4  # 2 + 2 + 1 SGEs, then the SEND: a chain of more than two
    wrs = send_chain(99, specs)
    try:
        assert len(wrs) == len(specs) and all(isinstance(w, v.SendWR) for w in wrs)
        assert [w.opcode for w in wrs] == [int(s.opcode) for s in specs]
        assert [w.num_sge for w in wrs] == [len(s.sges) for s in specs]
        assert all(w.wr_id == 99 for w in wrs)
        signaled = v.e.IBV_SEND_SIGNALED
        assert [w.send_flags for w in wrs] == [0, 0, signaled,
                                               signaled | v.e.IBV_SEND_FENCE]
        # verbs wants the immediate in network byte order; pyverbs passes it through
        assert wrs[2].imm_data == socket.htonl(encode_imm(7, 2))
        assert wrs[0].imm_data == 0
    finally:
        qp = _QP()
        post_send(qp, wrs, "peer")  # posts the head and releases the whole chain
    assert qp.posted == [wrs[0]]


def test_failed_post_is_peer_lost_with_errno_once(v: Any) -> None:
    wrs = send_chain(1, _specs()[:1])
    qp = _QP(PyverbsRDMAError("Failed to post send", 12))
    with pytest.raises(PeerLostError) as info:
        post_send(qp, wrs, "peer")
    text = str(info.value)
    assert info.value.peer == "peer" and info.value.transport == "rdma"
    assert "ibv_post_send failed" in text and text.count("12") == 1, text


def test_requests_pyverbs_refuses_are_protocol_errors() -> None:
    bad_key = WrSpec(Opcode.WRITE, (Sge(0x1000, 64, 1),), 0x2000, 1 << 32, True)
    with pytest.raises(ProtocolError, match="not representable"):
        send_chain(1, [_specs()[0], bad_key])
    no_entry = WrSpec(Opcode.WRITE, (), 0x2000, 1, True)  # pyverbs: needs one SGE
    with pytest.raises(ProtocolError, match="at least one SGE"):
        send_chain(1, [no_entry])


# --- a rail's data path, on stand-ins for the QP, NIC and transport ---------------------

class _Mr:
    buf, lkey = 0x7F0000100000, 0x3333

    def write(self, data: bytes, length: int, offset: int) -> None:
        assert len(data) == length and offset >= 0

    def close(self) -> None:
        pass


class _Nic:
    name, link_rate_gbps = "fake0", 0.0
    max_sge = max_sge_rd = 2
    max_msg_size = 1 << 20

    post_send = Device.post_send  # the real pyverbs posting path: one chain per work

    def destroy_qp(self, qp: Any) -> None:
        qp.close()

    def alloc_mr(self, length: int) -> _Mr:
        return _Mr()


class _Transport:
    sq_depth, max_notify, notify_slots = 64, 64, 4

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.deferred: list[tuple[Any, tuple[Any, ...]]] = []

    def local_keys(self, device: str) -> dict[int, MrKey]:
        return {1: MrKey(0x7F0000000000, 1 << 20, 0x1111)}

    def new_wr_id(self, rail: Any) -> int:
        return next(self.ids)

    def defer(self, device: Any, fn: Any, *args: Any) -> None:
        self.deferred.append((fn, args))  # the completion thread's job, run by the test

    def forget_wr_ids(self, wr_ids: list[int]) -> None:
        pass

    def forget_rail(self, rail: Any) -> None:
        pass


class _Sock:
    def close(self) -> None:
        pass


class _RailQP(_QP):
    def close(self) -> None:
        pass


def _rail(rkey: int) -> tuple[RdmaRail, _RailQP, _Transport, list[Completion]]:
    qp, transport = _RailQP(), _Transport()
    done: list[Completion] = []
    rail = RdmaRail(transport, "peer", 0, _Nic(), "fake1", qp,  # type: ignore[arg-type]
                    _Sock(), {2: MrKey(0x5000, 1 << 20, rkey)},  # type: ignore[arg-type]
                    done.append)
    return rail, qp, transport, done


def _work() -> Work:
    return Work(1, Op.WRITE, [Extent(1, i * 8192, 4096) for i in range(5)],
                [Extent(2, 0, 5 * 4096)], 5 * 4096, Immediate(7, 1, b"ready"))


def test_rail_posts_one_chain_through_pyverbs(v: Any) -> None:
    rail, qp, transport, done = _rail(0x2222)
    rail.post(_work())  # three WRITEs then the notify SEND_WITH_IMM
    assert len(qp.posted) == 1 and isinstance(qp.posted[0], v.SendWR)
    assert qp.posted[0].opcode == v.e.IBV_WR_RDMA_WRITE and qp.posted[0].num_sge == 2
    assert rail.inflight == 1 and not transport.deferred and not done
    rail.close()
    assert [type(c.error).__name__ for c in done] == ["ClosedError"]


def test_rail_fails_only_the_work_pyverbs_refuses(v: Any) -> None:
    rail, qp, transport, done = _rail(1 << 32)  # a peer's rkey that is not 32 bits
    rail.post(_work())
    for fn, args in transport.deferred:
        fn(*args)
    assert qp.posted == [] and rail.inflight == 0 and not rail.closed
    (completion,) = done
    assert isinstance(completion.error, ProtocolError)
    assert completion.error.peer == "peer" and completion.error.op == str(Op.WRITE)
    assert rail.free_notify_slots == _Transport.notify_slots  # its notify slot came back
    rail.close()


def test_recv_wr_keeps_a_64_bit_id(v: Any) -> None:
    wr_id = (1 << 63) | (0xFFFFFF << 20) | 0xFFFFF  # the transport's receive id layout
    wr = recv_wr(wr_id, 0x7F0000200000, 4120, 0x4444)
    try:
        assert isinstance(wr, v.RecvWR)
        assert (wr.wr_id, wr.num_sge) == (wr_id, 1)
    finally:
        release([wr])


def test_work_request_objects_are_freed_only_by_close() -> None:
    """pyverbs spells their destructor ``__dealloc``; ``release`` closes exactly when that
    is so (a real destructor would free them itself, and a second close frees twice)."""
    typo = [hasattr(c, "__dealloc") for c in (pv_wr.SGE, pv_wr.SendWR, pv_wr.RecvWR)]
    assert len(set(typo)) == 1, typo

    class _Obj:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    class _Typo(_Obj):
        pass

    setattr(_Typo, "__dealloc", lambda self: None)  # noqa: B010  (the name pyverbs uses)
    plain, typod = _Obj(), _Typo()
    release([plain, typod])
    assert (plain.closed, typod.closed) == (0, 1)


# --- completions --------------------------------------------------------------------------

def test_completion_fields_as_poll_fills_them(v: Any) -> None:
    imm = encode_imm(0xABCDEF, 3)
    wc = pv_cq.WC(wr_id=(1 << 63) | 5, status=0, opcode=int(v.e.IBV_WC_RECV_RDMA_WITH_IMM),
                  vendor_err=0, byte_len=4096, imm_data=socket.htonl(imm),
                  wc_flags=int(v.e.IBV_WC_WITH_IMM))
    assert wc.wr_id & (1 << 63) and wc.wr_id & 0xFFFFF == 5
    assert wc.opcode == v.e.IBV_WC_RECV_RDMA_WITH_IMM and wc.status == 0
    assert decode_imm(socket.ntohl(wc.imm_data)) == (0xABCDEF, 3)


# --- no device --------------------------------------------------------------------------

def test_no_device_is_not_supported_with_the_reason(v: Any) -> None:
    if not _no_device():
        pytest.skip("an RDMA device is listed; this checks the message without one")
    with pytest.raises(NotSupportedError) as info:
        open_devices(None, route=RouteSettings(), cq_depth=16, relaxed_ordering=False,
                     on_wc=None, poll_interval=0.1)
    text = str(info.value)
    assert info.value.transport == "rdma"
    assert text.startswith("no RDMA device") and "ibv_devices" in text

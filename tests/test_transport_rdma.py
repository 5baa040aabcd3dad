"""RDMA transport: the conformance suite and transport-level checks on a real NIC.

Tests marked ``rdma`` skip with the reason from ``tests.helpers.hardware.rdma_skip_reason`` when
pyverbs or an active device is missing. The unmarked tests check that a missing library
or device gives a ``NotSupportedError`` that says what is missing; they run everywhere.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np
import pytest

from tests.helpers.hardware import rdma_skip_reason
from transfer_engine.control.tickets import Credential, Ticket, TicketBook
from transfer_engine.descriptor import Extent, Op
from transfer_engine.errors import ClosedError, InvalidDescriptorError, NotSupportedError
from transfer_engine.segment import Segment, describe_memory
from transfer_engine.transport import load_transport
from transfer_engine.transport.base import Completion, Immediate, Work

try:
    from tests.helpers.transport_contract import TransportContract
except ImportError as exc:  # the suite lands separately; skip, do not break collection
    _CONTRACT_MISSING: str | None = f"tests/helpers/transport_contract.py not importable: {exc}"

    class TransportContract:  # type: ignore[no-redef]
        transports: ClassVar[list[Any]] = []
else:
    _CONTRACT_MISSING = None


@pytest.mark.rdma
@pytest.mark.skipif(_CONTRACT_MISSING is not None, reason=str(_CONTRACT_MISSING))
class TestRdmaContract(TransportContract):
    transports: ClassVar[list[Any]] = ["rdma"]

    def transports_for(self, role: str) -> list[Any]:
        # Loopback pair: both engines in this process, side channel on 127.0.0.1.
        return [load_transport("rdma", host="127.0.0.1")]


class TestEmulatedRdmaContract(TransportContract):
    """The same suite over the emulated verbs provider: runs on every machine."""

    transports: ClassVar[list[Any]] = ["rdma"]

    def transports_for(self, role: str) -> list[Any]:
        return [load_transport("rdma", host="127.0.0.1", provider="emulated")]


def test_missing_pyverbs_or_device_says_what_is_missing() -> None:
    reason = rdma_skip_reason()
    if reason is None:
        pytest.skip("an RDMA device is present; this checks the message without one")
    with pytest.raises(NotSupportedError) as info:
        load_transport("rdma")
    text = str(info.value)
    assert info.value.transport == "rdma"
    assert "pyverbs" in text or "RDMA device" in text
    if "pyverbs" in text:
        assert "python3-pyverbs" in text  # how to get it


def test_unknown_device_name_is_not_supported() -> None:
    if rdma_skip_reason() is not None and "pyverbs not importable" in str(rdma_skip_reason()):
        with pytest.raises(NotSupportedError, match="pyverbs"):
            load_transport("rdma", devices="nope0")
        return
    with pytest.raises(NotSupportedError, match="RDMA device"):
        load_transport("rdma", devices="nope0")


# --- transport-level checks on hardware -----------------------------------------------

class _Host:
    """The engine side a transport needs, in-process (a real engine is not required to
    exercise the verbs path)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.host_id = "local"
        self.segments: dict[int, Segment] = {}
        self.immediates: list[tuple[str, Immediate]] = []
        self.got = threading.Condition()
        self.tickets = TicketBook(None, name)

    def admit_rail(self, *opening: Any) -> tuple[Ticket, bytes]:
        return self.tickets.admit(*opening)

    def local_ranges(self) -> np.ndarray:
        return np.empty((0, 3), dtype=np.uint64)

    def credential_for(self, peer: str) -> Credential:
        """What this host's handshake would hand ``peer``: a ticket for its rails."""
        return Credential.from_welcome(self.tickets.issue(peer), None, self.name, peer)

    def local_segment(self, segment_id: int, *, peer: str | None = None,
                      op: str | None = None) -> Segment:
        return self.segments[segment_id]

    def deliver_immediate(self, peer: str, imm: Immediate, origin: bytes = b"",
                          work: int | None = None, resent: bool = False) -> None:
        with self.got:
            self.immediates.append((peer, imm))
            self.got.notify_all()


class _Completions:
    def __init__(self) -> None:
        self.items: list[Completion] = []
        self.cond = threading.Condition()

    def __call__(self, completion: Completion) -> None:
        with self.cond:
            self.items.append(completion)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[Completion]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, timeout), self.items
            return list(self.items)


@pytest.fixture
def loopback() -> Any:
    hosts = _Host("a"), _Host("b")
    ta = load_transport("rdma", host="127.0.0.1")
    tb = load_transport("rdma", host="127.0.0.1")
    with ta, tb:
        ta.start(hosts[0])
        info = tb.start(hosts[1])
        yield ta, tb, hosts, info


def _segment(host: _Host, transport: Any, seg_id: int, data: np.ndarray) -> Segment:
    seg = Segment(seg_id, f"s{seg_id}", describe_memory(data))
    seg.keys["rdma"] = transport.register(seg)
    host.segments[seg_id] = seg
    return seg


@pytest.mark.rdma
def test_write_with_imm_and_notify_then_read(loopback: Any) -> None:
    ta, tb, (ha, hb), info = loopback
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    _segment(ha, ta, 1, src)
    _segment(hb, tb, 2, dst)
    done = _Completions()
    rails = [ta.connect("b", info, done, credential=hb.credential_for("a"))
             for _ in range(2)]
    half = 1 << 19
    rails[0].post(Work(1, Op.WRITE, [Extent(1, 0, half)], [Extent(2, 0, half)], half,
                       Immediate(7, 2)))
    rails[1].post(Work(2, Op.WRITE, [Extent(1, half, half)], [Extent(2, half, half)], half,
                       Immediate(7, 2, b"ready")))
    assert all(c.ok for c in done.wait(2))
    with hb.got:
        assert hb.got.wait_for(lambda: len(hb.immediates) == 2, 10)
    assert np.array_equal(src, dst)
    assert sorted(imm.notify or b"" for _, imm in hb.immediates) == [b"", b"ready"]
    assert {imm.transfer_id for _, imm in hb.immediates} == {7}
    back = np.zeros(4096, dtype=np.uint8)
    _segment(ha, ta, 3, back)
    rails[0].post(Work(3, Op.READ, [Extent(3, 0, 4096)], [Extent(2, 100, 4096)], 4096))
    assert done.wait(3)[-1].ok
    assert np.array_equal(back, dst[100:4196])


@pytest.mark.rdma
def test_deregistered_remote_segment_fails_precisely(loopback: Any) -> None:
    ta, tb, (ha, hb), info = loopback
    src = np.ones(8192, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    _segment(ha, ta, 1, src)
    seg = _segment(hb, tb, 2, dst)
    done = _Completions()
    rail = ta.connect("b", info, done, credential=hb.credential_for("a"))
    tb.deregister(seg)
    rail.post(Work(1, Op.WRITE, [Extent(1, 0, 8192)], [Extent(2, 0, 8192)], 8192))
    (completion,) = done.wait(1)
    assert isinstance(completion.error, InvalidDescriptorError)
    assert completion.error.peer == "b" and completion.error.transport == "rdma"


@pytest.mark.rdma
def test_closed_rail_refuses_work(loopback: Any) -> None:
    ta, _tb, (ha, hb), info = loopback
    rail = ta.connect("b", info, _Completions(), credential=hb.credential_for("a"))
    rail.close()
    rail.close()  # idempotent
    assert rail.closed
    with pytest.raises(ClosedError):
        rail.post(Work(1, Op.WRITE, [Extent(1, 0, 1)], [Extent(2, 0, 1)], 1))

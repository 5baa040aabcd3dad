"""Memory regions on the NICs nearest the memory, rails chosen by where the regions are,
and the route settings of queue pairs.

End-to-end cases run on the emulated verbs provider (no NIC here); each engine gets its
own topology, naming its two emulated NICs, so one host plays two differently wired
ones. The topology's preference for the location this host's memory reports (NUMA node
when the kernel tells, else plain ``cpu``) decides the nearest NIC.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.helpers.transport_contract import MiB, random_bytes
from transfer_engine import Blocks, Engine
from transfer_engine.errors import NotSupportedError
from transfer_engine.topology import Gpu, Nic, Topology, nearest_nics
from transfer_engine.transport.rdma import RdmaTransport
from transfer_engine.transport.rdma.placement import (
    RouteSettings,
    memory_location,
    memory_node,
    placement_of,
)

NICS = ("emu0", "emu1")


def _topology(where: str, nearest: str) -> Topology:
    nics = tuple(Nic(n, port_state="ACTIVE") for n in NICS)
    return Topology(nics, (), {where: ((nearest,), ())})


def _where(buf: np.ndarray) -> str:
    return memory_location(buf.ctypes.data, buf.nbytes, "cpu")


def _rdma(topo: Topology | None = None, **kw: Any) -> RdmaTransport:
    return RdmaTransport(provider="emulated", nic_topology=topo, **kw)


def _issued(transport: RdmaTransport) -> dict[str, int]:
    return {nic.name: nic.wrs_issued for nic in transport.emulated_nics()}


def _moved(a: Engine, b: Engine, src: np.ndarray, dst: np.ndarray, seg: Any,
           peer: Any) -> None:
    remote = peer.segment("dst")
    rng = np.random.default_rng(3)
    n = 256
    loffs, roffs = rng.permutation(n) * 16384, rng.permutation(n) * 16384
    a.write(peer, Blocks(seg, remote, loffs, roffs, 16384)).wait(30)
    for lo, ro in zip(loffs.tolist(), roffs.tolist(), strict=True):
        assert np.array_equal(dst[ro:ro + 16384], src[lo:lo + 16384])
    back = np.zeros_like(src)
    with a.register(back, name="back") as bseg:
        a.read(peer, Blocks(bseg, remote, loffs, roffs, 16384)).wait(30)
        for lo, ro in zip(loffs.tolist(), roffs.tolist(), strict=True):
            assert np.array_equal(back[lo:lo + 16384], dst[ro:ro + 16384])


def _pair(make_engine: Callable[..., Engine], ours: str, theirs: str) -> tuple[Any, ...]:
    """Engines a and b whose memory is nearest ``ours`` and ``theirs``, b's ``dst``
    segment reached from a's ``src``."""
    src, dst = random_bytes(8 * MiB, 1), random_bytes(8 * MiB, 2)
    ta, tb = _rdma(_topology(_where(src), ours)), _rdma(_topology(_where(dst), theirs))
    a = make_engine("a", transports=[ta])
    b = make_engine("b", transports=[tb])
    seg = a.register(src, name="src")
    b.register(dst, name="dst")
    return a, b, ta, src, dst, seg, a.connect(b.endpoint)


def test_nearest_nics_by_pcie_switch_then_numa_then_all() -> None:
    nics = (Nic("far", numa_node=1, pci_path="pci0000:80/0000:80:01.0/0000:81:00.0"),
            Nic("numa", numa_node=0, pci_path="pci0000:00/0000:00:02.0/0000:02:00.0"),
            Nic("switch", numa_node=0,
                pci_path="pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:04:00.0"))
    gpu = Gpu(0, "0000:05:00.0", 0,
              "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:05:00.0")
    topo = Topology(nics, (gpu,))
    names = ["far", "numa", "switch"]
    assert nearest_nics(topo, "cuda:0", names) == ["switch"]
    assert nearest_nics(topo, "cpu:0", names) == ["numa", "switch"]
    assert nearest_nics(topo, "cpu:1", names) == ["far"]
    assert nearest_nics(topo, "cpu", names) == names  # nothing known: every NIC
    assert nearest_nics(topo, "cpu:0", ["far", "other"]) == ["far", "other"]
    pinned = Topology(nics, (gpu,), {"cuda:0": (("far",), ())})
    assert nearest_nics(pinned, "cuda:0", names) == ["far"]  # a file's choice wins
    assert nearest_nics(pinned, "cuda:0", ["numa"]) == ["numa"]  # ...among the given


def test_segment_registered_on_its_nearest_nic_only_and_carried_there(
        make_engine: Callable[..., Engine]) -> None:
    a, b, ta, src, dst, seg, peer = _pair(make_engine, "emu1", "emu1")
    assert set(peer.segment("dst").keys["rdma"]["mrs"]) == {"emu1"}
    assert set(seg.keys["rdma"]["mrs"]) == {"emu1"}
    before = _issued(ta)
    _moved(a, b, src, dst, seg, peer)
    after = _issued(ta)
    assert after["emu0"] == before["emu0"]  # nothing on the far NIC
    assert after["emu1"] > before["emu1"]


def test_nearest_nics_that_do_not_pair_register_once_more_and_still_move(
        make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture) -> None:
    """Our memory is near emu0, the peer's near its emu1; rails pair emu0-emu0 and
    emu1-emu1, so our segment goes on emu1 as well, once, and the bytes are exact."""
    a, b, ta, src, dst, seg, peer = _pair(make_engine, "emu0", "emu1")
    assert ta._regions.devices_of(seg.id) == ["emu0"]
    with caplog.at_level(logging.INFO, logger="transfer_engine.transport.rdma.transport"):
        _moved(a, b, src, dst, seg, peer)
        _moved(a, b, src, dst, seg, peer)
    assert sorted(ta._regions.devices_of(seg.id)) == ["emu0", "emu1"]
    assert sum("registering ['src'] on emu1 too" in r.getMessage()
               for r in caplog.records) == 1


def test_placement_all_registers_everywhere(make_engine: Callable[..., Engine]) -> None:
    src = random_bytes(MiB, 1)
    t = _rdma(_topology(_where(src), "emu1"), placement="all")
    seg = make_engine("a", transports=[t]).register(src, name="src")
    assert set(seg.keys["rdma"]["mrs"]) == set(NICS)


def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotSupportedError, match="placement 'closest'"):
        placement_of("closest")
    monkeypatch.setenv("TE_RDMA_PLACEMENT", "all")
    assert placement_of(None) == "all"
    assert RouteSettings.resolve() == RouteSettings(None, 0, 0)
    assert RouteSettings.resolve(3, 106, 5) == RouteSettings(3, 106, 5)
    for kw in ({"traffic_class": 256}, {"service_level": 16}, {"gid_index": -1},
               {"traffic_class": True}):
        with pytest.raises(ValueError, match="must be an integer"):
            RouteSettings.resolve(**kw)
    monkeypatch.setenv("TE_RDMA_TRAFFIC_CLASS", "0x68")
    monkeypatch.setenv("TE_RDMA_SERVICE_LEVEL", "3")
    monkeypatch.setenv("TE_RDMA_GID_INDEX", "1")
    assert RouteSettings.resolve() == RouteSettings(1, 0x68, 3)
    assert RouteSettings.resolve(traffic_class=0).traffic_class == 0  # argument wins
    monkeypatch.setenv("TE_RDMA_SERVICE_LEVEL", "high")
    with pytest.raises(ValueError, match="TE_RDMA_SERVICE_LEVEL"):
        RouteSettings.resolve()
    with pytest.raises(ValueError, match="traffic_class"):
        _rdma(traffic_class=300)


def test_memory_node_never_faults_or_raises() -> None:
    touched = random_bytes(MiB, 4)
    assert memory_node(touched.ctypes.data, touched.nbytes) >= -1
    import mmap
    with mmap.mmap(-1, 4 * mmap.PAGESIZE) as fresh:  # never touched: no node yet
        addr = np.frombuffer(fresh, dtype=np.uint8).ctypes.data
        assert memory_node(addr, len(fresh)) == -1
    assert memory_node(0, 0) == -1
    assert memory_location(touched.ctypes.data, touched.nbytes, "cuda:1") == "cuda:1"

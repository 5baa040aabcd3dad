"""Device memory between shm peers by device IPC: no host bounce on either side.

No GPU here: the stand-in device (``tests/helpers/standin_device.py``), whose memory no
system call can reach, offers IPC to engines of this process (CUDA refuses a handle in
the process that exported it; the stand-in maps its own). What is checked: the bytes,
that the path took device copies and no bounce, that the target still checks what it
checks for host memory, and the fallbacks.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tests.helpers.standin_device import StandInGpu
from tests.helpers.transport_contract import MiB, random_bytes
from transfer_engine import Blocks, Descriptor, Engine
from transfer_engine.errors import InvalidDescriptorError, ProtocolError
from transfer_engine.transport.shm_ipc import DeviceRange, PeerDevices, encode_devices
from transfer_engine.transport.stream import targets
from transfer_engine.transport.stream.wire import HEADER

BLOCK = 65536


@pytest.fixture
def gpu() -> Iterator[StandInGpu]:
    with StandInGpu().installed() as g:
        yield g


def _engines(make_engine: Callable[..., Engine]) -> tuple[Engine, Engine]:
    return make_engine("a", transports=["shm"]), make_engine("b", transports=["shm"])


def test_device_to_device_by_ipc_without_bounces(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    a, b = _engines(make_engine)
    src, there, back = gpu.alloc(4 * MiB), gpu.alloc(4 * MiB), gpu.alloc(4 * MiB)
    data = random_bytes(4 * MiB, 21)
    src.upload(data)
    seg, bseg = a.register(src, name="src"), a.register(back, name="back")
    b.register(there, name="there")
    peer = a.connect(b.endpoint)
    remote = peer.segment("there")
    rng = np.random.default_rng(1)
    loffs, roffs = rng.permutation(64) * BLOCK, rng.permutation(64) * BLOCK
    h = a.write(peer, Blocks(seg, remote, loffs, roffs, BLOCK), notify=b"ipc")
    h.wait(30)
    assert h.transport == "shm"
    got = there.download()
    for lo, ro in zip(loffs.tolist(), roffs.tolist(), strict=True):
        assert np.array_equal(got[ro:ro + BLOCK], data[lo:lo + BLOCK])
    assert [n.payload for n in b.notifications(timeout=5)] == [b"ipc"]
    a.read(peer, [(Descriptor(bseg, 0, 4 * MiB), Descriptor(remote, 0, 4 * MiB))]).wait(30)
    assert np.array_equal(back.download(), got)
    # both engines in this process: the target copies at the initiator's own addresses
    # (CUDA opens no handle in the process that exported it); mappings of another
    # process's handles: test_initiator_device_rows_are_checked_against_what_it_announced
    # here, tests/test_gpu.py across processes
    assert gpu.device_to_device > 0 and gpu.exported >= 1 and gpu.opened == 0
    assert a._staging_area is None  # no bounce on the initiator
    assert not [n for n in a.segments if n.startswith("te-staging-")]
    assert targets._held[0] == 0


def test_device_initiator_host_target_and_the_reverse(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    """Device memory of ours against host memory there: one device copy on the target
    (IPC). Host memory of ours against device memory there: the target's bounce."""
    a, b = _engines(make_engine)
    dev = gpu.alloc(2 * MiB)
    data = random_bytes(2 * MiB, 8)
    dev.upload(data)
    host_there = np.zeros(2 * MiB, dtype=np.uint8)
    dev_there = gpu.alloc(2 * MiB)
    ours_host = random_bytes(2 * MiB, 9)
    seg, hseg = a.register(dev, name="d"), a.register(ours_host, name="h")
    b.register(host_there, name="host")
    b.register(dev_there, name="dev")
    peer = a.connect(b.endpoint)
    a.write(peer, [(Descriptor(seg, 0, 2 * MiB),
                    Descriptor(peer.segment("host"), 0, 2 * MiB))]).wait(30)
    assert np.array_equal(host_there, data)
    a.write(peer, [(Descriptor(hseg, 0, MiB),
                    Descriptor(peer.segment("dev"), MiB, MiB))]).wait(30)
    assert np.array_equal(dev_there.download()[MiB:], ours_host[:MiB])
    a.read(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dev"), MiB, MiB))]
           ).wait(30)
    assert np.array_equal(dev.download()[:MiB], ours_host[:MiB])


def test_a_transfer_mixing_host_and_device_memory_is_staged(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    a, b = _engines(make_engine)
    dev, host = gpu.alloc(MiB), random_bytes(MiB, 3)
    data = random_bytes(MiB, 4)
    dev.upload(data)
    dst = np.zeros(2 * MiB, dtype=np.uint8)
    dseg, hseg = a.register(dev, name="d"), a.register(host, name="h")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    remote = peer.segment("dst")
    a.write(peer, [(Descriptor(dseg, 0, MiB), Descriptor(remote, 0, MiB)),
                   (Descriptor(hseg, 0, MiB), Descriptor(remote, MiB, MiB))]).wait(30)
    assert np.array_equal(dst[:MiB], data) and np.array_equal(dst[MiB:], host)
    assert a._staging_area is not None


def test_a_serving_process_target_takes_staged_device_memory(
        gpu: StandInGpu, make_engine: Callable[..., Engine]) -> None:
    """A target served from its serving process maps no IPC: our device memory goes
    through our bounce, and its host segment is written exactly."""
    a = make_engine("a", transports=["shm"])
    b = make_engine("b", transports=["shm"], serve="process")
    dev = gpu.alloc(MiB)
    data = random_bytes(MiB, 5)
    dev.upload(data)
    dst = np.zeros(MiB, dtype=np.uint8)
    seg = a.register(dev, name="d")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))]
            ).wait(30)
    assert np.array_equal(dst, data)
    assert a._staging_area is not None and gpu.opened == 0


def test_initiator_device_rows_are_checked_against_what_it_announced(
        gpu: StandInGpu) -> None:
    """The target's view of an initiator's announcement: rows outside it, or a READ
    into a read-only device segment, are not mapped; malformed ones are refused."""
    alloc = gpu.alloc(MiB)
    peer = PeerDevices("p")
    handle = gpu.export_ipc(alloc.address, MiB)
    peer.announce(encode_devices([])[HEADER.size:])  # the body, without its header
    rows = np.array([[alloc.address, 4096]], dtype=np.uint64)
    assert peer.translate(rows, writable=False) is None  # nothing announced yet
    entry = DeviceRange(alloc.address, MiB, False, "cuda:0", handle)
    peer.announce(encode_devices([entry])[HEADER.size:])
    got = peer.translate(rows, writable=False)
    assert got == [(alloc.address, 4096, "cuda:0")]
    assert peer.translate(rows, writable=True) is None  # read-only there
    past = np.array([[alloc.address + MiB - 10, 4096]], dtype=np.uint64)
    assert peer.translate(past, writable=False) is None
    for bad in (b"\x93\x01\x02", b"not msgpack \xc1", b"\x91\x95\x00\x01\xc3\xa5cuda:\x00"):
        with pytest.raises(ProtocolError, match="device announcement"):
            peer.announce(bad)
    peer.close()
    assert gpu.closed_maps == gpu.opened
    # an announcement larger than the memory its handle maps: refused, never copied past
    liar = PeerDevices("liar")
    liar.announce(encode_devices([DeviceRange(alloc.address, 64 * MiB, True, "cuda:0",
                                              handle)])[HEADER.size:])
    with pytest.raises(InvalidDescriptorError, match="maps only"):
        liar.translate(np.array([[alloc.address + 32 * MiB, 4096]], dtype=np.uint64),
                       writable=True)
    assert gpu.closed_maps == gpu.opened  # the refused mapping was closed


def test_other_transports_refuse_a_device_announcement(make_engine: Callable[..., Engine]
                                                      ) -> None:
    """A device announcement sent on a tcp rail by hand: the rail is dropped, the
    server keeps serving others."""
    b = make_engine("b", transports=["tcp"])
    a = make_engine("a", transports=["tcp"])
    dst = np.zeros(MiB, dtype=np.uint8)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    rail = peer.rails["tcp"][0]
    sock: socket.socket = rail._sock  # type: ignore[attr-defined]
    sock.sendall(encode_devices([]))
    src = random_bytes(MiB, 2)
    seg = a.register(src, name="src")
    for _ in range(3):  # later transfers go on, on rails that are still open
        try:
            a.write(peer, [(Descriptor(seg, 0, MiB),
                            Descriptor(peer.segment("dst"), 0, MiB))]).wait(10)
            break
        except Exception:  # noqa: BLE001 - the dropped rail's transfer
            continue
    assert np.array_equal(dst, src)

"""Work of a peer whose every NIC rail broke waits a bounded while for one to open again
(``tcp_nics.Parking``), rather than failing at once: real engines on loopback NIC rails,
broken by hand the way the stall watch breaks them (``rail.stall``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from transfer_engine import Descriptor, Engine
from transfer_engine.errors import ClosedError, PeerLostError, TransferError
from transfer_engine.topology import Nic, Topology
from transfer_engine.transport.tcp import TcpTransport
from transfer_engine.transport.tcp_nics import Parking


def _topology(address: str) -> Topology:
    return Topology(tuple(Nic(f"eth{i}", numa_node=i, port_state="ACTIVE",
                              link_rate_gbps=1, address=address) for i in range(2)))


SIZE = 64 << 20


def _pair(make_engine: Callable[..., Engine], b_nics: str = "127.0.0.1", **tcp: Any
          ) -> tuple[Engine, Engine, TcpTransport, TcpTransport]:
    """Engines a and b on NIC rails (a's NICs on 127.0.0.1, b's on ``b_nics``: its own
    listeners where that is not its main address)."""
    ta = TcpTransport(nics="auto", topology=_topology("127.0.0.1"), rails=1, **tcp)
    tb = TcpTransport(nics="auto", topology=_topology(b_nics), rails=1)
    a = make_engine("a", transports=[ta], timeout=20.0)
    b = make_engine("b", transports=[tb], timeout=20.0)
    return a, b, ta, tb


def _break_every_rail_mid_write(a: Engine, b: Engine, ta: TcpTransport,
                                gone: TcpTransport | None = None
                                ) -> tuple[Any, np.ndarray, np.ndarray]:
    """Posts a 64 MiB WRITE and stalls both NIC rails while it is in flight (tried
    again, bounded, when the write finished first); or, with ``gone`` (the peer's
    transport), closes the peer's NIC listeners and their connections then."""
    dst = np.zeros(SIZE, np.uint8)
    b.register(dst, name="dst")
    data = np.random.default_rng(7).integers(0, 256, SIZE, np.uint8)
    src = a.register(data)
    peer = a.connect(b.endpoint)
    for _ in range(8):
        rails = [r for r in peer.rails["tcp"] if not r.closed]
        handle = a.write(peer, [(Descriptor(src, 0, SIZE),
                                 Descriptor(peer.segment("dst"), 0, SIZE))])
        if gone is not None:
            assert gone._nic_servers
            for server in gone._nic_servers:
                server.close()
        for rail in rails if gone is None else ():
            rail.stall("broken by the test")
        if gone is not None or ta._parking.parked:
            return handle, data, dst
        handle.wait(20)  # it was done before the rails broke: again
        time.sleep(1.2)  # the rails reopen (nic_retry 0.2 s; rail ends its settling)
    pytest.skip("the write always finished before its rails could be broken")


def test_a_write_waits_for_a_nic_rail_to_reopen(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Both NIC rails break mid-write: the write is neither failed nor half-landed; the
    pairs open again at once and it completes there, byte-exact."""
    a, b, ta, _ = _pair(make_engine, nic_retry=0.2, nic_wait=10.0)
    handle, data, dst = _break_every_rail_mid_write(a, b, ta)
    t0 = time.monotonic()
    handle.wait(20)
    assert time.monotonic() - t0 < 5
    assert np.array_equal(dst, data)
    assert ta._parking.resumed >= 1 and not ta._parking.waiting("x")
    peer = a.connect(b.endpoint)  # the engine took the reopened rails
    dst[:] = 0
    a.write(peer, [(Descriptor(a.register(data), 0, SIZE),
                    Descriptor(peer.segment("dst"), 0, SIZE))]).wait(20)
    assert np.array_equal(dst, data)


def test_a_gone_peer_fails_the_waiting_write_at_once(make_engine) -> None:  # type: ignore[no-untyped-def]
    """The peer's NIC listeners close mid-write, and their connections with them: the
    write parks, the peer refuses the new connection, and the write fails with
    PeerLostError saying so, well before its wait is over."""
    a, b, ta, tb = _pair(make_engine, b_nics="127.0.0.2", nic_retry=0.2, nic_wait=30.0)
    handle, _, _ = _break_every_rail_mid_write(a, b, ta, gone=tb)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="refused a new connection") as err:
        handle.wait(20)
    assert time.monotonic() - t0 < 5
    assert "no NIC rail to the peer is left (eth0, eth1 failed)" in str(err.value)


def test_no_wait_fails_at_once(make_engine) -> None:  # type: ignore[no-untyped-def]
    """``nic_wait=0``: a write whose every NIC rail broke fails at once, as before."""
    a, b, ta, _ = _pair(make_engine, nic_retry=0.2, nic_wait=0)
    b.register(np.zeros(SIZE, np.uint8), name="dst")
    src = a.register(np.ones(SIZE, np.uint8))
    peer = a.connect(b.endpoint)
    for _ in range(8):
        rails = [r for r in peer.rails["tcp"] if not r.closed]
        handle = a.write(peer, [(Descriptor(src, 0, SIZE),
                                 Descriptor(peer.segment("dst"), 0, SIZE))])
        for rail in rails:
            rail.stall("broken by the test")
        try:
            handle.wait(20)
        except PeerLostError as exc:
            assert "no NIC rail to the peer is left" in str(exc)
            break
        time.sleep(1.2)  # finished before the rails broke: again, once they reopened
    else:
        pytest.skip("the write always finished before its rails could be broken")
    assert ta._parking.parked == 0


class _Rail:
    """Stands in for a rail: what Parking calls on it (post, settle)."""

    def __init__(self, refuse: bool = False) -> None:
        self.peer, self.nic = "p", "eth0"
        self.refuse = refuse
        self.posted: list[Any] = []
        self.settled: list[tuple[Any, TransferError]] = []
        self.done = threading.Event()

    def post(self, work: Any) -> None:
        if self.refuse:
            raise PeerLostError("broken again")
        self.posted.append(work)

    def settle(self, work: Any, error: TransferError) -> None:
        self.settled.append((work, error))
        self.done.set()


class _Work:
    resent = False


def test_parking_takes_expires_fails_and_closes() -> None:
    lost = PeerLostError("no NIC rail to the peer is left", peer="p", op="write")
    parking = Parking("t", wait=0.3)
    try:
        broken, fresh, refusing = _Rail(), _Rail(), _Rail(refuse=True)
        w1, w2 = _Work(), _Work()
        assert parking.park("k", broken, w1, lost) and parking.park("k", broken, w2, lost)
        parking.take("k", refusing)  # the new rail broke too: both keep waiting
        assert parking.waiting("k") and not refusing.posted
        parking.take("k", fresh)
        assert fresh.posted == [w1, w2] and w1.resent and w2.resent
        assert not parking.waiting("k") and parking.resumed == 2
        w3 = _Work()
        parking.park("k", broken, w3, lost)  # nothing reopens: fails at its deadline
        t0 = time.monotonic()
        assert broken.done.wait(5) and 0.2 < time.monotonic() - t0 < 3
        ((work, error),) = broken.settled
        assert work is w3 and isinstance(error, PeerLostError)
        assert "within 0.3s" in error.message and error.peer == "p" and error.op == "write"
        parking.park("k", broken, _Work(), lost)
        parking.fail("k", "the peer refused a new connection")
        assert "refused" in broken.settled[-1][1].message
    finally:
        parking.close(lambda e: e)
    assert not parking.park("k", _Rail(), _Work(), lost)  # closed: not held
    held = Parking("t", wait=60)
    rail = _Rail()
    held.park("k", rail, _Work(), lost)
    held.close(lambda e: TransferError("closed", **e.context()))
    assert rail.settled and rail.settled[0][1].message == "closed"
    assert not Parking("t", wait=0).park("k", rail, _Work(), lost)  # no wait: not held
    with pytest.raises(ValueError):
        Parking("t", wait=-1)


def test_closing_the_engine_ends_a_waiting_write(make_engine) -> None:  # type: ignore[no-untyped-def]
    """A write waiting for a NIC rail ends with a precise error when the engine closes,
    and the close returns promptly (no pair is reopened here: the reopener is stopped
    first, so the write would otherwise wait its whole minute)."""
    a, b, ta, _ = _pair(make_engine, nic_retry=0.2, nic_wait=60.0)
    ta._reopener.close()
    handle, _, _ = _break_every_rail_mid_write(a, b, ta)
    assert ta._parking.waiting(next(iter(ta._nic_groups)))
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 10
    with pytest.raises(ClosedError):
        handle.wait(5)

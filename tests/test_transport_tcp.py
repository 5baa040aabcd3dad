from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.helpers.faults import rail_socket, served_sockets
from tests.helpers.transport_contract import MiB, TransportContract, random_bytes
from transfer_engine import Blocks, Engine
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment
from transfer_engine.transport.tcp import (
    LOOPBACK_CONGESTION,
    TcpRail,
    TcpTransport,
    _cores,
    congestion_of,
)

needs_congestion = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"),
                                      reason="TCP_CONGESTION is Linux only")


class TestTcpContract(TransportContract):
    transports = ["tcp"]

    def transports_for(self, role: str) -> list[Any]:
        # every transfer cut over both rails whatever the host's cores, so that rails
        # finish out of order
        return [TcpTransport(rails=2, spread=2)]


class _FakeRail:
    """Only what :meth:`TcpTransport.spread` reads of a rail."""

    def __init__(self, loopback: bool) -> None:
        self.loopback = loopback


def test_spread_follows_the_cores() -> None:
    t = TcpTransport(rails=4)
    cores = _cores()
    remote = [_FakeRail(False) for _ in range(4)]
    local = [_FakeRail(True) for _ in range(4)]
    assert t.spread(remote) == max(1, min(4, cores))
    assert t.spread(local) == max(1, min(4, cores // 2))  # two copies per loopback rail
    assert TcpTransport(spread=3).spread(local) == 3
    assert TcpTransport(spread=8).spread(local) == 4  # never more than the rails
    with pytest.raises(ValueError):
        TcpTransport(spread=0)


def _sixteen_mib(make_engine: Callable[..., Engine], transport: TcpTransport
                 ) -> tuple[Engine, Peer, Segment, RemoteSegment, np.ndarray, np.ndarray]:
    """Engine a (over ``transport``) connected to engine b, with 16 MiB of random bytes
    registered on each side: (a, peer b, a's segment, b's segment, a's bytes, b's)."""
    a = make_engine("a", transports=[transport])
    b = make_engine("b", transports=["tcp"])
    src = random_bytes(16 * MiB, 1)
    dst = random_bytes(16 * MiB, 2)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    return a, peer, seg, peer.segment(b.register(dst).name), src, dst


@pytest.mark.parametrize("spread", [1, 2])
def test_a_transfer_uses_spread_rails(make_engine: Callable[..., Engine],
                                      spread: int) -> None:
    a, peer, seg, remote, src, dst = _sixteen_mib(make_engine, TcpTransport(rails=2,
                                                                           spread=spread))
    rails = peer.rails["tcp"]
    assert all(isinstance(r, TcpRail) and r.loopback for r in rails)
    offsets = np.arange(0, 16 * MiB, MiB)  # coalesced: one request per rail used
    a.write(peer, Blocks(seg, remote, offsets, offsets, MiB)).wait(30)
    assert np.array_equal(src, dst)
    assert sum(r.bytes_sent > 0 for r in rails) == spread
    assert sum(r.bytes_sent for r in rails) >= 16 * MiB


def _server_congestion(engine: Engine) -> list[str | None]:
    """The congestion control of each accepted end of the rails."""
    return sorted(congestion_of(sock) for sock in served_sockets(engine.transports["tcp"]))


@needs_congestion
def test_loopback_rails_use_a_loss_based_congestion_control(
        make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    src = random_bytes(8 * MiB, 1)
    dst = random_bytes(8 * MiB, 2)
    peer = a.connect(b.endpoint)
    rails = peer.rails["tcp"]
    chosen = {rail.congestion for rail in rails}
    assert len(chosen) == 1 and chosen <= set(LOOPBACK_CONGESTION)
    assert all(congestion_of(rail_socket(rail)) == rail.congestion for rail in rails)
    assert _server_congestion(b) == [rail.congestion for rail in rails]
    seg, remote = a.register(src), peer.segment(b.register(dst).name)
    offsets = np.arange(0, 8 * MiB, 64 << 10)
    a.write(peer, Blocks(seg, remote, offsets, offsets[::-1].copy(), 64 << 10)).wait(30)
    assert np.array_equal(src.reshape(-1, 64 << 10), dst.reshape(-1, 64 << 10)[::-1])


@needs_congestion
def test_congestion_none_keeps_the_hosts_default(make_engine: Callable[..., Engine]) -> None:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        default = f.read().strip()
    a = make_engine("a", transports=[TcpTransport(congestion=None)])
    b = make_engine("b", transports=[TcpTransport(congestion=None)])
    peer = a.connect(b.endpoint)
    assert {rail.congestion for rail in peer.rails["tcp"]} == {default}
    assert set(_server_congestion(b)) == {default}


@needs_congestion
def test_a_congestion_control_the_host_refuses_is_named() -> None:
    with pytest.raises(ValueError, match="'no-such-cc' refused by this host"):
        TcpTransport(congestion="no-such-cc")


def test_concurrent_transfers_keep_to_the_active_rails(make_engine: Callable[..., Engine]
                                                       ) -> None:
    """With one active rail (a 2-core host on loopback, or ``spread=1``) concurrent
    transfers queue on it and the other rail stays idle; every byte still lands."""
    assert TcpTransport(rails=3, spread=1).active([_FakeRail(True)] * 3) == 1
    assert TcpTransport(rails=3, spread=2).active([_FakeRail(True)] * 3) == 2
    a, peer, seg, remote, src, dst = _sixteen_mib(make_engine,
                                                  TcpTransport(rails=2, spread=1))
    handles = [a.write(peer, Blocks(seg, remote, [k * 4 * MiB], [k * 4 * MiB], 4 * MiB))
               for k in range(4)]
    for handle in handles:
        handle.wait(30)
    assert np.array_equal(src, dst)
    rails = peer.rails["tcp"]
    assert rails[0].bytes_sent == 16 * MiB and rails[1].bytes_sent == 0

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.transport_contract import MiB, TransportContract, random_bytes
from transfer_engine import Blocks, Engine
from transfer_engine.transport.tcp import TcpRail, TcpTransport, _cores


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


@pytest.mark.parametrize("spread", [1, 2])
def test_a_transfer_uses_spread_rails(make_engine: Callable[..., Engine],
                                      spread: int) -> None:
    a = make_engine("a", transports=[TcpTransport(rails=2, spread=spread)])
    b = make_engine("b", transports=["tcp"])
    src = random_bytes(16 * MiB, 1)
    dst = random_bytes(16 * MiB, 2)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    remote = peer.segment(b.register(dst).name)
    rails = peer.rails["tcp"]
    assert all(isinstance(r, TcpRail) and r.loopback for r in rails)
    offsets = np.arange(0, 16 * MiB, MiB)  # four 4 MiB requests after coalescing
    a.write(peer, Blocks(seg, remote, offsets, offsets, MiB)).wait(30)
    assert np.array_equal(src, dst)
    assert sum(r.bytes_sent > 0 for r in rails) == spread
    assert sum(r.bytes_sent for r in rails) >= 16 * MiB

"""Transport negotiation and per-peer health (pure logic, fake clock)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.helpers.clock import FakeClock as Clock
from transfer_engine import Descriptor
from transfer_engine.health import PeerHealth, TransportState, negotiate


def meta(host: str, *names: str, fabric: str = "f1") -> dict[str, object]:
    transports: dict[str, object] = {}
    for n in names:
        if n == "shm":
            transports[n] = {"host_id": host}
        elif n == "rdma":
            transports[n] = {"devices": [{"name": "mlx5_0", "fabric": fabric}]}
        else:
            transports[n] = {"port": 1}
    return {"host_id": host, "transports": transports}


def test_negotiate_same_host_rdma_fabric_tcp() -> None:
    assert negotiate(meta("h1", "tcp", "shm", "rdma"), meta("h1", "shm", "rdma", "tcp")) == [
        "shm", "rdma", "tcp"]
    assert negotiate(meta("h1", "shm", "rdma", "tcp"), meta("h2", "shm", "rdma", "tcp")) == [
        "rdma", "tcp"]
    assert negotiate(meta("h1", "shm", "rdma", "tcp"),
                     meta("h2", "shm", "rdma", "tcp", fabric="f2")) == ["tcp"]
    assert negotiate(meta("h1", "rdma", "tcp"), meta("h2", "tcp")) == ["tcp"]
    assert negotiate(meta("h1", "shm", "tcp"), meta("h1", "shm", "tcp"),
                     available=["tcp"]) == ["tcp"]
    assert negotiate(meta("h1", "tcp"), meta("h2", "shm")) == []


def test_latency_ewma_and_counts() -> None:
    h = PeerHealth(["shm", "tcp"], alpha=0.5)
    h.record_success("tcp", 0.010)
    h.record_success("tcp", 0.020)
    assert h["tcp"].latency == pytest.approx(0.015)
    h.record_failure("tcp")
    assert (h["tcp"].errors, h["tcp"].consecutive, h["tcp"].successes) == (1, 1, 2)
    h.record_success("tcp")
    assert h["tcp"].consecutive == 0


def test_demotion_after_consecutive_failures_and_reprobe_with_backoff() -> None:
    clock = Clock(0.0)
    h = PeerHealth(["shm", "tcp"], demote_after=3, reprobe_after=5, clock=clock)
    assert not h.record_failure("shm") and not h.record_failure("shm")
    assert h.order() == ["shm", "tcp"]
    assert h.record_failure("shm")  # third in a row
    assert h.order() == ["tcp", "shm"] and h["shm"].state is TransportState.DEMOTED
    clock.now = 4.9
    assert h.due() == []
    clock.now = 5.0
    assert h.due() == ["shm"] and h["shm"].state is TransportState.PROBING
    assert h.order() == ["shm", "tcp"]  # the probe goes first
    assert h.record_failure("shm")  # failed probe: demoted for twice as long
    assert h["shm"].reprobe_at == pytest.approx(15.0)
    clock.now = 15.0
    assert h.due() == ["shm"]
    h.record_success("shm", 0.001)  # probe worked: restored
    assert h["shm"].state is TransportState.HEALTHY and h.order() == ["shm", "tcp"]
    assert h["shm"].demotions == 2


def test_forced_demotion_and_backoff_cap() -> None:
    clock = Clock(0.0)
    h = PeerHealth(["rdma", "tcp"], reprobe_after=100, max_reprobe=150, clock=clock)
    assert h.record_failure("rdma", force=True)
    for _ in range(3):
        clock.now = h["rdma"].reprobe_at
        assert h.due() == ["rdma"]
        h.record_failure("rdma")
    assert h["rdma"].backoff == 150
    assert h.snapshot()["rdma"]["state"] == "demoted"
    with pytest.raises(ValueError):
        PeerHealth([], demote_after=0)


def test_engine_feeds_peer_health_from_finished_transfers(make_engine: Any) -> None:
    """Real engines over loopback TCP: each completed transfer is one success with its
    latency."""
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    seg = a.register(src)
    pairs = [(Descriptor(seg, 0, src.nbytes), Descriptor(peer.segment("dst"), 0, src.nbytes))]
    for _ in range(3):
        a.write(peer, pairs).wait(10)
    assert np.array_equal(src, dst)
    tcp = peer.health["tcp"]
    assert tcp.successes == 3 and tcp.errors == 0
    assert tcp.latency is not None and 0 < tcp.latency < 10

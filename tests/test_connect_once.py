"""One connection per peer, whoever asks: concurrent first contact, a connect while a
transfer is in flight, and the same engine reached by two addresses."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tests.helpers.transport_contract import random_bytes
from transfer_engine import Descriptor, Engine

MiB = 1 << 20


def test_concurrent_first_contact_shares_one_handshake(make_engine: Callable[..., Engine]
                                                       ) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    dst = np.zeros(10 * MiB, dtype=np.uint8)
    b.register(dst, name="dst")
    src = random_bytes(10 * MiB, 3)
    seg = a.register(src)
    peers: list[object] = []
    errors: list[BaseException] = []

    def push(i: int) -> None:
        try:
            peer = a.connect(b.endpoint)
            peers.append(peer)
            a.write(peer, [(Descriptor(seg, i * MiB, MiB),
                            Descriptor(peer.segment("dst"), i * MiB, MiB))]).wait(30)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len({id(p) for p in peers}) == 1
    assert np.array_equal(dst, src)


def test_a_second_connect_does_not_fail_a_transfer_in_flight(
        make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    size = 128 * MiB
    dst = np.zeros(size, dtype=np.uint8)
    b.register(dst, name="dst")
    src = random_bytes(size, 4)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    handle = a.write(peer, [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0,
                                                                  size))])
    again = a.connect(b.endpoint)
    assert again is peer
    handle.wait(60)
    assert np.array_equal(dst, src)


def test_the_same_engine_by_another_address_is_one_peer(make_engine: Callable[..., Engine]
                                                        ) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    first = a.connect(b.endpoint)
    other = b.endpoint.replace("127.0.0.1", "localhost")
    assert a.connect(other) is first
    assert list(a.peers) == ["b"]


class _TcpFirst:
    """A traffic policy that sends everything over tcp and keeps what it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str, bool, int]] = []

    def order(self, transports: Any, local_meta: Any, peer_meta: Any) -> list[str]:
        given = list(transports)
        return sorted(given, key=lambda t: t != "tcp")

    def record(self, peer: str, transport: str, latency: float, ok: bool,
               nbytes: int = 0) -> None:
        self.heard.append((peer, transport, ok, nbytes))


def test_a_traffic_policy_steers_each_transfer(make_engine: Callable[..., Engine]) -> None:
    policy = _TcpFirst()
    a = make_engine("a", transports=["shm", "tcp"], traffic=policy)
    b = make_engine("b", transports=["shm", "tcp"])
    b.register(np.zeros(MiB, dtype=np.uint8), name="dst")
    src = random_bytes(MiB, 5)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    assert peer.order[0] == "shm"  # health order: same host
    h = a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))])
    h.wait(10)
    assert h.transport == "tcp"
    assert policy.heard == [("b", "tcp", True, MiB)]


def test_the_scheduler_policy_keeps_one_host_on_shm(make_engine: Callable[..., Engine]
                                                    ) -> None:
    from scheduler.policy import TrafficPolicy

    a = make_engine("a", transports=["shm", "tcp"], traffic=TrafficPolicy(), zone="z1")
    b = make_engine("b", transports=["shm", "tcp"], zone="z2")
    b.register(np.zeros(MiB, dtype=np.uint8), name="dst")
    seg = a.register(random_bytes(MiB, 6))
    peer = a.connect(b.endpoint)
    assert peer.meta["zone"] == "z2"
    h = a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(peer.segment("dst"), 0, MiB))])
    h.wait(10)
    assert h.transport == "shm"

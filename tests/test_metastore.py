"""The MetadataStore contract, for the in-memory store and the ZeroMQ registry, and the
engine driven by membership events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from transfer_engine import Descriptor, Engine, PeerLostError, UnknownPeerError
from transfer_engine.control.client import RegistryStore
from transfer_engine.control.metastore import (
    EventKind,
    MemberEvent,
    MemberRecord,
    MemoryStore,
    MetadataStore,
)
from transfer_engine.control.registry import Registry
from transfer_engine.errors import ProtocolError


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture(params=["memory", "registry"])
def stores(request: pytest.FixtureRequest) -> Iterator[Callable[[], MetadataStore]]:
    """Makes stores that share one membership."""
    made: list[MetadataStore] = []
    if request.param == "memory":
        shared = MemoryStore()
        yield lambda: shared
        return
    with Registry(interval=0.1) as reg:
        assert reg.endpoint is not None
        endpoint = reg.endpoint

        def make() -> MetadataStore:
            store = RegistryStore(endpoint, timeout=2)
            made.append(store)
            return store
        yield make
        for s in made:
            s.close()


def test_store_contract(stores: Callable[[], MetadataStore]) -> None:
    s1, s2 = stores(), stores()
    seen: list[MemberEvent] = []
    lock = threading.Lock()

    def cb(event: MemberEvent) -> None:
        with lock:
            seen.append(event)
    sub = s2.watch(cb)
    s1.put(MemberRecord("p0", "i0", role="prefill", pod="pod-a"))
    s2.put(MemberRecord("d0", "i1", role="decode"))
    assert s2.get("p0").pod == "pod-a"
    assert [r.name for r in s1.list()] == ["d0", "p0"]
    assert [r.name for r in s1.list("decode")] == ["d0"]
    with pytest.raises(UnknownPeerError):
        s1.get("zz")
    s1.put(MemberRecord("p0", "i0", role="prefill", pod="pod-b"))  # update
    wait_for(lambda: any(e.kind is EventKind.UPDATE for e in seen))
    s1.delete("p0")
    wait_for(lambda: any(e.kind is EventKind.LEAVE and e.name == "p0" for e in seen))
    with lock:
        kinds = [(e.kind, e.name) for e in seen]
    assert kinds[:1] == [(EventKind.JOIN, "p0")] or (EventKind.JOIN, "p0") in kinds
    assert (EventKind.JOIN, "d0") in kinds
    sub.close()
    s2.delete("d0")


def test_memory_store_lease_expiry_with_fake_clock() -> None:
    now = [0.0]
    store = MemoryStore(ttl=3, clock=lambda: now[0])
    events: list[MemberEvent] = []
    store.watch(events.append)
    store.put(MemberRecord("a", "1"))
    now[0] = 10
    assert store.sweep() == []  # a live holder keeps its lease
    store.silence("a")
    now[0] = 12
    assert store.sweep() == []
    now[0] = 13.5
    assert store.sweep() == ["a"]
    assert [e.kind for e in events] == [EventKind.JOIN, EventKind.EXPIRE]


def test_record_validation() -> None:
    with pytest.raises(ProtocolError, match="role"):
        MemberRecord.from_wire({"name": "a", "incarnation": "i", "role": "king"})
    with pytest.raises(ProtocolError, match="name"):
        MemberRecord.from_wire({"name": "", "incarnation": "i"})
    with pytest.raises(ProtocolError, match="transports"):
        MemberRecord.from_wire({"name": "a", "incarnation": "i", "transports": []})
    rec = MemberRecord("a", "i", "store", nics=["mlx5_0"])
    assert MemberRecord.from_message(rec.to_message()) == rec


def test_engine_fails_in_flight_transfers_when_its_peer_expires(
        make_engine: Callable[..., Engine]) -> None:
    """Same path as the registry's expiry, driven through the in-memory store."""
    now = [0.0]
    store = MemoryStore(ttl=1, clock=lambda: now[0])
    a = make_engine("a", transports=["tcp"], registry=store)
    b = make_engine("b", transports=["tcp"], registry=store)
    size = 32 << 20
    b.register(np.zeros(size, dtype=np.uint8), name="dst")
    assert [r.name for r in a.members()] == ["a", "b"]
    peer = a.connect("b")
    seg = a.register(np.ones(size, dtype=np.uint8))
    pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
    handles = [a.write(peer, pairs) for _ in range(4)]
    store.silence("b")
    now[0] = 2
    store.sweep()  # -> EXPIRE -> a.peer_lost("b")
    failed = 0
    for h in handles:
        try:
            h.wait(5)
        except PeerLostError as exc:
            failed += 1
            assert "expire" in str(exc)
    assert failed >= 1 and a.stats["peers_lost"] == 1
    with pytest.raises(PeerLostError, match="peer lost"):
        a.write(peer, pairs)
    assert a.peer_lost("nobody") == 0

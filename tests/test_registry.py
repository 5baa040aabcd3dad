"""The membership registry over real ZeroMQ on loopback, members in separate processes:
join, leave, expiry after missed heartbeats, registry restart, events seen by all."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from bench.fleet import Proc, free_port, member, registry_process
from transfer_engine import Descriptor, Engine, PeerLostError, UnknownPeerError
from transfer_engine.control.client import RegistryClient
from transfer_engine.control.metastore import EventKind, MemberEvent, MemberRecord
from transfer_engine.control.registry import Registry
from transfer_engine.errors import ConnectError

MiB = 1 << 20


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry(interval=0.1, max_missed=3) as reg:
        yield reg


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    out: list[Proc] = []
    yield out
    for p in out:
        p.stop()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Recorder:
    def __init__(self) -> None:
        self.events: list[MemberEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: MemberEvent) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self, name: str) -> list[EventKind]:
        with self._lock:
            return [e.kind for e in self.events if e.name == name]


def test_join_leave_events_seen_by_every_member(registry: Registry, procs: list[Proc]
                                                ) -> None:
    assert registry.endpoint is not None
    names = ["m0", "m1", "m2"]
    for n in names:
        procs.append(member(n, registry.endpoint, role="decode" if n != "m0" else "prefill"))
    for p in procs:
        p.expect("READY")
    for p in procs:  # every member sees every join (its own included)
        for n in names:
            p.expect(f"EVENT join {n}")
    with RegistryClient(registry.endpoint, name="observer") as client:
        assert [r.name for r in client.list()] == names
        assert [r.name for r in client.list("prefill")] == ["m0"]
        rec = client.lookup("m1")
        assert rec.role == "decode" and rec.control.startswith("tcp://")
        assert [s["name"] for s in rec.segments] == ["dst"]
        with pytest.raises(UnknownPeerError):
            client.lookup("nobody")
    procs[2].stop()  # closes its engine: an explicit leave
    for p in procs[:2]:
        p.expect("EVENT leave m2", timeout=5)
    assert [r.name for r in registry.members] == ["m0", "m1"]
    assert registry.stats["expires"] == 0


def test_engine_resolves_names_and_fails_transfers_of_an_expired_peer(
        procs: list[Proc], make_engine: Callable[..., Engine]) -> None:
    """A hung peer (SIGSTOP: its sockets stay open, nothing fails by itself) is expired
    after missed heartbeats and its in-flight transfers fail fast with PeerLostError.
    (Ten missed beats, not three: a loaded host delays a healthy member's beats by some
    hundreds of milliseconds, which must not expire it before it is stopped.)"""
    with Registry(interval=0.1, max_missed=10) as registry:
        _expired_peer_fails_transfers(registry, procs, make_engine)


def _expired_peer_fails_transfers(registry: Registry, procs: list[Proc],
                                  make_engine: Callable[..., Engine]) -> None:
    assert registry.endpoint is not None
    size = 16 * MiB
    victim = member("victim", registry.endpoint, size=size)
    procs.append(victim)
    victim.expect("READY")
    a = make_engine("a", transports=["tcp"], registry=registry.endpoint, role="prefill")
    rec = Recorder()
    assert a.membership is not None
    sub = a.membership.watch(rec)
    peer = a.connect("victim")  # a name: resolved through the registry
    assert peer.name == "victim"
    src = np.ones(size, dtype=np.uint8)
    seg = a.register(src)
    pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
    a.write(peer, pairs).wait(20)  # works while healthy
    victim.signal(signal.SIGSTOP)
    handles = [a.write(peer, pairs) for _ in range(8)]
    stopped = time.monotonic()
    for h in handles:
        with pytest.raises(PeerLostError) as info:
            h.wait(5)
        assert info.value.peer == "victim"
    elapsed = time.monotonic() - stopped
    assert elapsed < 0.1 * 10 + 1.5, elapsed  # 10 missed 100 ms heartbeats, plus slack
    wait_for(lambda: EventKind.EXPIRE in rec.kinds("victim"), timeout=2, what="expire")
    with pytest.raises(PeerLostError):
        a.write(peer, pairs)
    sub.close()


def test_registry_restart_loses_no_member_and_no_transfer(
        procs: list[Proc], make_engine: Callable[..., Engine]) -> None:
    port = free_port()
    reg = registry_process(port)
    procs.append(reg)
    address = reg.expect("REGISTRY").split()[1]
    b = member("b", address, size=4 * MiB)
    procs.append(b)
    b.expect("READY")
    a = make_engine("a", transports=["tcp"], registry=address)
    rec = Recorder()
    assert a.membership is not None
    sub = a.membership.watch(rec)
    wait_for(lambda: EventKind.JOIN in rec.kinds("b"), what="b's join")
    peer = a.connect("b")
    src = np.arange(4 * MiB, dtype=np.uint8)
    seg = a.register(src)
    pairs = [(Descriptor(seg, 0, 4 * MiB), Descriptor(peer.segment("dst"), 0, 4 * MiB))]
    stop = threading.Event()
    results: list[BaseException | None] = []

    def pump() -> None:
        while not stop.is_set():
            try:
                a.write(peer, pairs, notify=b"x").wait(10)
                results.append(None)
            except BaseException as exc:  # noqa: BLE001 - collected for the assert
                results.append(exc)

    t = threading.Thread(target=pump, name="pump")
    t.start()
    try:
        time.sleep(0.3)
        reg.signal(signal.SIGKILL)
        reg.stop()
        time.sleep(0.3)  # members notice: heartbeats go unanswered
        reg2 = registry_process(port)
        procs.append(reg2)
        reg2.expect("REGISTRY")
        with RegistryClient(address, name="observer") as obs:
            wait_for(lambda: [r.name for r in obs.list()] == ["a", "b"], timeout=10,
                     what="membership rebuilt")
        time.sleep(0.6)  # past the restarted registry's recovery window (resync)
    finally:
        stop.set()
        t.join(20)
    assert results and all(r is None for r in results), [r for r in results if r][:3]
    assert a.stats["peers_lost"] == 0
    # no leave invented by the restart (an UPDATE may carry b's segment, published
    # asynchronously after its join)
    kinds = rec.kinds("b")
    assert kinds.count(EventKind.JOIN) == 1 and set(kinds) <= {EventKind.JOIN,
                                                              EventKind.UPDATE}, kinds
    assert a.peer("b").lost is None
    sub.close()


def test_name_held_by_a_live_member_is_refused(registry: Registry) -> None:
    assert registry.endpoint is not None
    with RegistryClient(registry.endpoint, name="x1") as c1, \
            RegistryClient(registry.endpoint, name="x2") as c2:
        c1.register(MemberRecord("x", "inc-1"))
        with pytest.raises(ConnectError, match="held by a live member"):
            c2.register(MemberRecord("x", "inc-2"))
        c1.leave()
        c2.register(MemberRecord("x", "inc-2"))  # released by the leave
        c2.leave()


def test_peer_to_peer_mode_without_registry(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    assert a.membership is None and a.members() == []
    assert a.connect(b.endpoint).name == "b"
    with pytest.raises(UnknownPeerError):
        a.connect("b")  # a name needs a registry

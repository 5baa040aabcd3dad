"""EtcdStore against a real etcd started by the test: the MetadataStore contract, leases
and watches, and engines that find each other through it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.etcd_server import EtcdCluster, etcd_cluster, etcd_server, etcd_skip_reason
from tests.helpers.faults import revoke_etcd_lease
from transfer_engine import Descriptor, Engine, UnknownPeerError
from transfer_engine.control.etcd_client import parse_etcd_address
from transfer_engine.control.etcd_store import EtcdStore
from transfer_engine.control.metastore import EventKind, MemberEvent, MemberRecord
from transfer_engine.errors import ConnectError


def wait_for(cond: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    with etcd_server(tmp_path_factory.mktemp("etcd")) as address:
        yield address


@pytest.fixture
def make_store(etcd: str, request: pytest.FixtureRequest
               ) -> Iterator[Callable[..., EtcdStore]]:
    """Stores on a prefix of this test's own, all closed afterwards."""
    made: list[EtcdStore] = []
    prefix = f"/t-{request.node.name}"

    def make(**kwargs: object) -> EtcdStore:
        store = EtcdStore(etcd + prefix, timeout=2, **kwargs)  # type: ignore[arg-type]
        made.append(store)
        return store
    try:
        yield make
    finally:
        for s in made:
            s.close()


class Events:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[MemberEvent] = []

    def __call__(self, event: MemberEvent) -> None:
        with self.lock:
            self.seen.append(event)

    def kinds(self) -> list[tuple[EventKind, str]]:
        with self.lock:
            return [(e.kind, e.name) for e in self.seen]


def test_contract(make_store: Callable[..., EtcdStore]) -> None:
    s1, s2 = make_store(name="s1"), make_store(name="s2")
    s1.put(MemberRecord("p0", "i0", role="prefill", pod="pod-a"))
    events = Events()
    sub = s2.watch(events)
    assert events.kinds() == [(EventKind.JOIN, "p0")]  # current members first
    s2.put(MemberRecord("d0", "i1", role="decode"))
    assert s2.get("p0").pod == "pod-a"
    assert [r.name for r in s1.list()] == ["d0", "p0"]
    assert [r.name for r in s1.list("decode")] == ["d0"]
    with pytest.raises(UnknownPeerError):
        s1.get("zz")
    s1.put(MemberRecord("p0", "i0", role="prefill", pod="pod-b"))
    s1.put(MemberRecord("p0", "i9", role="prefill"))  # a restart: new incarnation
    s1.delete("p0")
    s1.delete("p0")  # idempotent
    wait_for(lambda: (EventKind.LEAVE, "p0") in events.kinds())
    assert events.kinds() == [(EventKind.JOIN, "p0"), (EventKind.JOIN, "d0"),
                              (EventKind.UPDATE, "p0"), (EventKind.JOIN, "p0"),
                              (EventKind.LEAVE, "p0")]
    sub.close()
    s2.put(MemberRecord("d1", "i2"))
    time.sleep(0.2)
    assert (EventKind.JOIN, "d1") not in events.kinds()  # closed watch: no more calls
    assert [r.name for r in s1.list()] == ["d0", "d1"]


def test_lease_keeps_a_live_member_and_expires_a_silent_one(
        make_store: Callable[..., EtcdStore]) -> None:
    holder, watcher = make_store(name="h", ttl=2), make_store(name="w")
    events = Events()
    watcher.watch(events)
    holder.put(MemberRecord("live", "1"))
    time.sleep(3.0)  # past one ttl: renewed
    assert [r.name for r in watcher.list()] == ["live"]
    holder.close()  # stops renewing without leaving, as a dead process would
    wait_for(lambda: (EventKind.EXPIRE, "live") in events.kinds(), timeout=6)
    assert watcher.list() == []


def test_unreachable_etcd_is_a_connect_error() -> None:
    store = EtcdStore("etcd://127.0.0.1:9", timeout=1)  # discard port: nothing listens
    try:
        with pytest.raises(ConnectError, match="etcd"):
            store.list()
    finally:
        store.close()
    with pytest.raises(ValueError):
        EtcdStore("redis://127.0.0.1:1")


def test_engines_meet_through_etcd(etcd: str, make_engine: Callable[..., Engine],
                                   request: pytest.FixtureRequest) -> None:
    registry = f"{etcd}/t-{request.node.name}"
    decode = make_engine("decode-0", transports=["tcp"], registry=registry, role="decode",
                         zone="z1")
    prefill = make_engine("prefill-0", transports=["tcp"], registry=registry,
                          role="prefill")
    assert repr(decode.membership).startswith("<EtcdStore")
    dst = np.zeros(1 << 20, dtype=np.uint8)
    decode.register(dst, name="kv")
    wait_for(lambda: bool(prefill.members("decode"))
             and bool(prefill.members("decode")[0].segments))
    assert [m.zone for m in prefill.members("decode")] == ["z1"]
    peer = prefill.connect("decode-0")
    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    src = prefill.register(data)
    prefill.write(peer, [(Descriptor(src, 0, 1 << 20),
                          Descriptor(peer.segment("kv"), 0, 1 << 20))]).wait(10)
    assert np.array_equal(dst, data)


def test_membership_bench_runs_on_etcd(etcd: str, request: pytest.FixtureRequest) -> None:
    from bench.membership_bench import join_to_visible  # noqa: PLC0415

    prefix = f"{etcd}/t-{request.node.name}"
    out = join_to_visible(prefix, lambda name: EtcdStore(prefix, name=name), 5, hosts=2,
                          observers=2, hold=0.5)
    assert out["samples"] == 5 and 0 < out["p50_ms"] <= out["p99_ms"] < 5000
    assert out["expired"] == 0


def test_a_lost_lease_is_taken_again(make_store: Callable[..., EtcdStore]) -> None:
    """etcd forgot our lease (revoked here, as a restore from backup would): the
    keep-alive notices within ttl/3 and puts the record under a new lease."""
    holder, watcher = make_store(name="h", ttl=2), make_store(name="w")
    events = Events()
    watcher.watch(events)
    holder.put(MemberRecord("m", "1"))
    lease = holder.leases["m"]
    revoke_etcd_lease(holder, lease)
    wait_for(lambda: events.kinds()[-2:] == [(EventKind.EXPIRE, "m"), (EventKind.JOIN, "m")]
             and holder.leases.get("m", lease) != lease, timeout=5)
    assert [r.name for r in watcher.list()] == ["m"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three etcd members of one cluster on loopback; a test may kill or freeze one."""
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    with etcd_cluster(tmp_path, 3) as c:
        yield c


def test_address_lists_cluster_members() -> None:
    assert parse_etcd_address("etcd://10.0.0.1:1,10.0.0.2,[::1]:3/fleet") == (
        [("10.0.0.1", 1), ("10.0.0.2", 2379), ("::1", 3)], "/fleet")
    assert parse_etcd_address("http://h:5") == ([("h", 5)], "")
    for bad in ("etcd://", "etcd://h:x", "etcd://h:1,,h:2", "etcd://h:70000",
                "etcd://[::1", "redis://h:1"):
        with pytest.raises(ValueError):
            parse_etcd_address(bad)


def test_a_cluster_that_loses_its_leader_keeps_engines_joining_and_leaving(
        cluster: EtcdCluster, make_engine: Callable[..., Engine]) -> None:
    """Kill the leader (SIGKILL): engines already in stay in (their leases are renewed
    through another member), new ones join, one leaves, a transfer finds its peer, and
    a watcher sees exactly those events."""
    address = cluster.address + "/fleet"
    watcher = EtcdStore(address, name="w", ttl=2, timeout=3)
    events = Events()
    try:
        watcher.watch(events)
        old = [make_engine(f"old-{i}", transports=["tcp"], registry=address, timeout=5)
               for i in range(2)]
        wait_for(lambda: len(watcher.list()) == 2)
        cluster.kill(cluster.leader())
        new = make_engine("new-0", transports=["tcp"], registry=address, timeout=5)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        new.register(dst, name="kv")
        wait_for(lambda: any(m.segments for m in old[0].members() if m.name == "new-0"))
        old[1].close()
        wait_for(lambda: (EventKind.LEAVE, "old-1") in events.kinds())
        time.sleep(3.0)  # past a lease: the old members were kept alive meanwhile
        assert sorted(r.name for r in watcher.list()) == ["new-0", "old-0"]
        assert EventKind.EXPIRE not in [k for k, _ in events.kinds()]
        peer = old[0].connect("new-0")
        data = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8)
        src = old[0].register(data)
        old[0].write(peer, [(Descriptor(src, 0, 1 << 16),
                             Descriptor(peer.segment("kv"), 0, 1 << 16))]).wait(10)
        assert np.array_equal(dst, data)
    finally:
        watcher.close()


def test_a_watch_moves_off_a_frozen_member(cluster: EtcdCluster) -> None:
    """A member that freezes (SIGSTOP) keeps its watch streams open and silent; the
    watch notices within about a ttl and resumes on another member from its revision,
    so nothing put meanwhile is missed."""
    watcher = EtcdStore(cluster.address, name="w", ttl=2, timeout=2)
    others = ",".join(m.url for m in cluster.members[1:])
    writer = EtcdStore(f"etcd://{others}", name="p", ttl=2, timeout=5)
    events = Events()
    frozen = cluster.members[0].proc
    try:
        watcher.watch(events)
        writer.put(MemberRecord("before", "1"))
        wait_for(lambda: (EventKind.JOIN, "before") in events.kinds())
        frozen.send_signal(signal.SIGSTOP)
        writer.put(MemberRecord("during", "1"))
        wait_for(lambda: (EventKind.JOIN, "during") in events.kinds(), timeout=10)
        assert events.kinds() == [(EventKind.JOIN, "before"), (EventKind.JOIN, "during")]
        assert [r.name for r in watcher.list()] == ["before", "during"]
    finally:
        frozen.send_signal(signal.SIGCONT)
        watcher.close()
        writer.close()


def test_no_member_serving_is_a_connect_error_naming_each() -> None:
    store = EtcdStore("etcd://127.0.0.1:9,127.0.0.1:7", timeout=1)
    try:
        with pytest.raises(ConnectError, match=r"127\.0\.0\.1:9.*127\.0\.0\.1:7"):
            store.list()
    finally:
        store.close()

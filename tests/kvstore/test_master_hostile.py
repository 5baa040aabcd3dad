"""The kvstore master against careless and hostile input spoken by hand (a raw ZeroMQ
DEALER on loopback, no secret): a put too large for any pool, storage-node
registrations with out-of-range versions, too many pools, endless directories, and
nodes that restart again and again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kvstore import master as master_module
from kvstore import nodes as nodes_module
from kvstore.client import Client
from kvstore.master import Master
from kvstore.node import StorageNode
from kvstore.protocol import (
    ENTRY,
    KvBeat,
    KvCommit,
    KvNode,
    KvNodeWelcome,
    KvPut,
    KvStats,
    Status,
)
from transfer_engine.control.messages import ErrorReply, Message, decode, encode


class Raw:
    """A client that speaks the master's wire by hand."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, msg: Message, timeout: float = 5.0) -> Message:
        self.sock.send(encode(msg))
        assert self.sock.poll(int(timeout * 1000)), "no answer"
        return decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _keys(ints: list[int]) -> bytes:
    a = np.zeros((len(ints), 2), dtype="<u8")
    a[:, 0] = ints
    a[:, 1] = 7
    return a.tobytes()


@pytest.fixture
def cluster() -> Iterator[tuple[Master, Raw]]:
    # nodes are dropped after 2 s of silence, not 0.2: a loaded host's beats come late
    with Master(lease_s=0.2, put_timeout_s=0.2, grace_s=0.2, node_interval=0.05,
                node_max_missed=40) as m:
        node = StorageNode(m.endpoint, 16 << 20, name="n0")
        raw = Raw(m.endpoint)
        try:
            m.wait_nodes(1)
            yield m, raw
        finally:
            raw.close()
            node.close()


def test_a_put_too_large_for_any_pool_evicts_nothing(cluster: tuple[Master, Raw]) -> None:
    """A rejected 1 TiB value once set the room a missing get makes, so the next get of
    an absent key evicted the whole store."""
    m, raw = cluster
    with Client(m.endpoint) as c:
        ks = list(range(1, 101))
        c.batch_put(ks, [bytes([k % 256]) * 4096 for k in ks])
        rep = raw.ask(KvPut(keys=_keys([10**6]), lengths=np.array([1 << 40], "<i8").tobytes(),
                            checksums=np.zeros(1, "<u8").tobytes()))
        assert [Status(s) for s in np.frombuffer(rep.status, np.int8)] == [  # type: ignore[attr-defined]
            Status.TOO_LARGE]
        assert c.get(999_999) is None
        time.sleep(0.2)
        assert m.stats().get("evictions", 0) == 0
        assert c.batch_get(ks) == [bytes([k % 256]) * 4096 for k in ks]


def test_a_registration_with_a_huge_version_is_refused(cluster: tuple[Master, Raw]) -> None:
    m, raw = cluster
    entry = np.zeros(1, ENTRY)
    entry["key"] = (5, 7)
    entry["length"] = 64
    entry["version"] = 2**64 - 1
    rep = raw.ask(KvNode(name="bogus", incarnation="i", pools=[["s", 1 << 20, "dram"]],
                         entries=entry.tobytes(), part=0, last=True))
    assert isinstance(rep, ErrorReply) and "versions below 2**62" in rep.message
    assert "bogus" not in m._nodes
    with Client(m.endpoint) as c:
        for k in range(3):
            c.put(k, b"v%d" % k)
        assert [c.get(k) for k in range(3)] == [b"v0", b"v1", b"v2"]


def test_registrations_are_bounded(cluster: tuple[Master, Raw],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Too many pools, a directory past the limit, and a registration that never ends
    are each refused or dropped, keeping nothing."""
    m, raw = cluster
    pools_before = len(m._pools)
    rep = raw.ask(KvNode(name="many", incarnation="i", pools=[["s", 64, "dram"]] * 100_000,
                         part=0, last=True))
    assert isinstance(rep, ErrorReply) and "at most 64 pools" in rep.message
    monkeypatch.setattr(nodes_module, "MAX_DIRECTORY", 100)
    part = np.zeros(60, ENTRY).tobytes()
    assert isinstance(raw.ask(KvNode(name="endless", incarnation="i", entries=part, part=0,
                                     last=False)), KvNodeWelcome)
    rep = raw.ask(KvNode(name="endless", incarnation="i", entries=part, part=1, last=False))
    assert isinstance(rep, ErrorReply) and "at most 100 objects" in rep.message
    assert "endless" not in m._nodes
    monkeypatch.setattr(master_module, "REGISTER_S", 0.3)
    assert isinstance(raw.ask(KvNode(name="slow", incarnation="i", entries=part, part=0,
                                     last=False)), KvNodeWelcome)
    for _ in range(20):  # it keeps sending nothing: dropped once its time is up
        time.sleep(0.1)
        raw.ask(KvNode(name="slow-beats", incarnation="i", part=0, last=False))
        if "slow" not in m._nodes:
            break
    assert "slow" not in m._nodes
    assert len(m._pools) == pools_before


def test_registrations_that_lie_are_refused_and_leave_nothing(
        cluster: tuple[Master, Raw], monkeypatch: pytest.MonkeyPatch) -> None:
    """Names of a megabyte (they once made every client's stats() fail), pools that
    claim 2**63 bytes, a directory entry whose end overflows, and pools past the
    master's bound are each refused precisely; no pool is left half-registered, and
    the store goes on serving."""
    m, raw = cluster
    pools_before = len(m._pools)
    ok_pool = [["s", 1 << 20, "dram"]]
    cases = [
        (KvNode(name="n" * (1 << 20), incarnation="i", pools=ok_pool, part=0, last=True),
         "name is a string of at most 1024"),
        (KvNode(name="z", incarnation="i", zone="z" * 5000, pools=ok_pool, part=0,
                last=True), "zone is a string"),
        (KvNode(name="big", incarnation="i", pools=[["s", 1 << 63, "dram"]], part=0,
                last=True), "1 to 2**56 bytes"),
        (KvNode(name="long", incarnation="i", pools=[["s" * 5000, 1 << 20, "dram"]],
                part=0, last=True), "names of at most"),
    ]
    entry = np.zeros(1, ENTRY)
    entry["offset"], entry["length"], entry["pool"] = (1 << 63) - 64, 128, 1
    cases.append((KvNode(name="wraps", incarnation="i", entries=entry.tobytes(),
                         pools=ok_pool * 2, part=0, last=True), "leave the pool"))
    for msg, says in cases:
        rep = raw.ask(msg)
        assert isinstance(rep, ErrorReply) and says in rep.message, (says, rep)
        assert len(m._pools) == pools_before and msg.name not in m._nodes
    monkeypatch.setattr(nodes_module, "MAX_POOLS", pools_before + 3)
    rep = raw.ask(KvNode(name="fits", incarnation="i", pools=ok_pool * 3, part=0, last=True))
    assert isinstance(rep, KvNodeWelcome)
    rep = raw.ask(KvNode(name="over", incarnation="i", pools=ok_pool, part=0, last=True))
    assert isinstance(rep, ErrorReply) and "at most" in rep.message
    assert "over" not in m._nodes and len(m._pools) == pools_before + 3
    with Client(m.endpoint) as c:
        assert c.stats()
        c.put(2, b"still serving")
        assert c.get(2) == b"still serving"


def test_a_node_that_beats_but_serves_nothing_does_not_take_every_put(
        cluster: tuple[Master, Raw]) -> None:
    """A node that registers pools and heartbeats, but that no client can write to:
    once a client reports a write to it failed, new objects go to the nodes that
    work, so every put succeeds (each retry used to land on it again)."""
    m, raw = cluster
    stop = threading.Event()
    rep = raw.ask(KvNode(name="liar", incarnation="i", pools=[["nope", 1 << 30, "dram"]] * 8,
                         part=0, last=True))
    assert isinstance(rep, KvNodeWelcome)

    def beat() -> None:
        while not stop.wait(0.02):
            raw.sock.send(encode(KvBeat(name="liar", incarnation="i", epoch=m.epoch)))
            while raw.sock.poll(0):
                raw.sock.recv()

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        time.sleep(0.3)  # past the grace: the liar's pools are ready
        assert "liar" in m._nodes
        with Client(m.endpoint, timeout=5) as c:
            values = {k: np.random.default_rng(k).bytes(3000) for k in range(1, 21)}
            for key, value in values.items():
                c.put(key, value)
            for key, value in values.items():
                assert c.get(key) == value
    finally:
        stop.set()
        beating.join(5)


def test_restarting_nodes_reuse_pool_numbers(cluster: tuple[Master, Raw]) -> None:
    """A node that registers again and again (a restart each time) leaves the master's
    pool list as long as its live pools need, once the dead ones' time has passed."""
    m, raw = cluster
    with m._lock:  # each registration, silent, is dead before the next one (0.9 s on)
        m.node_max_missed = 4
    grown = []
    for i in range(8):
        rep = raw.ask(KvNode(name="restarts", incarnation=f"i{i}",
                             pools=[["s", 1 << 20, "dram"], ["t", 1 << 20, "dram"]],
                             part=0, last=True))
        assert isinstance(rep, KvNodeWelcome), rep
        grown.append(len(m._pools))
        time.sleep(0.9)  # past twice the grace (0.2 s) of the pools it just left
    assert grown[-1] <= grown[1], grown
    with Client(m.endpoint) as c:
        c.put(1, b"still here")
        assert c.get(1) == b"still here"


def test_put_ids_cannot_be_guessed(cluster: tuple[Master, Raw]) -> None:
    """A put is committed (or aborted) by its id alone: ids are random, so another
    client cannot publish a put whose bytes are not written yet, nor abort it."""
    m, raw = cluster
    with m._lock:  # the fixture's 0.2 s could pass during the guesses on a loaded host
        m.put_timeout_s = 30.0
    placed = [raw.ask(KvPut(keys=_keys([100 + i]), lengths=np.array([64], "<i8").tobytes(),
                            checksums=np.zeros(1, "<u8").tobytes())) for i in range(2)]
    ids = [p.put_id for p in placed]  # type: ignore[attr-defined]
    assert all(ids) and abs(ids[1] - ids[0]) > 1000
    for guess in range(1, 200):
        rep = raw.ask(KvCommit(put_id=guess, abort=True))
        assert isinstance(rep, ErrorReply) and "unknown put" in rep.message
    assert set(ids) <= set(m._puts)


def test_lease_ids_cannot_be_guessed(cluster: tuple[Master, Raw]) -> None:
    """A get's lease is released by its id alone, with the reader's next request: ids
    are random, so neither another client nor a client of a previous master (whose
    ids it still holds after a restart) can release a lease that keeps space from
    being reused under a reader."""
    m, raw = cluster
    with Client(m.endpoint) as c:
        c.put(5, b"leased bytes")
        assert c.get(5) == b"leased bytes"  # its lease is held until c's next request
        assert len(m._leases) == 1
        (lease,) = m._leases
        assert lease > 1 << 20
        raw.ask(KvStats(release=np.arange(1, 400, dtype="<u8").tobytes()))
        assert set(m._leases) == {lease}


def test_a_live_nodes_name_cannot_be_taken(cluster: tuple[Master, Raw]) -> None:
    """A registration or heartbeat under a live node's name from another connection is
    refused, and the node's objects stay where they are; a node that has gone silent
    can be replaced (a restart)."""
    m, raw = cluster
    with Client(m.endpoint) as c:
        c.put(5, b"v5")
        rep = raw.ask(KvNode(name="n0", incarnation="forged", pools=[["s", 64, "dram"]],
                             part=0, last=True))
        assert isinstance(rep, ErrorReply) and "held by a live node" in rep.message
        node = m._nodes["n0"]
        rep = raw.ask(KvBeat(name="n0", incarnation=node.incarnation, epoch=m.epoch))
        assert isinstance(rep, ErrorReply) and "another connection" in rep.message
        assert m._nodes["n0"] is node and c.get(5) == b"v5"
    for _ in range(20):  # as if it had died (it still beats: a beat may come between)
        node.last_seen -= 10
        rep = raw.ask(KvNode(name="n0", incarnation="restarted",
                             pools=[["s", 1 << 20, "dram"]], part=0, last=True))
        if isinstance(rep, KvNodeWelcome):
            break
    assert isinstance(rep, KvNodeWelcome), rep

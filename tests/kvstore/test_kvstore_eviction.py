"""The master's eviction order: least recently used, refreshed by every hit, the deepest
blocks of a chain before their prefix, never a leased or half-written object, never half
an object. The table directly (exact order), then a real master with real nodes moving
random bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import Client, key_rows
from kvstore.master import Master
from kvstore.node import StorageNode
from kvstore.objects import ObjectTable, State
from kvstore.protocol import KvCommit, KvGet, KvPlaced, KvPut, pack
from tests.helpers.faults import holding_lock, pending_put_rows, raw_link

BLOCK = 4096
SLOTS = 64  # blocks a one-node test pool holds


def _publish(t: ObjectTable, keys: list[int], length: int = 100) -> np.ndarray:
    rows = t.new_rows(len(keys))
    t.keys[rows] = key_rows(keys)
    t.length[rows] = length
    t.nrep[rows] = 1
    t.pool[rows, 0] = 0
    t.state[rows] = State.PENDING
    t.publish(rows)
    return rows


def _evicted(t: ObjectTable, nbytes: int) -> list[int]:
    rows = t.victims(nbytes)
    t.drop_rows(rows)  # what the master does with unleased victims
    return [int(k) for k in t.keys[rows, 0]]


def test_table_order_is_lru_deepest_first() -> None:
    t = ObjectTable()
    _publish(t, [1, 2, 3])  # one chain, one commit
    _publish(t, [10, 11, 12])
    _publish(t, [20])
    # oldest commit first, its deepest block first
    assert _evicted(t, 100) == [3]
    # a hit refreshes: the chain 10.. is now the newest; within one get the prefix ranks
    # above its tail, and a key that missed keeps its place in the chain
    t.lookup(key_rows([10, 99, 11]), touch=True)
    assert _evicted(t, 400) == [2, 1, 12, 20]
    assert _evicted(t, 1000) == [11, 10]
    assert len(t) == 0 and _evicted(t, 100) == []


def test_table_victims_of_some_pools_and_put_back() -> None:
    t = ObjectTable()
    _publish(t, [1, 2])
    disk = _publish(t, [3])
    t.pool[disk, 0] = 1  # on another pool (a disk)
    _publish(t, [4])
    dram = np.array([True, False])
    # the object on pool 1 is passed over, whatever its age
    rows = t.victims(200, pools=dram)
    assert [int(k) for k in t.keys[rows, 0]] == [2, 1]
    t.publish(rows, schedule=False)  # put back (a demotion): readable, same place
    assert (t.lookup(key_rows([1, 2])) >= 0).all()
    # the queue moved past the rows put back (moving: not picked again meanwhile)
    rows = t.victims(100, pools=dram)
    t.drop_rows(rows)
    assert [int(k) for k in t.keys[rows, 0]] == [4]
    assert _evicted(t, 1000) == [2, 1, 3]  # all pools: queued again, in their order
    assert len(t) == 0


def test_table_commit_after_get_ranks_below_that_prefix() -> None:
    t = ObjectTable()
    _publish(t, [1, 2])
    _publish(t, [50])
    t.lookup(key_rows([1, 2, 3, 4]), touch=True)  # a chain's prefix found, its tail not
    _publish(t, [3, 4])  # the client computed the tail and put it
    # the tail goes before the prefix it extends, though it was committed later
    assert _evicted(t, 500) == [50, 4, 3, 2, 1]
    # a put's if_absent lookup never ages a key a get just refreshed
    _publish(t, [5])
    _publish(t, [6])
    t.lookup(key_rows([5]), touch=True)
    t.lookup(key_rows([5]), touch=True, new_turn=False)
    assert _evicted(t, 200) == [6, 5]


def test_table_queue_skips_refreshed_leased_and_pending() -> None:
    t = ObjectTable()
    n = 3000  # more than one queue's worth (1/64 of the table)
    for k in range(n):
        _publish(t, [k])
    assert _evicted(t, 100) == [0]  # queue built
    t.lookup(key_rows([1, 2]), touch=True)  # queued rows refreshed: they rank last now
    row3 = int(t.lookup(key_rows([3]))[0])
    t.leases[row3] = 1  # a reader holds 3
    pending = t.new_rows(1)
    t.keys[pending] = key_rows([n])
    t.length[pending] = 100
    t.state[pending] = State.PENDING  # a put in progress: never in the index
    got = _evicted(t, 100 * (n - 2))
    assert got == list(range(4, n)) + [2, 1]  # in one get, 2 is deeper than 1
    assert len(t) == 1 and int(t.lookup(key_rows([3]))[0]) == row3
    assert t.state[pending[0]] == State.PENDING
    t.leases[row3] = 0
    assert _evicted(t, 100) == [3]


def test_table_memory_per_object() -> None:
    t = ObjectTable(initial=1 << 20)
    per_object = t.nbytes() / (1 << 20)
    assert per_object < 200, per_object


# -- a real master and nodes ---------------------------------------------------------


@pytest.fixture
def one_node() -> Iterator[Master]:
    """A master with one node of exactly ``SLOTS`` 4 KiB blocks; leases and puts last
    long enough that only the test decides when they end."""
    with Master(lease_s=60.0, put_timeout_s=60.0, node_interval=0.25) as master:
        node = StorageNode(master.endpoint, SLOTS * BLOCK, name="n0")
        try:
            master.wait_nodes(1)
            yield master
        finally:
            node.close()


def _present(master: Master, keys: list[int]) -> list[bool]:
    """Which keys the master holds, without refreshing them."""
    with holding_lock(master):
        return (master.table.lookup(key_rows(keys)) >= 0).tolist()


def _blocks(rng: np.random.Generator, n: int) -> list[bytes]:
    return [rng.bytes(BLOCK) for _ in range(n)]


def test_hits_refresh_recency(one_node: Master) -> None:
    master = one_node
    rng = np.random.default_rng(11)
    vals = dict(zip(range(SLOTS - 1), _blocks(rng, SLOTS - 1), strict=True))
    with Client(master.endpoint) as client:
        for k, v in vals.items():  # one commit each: 0 is the oldest
            client.put(k, v)
        assert master.stats().get("evictions", 0) == 0
        assert client.get(0) == vals[0]  # a get refreshes
        assert client.exists(1)  # and so does a query
        assert client.longest_prefix([2]) == 1
        client.put(100, rng.bytes(BLOCK))  # the last free block
        # no room: evicts the least recent, 3, and as much again for the next put, 4
        client.put(101, rng.bytes(BLOCK))
        assert _present(master, list(range(6))) == [True, True, True, False, False, True]
        assert master.stats()["evictions"] == 2
        got = client.batch_get(list(vals))
        for k, v in zip(vals, got, strict=True):
            assert v == (None if k in (3, 4) else vals[k])


def test_tails_go_before_their_prefix(one_node: Master) -> None:
    master = one_node
    rng = np.random.default_rng(12)
    chain = list(range(10))
    f1, f2 = list(range(100, 126)), list(range(200, 227))
    vals = dict(zip(chain[:4] + f1 + f2, _blocks(rng, 57), strict=True))
    with Client(master.endpoint) as client:
        client.batch_put(chain[:4], [vals[k] for k in chain[:4]])
        client.batch_put(f1, [vals[k] for k in f1])
        client.batch_put(f2, [vals[k] for k in f2])  # 57 of 64 blocks
        # a prefix-cache request: the first 4 blocks are stored, the rest computed and put
        got = client.batch_get(chain)
        assert got[:4] == [vals[k] for k in chain[:4]] and got[4:] == [None] * 6
        tail = _blocks(rng, 6)
        vals.update(zip(chain[4:], tail, strict=True))
        client.batch_put(chain[4:], tail, if_absent=True)  # 63 of 64
        # later requests use the other entries: the chain is the least recent now
        assert None not in client.batch_get(f1 + f2)
        # one block free: evicts 5, and 1 more (at most 1/1024 of the pool) for what follows
        client.batch_put(list(range(300, 306)), _blocks(rng, 6))
        # its tail went first, deepest first, though committed after its prefix was got
        assert _present(master, chain) == [True] * 4 + [False] * 6
        client.batch_put([306, 307], _blocks(rng, 2))  # 2 more: the deepest left
        assert _present(master, chain) == [True, True, False, False] + [False] * 6
        assert client.batch_get(chain[:2]) == [vals[0], vals[1]]
        assert None not in client.batch_get(f1 + f2)


def test_leased_and_in_flight_objects_are_never_evicted(one_node: Master) -> None:
    master = one_node
    rng = np.random.default_rng(13)
    held = rng.bytes(BLOCK)
    with Client(master.endpoint) as client:
        client.put(7, held)  # the oldest object
        client.batch_put(list(range(8, 8 + SLOTS - 3)), _blocks(rng, SLOTS - 3))
        with raw_link(client) as request:  # a reader's lease on 7, kept
            lease = request(KvGet(keys=key_rows([7]).tobytes()), 5.0)
            # a put allocated and not committed yet: its bytes are being written
            placed = request(KvPut(
                keys=key_rows([9999]).tobytes(), lengths=pack([BLOCK], "<i8"),
                checksums=pack([0], "<u8")), 5.0)
        assert isinstance(placed, KvPlaced) and placed.put_id
        t = master.table
        row7 = int(t.lookup(key_rows([7]))[0])
        where7 = (int(t.pool[row7, 0]), int(t.offset[row7, 0]))
        pend = int(pending_put_rows(master, placed.put_id)[0])
        where_pend = (int(t.pool[pend, 0]), int(t.offset[pend, 0]))
        for i in range(20):  # churn three times what the pool holds
            keys = list(range(1000 + 10 * i, 1010 + 10 * i))
            client.batch_put(keys, _blocks(rng, 10))
        with holding_lock(master):
            assert master.stats()["evictions"] >= 3 * SLOTS
            assert _present(master, [7]) == [True]
            assert int(t.lookup(key_rows([7]))[0]) == row7
            assert t.state[pend] == State.PENDING
            live = np.flatnonzero(t.state[: t.capacity] != State.FREE)
            used = set(zip(t.pool[live, 0].tolist(), t.offset[live, 0].tolist(),
                           strict=True))
            others = [(int(t.pool[r, 0]), int(t.offset[r, 0])) for r in live
                      if r not in (row7, pend)]
            assert where7 in used and where_pend in used
            assert where7 not in others and where_pend not in others
        with raw_link(client) as request:
            request(KvCommit(put_id=placed.put_id, abort=True,
                             release=pack([lease.lease_id], "<u8")), 5.0)
        assert client.get(7) == held


def test_nothing_half_evicted() -> None:
    """Three nodes, two replicas, chains of random length and random sizes through many
    times the pools: every object is whole or gone, byte for byte."""
    with Master(lease_s=5.0, put_timeout_s=10.0, node_interval=0.25) as master:
        nodes = [StorageNode(master.endpoint, 1 << 20, name=f"n{i}", zone=f"z{i}")
                 for i in range(3)]
        try:
            master.wait_nodes(3)
            rng = np.random.default_rng(14)
            written: dict[int, bytes] = {}
            with Client(master.endpoint, replicas=2) as client:
                for _ in range(60):
                    start = int(rng.integers(0, 400))
                    chain = list(range(start, start + int(rng.integers(1, 24))))
                    got = client.batch_get(chain)
                    n = 0
                    while n < len(chain) and got[n] is not None:
                        assert got[n] == written[chain[n]]
                        n += 1
                    if n == len(chain):
                        continue
                    vals = [rng.bytes(int(rng.integers(1, 16 << 10))) for _ in chain[n:]]
                    client.batch_put(chain[n:], vals)  # replaces what is past a gap
                    written.update(zip(chain[n:], vals, strict=True))
                assert master.stats()["evictions"] > 0
                keys = sorted(written)
                got = client.batch_get(keys)
                assert 0 < sum(v is not None for v in got) < len(keys)
                for k, v in zip(keys, got, strict=True):
                    assert v is None or v == written[k]
            with holding_lock(master):
                t = master.table
                live = np.flatnonzero(t.state[: t.capacity] == State.LIVE)
                assert (t.nrep[live] == 2).all()
                objects = len(t)
            time.sleep(0.5)  # the journal settles: the nodes hold exactly the objects
            assert sum(len(n.directory) for n in nodes) == 2 * objects
        finally:
            for node in nodes:
                node.close()


def test_a_miss_makes_room_for_the_put_that_follows(one_node: Master) -> None:
    master = one_node
    rng = np.random.default_rng(15)
    with Client(master.endpoint) as client:
        client.batch_put(list(range(SLOTS)), _blocks(rng, SLOTS))  # full
        assert master.stats().get("evictions", 0) == 0
        got = client.batch_get([0, 1, 1000, 1001])  # two blocks computed next
        assert got[2:] == [None, None] and master.stats()["evictions"] == 2
        # the deepest blocks of the oldest chain went, not the two just got
        assert _present(master, [0, 1, SLOTS - 2, SLOTS - 1]) == [True, True, False, False]
        deadline = time.monotonic() + 10  # the node acknowledges the frees
        while master.stats()["pools"][0]["free"] < 2 * BLOCK and time.monotonic() < deadline:
            time.sleep(0.01)
        new = _blocks(rng, 2)
        client.batch_put([1000, 1001], new)
        assert master.stats().get("puts_parked", 0) == 0  # the room was there
        assert client.batch_get([1000, 1001]) == new

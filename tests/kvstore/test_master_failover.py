"""Masters that stand by in etcd (``kvstore-master --etcd``): the leading master is killed
or frozen, a standby takes the lead, storage nodes and clients given the etcd address
follow it, and every value committed before is read back byte for byte. Real master
processes, a real etcd, real nodes and engines."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.etcd_server import etcd_server, etcd_skip_reason
from bench.fleet import Proc, free_port
from kvstore.client import Client
from kvstore.errors import MasterUnavailableError, PutError
from kvstore.link import MASTER_ROLE
from kvstore.node import StorageNode
from transfer_engine.control.etcd_leader import EtcdLeader, leader_of


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    with etcd_server(tmp_path) as address:
        yield address + "/store"


@pytest.fixture
def masters(etcd: str) -> Iterator[Callable[[], tuple[Proc, str]]]:
    """Starts master processes that campaign in ``etcd``; stops them all afterwards."""
    made: list[Proc] = []

    def start() -> tuple[Proc, str]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        proc = Proc(["-m", "kvstore.master", "--bind", endpoint, "--etcd", etcd,
                     "--leader-ttl", "2", "--node-interval", "0.1", "--lease-s", "0.5",
                     "--put-timeout-s", "1", "--grace-s", "1"])
        made.append(proc)
        return proc, endpoint
    try:
        yield start
    finally:
        for proc in made:
            if proc.proc.poll() is None:
                proc.signal(signal.SIGCONT)
                proc.signal(signal.SIGTERM)  # a master stops on SIGTERM, resigning
            proc.stop()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def put_when_ready(client: Client, key: int, value: bytes, timeout: float = 10) -> None:
    """A new master's pools take nothing during its grace period (RECOVERING)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.put(key, value)
            return
        except PutError as exc:
            assert "RECOVERING" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.2)


def test_a_standby_master_takes_over_and_nodes_and_clients_follow(
        etcd: str, masters: Callable[[], tuple[Proc, str]]) -> None:
    first, first_at = masters()
    first.expect("kvstore-master serving", 20)
    standby, standby_at = masters()
    standby.expect("kvstore-master standing by", 20)
    assert leader_of(etcd, MASTER_ROLE) == first_at
    rng = np.random.default_rng(11)
    vals = [rng.integers(0, 256, int(rng.integers(1, 30000)), dtype=np.uint8).tobytes()
            for _ in range(40)]
    nodes = [StorageNode(etcd, 8 << 20, name=f"f{i}") for i in range(2)]
    try:
        wait_for(lambda: all(n.registered for n in nodes), 10, "nodes registered")
        assert {n.master_endpoint for n in nodes} == {first_at}
        with Client(etcd, replicas=2, checksum=True, timeout=3.0) as client:
            client.batch_put(range(40), vals)
            time.sleep(0.3)  # the journal reaches the nodes
            first.signal(signal.SIGKILL)
            standby.expect("kvstore-master serving", 15)
            assert leader_of(etcd, MASTER_ROLE) == standby_at
            wait_for(lambda: all(n.master_endpoint == standby_at and n.registered
                                 for n in nodes), 10, "nodes moved to the new leader")
            # the first request waits out the dead master, then asks the new one
            assert client.batch_get(range(40), verify=True) == vals
            put_when_ready(client, 1000, b"after the failover")
            assert client.get(1000) == b"after the failover"
    finally:
        for node in nodes:
            node.close()


def test_a_frozen_leader_loses_the_lead_and_stops_serving(
        etcd: str, masters: Callable[[], tuple[Proc, str]]) -> None:
    """Frozen (SIGSTOP) past its lease, the leader is replaced; woken, it finds its
    lease gone and exits (code 3) instead of serving beside the new leader."""
    first, _ = masters()
    first.expect("kvstore-master serving", 20)
    standby, standby_at = masters()
    standby.expect("kvstore-master standing by", 20)
    first.signal(signal.SIGSTOP)
    standby.expect("kvstore-master serving", 15)
    first.signal(signal.SIGCONT)
    first.expect("kvstore-master lost the lead", 10)
    assert first.proc.wait(10) == 3
    assert leader_of(etcd, MASTER_ROLE) == standby_at


def test_no_master_leading_is_a_precise_error(etcd: str) -> None:
    with pytest.raises(MasterUnavailableError, match="no kvstore master found"):
        Client(etcd, timeout=1.0)
    with pytest.raises(MasterUnavailableError, match="no kvstore master found"):
        StorageNode(etcd, 1 << 20)


def test_a_leader_entry_that_is_no_endpoint_is_a_precise_error(etcd: str) -> None:
    """Whatever holds the leader's key (a misconfigured or hostile writer), a node or
    client refuses a value that is not a tcp://HOST:PORT endpoint, saying so."""
    for bad in ("garbage", "tcp://:7400", "tcp://h:0", "tcp://h:x", "ipc:///tmp/m"):
        with EtcdLeader(etcd, MASTER_ROLE, bad, ttl=2) as leader:
            leader.campaign(timeout=5)
            with pytest.raises(MasterUnavailableError, match="not a tcp://HOST:PORT"):
                Client(etcd, timeout=1.0)
            with pytest.raises(MasterUnavailableError, match="not a tcp://HOST:PORT"):
                StorageNode(etcd, 1 << 20)

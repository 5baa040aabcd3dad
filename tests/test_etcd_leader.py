"""EtcdLeader against a real etcd: one leader at a time, a standby that takes over when
the leader resigns or its lease is lost, and a leader that learns it lost the lead."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.etcd_server import etcd_server, etcd_skip_reason
from tests.helpers.faults import revoke_etcd_lease_at
from transfer_engine.control.etcd_leader import EtcdLeader, leader_of
from transfer_engine.errors import ClosedError, TransferTimeout, UnknownPeerError


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    with etcd_server(Path(tmp_path_factory.mktemp("etcd"))) as address:
        yield address


def test_one_leader_at_a_time_and_a_standby_takes_over(etcd: str,
                                                       request: pytest.FixtureRequest
                                                       ) -> None:
    address = f"{etcd}/t-{request.node.name}"
    with pytest.raises(UnknownPeerError):
        leader_of(address, "svc")
    with EtcdLeader(address, "svc", "tcp://a:1", ttl=2) as a, \
            EtcdLeader(address, "svc", "tcp://b:2", ttl=2) as b:
        a.campaign(timeout=5)
        assert a.leading and leader_of(address, "svc") == "tcp://a:1"
        with pytest.raises(TransferTimeout):
            b.campaign(timeout=0.5)
        assert not b.leading
        a.resign()  # hands over at once
        b.campaign(timeout=5)
        assert leader_of(address, "svc") == "tcp://b:2" and not a.leading


def test_a_leader_whose_lease_is_lost_is_told(etcd: str,
                                              request: pytest.FixtureRequest) -> None:
    address = f"{etcd}/t-{request.node.name}"
    lost = threading.Event()
    with EtcdLeader(address, "svc", "tcp://a:1", ttl=2, on_lost=lost.set) as a, \
            EtcdLeader(address, "svc", "tcp://b:2", ttl=2) as b:
        a.campaign(timeout=5)
        revoke_etcd_lease_at(address, a.lease)  # as a partition past the lease would
        assert lost.wait(5) and not a.leading
        b.campaign(timeout=5)
        assert leader_of(address, "svc") == "tcp://b:2"


def test_a_cancelled_campaign_ends_and_bad_roles_are_refused(etcd: str) -> None:
    with EtcdLeader(etcd, "held", "x", ttl=2) as a, EtcdLeader(etcd, "held", "y") as b:
        a.campaign(timeout=5)
        threading.Timer(0.3, b.cancel).start()
        with pytest.raises(ClosedError):
            b.campaign()
    for role in ("", "a/b"):
        with pytest.raises(ValueError):
            EtcdLeader(etcd, role, "x")

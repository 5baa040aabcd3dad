"""TCP rails per NIC: pairing, rate metering, and striping across shaped lab NICs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from bench.lab_bench import run_lab
from tests.helpers.lab_helpers import lab_tag, make_lab  # noqa: F401  (fixture)
from transfer_engine.lab import lab_skip_reason
from transfer_engine.topology import Nic, Topology
from transfer_engine.transport.tcp import TcpTransport
from transfer_engine.transport.tcp_nics import (
    RateMeter,
    StallWatch,
    link_up,
    local_nics,
    pair_nics,
)

TOPO = Topology((Nic("eth0", numa_node=0, port_state="ACTIVE", link_rate_gbps=1,
                     address="127.0.0.1"),
                 Nic("eth1", numa_node=1, port_state="ACTIVE", link_rate_gbps=1,
                     address="127.0.0.1"),
                 Nic("ib0", port_state="ACTIVE")))


def test_local_nics_from_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [n.name for n in local_nics("auto", TOPO)] == ["eth0", "eth1"]  # addressed
    assert [n.address for n in local_nics(["eth1"], TOPO)] == ["127.0.0.1"]
    with pytest.raises(ValueError, match="ib0"):
        local_nics("eth0,ib0", TOPO)
    monkeypatch.delenv("TE_TCP_NICS", raising=False)
    assert local_nics(None, TOPO) == []
    monkeypatch.setenv("TE_TCP_NICS", "eth1")
    assert [n.name for n in local_nics(None, TOPO)] == ["eth1"]


def test_pairs_follow_the_kernel_routes() -> None:
    local = local_nics("auto", TOPO)
    remote = [{"name": "r0", "address": "127.0.0.1", "port": 1, "gbps": 0.5},
              {"name": "r1", "address": "198.18.0.9", "port": 2},  # no route here
              {"name": "bad"}]
    pairs = pair_nics(local, remote)
    # both local NICs reach r0 only (the lab's 198.18 net is not routed from here)
    assert [(p[0].name, p[1], p[2]) for p in pairs] == [
        ("eth0", ("127.0.0.1", 1), 0.5), ("eth1", ("127.0.0.1", 1), 0.5)]


def test_rate_meter_follows_goodput() -> None:
    meter = RateMeter(10.0)
    assert meter.gbps == 10.0
    meter.started(1)
    meter.started(2)
    time.sleep(0.05)
    meter.done(1, 1 << 20, True)  # ~0.17 Gb/s over 50 ms
    assert 0.05 < meter.gbps < 0.2
    time.sleep(0.05)
    meter.done(2, 1 << 20, True)  # timed from the previous completion, not its start
    assert 0.05 < meter.gbps < 0.2 and meter.samples == 2
    meter.started(3)
    meter.done(3, 4096, True)  # too small to say anything about the link
    assert meter.samples == 2


def test_link_state_of_a_nic() -> None:
    assert link_up("lo") in (True, None)  # loopback has no carrier to lose
    assert link_up("te-no-such0") is None


def test_overdue_work_and_the_stall_watch() -> None:
    """A rail is overdue once its oldest work has waited ``grace`` plus four times its
    bytes at the measured goodput; the watch stalls such a rail only while another rail
    to the peer is open, since a slow rail beats none."""
    meter = RateMeter(1.0)  # 1 Gb/s: 1 MiB is due in 4 x 8.4 ms
    assert meter.overdue(0.1) == 0.0  # nothing outstanding
    meter.started(1, 1 << 20)
    now = time.monotonic()
    assert meter.overdue(0.1, now) == 0.0
    assert meter.overdue(0.1, now + 1.0) == pytest.approx(1.0 - 0.1 - 4 * 8 / 953.67,
                                                           abs=0.01)
    meter.done(1, 1 << 20, True)
    assert meter.overdue(0.1, now + 5) == 0.0

    class Rail:
        def __init__(self, late: bool) -> None:
            self.nic = "te-no-such0"  # its link state cannot be told here
            self.closed = False
            self.meter = RateMeter(1.0)
            self.inflight = 1 if late else 0
            self.stalls: list[str] = []
            if late:
                self.meter.started(1, 1 << 20)
                self.meter._starts[1] = (time.monotonic() - 10, 1 << 20)  # 10 s ago

        def stall(self, reason: str) -> None:
            self.stalls.append(reason)
            self.closed = True

    late, fine = Rail(True), Rail(False)
    watch = StallWatch("t", lambda: [[late, fine]], grace=1.0)
    try:
        watch.check()
        assert len(late.stalls) == 1 and "past due" in late.stalls[0]
        assert not fine.stalls and watch.stalled == 1
        alone = Rail(True)
        watch._groups = lambda: [[alone]]  # its only rail: kept, however slow
        watch.check()
        assert not alone.stalls
    finally:
        watch.close()


def test_nic_rails_on_loopback(make_engine) -> None:  # type: ignore[no-untyped-def]
    import numpy as np  # noqa: PLC0415

    from transfer_engine import Descriptor  # noqa: PLC0415

    a = make_engine("a", transports=[TcpTransport(nics="auto", topology=TOPO, rails=1)])
    b = make_engine("b", transports=[TcpTransport(nics="auto", topology=TOPO, rails=1)])
    dst = np.zeros(8 << 20, np.uint8)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    assert [r.nic for r in peer.rails["tcp"]] == ["eth0", "eth1"]
    data = np.random.default_rng(1).integers(0, 256, 8 << 20, np.uint8)
    src = a.register(data)
    a.write(peer, [(Descriptor(src, 0, 8 << 20),
                    Descriptor(peer.segment("dst"), 0, 8 << 20))]).wait(10)
    assert np.array_equal(dst, data)
    assert all(r.meter is not None and r.meter.samples >= 1 for r in peer.rails["tcp"])


def test_striping_over_lab_nics(tmp_path: Path) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    failover: dict[str, Any] = {}
    rows = run_lab([1, 2], rate_mbit=200, seconds=1.0, tag=lab_tag("r"),
                   state_root=tmp_path, failover=failover)
    one, two = rows
    assert one["rails"] == ["eth0"] and two["rails"] == ["eth0", "eth1"]
    assert all(r["exact"] for r in rows)
    assert one["ratio"] > 0.8 and two["ratio"] > 0.8, rows
    assert two["gbps"] > 1.7 * one["gbps"], rows
    # eth1 pulled mid-write: its work moves within a second (the link watch, not the
    # kernel's 5 s timeout), and every byte reads back exact
    assert failover["bytes_verified"] == 64 << 20 and failover["moved"] >= 1, failover
    assert 0 < failover["seconds_to_recover"] < 1.0, failover


def _failover_pair(lab_factory: Any, nic_wait: float | None = None, **config: Any
                   ) -> tuple[Any, Any, Any, Any]:
    """Two lab hosts with 2 NICs at 50 Mbit/s: a target on host 1 and, on host 0, the
    initiator of tests/helpers/lab_failover_peer.py (NIC timeout 1 s). Returns (lab,
    target, initiator, the initiator's stdout)."""
    import secrets  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    lab = lab_factory(hosts=2, nics=2, rate_mbit=50, **config)
    h0, h1 = lab.hosts
    env = {"TE_CONTROL_SECRET": secrets.token_hex(24), "PATH": "/usr/bin:/bin"}
    target = lab.spawn(h1, [sys.executable, "-m", "bench.lab_bench", "serve", "--host",
                            h1.address], env=env, stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
    assert target.stdout is not None and target.stdin is not None
    endpoint = target.stdout.readline().split()[1]
    init = lab.spawn(h0, [sys.executable, str(Path(__file__).parent / "helpers"
        / "lab_failover_peer.py"), h0.address, endpoint, "1.0",
        *([] if nic_wait is None else [str(nic_wait)])], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert init.stdout is not None and init.stdin is not None
    return lab, target, init, init.stdout


def test_nic_failover_in_the_lab(make_lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """A NIC pulled mid-transfer: its slices move to the other NIC, byte-exact. Every
    NIC pulled: the transfer fails with PeerLostError, in bounded time."""
    lab, target, init, out = _failover_pair(make_lab)
    inp = init.stdin
    assert out.readline().split() == ["RAILS", "eth0,eth1"]
    inp.write("go\n")
    inp.flush()
    assert out.readline().strip() == "STARTED"
    time.sleep(0.5)  # 16 MiB over 2 x 50 Mbit/s takes ~2.8 s: pull eth1 midway
    lab.set_link(0, 1, up=False)
    wrote = out.readline().split()
    assert wrote[:2] == ["WROTE", "ok"], wrote
    assert out.readline().split() == ["EXACT", "True"]
    failovers = int(out.readline().split()[1])
    assert failovers >= 1
    lab.set_link(0, 0, up=False)  # now every NIC of host 0 is gone
    inp.write("go\n")
    inp.flush()
    assert out.readline().strip() == "STARTED"
    wrote = out.readline().split(maxsplit=3)
    assert wrote[1] == "PeerLostError" and float(wrote[2]) < 15, wrote
    assert "no NIC rail to the peer is left (eth0, eth1 failed)" in wrote[3], wrote
    inp.close()
    init.wait(20)
    target.stdin.close()


def test_a_nic_that_comes_back_carries_traffic_again(make_lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """A NIC pulled mid-transfer and plugged back: its rail is opened again in the
    background and the next transfer goes over both NICs again, byte-exact."""
    lab, target, init, out = _failover_pair(make_lab)
    inp = init.stdin

    def step(command: str) -> None:
        inp.write(command + "\n")
        inp.flush()

    assert out.readline().split() == ["RAILS", "eth0,eth1"]
    step("go")
    assert out.readline().strip() == "STARTED"
    time.sleep(0.5)
    lab.set_link(0, 1, up=False)
    assert out.readline().split()[:2] == ["WROTE", "ok"]
    assert out.readline().split() == ["EXACT", "True"]
    assert int(out.readline().split()[1]) >= 1
    step("rails")
    assert out.readline().split() == ["RAILS", "eth0"]
    lab.set_link(0, 1, up=True)
    for _ in range(8):  # bounded: the rail comes back within a few retries
        time.sleep(0.5)
        step("go")
        assert out.readline().strip() == "STARTED"
        assert out.readline().split()[:2] == ["WROTE", "ok"]
        assert out.readline().split() == ["EXACT", "True"]
        out.readline()  # FAILOVERS
        step("rails")
        if out.readline().split() == ["RAILS", "eth0,eth1"]:
            break
    else:
        raise AssertionError("the NIC's rail was not opened again")
    inp.close()
    init.wait(20)
    target.stdin.close()


def test_a_nic_that_turns_lossy_mid_transfer(make_lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Links stay up while a NIC loses frames (the lab's delay line drops them). A NIC
    that drops everything mid-write (a black hole its link state does not show) has its
    work moved to the other NIC once its connection times out (1 s here), byte-exact,
    in bounded time; at 20% loss later writes complete byte-exact."""
    lab, target, init, out = _failover_pair(make_lab, delay_line=True)
    inp = init.stdin

    def step() -> list[str]:
        inp.write("go\n")
        inp.flush()
        assert out.readline().strip() == "STARTED"
        return out.readline().split()

    assert out.readline().split() == ["RAILS", "eth0,eth1"]
    inp.write("go\n")
    inp.flush()
    assert out.readline().strip() == "STARTED"
    time.sleep(0.5)
    lab.set_loss(0, 1, 1.0)  # mid-write: eth1 goes silent, its link still up
    wrote = out.readline().split()
    assert wrote[:2] == ["WROTE", "ok"] and float(wrote[2]) < 20, wrote
    assert out.readline().split() == ["EXACT", "True"]
    assert int(out.readline().split()[1]) >= 1
    lab.set_loss(0, 1, 0.2)  # back, but lossy: slower, and still exact
    landed = 0
    for _ in range(5):  # bounded: two writes must land
        wrote = step()
        if wrote[:2] == ["WROTE", "PeerLostError"]:
            # at this loss, with a 1 s NIC timeout, both rails can fail in turn (seen
            # once on a loaded machine): that write fails whole, saying so, and the
            # next one runs once the rails are open again
            time.sleep(1.0)
            continue
        assert wrote[:2] == ["WROTE", "ok"], wrote
        exact = out.readline().split()
        if exact == ["EXACT", "PeerLostError"]:  # the read back, the same way
            time.sleep(1.0)
            continue
        assert exact == ["EXACT", "True"]
        out.readline()  # FAILOVERS: a rail may time out again at this loss
        landed += 1
        if landed == 2:
            break
    assert landed == 2
    inp.close()
    init.wait(20)
    target.stdin.close()


def test_every_nic_silent_for_a_moment(make_lab) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Both NICs drop every frame for 2 s mid-write, longer than the 1 s NIC timeout, so
    every rail to the peer breaks: the write waits for a NIC pair to open again and
    completes there, byte-exact, instead of failing."""
    lab, target, init, out = _failover_pair(make_lab, nic_wait=10.0, delay_line=True)
    inp = init.stdin
    assert out.readline().split() == ["RAILS", "eth0,eth1"]
    inp.write("go\n")
    inp.flush()
    assert out.readline().strip() == "STARTED"
    time.sleep(0.5)
    lab.set_loss(0, 0, 1.0)
    lab.set_loss(0, 1, 1.0)
    time.sleep(2.0)
    lab.set_loss(0, 0, 0.0)
    lab.set_loss(0, 1, 0.0)
    wrote = out.readline().split()
    assert wrote[:2] == ["WROTE", "ok"] and float(wrote[2]) < 20, wrote
    assert out.readline().split() == ["EXACT", "True"]
    inp.close()
    init.wait(20)
    target.stdin.close()


def test_shares_follow_measured_goodput(tmp_path: Path) -> None:
    """NIC 1 is shaped to a fifth of the rate its topology claims: an even split would
    reach 2 x 40 Mbit/s; shares by measured goodput fill both links."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    (row,) = run_lab([2], rate_mbit=200, seconds=2.0, tag=lab_tag("w"),
                     state_root=tmp_path, nic_rates_mbit=(200, 40))
    assert row["limit_gbps"] == pytest.approx(0.24)
    assert row["exact"] and row["ratio"] > 0.75, row
    fast, slow = row["rail_gbps"]
    assert slow < fast / 2, row


def test_nic_listeners_keep_to_the_engines_exposure() -> None:
    topo = Topology((Nic("eth0", port_state="ACTIVE", address="198.18.0.1"),))
    tcp = TcpTransport(nics="auto", topology=topo)  # serves 127.0.0.1
    try:
        with pytest.raises(ValueError, match="beyond loopback"):
            tcp.start(None)  # type: ignore[arg-type]  (refused before it is used)
    finally:
        tcp.close()

"""The fleet lab: namespaces as hosts, shaped veths as NICs, and nothing left behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.lab_helpers import (  # noqa: F401  (make_lab: a fixture)
    lab_tag,
    make_lab,
    round_trip_ms,
    send_to,
)
from transfer_engine.lab import Lab, LabConfig, LabError, lab_skip_reason
from transfer_engine.lab.netns import check_address, namespaces, run
from transfer_engine.lab.wire import WirePort, frame_delay
from transfer_engine.topology import load_topology_file, preferred_nics


def test_config_is_validated() -> None:
    for bad in ({"hosts": 0}, {"nics": 17}, {"rate_mbit": 0}, {"delay_ms": -1},
                {"zones": 3, "hosts": 2}, {"tag": "Bad-Tag"}):
        with pytest.raises(ValueError):
            LabConfig(**bad)  # type: ignore[arg-type]


def test_only_lab_addresses() -> None:
    assert str(check_address("198.19.255.1")) == "198.19.255.1"
    for outside in ("10.0.0.1", "198.20.0.1", "127.0.0.1", "::1"):
        with pytest.raises(LabError):
            check_address(outside)


def test_hosts_nics_and_topology(make_lab) -> None:  # noqa: F811
    lab = make_lab(hosts=3, nics=2, rate_mbit=1000, zones=2)
    assert [h.zone for h in lab.hosts] == ["z0", "z1", "z0"]
    assert [h.pod for h in lab.hosts] == ["z0-p0", "z1-p0", "z0-p0"]
    for host in lab.hosts:
        assert host.netns in namespaces()
        routes = run(["ip", "-4", "route", "show"], host.netns).splitlines()
        # connected routes of the lab's own subnets and nothing else: no way out
        assert len(routes) == 2 and all(r.startswith("198.18.") for r in routes), routes
        assert "default" not in run(["ip", "-6", "route", "show"], host.netns)
        topo = load_topology_file(host.topology_file)
        assert [(n.name, n.address) for n in topo.active_nics()] == [
            (n.name, n.address) for n in host.nics]
        assert [n.link_rate_gbps for n in topo.nics] == [1.0, 1.0]
        # GPU j shares PCIe switch j with NIC j: memory on cuda:1 prefers eth1
        assert preferred_nics(topo, "cuda:1") == ["eth1", "eth0"]
        assert preferred_nics(topo, "cpu:0")[0] == "eth0"
    qdisc = run(["tc", "qdisc", "show", "dev", "eth0"], lab.hosts[0].netns)
    assert "tbf" in qdisc  # no cross-zone delay asked: plain tbf
    assert "tbf" in run(["tc", "qdisc", "show"], lab.switch)


def test_rate_is_enforced(make_lab) -> None:  # noqa: F811
    lab = make_lab(hosts=2, nics=2, rate_mbit=200)
    for nic in (0, 1):
        gbps = send_to(lab, lab.hosts[0], lab.hosts[1], nic, 8 << 20)
        assert 0.7 * 0.2 < gbps < 1.1 * 0.2, (nic, gbps)


def test_close_removes_everything(tmp_path: Path) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab(LabConfig(hosts=2, nics=1, tag=lab_tag("c")), state_root=tmp_path)
    made = [h.netns for h in lab.hosts] + [lab.switch]
    proc = lab.spawn(lab.hosts[0], [sys.executable, "-c", "import time; time.sleep(60)"])
    with lab:
        pass
    assert proc.poll() is not None
    assert not set(made) & set(namespaces())
    assert not (tmp_path / lab.config.tag).exists()
    lab.close()  # idempotent


def test_the_delay_line_delays_by_destination() -> None:
    port = WirePort("h0n0", "y0n0", 0.001, {"198.18.0.2": 0.016})
    header = bytes(10)  # the kernel's offload header

    def ipv4_to(dst: str) -> bytes:
        ip = bytes(16) + socket.inet_aton(dst)
        return header + bytes(12) + b"\x08\x00" + ip + bytes(20)
    assert frame_delay(port, ipv4_to("198.18.0.2")) == 0.016  # another zone
    assert frame_delay(port, ipv4_to("198.18.0.3")) == 0.001  # its own zone
    arp = header + bytes(12) + b"\x08\x06" + bytes(28)
    assert frame_delay(port, arp) == 0.001
    assert frame_delay(port, header[:4]) == 0.001  # a runt: the host's delay


def test_cross_zone_hosts_are_further_away(make_lab) -> None:  # noqa: F811
    """Zones of two hosts each: one way, 1 ms to a host of the same zone and 16 ms to
    another zone, from netem or, on a kernel without it, the userspace delay line; the
    delayed links still carry their rate."""
    lab = make_lab(hosts=4, nics=1, rate_mbit=200, zones=2, delay_ms=1,
                   cross_zone_delay_ms=15)
    h0, h1, h2 = lab.hosts[:3]  # zones z0, z1, z0
    if lab.wired:
        assert [(p.host, p.delay_s, p.delay_to) for p in lab.wire_ports()][:2] == [
            ("h0n0", 0.001, {"198.18.0.2": 0.016, "198.18.0.4": 0.016}),
            ("h1n0", 0.001, {"198.18.0.1": 0.016, "198.18.0.3": 0.016})]
    same = round_trip_ms(lab, h0, h2)
    cross = round_trip_ms(lab, h0, h1, port=5302)
    assert 1.8 < same < 8, same
    assert 31 < cross < 45, cross
    gbps = send_to(lab, h0, h1, 0, 32 << 20)
    assert 0.6 * 0.2 < gbps < 1.1 * 0.2, gbps


def running_with(text: str) -> bool:
    """Whether a running process has ``text`` in its command line."""
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in path.read_bytes().decode(errors="replace"):
                return True
        except OSError:
            pass  # it ended meanwhile
    return False


def test_cli_up_and_down(tmp_path: Path) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    tag = lab_tag("k")
    env = {"TE_LAB_STATE": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1]),
           "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    cli = [sys.executable, "-m", "transfer_engine.lab"]
    try:
        up = subprocess.run([*cli, "up", "--hosts", "2", "--nics", "2", "--rate-mbit",
                             "100", "--delay-ms", "1", "--name", tag], capture_output=True,
                            text=True, env=env, timeout=60, check=True)
        hosts = json.loads(up.stdout)["hosts"]
        assert [n["address"] for n in hosts[1]["nics"]] == ["198.18.0.2", "198.18.1.2"]
        assert f"te-{tag}-h1" in namespaces()
        assert Path(hosts[0]["topology_file"]).is_file()
        # without netem, the delay line outlives `up` (a process of its own)
        assert running_with(str(tmp_path / tag)) == json.loads(up.stdout)["delay_line"]
    finally:
        down = subprocess.run([*cli, "down", "--name", tag], capture_output=True,
                              text=True, env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    assert sorted(json.loads(down.stdout)["removed"]) == [
        f"te-{tag}-h0", f"te-{tag}-h1", f"te-{tag}-sw"]
    assert not (tmp_path / tag).exists()
    assert not running_with(str(tmp_path / tag))  # `down` ended the delay line


def test_loss_needs_the_delay_line_and_a_real_port(make_lab) -> None:  # noqa: F811
    plain = make_lab(hosts=2)
    with pytest.raises(LabError, match="delay_line=True"):
        plain.set_loss(0, 0, 0.1)
    wired = make_lab(hosts=2, delay_line=True)
    assert wired.wired
    with pytest.raises(ValueError):
        wired.set_loss(0, 0, 1.5)
    with pytest.raises(LabError, match="no port"):
        wired.set_loss(0, 3, 0.1)
    wired.set_loss(0, 0, 0.0)
    assert send_to(wired, wired.hosts[0], wired.hosts[1], 0, 4 << 20) > 0.5

"""A small fleet in the lab: etcd on lab hosts (one member, or a cluster of three),
members on others, in two zones. Every member sees the others' hosts, pods and zones
and the traffic policy's path classes; a cluster that loses its leader keeps members
joining and leaving."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.etcd_server import ETCD, etcd_skip_reason
from tests.helpers.lab_helpers import make_lab  # noqa: F401  (fixture)
from transfer_engine.lab import Lab, LabHost

HELPERS = Path(__file__).parent / "helpers"


def start_etcd(lab: Lab, hosts: list[LabHost], tmp_path: Path
               ) -> list[subprocess.Popen[bytes]]:
    """etcd members on ``hosts`` (each a namespace with ports to itself), as one cluster;
    returns once every one listens. The root namespace cannot reach the lab, so each
    member's log tells when it serves."""
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = ",".join(f"e{h.index}=http://{h.address}:2380" for h in hosts)
    procs, logs = [], []
    for h in hosts:
        url = f"http://{h.address}"
        log = tmp_path / f"etcd-{h.index}.log"
        with open(log, "wb") as log_file:  # the child holds its own copy
            procs.append(lab.spawn(h, [
                ETCD, "--name", f"e{h.index}", "--data-dir", str(tmp_path / f"etcd-{h.index}"),
                "--listen-client-urls", f"{url}:2379", "--advertise-client-urls", f"{url}:2379",
                "--listen-peer-urls", f"{url}:2380",
                "--initial-advertise-peer-urls", f"{url}:2380",
                "--initial-cluster", cluster, "--initial-cluster-token", lab.config.tag,
                "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=subprocess.DEVNULL, stderr=log_file))
        logs.append(log)
    deadline = time.monotonic() + 30
    for proc, log in zip(procs, logs, strict=True):
        while b"serving insecure client requests on" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, \
                log.read_text()[-500:]
            time.sleep(0.05)
    return procs


def spawn_member(lab: Lab, host: LabHost, name: str, registry: str, n: int,
                 env: dict[str, str]) -> subprocess.Popen[str]:
    """A fleet member on ``host`` that prints its view once ``n`` members are in."""
    return lab.spawn(host, [sys.executable, str(HELPERS / "lab_member.py"), name,
                            host.address, registry, host.pod, host.zone, str(n)],
                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def view_of(proc: subprocess.Popen[str]) -> dict[str, list[str]]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"member exited with {proc.wait(5)} before printing its view"
    view: dict[str, list[str]] = json.loads(line)
    return view


def leave(proc: subprocess.Popen[str]) -> None:
    """Lets a member go (it leaves the registry as it closes) and waits for it."""
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(20) == 0


def leader_of(lab: Lab, hosts: list[LabHost]) -> int:
    """Index in ``hosts`` of the etcd member that leads, asked from inside each host."""
    ask = ("import sys; from transfer_engine.control.etcd_client import etcd_request as r;"
           "s = r(sys.argv[1], 2379, '/v3/maintenance/status', {}, 2, 'status');"
           "print(s['leader'] == s['header']['member_id'])")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for i, h in enumerate(hosts):
            out = lab.spawn(h, [sys.executable, "-c", ask, h.address],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            if out.communicate(timeout=20)[0].strip() == "True":
                return i
        time.sleep(0.2)
    raise AssertionError("the lab's etcd cluster elected no leader")


def member_env() -> dict[str, str]:
    return {"TE_CONTROL_SECRET": secrets.token_hex(24), "PATH": "/usr/bin:/bin"}


def test_members_carry_their_lab_placement(make_lab, tmp_path: Path) -> None:  # noqa: F811
    lab = make_lab(hosts=6, nics=1, rate_mbit=1000, zones=2, hosts_per_pod=2)
    h0 = lab.hosts[0]
    start_etcd(lab, [h0], tmp_path)
    env = member_env()
    members = [spawn_member(lab, h, f"m{h.index}", f"etcd://{h0.address}:2379",
                            len(lab.hosts), env) for h in lab.hosts]
    views = [view_of(proc) for proc in members]
    view = views[0]  # m0: zone z0, pod z0-p0
    assert {name: v[1:] for name, v in view.items()} == {
        "m0": ["z0", "z0-p0", "HOST"], "m1": ["z1", "z1-p0", "CROSS_ZONE"],
        "m2": ["z0", "z0-p0", "POD"], "m3": ["z1", "z1-p0", "CROSS_ZONE"],
        "m4": ["z0", "z0-p1", "ZONE"], "m5": ["z1", "z1-p1", "CROSS_ZONE"]}
    # each lab host is a host of its own (its own hostname), not the machine's
    assert [view[f"m{i}"][0] for i in range(6)] == [h.netns for h in lab.hosts]
    assert all(len(v) == 6 for v in views)
    for proc in members:
        leave(proc)


def test_a_three_member_etcd_survives_losing_its_leader(make_lab, tmp_path: Path  # noqa: F811
                                                        ) -> None:
    """etcd on three lab hosts, members on three others. The leader's host loses its
    etcd (SIGKILL); past a lease's length the members already in are still in (their
    keep-alives went to another etcd member), one leaves, and a new one joins on its
    host and sees
    exactly the members that are there."""
    lab = make_lab(hosts=6, nics=1, rate_mbit=1000, zones=2, hosts_per_pod=1)
    etcd_hosts, member_hosts = lab.hosts[:3], lab.hosts[3:]
    etcd = start_etcd(lab, etcd_hosts, tmp_path)
    registry = "etcd://" + ",".join(f"{h.address}:2379" for h in etcd_hosts)
    env = member_env()
    members = [spawn_member(lab, h, f"m{h.index}", registry, 3, env) for h in member_hosts]
    assert all(sorted(view_of(p)) == ["m3", "m4", "m5"] for p in members)
    etcd[leader_of(lab, etcd_hosts)].kill()
    leave(members[2])
    time.sleep(4.0)  # past the 3 s lease of m3 and m4: kept alive through the others
    late = spawn_member(lab, member_hosts[2], "late", registry, 3, env)
    view = view_of(late)
    assert sorted(view) == ["late", "m3", "m4"]
    for proc in (members[0], members[1], late):
        leave(proc)

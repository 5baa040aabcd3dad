"""A small fleet in the lab: etcd on one lab host, members on six, in two zones; every
member sees the others' hosts, pods and zones, and the traffic policy's path classes."""

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

HELPERS = Path(__file__).parent / "helpers"


def test_members_carry_their_lab_placement(make_lab, tmp_path: Path) -> None:  # noqa: F811
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    lab = make_lab(hosts=6, nics=1, rate_mbit=1000, zones=2, hosts_per_pod=2)
    h0 = lab.hosts[0]
    url = f"http://{h0.address}"
    # etcd on lab host 0: its own namespace has these ports to itself
    log = tmp_path / "etcd.log"
    log_file = open(log, "wb")  # noqa: SIM115  (closed once handed over)
    etcd = lab.spawn(h0, [ETCD, "--name", "lab", "--data-dir", str(tmp_path / "etcd"),
                          "--listen-client-urls", f"{url}:2379",
                          "--advertise-client-urls", f"{url}:2379",
                          "--listen-peer-urls", f"{url}:2380",
                          "--initial-advertise-peer-urls", f"{url}:2380",
                          "--initial-cluster", f"lab={url}:2380"],
                     stdout=subprocess.DEVNULL, stderr=log_file)
    log_file.close()  # the child holds its own copy
    deadline = time.monotonic() + 20
    # the root namespace cannot reach the lab, so etcd's log tells when it listens
    while b"serving insecure client requests on" not in log.read_bytes():
        assert etcd.poll() is None and time.monotonic() < deadline, log.read_text()[-500:]
        time.sleep(0.05)
    env = {"TE_CONTROL_SECRET": secrets.token_hex(24), "PATH": "/usr/bin:/bin"}
    members = [lab.spawn(h, [sys.executable, str(HELPERS / "lab_member.py"), f"m{h.index}",
                             h.address, f"etcd://{h0.address}:2379", h.pod, h.zone,
                             str(len(lab.hosts))],
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for h in lab.hosts]
    views = []
    for proc in members:
        assert proc.stdout is not None
        views.append(json.loads(proc.stdout.readline()))
    view = views[0]  # m0: zone z0, pod z0-p0
    assert {name: v[1:] for name, v in view.items()} == {
        "m0": ["z0", "z0-p0", "HOST"], "m1": ["z1", "z1-p0", "CROSS_ZONE"],
        "m2": ["z0", "z0-p0", "POD"], "m3": ["z1", "z1-p0", "CROSS_ZONE"],
        "m4": ["z0", "z0-p1", "ZONE"], "m5": ["z1", "z1-p1", "CROSS_ZONE"]}
    # each lab host is a host of its own (its own hostname), not the machine's
    assert [view[f"m{i}"][0] for i in range(6)] == [h.netns for h in lab.hosts]
    assert all(len(v) == 6 for v in views)
    for proc in members:
        assert proc.stdin is not None
        proc.stdin.close()

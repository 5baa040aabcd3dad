"""Lab fixtures shared by the lab tests: a lab per test, removed pass or fail."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from transfer_engine.lab import Lab, LabConfig, LabHost, lab_skip_reason

# a process inside a host: serve one TCP connection on ADDR:PORT, print bytes and seconds
SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(20); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k: break
    t0 = t0 or time.monotonic(); n += k
print(n, time.monotonic() - t0, flush=True)
"""


def lab_tag(suffix: str = "") -> str:
    """A tag no other test run shares (1-8 characters)."""
    return f"t{os.getpid() % 100000}{suffix}"[:8]


@pytest.fixture
def make_lab(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    """Builds labs (skipping without root) and removes every one after the test."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    labs: list[Lab] = []

    def make(**kwargs: object) -> Lab:
        kwargs.setdefault("tag", lab_tag(str(len(labs))))
        lab = Lab(LabConfig(**kwargs), state_root=tmp_path / "lab")  # type: ignore[arg-type]
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in labs:
            lab.close()


def send_to(lab: Lab, src: LabHost, dst: LabHost, nic: int, nbytes: int,
            port: int = 5201) -> float:
    """Sends ``nbytes`` from ``src`` to ``dst`` over NIC ``nic``; returns Gbit/s seen by
    the receiver."""
    addr = dst.nics[nic].address
    sink = lab.spawn(dst, [sys.executable, "-c", SINK, addr, str(port)],
                     stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    assert sink.stdout.readline().strip() == "ready"
    send = ("import socket, sys\n"
            "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)\n"
            "b = bytes(1 << 20)\n"
            f"for _ in range({nbytes >> 20}): c.sendall(b)\n"
            "c.close()\n")
    t0 = time.monotonic()
    lab.spawn(src, [sys.executable, "-c", send, addr, str(port)]).wait(30)
    n, seconds = sink.stdout.readline().split()
    sink.wait(10)
    assert int(n) == nbytes, (n, nbytes, time.monotonic() - t0)
    return int(n) * 8 / float(seconds) / 1e9


# a process inside a host: echo single bytes on ADDR:PORT for one connection
ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(20)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)):
    c.sendall(b)
"""

PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.monotonic(); c.sendall(b"x"); c.recv(1); rtts.append(time.monotonic() - t)
print(statistics.median(rtts) * 1e3, flush=True)
"""


def round_trip_ms(lab: Lab, src: LabHost, dst: LabHost, nic: int = 0, port: int = 5301,
                  count: int = 10) -> float:
    """Median round trip of one byte over TCP from ``src`` to ``dst`` on NIC ``nic``."""
    addr = dst.nics[nic].address
    echo = lab.spawn(dst, [sys.executable, "-c", ECHO, addr, str(port)],
                     stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None
    assert echo.stdout.readline().strip() == "ready"
    ping = lab.spawn(src, [sys.executable, "-c", PING, addr, str(port), str(count)],
                     stdout=subprocess.PIPE, text=True)
    out, _ = ping.communicate(timeout=30)
    echo.wait(10)
    return float(out)

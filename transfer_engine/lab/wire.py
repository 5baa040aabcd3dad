"""The lab's delay line in userspace, for kernels built without ``netem``.

Where ``netem`` is missing, a lab that asks for delay wires each host NIC's switch port
through this process instead of straight into the bridge::

    host eth j  <->  hIn j  (switch ns)  ==wire==  yInj <-> xInj  -- bridge brj

The wire reads every frame a host sends from its switch port (a packet socket) and
sends it on toward the bridge once its delay has passed: the host's ``delay_ms``, plus
``cross_zone_delay_ms`` when the frame's IPv4 destination is a host of another zone,
exactly the delays the ``netem`` layout would add on the host's egress. Frames toward
a host pass at once (their sender's wire delayed them). Frames keep their kernel
offload header (``PACKET_VNET_HDR``), so a 64 KiB TCP segment crosses as one frame,
checksum offload intact: the wire keeps up with the lab's gigabit links. At most
``LIMIT`` frames wait in the line (as ``netem``'s ``limit``); beyond, frames are dropped.

A port can also be made lossy while the lab runs (:func:`set_loss`): a fraction of the
frames it carries, both ways, is dropped, as by a bad cable or an overrun switch port
whose link stays up.

    python -m transfer_engine.lab.wire CONFIG.json

CONFIG: ``{"ports": [{"host": "h0n0", "bridge": "y0n0", "delay_s": 0.001,
"delay_to": {"198.18.0.2": 0.021}}, ...], "control": "/run/te-lab/TAG/wire.ctl"}``.
It writes ``ready`` to stdout once every port is open, and runs until killed or a port
disappears (its lab was taken down). ``control`` is a datagram socket that takes
``{"port": "h0n1", "loss": 0.2}`` and answers ``ok`` or what was wrong.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import select
import socket
import sys
import time
from dataclasses import dataclass, field
from itertools import count
from typing import Any

__all__ = ["LIMIT", "WirePort", "frame_delay", "main", "set_loss"]

LIMIT = 100_000
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15
_ETH_P_ALL = 0x0003
_VNET_HDR = 10  # struct virtio_net_hdr
_MAX_FRAME = _VNET_HDR + 65_536 + 64


@dataclass(frozen=True)
class WirePort:
    """One host NIC's port: frames from ``host`` go to ``bridge`` after their delay."""

    host: str
    bridge: str
    delay_s: float = 0.0
    delay_to: dict[str, float] = field(default_factory=dict)  # IPv4 destination -> s

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "bridge": self.bridge, "delay_s": self.delay_s,
                "delay_to": self.delay_to}


def frame_delay(port: WirePort, frame: bytes) -> float:
    """The delay of ``frame`` (offload header first) leaving ``port``'s host."""
    eth = frame[_VNET_HDR:]
    if len(eth) >= 34 and eth[12:14] == b"\x08\x00":
        return port.delay_to.get(socket.inet_ntoa(eth[30:34]), port.delay_s)
    return port.delay_s


def _open(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    try:
        sock.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind((ifname, 0))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def set_loss(control: str, port: str, loss: float, timeout: float = 5.0) -> None:
    """Tells the wire behind ``control`` to drop ``loss`` (0..1) of ``port``'s frames;
    raises ``OSError`` or ``ValueError`` if it did not take it."""
    reply_path = f"{control}.{os.getpid()}.{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(reply_path)
        try:
            sock.settimeout(timeout)
            sock.sendto(json.dumps({"port": port, "loss": loss}).encode(), control)
            answer = sock.recv(1024).decode()
        finally:
            os.unlink(reply_path)
    if answer != "ok":
        raise ValueError(f"the delay line refused loss {loss} on {port}: {answer}")


def _control(sock: socket.socket, loss: dict[str, float]) -> None:
    """Takes one loss setting from the control socket and answers it."""
    try:
        data, sender = sock.recvfrom(1024)
    except OSError:
        return
    try:
        msg = json.loads(data)
        port, value = msg["port"], float(msg["loss"])
        if port not in loss or not 0.0 <= value <= 1.0:
            raise ValueError(f"no port {port!r}, or loss {value} outside 0..1")
        loss[port] = value
        answer = "ok"
    except (ValueError, KeyError, TypeError) as exc:
        answer = f"bad request: {exc}"
    if sender:
        try:
            sock.sendto(answer.encode(), sender)
        except OSError:
            pass


def run(ports: list[WirePort], ready: Any = None, control: str | None = None) -> None:
    """Relays frames until a port's interface disappears."""
    socks: dict[int, socket.socket] = {}
    names: dict[int, str] = {}
    routes: dict[int, tuple[socket.socket, WirePort | None]] = {}
    lossy: dict[int, str] = {}  # socket -> the port whose loss applies to its frames
    loss = {port.host: 0.0 for port in ports}
    for port in ports:
        host, bridge = _open(port.host), _open(port.bridge)
        socks[host.fileno()], socks[bridge.fileno()] = host, bridge
        names[host.fileno()], names[bridge.fileno()] = port.host, port.bridge
        lossy[host.fileno()] = lossy[bridge.fileno()] = port.host
        routes[host.fileno()] = (bridge, port)  # from the host: delayed
        routes[bridge.fileno()] = (host, None)  # toward the host: at once
    poller = select.poll()
    for fd in socks:
        poller.register(fd, select.POLLIN)
    ctl: socket.socket | None = None
    if control is not None:
        ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ctl.bind(control)
        poller.register(ctl.fileno(), select.POLLIN)
    line: list[tuple[float, int, socket.socket, bytes]] = []
    seq = count()
    if ready is not None:
        ready()
    while True:
        wait = -1 if not line else max(0.0, (line[0][0] - time.monotonic()) * 1000)
        for fd, events in poller.poll(wait):
            if ctl is not None and fd == ctl.fileno():
                _control(ctl, loss)
                continue
            sock = socks[fd]
            if events & select.POLLERR:
                # a link set down (a pulled cable) or deleted: the first comes back
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                try:
                    socket.if_nametoindex(names[fd])
                except OSError:
                    return  # the interface went away with its lab
            if events & select.POLLNVAL:
                return
            out, delayed = routes[fd]
            for _ in range(256):  # a bounded batch per socket, then the line again
                try:
                    frame, addr = sock.recvfrom(_MAX_FRAME)
                except BlockingIOError:
                    break
                except OSError:
                    break  # the link went down: its error is taken at the next poll
                if addr[2] == socket.PACKET_OUTGOING:
                    continue  # our own send on this socket's interface
                drop = loss[lossy[fd]]
                if drop and random.random() < drop:
                    continue
                if delayed is None:
                    _send(out, frame)
                elif len(line) < LIMIT:
                    heapq.heappush(line, (time.monotonic() + frame_delay(delayed, frame),
                                          next(seq), out, frame))
        now = time.monotonic()
        while line and line[0][0] <= now:
            _, _, out, frame = heapq.heappop(line)
            _send(out, frame)


def _send(sock: socket.socket, frame: bytes) -> None:
    try:
        sock.send(frame)
    except OSError:
        pass  # a full queue or a downed link drops the frame, as a wire would


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        config = json.load(f)
    ports = [WirePort(p["host"], p["bridge"], float(p["delay_s"]),
                      {k: float(v) for k, v in p["delay_to"].items()})
             for p in config["ports"]]

    def ready() -> None:
        print("ready", flush=True)
    run(ports, ready, config.get("control"))


if __name__ == "__main__":
    main()

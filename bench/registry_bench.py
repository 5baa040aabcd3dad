"""Control-plane figures, all from one run against a registry in its own process.

    python bench/registry_bench.py [--engines 50] [--hb-members 100] [--interval 1.0]
                                   [--max-missed 3] [--json out.json]

1. join-to-visible: 50 engines join one after another (earlier ones keep heartbeating);
   time from an engine's registration request to an observer's watch seeing its join.
2. requests/s: lookups pipelined over 4 DEALER sockets (64 in flight each) for 2 s.
3. heartbeat CPU: 100 members heartbeating every ``interval`` s for 5 s; CPU seconds
   per second of the registry process and of the members' side, per 100 members.
4. peer death -> in-flight transfers failing: a peer process receiving 8 x 64 MiB
   writes is SIGKILLed (its sockets reset) or SIGSTOPped (hung: only the missed
   heartbeats reveal it); time until every in-flight handle has failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import threading
import time

import numpy as np
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.fleet import free_port, member, registry_process  # noqa: E402
from transfer_engine import Descriptor, Engine, PeerLostError  # noqa: E402
from transfer_engine.control.client import RegistryClient, RegistryStore  # noqa: E402
from transfer_engine.control.messages import Lookup, encode  # noqa: E402
from transfer_engine.control.metastore import MemberEvent, MemberRecord  # noqa: E402

MiB = 1 << 20


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


class TimedStore(RegistryStore):
    t0 = 0.0

    def put(self, record: MemberRecord, timeout: float | None = None) -> None:
        if not self.t0:
            self.t0 = time.monotonic()
        super().put(record, timeout)


def join_to_visible(address: str, n: int) -> dict[str, float]:
    seen: dict[str, float] = {}
    cond = threading.Condition()

    def on_event(ev: MemberEvent) -> None:
        with cond:
            seen.setdefault(ev.name, time.monotonic())
            cond.notify_all()

    lat = []
    engines: list[Engine] = []
    stores: list[TimedStore] = []
    with RegistryClient(address, name="observer") as obs:
        sub = obs.watch(on_event)
        time.sleep(0.3)
        try:
            for i in range(n):
                store = TimedStore(address, name=f"e{i}")
                stores.append(store)
                engines.append(Engine(f"e{i}", transports=["tcp"], registry=store))
                with cond:
                    cond.wait_for(functools.partial(seen.__contains__, f"e{i}"), 10)
                lat.append(seen[f"e{i}"] - store.t0)
        finally:
            sub.close()
            for e in engines:
                e.close()
            for s in stores:
                s.close()
    return {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "max_ms": max(lat) * 1e3, "samples": len(lat)}


def requests_per_second(address: str, duration: float = 2.0, sockets: int = 4,
                        window: int = 64) -> dict[str, float]:
    ctx = zmq.Context()
    socks = []
    req = encode(Lookup("target"))
    try:
        for _ in range(sockets):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            socks.append(s)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
            for _ in range(window):
                s.send(req)
        done = 0
        start = time.monotonic()
        end = start + duration
        while time.monotonic() < end:
            for s, _ in poller.poll(100):
                while True:
                    try:
                        s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    done += 1
                    s.send(req)
        elapsed = time.monotonic() - start
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    return {"requests_per_s": done / elapsed}


def heartbeat_cpu(address: str, registry_pid: int, members: int, interval: float,
                  seconds: float = 5.0) -> dict[str, float]:
    clients = [RegistryClient(address, name=f"hb{i}") for i in range(members)]
    try:
        for i, c in enumerate(clients):
            c.register(MemberRecord(f"hb{i}", f"inc{i}", "decode"))
        time.sleep(interval * 1.5)  # settle
        r0, c0, t0 = cpu_seconds(registry_pid), time.process_time(), time.monotonic()
        beats0 = sum(c.stats["heartbeats"] for c in clients)
        time.sleep(seconds)
        r1, c1, t1 = cpu_seconds(registry_pid), time.process_time(), time.monotonic()
        beats = sum(c.stats["heartbeats"] for c in clients) - beats0
    finally:
        for c in clients:
            try:
                c.leave(1.0)
            except Exception:  # noqa: BLE001 - best effort in a bench
                pass
            c.close()
    scale = 100 / members
    wall = t1 - t0
    return {"registry_cpu_pct_per_100": (r1 - r0) / wall * 100 * scale,
            "members_cpu_pct_per_100": (c1 - c0) / wall * 100 * scale,
            "heartbeats_per_s": beats / wall, "interval_s": interval}


def death_to_failure(address: str, how: signal.Signals, trials: int) -> dict[str, float]:
    out = []
    size = 64 * MiB
    src = np.ones(size, dtype=np.uint8)
    for t in range(trials):
        victim = member(f"victim{t}{how.name}", address, size=size)
        try:
            victim.expect("READY", 30)
            with Engine(f"killer{t}{how.name}", transports=["tcp"], registry=address) as a:
                peer = a.connect(f"victim{t}{how.name}")
                seg = a.register(src)
                pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
                handles = [a.write(peer, pairs) for _ in range(8)]
                victim.signal(how)
                died = time.monotonic()
                for h in handles:
                    try:
                        h.wait(30)
                    except PeerLostError:
                        pass
                out.append(time.monotonic() - died)
                assert any(h.error is not None for h in handles)
        finally:
            if how is signal.SIGSTOP:
                victim.signal(signal.SIGKILL)
            victim.stop()
    return {"median_ms": statistics.median(out) * 1e3, "max_ms": max(out) * 1e3,
            "trials": trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=50)
    ap.add_argument("--hb-members", type=int, default=100)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--max-missed", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    reg = registry_process(free_port(), args.interval, args.max_missed)
    try:
        address = reg.expect("REGISTRY", 30).split()[1]
        results = {
            "join_to_visible": join_to_visible(address, args.engines),
            "registry_requests": requests_per_second(address),
            "heartbeat_cpu": heartbeat_cpu(address, reg.proc.pid, args.hb_members,
                                           args.interval),
            "peer_killed_to_failure": death_to_failure(address, signal.SIGKILL, args.trials),
            "peer_hung_to_failure": death_to_failure(address, signal.SIGSTOP, args.trials),
        }
        results["config"] = {"interval_s": args.interval, "max_missed": args.max_missed,
                             "engines": args.engines, "hb_members": args.hb_members}
    finally:
        reg.stop()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

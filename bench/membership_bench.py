"""Join-to-visible latency of the two membership stores, side by side, at fleet size.

    python -m bench.membership_bench [--engines 1000] [--hosts 8] [--observers 4]
                                     [--hold 12] [--etcd-members 1] [--json out.json]

``--engines`` members join one after another; each is a real engine's record put through
a store of its own (its own etcd lease, or its own registry heartbeats), and the members
are spread over ``--hosts`` processes (:mod:`bench.member_host`), as a fleet's engines
live in processes of their own. ``--observers`` watches (a router's or scheduler's)
follow the membership; a join is visible once every observer has seen its ``JOIN``, and
its latency runs from the start of its ``put``. Once all are in, the fleet is held for
``--hold`` seconds: a member whose lease or heartbeats were not kept up meanwhile shows as
an ``EXPIRE`` (``expired``). Once against the embedded ZeroMQ registry (in its own
process, as deployed), once against a real etcd started here on loopback (a cluster with
``--etcd-members 3``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.etcd_server import etcd_cluster, etcd_skip_reason
from bench.fleet import Proc, free_port, registry_process
from transfer_engine.control.client import RegistryStore
from transfer_engine.control.etcd_store import EtcdStore
from transfer_engine.control.metastore import EventKind, MemberEvent, MetadataStore


class Observers:
    """``count`` watches; notes when each first saw each member join."""

    def __init__(self, make_store: Callable[[str], MetadataStore], count: int) -> None:
        self.cond = threading.Condition()
        self.seen: list[dict[str, float]] = [{} for _ in range(count)]
        self.expired: list[str] = []
        self.stores = [make_store(f"observer-{k}") for k in range(count)]
        self.subs = [store.watch(self._on_event(k)) for k, store in enumerate(self.stores)]

    def _on_event(self, k: int) -> Callable[[MemberEvent], None]:
        def on_event(ev: MemberEvent) -> None:
            now = time.monotonic()
            with self.cond:
                if ev.kind is EventKind.JOIN:
                    self.seen[k].setdefault(ev.name, now)
                elif ev.kind is EventKind.EXPIRE:
                    self.expired.append(ev.name)
                self.cond.notify_all()
        return on_event

    def visible(self, name: str, timeout: float) -> float:
        """When the last observer saw ``name`` join."""
        with self.cond:
            if not self.cond.wait_for(lambda: all(name in s for s in self.seen), timeout):
                raise TimeoutError(f"{name} not visible to every observer in {timeout}s")
            return max(s[name] for s in self.seen)

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        for store in self.stores:
            store.close()


def join_to_visible(registry: str, make_store: Callable[[str], MetadataStore],
                    engines: int, hosts: int = 8, observers: int = 4, hold: float = 0.0,
                    ttl: float = 10.0) -> dict[str, float | int]:
    watch = Observers(make_store, observers)
    procs = [Proc(["-m", "bench.member_host", registry, str(ttl)])
             for _ in range(min(hosts, engines))]
    lat: list[float] = []
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        for i in range(engines):
            name = f"e{i}"
            proc = procs[i % len(procs)]
            assert proc.proc.stdin is not None
            proc.proc.stdin.write(f"JOIN {name}\n")
            proc.proc.stdin.flush()
            started = float(proc.expect(f"PUT {name} ", 60).split()[2])
            lat.append(watch.visible(name, 10) - started)
        joined = time.monotonic() - t0
        time.sleep(hold)
    finally:
        for proc in procs:
            proc.stop(60)
        watch.close()
    a = np.array(lat) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "samples": len(lat), "join_seconds": joined,
            "expired": len(watch.expired)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--hosts", type=int, default=8, help="processes holding the members")
    ap.add_argument("--observers", type=int, default=4)
    ap.add_argument("--hold", type=float, default=12.0,
                    help="seconds the whole fleet stays in before leaving")
    ap.add_argument("--ttl", type=float, default=10.0, help="etcd lease, seconds")
    ap.add_argument("--etcd-members", type=int, default=1,
                    help="etcd members (3: a cluster; requests go to any of them)")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="registry heartbeat interval, seconds")
    ap.add_argument("--json")
    args = ap.parse_args()
    results: dict[str, object] = {"engines": args.engines, "hosts": args.hosts,
                                  "observers": args.observers, "hold_s": args.hold}
    # every member here comes from 127.0.0.1; a fleet's come from hosts of their own, so
    # the registry's per-source join limit is lifted
    reg = registry_process(free_port(), args.interval, 3, "--join-rate", "0")
    try:
        address = reg.expect("REGISTRY", 30).split()[1]
        results["zmq_registry"] = join_to_visible(
            address, lambda name: RegistryStore(address, name=name, timeout=10),
            args.engines, args.hosts, args.observers, args.hold)
    finally:
        reg.stop()
    reason = etcd_skip_reason()
    if reason:
        results["etcd"] = {"skipped": reason}
    else:
        with (tempfile.TemporaryDirectory() as tmp,
              etcd_cluster(Path(tmp), args.etcd_members) as cluster):
            etcd = cluster.address
            results["etcd_members"] = args.etcd_members
            results["etcd"] = join_to_visible(
                etcd, lambda name: EtcdStore(etcd, name=name, ttl=args.ttl, timeout=10),
                args.engines, args.hosts, args.observers, args.hold, args.ttl)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()

"""Join-to-visible latency of the two membership stores, side by side.

    python -m bench.membership_bench [--engines 50] [--json out.json]

N engines join one after another (the earlier ones stay, renewing their records); for
each, the time from the start of its record's ``put`` to an observer's watch seeing its
``JOIN``. Once against the embedded ZeroMQ registry (in its own process, as deployed),
once against a real etcd (started here on loopback, in a temporary folder).
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

from bench.etcd_server import etcd_server, etcd_skip_reason
from bench.fleet import free_port, registry_process
from transfer_engine import Engine
from transfer_engine.control.client import RegistryStore
from transfer_engine.control.etcd_store import EtcdStore
from transfer_engine.control.metastore import MemberEvent, MemberRecord, MetadataStore


def _timed(store: MetadataStore) -> tuple[MetadataStore, list[float]]:
    """Wraps ``store.put`` to note when the first put began."""
    started: list[float] = []
    put = store.put

    def timed_put(record: MemberRecord, timeout: float | None = None) -> None:
        if not started:
            started.append(time.monotonic())
        put(record, timeout)
    store.put = timed_put  # type: ignore[method-assign]
    return store, started


def join_to_visible(make_store: Callable[[str], MetadataStore], n: int
                    ) -> dict[str, float]:
    seen: dict[str, float] = {}
    cond = threading.Condition()

    def on_event(ev: MemberEvent) -> None:
        with cond:
            seen.setdefault(ev.name, time.monotonic())
            cond.notify_all()

    lat: list[float] = []
    engines: list[Engine] = []
    stores: list[MetadataStore] = []
    observer = make_store("observer")
    sub = observer.watch(on_event)
    try:
        time.sleep(0.3)
        for i in range(n):
            store, started = _timed(make_store(f"e{i}"))
            stores.append(store)
            engines.append(Engine(f"e{i}", transports=["tcp"], registry=store))
            with cond:
                if not cond.wait_for(lambda i=i: f"e{i}" in seen, 10):  # type: ignore[misc]
                    raise TimeoutError(f"e{i} not visible after 10 s")
            lat.append(seen[f"e{i}"] - started[0])
    finally:
        sub.close()
        for e in engines:
            e.close()
        for s in stores + [observer]:
            s.close()
    a = np.array(lat) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "samples": len(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    results: dict[str, object] = {"engines": args.engines}
    reg = registry_process(free_port(), 1.0, 3)
    try:
        address = reg.expect("REGISTRY", 30).split()[1]
        results["zmq_registry"] = join_to_visible(
            lambda name: RegistryStore(address, name=name), args.engines)
    finally:
        reg.stop()
    reason = etcd_skip_reason()
    if reason:
        results["etcd"] = {"skipped": reason}
    else:
        with tempfile.TemporaryDirectory() as tmp, etcd_server(Path(tmp)) as etcd:
            results["etcd"] = join_to_visible(
                lambda name: EtcdStore(etcd, name=name), args.engines)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()

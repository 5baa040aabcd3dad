"""Many members' records held by one process, for the membership bench: each member has
a store of its own (its own lease or heartbeats), as its engine would.

Usage: python -m bench.member_host REGISTRY [TTL]
Reads commands on stdin: ``JOIN NAME`` puts NAME's record and answers
``PUT NAME <monotonic start of the put>``; ``LEAVE NAME`` takes it out (``LEFT NAME``).
At end of input every member still in leaves, and the process exits.

The record is a real engine's (its transports and four registered segments), renamed.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from transfer_engine import Engine
from transfer_engine.control.client import RegistryStore
from transfer_engine.control.etcd_client import ETCD_SCHEME
from transfer_engine.control.etcd_store import EtcdStore
from transfer_engine.control.metastore import MemberRecord, MetadataStore


def template() -> MemberRecord:
    """What an engine with a tcp transport and four segments publishes."""
    bufs = [np.ones(1 << 16, dtype=np.uint8) for _ in range(4)]
    with Engine("template", transports=["tcp"]) as engine:
        for i, buf in enumerate(bufs):
            engine.register(buf, name=f"kv{i}")
        meta = engine.metadata()
        return MemberRecord("template", engine.incarnation, "decode", meta["hostname"],
                            "pod-0", "zone-0", engine.endpoint, meta["transports"], [],
                            meta["segments"])


def store_for(registry: str, name: str, ttl: float) -> MetadataStore:
    if registry.startswith(ETCD_SCHEME):
        return EtcdStore(registry, name=name, ttl=ttl, timeout=10)
    return RegistryStore(registry, name=name, timeout=10)


def main() -> None:
    registry = sys.argv[1]
    ttl = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    base = template()
    stores: dict[str, MetadataStore] = {}
    try:
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            if command == "JOIN" and name not in stores:
                store = stores[name] = store_for(registry, name, ttl)
                started = time.monotonic()
                store.put(dataclasses.replace(base, name=name, incarnation=f"{name}-1"))
                print(f"PUT {name} {started!r}", flush=True)
            elif command == "LEAVE" and name in stores:
                store = stores.pop(name)
                store.delete(name)
                store.close()
                print(f"LEFT {name}", flush=True)
    finally:
        for name, store in stores.items():
            store.delete(name)
            store.close()


if __name__ == "__main__":
    main()

"""Mooncake Store client processes for :mod:`bench.store_bench` (needs Mooncake's wheel).

    python -m bench.mooncake_store_peer segment --master 127.0.0.1:PORT --segment-size N
    python -m bench.mooncake_store_peer client --master 127.0.0.1:PORT --value-size N \
        --batch N --sets N --duration S

``segment`` is a Mooncake client that lends ``--segment-size`` bytes of DRAM to the pool
and holds nothing else; it prints ``mooncake-segment ready`` and serves until SIGTERM.
``client`` lends nothing, so every value it puts or gets crosses the TCP transport to the
segment process (a Mooncake client that holds the replica copies locally instead). It
puts ``--sets`` batches of ``--batch`` random values of ``--value-size`` bytes from one
registered buffer (``batch_put_from``), checks a get (``batch_get_into`` into another
registered buffer) returns the same bytes, then times, as the bench times its own store,
``batch_upsert_from`` (a re-put of a stored key in Mooncake skips the transfer; upsert
writes the value, as a put over a stored key does in ours) and ``batch_get_into`` over
the same keys, checks the bytes again, removes the keys, and prints one line
``mooncake-result {json}``: ``put_gbps``, ``get_gbps``, ``get_p50_us``, ``get_p99_us``.
Both use the P2P handshake (no metadata server) and ``protocol="tcp"`` on 127.0.0.1.
They run under the interpreter of Mooncake's environment (``--mooncake-python``), which
needs numpy besides the wheel, and import nothing of this project but ``bench.stats``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

# Mooncake logs through glog: keep its INFO and WARNING lines out of the bench's output.
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402

from bench.stats import fill_random, percentile, timed_calls  # noqa: E402

LOCAL_BUFFER = 16 << 20


def _store(master: str, segment_size: int) -> Any:
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found,unused-ignore]

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_size, LOCAL_BUFFER, "tcp", "",
                     master)
    if rc != 0:
        raise SystemExit(f"mooncake-error setup returned {rc}")
    return store


def segment(args: argparse.Namespace) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = _store(args.master, args.segment_size)
    try:
        print("mooncake-segment ready", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        store.close()


def client(args: argparse.Namespace) -> None:
    size, batch, sets = args.value_size, args.batch, args.sets
    src = np.empty(size * batch, dtype=np.uint8)
    fill_random(src, args.seed)
    dst = np.empty_like(src)
    dst.fill(1)
    store = _store(args.master, 0)
    try:
        for buf in (src, dst):
            rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise SystemExit(f"mooncake-error register_buffer returned {rc}")
        keys = [[f"bench-{s}-{j}" for j in range(batch)] for s in range(sets)]
        srcs = [src.ctypes.data + j * size for j in range(batch)]
        dsts = [dst.ctypes.data + j * size for j in range(batch)]
        sizes = [size] * batch

        def check(op: str, codes: list[int], want: int) -> None:
            bad = [c for c in codes if c != want]
            if bad:
                raise SystemExit(f"mooncake-error {op}: {len(bad)} of {len(codes)} keys "
                                 f"failed (codes {sorted(set(bad))})")

        def put(i: int) -> None:
            check("batch_upsert_from",
                  store.batch_upsert_from(keys[i % sets], srcs, sizes), 0)

        def get(i: int) -> None:
            check("batch_get_into", store.batch_get_into(keys[i % sets], dsts, sizes), size)

        def verify() -> None:
            if not np.array_equal(dst, src):
                raise SystemExit("mooncake-error a get returned other bytes than put")
            dst.fill(1)

        for s in range(sets):  # every key stored once before timing
            check("batch_put_from", store.batch_put_from(keys[s], srcs, sizes), 0)
        get(0)
        verify()
        calls, _ = timed_calls(put, args.duration)
        out: dict[str, Any] = {"put_gbps": calls * batch * size / args.duration / 1e9}
        calls, lat = timed_calls(get, args.duration)
        out["get_gbps"] = calls * batch * size / sum(lat) / 1e9
        out["get_p50_us"] = percentile(lat, 50) * 1e6
        out["get_p99_us"] = percentile(lat, 99) * 1e6
        get(1)
        verify()
        for s in range(sets):
            store.batch_remove(keys[s], True)
        print("mooncake-result " + json.dumps(out), flush=True)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mooncake_store_peer", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    seg = sub.add_parser("segment")
    seg.add_argument("--master", required=True)
    seg.add_argument("--segment-size", type=int, required=True)
    cli = sub.add_parser("client")
    cli.add_argument("--master", required=True)
    cli.add_argument("--value-size", type=int, required=True)
    cli.add_argument("--batch", type=int, required=True)
    cli.add_argument("--sets", type=int, required=True)
    cli.add_argument("--duration", type=float, required=True)
    cli.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    segment(args) if args.role == "segment" else client(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

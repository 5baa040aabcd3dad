"""KV store benchmark: batch lookups against a dict, cuckoo load limit, arena waste.

    python -m bench.kvstore_bench --keys 1000000 10000000 --json results/kvstore.json

For each ``--keys`` N: fill a store with N keys, time ``KVStore.lookup`` on batches of
``--batch`` keys (half hits, half misses, shuffled; full-key confirmation and the expiry
check included) and a Python dict answering the same batches (``map(dict.get, batch)``
over pre-built lists of ints: the dict's best case). Then, once per run: the load factor
of a cuckoo index at its first failed insert, and the arena's waste after a churn of
``--churn-factor`` times its capacity with mixed value sizes under eviction. The process
is pinned to one CPU where the OS allows it. Top-level JSON fields describe the largest N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore import CapacityError, CuckooIndex, KVStore

MIB = 1 << 20


def _pin_one_cpu() -> int | None:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        return cpus[-1]
    except (AttributeError, OSError):
        return None


def _unique_keys(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint64]:
    keys = np.unique(rng.integers(0, 2**64, size=n + n // 50 + 16, dtype=np.uint64))
    rng.shuffle(keys)
    return keys[:n]


def _timed(fn: Any, batches: list[Any], seconds: float) -> tuple[float, int]:
    """Runs ``fn`` over the batches, round after round, for at least ``seconds``."""
    fn(batches[0])  # warm
    done = 0
    t0 = time.perf_counter()
    while True:
        for b in batches:
            fn(b)
            done += len(b)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return done / elapsed, done


def bench_lookups(
    n: int, batch: int, value_bytes: int, seconds: float, seed: int
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    keys = _unique_keys(rng, n)
    record = (24 + value_bytes + 7) & ~7
    slab = 4 * MIB
    capacity = (n * record * 21 // 20 // slab + 2) * slab
    out: dict[str, Any] = {"keys": n, "batch": batch, "value_bytes": value_bytes}
    with KVStore(capacity, slab_bytes=slab, max_entries=n, evict=False) as store:
        t0 = time.perf_counter()
        chunk = 1 << 20
        for i in range(0, n, chunk):
            part = keys[i : i + chunk]
            values = rng.integers(0, 256, size=(part.size, value_bytes), dtype=np.uint8)
            store.batch_put(part, values)
        out["build_s"] = round(time.perf_counter() - t0, 2)
        out["index_load_factor"] = round(store.index.load_factor, 4)
        out["index_stash"] = store.index.stash_count

        nb = 64
        hits = keys[rng.integers(0, n, size=nb * batch // 2)]
        misses = rng.integers(0, 2**64, size=nb * batch - hits.size, dtype=np.uint64)
        misses = misses[~np.isin(misses, keys)]
        mixed = np.concatenate((hits, misses))
        expect_hits = hits.size
        perm = rng.permutation(mixed.size)
        mixed = mixed[perm]
        batches = [mixed[i : i + batch] for i in range(0, mixed.size - batch + 1, batch)]
        found = sum(int((store.lookup(b) >= 0).sum()) for b in batches)
        tail = mixed.size - len(batches) * batch
        if tail:
            found += int((store.lookup(mixed[-tail:]) >= 0).sum())
        assert found == expect_hits, f"lookup found {found} of {expect_hits} hits"
        out["lookups_per_s"], out["lookups_timed"] = _timed(store.lookup, batches, seconds)
        out["batch_get_per_s"], _ = _timed(store.batch_get, batches[:8], seconds / 3)

        d = dict(zip(keys.tolist(), range(n), strict=True))
        lists = [b.tolist() for b in batches]
        got = sum(sum(x is not None for x in map(d.get, b)) for b in lists)
        assert got == found - (int((store.lookup(mixed[-tail:]) >= 0).sum()) if tail else 0)
        out["dict_lookups_per_s"], _ = _timed(lambda b: list(map(d.get, b)), lists, seconds)
    out["speedup_vs_dict"] = round(out["lookups_per_s"] / out["dict_lookups_per_s"], 2)
    for k in ("lookups_per_s", "batch_get_per_s", "dict_lookups_per_s"):
        out[k] = round(out[k])
    return out


def bench_max_load(num_buckets: int, seed: int) -> dict[str, Any]:
    """Fills an index (locations stand in for records) until the first failed insert."""
    rng = np.random.default_rng(seed + 1)
    slots = num_buckets * 12
    keys = _unique_keys(rng, slots + 64)
    table = keys[:, None]
    index = CuckooIndex(num_buckets, lambda locs: table[locs], stash_size=16)
    t0 = time.perf_counter()
    n = 0
    step = int(slots * 0.85)
    while True:
        try:
            index.insert(keys[n : n + step], np.arange(n, n + step))
            n += step
            step = max(1, (slots - n) // 4)
        except CapacityError:
            if step == 1:
                break
            step = 1  # the batch was rolled back; go on key by key
    load = n / slots
    assert index.lookup(keys[:n]).tolist() == list(range(n)), "entries lost at capacity"
    return {
        "max_load_factor": round(load, 4),
        "slots": slots,
        "stash_used": index.stash_count,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def bench_churn(capacity_mib: int, factor: float, seed: int) -> dict[str, Any]:
    """Puts (and some deletes and gets) of log-uniform 256 B..64 KiB values, with CLOCK
    eviction, until ``factor`` x capacity bytes were written."""
    rng = np.random.default_rng(seed + 2)
    capacity = capacity_mib * MIB
    pool = rng.integers(0, 256, size=256 * 1024, dtype=np.uint8)
    sizes = np.exp(rng.uniform(np.log(256), np.log(64 * 1024), size=1 << 20)).astype(np.int64)
    avg = float(sizes.mean())
    key_space = int(2 * capacity / avg)
    written = 0
    ops = 0
    t0 = time.perf_counter()
    with KVStore(capacity, slab_bytes=MIB, max_entries=4 * key_space) as store:
        while written < factor * capacity:
            r = rng.random()
            k = int(rng.integers(0, key_space))
            if r < 0.8:
                size = int(sizes[ops % sizes.size])
                start = int(rng.integers(0, pool.size - size))
                store.put(k, pool[start : start + size])
                written += size
            elif r < 0.9:
                store.delete(k)
            else:
                store.get(k)
            ops += 1
        stats = store.stats()
        store.compact()
        after = store.stats()
    return {
        "arena_waste": round(stats.waste, 4),
        "arena_waste_after_compact": round(after.waste, 4),
        "arena_utilisation": round(1 - stats.waste, 4),
        "capacity_bytes": capacity,
        "bytes_written": written,
        "operations": ops,
        "entries": stats.entries,
        "evictions": stats.evictions,
        "compactions": stats.compactions,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--keys", type=int, nargs="+", default=[1_000_000], help="keys stored (one run each)"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--batch", type=int, default=4096, help="keys per lookup batch")
    p.add_argument("--value-bytes", type=int, default=16, help="value size for the lookup runs")
    p.add_argument("--seconds", type=float, default=3.0, help="time per measured loop")
    p.add_argument(
        "--load-buckets", type=int, default=1 << 14, help="buckets of the max-load table"
    )
    p.add_argument("--churn-mib", type=int, default=64, help="arena size for the churn test")
    p.add_argument("--churn-factor", type=float, default=10.0, help="bytes written / capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    args = p.parse_args(argv)

    cpu = None if args.no_pin else _pin_one_cpu()
    runs = []
    for n in sorted(args.keys):
        res = bench_lookups(n, args.batch, args.value_bytes, args.seconds, args.seed)
        print(json.dumps(res), flush=True)
        runs.append(res)
    max_load = bench_max_load(args.load_buckets, args.seed)
    print(json.dumps({"max_load": max_load}), flush=True)
    churn = bench_churn(args.churn_mib, args.churn_factor, args.seed)
    print(json.dumps({"churn": churn}), flush=True)
    top = runs[-1]
    result = {
        "keys": top["keys"],
        "lookups_per_s": top["lookups_per_s"],
        "dict_lookups_per_s": top["dict_lookups_per_s"],
        "speedup_vs_dict": top["speedup_vs_dict"],
        "max_load_factor": max_load["max_load_factor"],
        "arena_waste": churn["arena_waste"],
        "runs": runs,
        "max_load": max_load,
        "churn": churn,
        "env": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpu_pinned": cpu,
            "argv": sys.argv[1:] if argv is None else argv,
        },
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in list(result)[:6]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
